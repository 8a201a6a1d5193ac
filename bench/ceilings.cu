#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "bench_cuda.h"
#include "ceilings.h"

namespace tandem::bench {
namespace {

// Grid-stride: consecutive threads read consecutive 16-byte words; four loads a grid apart.
__global__ void __launch_bounds__(256)
    ReadGridStride(const uint4* __restrict__ p, uint64_t n, unsigned* out) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldg(p + i), b = __ldg(p + i + stride), c = __ldg(p + i + 2 * stride),
                d = __ldg(p + i + 3 * stride);
    acc += (a.x ^ b.y) + (c.z ^ d.w) + (a.w ^ b.x) + (c.y ^ d.z);
  }
  for (; i < n; i += stride) acc += __ldg(p + i).x;
  if (acc == 0x9e3779b9u) atomicAdd(out, acc);  // keeps the loads; practically never taken
}

// Block-contiguous spans: block b reads words [b·span, (b+1)·span), kLoads loads of a block's
// width apart in flight per thread, so each block streams one contiguous region.
template <int kLoads>
__global__ void __launch_bounds__(256)
    ReadSpans(const uint4* __restrict__ p, uint64_t n, uint64_t span, unsigned* out) {
  const uint64_t begin = uint64_t{blockIdx.x} * span;
  const uint64_t end = begin + span < n ? begin + span : n;
  unsigned acc = 0;
  uint64_t i = begin + threadIdx.x;
  for (; i + (kLoads - 1) * uint64_t{blockDim.x} < end; i += kLoads * uint64_t{blockDim.x}) {
    uint4 v[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) v[j] = __ldg(p + i + j * uint64_t{blockDim.x});
#pragma unroll
    for (int j = 0; j < kLoads; ++j) acc += v[j].x ^ v[j].w ^ (v[j].y + v[j].z);
  }
  for (; i < end; i += blockDim.x) acc += __ldg(p + i).x;
  if (acc == 0x9e3779b9u) atomicAdd(out, acc);
}

template <typename Enqueue>
double MedianSeconds(Enqueue enqueue, int iters, cudaStream_t s) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < iters + 3; ++i) {
    BENCH_CUDA(cudaEventRecord(a, s));
    enqueue();
    BENCH_CUDA(cudaGetLastError());
    BENCH_CUDA(cudaEventRecord(b, s));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    if (i >= 3) t.push_back(ms * 1e-3);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

ReadCeiling MeasureReadCeiling(size_t bytes, int iters, cudaStream_t s) {
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  bytes &= ~size_t{15};
  uint4* buf = nullptr;
  unsigned* out = nullptr;
  BENCH_CUDA(cudaMalloc(&buf, bytes));
  BENCH_CUDA(cudaMalloc(&out, sizeof(unsigned)));
  FillBf16(LoadHelpers(), buf, bytes / 2, 4242, sms, s);
  const uint64_t n = bytes / 16;
  ReadCeiling result;
  auto add = [&](const char* name, auto enqueue) {
    const double secs = MedianSeconds(enqueue, iters, s);
    result.variants.push_back({name, static_cast<double>(bytes) / secs});
  };
  for (int per_sm : {8, 16}) {
    const unsigned grid = static_cast<unsigned>(sms * per_sm);
    add(per_sm == 8 ? "grid-stride x4, 8 blocks/SM" : "grid-stride x4, 16 blocks/SM",
        [&] { ReadGridStride<<<grid, 256, 0, s>>>(buf, n, out); });
  }
  for (int per_sm : {4, 8}) {
    const unsigned grid = static_cast<unsigned>(sms * per_sm * 16);  // many spans: a balanced tail
    const uint64_t span = (n + grid - 1) / grid;
    add(per_sm == 4 ? "spans x4, 64 spans/SM" : "spans x4, 128 spans/SM",
        [&] { ReadSpans<4><<<grid, 256, 0, s>>>(buf, n, span, out); });
    add(per_sm == 4 ? "spans x8, 64 spans/SM" : "spans x8, 128 spans/SM",
        [&] { ReadSpans<8><<<grid, 256, 0, s>>>(buf, n, span, out); });
  }
  for (const ReadVariant& v : result.variants) {
    if (v.bytes_per_s > result.bytes_per_s) {
      result.bytes_per_s = v.bytes_per_s;
      result.best = v.name;
    }
  }
  BENCH_CUDA(cudaFree(buf));
  BENCH_CUDA(cudaFree(out));
  return result;
}

double MeasureGemmPeak(int n, int iters, cudaStream_t s) {
  const size_t elems = size_t(n) * n;
  __nv_bfloat16* m = nullptr;
  BENCH_CUDA(cudaMalloc(&m, 3 * elems * sizeof(__nv_bfloat16)));
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  FillBf16(LoadHelpers(), m, 3 * elems, 99, sms, s);
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS || cublasSetStream(h, s) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    std::exit(1);
  }
  const float alpha = 1, beta = 0;
  const double secs = MedianSeconds(
      [&] {
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, m, CUDA_R_16BF, n, m + elems,
                         CUDA_R_16BF, n, &beta, m + 2 * elems, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "cublasGemmEx failed\n");
          std::exit(1);
        }
      },
      iters, s);
  cublasDestroy(h);
  BENCH_CUDA(cudaFree(m));
  return 2.0 * n * double(n) * n / secs;
}

}  // namespace tandem::bench
