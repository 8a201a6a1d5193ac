// The wgmma prefill-attention kernel (kernels/cuda/prefill_attention_sm90.cu), behind
// PrefillAttention (ops.h), which validates the parameters before either function sees them.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {

// Whether PrefillAttentionSm90 can run p on the current device: head_dim 128, max_q_len > 64 (shorter
// chunks keep the mma.sync kernel's 64-row tiles), a compute capability 9.0 device, and sm_90a
// code for it in this build.
bool PrefillAttentionSm90Supported(const AttentionParams& p);

// Runs p (validated, PrefillAttentionSm90Supported(p)) on `stream`.
absl::Status PrefillAttentionSm90(const AttentionParams& p, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
