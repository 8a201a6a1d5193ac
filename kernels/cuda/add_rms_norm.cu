// AddRmsNorm: residual(fp32) += delta(bf16), then out = bf16(residual * rsqrt(mean(residual²) + eps)
// * weight). One thread block per row; each thread keeps its first chunks of the row in registers
// between the sum of squares and the scaling (longer rows re-read their own residual writes).
// Chunks are 8 elements (16-byte bf16 / 32-byte fp32 accesses) when sizes and pointers allow.
//
// Rounding matches the CPU reference as closely as cheaply possible: the sum of squares is
// accumulated in double (so the fp32 mean is the correctly rounded one, as on the CPU), the
// inverse root is rounded once from double, and out = weight * (x * inv) is evaluated with
// explicit round-to-nearest products (no FMA contraction).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kRegChunks = 4;     // chunks per thread held in registers
constexpr int kMaxThreads = 512;  // registers: up to 128 per thread for the row cache
constexpr int64_t kMaxGrid = int64_t{1} << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("AddRmsNorm: ", what));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ uint32_t Pack(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x = a (low half), .y = b
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <int kV>
__device__ __forceinline__ void LoadF32(const float* p, float (&v)[kV]) {
  if constexpr (kV == 8) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    v[0] = *p;
  }
}
template <int kV>
__device__ __forceinline__ void StoreF32(float* p, const float (&v)[kV]) {
  if constexpr (kV == 8) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *p = v[0];
  }
}
template <int kV>
__device__ __forceinline__ void LoadBf16(const bf16* p, float (&v)[kV]) {
  if constexpr (kV == 8) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    v[0] = Lo(w.x), v[1] = Hi(w.x), v[2] = Lo(w.y), v[3] = Hi(w.y);
    v[4] = Lo(w.z), v[5] = Hi(w.z), v[6] = Lo(w.w), v[7] = Hi(w.w);
  } else {
    v[0] = __bfloat162float(*p);
  }
}
template <int kV>
__device__ __forceinline__ void StoreBf16(bf16* p, const float (&v)[kV]) {
  if constexpr (kV == 8) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(Pack(v[0], v[1]), Pack(v[2], v[3]), Pack(v[4], v[5]), Pack(v[6], v[7]));
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}

// Sum over the block, the same value in every thread. `scratch` holds one double per warp.
__device__ __forceinline__ double BlockSum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next row
  return total;
}

// Rows j in [0, rows): source row src = out_rows ? out_rows[j] : j, output row j. With delta,
// residual(src) += delta(src) first (only used without out_rows, where src == j is unique).
// Sources outside [0, n) produce a zero output row.
template <int kV>
__global__ void __launch_bounds__(kMaxThreads)
    AddRmsNormKernel(float* __restrict__ residual, const bf16* __restrict__ delta,
                     const bf16* __restrict__ weight, bf16* __restrict__ out,
                     const int32_t* __restrict__ out_rows, int64_t rows, int64_t n, int64_t d, float eps) {
  __shared__ double scratch[kMaxThreads / 32];
  const int64_t chunks = d / kV;
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const int64_t src = out_rows != nullptr ? static_cast<int64_t>(out_rows[j]) : j;
    bf16* o = out + j * d;
    if (src < 0 || src >= n) {  // block-uniform
      const float zero[kV] = {};
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) StoreBf16<kV>(o + c * kV, zero);
      continue;
    }
    float* r = residual + src * d;
    const bf16* dl = delta != nullptr ? delta + src * d : nullptr;

    // Pass 1: add, write back, sum of squares; the first kRegChunks chunks stay in registers.
    auto add_chunk = [&](int64_t c, float(&x)[kV]) {
      LoadF32<kV>(r + c * kV, x);
      if (dl != nullptr) {
        float y[kV];
        LoadBf16<kV>(dl + c * kV, y);
#pragma unroll
        for (int e = 0; e < kV; ++e) x[e] = __fadd_rn(x[e], y[e]);
        StoreF32<kV>(r + c * kV, x);
      }
      double s = 0.0;
#pragma unroll
      for (int e = 0; e < kV; ++e) s += static_cast<double>(x[e]) * static_cast<double>(x[e]);
      return s;
    };
    float cache[kRegChunks][kV];
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < chunks) ss += add_chunk(c, cache[k]);
    }
    for (int64_t c = threadIdx.x + static_cast<int64_t>(kRegChunks) * blockDim.x; c < chunks;
         c += blockDim.x) {
      float x[kV];
      ss += add_chunk(c, x);
    }
    ss = BlockSum(ss, scratch);
    // As the CPU reference: variance rounded to fp32, + eps in fp32, 1/sqrt rounded once.
    const float var = static_cast<float>(ss / static_cast<double>(d));
    const float inv = static_cast<float>(1.0 / sqrt(static_cast<double>(__fadd_rn(var, eps))));

    // Pass 2: out = weight * (x * inv).
    auto scale_chunk = [&](int64_t c, float(&x)[kV]) {
      float w[kV];
      LoadBf16<kV>(weight + c * kV, w);
#pragma unroll
      for (int e = 0; e < kV; ++e) x[e] = __fmul_rn(w[e], __fmul_rn(x[e], inv));
      StoreBf16<kV>(o + c * kV, x);
    };
#pragma unroll
    for (int k = 0; k < kRegChunks; ++k) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
      if (c < chunks) scale_chunk(c, cache[k]);
    }
    for (int64_t c = threadIdx.x + static_cast<int64_t>(kRegChunks) * blockDim.x; c < chunks;
         c += blockDim.x) {
      float x[kV];
      LoadF32<kV>(r + c * kV, x);  // this thread's own write in pass 1
      scale_chunk(c, x);
    }
  }
}

// residual(n, d) += delta(n, d), elementwise (before a gathered normalisation).
template <int kV>
__global__ void AddKernel(float* __restrict__ residual, const bf16* __restrict__ delta, int64_t chunks) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float x[kV], y[kV];
    LoadF32<kV>(residual + c * kV, x);
    LoadBf16<kV>(delta + c * kV, y);
#pragma unroll
    for (int e = 0; e < kV; ++e) x[e] = __fadd_rn(x[e], y[e]);
    StoreF32<kV>(residual + c * kV, x);
  }
}

template <int kV>
absl::Status Launch(const AddRmsNormParams& p, cudaStream_t stream) {
  const int64_t chunks = p.d / kV;
  const bool gather = p.out_rows != nullptr;
  if (gather && p.delta != nullptr) {
    const int64_t total = p.n * chunks;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, kMaxGrid));
    AddKernel<kV><<<grid, 256, 0, stream>>>(p.residual, p.delta, total);
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  // About two chunks per thread: enough threads to cover the row, registers for the cache.
  const int threads =
      static_cast<int>(std::clamp<int64_t>(((chunks + 1) / 2 + 31) / 32 * 32, 32, kMaxThreads));
  const int64_t rows = gather ? p.n_out : p.n;
  const unsigned grid = static_cast<unsigned>(std::min(rows, kMaxGrid));
  AddRmsNormKernel<kV><<<grid, threads, 0, stream>>>(p.residual, gather ? nullptr : p.delta, p.weight, p.out,
                                                     p.out_rows, rows, p.n, p.d, p.eps);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace

absl::Status AddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.residual == nullptr) return Invalid("residual is null");
  if (p.weight == nullptr) return Invalid("weight is null");
  if (p.out == nullptr) return Invalid("out is null");
  if (p.n <= 0) return Invalid(absl::StrCat("n must be positive, got ", p.n));
  if (p.d <= 0) return Invalid(absl::StrCat("d must be positive, got ", p.d));
  if (p.out_rows != nullptr && p.n_out <= 0) {
    return Invalid(absl::StrCat("n_out must be positive with out_rows, got ", p.n_out));
  }
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return Invalid(absl::StrCat("eps must be finite and >= 0, got ", p.eps));
  }
  const bool vec = p.d % 8 == 0 && Aligned16(p.residual) && Aligned16(p.weight) && Aligned16(p.out) &&
                   (p.delta == nullptr || Aligned16(p.delta));
  return vec ? Launch<8>(p, stream) : Launch<1>(p, stream);
}

}  // namespace tandem::kernels::cuda
