// Helpers shared by the GPU tests: skipping without a GPU (with the reason), device buffers with
// guard regions, and bf16 conversions for building inputs and reading outputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"

namespace tandem::testing_gpu {

// Empty when a CUDA device is usable, else the reason it is not.
inline std::string NoGpuReason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no usable CUDA device (") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err) +
           ")";
  }
  if (n == 0) return "no CUDA device on this machine";
  return "";
}

// CUDA devices visible to this process (0 without a usable driver).
inline int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

#define TANDEM_SKIP_WITHOUT_GPU()                                    \
  do {                                                               \
    const std::string reason = ::tandem::testing_gpu::NoGpuReason(); \
    if (!reason.empty()) GTEST_SKIP() << reason;                     \
  } while (0)

#define CUDA_ASSERT_OK(expr)                                                                           \
  do {                                                                                                 \
    const cudaError_t e = (expr);                                                                      \
    ASSERT_EQ(e, cudaSuccess) << #expr << ": " << cudaGetErrorName(e) << " " << cudaGetErrorString(e); \
  } while (0)

// A device buffer of T with `guard` elements before and after the payload, filled with a
// sentinel byte pattern; GuardsIntact() checks that no kernel wrote outside the payload.
template <typename T>
class GuardedBuffer {
 public:
  static constexpr int64_t kGuard = 256;
  static constexpr unsigned char kSentinel = 0xA5;
  explicit GuardedBuffer(int64_t n) : n_(n) {
    const size_t bytes = static_cast<size_t>(n_ + 2 * kGuard) * sizeof(T);
    if (cudaMalloc(&base_, bytes) != cudaSuccess) base_ = nullptr;
    if (base_) cudaMemset(base_, kSentinel, bytes);
    // The legacy-stream memset must be complete before kernels on non-blocking streams run.
    cudaDeviceSynchronize();
  }
  ~GuardedBuffer() {
    if (base_) cudaFree(base_);
  }
  GuardedBuffer(const GuardedBuffer&) = delete;
  GuardedBuffer& operator=(const GuardedBuffer&) = delete;

  T* get() { return static_cast<T*>(base_) + kGuard; }
  int64_t size() const { return n_; }
  // A pageable cudaMemcpy may return before the data reaches the device, and kernels on
  // non-blocking streams do not wait for the legacy stream: synchronise before returning.
  void Upload(const std::vector<T>& host) {
    cudaMemcpy(get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  }
  std::vector<T> Download() {
    std::vector<T> host(static_cast<size_t>(n_));
    cudaMemcpy(host.data(), get(), host.size() * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
  bool GuardsIntact() {
    std::vector<unsigned char> g(kGuard * sizeof(T));
    for (int side = 0; side < 2; ++side) {
      const T* at = side == 0 ? static_cast<T*>(base_) : get() + n_;
      cudaMemcpy(g.data(), at, g.size(), cudaMemcpyDeviceToHost);
      for (unsigned char c : g)
        if (c != kSentinel) return false;
    }
    return true;
  }

 private:
  int64_t n_;
  void* base_ = nullptr;
};

inline uint16_t BitsOf(__nv_bfloat16 v) {
  const __nv_bfloat16_raw r = v;
  return r.x;
}
inline __nv_bfloat16 FromBits(uint16_t b) {
  __nv_bfloat16_raw r;
  r.x = b;
  return __nv_bfloat16(r);
}
inline float ToFloat(__nv_bfloat16 v) { return Bf16ToFloat(BitsOf(v)); }

// One unit in the last place of a bf16 value of magnitude |x| (8 significant bits).
inline double Bf16Ulp(float x) {
  const double a = std::abs(static_cast<double>(x));
  if (a < static_cast<double>(std::numeric_limits<float>::min())) return std::ldexp(1.0, -133);
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  return std::ldexp(1.0, e - 8);
}
inline __nv_bfloat16 ToBf16(float f) { return FromBits(FloatToBf16(f)); }

// Random bf16 values in [lo, hi) and their exact fp32 values (for the CPU reference).
inline void RandomBf16(std::mt19937& rng, int64_t n, float lo, float hi,
                       std::vector<__nv_bfloat16>* dev_values, std::vector<float>* exact) {
  std::uniform_real_distribution<float> u(lo, hi);
  dev_values->resize(static_cast<size_t>(n));
  exact->resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    (*dev_values)[static_cast<size_t>(i)] = ToBf16(u(rng));
    (*exact)[static_cast<size_t>(i)] = ToFloat((*dev_values)[static_cast<size_t>(i)]);
  }
}

}  // namespace tandem::testing_gpu
