// What the two prefill-attention kernels (prefill_attention.cu: mma.sync; prefill_attention_sm90.cu:
// wgmma) share on the host: their arguments and their grid. Internal to kernels/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {

struct PrefillKernelArgs {
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  bf16* out;
  float* lse;
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_slots;
  int64_t num_slots;
  int num_heads, num_kv_heads;
  float scale, scale_log2;
};

inline PrefillKernelArgs MakePrefillKernelArgs(const AttentionParams& p) {
  PrefillKernelArgs a;
  a.q = p.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.out = p.out;
  a.lse = p.lse;
  a.q_indptr = p.q_indptr;
  a.kv_indptr = p.kv_indptr;
  a.kv_slots = p.kv_slots;
  a.num_slots = p.num_slots;
  a.num_heads = static_cast<int>(p.num_heads);
  a.num_kv_heads = static_cast<int>(p.num_kv_heads);
  a.scale = p.scale;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  return a;
}

// The grid of CTAs (num_heads · num_requests, ceil(max_q_len / block_m)): x is (request, head),
// y the tile of block_m rows. InvalidArgument where it exceeds CUDA's grid limits.
inline absl::StatusOr<dim3> PrefillGrid(const AttentionParams& p, int block_m) {
  const int64_t m_tiles = (p.max_q_len + block_m - 1) / block_m;
  if (m_tiles > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("PrefillAttention: max_q_len ", p.max_q_len,
                                                   " needs more than 65535 tiles of ", block_m, " rows"));
  }
  const int64_t ctas_x = p.num_heads * p.num_requests;
  if (ctas_x > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefillAttention: num_heads * num_requests = ", ctas_x, " exceeds the grid limit"));
  }
  return dim3(static_cast<unsigned>(ctas_x), static_cast<unsigned>(m_tiles));
}

}  // namespace tandem::kernels::cuda
