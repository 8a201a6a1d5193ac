// Internals of the NCCL transport, shared by its three source files (not a public header):
//   nccl_setup.cc        connections, communicator set-up, progress, control messages, teardown
//   nccl_host_path.cc    Write / WaitDoorbell / Flush (staged sends, receives posted on frames)
//   nccl_device_path.cc  EnqueueWrite / EnqueueWait / SyncStream and their watchdog
// The design, as one text:
//
// The NCCL transport (docs/architecture.md, "Transports"): payloads move as NCCL point-to-point transfers
// between device buffers, on one host (NVLink, PCIe) or across hosts (InfiniBand, RoCE, sockets:
// whatever NCCL finds). Registered buffers are device memory of this process's GPU.
//
// Control plane. Connections, control messages and peer-failure detection are the UCX
// transport's (an inner transport this one wraps, as the p2p transport does). This transport's
// own frames travel on that channel and are consumed inside its calls; the caller's messages
// that arrive meanwhile are kept for Receive. Frames (fixed layout, magic first):
//   hello       {magic, protocol, ncclUniqueId, key, checksums}  sent once per connection, by both sides
//   settings    {magic, checksums}            SetDeviceChecksums changed the setting after the hello
//   propose     {magic}                       the set-up's leader asks to start (setup_turns.h)
//   go          {magic}                       the follower starts; the leader starts on it
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
// transfer waits until no set-up is running. Since a set-up needs both processes at once, the
// processes agree on the order (setup_turns.h: a random key in each hello; of two peers the one
// with the smaller key proposes, the other answers "go" when it is idle), so that three or more
// processes that all connect to each other never each wait for a different partner. An operation
// that needs a communicator waits for it (pumping the control plane) up to kSetupTimeout, then
// fails with DeadlineExceeded naming the peer and what its set-up waits for. No set-up takes its
// turn while device-path work is in flight (StartNextSetup): a peer met while steps run (a memory
// rank that rejoins) is set up between them, Connecting() stays true until its pair is ready, and
// the caller takes it into its steps only then (Capabilities::device_path_new_peers).
//
// Payload checksums (SetDeviceChecksums: on until a caller turns them off, which a deployment does
// on nccl unless transport.checksums says true; docs/architecture.md, "Transports"). With
// them on, each device-path payload goes out followed by its checksum entry {seqno, checksum}
// (payload_checksum.h): a kernel on the send stream sums the source into the peer's entry slot
// (Peer::sent_entry) before the send, and the two sends are one NCCL group, so one launch carries
// both. The receiver, if the peer announced checksums (its hello, or a settings frame since),
// receives the entry in the same group into the buffer's ring (Local::entries) and, with its own
// checksums on, checks the landed bytes against it with the device path's check kernel
// (common/transport/device/device_path.h) on a side stream beside whatever the caller enqueues next;
// the caller's stream joins the checks before its next write and at SyncStream, whose success then
// asks the check record: a mismatch is DataLoss naming the wait. Both sides must agree whether an
// entry follows a payload (NCCL would match an entry against the next payload): the sender's
// setting decides, and the receiver learns it from frames that precede, on the control channel,
// whatever makes it receive (a rank sets it before its hello or hello reply goes out).
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
// Device path (EnqueueWrite / EnqueueWait / SyncStream). EnqueueWait is an ncclRecv into the
// registered buffer at the offset, on the caller's stream. EnqueueWrite is an ncclSend from the
// caller's device memory on a stream of the peer's own (Peer::send_stream), made to wait
// (cudaStreamWaitEvent) for an event recorded on the caller's stream at the call: the send starts
// once the caller's earlier work (which wrote the source) has run, and the caller's stream goes
// on without waiting for the peer to receive. Offsets and seqnos do not travel: NCCL matches sends
// and receives of a communicator in order, so the k-th EnqueueWrite to a peer lands where that
// peer's k-th EnqueueWait from us says.
//
// Why sends leave the caller's stream. An NCCL kernel that waits for its peer holds up the
// stream behind it. With two micro-batches A and B in flight (pipeline.batches 2), compute rank
// 0 enqueues: send A's q,k,v, send B's q,k,v, receive A's output, ...; the memory rank: receive
// A's q,k,v, attention, send A's output, receive B's q,k,v. Were B's send on compute rank 0's
// stream, it would hold up the receive of A's output behind it until the memory rank posts B's
// receive, which that rank does only after it sent A's output, which completes only once that
// receive runs: a deadlock. On a send stream, a send waits only for the work that wrote its
// source and for the matching receive; nothing on a caller's stream waits for a send.
//
// One stream per communicator in each process, and the same order on both sides. The
// communicator we write on is used from the peer's send stream (and by the host path from
// stream_, never while device-path writes to that peer are in flight: see below); the one we
// receive on from the caller's stream (host path: recv_stream_). A communicator's transfers are
// then issued, on each side, in the order the caller called EnqueueWrite / EnqueueWait for that
// peer, and the ranks keep those orders equal: a compute rank sends each lane's q,k,v and
// receives its attention outputs in (layer, micro-batch) order, a memory rank receives the q,k,v
// and sends the outputs in that order too (LayersOnDevice: per layer, the lanes in turn), and a
// rotational ring's residual streams are handed on and taken in that order. Each rank has one
// caller stream (a compute rank's lanes share its backend's stream, a memory rank's lanes its
// executor's), so a memory rank receives the q,k,v of all its lanes from one compute rank on one
// stream; a compute rank's sends to a peer all go to that peer's send stream. Receives from one
// peer posted on two caller streams at once would be matched in the order they were issued, not
// the order the streams reach them, so EnqueueWait refuses them (InvalidArgument).
//
// No cycle. Take the transfers in the order (layer, micro-batch, stage), an item's stages being
// the transfer of its q,k,v (and of its residual stream, rotational), then of its attention
// output. Every stream meets its blocking transfers in that order: a caller's stream blocks only
// in receives, enqueued in item order; a send stream's sends are in item order too, each also
// waiting for the caller's work that produced its source, which follows the transfer one stage
// back on that stream (item (l, j)'s q,k,v are computed after (l-1, j)'s output was received, its
// output after its q,k,v were). A transfer completes once its match on the peer runs, which in
// turn waits only for transfers before it. So each transfer waits only for earlier ones, and all
// complete. Several NCCL kernels may now run at once on a GPU (a send per peer beside the
// caller's receive); they are small point-to-point kernels that fit on the device together, and
// the device path makes no device-wide synchronising call while transfers are in flight (Grow is
// stream-ordered), which is what NCCL's caution about concurrent communicators is about.
//
// A write's source is read after the caller's stream has passed the call, until the peer has
// received it (nccl_transport.h says so to callers). The ranks rewrite a source only after
// something that the peer computed from it has come back (a compute rank rewrites a lane's q,k,v
// after receiving that lane's attention output; a memory rank rewrites a lane's output after
// receiving the lane's next q,k,v, computed from it; a handed-on residual stream returns only
// round the ring), or after SyncStream.
//
// Watchdog. NCCL's kernels wait on the device and cannot be given a timeout, so the host watches
// them: EnqueueWait records a CUDA event before and after its receive, and EnqueueWrite one on the
// send stream after its send (StreamWork::sent, the stream's last send to each peer). SyncStream
// first makes the caller's stream wait for those send events, so the event it then records covers
// the stream's sends too, and polls it while, every ~100 us, it pumps the control plane, checks
// every communicator for asynchronous errors and checks the pending waits (a wait whose "before"
// event has completed but whose "after" event has not, `timeout` after it was first seen reached,
// has expired), checks the control plane's view of the stream's peers (a dead process whose
// NCCL transfers go over NVLink is noticed there, not by NCCL; a failed peer the stream does not
// use is left to the caller, and the stream goes on), and calls the caller's device poll
// (SetDevicePoll) about every millisecond. On an error or at the deadline (which names the first
// pending wait, else a send still in flight) the device path fails (FailedPrecondition with the
// first error until ResetDevicePath). Which communicators are aborted: only the blamed peer's (its
// communicator or connection failed, or its wait expired first), and the stream runs through:
// every rank enqueued its whole step and each communicator's transfers match in the order issued,
// so the transfers with healthy peers still meet one for one and those communicators stay usable
// for a rerun (compute rank 0 discards the step and runs it again without a lost memory rank). For
// the same reason a transfer enqueued with a peer whose communicator has already failed is left out
// rather than refused (LeftOut), so the rest of the step still reaches the healthy peers; and the
// blamed communicators' aborts are started together and joined after the drain (an abort's kernels
// return at once, but the abort may wait seconds for a stopped peer, past the healthy ranks' own
// deadlines if done one after another). An
// error of the caller's poll (a step discard) blames nobody: the stream is left to drain. A stream
// that does not drain within kDrainTimeout so, or an error that blames nobody otherwise (CUDA),
// has every communicator it uses aborted, which makes their kernels return; ResetDevicePath then
// refuses. A genuine failure of a peer's communicator fails the transport's other calls only
// until that peer is Close()d (Peer::failure, Broken). Host-path and device-path writes must
// not both be in flight on one peer in one direction: their receives would be posted in an order
// the sender cannot know.
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
#pragma once

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
#include <random>
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
#include "common/transport/device/device_path.h"
#include "common/transport/device/payload_checksum.h"
#include "common/transport/nccl/setup_turns.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "the nccl transport needs NCCL 2.18 or newer"
#endif

namespace tandem::transport::nccl_internal {

constexpr uint32_t kHelloMagic = 0x48434e54;       // "TNCH" on the wire
constexpr uint32_t kDescriptorMagic = 0x42434e54;  // "TNCB"
constexpr uint32_t kWriteMagic = 0x57434e54;       // "TNCW"
constexpr uint32_t kProposeMagic = 0x50434e54;     // "TNCP"
constexpr uint32_t kGoMagic = 0x47434e54;          // "TNCG"
constexpr uint32_t kSettingsMagic = 0x53434e54;    // "TNCS"
constexpr uint32_t kProtocol = 3;                  // 2: set-up turns (key, propose, go); 3: checksums

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
  uint64_t key = 0;        // this process's set-up key (SetupTurns)
  uint32_t checksums = 0;  // 1: this side's device-path payloads are followed by their checksum entries
  uint32_t reserved = 0;
};
struct SettingsFrame {
  uint32_t magic = kSettingsMagic;
  uint32_t checksums = 0;  // as HelloFrame::checksums, from now on
};
struct TurnFrame {  // propose or go
  uint32_t magic = kProposeMagic;
  uint32_t reserved = 0;
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
static_assert(sizeof(HelloFrame) == 24 + NCCL_UNIQUE_ID_BYTES);
static_assert(sizeof(SettingsFrame) == 8);
static_assert(sizeof(TurnFrame) == 8);
static_assert(sizeof(DescriptorFrame) == 16);
static_assert(sizeof(WriteFrame) == 32);

inline absl::Status CudaError(cudaError_t err, std::string_view call, std::string_view context) {
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
// `fn` run on a helper thread from construction. Wait() joins it if it returns by `until`;
// otherwise the thread is left running (detached) and `what` is logged. `fn` must own what it uses.
class BoundedRun {
 public:
  explicit BoundedRun(std::function<void()> fn) : state_(std::make_shared<State>()) {
    thread_ = std::thread([state = state_, fn = std::move(fn)] {
      fn();
      std::lock_guard<std::mutex> lock(state->mu);
      state->done = true;
      state->cv.notify_all();
    });
  }
  BoundedRun(BoundedRun&&) = default;
  BoundedRun& operator=(BoundedRun&&) = delete;
  ~BoundedRun() {
    if (thread_.joinable()) thread_.detach();  // not waited for: left running
  }
  bool Wait(absl::Time until, std::string_view what, absl::Duration limit) {
    bool done = false;
    {
      std::unique_lock<std::mutex> lock(state_->mu);
      done = state_->cv.wait_for(
          lock, absl::ToChronoNanoseconds(std::max(until - absl::Now(), absl::ZeroDuration())),
          [&] { return state_->done; });
    }
    if (done) {
      thread_.join();
    } else {
      thread_.detach();
      TANDEM_LOG_WARN("transport", "nccl: ", ToAbsl(what), " did not return within ",
                      absl::FormatDuration(limit), "; left running");
    }
    return done;
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  std::shared_ptr<State> state_;
  std::thread thread_;
};

// Runs `fn` on a helper thread and waits for it at most `limit` (BoundedRun). True if it returned.
inline bool RunBounded(std::function<void()> fn, absl::Duration limit, std::string_view what) {
  return BoundedRun(std::move(fn)).Wait(absl::Now() + limit, what, limit);
}

// An ncclCommAbort started on a helper thread: its kernels return as soon as it has begun; the rest
// of it (joining NCCL's threads) may wait for the peer process. Finish() waits for it, bounded.
struct PendingAbort {
  PendingAbort(ncclComm_t comm, std::string_view who)
      : started(absl::Now()),
        what(absl::StrCat("ncclCommAbort of the communicator ", ToAbsl(who))),
        run([comm] { ncclCommAbort(comm); }) {}
  void Finish() { (void)run.Wait(started + kAbortTimeout, what, kAbortTimeout); }
  absl::Time started;
  std::string what;
  BoundedRun run;
};

// ncclCommAbort, bounded by kAbortTimeout.
inline void Abort(ncclComm_t comm, std::string_view who) {
  if (comm == nullptr) return;
  PendingAbort(comm, who).Finish();
}

// Several aborts started together (each one's kernels return at once), finished together.
inline void FinishAborts(std::vector<PendingAbort>& aborts) {
  for (PendingAbort& a : aborts) a.Finish();
  aborts.clear();
}

inline absl::Status NcclError(ncclResult_t r, std::string_view call, std::string_view context) {
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
  kQueued,         // both ids known; waits for its turn (SetupTurns: one set-up at a time, agreed)
  kInit,           // both ncclCommInitRankConfig running, in one group
  kConnecting,     // the one-byte first transfers running, in one group (NCCL connects)
  kReady,
  kFailed,  // both communicators aborted; `setup_failure` says why
};

inline const char* SetupName(Setup s) {
  switch (s) {
    case Setup::kAwaitingHello:
      return "no hello from the peer yet";
    case Setup::kQueued:
      return "waiting for its turn";
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
  absl::Status failure;  // not OK: aborted (or its abort deferred), for this reason
  // Failed while the caller was enqueueing a step (Issued on the device path): `comm` is aborted by
  // the step's SyncStream (FailStream), with the whole step enqueued. Aborted at once, its
  // resources' release (cudaFree, which waits for the whole device) would wait for the healthy
  // peers' transfers, which wait for the rest of the step, whose launches would wait for it.
  bool abort_deferred = false;
};

struct Peer {
  std::string name;
  bool greeted = false;  // our hello went out
  Setup setup = Setup::kAwaitingHello;
  absl::Status setup_failure;
  ncclUniqueId mine{}, theirs{};        // of the communicator we write on / the peer writes on
  Comm send;                            // this side is rank 0 and writes
  Comm recv;                            // this side is rank 1 and receives
  absl::Status failure;                 // the first genuine failure of its communicators (Broken)
  std::map<uint32_t, uint64_t> remote;  // the peer's buffers: id -> bytes
  std::deque<WriteFrame> incoming;      // announced host-path writes, receive not posted yet
  cudaStream_t send_stream = nullptr;   // device-path sends to it (created by the first EnqueueWrite)
  // Payload checksums: whether its device-path payloads come with their entries (its hello or
  // settings frame), and the device slot the entries of ours to it are summed into before each send
  // (created with send_stream; the send stream's order keeps one slot enough).
  bool checksums = false;
  ChecksumEntry* sent_entry = nullptr;
};

struct Local {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  uint64_t doorbell = 0;
  ChecksumEntry* entries = nullptr;  // device: kChecksumRing received checksum entries, by seqno
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
  // Per peer written to: an event recorded on its send stream after the last send this stream
  // enqueued there (sends on one send stream complete in order), joined by SyncStream.
  std::map<PeerId, cudaEvent_t> sent;
};

class NcclTransport : public ControlPlaneTransport {
 public:
  NcclTransport(std::unique_ptr<Transport> control, int device)
      : ControlPlaneTransport(std::move(control)), device_(device) {
    caps_.name = "nccl";
    caps_.gpu_memory = true;
    caps_.device_polling = true;
    caps_.same_host_only = false;
    caps_.device_path_reset = true;
    // A peer met at any time gets its pair of communicators through the connection's hellos, set up
    // between the caller's steps (StartNextSetup waits while device-path work is in flight); a
    // caller that connects to a new process (a rejoin) waits for Connecting() to turn false.
    caps_.device_path_new_peers = true;
    // A rejoin probe's connection may be refused: greeted by its first Send or message, as p2p's.
    greet_when_connected_ = true;
  }

  ~NcclTransport() override;

  absl::Status Init() {
    NCCL_T_CUDA(cudaSetDevice(device_), "");
    NCCL_T_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "");
    NCCL_T_CUDA(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking), "");
    NCCL_T_CUDA(cudaMalloc(&first_, 64), "first-transfer bytes");
    NCCL_T_CUDA(cudaMemset(first_, 0, 64), "");
    NCCL_T_CUDA(cudaDeviceSynchronize(), "");
    ASSIGN_OR_RETURN(checks_, DevicePath::Create(device_));
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
        // Greet, not OnNewPeer: a Receive or Pump may have met this peer first (and greeted it).
        RETURN_IF_ERROR(Greet(*peer));
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
  // The control plane's view, then the first genuine failure of the peer's communicators.
  absl::Status PeerStatus(PeerId peer) const override {
    RETURN_IF_ERROR(ControlPlaneTransport::PeerStatus(peer));
    auto it = peers_.find(peer);
    return it == peers_.end() ? absl::OkStatus() : it->second.failure;
  }
  void Close(PeerId peer) override {
    if (turns_.current() == peer && !job_) turns_.Ended(peer);  // a proposal to it is withdrawn
    closed_.insert(peer);  // also a peer not met yet (a probe Close()d at once)
    ControlPlaneTransport::Close(peer);
  }
  void Reopen(PeerId peer) override {
    closed_.erase(peer);
    ControlPlaneTransport::Reopen(peer);
  }
  // The control connection's bootstrap, then, once either side has greeted, the set-up of the
  // peer's pair of communicators (until ready or failed: a failure is the peer's, PeerStatus). Not
  // greeted yet (nothing sent to or heard from the peer): false, so that the caller's first Send
  // greets it; a caller that must not meet the set-up inside a step asks again after the peer
  // answered.
  bool Connecting(PeerId peer) const override {
    if (ControlPlaneTransport::Connecting(peer)) return true;
    auto it = peers_.find(peer);
    return it != peers_.end() && it->second.setup != Setup::kReady && it->second.setup != Setup::kFailed;
  }

  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override;
  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override;
  absl::Status SyncStream(void* stream, absl::Time deadline) override;
  void SetDevicePoll(std::function<absl::Status()> poll) override { poll_ = std::move(poll); }
  // Announced to every peer greeted so far (a settings frame); later peers get it in the hello.
  void SetDeviceChecksums(bool on) override;
  absl::Status ResetDevicePath(void* stream) override;

 private:
  // ---- connections and communicators ----
  absl::Status OnNewPeer(PeerId peer) override;
  // Takes the next set-up turn (SetupTurns), if no NCCL job is in flight: a proposal, an answer, or
  // the start of a set-up.
  void StartNextSetup();
  // Starts initialising the peer's two communicators (one group): the NCCL job of a set-up.
  void InitComms(PeerId peer);
  // What a peer whose set-up has not finished waits for, for error messages.
  std::string SetupState(const Peer& p, PeerId peer) const {
    return p.setup == Setup::kQueued ? turns_.Describe(peer) : SetupName(p.setup);
  }
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
  // With `aborts`, the communicator's abort is started and left there for the caller to finish
  // (FinishAborts), so that the aborts of several communicators run at once.
  absl::Status FailComm(PeerId peer, bool sender, absl::Status why, bool genuine,
                        std::vector<PendingAbort>* aborts = nullptr, bool defer_abort = false);
  // Starts the aborts that FailComm deferred (Comm::abort_deferred) into `aborts`.
  void StartDeferredAborts(std::vector<PendingAbort>* aborts);
  // A peer met so far whose set-up has neither finished nor failed (closed peers and those
  // given up on, not_awaited_, aside).
  std::optional<PeerId> PendingSetup() const;
  // The entry of a peer met now (greeted, or heard from first).
  Peer& MeetPeer(PeerId peer) {
    auto [it, met] = peers_.try_emplace(peer);
    if (met) it->second.name = PeerName(peer);
    return it->second;
  }
  // Waits (pumping) until the peer's communicator is ready, no NCCL job is in flight and no other
  // peer's set-up is pending (each awaited at most kSetupTimeout once).
  absl::StatusOr<ncclComm_t> ReadyComm(PeerId peer, bool sender);
  // After a transfer call: ncclInProgress (the launch runs in an NCCL thread) is waited out, since
  // the stream holds the transfer only once it has run; an error fails the communicator, aborted at
  // once on the host path and by the step's SyncStream on the device path (`device`).
  absl::Status Issued(PeerId peer, bool sender, ncclResult_t r, std::string_view call, bool device = false);
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
  // Set-up, posting announced receives, completing them; returns the first genuine failure
  // (Broken) unless something else failed first.
  absl::Status Advance() {
    RETURN_IF_ERROR(AdvanceWork());
    return Broken();
  }
  absl::Status AdvanceWork();
  // The first genuine communicator failure of a peer that is not closed: a failed peer fails every
  // operation until the caller lets it go (Close), as a lost connection does on the other transports.
  absl::Status Broken() const {
    for (const auto& [id, p] : peers_) {
      if (!closed_.contains(id) && !p.failure.ok()) return p.failure;
    }
    return absl::OkStatus();
  }
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
  // Whether a device-path transfer with `peer` in this direction is left out because its
  // communicator failed (before or at the call): the call then succeeds, the peer is counted among
  // the stream's, and SyncStream blames it. A caller enqueues whole steps, and the healthy peers
  // wait for the transfers after this one; a step cut short here would leave them nothing to match,
  // and their streams could not drain for a rerun.
  bool LeftOut(PeerId peer, bool sender, void* stream) {
    if (CommOf(peer, sender).failure.ok()) return false;
    StreamWork& work = streams_[stream];
    (sender ? work.sends_to : work.receives_from).insert(peer);
    return true;
  }
  // The first expired wait, with its peer in *culprit.
  absl::Status CheckWaits(StreamWork& work, std::optional<PeerId>* culprit);
  // Fails the device path with `why`: aborts the communicators of the peers in `lost`, then waits
  // for the stream to drain; if it does not (or nothing is blamed and `drain_first` is false),
  // every communicator the stream uses is aborted and the path cannot be reset.
  absl::Status FailStream(void* stream, cudaEvent_t done, absl::Status why, const std::set<PeerId>& lost,
                          bool drain_first);
  // The stream device-path sends to `peer` are issued on (created on first use).
  absl::StatusOr<cudaStream_t> SendStream(PeerId peer);

  // ---- CUDA resources ----
  absl::StatusOr<cudaEvent_t> RecordEvent(cudaStream_t stream, std::string_view context);
  void ReleaseEvent(cudaEvent_t e) { free_events_.push_back(e); }
  absl::Status Grow(void** buffer, uint64_t* size, uint64_t bytes, cudaStream_t stream);
  // Waits (at most `limit`) for `e`, without pumping: after an abort, kernels return by themselves,
  // and the transfers with healthy peers need nothing of this host. Whether `e` completed.
  bool Drain(cudaEvent_t e, absl::Duration limit) {
    const absl::Time until = absl::Now() + limit;
    cudaError_t q = cudaErrorNotReady;
    while ((q = cudaEventQuery(e)) == cudaErrorNotReady && absl::Now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    (void)cudaGetLastError();
    return q == cudaSuccess;
  }

  // A random, nonzero set-up key for this transport (SetupTurns).
  static uint64_t DrawKey() {
    std::random_device rd;
    uint64_t key = 0;
    while (key == 0) key = (uint64_t{rd()} << 32) ^ rd();
    return key;
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
  std::optional<PeerId> job_;            // the peer whose set-up job NCCL is running
  SetupTurns<PeerId> turns_{DrawKey()};  // the agreed order of set-ups
  std::set<PeerId> not_awaited_;         // peers whose pending set-up transfers no longer wait for
  // Close()d and not Reopen()ed (met or not: a probe is Close()d at once): the peer's communicators
  // failing is expected, not the transport's failure.
  std::set<PeerId> closed_;
  std::deque<absl::Status> errors_;  // refused writes, for WaitDoorbell/Receive
  std::deque<HostRecv> host_recvs_;
  std::map<void*, StreamWork> streams_;
  std::vector<cudaEvent_t> free_events_;
  absl::Status device_failure_;
  // Set when a failed stream's healthy communicators had to be aborted too: ResetDevicePath refuses.
  absl::Status reset_refused_;
  std::function<absl::Status()> poll_;  // the caller's (SetDevicePoll)
  bool checksums_ = true;               // our device-path payloads carry checksum entries; we check theirs
  std::unique_ptr<DevicePath> checks_;  // the checksum kernels and their failure record
};

}  // namespace tandem::transport::nccl_internal
