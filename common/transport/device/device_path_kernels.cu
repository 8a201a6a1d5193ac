// Kernels of the device path (device_path.h); the host logic is in device_path.cc.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/transport/device/device_path_kernels.h"

namespace tandem::transport {

namespace {

constexpr int kWriteThreads = 512;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreRelease(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One thread: spins until the doorbell reaches `seqno`. The GPU clock and the host's flags are
// read every 64 polls, so the doorbell itself is polled back to back.
__global__ void WaitDoorbellKernel(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                                   DeviceWaitRecord* rec, uint32_t index) {
  volatile DeviceWaitRecord* r = rec;
  if (r->failed != 0 || r->abort != 0) {
    if (r->failed == 0) {
      r->wait = index;
      r->seen = LoadAcquire(bell);
      __threadfence_system();
      r->failed = 2;
    }
    return;
  }
  const uint64_t start = GlobalTimerNs();
  for (uint32_t polls = 1;; ++polls) {
    const uint64_t v = LoadAcquire(bell);
    if (v >= seqno) return;
    if ((polls & 63) != 0) continue;
    const bool expired = GlobalTimerNs() - start > timeout_ns;
    if (expired || r->abort != 0 || r->failed != 0) {
      if (r->failed == 0) {
        r->wait = index;
        r->seen = v;
        __threadfence_system();
        r->failed = expired ? 1 : 2;
      }
      return;
    }
  }
}

// Grid-stride copy (16-byte vectors when both ends allow), then the last block to finish stores
// the doorbell after a system-wide fence: every block fences its own stores before it counts
// itself done, so the doorbell cannot overtake any of them.
__global__ void WriteWithDoorbellKernel(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t* bell,
                                        uint64_t seqno, uint32_t* counter) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const size_t n = bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (size_t i = tid; i < n; i += stride) d[i] = s[i];
    head = n * 16;
  }
  for (size_t i = head + tid; i < bytes; i += stride) dst[i] = src[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {
      *counter = 0;  // ready for the next launch that uses this counter
      __threadfence_system();
      StoreRelease(bell, seqno);
    }
  }
}

}  // namespace

cudaError_t LaunchWaitDoorbell(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                               DeviceWaitRecord* record, uint32_t index, void* stream) {
  WaitDoorbellKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(bell, seqno, timeout_ns, record, index);
  return cudaGetLastError();
}

cudaError_t LaunchWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* bell, uint64_t seqno,
                                    uint32_t* counter, void* stream) {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, n);
  }();
  // About 8 KiB per block (one pass of 512 threads × 16 B), at most one block per SM: a layer
  // message of tens of KiB goes out from several SMs at once, large ones from every SM.
  const size_t blocks = std::clamp<size_t>((bytes + 8191) / 8192, 1, static_cast<size_t>(sms));
  WriteWithDoorbellKernel<<<static_cast<unsigned>(blocks), kWriteThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes, bell, seqno, counter);
  return cudaGetLastError();
}

}  // namespace tandem::transport
