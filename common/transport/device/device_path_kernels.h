// The kernels of the device path (device_path.h), launched from its host code. Plain C++ types
// only, so that the host side compiles without nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tandem::transport {

// Host-mapped, written by the device when a wait gives up, read by the host after the stream
// (the other fields only once `failed` is set).
struct DeviceWaitRecord {
  uint32_t failed;  // 0: none; 1: a wait expired; 2: a wait was aborted by the host
  uint32_t wait;    // index of the first failed wait since the last successful Sync
  uint64_t seen;    // its doorbell value when it gave up
  uint32_t abort;   // set by the host: every wait falls through
};

cudaError_t LaunchWaitDoorbell(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                               DeviceWaitRecord* record, uint32_t index, void* stream);
// `counter`: a zeroed device word no other launch in flight uses; the kernel leaves it zeroed.
cudaError_t LaunchWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* bell, uint64_t seqno,
                                    uint32_t* counter, void* stream);

}  // namespace tandem::transport
