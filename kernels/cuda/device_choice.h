// Which device a rank or engine runs on: a device setting ("cpu", "cuda", "cuda:N", "auto")
// resolved against the visible GPUs and what the CUDA kernels support. Works in every build
// (without the CUDA backend, "auto" is the CPU).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace tandem::kernels {

// Empty if the CUDA attention kernels support `head_dim` (64 or 128), else why not.
std::string CudaAttentionUnsupported(int64_t head_dim);

// "cpu" -> -1; "cuda" -> 0; "cuda:N" -> N; "auto" -> 0 if a CUDA device is present and the CUDA
// kernels support the model, else -1 (with a warning when a GPU is present but unsupported).
// InvalidArgument naming runtime.device for anything else; callers with another key re-annotate.
absl::StatusOr<int> ResolveDevice(const std::string& device, const ModelSpec& spec);

}  // namespace tandem::kernels
