// The NCCL transport's device path: receives enqueued on the caller's stream, sends on a stream per peer
// ordered after the caller's, watched from the host (see nccl_internal.h for the design).
#include "absl/strings/str_join.h"
#include "common/transport/nccl/nccl_internal.h"

namespace tandem::transport::nccl_internal {
namespace {

// A payload and, when `entry` is not null, its checksum entry after it, as one NCCL group (one
// launch; the peer's matching call receives both in the same order).
ncclResult_t Transfer(bool send, void* payload, size_t bytes, ChecksumEntry* entry, ncclComm_t comm,
                      cudaStream_t stream) {
  auto one = [&](void* p, size_t n) {
    return send ? ncclSend(p, n, ncclUint8, 1, comm, stream) : ncclRecv(p, n, ncclUint8, 0, comm, stream);
  };
  if (entry == nullptr) return one(payload, bytes);
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return r;
  const ncclResult_t a = one(payload, bytes);
  const ncclResult_t b = one(entry, sizeof(ChecksumEntry));
  r = ncclGroupEnd();  // ends the group even when a call in it failed
  if (a != ncclSuccess && a != ncclInProgress) return a;
  if (b != ncclSuccess && b != ncclInProgress) return b;
  return r;
}

}  // namespace

// ---- device path ----------------------------------------------------------------------------------

absl::Status NcclTransport::EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src,
                                         size_t bytes, uint64_t seqno, void* stream) {
  if (!device_failure_.ok()) return DeviceFailed();
  if (seqno == 0) return absl::InvalidArgumentError("nccl transport: EnqueueWrite with seqno 0");
  ASSIGN_OR_RETURN(const uint64_t size, RemoteBytes(peer, buffer));
  const std::string& name = peers_.at(peer).name;
  if (offset > size || bytes > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: device write of ", bytes,
                                                   " bytes at offset ", offset, " outside buffer ", buffer,
                                                   " (", size, " bytes) of ", name));
  }
  if (bytes == 0) return absl::OkStatus();  // nothing to match: the receiver enqueues no receive either
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, src) != cudaSuccess) {
    (void)cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) || attr.device != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl transport: EnqueueWrite's source must be device memory of cuda:", device_));
  }
  if (LeftOut(peer, true, stream)) return absl::OkStatus();
  ASSIGN_OR_RETURN(ncclComm_t comm, ReadyComm(peer, true));
  NCCL_T_CUDA(cudaSetDevice(device_), name);
  ASSIGN_OR_RETURN(cudaStream_t send, SendStream(peer));
  // A write may let the peer send again into a buffer of ours whose check runs beside the stream.
  RETURN_IF_ERROR(checks_->JoinChecks(stream));
  // The send runs on the peer's send stream once the caller's stream has reached this point (the
  // source is written by then); the caller's stream goes on without waiting for the peer.
  ASSIGN_OR_RETURN(cudaEvent_t reached, RecordEvent(static_cast<cudaStream_t>(stream), name));
  const cudaError_t waited = cudaStreamWaitEvent(send, reached, 0);
  ReleaseEvent(reached);  // the wait holds what it captured; the event may be recorded again
  if (waited != cudaSuccess) {
    (void)cudaGetLastError();
    return CudaError(waited, "cudaStreamWaitEvent", name);
  }
  StreamWork& work = streams_[stream];
  work.sends_to.insert(peer);
  ChecksumEntry* entry = checksums_ ? peers_.at(peer).sent_entry : nullptr;
  if (entry != nullptr) RETURN_IF_ERROR(checks_->EnqueueChecksum(src, bytes, seqno, entry, send));
  const absl::Status issued =
      Issued(peer, true, Transfer(true, const_cast<void*>(src), bytes, entry, comm, send), "ncclSend", true);
  if (!issued.ok()) return LeftOut(peer, true, stream) ? absl::OkStatus() : issued;
  ASSIGN_OR_RETURN(cudaEvent_t sent, RecordEvent(send, name));
  auto [it, first] = work.sent.try_emplace(peer, sent);
  if (!first) {
    ReleaseEvent(it->second);  // this send completes after that one
    it->second = sent;
  }
  return absl::OkStatus();
}

absl::Status NcclTransport::EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes,
                                        uint64_t seqno, absl::Duration timeout, const std::string& label,
                                        void* stream) {
  if (!device_failure_.ok()) return DeviceFailed();
  auto it = local_.find(buffer);
  if (it == local_.end()) return absl::NotFoundError(absl::StrCat("nccl transport: no buffer ", buffer));
  if (!peers_.contains(peer)) return absl::NotFoundError(absl::StrCat("nccl transport: no peer ", peer));
  if (seqno == 0) return absl::InvalidArgumentError("nccl transport: EnqueueWait with seqno 0");
  if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: ", label, ": a wait for ", bytes,
                                                   " bytes at offset ", offset, " outside buffer ", buffer,
                                                   " (", it->second.bytes, " bytes)"));
  }
  for (const auto& [other, work] : streams_) {
    if (other != stream && work.receives_from.contains(peer)) {
      // NCCL would match them in the order issued, not the order the streams reach them.
      return absl::InvalidArgumentError(absl::StrCat(
          "nccl transport: ", label, ": receives from ", peers_.at(peer).name,
          " are enqueued on another stream that was not synchronised since (one stream per peer)"));
    }
  }
  if (LeftOut(peer, false, stream)) return absl::OkStatus();
  ASSIGN_OR_RETURN(ncclComm_t comm, ReadyComm(peer, false));
  const std::string& name = peers_.at(peer).name;
  NCCL_T_CUDA(cudaSetDevice(device_), name);
  auto s = static_cast<cudaStream_t>(stream);
  DeviceWait w;
  w.peer = peer;
  w.buffer = buffer;
  w.seqno = seqno;
  w.timeout = timeout;
  w.label = label;
  ASSIGN_OR_RETURN(w.before, RecordEvent(s, name));
  StreamWork& work = streams_[stream];
  work.receives_from.insert(peer);
  // The peer's payloads come with their checksum entries when it said so (its hello or settings).
  ChecksumEntry* entry =
      bytes > 0 && peers_.at(peer).checksums ? it->second.entries + seqno % kChecksumRing : nullptr;
  if (bytes > 0) {
    const absl::Status issued = Issued(
        peer, false, Transfer(false, it->second.base + offset, bytes, entry, comm, s), "ncclRecv", true);
    if (!issued.ok()) {
      cudaEventDestroy(w.before);
      return LeftOut(peer, false, stream) ? absl::OkStatus() : issued;
    }
  }
  if (entry != nullptr && checksums_) {
    absl::Status checked = checks_->EnqueueVerify(it->second.base + offset, bytes, entry, seqno, label, s);
    if (!checked.ok()) {
      cudaEventDestroy(w.before);
      return checked;
    }
  }
  absl::StatusOr<cudaEvent_t> after = RecordEvent(s, name);
  if (!after.ok()) {
    cudaEventDestroy(w.before);
    return after.status();
  }
  w.after = *after;
  work.waits.push_back(std::move(w));
  return absl::OkStatus();
}

absl::Status NcclTransport::SyncStream(void* stream, absl::Time deadline) {
  if (!device_failure_.ok()) return DeviceFailed();
  NCCL_T_CUDA(cudaSetDevice(device_), "SyncStream");
  auto caller = static_cast<cudaStream_t>(stream);
  StreamWork& work = streams_[stream];
  RETURN_IF_ERROR(checks_->JoinChecks(stream));  // the step's payload checks are part of it
  // The stream's sends ran on the peers' send streams: joined here, after everything the stream
  // enqueued, so that `done` covers them (and a drain after an abort waits for them too).
  for (const auto& [peer, sent] : work.sent) {
    NCCL_T_CUDA(cudaStreamWaitEvent(caller, sent, 0),
                absl::StrCat("SyncStream, the sends to ", peers_.at(peer).name));
  }
  ASSIGN_OR_RETURN(cudaEvent_t done, RecordEvent(caller, "SyncStream"));
  auto last_poll = std::chrono::steady_clock::now();
  while (true) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) break;
    absl::Status s;
    std::set<PeerId> lost;     // the peers blamed: their communicators are aborted, the rest drain
    bool drain_first = false;  // nothing blamed, but the transfers may still finish (the caller's poll)
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      s = CudaError(q, "cudaEventQuery", "SyncStream");
    }
    // The control plane and set-ups move on. A failure of a peer this stream does not use, which
    // the pump reports until the caller closes that peer, is not the stream's (its transfers with
    // the others still complete, or their waits expire): it is the caller's to find (a compute
    // replica's loss, found by compute rank 0 from the replica's own messages), so the stream goes
    // on; a failed peer of the stream is blamed below.
    if (s.ok() && !Pump(kPump).ok()) std::this_thread::sleep_for(absl::ToChronoMicroseconds(kPump));
    if (s.ok()) s = AdvanceWork();
    // A peer of the stream that failed: its communicator reported an error, or its connection did
    // (a process that died: NCCL's kernels may not notice it, the control plane does).
    auto blame = [&](PeerId p, const absl::Status& why) {
      if (why.ok()) return;
      lost.insert(p);
      if (s.ok()) s = why;
    };
    for (PeerId p : work.sends_to) blame(p, CommOf(p, true).failure);
    for (PeerId p : work.receives_from) blame(p, CommOf(p, false).failure);
    for (PeerId p : work.sends_to) blame(p, ControlPlaneTransport::PeerStatus(p));
    for (PeerId p : work.receives_from) blame(p, ControlPlaneTransport::PeerStatus(p));
    if (s.ok()) {
      std::optional<PeerId> culprit;
      s = CheckWaits(work, &culprit);
      if (culprit) lost.insert(*culprit);
    }
    if (s.ok() && poll_ && std::chrono::steady_clock::now() - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = std::chrono::steady_clock::now();
      s = poll_();
      drain_first = !s.ok();
    }
    if (s.ok() && absl::Now() >= deadline) {
      std::string pending;
      for (const DeviceWait& w : work.waits) {
        if (!w.done) {
          pending = absl::StrCat("; first pending wait: ", w.label, " (seqno ", w.seqno, ")");
          lost.insert(w.peer);
          break;
        }
      }
      for (const auto& [peer, sent] : work.sent) {
        if (!pending.empty()) break;
        const cudaError_t sq = cudaEventQuery(sent);
        if (sq == cudaSuccess) continue;
        (void)cudaGetLastError();
        pending = absl::StrCat("; a send to ", peers_.at(peer).name, " was not received");
        lost.insert(peer);
      }
      s = absl::DeadlineExceededError(
          absl::StrCat("nccl transport: the stream's work did not finish before the deadline", pending));
    }
    if (!s.ok()) return FailStream(stream, done, std::move(s), lost, drain_first);
  }
  // Every transfer completed; the payloads' checks ran with them: a mismatch fails the step (DataLoss
  // naming the wait), with nothing left in flight.
  const absl::Status checked = checks_->Sync(stream, deadline, {});
  if (!checked.ok()) {
    device_failure_ = checked;
    TANDEM_LOG_WARN("transport", "nccl: device path failed: ", checked.message());
  }
  for (DeviceWait& w : work.waits) {
    uint64_t& doorbell = local_.at(w.buffer).doorbell;
    doorbell = std::max(doorbell, w.seqno);
    ReleaseEvent(w.before);
    ReleaseEvent(w.after);
  }
  for (const auto& [peer, sent] : work.sent) ReleaseEvent(sent);
  streams_.erase(stream);
  ReleaseEvent(done);
  return checked;
}

// The waits of one stream complete in stream order: the first one not yet done decides.
absl::Status NcclTransport::CheckWaits(StreamWork& work, std::optional<PeerId>* culprit) {
  const absl::Time now = absl::Now();
  for (DeviceWait& w : work.waits) {
    if (w.done) continue;
    if (!w.reached) {
      const cudaError_t q = cudaEventQuery(w.before);
      if (q == cudaErrorNotReady) return absl::OkStatus();
      if (q != cudaSuccess) {
        (void)cudaGetLastError();
        return CudaError(q, "cudaEventQuery", w.label);
      }
      w.reached = now;
    }
    const cudaError_t q = cudaEventQuery(w.after);
    if (q == cudaSuccess) {
      w.done = true;
      uint64_t& doorbell = local_.at(w.buffer).doorbell;
      doorbell = std::max(doorbell, w.seqno);
      continue;
    }
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return CudaError(q, "cudaEventQuery", w.label);
    }
    if (now - *w.reached > w.timeout) {
      *culprit = w.peer;
      return absl::DeadlineExceededError(absl::StrCat(w.label, ": waited ", absl::FormatDuration(w.timeout),
                                                      " for seqno ", w.seqno, " (buffer ", w.buffer, " from ",
                                                      peers_.at(w.peer).name, "; its doorbell is at ",
                                                      local_.at(w.buffer).doorbell, ")"));
    }
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

// A failed step: the peers to blame lose their communicators (their kernels return at once), and the
// stream runs through. Every rank enqueued its whole step and NCCL matches a communicator's
// transfers in order, so once the lost peer's transfers have returned (a receive from it with
// whatever its buffer held), the transfers with the healthy peers still match one for one: their
// communicators end the step in step with each other and serve a rerun (ResetDevicePath). A
// stream that does not drain so (a healthy peer that stopped too, a wait with nobody to blame)
// has every communicator it uses aborted, as the last resort; the device path then stays failed.
absl::Status NcclTransport::FailStream(void* stream, cudaEvent_t done, absl::Status why,
                                       const std::set<PeerId>& lost, bool drain_first) {
  device_failure_ = why;
  StreamWork& work = streams_[stream];
  std::string names;
  for (PeerId p : lost) absl::StrAppend(&names, names.empty() ? "" : ", ", peers_.at(p).name);
  TANDEM_LOG_WARN("transport", "nccl: device path failed: ", why.message(),
                  lost.empty() ? std::string()
                               : absl::StrCat("; the communicators with ", names,
                                              " are aborted and the step's other transfers run through"));
  const absl::Status aborted = absl::FailedPreconditionError(
      absl::StrCat("nccl transport: communicator aborted after a device-path failure: ", why.message()));
  // The aborts run at once and the stream drains meanwhile: an abort's kernels return as soon as it
  // has begun, but the abort itself may wait seconds for a stopped peer, and the healthy peers'
  // deadlines (twice the step timeout) leave no room to do them one after another.
  std::vector<PendingAbort> aborts;
  StartDeferredAborts(&aborts);  // those that failed while the step was enqueued (their peers are in `lost`)
  for (PeerId p : lost) {
    for (bool sender : {true, false}) {
      if (CommOf(p, sender).failure.ok()) (void)FailComm(p, sender, aborted, false, &aborts);
    }
  }
  // The stream waits for its sends too (SyncStream joined them).
  bool drained = (!lost.empty() || drain_first) && Drain(done, kDrainTimeout);
  FinishAborts(aborts);
  if (!drained) {
    std::vector<std::string> others;
    for (bool sender : {true, false}) {
      for (PeerId p : sender ? work.sends_to : work.receives_from) {
        if (!CommOf(p, sender).failure.ok()) continue;
        (void)FailComm(p, sender, aborted, false, &aborts);
        if (!lost.contains(p)) others.push_back(Direction(p, sender));
      }
    }
    if (!others.empty()) {
      reset_refused_ = absl::FailedPreconditionError(absl::StrCat(
          "nccl transport: the failed step did not drain within ", absl::FormatDuration(kDrainTimeout),
          ", so the communicators ", absl::StrJoin(others, ", "), " were aborted too (", why.message(), ")"));
      TANDEM_LOG_WARN("transport", "nccl: ", reset_refused_.message());
    }
    drained = Drain(done, kDrainTimeout);
    FinishAborts(aborts);
  }
  if (!drained && reset_refused_.ok()) {
    reset_refused_ = absl::FailedPreconditionError(absl::StrCat(
        "nccl transport: the failed step's stream did not drain after its communicators were aborted (",
        why.message(), ")"));
  }
  cudaEventDestroy(done);
  for (DeviceWait& w : work.waits) {
    cudaEventDestroy(w.before);
    cudaEventDestroy(w.after);
  }
  for (const auto& [peer, sent] : work.sent) cudaEventDestroy(sent);
  streams_.erase(stream);
  return why;
}

absl::Status NcclTransport::ResetDevicePath(void* stream) {
  if (!reset_refused_.ok()) return reset_refused_;
  NCCL_T_CUDA(cudaSetDevice(device_), "ResetDevicePath");
  {
    // A step left without its SyncStream: the communicators that failed while it was enqueued.
    std::vector<PendingAbort> aborts;
    StartDeferredAborts(&aborts);
    FinishAborts(aborts);
  }
  // Nothing of the failed step may still run: the stream (with the sends it joined) has drained.
  auto caller = static_cast<cudaStream_t>(stream);
  const absl::Time until = absl::Now() + absl::Seconds(1);
  cudaError_t q = cudaErrorNotReady;
  while ((q = cudaStreamQuery(caller)) == cudaErrorNotReady && absl::Now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  if (q != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "nccl transport: ResetDevicePath: the stream has not drained (", cudaGetErrorName(q), ")"));
  }
  // Work enqueued since the last SyncStream (a step left without one) has run: forgotten.
  // Checked before anything is released: a refusal leaves the entry as it was.
  if (auto it = streams_.find(stream); it != streams_.end()) {
    for (const auto& [peer, sent] : it->second.sent) {
      if (cudaEventQuery(sent) != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::FailedPreconditionError(absl::StrCat("nccl transport: ResetDevicePath: a send to ",
                                                          peers_.at(peer).name, " is still in flight"));
      }
    }
    for (DeviceWait& w : it->second.waits) {
      ReleaseEvent(w.before);
      ReleaseEvent(w.after);
    }
    for (const auto& [peer, sent] : it->second.sent) ReleaseEvent(sent);
    streams_.erase(it);
  }
  RETURN_IF_ERROR(checks_->Reset(stream));  // the checks' record and state, with the side streams drained
  device_failure_ = absl::OkStatus();
  return absl::OkStatus();
}

absl::StatusOr<cudaStream_t> NcclTransport::SendStream(PeerId peer) {
  Peer& p = peers_.at(peer);
  if (p.send_stream == nullptr) {
    if (p.sent_entry == nullptr) {
      NCCL_T_CUDA(cudaMalloc(&p.sent_entry, sizeof(ChecksumEntry)),
                  absl::StrCat("a checksum entry for ", p.name));
    }
    NCCL_T_CUDA(cudaStreamCreateWithFlags(&p.send_stream, cudaStreamNonBlocking),
                absl::StrCat("the send stream to ", p.name));
  }
  return p.send_stream;
}

}  // namespace tandem::transport::nccl_internal
