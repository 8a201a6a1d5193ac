// Hopper warpgroup MMA (wgmma) building blocks for sm_90a kernels (device code only; include from
// a .cu compiled for sm_90a, e.g. kernels/cuda/prefill_attention_sm90.cu).
//
// Shared-memory operands use the 128-byte swizzle: a tile of R rows with 64 bf16 (128 bytes) per
// row and atom is stored as [atom][row][64], 16-byte chunk c of row r at
//   atom · R · 128 + r · 128 + ((c ^ (r % 8)) · 16),
// and every atom starts on a 1024-byte boundary (the swizzle is a function of address bits 4-9).
// A K-major operand (rows along M or N, the reduction dimension K contiguous) with K = 128 has two
// atoms along K; an MN-major operand (K along rows, M or N contiguous) has its atoms along M or N.
//
// Accumulator fragment of m64nNk16 with fp32 accumulators: warp w of the warpgroup holds rows
// 16w .. 16w+15; with g = lane / 4 and t = lane % 4, d[4j + e] is (row 16w + g + 8·(e / 2),
// column 8j + 2t + (e % 2)), the mma.sync m16n8 layout repeated over the N / 8 column blocks. An A
// fragment in registers (m64k16) is mma.sync's m16k16 A fragment, per warp on its 16 rows.
#pragma once

#include <cstdint>

namespace tandem::kernels::cuda {

// Shared-memory matrix descriptor with the 128-byte swizzle. `addr` is a shared-state-space
// address; lbo and sbo are the leading and stride byte offsets (multiples of 16): for a K-major
// operand sbo is the distance between 8-row groups (1024 here) and lbo is unused; for an MN-major
// one lbo is the distance between atoms along M or N and sbo that between 8-row groups along K.
__device__ __forceinline__ uint64_t SwizzledDesc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  desc |= uint64_t{1} << 62;  // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by the generic proxy (st.shared, cp.async) becomes visible to wgmma's
// async proxy.
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of registers that an in-flight wgmma owns across
// the issue or the wait (the asm statements own them from the compiler's point of view).
template <int N>
__device__ __forceinline__ void FenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void FenceRegs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// mbarrier in shared memory (`bar`: a shared-state-space address of 8 bytes, 8-byte aligned).
__device__ __forceinline__ void MbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrival on `bar` once every cp.async this thread issued before it has completed; it counts
// against the count given at init (.noinc).
__device__ __forceinline__ void MbarArriveOnCpAsync(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ void MbarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Hands registers between warpgroups (every warp of a warpgroup must run the same one).
template <int N>
__device__ __forceinline__ void SetMaxRegsDec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void SetMaxRegsInc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Arrives at named barrier kId (counted among `threads`) without waiting for it.
template <int kId>
__device__ __forceinline__ void NamedBarrierArrive(int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
// A barrier among `threads` threads (a multiple of 32) with id 1 .. 15 (0 is __syncthreads).
template <int kId>
__device__ __forceinline__ void NamedBarrier(int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}

// The 64 fp32 accumulator operands of an m64n128 wgmma (%0 .. %63), read and written.
#define TANDEM_WGMMA_D64_REGS                                                                          \
  "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
  "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,"   \
  "%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define TANDEM_WGMMA_D64_OPERANDS(d)                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),           \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
      "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),            \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),            \
      "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),            \
      "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),            \
      "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]),            \
      "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]),            \
      "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= a · b, m64n128k16, bf16 operands, fp32 accumulators; a and b in shared memory, both
// K-major. accumulate == 0 overwrites d.
__device__ __forceinline__ void WgmmaM64N128K16(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TANDEM_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : TANDEM_WGMMA_D64_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The same with a in registers (an m64k16 A fragment) and b MN-major (transposed).
__device__ __forceinline__ void WgmmaM64N128K16RegA(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" TANDEM_WGMMA_D64_REGS
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"
      : TANDEM_WGMMA_D64_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

}  // namespace tandem::kernels::cuda
