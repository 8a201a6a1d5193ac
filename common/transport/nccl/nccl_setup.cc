// The NCCL transport: connections, communicator set-up, progress, control messages, teardown (see
// nccl_internal.h for the design).
#include "common/transport/nccl/nccl_internal.h"

namespace tandem::transport::nccl_internal {

// ---- connections and communicators --------------------------------------------------------------

// A new connection: our hello (the id of the communicator we write on), then every buffer
// registered so far. The set-up starts once the peer's hello has arrived.
absl::Status NcclTransport::OnNewPeer(PeerId peer) {
  Peer& p = MeetPeer(peer);
  HelloFrame h;
  h.key = turns_.key();
  h.checksums = checksums_ ? 1 : 0;
  const ncclResult_t r = ncclGetUniqueId(&h.id);
  if (r != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("nccl transport: ncclGetUniqueId for ", p.name, ": ",
                                               ncclGetErrorString(r), " (", ncclGetLastError(nullptr), ")"));
  }
  p.mine = h.id;
  RETURN_IF_ERROR(control().Send(peer, ToBytes(h)));
  for (const auto& [id, b] : local_) {
    DescriptorFrame d;
    d.buffer = id;
    d.bytes = b.bytes;
    RETURN_IF_ERROR(control().Send(peer, ToBytes(d)));
  }
  p.greeted = true;
  return absl::OkStatus();
}

void NcclTransport::StartNextSetup() {
  // Not while device-path work is in flight: NCCL's caution about a communicator initialised beside
  // another's transfers (a peer met between steps, a rejoin, is set up between them).
  if (job_ || !streams_.empty()) return;
  const std::optional<SetupTurns<PeerId>::Turn> turn = turns_.Next();
  if (!turn) return;
  using Action = SetupTurns<PeerId>::Action;
  const PeerId id = turn->peer;
  if (turn->action != Action::kStart) {
    TurnFrame t;
    t.magic = turn->action == Action::kPropose ? kProposeMagic : kGoMagic;
    const absl::Status sent = control().Send(id, ToBytes(t));
    if (!sent.ok()) return FailSetup(id, sent);
    if (turn->action == Action::kPropose) return;  // started when the peer's "go" arrives
  }
  InitComms(id);
}

void NcclTransport::InitComms(PeerId id) {
  Peer& p = peers_.at(id);
  // job_ first: a failure below ends the set-up (FailSetup) and with it this side's turn.
  job_ = id;
  p.setup = Setup::kInit;
  if (cudaSetDevice(device_) != cudaSuccess) {
    const cudaError_t err = cudaGetLastError();
    return FailSetup(id, CudaError(err, "cudaSetDevice", absl::StrCat("communicators with ", p.name)));
  }
  // NCCL copies the configuration; one per communicator all the same.
  ncclConfig_t send_config = NCCL_CONFIG_INITIALIZER, recv_config = NCCL_CONFIG_INITIALIZER;
  send_config.blocking = 0;
  recv_config.blocking = 0;
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) {
    const ncclResult_t a = ncclCommInitRankConfig(&p.send.comm, 2, p.mine, 0, &send_config);
    const ncclResult_t b = ncclCommInitRankConfig(&p.recv.comm, 2, p.theirs, 1, &recv_config);
    r = ncclGroupEnd();
    if (a != ncclSuccess && a != ncclInProgress) r = a;
    if (b != ncclSuccess && b != ncclInProgress) r = b;
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    FailSetup(id, NcclError(r, "ncclCommInitRankConfig", absl::StrCat("communicators with ", p.name)));
  }
}

bool NcclTransport::PhaseDone(const Peer& p, absl::Status* failure) const {
  bool done = true;
  for (const Comm* c : {&p.send, &p.recv}) {
    if (c->comm == nullptr) continue;
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(c->comm, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclInProgress) {
      done = false;
    } else if (state != ncclSuccess && failure->ok()) {
      const char* what = p.setup == Setup::kInit ? "ncclCommInitRankConfig" : "first transfer";
      *failure = NcclError(state, what, absl::StrCat(c == &p.send ? "to " : "from ", p.name));
    }
  }
  return done || !failure->ok();
}

void NcclTransport::PollSetup() {
  if (!job_) return;
  const PeerId id = *job_;
  Peer& p = peers_.at(id);
  absl::Status failure;
  if (!PhaseDone(p, &failure)) return;
  if (!failure.ok()) return FailSetup(id, failure);
  Settle(p.send.comm);
  Settle(p.recv.comm);
  if (p.setup == Setup::kConnecting) {
    p.setup = Setup::kReady;
    job_.reset();
    turns_.Ended(id);
    return;
  }
  // Initialised. The first transfer each way makes NCCL connect the two sides.
  if (cudaSetDevice(device_) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // tried again on the next poll
  }
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) {
    const ncclResult_t a = ncclSend(first_, 1, ncclUint8, 1, p.send.comm, stream_);
    const ncclResult_t b = ncclRecv(first_ + 1, 1, ncclUint8, 0, p.recv.comm, recv_stream_);
    r = ncclGroupEnd();
    if (a != ncclSuccess && a != ncclInProgress) r = a;
    if (b != ncclSuccess && b != ncclInProgress) r = b;
  }
  p.setup = Setup::kConnecting;
  if (r != ncclSuccess && r != ncclInProgress) {
    FailSetup(id, NcclError(r, "first transfer", absl::StrCat("communicators with ", p.name)));
  }
}

void NcclTransport::FailSetup(PeerId peer, absl::Status why, bool genuine) {
  Peer& p = peers_.at(peer);
  for (Comm* c : {&p.send, &p.recv}) {
    Abort(c->comm, Direction(peer, c == &p.send));
    c->comm = nullptr;
    c->abort_deferred = false;
    if (c->failure.ok()) c->failure = why;
  }
  if (p.setup != Setup::kFailed) {
    TANDEM_LOG_WARN("transport", "nccl: set-up with ", p.name, " failed: ", why.message());
    p.setup = Setup::kFailed;
    p.setup_failure = why;
  }
  if (job_ == peer) job_.reset();
  turns_.Ended(peer);
  p.incoming.clear();
  for (HostRecv& r : host_recvs_) {
    if (r.peer == peer) r.valid = false;
  }
  if (genuine && p.failure.ok()) p.failure = why;
}

absl::Status NcclTransport::FailComm(PeerId peer, bool sender, absl::Status why, bool genuine,
                                     std::vector<PendingAbort>* aborts, bool defer_abort) {
  if (job_ == peer) {
    FailSetup(peer, why);
    return why;
  }
  // Another peer's set-up job is in flight: let its current phase finish before calling into NCCL.
  if (job_) {
    Peer& other = peers_.at(*job_);
    const absl::Time until = absl::Now() + kSettleTimeout;
    absl::Status failure;
    while (!PhaseDone(other, &failure) && absl::Now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (!failure.ok()) {
      FailSetup(*job_, failure);
    } else if (!PhaseDone(other, &failure)) {
      FailSetup(*job_,
                absl::DeadlineExceededError(absl::StrCat("nccl transport: set-up with ", other.name,
                                                         " did not finish within ",
                                                         absl::FormatDuration(kSettleTimeout))),
                /*genuine=*/false);
    } else {
      Settle(other.send.comm);
      Settle(other.recv.comm);
    }
  }
  Comm& c = CommOf(peer, sender);
  if (defer_abort && c.comm != nullptr) {
    c.abort_deferred = true;  // StartDeferredAborts
  } else {
    // Aborted now, a deferred abort included (it is not left for StartDeferredAborts to repeat).
    c.abort_deferred = false;
    if (aborts != nullptr && c.comm != nullptr) {
      aborts->emplace_back(c.comm, Direction(peer, sender));
    } else {
      Abort(c.comm, Direction(peer, sender));
    }
    c.comm = nullptr;
  }
  if (c.failure.ok()) {
    c.failure = why;
    TANDEM_LOG_WARN(
        "transport", "nccl: communicator ", Direction(peer, sender),
        c.abort_deferred ? " failed (aborted once the step is enqueued): " : " aborted: ", why.message());
  }
  // Receives posted on it will never deliver their bytes.
  if (!sender) {
    peers_.at(peer).incoming.clear();
    for (HostRecv& r : host_recvs_) {
      if (r.peer == peer) r.valid = false;
    }
  }
  Peer& failed = peers_.at(peer);
  if (genuine && failed.failure.ok()) failed.failure = why;
  return why;
}

void NcclTransport::StartDeferredAborts(std::vector<PendingAbort>* aborts) {
  for (auto& [id, p] : peers_) {
    for (bool sender : {true, false}) {
      Comm& c = sender ? p.send : p.recv;
      if (!c.abort_deferred) continue;
      aborts->emplace_back(c.comm, Direction(id, sender));
      c.comm = nullptr;
      c.abort_deferred = false;
    }
  }
}

std::optional<PeerId> NcclTransport::PendingSetup() const {
  for (const auto& [id, p] : peers_) {
    if (closed_.contains(id) || not_awaited_.contains(id)) continue;
    if (p.setup != Setup::kReady && p.setup != Setup::kFailed) return id;
  }
  return std::nullopt;
}

absl::StatusOr<ncclComm_t> NcclTransport::ReadyComm(PeerId peer, bool sender) {
  if (!peers_.contains(peer)) return absl::NotFoundError(absl::StrCat("nccl transport: no peer ", peer));
  const absl::Time start = absl::Now();
  while (true) {
    const Peer& p = peers_.at(peer);
    const Comm& c = sender ? p.send : p.recv;
    if (!c.failure.ok()) return c.failure;
    if (p.setup == Setup::kReady && !job_) {
      // Other peers' set-ups first: an NCCL communicator initialised while transfers of another
      // are in flight can wait for them, and they for it (NCCL's caution about concurrent
      // communicators), so the first transfers wait until every peer met so far is set up. A peer
      // whose set-up does not finish in time is left to fail on its own. Within a step (device-path
      // work in flight) no set-up starts: those wait for the next SyncStream.
      const std::optional<PeerId> other = PendingSetup();
      if (!other || !streams_.empty()) return c.comm;
      if (absl::Now() - start > kSetupTimeout) {
        TANDEM_LOG_WARN("transport", "nccl: transfers go on while the set-up with ", peers_.at(*other).name,
                        " has not finished after ", absl::FormatDuration(kSetupTimeout), " (",
                        SetupState(peers_.at(*other), *other), ")");
        not_awaited_.insert(*other);
        continue;
      }
    } else if (absl::Now() - start > kSetupTimeout) {
      if (p.setup != Setup::kReady) {
        return absl::DeadlineExceededError(absl::StrCat(
            "nccl transport: the communicator ", Direction(peer, sender), " is not set up after ",
            absl::FormatDuration(kSetupTimeout), " (", SetupState(p, peer), ")"));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("nccl transport: the set-up of ", peers_.at(*job_).name, " kept NCCL busy for ",
                       absl::FormatDuration(kSetupTimeout), " (", SetupName(peers_.at(*job_).setup), ")"));
    }
    RETURN_IF_ERROR(Progress(kPump));
  }
}

absl::Status NcclTransport::Issued(PeerId peer, bool sender, ncclResult_t r, std::string_view call,
                                   bool device) {
  Comm& c = CommOf(peer, sender);
  if (r == ncclInProgress) {
    // The launch runs in an NCCL thread; it needs nothing from the peer, only time.
    const absl::Time until = absl::Now() + kSetupTimeout;
    while (true) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(c.comm, &state);
      r = q != ncclSuccess ? q : state;
      if (r != ncclInProgress || absl::Now() >= until) break;
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
    if (r == ncclInProgress) {
      return FailComm(peer, sender,
                      absl::DeadlineExceededError(
                          absl::StrCat("nccl transport: ", ToAbsl(call), " ", Direction(peer, sender),
                                       " was not enqueued within ", absl::FormatDuration(kSetupTimeout))),
                      true, nullptr, device);
    }
    if (r == ncclSuccess) Settle(c.comm);
  }
  if (r == ncclSuccess) return absl::OkStatus();
  return FailComm(peer, sender, NcclError(r, call, Direction(peer, sender)), true, nullptr, device);
}

absl::StatusOr<uint64_t> NcclTransport::RemoteBytes(PeerId peer, uint32_t buffer) {
  auto pit = peers_.find(peer);
  if (pit == peers_.end()) return absl::NotFoundError(absl::StrCat("nccl transport: no peer ", peer));
  const absl::Time start = absl::Now();
  while (true) {
    auto it = pit->second.remote.find(buffer);
    if (it != pit->second.remote.end()) return it->second;
    if (absl::Now() - start > kSetupTimeout) {
      return absl::DeadlineExceededError(
          absl::StrCat("nccl transport: buffer ", buffer, " of ", pit->second.name, " was never registered"));
    }
    RETURN_IF_ERROR(Progress(kPump));
  }
}

// ---- progress ---------------------------------------------------------------------------------------

absl::Status NcclTransport::Progress(absl::Duration wait) {
  RETURN_IF_ERROR(Pump(wait));
  return Advance();
}

// A frame of this transport is applied and consumed (true); anything else is the caller's (false).
absl::StatusOr<bool> NcclTransport::Consume(PeerId from, const std::vector<uint8_t>& m) {
  const uint32_t magic = MagicOf(m);
  if (magic != kHelloMagic && magic != kDescriptorMagic && magic != kWriteMagic && magic != kProposeMagic &&
      magic != kGoMagic && magic != kSettingsMagic) {
    return false;
  }
  Peer& p = MeetPeer(from);
  if (magic == kHelloMagic && m.size() >= 8) {
    HelloFrame h;
    std::memcpy(&h, m.data(), std::min(m.size(), sizeof(h)));
    if (p.setup != Setup::kAwaitingHello) {
      errors_.push_back(absl::DataLossError(absl::StrCat("nccl transport: a second hello from ", p.name)));
    } else if (h.protocol != kProtocol) {
      FailSetup(from, absl::DataLossError(absl::StrCat("nccl transport: ", p.name, " speaks protocol ",
                                                       h.protocol, ", this side ", kProtocol)));
    } else if (m.size() != sizeof(HelloFrame)) {
      FailSetup(from,
                absl::DataLossError(absl::StrCat("nccl transport: a hello of ", m.size(), " bytes from ",
                                                 p.name, " (", sizeof(HelloFrame), " expected)")));
    } else if (absl::Status s = turns_.Hello(from, h.key); !s.ok()) {
      FailSetup(from, absl::DataLossError(absl::StrCat("nccl transport: ", p.name, ": ", s.message())));
    } else {
      p.theirs = h.id;
      p.checksums = h.checksums != 0;
      p.setup = Setup::kQueued;  // taken in turn by Advance (StartNextSetup)
    }
    return true;
  }
  if (magic == kSettingsMagic && m.size() == sizeof(SettingsFrame)) {
    SettingsFrame f;
    std::memcpy(&f, m.data(), sizeof(f));
    p.checksums = f.checksums != 0;
    return true;
  }
  if ((magic == kProposeMagic || magic == kGoMagic) && m.size() == sizeof(TurnFrame)) {
    const absl::Status s = magic == kProposeMagic ? turns_.Proposed(from) : turns_.Go(from);
    if (!s.ok()) {
      FailSetup(from, absl::DataLossError(absl::StrCat("nccl transport: ", s.message(), " from ", p.name)));
    }
    return true;
  }
  if (magic == kDescriptorMagic && m.size() == sizeof(DescriptorFrame)) {
    DescriptorFrame d;
    std::memcpy(&d, m.data(), sizeof(d));
    p.remote[d.buffer] = d.bytes;
    return true;
  }
  if (magic == kWriteMagic && m.size() == sizeof(WriteFrame)) {
    WriteFrame w;
    std::memcpy(&w, m.data(), sizeof(w));
    p.incoming.push_back(w);
    return true;
  }
  return false;  // our magic at a wrong size: not a frame of ours after all
}

// Set-up failures are kept in the peer (Peer::failure, see Broken), so they do not end this early.
absl::Status NcclTransport::AdvanceWork() {
  PollSetup();
  // Asynchronous errors of the communicators in use (a lost connection, a failed kernel).
  for (auto& [id, p] : peers_) {
    if (p.setup != Setup::kReady) continue;
    for (bool sender : {true, false}) {
      const Comm& c = sender ? p.send : p.recv;
      if (c.comm == nullptr || !c.failure.ok()) continue;
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(c.comm, &state);
      if (r != ncclSuccess) state = r;
      if (state != ncclSuccess && state != ncclInProgress) {
        (void)FailComm(id, sender, NcclError(state, "communicator", Direction(id, sender)),
                       !closed_.contains(id));
      }
    }
  }
  // Announced writes are received in arrival order, while no set-up job is in flight.
  for (auto& [id, p] : peers_) {
    while (!job_ && !p.incoming.empty() && p.setup == Setup::kReady && p.recv.failure.ok()) {
      const WriteFrame w = p.incoming.front();
      p.incoming.pop_front();
      RETURN_IF_ERROR(PostReceive(id, w));
    }
  }
  StartNextSetup();
  return CompleteReceives();
}

absl::Status NcclTransport::PostReceive(PeerId peer, const WriteFrame& w) {
  Peer& p = peers_.at(peer);
  HostRecv r;
  r.peer = peer;
  r.buffer = w.buffer;
  r.seqno = w.seqno;
  void* dst = nullptr;
  std::string problem;
  auto it = local_.find(w.buffer);
  if (it == local_.end()) {
    problem = "no such buffer";
  } else if (w.offset > it->second.bytes || w.bytes > it->second.bytes - w.offset) {
    problem = absl::StrCat("outside the buffer's ", it->second.bytes, " bytes");
  } else if (w.seqno == 0) {
    problem = "seqno 0";
  } else {
    dst = it->second.base + w.offset;
  }
  if (!problem.empty()) {
    absl::Status refused = absl::DataLossError(absl::StrCat("nccl transport: refused a write from ", p.name,
                                                            " to buffer ", w.buffer, " at offset ", w.offset,
                                                            ", length ", w.bytes, ": ", problem));
    TANDEM_LOG_WARN("transport", refused.message());
    errors_.push_back(refused);
    r.valid = false;
    if (w.bytes > kMaxDrainBytes) {
      // Too large to drain: the transfers from this peer can no longer be matched.
      (void)FailComm(peer, false, refused, false);
      return absl::OkStatus();
    }
    if (w.bytes > 0) {
      RETURN_IF_ERROR(Grow(&scratch_, &scratch_bytes_, w.bytes, recv_stream_));
      dst = scratch_;
    }
  }
  if (w.bytes > 0) {
    NCCL_T_CUDA(cudaSetDevice(device_), p.name);
    RETURN_IF_ERROR(
        Issued(peer, false, ncclRecv(dst, w.bytes, ncclUint8, 0, p.recv.comm, recv_stream_), "ncclRecv"));
    ASSIGN_OR_RETURN(r.done, RecordEvent(recv_stream_, p.name));
  }
  host_recvs_.push_back(r);
  return absl::OkStatus();
}

absl::Status NcclTransport::CompleteReceives() {
  while (!host_recvs_.empty()) {
    HostRecv& r = host_recvs_.front();
    if (r.done != nullptr) {
      const cudaError_t q = cudaEventQuery(r.done);
      if (q == cudaErrorNotReady) break;
      if (q != cudaSuccess) {
        (void)cudaGetLastError();
        return CudaError(q, "cudaEventQuery", absl::StrCat("a write from ", peers_.at(r.peer).name));
      }
      ReleaseEvent(r.done);
    }
    if (r.valid) {
      uint64_t& doorbell = local_.at(r.buffer).doorbell;
      doorbell = std::max(doorbell, r.seqno);
    }
    host_recvs_.pop_front();
  }
  return absl::OkStatus();
}

bool NcclTransport::Busy() const {
  if (!host_recvs_.empty()) return true;
  if (job_) return true;
  for (const auto& [id, p] : peers_) {
    if (p.setup == Setup::kQueued || !p.incoming.empty()) return true;
  }
  return false;
}

// ---- control messages and buffers -----------------------------------------------------------------

absl::Status NcclTransport::Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) {
  while (true) {
    if (!errors_.empty()) return TakeError();
    if (TakeKept(from, message)) return absl::OkStatus();
    RETURN_IF_ERROR(Advance());
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("nccl transport: no message from any of ",
                                                      peers_.size(), " peers before the deadline"));
    }
    const absl::Status s = control().Receive(from, message, std::min(deadline, now + WaitFor(deadline)));
    if (absl::IsDeadlineExceeded(s)) continue;
    RETURN_IF_ERROR(s);
    RETURN_IF_ERROR(Greet(*from));
    ASSIGN_OR_RETURN(const bool ours, Consume(*from, *message));
    if (!ours) return absl::OkStatus();
  }
}

absl::Status NcclTransport::RegisterBuffer(uint32_t id, void* base, size_t bytes) {
  if (local_.contains(id)) {
    return absl::AlreadyExistsError(absl::StrCat("nccl transport: buffer ", id, " is registered"));
  }
  if (base == nullptr || bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: buffer ", id, " is empty"));
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, base) != cudaSuccess) {
    (void)cudaGetLastError();
    attr.type = cudaMemoryTypeUnregistered;
  }
  if (attr.type != cudaMemoryTypeDevice || attr.device != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl transport: buffer ", id, " must be device memory of cuda:", device_));
  }
  // The ring its peers' checksum entries are received into (zeroed: seqno 0 is never awaited).
  ChecksumEntry* entries = nullptr;
  const size_t ring = kChecksumRing * sizeof(ChecksumEntry);
  NCCL_T_CUDA(cudaSetDevice(device_), absl::StrCat("buffer ", id));
  NCCL_T_CUDA(cudaMalloc(&entries, ring), absl::StrCat("the checksum entries of buffer ", id));
  if (const cudaError_t e = cudaMemset(entries, 0, ring); e != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFree(entries);
    return CudaError(e, "cudaMemset", absl::StrCat("the checksum entries of buffer ", id));
  }
  local_[id] = Local{.base = static_cast<uint8_t*>(base), .bytes = bytes, .entries = entries};
  DescriptorFrame d;
  d.buffer = id;
  d.bytes = bytes;
  for (const auto& [peer, p] : peers_) {
    const absl::Status sent = control().Send(peer, ToBytes(d));
    if (!sent.ok() && !closed_.contains(peer))
      return sent;  // a closed peer may be gone (a lost rank): none of its concern
  }
  return absl::OkStatus();
}

void NcclTransport::SetDeviceChecksums(bool on) {
  if (on == checksums_) return;
  checksums_ = on;
  SettingsFrame f;
  f.checksums = on ? 1 : 0;
  for (const auto& [peer, p] : peers_) {
    // A peer whose connection failed hears nothing more from us anyway (its failure is reported
    // by the next operation on it).
    if (p.greeted) (void)control().Send(peer, ToBytes(f));
  }
}

// ---- CUDA resources ---------------------------------------------------------------------------------

absl::StatusOr<cudaEvent_t> NcclTransport::RecordEvent(cudaStream_t stream, std::string_view context) {
  cudaEvent_t e = nullptr;
  if (!free_events_.empty()) {
    e = free_events_.back();
    free_events_.pop_back();
  } else {
    NCCL_T_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), context);
  }
  const cudaError_t err = cudaEventRecord(e, stream);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    cudaEventDestroy(e);
    return CudaError(err, "cudaEventRecord", context);
  }
  return e;
}

// Stream-ordered (re)allocation: no device-wide synchronisation, which could wait on NCCL kernels
// of the device path that wait for this very call to make progress.
absl::Status NcclTransport::Grow(void** buffer, uint64_t* size, uint64_t bytes, cudaStream_t stream) {
  if (*size >= bytes) return absl::OkStatus();
  uint64_t want = std::max<uint64_t>(*size * 2, uint64_t{1} << 20);
  while (want < bytes) want *= 2;
  if (*buffer != nullptr) NCCL_T_CUDA(cudaFreeAsync(*buffer, stream), "");
  *buffer = nullptr;
  *size = 0;
  NCCL_T_CUDA(cudaMallocAsync(buffer, want, stream), absl::StrCat(want, " bytes"));
  *size = want;
  return absl::OkStatus();
}

NcclTransport::~NcclTransport() {
  cudaSetDevice(device_);
  // A set-up in flight is abandoned; communicators with work that can no longer complete are
  // aborted; the others are finalized (all started together, so that two processes tearing down at
  // once do not wait for each other in turn) and destroyed. All of it on a helper thread, bounded.
  struct Teardown {
    ncclComm_t comm;
    bool finalize;
    std::string who;
  };
  std::vector<Teardown> comms;
  std::set<std::pair<PeerId, bool>> stuck;
  for (const HostRecv& r : host_recvs_) stuck.insert({r.peer, false});
  for (const auto& [stream, work] : streams_) {
    for (PeerId p : work.sends_to) stuck.insert({p, true});
    for (PeerId p : work.receives_from) stuck.insert({p, false});
  }
  size_t left = 0;
  for (auto& [id, p] : peers_) {
    for (bool sender : {true, false}) {
      Comm& c = sender ? p.send : p.recv;
      if (c.comm == nullptr) continue;
      if (closed_.contains(id)) {
        // The peer said goodbye and is tearing down (or gone) on its own schedule: NCCL's finalize,
        // destroy and abort all wait on it, and a teardown cut short by the bound below leaves an
        // NCCL thread that crashes when the process exits (seen on 4×H200 with NCCL 2.28). Its
        // communicators are left to the process's exit instead.
        c.comm = nullptr;
        ++left;
        continue;
      }
      const bool finalize =
          !(job_ == id) && p.setup == Setup::kReady && !stuck.contains({id, sender}) && c.failure.ok();
      comms.push_back({c.comm, finalize, Direction(id, sender)});
      c.comm = nullptr;
    }
  }
  job_.reset();
  if (left > 0)
    TANDEM_LOG_DEBUG("transport", "nccl: ", left, " communicator(s) of closed peers left to exit");
  const int device = device_;
  auto teardown = [comms, device] {
    cudaSetDevice(device);
    std::vector<ncclResult_t> state(comms.size(), ncclSuccess);
    for (size_t i = 0; i < comms.size(); ++i) {
      if (comms[i].finalize) state[i] = ncclCommFinalize(comms[i].comm);
    }
    const absl::Time until = absl::Now() + kFinalizeTimeout;
    for (size_t i = 0; i < comms.size(); ++i) {
      if (!comms[i].finalize) continue;
      while (state[i] == ncclInProgress && absl::Now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(comms[i].comm, &state[i]) != ncclSuccess) state[i] = ncclInternalError;
      }
      if (state[i] == ncclInProgress) {
        TANDEM_LOG_WARN("transport", "nccl: the communicator ", comms[i].who, " did not finalize within ",
                        absl::FormatDuration(kFinalizeTimeout), "; aborting it");
      }
    }
    for (size_t i = 0; i < comms.size(); ++i) {
      if (comms[i].finalize && state[i] == ncclSuccess) {
        ncclCommDestroy(comms[i].comm);
      } else {
        ncclCommAbort(comms[i].comm);
      }
    }
    (void)cudaGetLastError();
  };
  const bool done = comms.empty() || RunBounded(teardown, kCloseTimeout, "tearing down the communicators");
  for (HostRecv& r : host_recvs_) {
    if (r.done != nullptr) cudaEventDestroy(r.done);
  }
  for (auto& [stream, work] : streams_) {
    for (DeviceWait& w : work.waits) {
      cudaEventDestroy(w.before);
      cudaEventDestroy(w.after);
    }
    for (auto& [peer, sent] : work.sent) cudaEventDestroy(sent);
  }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  bool idle = false;
  if (done) {
    // Bounded waits: an aborted communicator's kernels return by themselves.
    // (cudaFree synchronises the device, so first_ is freed only once every stream is idle.)
    const absl::Time until = absl::Now() + kDrainTimeout;
    idle = true;
    std::vector<cudaStream_t> ours = {stream_, recv_stream_};
    for (const auto& [id, p] : peers_) ours.push_back(p.send_stream);
    for (cudaStream_t s : ours) {
      if (s == nullptr) continue;
      if (s == stream_ && staging_ != nullptr) cudaFreeAsync(staging_, s);
      if (s == recv_stream_ && scratch_ != nullptr) cudaFreeAsync(scratch_, s);
      while (cudaStreamQuery(s) == cudaErrorNotReady && absl::Now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (cudaStreamQuery(s) == cudaErrorNotReady) idle = false;
      cudaStreamDestroy(s);
    }
    if (idle) {
      if (first_ != nullptr) cudaFree(first_);
      for (const auto& [id, b] : local_) cudaFree(b.entries);
      for (const auto& [id, p] : peers_) cudaFree(p.sent_entry);
    }
  }
  // Otherwise NCCL may still use the streams and buffers: they are leaked with its communicators,
  // and so is the check kernels' state (its destructor synchronises the device, which kernels left
  // running would hold up).
  if (!idle) (void)checks_.release();
  (void)cudaGetLastError();
  ResetControl();
}

}  // namespace tandem::transport::nccl_internal
