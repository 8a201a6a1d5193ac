// Embedding: out(n, hidden) fp32 = table(ids[i], :) bf16. One thread block per output row
// (grid-stride over rows), 16-byte loads of 8 bf16 values where the layout allows.
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

constexpr int64_t kMaxGrid = int64_t{1} << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("Embedding: ", what));
}

// bf16 → fp32 is exact: the bf16 bits are the high half of the fp32 bits.
__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

template <bool kVec>
__global__ void EmbeddingKernel(const int32_t* __restrict__ ids, const bf16* __restrict__ table,
                                float* __restrict__ out, int64_t n, int64_t vocab, int64_t hidden) {
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const int32_t id = ids[row];
    const bool ok = id >= 0 && id < vocab;  // out of range: a zero row
    float* o = out + row * hidden;
    const bf16* t = table + (ok ? static_cast<int64_t>(id) : 0) * hidden;
    if constexpr (kVec) {
      const int64_t chunks = hidden / 8;
      for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (ok) {
          const uint4 w = reinterpret_cast<const uint4*>(t)[c];
          a = make_float4(Lo(w.x), Hi(w.x), Lo(w.y), Hi(w.y));
          b = make_float4(Lo(w.z), Hi(w.z), Lo(w.w), Hi(w.w));
        }
        reinterpret_cast<float4*>(o)[2 * c] = a;
        reinterpret_cast<float4*>(o)[2 * c + 1] = b;
      }
    } else {
      for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) o[j] = ok ? __bfloat162float(t[j]) : 0.0f;
    }
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

absl::Status Embedding(const EmbeddingParams& p, cudaStream_t stream) {
  if (p.ids == nullptr) return Invalid("ids is null");
  if (p.table == nullptr) return Invalid("table is null");
  if (p.out == nullptr) return Invalid("out is null");
  if (p.n <= 0) return Invalid(absl::StrCat("n must be positive, got ", p.n));
  if (p.vocab <= 0) return Invalid(absl::StrCat("vocab must be positive, got ", p.vocab));
  if (p.hidden <= 0) return Invalid(absl::StrCat("hidden must be positive, got ", p.hidden));

  const bool vec = p.hidden % 8 == 0 && Aligned16(p.table) && Aligned16(p.out);
  const int64_t per_row = vec ? p.hidden / 8 : p.hidden;
  const int threads = static_cast<int>(std::clamp<int64_t>((per_row + 31) / 32 * 32, 32, 256));
  const unsigned grid = static_cast<unsigned>(std::min(p.n, kMaxGrid));
  if (vec) {
    EmbeddingKernel<true><<<grid, threads, 0, stream>>>(p.ids, p.table, p.out, p.n, p.vocab, p.hidden);
  } else {
    EmbeddingKernel<false><<<grid, threads, 0, stream>>>(p.ids, p.table, p.out, p.n, p.vocab, p.hidden);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
