// Gemv: y(1, n) = x(1, k) · w(n, k)ᵀ, the GEMMs of a decode step at batch 1. There every weight
// byte is read once and used for one FMA, so the time is weight bytes over read bandwidth; the
// kernel is built for that:
//   * one block of kThreads threads per kCols consecutive output columns; the threads split k,
//     8 elements per 16-byte load, so every warp reads 512 contiguous bytes of each of its
//     kCols weight rows per step;
//   * kUnroll steps unrolled: kUnroll · kCols independent 16-byte weight loads in flight per
//     thread before the first FMA; x (a few KB, L1/L2 resident) through the read-only path;
//   * fp32 FMAs, then a shuffle reduction in each warp and one through shared memory across the
//     block's warps, in a fixed order (results are deterministic).
// Measured on an H100 (docs/benchmarks.md, "Linear layers alone"): 94–99% of the read roofline
// where cuBLAS reaches 84–93%. Two rows and more stay with cuBLAS: this kernel's FMAs (and a
// tensor-core variant's scattered 64-byte row pieces) fell behind it there.
// Needs k % 8 == 0 and 16-byte aligned x and w (GemvSupports).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 4;
constexpr int kUnroll = 2;

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Dot of 8 bf16 pairs (two uint4) in fp32, added to acc.
__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b, float acc) {
  const uint32_t av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc = fmaf(__uint_as_float(av[i] << 16), __uint_as_float(bv[i] << 16), acc);
    acc = fmaf(__uint_as_float(av[i] & 0xffff0000u), __uint_as_float(bv[i] & 0xffff0000u), acc);
  }
  return acc;
}

__global__ void __launch_bounds__(kThreads)
    GemvKernel(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, void* __restrict__ y,
               int64_t n, int64_t k, bool y_fp32, bool accumulate) {
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kCols;
  // Columns past n (the last block) re-read column n-1 and are not written.
  const uint4* wrow[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    const int64_t col = col0 + c < n ? col0 + c : n - 1;
    wrow[c] = reinterpret_cast<const uint4*>(w + col * k);
  }
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float acc[kCols] = {};
  const int64_t k8 = k / 8;  // 16-byte chunks per row
  for (int64_t base = threadIdx.x; base < k8; base += int64_t{kThreads} * kUnroll) {
    uint4 wv[kUnroll][kCols];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * kThreads;
#pragma unroll
      for (int c = 0; c < kCols; ++c) wv[u][c] = i < k8 ? __ldg(wrow[c] + i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t{u} * kThreads;
      if (i >= k8) break;
      const uint4 xv = __ldg(x4 + i);
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[c] = Dot8(xv, wv[u][c], acc[c]);
    }
  }

  __shared__ float partial[kWarps][kCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int c = 0; c < kCols; ++c) {
    float v = acc[c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[warp][c] = v;
  }
  __syncthreads();
  if (threadIdx.x < kCols) {
    const int c = threadIdx.x;
    const int64_t col = col0 + c;
    if (col < n) {
      float v = 0.0f;
#pragma unroll
      for (int i = 0; i < kWarps; ++i) v += partial[i][c];
      if (y_fp32) {
        float* out = static_cast<float*>(y) + col;
        *out = accumulate ? *out + v : v;
      } else {
        static_cast<__nv_bfloat16*>(y)[col] = __float2bfloat16_rn(v);
      }
    }
  }
}

}  // namespace

bool GemvSupports(const GemmParams& p) {
  return p.m == 1 && p.n >= 1 && p.k >= 8 && p.k % 8 == 0 &&
         (p.n + kCols - 1) / kCols <= int64_t{0x7fffffff} && Aligned16(p.x) && Aligned16(p.w) &&
         p.y != nullptr && (!p.accumulate || p.y_fp32);
}

absl::Status Gemv(const GemmParams& p, cudaStream_t stream) {
  if (!p.x || !p.w || !p.y) return absl::InvalidArgumentError("Gemv: null pointer");
  if (!GemvSupports(p)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemv: unsupported shape or alignment (m=", p.m, " n=", p.n, " k=", p.k,
                     "; needs m = 1, k a multiple of 8, 16-byte aligned x and w, "
                     "and an fp32 y to accumulate into)"));
  }
  const auto blocks = static_cast<unsigned>((p.n + kCols - 1) / kCols);
  GemvKernel<<<blocks, kThreads, 0, stream>>>(p.x, p.w, p.y, p.n, p.k, p.y_fp32, p.accumulate);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
