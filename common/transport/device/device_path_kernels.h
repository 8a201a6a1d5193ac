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
  // 0: none; 1: a wait expired; 2: a wait was aborted by the host; 3: a payload's checksum did not
  // match; 4: a payload's checksum entry held another seqno
  uint32_t failed;
  uint32_t wait;      // index of the first failed wait (or check) since the last successful Sync
  uint64_t seen;      // its doorbell value when it gave up; 3: the checksum computed here
  uint64_t expected;  // 3: the writer's checksum; 4: the seqno the entry held
  uint32_t abort;     // set by the host: every wait falls through
};

struct ChecksumEntry;  // payload_checksum.h

// `flag`: device memory, 0 until the first failure (written with the record, read by later kernels
// instead of the host-mapped record).
cudaError_t LaunchWaitDoorbell(const uint64_t* bell, uint64_t seqno, uint64_t timeout_ns,
                               DeviceWaitRecord* record, uint32_t* flag, uint32_t index, void* stream);
// `counter` and `sum`: zeroed device words no other launch in flight uses; the kernel leaves them
// zeroed. With `entry` (the receiver's, or null) the kernel stores {seqno, checksum of the bytes}
// there before the doorbell. Nothing is written once `flag` (as for the waits) is set. `dst` null:
// nothing is copied (the checksum alone); `bell` null: no doorbell; `flag` null: never skips.
cudaError_t LaunchWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* bell, uint64_t seqno,
                                    uint32_t* counter, unsigned long long* sum, ChecksumEntry* entry,
                                    const uint32_t* flag, void* stream);
// Checks the `bytes` at `data` against `entry` (seqno and checksum), unless a wait of the record
// already failed; a mismatch records failure 3 or 4 with `index`. Counter and sum as above.
cudaError_t LaunchVerifyChecksum(const void* data, size_t bytes, const ChecksumEntry* entry, uint64_t seqno,
                                 uint32_t* counter, unsigned long long* sum, DeviceWaitRecord* record,
                                 uint32_t* flag, uint32_t index, void* stream);

}  // namespace tandem::transport
