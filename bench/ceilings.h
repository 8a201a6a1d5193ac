// The device's two ceilings, measured in the calling program so that a benchmark's percentages
// are against the card as it runs now (docs/benchmarks.md, "Method"):
//   * read bandwidth: the best of several read-only kernels over a buffer far larger than L2
//     (16-byte loads; grid-stride with four loads in flight, block-contiguous spans with four and
//     eight in flight, at two occupancies). The best is the ceiling; the others are printed so that
//     a reader sees how much the access pattern alone moves it;
//   * bf16 GEMM rate: cublasGemmEx 8192³, bf16 in and out, fp32 compute.
// Random data (never zeros); median of `iters` runs after warm-up, CUDA events.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace tandem::bench {

struct ReadVariant {
  std::string name;
  double bytes_per_s = 0;
};

struct ReadCeiling {
  double bytes_per_s = 0;  // the best variant
  std::string best;        // its name
  std::vector<ReadVariant> variants;
};

// `bytes` of device memory are allocated and freed here.
ReadCeiling MeasureReadCeiling(size_t bytes, int iters, cudaStream_t stream);

// FLOP/s of cublasGemmEx at n³ (bf16 in/out, fp32 compute).
double MeasureGemmPeak(int n, int iters, cudaStream_t stream);

}  // namespace tandem::bench
