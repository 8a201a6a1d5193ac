// The device side of the GPU transports (docs/architecture.md, "Transports"): doorbell waits that run as
// kernels with deadlines, the write that puts a payload and then its doorbell into a peer's
// memory, and the host's wait for a stream that keeps the control plane moving. Shared by p2p,
// nccl and verbs; CUDA builds only (target tandem_transport_device). Streams are cudaStream_t
// passed as void*, so that this header stays CUDA-free.
//
// A wait is one single-thread kernel that spins on a 64-bit doorbell (device memory of this GPU,
// or host memory mapped into it) until it reaches the awaited seqno, until its timeout (counted
// on the GPU clock from when the stream reaches it) passes, or until the host aborts. A wait that
// gives up records which wait it was and the doorbell value seen in host-mapped memory, and every
// later wait of the same DevicePath falls through at once, so a failed step drains in
// microseconds; Sync() turns the record into a Status.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::transport {

struct DeviceWaitRecord;  // device_path_kernels.h

class DevicePath {
 public:
  // Host-mapped failure record and abort flag on CUDA device `device` (made current).
  static absl::StatusOr<std::unique_ptr<DevicePath>> Create(int device);
  ~DevicePath();
  DevicePath(const DevicePath&) = delete;
  DevicePath& operator=(const DevicePath&) = delete;

  // Enqueues on `stream` a wait until *doorbell >= seqno. `label` names who waits for what
  // ("memory rank 1: q,k,v of step 7 layer 3"); it appears in Sync()'s error if the wait expires.
  absl::Status EnqueueWait(const uint64_t* doorbell, uint64_t seqno, absl::Duration timeout,
                           std::string label, void* stream);
  // Enqueues on `stream` one kernel that copies `bytes` from `src` to `dst` (any memory this GPU
  // can address: its own, a peer's through an IPC mapping, host-mapped) and then, after a
  // system-wide fence, stores `seqno` to `doorbell` (same kinds of memory), so that a reader that
  // sees the doorbell sees the bytes. bytes may be 0 (doorbell only); no alignment needed.
  absl::Status EnqueueWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* doorbell,
                                        uint64_t seqno, void* stream);

  // Waits until the work enqueued on `stream` so far has run. Calls `pump` about every 100 us
  // (the control plane: peer failures); an error from it aborts every pending wait and is
  // returned. Returns the first expired wait as DeadlineExceeded ("<label>: waited <timeout> for
  // doorbell seqno N, it is at M"), a CUDA error, or DeadlineExceeded at `deadline` (after
  // aborting the waits). Once failed, later calls return FailedPrecondition with the first error.
  absl::Status Sync(void* stream, absl::Time deadline, const std::function<absl::Status()>& pump);

  // Makes every pending and later wait fall through (recorded as aborted).
  void Abort();

  // A failure the host met while enqueueing (a wait whose writer never signalled, a peer that
  // failed meanwhile; see the p2p transport's same-GPU waits): every pending and later wait falls
  // through, and the next Sync drains the stream and returns `status` (the first one given).
  void Fail(absl::Status status);
  // True once Fail or a failed Sync has happened: the step in progress will not succeed.
  bool failed() const { return !failure_.ok() || !pending_.ok(); }

 private:
  DevicePath() = default;

  int device_ = 0;
  DeviceWaitRecord* record_ = nullptr;      // pinned, mapped
  DeviceWaitRecord* record_dev_ = nullptr;  // its device address
  uint32_t* counters_ = nullptr;            // device: per-launch block counters of the write kernel
  uint32_t next_counter_ = 0;
  struct Wait {
    std::string label;
    uint64_t seqno;
    absl::Duration timeout;
  };
  std::vector<Wait> waits_;  // enqueued since the last Sync, by the index the kernel records
  absl::Status failure_;
  absl::Status pending_;  // from Fail, returned by the next Sync
};

}  // namespace tandem::transport
