// The NCCL transport (DESIGN.md, "Transports"): payloads move as NCCL point-to-point transfers
// between device buffers, on one host (NVLink, PCIe) or across hosts (InfiniBand, RoCE, sockets:
// whatever NCCL finds). Registered buffers are device memory of this process's GPU.
//
// Control plane. Connections, control messages and peer-failure detection are the UCX
// transport's (an inner transport this one wraps, as the p2p transport does). This transport's
// own frames travel on that channel and are consumed inside its calls; the caller's messages
// that arrive meanwhile are kept for Receive. Frames (fixed layout, magic first):
//   hello       {magic, protocol, ncclUniqueId}  sent once per connection, by both sides
//   descriptor  {magic, buffer, bytes}           a registered buffer's size, for bounds checks
//   write       {magic, buffer, offset, bytes, seqno}  announces a host-path write
//
// Communicators. Each connection has two 2-rank NCCL communicators, one per direction: the side
// that writes is rank 0 and made the ncclUniqueId (sent in its hello), the side that receives is
// rank 1. One communicator per direction, because NCCL runs the transfers of a communicator one
// after the other in the order they were issued: with a single one, a write in each direction
// (each waiting for the other side to receive) could never both complete. Communicators are
// non-blocking (config.blocking = 0), so no call of this transport waits inside NCCL for the
// peer; set-up runs in NCCL's threads and is finished lazily, by polling ncclCommGetAsyncError
// inside every call. Once both hellos are known, a peer's two communicators are initialised in one group, and
// then connected in one group by a one-byte transfer each way of our own, so that NCCL's
// connection set-up (which needs both sides) never runs inside a caller's transfer. NCCL keeps
// the state of a non-blocking group in the calling thread (in some versions, one at a time), so
// this transport has at most one NCCL job in flight: peers are set up one after the other, and a
// transfer waits until no set-up is running. An operation that needs a communicator waits for it
// (pumping the control plane) up to kSetupTimeout, then fails with DeadlineExceeded naming the
// peer.
//
// Host path (Write / WaitDoorbell / Doorbell). Write checks bounds against the peer's descriptor,
// sends the write frame, stages the pieces (host or device memory) into a device staging buffer
// and ncclSends it on this transport's stream, then waits for the send to complete so that the
// pieces may be reused (pumping meanwhile, and receiving the peer's writes, so that writes in
// both directions make progress). The receiver, when it meets a write frame (inside any of its
// calls), posts the matching ncclRecv into the registered buffer on its receive stream and, once
// that completes, sets the buffer's doorbell (a host-side counter). A frame outside the buffer is
// refused with DataLoss (returned by the next WaitDoorbell/Receive) and its bytes are still
// received, into scratch, so that the communicator stays in step with the sender.
//
// Device path (EnqueueWrite / EnqueueWait / SyncStream). EnqueueWrite is an ncclSend from the
// caller's device memory on the caller's stream; EnqueueWait an ncclRecv into the registered
// buffer at the offset. Offsets and seqnos do not travel: NCCL matches sends and receives of a
// communicator in order, so the k-th EnqueueWrite to a peer lands where that peer's k-th
// EnqueueWait from us says. NCCL's kernels wait on the device and cannot be given a timeout, so
// the host watches them: EnqueueWait records a CUDA event before and after its receive, and
// SyncStream polls the stream while, every ~100 us, it pumps the control plane, checks every
// communicator for asynchronous errors and checks the pending waits (a wait whose "before" event
// has completed but whose "after" event has not, `timeout` after it was first seen reached, has
// expired). On an error or at the deadline it aborts the communicators the stream uses, which
// makes their kernels return, and the device path stays failed (FailedPrecondition with the first
// error). Host-path and device-path writes must not both be in flight on one peer in one
// direction: their receives would be posted in an order the sender cannot know.
//
// Teardown: healthy, idle communicators are finalized and destroyed; ones with work that can no
// longer complete, that failed, or that do not finalize within kFinalizeTimeout are aborted.
// Neither finalize, destroy nor abort is bounded in NCCL: finalize waits for the communicator to
// be quiescent on both sides, and destroy/abort join NCCL's proxy thread, which stays while the
// peer process still holds connections to it (a peer that is alive but not tearing down, e.g.
// waiting for this process to exit). So every ncclCommAbort/Destroy/Finalize of this transport runs
// on a helper thread that is waited for a bounded time (RunBounded); one that does not return in
// time is left running (its communicator and, in the destructor, the streams and buffers NCCL may
// still touch are leaked) and the process goes on. Communicators of a peer that was Close()d do not
// fail the transport when they report an error (the peer leaving is expected), and are not torn
// down at all: teardown waits on the peer, and one cut short crashes NCCL at process exit.
#include "common/transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/log.h"
#include "common/status.h"
#include "common/transport/control_plane.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the nccl transport needs NCCL 2.18 or newer"
#endif

namespace tandem::transport {
namespace {

constexpr uint32_t kHelloMagic = 0x48434e54;       // "TNCH" on the wire
constexpr uint32_t kDescriptorMagic = 0x42434e54;  // "TNCB"
constexpr uint32_t kWriteMagic = 0x57434e54;       // "TNCW"
constexpr uint32_t kProtocol = 1;

// Communicator set-up (init and first connection) or a peer's descriptor, awaited by an operation.
constexpr absl::Duration kSetupTimeout = absl::Seconds(60);
// A host-path write whose receiver never receives it.
constexpr absl::Duration kHostWriteTimeout = absl::Seconds(120);
constexpr absl::Duration kPump = absl::Microseconds(50);  // one short control-plane wait
constexpr absl::Duration kIdleWait = absl::Milliseconds(20);
// Teardown: all finalizes together, then the whole of destroy/abort (see the file comment).
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(2);
constexpr absl::Duration kCloseTimeout = absl::Seconds(5);
// One ncclCommAbort during operation (its kernels return as soon as it has started).
constexpr absl::Duration kAbortTimeout = absl::Seconds(2);
constexpr absl::Duration kDrainTimeout = absl::Seconds(5);
// Another peer's set-up phase, awaited before aborting a communicator.
constexpr absl::Duration kSettleTimeout = absl::Seconds(10);
// A refused write larger than this is not drained (the communicator from that peer is aborted).
constexpr uint64_t kMaxDrainBytes = uint64_t{1} << 30;

struct HelloFrame {
  uint32_t magic = kHelloMagic;
  uint32_t protocol = kProtocol;
  ncclUniqueId id{};
};
struct DescriptorFrame {
  uint32_t magic = kDescriptorMagic;
  uint32_t buffer = 0;
  uint64_t bytes = 0;
};
struct WriteFrame {
  uint32_t magic = kWriteMagic;
  uint32_t buffer = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint64_t seqno = 0;
};
static_assert(sizeof(HelloFrame) == 8 + NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(DescriptorFrame) == 16);
static_assert(sizeof(WriteFrame) == 32);

absl::Status CudaError(cudaError_t err, std::string_view call, std::string_view context) {
  return absl::InternalError(absl::StrCat("nccl transport: ", ToAbsl(call), context.empty() ? "" : " (",
                                          ToAbsl(context), context.empty() ? "" : ")", ": ",
                                          cudaGetErrorName(err), " (", cudaGetErrorString(err), ")"));
}

// Returns the CUDA error of `expr` as an Internal status naming the call and `context`.
#define NCCL_T_CUDA(expr, context)                   \
  do {                                               \
    const cudaError_t nccl_t_err_ = (expr);          \
    if (nccl_t_err_ != cudaSuccess) {                \
      (void)cudaGetLastError();                      \
      return CudaError(nccl_t_err_, #expr, context); \
    }                                                \
  } while (0)

// An NCCL failure as a Status: what failed, for which peer, NCCL's code and its last message.
// Network and remote failures are Unavailable, the rest Internal.
// Runs `fn` on a helper thread and waits for it at most `limit`. True if it returned; otherwise
// the thread is left running (detached) and `what` is logged. `fn` must own what it uses.
bool RunBounded(std::function<void()> fn, absl::Duration limit, std::string_view what) {
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  auto state = std::make_shared<State>();
  std::thread t([state, fn = std::move(fn)] {
    fn();
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->cv.notify_all();
  });
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(state->mu);
    done = state->cv.wait_for(lock, absl::ToChronoNanoseconds(limit), [&] { return state->done; });
  }
  if (done) {
    t.join();
  } else {
    t.detach();
    TANDEM_LOG_WARN("transport", "nccl: ", ToAbsl(what), " did not return within ",
                    absl::FormatDuration(limit), "; left running");
  }
  return done;
}

// ncclCommAbort, bounded: its kernels return as soon as it has started; the rest of it (joining
// NCCL's threads) may wait for the peer process.
void Abort(ncclComm_t comm, std::string_view who) {
  if (comm == nullptr) return;
  (void)RunBounded([comm] { ncclCommAbort(comm); }, kAbortTimeout,
                   absl::StrCat("ncclCommAbort of the communicator ", ToAbsl(who)));
}

absl::Status NcclError(ncclResult_t r, std::string_view call, std::string_view context) {
  const char* last = ncclGetLastError(nullptr);
  std::string msg =
      absl::StrCat("nccl transport: ", ToAbsl(call), " (", ToAbsl(context), "): ", ncclGetErrorString(r));
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&msg, " (NCCL: ", last, ")");
  if (r == ncclSystemError || r == ncclRemoteError) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

// Set-up of a peer's pair of communicators.
enum class Setup : uint8_t {
  kAwaitingHello,  // the peer's ncclUniqueId has not arrived yet
  kQueued,         // both ids known; waits for its turn (one NCCL job at a time)
  kInit,           // both ncclCommInitRankConfig running, in one group
  kConnecting,     // the one-byte first transfers running, in one group (NCCL connects)
  kReady,
  kFailed,  // both communicators aborted; `setup_failure` says why
};

const char* SetupName(Setup s) {
  switch (s) {
    case Setup::kAwaitingHello:
      return "no hello from the peer yet";
    case Setup::kQueued:
      return "waiting for another peer's set-up";
    case Setup::kInit:
      return "initialising";
    case Setup::kConnecting:
      return "connecting";
    case Setup::kReady:
      return "ready";
    case Setup::kFailed:
      return "failed";
  }
  return "?";
}

struct Comm {
  ncclComm_t comm = nullptr;
  absl::Status failure;  // not OK: aborted, for this reason
};

struct Peer {
  std::string name;
  bool greeted = false;  // our hello went out
  bool closed = false;   // Close()d: its communicators failing is expected, not the transport's failure
  Setup setup = Setup::kAwaitingHello;
  absl::Status setup_failure;
  ncclUniqueId mine{}, theirs{};        // of the communicator we write on / the peer writes on
  Comm send;                            // this side is rank 0 and writes
  Comm recv;                            // this side is rank 1 and receives
  std::map<uint32_t, uint64_t> remote;  // the peer's buffers: id -> bytes
  std::deque<WriteFrame> incoming;      // announced host-path writes, receive not posted yet
};

struct Local {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  uint64_t doorbell = 0;
};

// A posted host-path receive; completes in posting order on the receive stream.
struct HostRecv {
  PeerId peer = 0;
  uint32_t buffer = 0;
  uint64_t seqno = 0;
  bool valid = true;           // false: refused (drained into scratch) or its communicator aborted
  cudaEvent_t done = nullptr;  // null for a 0-byte write
};

// A device-path wait enqueued on a caller's stream.
struct DeviceWait {
  PeerId peer = 0;
  uint32_t buffer = 0;
  uint64_t seqno = 0;
  absl::Duration timeout;
  std::string label;
  cudaEvent_t before = nullptr, after = nullptr;
  std::optional<absl::Time> reached;  // when `before` was first seen complete
  bool done = false;
};

// The device-path work enqueued on one caller stream since its last SyncStream.
struct StreamWork {
  std::vector<DeviceWait> waits;
  std::set<PeerId> sends_to, receives_from;  // communicators the stream's NCCL kernels use
};

class NcclTransport : public ControlPlaneTransport {
 public:
  NcclTransport(std::unique_ptr<Transport> control, int device)
      : ControlPlaneTransport(std::move(control)), device_(device) {
    caps_.name = "nccl";
    caps_.gpu_memory = true;
    caps_.device_polling = true;
    caps_.same_host_only = false;
  }

  ~NcclTransport() override;

  absl::Status Init() {
    NCCL_T_CUDA(cudaSetDevice(device_), "");
    NCCL_T_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "");
    NCCL_T_CUDA(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking), "");
    NCCL_T_CUDA(cudaMalloc(&first_, 64), "first-transfer bytes");
    NCCL_T_CUDA(cudaMemset(first_, 0, 64), "");
    NCCL_T_CUDA(cudaDeviceSynchronize(), "");
    return absl::OkStatus();
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::StatusOr<PeerId> Accept(absl::Time deadline) override {
    // In slices, so that other peers' set-up keeps going meanwhile.
    while (true) {
      RETURN_IF_ERROR(Advance());
      const absl::Time now = absl::Now();
      const absl::Time until = std::min(deadline, now + (Busy() ? kPump : kIdleWait));
      absl::StatusOr<PeerId> peer = control().Accept(std::max(until, now + absl::Microseconds(1)));
      if (peer.ok()) {
        RETURN_IF_ERROR(OnNewPeer(*peer));
        return *peer;
      }
      if (!absl::IsDeadlineExceeded(peer.status()) || absl::Now() >= deadline) return peer.status();
    }
  }

  absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) override;
  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override;
  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override;
  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override;

  uint64_t Doorbell(uint32_t buffer) const override {
    auto it = local_.find(buffer);
    return it == local_.end() ? 0 : it->second.doorbell;
  }

  absl::Status Flush(absl::Time deadline) override;
  void Close(PeerId peer) override {
    auto it = peers_.find(peer);
    if (it != peers_.end()) it->second.closed = true;
    ControlPlaneTransport::Close(peer);
  }

  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override;
  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override;
  absl::Status SyncStream(void* stream, absl::Time deadline) override;

 private:
  // ---- connections and communicators ----
  absl::Status OnNewPeer(PeerId peer) override;
  // Starts the set-up of the first queued peer, if no NCCL job is in flight.
  void StartNextSetup();
  // Advances the set-up in flight (job_) once NCCL has finished its current phase.
  void PollSetup();
  // Whether both communicators of `p` are done with their current NCCL job (or have failed).
  bool PhaseDone(const Peer& p, absl::Status* failure) const;
  // After a non-blocking job of `comm` completed: lets NCCL reap it (a query that waits for the
  // communicator to be ready), so that the next job starts from a clean slate.
  static void Settle(ncclComm_t comm) {
    int ranks = 0;
    (void)ncclCommCount(comm, &ranks);
  }
  // Aborts both communicators of a peer whose set-up failed; a genuine failure (NCCL's, the
  // peer's) also fails every later wait, as a lost peer does.
  void FailSetup(PeerId peer, absl::Status why, bool genuine = true);
  // Aborts one communicator (its kernels return) and marks it failed with `why`; a genuine failure
  // (an NCCL error, not our decision) also fails every later wait, as a lost peer does.
  absl::Status FailComm(PeerId peer, bool sender, absl::Status why, bool genuine);
  // Waits (pumping) until the peer's communicator is ready and no NCCL job is in flight.
  absl::StatusOr<ncclComm_t> ReadyComm(PeerId peer, bool sender);
  // After a transfer call: ncclInProgress (the launch runs in an NCCL thread) is waited out, since
  // the stream holds the transfer only once it has run; an error aborts the communicator.
  absl::Status Issued(PeerId peer, bool sender, ncclResult_t r, std::string_view call);
  absl::StatusOr<uint64_t> RemoteBytes(PeerId peer, uint32_t buffer);
  Comm& CommOf(PeerId peer, bool sender) {
    Peer& p = peers_.at(peer);
    return sender ? p.send : p.recv;
  }
  std::string Direction(PeerId peer, bool sender) const {
    return absl::StrCat(sender ? "to " : "from ", peers_.at(peer).name);
  }

  // ---- progress ----
  // Pumps the control plane (waiting at most `wait` for the first frame), then Advance().
  absl::Status Progress(absl::Duration wait);
  absl::StatusOr<bool> Consume(PeerId from, const std::vector<uint8_t>& m) override;
  // Set-up, posting announced receives, completing them; returns the first genuine failure.
  absl::Status Advance();
  absl::Status PostReceive(PeerId peer, const WriteFrame& w);
  absl::Status CompleteReceives();
  // Whether something is in flight that host polling must finish (set-up, receives).
  bool Busy() const;
  absl::Duration WaitFor(absl::Time deadline) const {
    if (Busy()) return kPump;
    return std::clamp(deadline - absl::Now(), absl::Microseconds(1), kIdleWait);
  }

  // ---- device path ----
  absl::Status DeviceFailed() const {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl transport: the device path failed earlier: ", device_failure_.ToString()));
  }
  absl::Status CheckWaits(StreamWork& work);
  absl::Status FailStream(void* stream, cudaEvent_t done, absl::Status why);

  // ---- CUDA resources ----
  absl::StatusOr<cudaEvent_t> RecordEvent(cudaStream_t stream, std::string_view context);
  void ReleaseEvent(cudaEvent_t e) { free_events_.push_back(e); }
  absl::Status Grow(void** buffer, uint64_t* size, uint64_t bytes, cudaStream_t stream);
  // Waits (at most `limit`) for `e`, without pumping: after an abort, kernels return by themselves.
  void Drain(cudaEvent_t e, absl::Duration limit) {
    const absl::Time until = absl::Now() + limit;
    while (cudaEventQuery(e) == cudaErrorNotReady && absl::Now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    (void)cudaGetLastError();
  }

  absl::Status TakeError() {
    absl::Status s = std::move(errors_.front());
    errors_.pop_front();
    return s;
  }

  int device_;
  Capabilities caps_;
  cudaStream_t stream_ = nullptr;       // host-path sends (staging copies, then ncclSend)
  cudaStream_t recv_stream_ = nullptr;  // host-path receives
  uint8_t* first_ = nullptr;            // the bytes of each communicator's first transfer
  void* staging_ = nullptr;
  uint64_t staging_bytes_ = 0;
  void* scratch_ = nullptr;  // where refused writes are drained
  uint64_t scratch_bytes_ = 0;
  std::map<uint32_t, Local> local_;
  std::map<PeerId, Peer> peers_;
  std::optional<PeerId> job_;        // the peer whose set-up job NCCL is running
  std::deque<absl::Status> errors_;  // refused writes, for WaitDoorbell/Receive
  absl::Status broken_;              // first genuine communicator failure
  std::deque<HostRecv> host_recvs_;
  std::map<void*, StreamWork> streams_;
  std::vector<cudaEvent_t> free_events_;
  absl::Status device_failure_;
};

// ---- connections and communicators --------------------------------------------------------------

// A new connection: our hello (the id of the communicator we write on), then every buffer
// registered so far. The set-up starts once the peer's hello has arrived.
absl::Status NcclTransport::OnNewPeer(PeerId peer) {
  Peer& p = peers_[peer];
  p.name = PeerName(peer);
  HelloFrame h;
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
  if (job_) return;
  for (auto& [id, p] : peers_) {
    if (!p.greeted || p.setup != Setup::kQueued) continue;
    if (cudaSetDevice(device_) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
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
    p.setup = Setup::kInit;
    job_ = id;
    if (r != ncclSuccess && r != ncclInProgress) {
      FailSetup(id, NcclError(r, "ncclCommInitRankConfig", absl::StrCat("communicators with ", p.name)));
    }
    return;
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
    if (c->failure.ok()) c->failure = why;
  }
  if (p.setup != Setup::kFailed) {
    TANDEM_LOG_WARN("transport", "nccl: set-up with ", p.name, " failed: ", why.message());
    p.setup = Setup::kFailed;
    p.setup_failure = why;
  }
  if (job_ == peer) job_.reset();
  p.incoming.clear();
  for (HostRecv& r : host_recvs_) {
    if (r.peer == peer) r.valid = false;
  }
  if (genuine && broken_.ok()) broken_ = why;
}

absl::Status NcclTransport::FailComm(PeerId peer, bool sender, absl::Status why, bool genuine) {
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
  Abort(c.comm, Direction(peer, sender));
  c.comm = nullptr;
  if (c.failure.ok()) {
    c.failure = why;
    TANDEM_LOG_WARN("transport", "nccl: communicator ", Direction(peer, sender), " aborted: ", why.message());
  }
  // Receives posted on it will never deliver their bytes.
  if (!sender) {
    peers_.at(peer).incoming.clear();
    for (HostRecv& r : host_recvs_) {
      if (r.peer == peer) r.valid = false;
    }
  }
  if (genuine && broken_.ok()) broken_ = why;
  return why;
}

absl::StatusOr<ncclComm_t> NcclTransport::ReadyComm(PeerId peer, bool sender) {
  if (!peers_.contains(peer)) return absl::NotFoundError(absl::StrCat("nccl transport: no peer ", peer));
  const absl::Time start = absl::Now();
  while (true) {
    const Peer& p = peers_.at(peer);
    const Comm& c = sender ? p.send : p.recv;
    if (!c.failure.ok()) return c.failure;
    if (p.setup == Setup::kReady && !job_) return c.comm;
    if (absl::Now() - start > kSetupTimeout) {
      if (p.setup != Setup::kReady) {
        return absl::DeadlineExceededError(absl::StrCat(
            "nccl transport: the communicator ", Direction(peer, sender), " is not set up after ",
            absl::FormatDuration(kSetupTimeout), " (", SetupName(p.setup), ")"));
      }
      return absl::DeadlineExceededError(
          absl::StrCat("nccl transport: the set-up of ", peers_.at(*job_).name, " kept NCCL busy for ",
                       absl::FormatDuration(kSetupTimeout), " (", SetupName(peers_.at(*job_).setup), ")"));
    }
    RETURN_IF_ERROR(Progress(kPump));
  }
}

absl::Status NcclTransport::Issued(PeerId peer, bool sender, ncclResult_t r, std::string_view call) {
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
                      true);
    }
    if (r == ncclSuccess) Settle(c.comm);
  }
  if (r == ncclSuccess) return absl::OkStatus();
  return FailComm(peer, sender, NcclError(r, call, Direction(peer, sender)), true);
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
  if (magic != kHelloMagic && magic != kDescriptorMagic && magic != kWriteMagic) return false;
  if (!peers_.contains(from)) peers_[from].name = PeerName(from);
  Peer& p = peers_.at(from);
  if (magic == kHelloMagic && m.size() == sizeof(HelloFrame)) {
    HelloFrame h;
    std::memcpy(&h, m.data(), sizeof(h));
    if (p.setup != Setup::kAwaitingHello) {
      errors_.push_back(absl::DataLossError(absl::StrCat("nccl transport: a second hello from ", p.name)));
    } else if (h.protocol != kProtocol) {
      FailSetup(from, absl::DataLossError(absl::StrCat("nccl transport: ", p.name, " speaks protocol ",
                                                       h.protocol, ", this side ", kProtocol)));
    } else {
      p.theirs = h.id;
      p.setup = Setup::kQueued;  // started by Advance, when no other set-up is running
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

// Set-up failures are kept in the peer (and in broken_), so they do not end this early.
absl::Status NcclTransport::Advance() {
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
        (void)FailComm(id, sender, NcclError(state, "communicator", Direction(id, sender)), !p.closed);
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
  RETURN_IF_ERROR(CompleteReceives());
  return broken_;
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
  local_[id] = Local{.base = static_cast<uint8_t*>(base), .bytes = bytes};
  DescriptorFrame d;
  d.buffer = id;
  d.bytes = bytes;
  for (const auto& [peer, p] : peers_) RETURN_IF_ERROR(control().Send(peer, ToBytes(d)));
  return absl::OkStatus();
}

// ---- host path ------------------------------------------------------------------------------------

absl::Status NcclTransport::Write(PeerId peer, uint32_t buffer, uint64_t offset,
                                  absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) {
  if (seqno == 0) return absl::InvalidArgumentError("nccl transport: Write with seqno 0");
  ASSIGN_OR_RETURN(const uint64_t size, RemoteBytes(peer, buffer));
  uint64_t total = 0;
  for (const auto& piece : pieces) total += piece.size();
  const std::string& name = peers_.at(peer).name;
  if (offset > size || total > size - offset) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: write of ", total, " bytes at offset ",
                                                   offset, " outside buffer ", buffer, " (", size,
                                                   " bytes) of ", name));
  }
  ASSIGN_OR_RETURN(ncclComm_t comm, ReadyComm(peer, true));
  WriteFrame w;
  w.buffer = buffer;
  w.offset = offset;
  w.bytes = total;
  w.seqno = seqno;
  RETURN_IF_ERROR(control().Send(peer, ToBytes(w)));
  if (total == 0) return absl::OkStatus();

  NCCL_T_CUDA(cudaSetDevice(device_), name);
  RETURN_IF_ERROR(Grow(&staging_, &staging_bytes_, total, stream_));
  auto* at = static_cast<uint8_t*>(staging_);
  for (const auto& piece : pieces) {
    if (piece.empty()) continue;
    NCCL_T_CUDA(cudaMemcpyAsync(at, piece.data(), piece.size(), cudaMemcpyDefault, stream_),
                absl::StrCat("staging a write to ", name));
    at += piece.size();
  }
  RETURN_IF_ERROR(Issued(peer, true, ncclSend(staging_, total, ncclUint8, 1, comm, stream_), "ncclSend"));
  ASSIGN_OR_RETURN(cudaEvent_t done, RecordEvent(stream_, name));
  // Until the send has completed (the pieces are staged by then, the staging free again). Meanwhile
  // the peer's own writes to us are received, so that writes in both directions complete.
  const absl::Time start = absl::Now();
  while (true) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) {
      ReleaseEvent(done);
      return absl::OkStatus();
    }
    absl::Status s;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      s = CudaError(q, "cudaEventQuery", absl::StrCat("a write to ", name));
    }
    if (s.ok()) s = Progress(kPump);
    if (s.ok()) s = CommOf(peer, true).failure;
    if (s.ok() && absl::Now() - start > kHostWriteTimeout) {
      s = absl::DeadlineExceededError(absl::StrCat("nccl transport: ", name, " did not receive the write of ",
                                                   total, " bytes to its buffer ", buffer, " (seqno ", seqno,
                                                   ") within ", absl::FormatDuration(kHostWriteTimeout)));
    }
    if (!s.ok()) {
      (void)FailComm(peer, true, s, false);  // the send kernel returns
      Drain(done, kDrainTimeout);
      cudaEventDestroy(done);
      return s;
    }
  }
}

absl::Status NcclTransport::WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) {
  auto it = local_.find(buffer);
  if (it == local_.end()) return absl::NotFoundError(absl::StrCat("nccl transport: no buffer ", buffer));
  while (true) {
    if (it->second.doorbell >= seqno) return absl::OkStatus();
    if (!errors_.empty()) return TakeError();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("nccl transport: waiting for doorbell ", seqno,
                                                      " of buffer ", buffer, " (it is at ",
                                                      it->second.doorbell, ")"));
    }
    RETURN_IF_ERROR(Progress(WaitFor(deadline)));
  }
}

absl::Status NcclTransport::Flush(absl::Time deadline) {
  NCCL_T_CUDA(cudaSetDevice(device_), "");
  while (true) {
    const cudaError_t q = cudaStreamQuery(stream_);
    if (q == cudaSuccess) break;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return CudaError(q, "cudaStreamQuery", "Flush");
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("nccl transport: Flush did not complete before the deadline");
    }
    RETURN_IF_ERROR(Progress(kPump));
  }
  return control().Flush(deadline);
}

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
  ASSIGN_OR_RETURN(ncclComm_t comm, ReadyComm(peer, true));
  NCCL_T_CUDA(cudaSetDevice(device_), name);
  StreamWork& work = streams_[stream];
  work.sends_to.insert(peer);
  return Issued(peer, true, ncclSend(src, bytes, ncclUint8, 1, comm, static_cast<cudaStream_t>(stream)),
                "ncclSend");
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
  if (bytes > 0) {
    const absl::Status issued =
        Issued(peer, false, ncclRecv(it->second.base + offset, bytes, ncclUint8, 0, comm, s), "ncclRecv");
    if (!issued.ok()) {
      cudaEventDestroy(w.before);
      return issued;
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
  ASSIGN_OR_RETURN(cudaEvent_t done, RecordEvent(static_cast<cudaStream_t>(stream), "SyncStream"));
  StreamWork& work = streams_[stream];
  while (true) {
    const cudaError_t q = cudaEventQuery(done);
    if (q == cudaSuccess) break;
    absl::Status s;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      s = CudaError(q, "cudaEventQuery", "SyncStream");
    }
    if (s.ok()) s = Progress(kPump);
    if (s.ok()) {
      for (PeerId p : work.sends_to) {
        if (s.ok()) s = CommOf(p, true).failure;
      }
      for (PeerId p : work.receives_from) {
        if (s.ok()) s = CommOf(p, false).failure;
      }
    }
    if (s.ok()) s = CheckWaits(work);
    if (s.ok() && absl::Now() >= deadline) {
      std::string pending;
      for (const DeviceWait& w : work.waits) {
        if (!w.done) {
          pending = absl::StrCat("; first pending wait: ", w.label, " (seqno ", w.seqno, ")");
          break;
        }
      }
      s = absl::DeadlineExceededError(
          absl::StrCat("nccl transport: the stream's work did not finish before the deadline", pending));
    }
    if (!s.ok()) return FailStream(stream, done, std::move(s));
  }
  for (DeviceWait& w : work.waits) {
    uint64_t& doorbell = local_.at(w.buffer).doorbell;
    doorbell = std::max(doorbell, w.seqno);
    ReleaseEvent(w.before);
    ReleaseEvent(w.after);
  }
  streams_.erase(stream);
  ReleaseEvent(done);
  return absl::OkStatus();
}

// The waits of one stream complete in stream order: the first one not yet done decides.
absl::Status NcclTransport::CheckWaits(StreamWork& work) {
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
      return absl::DeadlineExceededError(absl::StrCat(w.label, ": waited ", absl::FormatDuration(w.timeout),
                                                      " for seqno ", w.seqno, " (buffer ", w.buffer, " from ",
                                                      peers_.at(w.peer).name, "; its doorbell is at ",
                                                      local_.at(w.buffer).doorbell, ")"));
    }
    return absl::OkStatus();
  }
  return absl::OkStatus();
}

// Aborts the communicators the stream's NCCL kernels use, so that they return instead of waiting
// forever, and keeps the device path failed.
absl::Status NcclTransport::FailStream(void* stream, cudaEvent_t done, absl::Status why) {
  device_failure_ = why;
  TANDEM_LOG_WARN("transport", "nccl: device path failed: ", why.message());
  StreamWork& work = streams_[stream];
  const absl::Status aborted = absl::FailedPreconditionError(
      absl::StrCat("nccl transport: communicator aborted after a device-path failure: ", why.message()));
  for (PeerId p : work.sends_to) {
    if (CommOf(p, true).failure.ok()) (void)FailComm(p, true, aborted, false);
  }
  for (PeerId p : work.receives_from) {
    if (CommOf(p, false).failure.ok()) (void)FailComm(p, false, aborted, false);
  }
  Drain(done, kDrainTimeout);
  cudaEventDestroy(done);
  for (DeviceWait& w : work.waits) {
    cudaEventDestroy(w.before);
    cudaEventDestroy(w.after);
  }
  streams_.erase(stream);
  return why;
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
      if (p.closed) {
        // The peer said goodbye and is tearing down (or gone) on its own schedule: NCCL's finalize,
        // destroy and abort all wait on it, and a teardown cut short by the bound below leaves an
        // NCCL thread that crashes when the process exits (seen on 4×H200 with NCCL 2.28). Its
        // communicators are left to the process's exit instead.
        c.comm = nullptr;
        ++left;
        continue;
      }
      const bool finalize = !(job_ == id) && p.setup == Setup::kReady && !stuck.contains({id, sender});
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
  }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  if (done) {
    // Bounded waits: an aborted communicator's kernels return by themselves.
    // (cudaFree synchronises the device, so first_ is freed only once both streams are idle.)
    const absl::Time until = absl::Now() + kDrainTimeout;
    bool idle = true;
    for (cudaStream_t s : {stream_, recv_stream_}) {
      if (s == nullptr) continue;
      if (s == stream_ && staging_ != nullptr) cudaFreeAsync(staging_, s);
      if (s == recv_stream_ && scratch_ != nullptr) cudaFreeAsync(scratch_, s);
      while (cudaStreamQuery(s) == cudaErrorNotReady && absl::Now() < until) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (cudaStreamQuery(s) == cudaErrorNotReady) idle = false;
      cudaStreamDestroy(s);
    }
    if (first_ != nullptr && idle) cudaFree(first_);
  }
  // Otherwise NCCL may still use the streams and buffers: they are leaked with its communicators.
  (void)cudaGetLastError();
  ResetControl();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("nccl transport: no CUDA device (",
                                               err == cudaSuccess ? "none found" : cudaGetErrorString(err),
                                               ")"));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: cuda:", options.device, " requested but ",
                                                   count, " device(s) are visible"));
  }
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 18, 0)) {
    return absl::UnavailableError(absl::StrCat(
        "nccl transport: NCCL 2.18 or newer is needed; the loaded library is version code ", version));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> control,
                   CreateUcxTransport({.listen_address = options.listen_address}));
  auto t = std::make_unique<NcclTransport>(std::move(control), options.device);
  RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::transport
