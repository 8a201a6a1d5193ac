// SiluMul: out(n, inter) = bf16(silu(gate) * up) with gate_up(n, 2·inter) = [gate | up], fp32 math
// as the CPU reference (g / (1 + exp(-g)) * u). Grid-stride over chunks of 8 elements (16-byte
// accesses) when sizes and pointers allow, single elements otherwise.
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

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = int64_t{1} << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("SiluMul: ", what));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float Silu(float g) { return __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))); }

__device__ __forceinline__ uint32_t SiluMulPair(uint32_t g, uint32_t u) {
  const float r0 = __fmul_rn(Silu(__uint_as_float(g << 16)), __uint_as_float(u << 16));
  const float r1 = __fmul_rn(Silu(__uint_as_float(g & 0xffff0000u)), __uint_as_float(u & 0xffff0000u));
  const __nv_bfloat162 v = __floats2bfloat162_rn(r0, r1);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Chunk c of the output: row c / per_row, columns (c % per_row) * kV ...
template <int kV>
__global__ void SiluMulKernel(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int64_t per_row,
                              int64_t total, int64_t inter) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < total;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / per_row;
    const int64_t col = (c - row * per_row) * kV;
    const bf16* g = gate_up + row * 2 * inter + col;
    bf16* o = out + row * inter + col;
    if constexpr (kV == 8) {
      const uint4 gv = *reinterpret_cast<const uint4*>(g);
      const uint4 uv = *reinterpret_cast<const uint4*>(g + inter);
      *reinterpret_cast<uint4*>(o) = make_uint4(SiluMulPair(gv.x, uv.x), SiluMulPair(gv.y, uv.y),
                                                SiluMulPair(gv.z, uv.z), SiluMulPair(gv.w, uv.w));
    } else {
      *o = __float2bfloat16_rn(__fmul_rn(Silu(__bfloat162float(*g)), __bfloat162float(g[inter])));
    }
  }
}

}  // namespace

absl::Status SiluMul(const SiluMulParams& p, cudaStream_t stream) {
  if (p.gate_up == nullptr) return Invalid("gate_up is null");
  if (p.out == nullptr) return Invalid("out is null");
  if (p.n <= 0) return Invalid(absl::StrCat("n must be positive, got ", p.n));
  if (p.inter <= 0) return Invalid(absl::StrCat("inter must be positive, got ", p.inter));
  const bool vec = p.inter % 8 == 0 && Aligned16(p.gate_up) && Aligned16(p.out);
  const int64_t per_row = vec ? p.inter / 8 : p.inter;
  const int64_t total = p.n * per_row;
  const unsigned grid = static_cast<unsigned>(std::min((total + kThreads - 1) / kThreads, kMaxGrid));
  if (vec) {
    SiluMulKernel<8><<<grid, kThreads, 0, stream>>>(p.gate_up, p.out, per_row, total, p.inter);
  } else {
    SiluMulKernel<1><<<grid, kThreads, 0, stream>>>(p.gate_up, p.out, per_row, total, p.inter);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
