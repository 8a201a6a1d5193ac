// bf16 GEMMs for the CUDA backend: y(m, n) = x(m, k) · w(n, k)ᵀ, with w in the Hugging Face
// (out, in) layout, fp32 accumulation, and y either bf16 or fp32 (fp32 with accumulate = true adds
// into the residual stream: the residual add is fused into the GEMM). One row (decode at batch 1)
// goes to tandem's bandwidth-bound Gemv, the rest to cuBLAS.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace tandem::kernels::cuda {

struct GemmParams {
  const __nv_bfloat16* x = nullptr;  // (m, k), row stride x_stride (0: k)
  const __nv_bfloat16* w = nullptr;  // (n, k)
  void* y = nullptr;                 // (m, n), row stride y_stride (0: n)
  bool y_fp32 = false;               // y is float (else bf16)
  bool accumulate = false;           // y += (fp32 only)
  int64_t m = 0, n = 0, k = 0;
  int64_t x_stride = 0, y_stride = 0;
};

// True when Gemv can run p: m = 1, k a multiple of 8, x and w 16-byte aligned, and an fp32 y
// where it accumulates.
bool GemvSupports(const GemmParams& p);

// The one-row GEMM (kernels/cuda/gemv.cu): every weight byte read once with 16-byte loads, fp32
// accumulation in a fixed order (deterministic). InvalidArgument where !GemvSupports.
absl::Status Gemv(const GemmParams& p, cudaStream_t stream);

// One cuBLAS handle bound to a stream, with a workspace of its own (kWorkspaceBytes), so that
// split-K algorithms allocate nothing while a CUDA graph is being captured. Not thread-safe; one
// per executor.
class CublasGemm {
 public:
  static absl::StatusOr<std::unique_ptr<CublasGemm>> Create(cudaStream_t stream);
  ~CublasGemm();
  CublasGemm(const CublasGemm&) = delete;
  CublasGemm& operator=(const CublasGemm&) = delete;
  // Gemv where it supports p (and gemv() is on), cuBLAS otherwise.
  absl::Status Run(const GemmParams& p);
  // cuBLAS only (the benchmarks compare the two).
  absl::Status RunCublas(const GemmParams& p);
  // Whether Run uses Gemv for one-row products (on by default).
  void set_gemv(bool on) { gemv_ = on; }
  bool gemv() const { return gemv_; }

 private:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // cuBLAS's default on Hopper
  CublasGemm() = default;
  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* workspace_ = nullptr;
  bool gemv_ = true;
};

}  // namespace tandem::kernels::cuda
