// Rope: in-place rotate-half RoPE on bf16 q and k rows (strided, e.g. inside fused qkv rows).
// One thread block per token: the block first computes cos/sin of the token's angles into shared
// memory (angle = float(pos) * inv_freq[j] in fp32 as transformers forms it; cos/sin evaluated in
// double and rounded once, as the CPU reference), then rotates every q and k head with them.
// Products and sums use explicit round-to-nearest intrinsics (no FMA contraction), so the fp32
// result equals the CPU reference's before the bf16 rounding.
// RopeShift (kv.store_pre_rope): keys in the cache turned from one position to another, one block
// per (row, layer), cos/sin of the angle differences formed as cpu::RopeShiftAngles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int64_t kMaxHeadDim = 8192;  // cos/sin of a row fit in 32 KiB of shared memory
constexpr int64_t kMaxGrid = int64_t{1} << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("Rope: ", what));
}

bool AlignedTo(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// kV consecutive bf16 at p (kV * 2 bytes, aligned to that).
template <int kV>
__device__ __forceinline__ void Load(const bf16* p, float (&v)[kV]) {
  if constexpr (kV == 8) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      v[2 * i] = __uint_as_float(u[i] << 16), v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  } else if constexpr (kV == 2) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    v[0] = __uint_as_float(w << 16), v[1] = __uint_as_float(w & 0xffff0000u);
  } else {
    v[0] = __bfloat162float(*p);
  }
}
__device__ __forceinline__ uint32_t Pack(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <int kV>
__device__ __forceinline__ void Store(bf16* p, const float (&v)[kV]) {
  if constexpr (kV == 8) {
    *reinterpret_cast<uint4*>(p) =
        make_uint4(Pack(v[0], v[1]), Pack(v[2], v[3]), Pack(v[4], v[5]), Pack(v[6], v[7]));
  } else if constexpr (kV == 2) {
    *reinterpret_cast<uint32_t*>(p) = Pack(v[0], v[1]);
  } else {
    *p = __float2bfloat16_rn(v[0]);
  }
}

// Work item w of a row: head h = w / (half / kV), chunk of kV pairs (j, j + half).
template <int kV>
__global__ void RopeKernel(bf16* __restrict__ q, bf16* __restrict__ k, const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, int64_t n, int num_heads, int num_kv_heads,
                           int head_dim, int64_t q_stride, int64_t k_stride) {
  extern __shared__ float cos_sin[];  // cos[half], then sin[half]
  const int half = head_dim / 2;
  float* cos_v = cos_sin;
  float* sin_v = cos_sin + half;
  const int chunks_per_head = half / kV;
  const int heads = num_heads + (k != nullptr ? num_kv_heads : 0);
  const int items = heads * chunks_per_head;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    __syncthreads();  // the previous row's readers are done with cos_sin
    const float pos = static_cast<float>(positions[row]);
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
      const float angle = __fmul_rn(pos, inv_freq[j]);
      double s, c;
      sincos(static_cast<double>(angle), &s, &c);
      cos_v[j] = static_cast<float>(c);
      sin_v[j] = static_cast<float>(s);
    }
    __syncthreads();
    for (int w = threadIdx.x; w < items; w += blockDim.x) {
      const int h = w / chunks_per_head;
      const int j = (w - h * chunks_per_head) * kV;
      bf16* x = h < num_heads ? q + row * q_stride + static_cast<int64_t>(h) * head_dim
                              : k + row * k_stride + static_cast<int64_t>(h - num_heads) * head_dim;
      float a[kV], b[kV];
      Load<kV>(x + j, a);
      Load<kV>(x + j + half, b);
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        const float c = cos_v[j + e], s = sin_v[j + e];
        const float ra = __fsub_rn(__fmul_rn(a[e], c), __fmul_rn(b[e], s));
        const float rb = __fadd_rn(__fmul_rn(b[e], c), __fmul_rn(a[e], s));
        a[e] = ra;
        b[e] = rb;
      }
      Store<kV>(x + j, a);
      Store<kV>(x + j + half, b);
    }
  }
}

// RopeShift: block (row i, layer l); cos/sin of the row's angle differences in shared memory.
__global__ void RopeShiftKernel(bf16* __restrict__ k, const int32_t* __restrict__ rows,
                                const int32_t* __restrict__ from, const int32_t* __restrict__ to,
                                const float* __restrict__ inv_freq, int num_kv_heads, int head_dim,
                                int64_t layer_stride) {
  extern __shared__ float cos_sin[];  // cos[half], then sin[half]
  const int64_t i = blockIdx.x;
  if (from[i] == to[i]) return;
  const int half = head_dim / 2;
  float* cos_v = cos_sin;
  float* sin_v = cos_sin + half;
  const float f = static_cast<float>(from[i]), t = static_cast<float>(to[i]);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    // The same fp32 angles as RopeKernel; their difference and its cos/sin in double.
    const double delta =
        static_cast<double>(__fmul_rn(t, inv_freq[j])) - static_cast<double>(__fmul_rn(f, inv_freq[j]));
    double s, c;
    sincos(delta, &s, &c);
    cos_v[j] = static_cast<float>(c);
    sin_v[j] = static_cast<float>(s);
  }
  __syncthreads();
  bf16* row = k + blockIdx.y * layer_stride + static_cast<int64_t>(rows[i]) * num_kv_heads * head_dim;
  for (int w = threadIdx.x; w < num_kv_heads * half; w += blockDim.x) {
    const int h = w / half, j = w - h * half;
    bf16* x = row + static_cast<int64_t>(h) * head_dim;
    const float a = __bfloat162float(x[j]), b = __bfloat162float(x[j + half]);
    const float c = cos_v[j], s = sin_v[j];
    x[j] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    x[j + half] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
  }
}

}  // namespace

absl::Status RopeShift(const RopeShiftParams& p, cudaStream_t stream) {
  constexpr int64_t kMaxGridY = 65535;
  if (p.k == nullptr || p.rows == nullptr || p.from_positions == nullptr || p.to_positions == nullptr ||
      p.inv_freq == nullptr) {
    return absl::InvalidArgumentError("RopeShift: a pointer is null");
  }
  if (p.n <= 0 || p.n > kMaxGrid)
    return absl::InvalidArgumentError(absl::StrCat("RopeShift: n ", p.n, " must be in [1, ", kMaxGrid, "]"));
  if (p.num_kv_heads <= 0 || p.head_dim <= 0 || p.head_dim % 2 != 0 || p.head_dim > kMaxHeadDim ||
      p.num_kv_heads * p.head_dim > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("RopeShift: num_kv_heads ", p.num_kv_heads,
                                                   " and head_dim ", p.head_dim,
                                                   " must be positive, head_dim even and <= ", kMaxHeadDim));
  }
  if (p.layers <= 0 || p.layers > kMaxGridY ||
      (p.layers > 1 && p.layer_stride < p.num_kv_heads * p.head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("RopeShift: layers ", p.layers, " (layer_stride ",
                                                   p.layer_stride, ") must be in [1, ", kMaxGridY,
                                                   "] with caches that do not overlap"));
  }
  const int64_t items = p.num_kv_heads * p.head_dim / 2;
  const int threads = static_cast<int>(std::clamp<int64_t>((items + 31) / 32 * 32, 32, 256));
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(p.layers));
  RopeShiftKernel<<<grid, threads, static_cast<size_t>(p.head_dim) * sizeof(float), stream>>>(
      p.k, p.rows, p.from_positions, p.to_positions, p.inv_freq, static_cast<int>(p.num_kv_heads),
      static_cast<int>(p.head_dim), p.layer_stride);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status Rope(const RopeParams& p, cudaStream_t stream) {
  if (p.q == nullptr) return Invalid("q is null");
  if (p.positions == nullptr) return Invalid("positions is null");
  if (p.inv_freq == nullptr) return Invalid("inv_freq is null");
  if (p.n <= 0) return Invalid(absl::StrCat("n must be positive, got ", p.n));
  if (p.num_heads <= 0) return Invalid(absl::StrCat("num_heads must be positive, got ", p.num_heads));
  if (p.head_dim <= 0 || p.head_dim % 2 != 0 || p.head_dim > kMaxHeadDim) {
    return Invalid(absl::StrCat("head_dim must be even and in [2, ", kMaxHeadDim, "], got ", p.head_dim));
  }
  if (p.k != nullptr && p.num_kv_heads <= 0) {
    return Invalid(absl::StrCat("num_kv_heads must be positive, got ", p.num_kv_heads));
  }
  const int64_t heads = p.num_heads + (p.k != nullptr ? p.num_kv_heads : 0);
  if (heads * p.head_dim > (int64_t{1} << 30)) return Invalid("num_heads + num_kv_heads too large");
  const int64_t q_stride = p.q_stride == 0 ? p.num_heads * p.head_dim : p.q_stride;
  const int64_t k_stride = p.k_stride == 0 ? p.num_kv_heads * p.head_dim : p.k_stride;
  if (q_stride < p.num_heads * p.head_dim) {
    return Invalid(
        absl::StrCat("q_stride ", q_stride, " < num_heads * head_dim = ", p.num_heads * p.head_dim));
  }
  if (p.k != nullptr && k_stride < p.num_kv_heads * p.head_dim) {
    return Invalid(
        absl::StrCat("k_stride ", k_stride, " < num_kv_heads * head_dim = ", p.num_kv_heads * p.head_dim));
  }

  // Widest access every q and k chunk allows: half, strides and base pointers all aligned.
  const int64_t half = p.head_dim / 2;
  auto fits = [&](int64_t v) {
    return half % v == 0 && q_stride % v == 0 && AlignedTo(p.q, 2 * v) &&
           (p.k == nullptr || (k_stride % v == 0 && AlignedTo(p.k, 2 * v)));
  };
  const int vec = fits(8) ? 8 : fits(2) ? 2 : 1;
  const int64_t items = heads * (half / vec);
  const int threads = static_cast<int>(std::clamp<int64_t>((std::max(items, half) + 31) / 32 * 32, 32, 256));
  const unsigned grid = static_cast<unsigned>(std::min(p.n, kMaxGrid));
  const size_t smem = static_cast<size_t>(p.head_dim) * sizeof(float);
  const int nh = static_cast<int>(p.num_heads), nkv = static_cast<int>(p.k != nullptr ? p.num_kv_heads : 0);
  const int hd = static_cast<int>(p.head_dim);
  switch (vec) {
    case 8:
      RopeKernel<8><<<grid, threads, smem, stream>>>(p.q, p.k, p.positions, p.inv_freq, p.n, nh, nkv, hd,
                                                     q_stride, k_stride);
      break;
    case 2:
      RopeKernel<2><<<grid, threads, smem, stream>>>(p.q, p.k, p.positions, p.inv_freq, p.n, nh, nkv, hd,
                                                     q_stride, k_stride);
      break;
    default:
      RopeKernel<1><<<grid, threads, smem, stream>>>(p.q, p.k, p.positions, p.inv_freq, p.n, nh, nkv, hd,
                                                     q_stride, k_stride);
      break;
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
