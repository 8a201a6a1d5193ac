// Helpers shared by the CUDA benchmarks: a CUDA error check that exits, and a device kernel that
// fills bf16 buffers with random values (the read-bandwidth ceiling is in ceilings.h).
//
// The kernels are PTX loaded at run time through cudaLibraryLoadData, because the benchmarks
// are compiled as host C++. Source (nvcc -arch=compute_90 -O3 -ptx):
//
//   // bf16 values ±[2^-7, 1): random sign, exponent and mantissa; never zero, inf or NaN.
//   extern "C" __global__ void __launch_bounds__(256) bench_fill_bf16(unsigned short* __restrict__ p,
//       unsigned long long n, unsigned long long seed) {
//     const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
//     for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
//          i += stride) {
//       unsigned long long z = i + seed * 0x9E3779B97F4A7C15ull;          // splitmix64
//       z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
//       z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
//       z ^= z >> 31;
//       const unsigned int sign = (unsigned int)(z & 1) << 15;
//       const unsigned int exponent = 120u + (unsigned int)((z >> 1) % 7);
//       const unsigned int mantissa = (unsigned int)(z >> 8) & 0x7f;
//       p[i] = (unsigned short)(sign | (exponent << 7) | mantissa);
//     }
//   }
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define BENCH_CUDA(expr)                                                          \
  do {                                                                            \
    const cudaError_t bench_err_ = (expr);                                        \
    if (bench_err_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, \
                   cudaGetErrorString(bench_err_));                               \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

namespace tandem::bench {

inline constexpr const char* kHelperPtx = R"PTX(
.version 9.0
.target sm_90
.address_size 64
.visible .entry bench_fill_bf16(
	.param .u64 bench_fill_bf16_param_0,
	.param .u64 bench_fill_bf16_param_1,
	.param .u64 bench_fill_bf16_param_2
)
.maxntid 256, 1, 1
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<13>;
	.reg .b64 	%rd<34>;
	ld.param.u64 	%rd7, [bench_fill_bf16_param_0];
	ld.param.u64 	%rd8, [bench_fill_bf16_param_1];
	ld.param.u64 	%rd9, [bench_fill_bf16_param_2];
	mov.u32 	%r1, %ntid.x;
	cvt.u64.u32 	%rd1, %r1;
	mov.u32 	%r2, %ctaid.x;
	mul.wide.u32 	%rd10, %r2, %r1;
	mov.u32 	%r3, %tid.x;
	cvt.u64.u32 	%rd11, %r3;
	add.s64 	%rd33, %rd10, %rd11;
	setp.ge.u64 	%p1, %rd33, %rd8;
	@%p1 bra 	$L__BB1_3;
	mul.lo.s64 	%rd3, %rd9, -7046029254386353131;
	mov.u32 	%r4, %nctaid.x;
	cvt.u64.u32 	%rd12, %r4;
	mul.lo.s64 	%rd4, %rd12, %rd1;
	cvta.to.global.u64 	%rd30, %rd7;
$L__BB1_2:
	add.s64 	%rd13, %rd33, %rd3;
	shr.u64 	%rd14, %rd13, 30;
	xor.b64  	%rd15, %rd14, %rd13;
	mul.lo.s64 	%rd16, %rd15, -4658895280553007687;
	shr.u64 	%rd17, %rd16, 27;
	xor.b64  	%rd18, %rd17, %rd16;
	mul.lo.s64 	%rd19, %rd18, -7723592293110705685;
	shr.u64 	%rd20, %rd19, 31;
	xor.b64  	%rd21, %rd20, %rd19;
	cvt.u32.u64 	%r5, %rd21;
	shr.u64 	%rd22, %rd21, 1;
	mul.hi.u64 	%rd23, %rd22, 2635249153387078803;
	sub.s64 	%rd24, %rd22, %rd23;
	shr.u64 	%rd25, %rd24, 1;
	add.s64 	%rd26, %rd25, %rd23;
	shr.u64 	%rd27, %rd26, 2;
	mul.lo.s64 	%rd28, %rd27, 7;
	sub.s64 	%rd29, %rd22, %rd28;
	cvt.u32.u64 	%r6, %rd29;
	shr.u32 	%r7, %r5, 8;
	and.b32  	%r8, %r7, 127;
	shl.b32 	%r9, %r6, 7;
	bfi.b32 	%r10, %r5, %r8, 15, 17;
	or.b32  	%r11, %r10, %r9;
	or.b32  	%r12, %r11, 15360;
	shl.b64 	%rd31, %rd33, 1;
	add.s64 	%rd32, %rd30, %rd31;
	st.global.u16 	[%rd32], %r12;
	add.s64 	%rd33, %rd33, %rd4;
	setp.lt.u64 	%p2, %rd33, %rd8;
	@%p2 bra 	$L__BB1_2;
$L__BB1_3:
	ret;
}
)PTX";

struct Helpers {
  cudaKernel_t fill_bf16 = nullptr;
};

inline Helpers LoadHelpers() {
  cudaLibrary_t lib = nullptr;
  BENCH_CUDA(cudaLibraryLoadData(&lib, kHelperPtx, nullptr, nullptr, 0, nullptr, nullptr, 0));
  Helpers h;
  BENCH_CUDA(cudaLibraryGetKernel(&h.fill_bf16, lib, "bench_fill_bf16"));
  return h;  // the library stays loaded for the life of the process
}

// bf16 values ±[2^-7, 1), never zero, inf or NaN; `sms` x 8 CTAs.
inline void FillBf16(const Helpers& h, void* p, uint64_t n, uint64_t seed, int sms, cudaStream_t s) {
  unsigned long long n_arg = n, seed_arg = seed;
  void* args[] = {&p, &n_arg, &seed_arg};
  BENCH_CUDA(
      cudaLaunchKernel(reinterpret_cast<const void*>(h.fill_bf16), dim3(sms * 8), dim3(256), args, 0, s));
}

}  // namespace tandem::bench
