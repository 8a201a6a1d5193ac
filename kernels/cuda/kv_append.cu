// KvAppend: k_cache(slots[i], :) = k(i, :), v_cache(slots[i], :) = v(i, :). Grid-stride over
// chunks of 8 bf16 (16-byte copies) when sizes, strides and pointers allow, single elements
// otherwise. Slots outside [0, num_slots) are skipped (the caller validates slots on the host).
// CopyRows: rows copied inside the planes of a cache, one block per (row, plane).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("KvAppend: ", what));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <int kV>
__global__ void KvAppendKernel(const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t k_stride,
                               int64_t v_stride, const int32_t* __restrict__ slots,
                               bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int64_t per_row,
                               int64_t total, int64_t kv_dim, int64_t num_slots) {
  using Chunk = typename std::conditional<kV == 8, uint4, uint16_t>::type;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / per_row;
    const int64_t col = (c - row * per_row) * kV;
    const int64_t slot = slots[row];
    if (slot < 0 || slot >= num_slots) continue;
    *reinterpret_cast<Chunk*>(k_cache + slot * kv_dim + col) =
        *reinterpret_cast<const Chunk*>(k + row * k_stride + col);
    *reinterpret_cast<Chunk*>(v_cache + slot * kv_dim + col) =
        *reinterpret_cast<const Chunk*>(v + row * v_stride + col);
  }
}

// CopyRows: block (row i, plane q) copies row src[i] to row dst[i] of plane q.
template <int kV>
__global__ void CopyRowsKernel(bf16* __restrict__ cache, const int32_t* __restrict__ src,
                               const int32_t* __restrict__ dst, int64_t chunks, int64_t width,
                               int64_t num_rows, int64_t plane_stride) {
  using Chunk = typename std::conditional<kV == 8, uint4, uint16_t>::type;
  const int64_t from = src[blockIdx.x], to = dst[blockIdx.x];
  if (from < 0 || from >= num_rows || to < 0 || to >= num_rows) return;
  bf16* plane = cache + blockIdx.y * plane_stride;
  for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
    *reinterpret_cast<Chunk*>(plane + to * width + c * kV) =
        *reinterpret_cast<const Chunk*>(plane + from * width + c * kV);
  }
}

}  // namespace

absl::Status CopyRows(const CopyRowsParams& p, cudaStream_t stream) {
  constexpr int64_t kMaxPlanes = 65535;
  const auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("CopyRows: ", parts...));
  };
  if (p.cache == nullptr || p.src == nullptr || p.dst == nullptr) return bad("a pointer is null");
  if (p.n <= 0 || p.n > kMaxGrid) return bad("n ", p.n, " must be in [1, ", kMaxGrid, "]");
  if (p.width <= 0 || p.num_rows <= 0)
    return bad("width ", p.width, " and num_rows ", p.num_rows, " must be positive");
  if (p.planes <= 0 || p.planes > kMaxPlanes || (p.planes > 1 && p.plane_stride < p.num_rows * p.width)) {
    return bad("planes ", p.planes, " (plane_stride ", p.plane_stride, ") must be in [1, ", kMaxPlanes,
               "] with planes that do not overlap");
  }
  const bool vec = p.width % 8 == 0 && (p.planes == 1 || p.plane_stride % 8 == 0) && Aligned16(p.cache);
  const int64_t chunks = vec ? p.width / 8 : p.width;
  const int threads = static_cast<int>(std::clamp<int64_t>((chunks + 31) / 32 * 32, 32, kThreads));
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>(p.planes));
  if (vec) {
    CopyRowsKernel<8>
        <<<grid, threads, 0, stream>>>(p.cache, p.src, p.dst, chunks, p.width, p.num_rows, p.plane_stride);
  } else {
    CopyRowsKernel<1>
        <<<grid, threads, 0, stream>>>(p.cache, p.src, p.dst, chunks, p.width, p.num_rows, p.plane_stride);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status KvAppend(const KvAppendParams& p, cudaStream_t stream) {
  if (p.k == nullptr) return Invalid("k is null");
  if (p.v == nullptr) return Invalid("v is null");
  if (p.slots == nullptr) return Invalid("slots is null");
  if (p.k_cache == nullptr) return Invalid("k_cache is null");
  if (p.v_cache == nullptr) return Invalid("v_cache is null");
  if (p.n <= 0) return Invalid(absl::StrCat("n must be positive, got ", p.n));
  if (p.kv_dim <= 0) return Invalid(absl::StrCat("kv_dim must be positive, got ", p.kv_dim));
  if (p.num_slots <= 0) return Invalid(absl::StrCat("num_slots must be positive, got ", p.num_slots));
  const int64_t k_stride = p.k_stride == 0 ? p.kv_dim : p.k_stride;
  const int64_t v_stride = p.v_stride == 0 ? p.kv_dim : p.v_stride;
  if (k_stride < p.kv_dim) return Invalid(absl::StrCat("k_stride ", k_stride, " < kv_dim = ", p.kv_dim));
  if (v_stride < p.kv_dim) return Invalid(absl::StrCat("v_stride ", v_stride, " < kv_dim = ", p.kv_dim));

  const bool vec = p.kv_dim % 8 == 0 && k_stride % 8 == 0 && v_stride % 8 == 0 && Aligned16(p.k) &&
                   Aligned16(p.v) && Aligned16(p.k_cache) && Aligned16(p.v_cache);
  const int64_t per_row = vec ? p.kv_dim / 8 : p.kv_dim;
  const int64_t total = p.n * per_row;
  const unsigned grid = static_cast<unsigned>(std::min((total + kThreads - 1) / kThreads, kMaxGrid));
  if (vec) {
    KvAppendKernel<8><<<grid, kThreads, 0, stream>>>(p.k, p.v, k_stride, v_stride, p.slots, p.k_cache,
                                                     p.v_cache, per_row, total, p.kv_dim, p.num_slots);
  } else {
    KvAppendKernel<1><<<grid, kThreads, 0, stream>>>(p.k, p.v, k_stride, v_stride, p.slots, p.k_cache,
                                                     p.v_cache, per_row, total, p.kv_dim, p.num_slots);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
