// Kernels of the device path (device_path.h); the host logic is in device_path.cc.
#include <cuda_runtime.h>

#include <algorithm>

#include "common/transport/device/device_path_kernels.h"
#include "common/transport/device/payload_checksum.h"

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

// Records the first failure of a step: the host-mapped record for Sync, and its code in `flag`
// (device memory), which later kernels read instead of the record.
__device__ __forceinline__ void RecordFailure(volatile DeviceWaitRecord* r, volatile uint32_t* flag,
                                              uint32_t code, uint32_t index, uint64_t seen,
                                              uint64_t expected) {
  if (*flag != 0 || r->failed != 0) return;
  r->wait = index;
  r->seen = seen;
  r->expected = expected;
  __threadfence_system();
  r->failed = code;
  *flag = code;
}

// One thread: spins until the doorbell reaches `seqno`. The GPU clock and the host's abort flag
// are read every 64 polls, so the doorbell itself is polled back to back, and a wait whose write
// has landed returns without reading host memory (a PCIe round trip of about 2 us); after a
// failure (`flag`, device memory) it falls through at once.
__global__ void WaitDoorbellKernel(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                                   DeviceWaitRecord* rec, uint32_t* flag, uint32_t index) {
  volatile DeviceWaitRecord* r = rec;
  volatile uint32_t* f = flag;
  if (*f != 0) return;
  const uint64_t start = GlobalTimerNs();
  for (uint32_t polls = 1;; ++polls) {
    const uint64_t v = LoadAcquire(bell);
    if (v >= seqno) return;
    if ((polls & 63) != 0) continue;
    const bool expired = GlobalTimerNs() - start > timeout_ns;
    if (expired || r->abort != 0 || *f != 0) {
      RecordFailure(r, f, expired ? 1 : 2, index, v, 0);
      return;
    }
  }
}

// The 8-byte word made of the bytes at [i, min(i + 8, bytes)) of `p` (little-endian, zero-padded),
// each copied to `dst` as well when it is not null.
__device__ __forceinline__ uint64_t LoadWord(const uint8_t* p, uint8_t* dst, size_t i, size_t bytes) {
  uint64_t word = 0;
  const size_t n = bytes - i < 8 ? bytes - i : 8;
  for (size_t b = 0; b < n; ++b) {
    const uint8_t c = p[i + b];
    if (dst != nullptr) dst[i + b] = c;
    word |= static_cast<uint64_t>(c) << (8 * b);
  }
  return word;
}

__device__ __forceinline__ uint64_t VectorTerms(int4 v, size_t vector) {
  const uint64_t lo = static_cast<uint32_t>(v.x) | (static_cast<uint64_t>(static_cast<uint32_t>(v.y)) << 32);
  const uint64_t hi = static_cast<uint32_t>(v.z) | (static_cast<uint64_t>(static_cast<uint32_t>(v.w)) << 32);
  return ChecksumTerm(2 * vector, lo) + ChecksumTerm(2 * vector + 1, hi);
}

// Adds the block's `part` sums into *sum (one atomic per block); every thread of the block calls
// it. Warps reduce by shuffles, then warp 0 reduces the warps' sums.
__device__ __forceinline__ void BlockAddSum(uint64_t part, unsigned long long* sum) {
  __shared__ uint64_t warps[32];
  for (int o = 16; o > 0; o >>= 1) part += __shfl_down_sync(0xffffffffu, part, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warps[warp] = part;
  __syncthreads();
  if (warp == 0) {
    part = lane < static_cast<int>((blockDim.x + 31) / 32) ? warps[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) part += __shfl_down_sync(0xffffffffu, part, o);
    if (lane == 0) atomicAdd(sum, static_cast<unsigned long long>(part));
  }
}

// The checksum terms of the grid's share of [0, bytes) at `src`, copying it to `dst` on the way
// when `dst` is not null: 16-byte vectors when both ends allow, then words.
__device__ __forceinline__ uint64_t CopyAndSum(uint8_t* dst, const uint8_t* src, size_t bytes, bool sum) {
  const size_t tid = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  uint64_t part = 0;
  size_t head = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const size_t n = bytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    for (size_t i = tid; i < n; i += stride) {
      const int4 v = s[i];
      if (d != nullptr) d[i] = v;
      if (sum) part += VectorTerms(v, i);
    }
    head = n * 16;
  }
  for (size_t w = head / 8 + tid; w * 8 < bytes; w += stride) {
    const uint64_t word = LoadWord(src, dst, w * 8, bytes);
    if (sum) part += ChecksumTerm(w, word);
  }
  return part;
}

// Grid-stride copy (none when `dst` is null), then the last block to finish stores the checksum
// entry (when asked) and the doorbell (when not null) after a system-wide fence: every block fences its own
// stores before it counts itself done, so the doorbell cannot overtake any of them. Once a wait of this path
// has failed (`flag`, device memory; null: never) nothing is written: a failed step drains without touching
// its peers' memory (a peer that died, or one that runs the step again once this rank has drained). Every
// block still counts itself, so the counter and sum are left zeroed.
__global__ void WriteWithDoorbellKernel(uint8_t* dst, const uint8_t* src, size_t bytes, uint64_t* bell,
                                        uint64_t seqno, uint32_t* counter, unsigned long long* sum,
                                        ChecksumEntry* entry, const uint32_t* flag) {
  __shared__ uint32_t skip;
  if (threadIdx.x == 0) skip = flag != nullptr ? *static_cast<const volatile uint32_t*>(flag) : 0;
  __syncthreads();
  const uint64_t part = skip != 0 ? 0 : CopyAndSum(dst, src, bytes, entry != nullptr);
  if (entry != nullptr) BlockAddSum(part, sum);
  // Another process may read what this kernel stores (the copy, the entry); the checksum alone
  // (nothing copied, no doorbell) is read by work later on this stream, so the block's sum needs
  // only to reach the last block.
  const bool shared = dst != nullptr || bell != nullptr;
  if (shared) {
    __threadfence_system();
  } else {
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (atomicAdd(counter, 1u) == gridDim.x - 1) {
      *counter = 0;  // ready for the next launch that uses this counter
      const uint64_t total = entry != nullptr ? atomicExch(sum, 0ull) : 0;
      if (flag != nullptr && *static_cast<const volatile uint32_t*>(flag) != 0)
        return;  // some blocks may have skipped
      if (entry != nullptr) {
        volatile ChecksumEntry* e = entry;
        e->checksum = ChecksumFinish(total, bytes);
        e->seqno = seqno;
      }
      if (bell != nullptr) {
        __threadfence_system();
        StoreRelease(bell, seqno);
      }
    }
  }
}

// The receiver's check: the same sum over the landed bytes; the last block compares. Nothing reads
// the host-mapped record on the way (a read of host memory from the GPU is a PCIe round trip, and
// those of many blocks at once queue behind each other: about 2 us each on an H200), only a
// mismatch does: after a wait that fell through (or an abort), the bytes are stale and the first
// failure, the wait's, stays the one recorded.
__global__ void VerifyChecksumKernel(const uint8_t* data, size_t bytes, const ChecksumEntry* entry,
                                     uint64_t seqno, uint32_t* counter, unsigned long long* sum,
                                     DeviceWaitRecord* rec, uint32_t* flag, uint32_t index) {
  BlockAddSum(CopyAndSum(nullptr, data, bytes, true), sum);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(counter, 1u) == gridDim.x - 1) {
    *counter = 0;
    const uint64_t got = ChecksumFinish(atomicExch(sum, 0ull), bytes);
    const volatile ChecksumEntry* e = entry;
    const uint64_t tag = e->seqno, sent = e->checksum;
    if (tag == seqno && sent == got) return;
    // After an abort the bytes may be stale (the wait fell through): the abort is the failure.
    if (static_cast<volatile DeviceWaitRecord*>(rec)->abort != 0) return;
    RecordFailure(rec, flag, tag == seqno ? 3 : 4, index, got, tag == seqno ? sent : tag);
  }
}

}  // namespace

cudaError_t LaunchWaitDoorbell(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                               DeviceWaitRecord* record, uint32_t* flag, uint32_t index, void* stream) {
  WaitDoorbellKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(bell, seqno, timeout_ns, record, flag,
                                                                     index);
  return cudaGetLastError();
}

namespace {

// About 8 KiB per block (one pass of 512 threads × 16 B), at most one block per SM: a layer
// message of tens of KiB goes out from several SMs at once, large ones from every SM.
unsigned Blocks(size_t bytes) {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return std::max(1, n);
  }();
  return static_cast<unsigned>(std::clamp<size_t>((bytes + 8191) / 8192, 1, static_cast<size_t>(sms)));
}

}  // namespace

cudaError_t LaunchWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* bell, uint64_t seqno,
                                    uint32_t* counter, unsigned long long* sum, ChecksumEntry* entry,
                                    const uint32_t* flag, void* stream) {
  WriteWithDoorbellKernel<<<Blocks(bytes), kWriteThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes, bell, seqno, counter, sum, entry,
      flag);
  return cudaGetLastError();
}

cudaError_t LaunchVerifyChecksum(const void* data, size_t bytes, const ChecksumEntry* entry, uint64_t seqno,
                                 uint32_t* counter, unsigned long long* sum, DeviceWaitRecord* record,
                                 uint32_t* flag, uint32_t index, void* stream) {
  VerifyChecksumKernel<<<Blocks(bytes), kWriteThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(data), bytes, entry, seqno, counter, sum, record, flag, index);
  return cudaGetLastError();
}

}  // namespace tandem::transport
