// Tensor-core and asynchronous-copy building blocks shared by the CUDA kernels (device code only;
// include from .cu).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

namespace tandem::kernels::cuda {

// d += a · b for one m16n8k16 tile, bf16 operands, fp32 accumulators (PTX mma.sync):
//   a (16×16, row-major fragment): a[0] = (row g, k 2t..2t+1), a[1] = (row g+8, k 2t..2t+1),
//     a[2] = (row g, k 2t+8..2t+9), a[3] = (row g+8, k 2t+8..2t+9);
//   b (16×8, "col" fragment): b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g);
//   d: d[0..1] = (row g, cols 2t, 2t+1), d[2..3] = (row g+8, cols 2t, 2t+1);
// with g = lane / 4 and t = lane % 4; each 32-bit register holds two bf16, the lower k in the low half.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
// The same without a size operand: all 16 bytes are read.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  uint32_t r;
  memcpy(&r, &v, 4);
  return r;
}

__device__ __forceinline__ float Exp2(float x) {  // 2^x; -inf -> +0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace tandem::kernels::cuda
