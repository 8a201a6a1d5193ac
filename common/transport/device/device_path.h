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
// later wait of the same DevicePath falls through at once, and so does every later write (nothing
// leaves this process once its step has failed), so a failed step drains in microseconds; Sync()
// turns the record into a Status. Reset() makes the path usable again for a rerun.
//
// Payload checksums (payload_checksum.h): the write kernel can store the checksum of what it
// copied, with its seqno, into an entry the receiver owns (beside its doorbell), and the
// receiver's EnqueueVerify recomputes it over the landed bytes after the wait; a mismatch fails
// like an expired wait (DataLoss from Sync, naming the wait's label). The check runs on a side
// stream of the caller's (unless asked not to), beside whatever the caller enqueues next (the
// consumer of the bytes), so
// the stream does not pay a kernel launch for it; the caller's stream joins its checks before its
// next write (the write that lets the peer send again into the buffer checked) and at Sync, so a
// step never ends unchecked and a buffer is never rewritten under its check. A payload found bad
// after its consumer read it fails the step all the same, before the step's results are used.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::transport {

struct DeviceWaitRecord;  // device_path_kernels.h
struct ChecksumEntry;     // payload_checksum.h

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
  // sees the doorbell sees the bytes. bytes may be 0 (doorbell only); no alignment needed. With
  // `checksum` (an entry in the same kinds of memory), {seqno, checksum of the bytes} is stored
  // there before the doorbell.
  absl::Status EnqueueWriteWithDoorbell(void* dst, const void* src, size_t bytes, uint64_t* doorbell,
                                        uint64_t seqno, void* stream, ChecksumEntry* checksum = nullptr);
  // Enqueues on `stream` the check of the `bytes` at `data` (this GPU's memory) against `entry`,
  // which the write of `seqno` filled: Sync() returns DataLoss naming `label` when the checksum
  // differs, or when the entry holds another seqno (the writer ran a ring ahead, or never stored
  // one); a mismatch after an earlier failed wait is not reported (the wait is). Enqueue it after
  // the wait for that write.
  // `beside`: on the side stream (below), else on `stream` itself (for a writer that shares this
  // GPU from another process: there a stream blocked on an event of the other process's lets the
  // GPU's time slices between the two contexts run out idle, measured at 2 ms a message).
  absl::Status EnqueueVerify(const void* data, size_t bytes, const ChecksumEntry* entry, uint64_t seqno,
                             std::string label, void* stream, bool beside = true);
  // Enqueues on `stream` the checksum of the `bytes` at `src` (this GPU's memory), stored with
  // `seqno` into `entry` (memory this GPU can write): the entry a transport that moves the payload
  // itself (nccl) sends after it, for the receiver's EnqueueVerify. Runs whatever the path's state
  // (the transport decides whether the payload goes out).
  absl::Status EnqueueChecksum(const void* src, size_t bytes, uint64_t seqno, ChecksumEntry* entry,
                               void* stream);
  // Makes `stream` wait for the checks enqueued beside it so far (EnqueueVerify). A transport
  // whose writes do not go through EnqueueWriteWithDoorbell calls it before each write that lets
  // the peer send again into a buffer checked beside the stream.
  absl::Status JoinChecks(void* stream) { return Join(stream); }

  // Waits until the work enqueued on `stream` so far has run. Calls `pump` about every 100 us
  // (the control plane: peer failures); an error from it aborts every pending wait and is
  // returned. Returns the first expired wait as DeadlineExceeded ("<label>: waited <timeout> for
  // doorbell seqno N, it is at M"), a CUDA error, or DeadlineExceeded at `deadline` (after
  // aborting the waits). Once failed, later calls return FailedPrecondition with the first error (until
  // Reset).
  absl::Status Sync(void* stream, absl::Time deadline, const std::function<absl::Status()>& pump);

  // Makes every pending and later wait fall through (recorded as aborted).
  void Abort();

  // A failure the host met while enqueueing (a wait whose writer never signalled, a peer that
  // failed meanwhile; see the p2p transport's same-GPU waits): every pending wait falls through,
  // later waits, writes and checks are not enqueued, and the next Sync drains the stream and
  // returns `status` (the first one given).
  void Fail(absl::Status status);
  // True once Fail or a failed Sync has happened: the step in progress will not succeed.
  bool failed() const { return !failure_.ok() || !pending_.ok(); }

  // Makes a failed path usable again for the next step (a rerun): once `stream` and its side
  // stream have drained (within a second: FailedPrecondition otherwise, and the path stays
  // failed), the failure record, the abort flag and the kernels' device state are cleared. Waits
  // and writes of the failed step must not be pending anywhere: Sync drained them.
  absl::Status Reset(void* stream);

 private:
  DevicePath() = default;

  int device_ = 0;
  DeviceWaitRecord* record_ = nullptr;      // pinned, mapped
  DeviceWaitRecord* record_dev_ = nullptr;  // its device address
  uint32_t* counters_ = nullptr;            // device: per-launch block counters of the write kernel
  unsigned long long* sums_ = nullptr;      // device: per-launch checksum sums, beside the counters
  uint32_t* failed_flag_ = nullptr;         // device: the record's failure code, for the kernels
  uint32_t next_counter_ = 0;
  // A caller stream's side stream for checks, with the events that fork it from and join it back
  // to the caller's stream (cudaStream_t / cudaEvent_t, kept as void* like the streams here).
  struct Side {
    void* stream = nullptr;
    void* fork = nullptr;
    void* done = nullptr;
    bool pending = false;  // checks enqueued since the caller's stream last joined them
  };
  std::map<void*, Side> sides_;  // by caller stream
  // Makes `stream` wait for the checks enqueued on its side stream so far.
  absl::Status Join(void* stream);
  struct Wait {
    std::string label;
    uint64_t seqno;
    absl::Duration timeout;
    size_t bytes = 0;  // a checksum check's payload
  };
  std::vector<Wait> waits_;  // enqueued since the last Sync, by the index the kernel records
  absl::Status failure_;
  absl::Status pending_;  // from Fail, returned by the next Sync
};

}  // namespace tandem::transport
