// The verbs transport (docs/architecture.md, "Transports"): hosts joined by an RDMA fabric (InfiniBand or
// RoCE). A writer puts the payload straight into the receiver's registered buffer with RDMA
// WRITE, then writes the sequence number into the receiver's doorbell with a second RDMA WRITE
// on the same reliable-connected (RC) queue pair; RC executes a queue pair's requests in order,
// so a receiver that sees the doorbell sees the payload. No CPU of the receiver takes part.
//
// Control plane: an inner UCX transport carries the caller's messages, makes the connections
// and detects failed peers. This transport's own frames (verbs_wire.h) travel on the same
// ordered channel and are consumed inside its calls; the caller's messages seen while pumping
// for them are kept for Receive. Per peer:
//   Connect/Accept: create a CQ and an RC queue pair, take it RESET -> INIT (verbs_qp.h), send
//     our QP info, then a descriptor of every buffer registered so far.
//   The peer's QP info: INIT -> RTR -> RTS, then send "ready".
//   The peer's ready: its queue pair accepts our writes; writes to it may start.
// RegisterBuffer sends the new buffer's descriptor to every connected peer. A writer waits (up to
// kRemoteWait, pumping the control channel) for the peer's ready and the buffer's descriptor.
//
// Memory: host buffers are registered with ibv_reg_mr. In a CUDA build with a device, device
// buffers are registered through a dma-buf the driver exports (cuMemGetHandleForAddressRange,
// looked up at run time so that nothing links libcuda) and ibv_reg_dmabuf_mr; where that fails,
// ibv_reg_mr on the device pointer, which works where the nvidia-peermem module is loaded.
// Registrations never ask for relaxed ordering: the PCIe writes of the payload must reach memory
// before the doorbell's. Doorbells: one page of 64-bit slots per process (device memory with a
// device, else host memory), buffer `id` owns slot id % kDoorbellSlots.
//
// Write: bounds against the descriptor first (InvalidArgument, nothing posted). A single piece
// that lies inside a registered local buffer is sent from there; anything else is copied into a
// registered staging buffer that grows to the largest write. The payload goes in work requests
// of at most the port's max message size, unsignaled; the doorbell write is signaled, and Write
// polls the peer's CQ until it completes, so the pieces are reusable on return and a failed
// completion (Unavailable naming the peer and ibv_wc_status_str) is seen by the call that caused
// it. A failed queue pair stays failed: later writes to that peer return the same error.
//
// Device path (CUDA build, device >= 0): EnqueueWait is DevicePath's kernel spinning on our
// doorbell slot in device memory. EnqueueWrite resolves the remote buffer and the source's
// registration at once, then enqueues a host function on the stream that posts the same two
// writes and waits for their completion, so the stream moves on only once the NIC is done with
// the source. Host functions run on a CUDA thread: everything they touch (the peer's queue pair,
// CQ, doorbell staging word, failure) is under the peer's mutex, and a failure is recorded for
// SyncStream, whose pump reports it (and any failed peer) and keeps the control plane moving.
//
// Trust: the rkeys a peer learns let it write anywhere inside the buffers and the doorbell page;
// bounds are the writer's duty, as for the p2p transport.
#include "common/transport/verbs/verbs_transport.h"

#include <infiniband/verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/control_plane.h"
#include "common/transport/verbs/verbs_qp.h"
#include "common/transport/verbs/verbs_wire.h"

#if TANDEM_VERBS_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include "common/transport/device/device_path.h"
#endif

namespace tandem::transport {
namespace {

using verbs::BufferDescriptor;
using verbs::LocalPort;
using verbs::LocalRange;
using verbs::QpInfo;
using verbs::QpState;
using verbs::QpStateMachine;

constexpr bool kCuda = TANDEM_VERBS_CUDA != 0;
constexpr int kSendQueueDepth = 64;                        // work requests per queue pair
constexpr uint64_t kMaxChunk = uint64_t{1} << 30;          // bytes per work request, at most
constexpr absl::Duration kRemoteWait = absl::Seconds(30);  // for a peer's ready and descriptors
constexpr absl::Duration kCompletionWait = absl::Seconds(60);
constexpr absl::Duration kPumpWait = absl::Microseconds(20);  // positive: see ControlPlaneTransport::Pump
constexpr absl::Duration kPumpEvery = absl::Microseconds(200);
constexpr absl::Duration kSpinTime = absl::Milliseconds(2);  // WaitDoorbell spins hot this long
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;

#if TANDEM_VERBS_CUDA
#define VERBS_CUDA(expr)                                                                       \
  do {                                                                                         \
    const cudaError_t verbs_err_ = (expr);                                                     \
    if (verbs_err_ != cudaSuccess) {                                                           \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorName(verbs_err_), " (", \
                                              cudaGetErrorString(verbs_err_), ")"));           \
    }                                                                                          \
  } while (0)
#endif

// `err`: errno, read right after the failed call (before building the message can change it).
absl::Status ErrnoStatus(int err, std::string_view what) { return ErrnoToStatus(err != 0 ? err : EIO, what); }

size_t PageSize() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

// Page-aligned host memory, zeroed.
void* AllocHost(size_t bytes) {
  const size_t page = PageSize();
  void* p = std::aligned_alloc(page, (bytes + page - 1) / page * page);
  if (p != nullptr) std::memset(p, 0, bytes);
  return p;
}

struct MrDeleter {
  void operator()(ibv_mr* mr) const {
    if (mr != nullptr) ibv_dereg_mr(mr);
  }
};
using Mr = std::unique_ptr<ibv_mr, MrDeleter>;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// One write: payload (if any) from a registered local range, then the doorbell.
struct WriteOp {
  uint64_t src = 0;
  uint32_t lkey = 0;
  uint64_t bytes = 0;
  uint64_t dst = 0;
  uint32_t rkey = 0;
  uint64_t doorbell = 0;
  uint32_t doorbell_rkey = 0;
  uint64_t seqno = 0;
};

// Everything about one peer. The fields under `mu` are also used by the device path's host
// functions; the rest belongs to the thread that drives the transport.
struct Peer {
  explicit Peer(std::string peer_name) : name(std::move(peer_name)), machine(absl::StrCat("QP to ", name)) {}
  ~Peer() {
    seqno_mr.reset();
    if (qp != nullptr) ibv_destroy_qp(qp);
    if (cq != nullptr) ibv_destroy_cq(cq);
  }

  std::string name;
  QpStateMachine machine;
  LocalPort local;
  QpInfo remote_info;
  bool have_remote_info = false;
  bool remote_ready = false;  // its queue pair accepts our writes
  std::map<uint32_t, BufferDescriptor> buffers;

  std::mutex mu;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  std::unique_ptr<uint64_t, FreeDeleter> seqno;  // the doorbell value being written, registered
  Mr seqno_mr;
  uint64_t next_wr_id = 1;
  absl::Status failure;  // a failed post or completion: the queue pair is unusable
};

struct LocalBuffer {
  void* base = nullptr;
  size_t bytes = 0;
  bool device = false;
  Mr mr;
  BufferDescriptor descriptor;
};

class VerbsTransport : public ControlPlaneTransport {
 public:
  VerbsTransport(std::unique_ptr<Transport> control, ibv_context* context, const VerbsOptions& options)
      : ControlPlaneTransport(std::move(control)), context_(context), options_(options) {
    caps_.name = "verbs";
    caps_.gpu_memory = kCuda && options.device >= 0;
    caps_.device_polling = caps_.gpu_memory;
    caps_.same_host_only = false;
  }

  ~VerbsTransport() override {
#if TANDEM_VERBS_CUDA
    if (device_doorbells()) cudaSetDevice(options_.device);
    device_path_.reset();
#endif
    peers_.clear();
    local_.clear();
    staging_mr_.reset();
    staging_.reset();
    doorbell_mr_.reset();
#if TANDEM_VERBS_CUDA
    if (device_doorbells()) cudaFree(doorbells_);
#endif
    if (!device_doorbells()) std::free(doorbells_);
    if (pd_ != nullptr) ibv_dealloc_pd(pd_);
    if (context_ != nullptr) ibv_close_device(context_);
  }

  absl::Status Init() {
    const std::string dev = ibv_get_device_name(context_->device);
    if (options_.port < 1 || options_.port > 255) {
      return absl::InvalidArgumentError(
          absl::StrCat("verbs transport: port ", options_.port, " of ", dev, " is not in [1, 255]"));
    }
    ibv_port_attr port{};
    if (const int rc = ibv_query_port(context_, static_cast<uint8_t>(options_.port), &port); rc != 0) {
      return Annotate(ErrnoToStatus(rc, absl::StrCat("ibv_query_port(", dev, ", ", options_.port, ")")),
                      "verbs transport");
    }
    if (port.state != IBV_PORT_ACTIVE) {
      return absl::UnavailableError(absl::StrCat("verbs transport: port ", options_.port, " of ", dev, " is ",
                                                 ibv_port_state_str(port.state), ", not active"));
    }
    if (options_.gid_index < 0 || options_.gid_index >= port.gid_tbl_len || options_.gid_index > 255) {
      return absl::InvalidArgumentError(absl::StrCat("verbs transport: gid_index ", options_.gid_index,
                                                     " is outside the GID table of ", dev, " port ",
                                                     options_.port, " (", port.gid_tbl_len, " entries)"));
    }
    ibv_gid gid{};
    if (ibv_query_gid(context_, static_cast<uint8_t>(options_.port), options_.gid_index, &gid) != 0) {
      const int err = errno;
      return Annotate(
          ErrnoStatus(err, absl::StrCat("ibv_query_gid(", dev, ", gid_index ", options_.gid_index, ")")),
          "verbs transport");
    }
    port_.ethernet = port.link_layer == IBV_LINK_LAYER_ETHERNET;
    port_.gid_index = static_cast<uint8_t>(options_.gid_index);
    port_.info.port = static_cast<uint8_t>(options_.port);
    port_.info.lid = port.lid;
    port_.info.mtu = static_cast<uint8_t>(port.active_mtu);
    std::memcpy(port_.info.gid.data(), gid.raw, port_.info.gid.size());
    if (port_.ethernet &&
        std::all_of(port_.info.gid.begin(), port_.info.gid.end(), [](uint8_t b) { return b == 0; })) {
      return absl::UnavailableError(absl::StrCat("verbs transport: GID ", options_.gid_index, " of ", dev,
                                                 " port ", options_.port,
                                                 " is empty (no address on the RoCE port)"));
    }
    max_chunk_ = std::min<uint64_t>(kMaxChunk, port.max_msg_sz > 0 ? port.max_msg_sz : kMaxChunk);
    pd_ = ibv_alloc_pd(context_);
    if (pd_ == nullptr) {
      const int err = errno;
      return Annotate(ErrnoStatus(err, absl::StrCat("ibv_alloc_pd(", dev, ")")), "verbs transport");
    }

    if (device_doorbells()) {
#if TANDEM_VERBS_CUDA
      VERBS_CUDA(cudaSetDevice(options_.device));
      // Its own allocation, large enough to be page-aligned for a dma-buf export.
      VERBS_CUDA(cudaMalloc(&doorbells_, kDeviceDoorbellAllocation));
      VERBS_CUDA(cudaMemset(doorbells_, 0, kDeviceDoorbellAllocation));
      VERBS_CUDA(cudaDeviceSynchronize());
      ASSIGN_OR_RETURN(doorbell_mr_,
                       RegisterDevice(doorbells_, verbs::kDoorbellPageBytes, "the doorbell page"));
      ASSIGN_OR_RETURN(device_path_, DevicePath::Create(options_.device));
#endif
    } else {
      doorbells_ = AllocHost(verbs::kDoorbellPageBytes);
      if (doorbells_ == nullptr)
        return absl::ResourceExhaustedError("verbs transport: no memory for doorbells");
      doorbell_mr_.reset(ibv_reg_mr(pd_, doorbells_, verbs::kDoorbellPageBytes, kAccess));
      if (doorbell_mr_ == nullptr) {
        return Annotate(ErrnoStatus(errno, "ibv_reg_mr(doorbell page)"), "verbs transport");
      }
    }
    return absl::OkStatus();
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override {
    std::vector<uint32_t> ids;
    for (const auto& [other, b] : local_) ids.push_back(other);
    RETURN_IF_ERROR(verbs::CheckDoorbellSlotFree(id, ids));
    if (base == nullptr || bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat("verbs buffer ", id, ": empty range (", bytes,
                                                     " bytes at ", reinterpret_cast<uintptr_t>(base), ")"));
    }
    auto b = std::make_unique<LocalBuffer>();
    b->base = base;
    b->bytes = bytes;
    const std::string what = absl::StrCat("buffer ", id);
    ASSIGN_OR_RETURN(b->device, IsDeviceMemory(base, what));
    if (b->device) {
#if TANDEM_VERBS_CUDA
      ASSIGN_OR_RETURN(b->mr, RegisterDevice(base, bytes, what));
#endif
    } else {
      b->mr.reset(ibv_reg_mr(pd_, base, bytes, kAccess));
      if (b->mr == nullptr) {
        const int err = errno;
        return ErrnoStatus(err,
                           absl::StrCat("verbs: ibv_reg_mr(", what, ", ", bytes, " bytes of host memory)"));
      }
    }
    b->descriptor =
        BufferDescriptor{.buffer = id,
                         .rkey = b->mr->rkey,
                         .addr = reinterpret_cast<uint64_t>(base),
                         .bytes = bytes,
                         .doorbell = reinterpret_cast<uint64_t>(doorbells_) + verbs::DoorbellOffset(id),
                         .doorbell_rkey = doorbell_mr_->rkey};
    const std::vector<uint8_t> frame = verbs::EncodeDescriptor(b->descriptor);
    local_[id] = std::move(b);
    for (const auto& [peer, p] : peers_) {
      RETURN_IF_ERROR(Annotate(control().Send(peer, frame), absl::StrCat("verbs: descriptor of ", what)));
    }
    return absl::OkStatus();
  }

  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override {
    const std::string what = absl::StrCat("verbs Write to buffer ", buffer, " of ", PeerName(peer));
    if (seqno == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": seqno 0 (doorbells start at 0)"));
    uint64_t total = 0;
    size_t nonempty = 0;
    const uint8_t* only = nullptr;
    for (const auto& p : pieces) {
      total += p.size();
      if (!p.empty()) ++nonempty, only = p.data();
    }
    ASSIGN_OR_RETURN(Peer * p, FindPeer(peer));
    ASSIGN_OR_RETURN(const BufferDescriptor d, RemoteBuffer(*p, peer, buffer, absl::Now() + kRemoteWait));
    RETURN_IF_ERROR(Annotate(verbs::CheckWriteBounds(offset, total, d.bytes), what));
    WriteOp op = ToRemote(d, offset, total, seqno);
    // Zero copy when the one piece lies inside a registered buffer of ours.
    const LocalBuffer* src = nonempty == 1 ? Containing(reinterpret_cast<uint64_t>(only), total) : nullptr;
    if (src != nullptr) {
      op.src = reinterpret_cast<uint64_t>(only);
      op.lkey = src->mr->lkey;
    } else if (total > 0) {
      RETURN_IF_ERROR(Annotate(Stage(pieces, total), what));
      op.src = reinterpret_cast<uint64_t>(staging_.get());
      op.lkey = staging_mr_->lkey;
    }
    return PostAndComplete(*p, op);
  }

  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override {
    if (!local_.contains(buffer)) return absl::NotFoundError(absl::StrCat("verbs: no buffer ", buffer));
    const absl::Time start = absl::Now();
    absl::Time last_pump = start;
    for (uint64_t spins = 0;; ++spins) {
      ASSIGN_OR_RETURN(const uint64_t seen, ReadDoorbell(buffer));
      if (seen >= seqno) return absl::OkStatus();
      // Host doorbells cost nanoseconds to read: look at the clock only now and then.
      if (device_doorbells() || spins % 64 == 63) {
        const absl::Time now = absl::Now();
        if (now >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("verbs: waiting for doorbell seqno ", seqno,
                                                          " of buffer ", buffer, " (it is at ", seen, ")"));
        }
        // Past kSpinTime, every check pumps: the control channel's wait is where this one rests.
        if (now - last_pump >= kPumpEvery || now - start >= kSpinTime) {
          RETURN_IF_ERROR(Pump(kPumpWait));
          last_pump = absl::Now();
        }
      }
    }
  }

  uint64_t Doorbell(uint32_t buffer) const override {
    if (!local_.contains(buffer)) return 0;
    const absl::StatusOr<uint64_t> v = ReadDoorbell(buffer);
    return v.ok() ? *v : 0;
  }

  // Writes complete inside Write (and inside the device path's host functions), so only the
  // control channel can have work in flight.
  absl::Status Flush(absl::Time deadline) override { return control().Flush(deadline); }

#if TANDEM_VERBS_CUDA
  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override {
    if (device_path_ == nullptr) return Unsupported("EnqueueWrite");
    const std::string what = absl::StrCat("verbs EnqueueWrite to buffer ", buffer, " of ", PeerName(peer));
    if (seqno == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": seqno 0 (doorbells start at 0)"));
    ASSIGN_OR_RETURN(Peer * p, FindPeer(peer));
    ASSIGN_OR_RETURN(const BufferDescriptor d, RemoteBuffer(*p, peer, buffer, absl::Now() + kRemoteWait));
    RETURN_IF_ERROR(Annotate(verbs::CheckWriteBounds(offset, bytes, d.bytes), what));
    auto job = std::make_unique<HostWrite>();
    job->self = this;
    job->peer = p;
    job->op = ToRemote(d, offset, bytes, seqno);
    if (bytes > 0) {
      const LocalBuffer* from = Containing(reinterpret_cast<uint64_t>(src), bytes);
      if (from == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": the source (", bytes, " bytes at ", reinterpret_cast<uintptr_t>(src),
                         ") is not inside a registered buffer of this process"));
      }
      job->op.src = reinterpret_cast<uint64_t>(src);
      job->op.lkey = from->mr->lkey;
    }
    VERBS_CUDA(cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), &RunHostWrite, job.get()));
    (void)job.release();  // RunHostWrite owns it now
    return absl::OkStatus();
  }

  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override {
    if (device_path_ == nullptr) return Unsupported("EnqueueWait");
    auto it = local_.find(buffer);
    if (it == local_.end()) return absl::NotFoundError(absl::StrCat("verbs EnqueueWait: no buffer ", buffer));
    RETURN_IF_ERROR(Annotate(verbs::CheckWriteBounds(offset, bytes, it->second->bytes),
                             absl::StrCat("verbs EnqueueWait on buffer ", buffer, " for ", PeerName(peer))));
    const uint64_t* doorbell = static_cast<const uint64_t*>(doorbells_) + verbs::DoorbellSlot(buffer);
    return device_path_->EnqueueWait(doorbell, seqno, timeout, label, stream);
  }

  absl::Status SyncStream(void* stream, absl::Time deadline) override {
    if (device_path_ == nullptr) return Unsupported("SyncStream");
    return device_path_->Sync(stream, deadline, [this] { return DevicePump(); });
  }
#endif

 private:
  bool device_doorbells() const { return kCuda && options_.device >= 0; }

  absl::StatusOr<Peer*> FindPeer(PeerId peer) {
    auto it = peers_.find(peer);
    if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("verbs: no peer ", peer));
    return it->second.get();
  }

  // A new connection: its queue pair (to INIT), then our QP info and every buffer so far.
  absl::Status OnNewPeer(PeerId id) override {
    const std::string name = PeerName(id);
    auto p = std::make_unique<Peer>(name);
    const std::string what = absl::StrCat("verbs: queue pair to ", name);
    auto failed = [&what](const char* call) {
      const int err = errno;  // before the message is built
      return ErrnoStatus(err, absl::StrCat(what, ": ", call));
    };
    p->cq = ibv_create_cq(context_, kSendQueueDepth, nullptr, nullptr, 0);
    if (p->cq == nullptr) return failed("ibv_create_cq");
    ibv_qp_init_attr init{};
    init.send_cq = p->cq;
    init.recv_cq = p->cq;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = 0;
    init.cap.max_send_wr = kSendQueueDepth;
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    p->qp = ibv_create_qp(pd_, &init);
    if (p->qp == nullptr) return failed("ibv_create_qp");
    p->seqno.reset(static_cast<uint64_t*>(AllocHost(sizeof(uint64_t))));
    if (p->seqno == nullptr) return absl::ResourceExhaustedError(absl::StrCat(what, ": no memory"));
    p->seqno_mr.reset(ibv_reg_mr(pd_, p->seqno.get(), sizeof(uint64_t), IBV_ACCESS_LOCAL_WRITE));
    if (p->seqno_mr == nullptr) return failed("ibv_reg_mr(doorbell staging)");
    p->local = port_;
    p->local.info.qp_num = p->qp->qp_num;
    p->local.info.psn = std::random_device{}() & 0xFFFFFF;
    RETURN_IF_ERROR(p->machine.ToInit(port_.info.port, Apply(p->qp)));
    Peer& peer = *(peers_[id] = std::move(p));
    RETURN_IF_ERROR(Annotate(control().Send(id, verbs::EncodeQpInfo(peer.local.info)), "verbs: QP info"));
    for (const auto& [buffer, b] : local_) {
      RETURN_IF_ERROR(Annotate(control().Send(id, verbs::EncodeDescriptor(b->descriptor)),
                               absl::StrCat("verbs: descriptor of buffer ", buffer)));
    }
    return absl::OkStatus();
  }

  static QpStateMachine::Apply Apply(ibv_qp* qp) {
    return [qp](ibv_qp_attr* attr, int mask) { return ibv_modify_qp(qp, attr, mask); };
  }

  // A control frame of this transport is applied and consumed (true); anything else is the
  // caller's (false). A malformed frame is DataLoss naming the peer.
  absl::StatusOr<bool> Consume(PeerId from, const std::vector<uint8_t>& m) override {
    const std::optional<uint32_t> magic = verbs::OurMagic(m);
    if (!magic) return false;
    const std::string who = absl::StrCat("verbs: from ", PeerName(from));
    auto it = peers_.find(from);
    if (it == peers_.end())
      return absl::DataLossError(absl::StrCat(who, ": a frame for a peer without queue pair"));
    Peer& p = *it->second;
    auto bad = [&](const absl::Status& s) {
      return absl::DataLossError(absl::StrCat(who, ": ", s.message()));
    };
    if (*magic == verbs::kQpInfoMagic) {
      absl::StatusOr<QpInfo> info = verbs::DecodeQpInfo(m);
      if (!info.ok()) return bad(info.status());
      if (p.have_remote_info) return absl::DataLossError(absl::StrCat(who, ": a second QP info"));
      p.have_remote_info = true;
      p.remote_info = *info;
      RETURN_IF_ERROR(p.machine.ToRtr(p.local, *info, Apply(p.qp)));
      RETURN_IF_ERROR(p.machine.ToRts(p.local, Apply(p.qp)));
      RETURN_IF_ERROR(Annotate(control().Send(from, verbs::EncodeReady({.qp_num = p.local.info.qp_num})),
                               "verbs: ready"));
    } else if (*magic == verbs::kReadyMagic) {
      absl::StatusOr<verbs::ReadyFrame> ready = verbs::DecodeReady(m);
      if (!ready.ok()) return bad(ready.status());
      if (!p.have_remote_info || ready->qp_num != p.remote_info.qp_num) {
        return absl::DataLossError(
            absl::StrCat(who, ": ready for queue pair ", ready->qp_num,
                         p.have_remote_info ? absl::StrCat(", its QP info said ", p.remote_info.qp_num)
                                            : std::string(", before its QP info")));
      }
      p.remote_ready = true;
    } else {
      absl::StatusOr<BufferDescriptor> d = verbs::DecodeDescriptor(m);
      if (!d.ok()) return bad(d.status());
      if (p.buffers.contains(d->buffer)) {
        return absl::DataLossError(absl::StrCat(who, ": a second descriptor of buffer ", d->buffer));
      }
      p.buffers[d->buffer] = *d;
    }
    return true;
  }

  // The descriptor of the peer's `buffer`, once the peer's queue pair is ready for our writes.
  absl::StatusOr<BufferDescriptor> RemoteBuffer(Peer& p, PeerId peer, uint32_t buffer, absl::Time deadline) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(p.mu);
        if (!p.failure.ok()) return p.failure;
      }
      if (p.machine.state() == QpState::kError) return p.machine.error();
      if (p.machine.state() == QpState::kRts && p.remote_ready) {
        auto it = p.buffers.find(buffer);
        if (it != p.buffers.end()) return it->second;
      }
      RETURN_IF_ERROR(Pump(kPumpWait));
      if (absl::Now() >= deadline) {
        if (p.machine.state() != QpState::kRts || !p.remote_ready) {
          return absl::DeadlineExceededError(
              absl::StrCat("verbs: the queue pair to ", p.name, " is not connected (",
                           verbs::QpStateName(p.machine.state()),
                           p.remote_ready ? "" : ", the peer has not said ready", ")"));
        }
        return absl::DeadlineExceededError(
            absl::StrCat("verbs: buffer ", buffer, " of ", p.name, " was never registered"));
      }
    }
  }

  static WriteOp ToRemote(const BufferDescriptor& d, uint64_t offset, uint64_t bytes, uint64_t seqno) {
    return WriteOp{.bytes = bytes,
                   .dst = d.addr + offset,
                   .rkey = d.rkey,
                   .doorbell = d.doorbell,
                   .doorbell_rkey = d.doorbell_rkey,
                   .seqno = seqno};
  }

  const LocalBuffer* Containing(uint64_t addr, uint64_t bytes) const {
    std::vector<LocalRange> ranges;
    ranges.reserve(local_.size());
    for (const auto& [id, b] : local_) {
      ranges.push_back({.id = id, .base = reinterpret_cast<uint64_t>(b->base), .bytes = b->bytes});
    }
    const std::optional<LocalRange> r = verbs::FindContaining(ranges, addr, bytes);
    return r ? local_.at(r->id).get() : nullptr;
  }

  // Copies the pieces into the staging buffer, growing (and re-registering) it as needed.
  absl::Status Stage(absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t total) {
    const size_t want = verbs::StagingBytesFor(staging_bytes_, total);
    if (want != staging_bytes_ || staging_ == nullptr) {
      staging_mr_.reset();
      staging_.reset(static_cast<uint8_t*>(AllocHost(want)));
      staging_bytes_ = 0;
      if (staging_ == nullptr) {
        return absl::ResourceExhaustedError(
            absl::StrCat("no memory for a staging buffer of ", want, " bytes"));
      }
      staging_mr_.reset(ibv_reg_mr(pd_, staging_.get(), want, IBV_ACCESS_LOCAL_WRITE));
      if (staging_mr_ == nullptr) {
        const int err = errno;
        return ErrnoStatus(err, absl::StrCat("ibv_reg_mr(staging buffer of ", want, " bytes)"));
      }
      staging_bytes_ = want;
    }
    uint8_t* at = staging_.get();
    for (const auto& piece : pieces) {
      if (piece.empty()) continue;
      ASSIGN_OR_RETURN(const bool device, IsDeviceMemory(piece.data(), "a piece"));
      if (device) {
#if TANDEM_VERBS_CUDA
        VERBS_CUDA(cudaMemcpy(at, piece.data(), piece.size(), cudaMemcpyDeviceToHost));
#endif
      } else {
        std::memcpy(at, piece.data(), piece.size());
      }
      at += piece.size();
    }
    return absl::OkStatus();
  }

  // Posts the payload (if any) and the doorbell, then polls the peer's CQ until the doorbell
  // write completes. Runs on the driving thread (Write) or on a CUDA thread (EnqueueWrite).
  absl::Status PostAndComplete(Peer& p, const WriteOp& op) {
    std::lock_guard<std::mutex> lock(p.mu);
    if (!p.failure.ok()) return p.failure;
    const uint64_t chunks = verbs::PayloadChunks(op.bytes, max_chunk_);
    if (chunks + 1 > kSendQueueDepth) {
      return absl::InvalidArgumentError(absl::StrCat("verbs: a write of ", op.bytes, " bytes to ", p.name,
                                                     " needs ", chunks + 1, " work requests, more than the ",
                                                     kSendQueueDepth, " of a send queue"));
    }
    std::vector<ibv_sge> sges(chunks + 1);
    std::vector<ibv_send_wr> wrs(chunks + 1);
    for (uint64_t i = 0; i <= chunks; ++i) {
      ibv_send_wr& wr = wrs[i];
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.next = i < chunks ? &wrs[i + 1] : nullptr;
      if (i < chunks) {
        const uint64_t at = i * max_chunk_;
        sges[i] = {.addr = op.src + at,
                   .length = static_cast<uint32_t>(std::min(max_chunk_, op.bytes - at)),
                   .lkey = op.lkey};
        wr.wr.rdma.remote_addr = op.dst + at;
        wr.wr.rdma.rkey = op.rkey;
      } else {
        *p.seqno = op.seqno;
        sges[i] = {.addr = reinterpret_cast<uint64_t>(p.seqno.get()),
                   .length = sizeof(uint64_t),
                   .lkey = p.seqno_mr->lkey};
        wr.wr.rdma.remote_addr = op.doorbell;
        wr.wr.rdma.rkey = op.doorbell_rkey;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr_id = p.next_wr_id++;
      }
    }
    ibv_send_wr* bad = nullptr;
    if (const int rc = ibv_post_send(p.qp, wrs.data(), &bad); rc != 0) {
      p.failure = absl::UnavailableError(
          absl::StrCat("verbs: ibv_post_send to ", p.name, " failed: ", std::strerror(rc)));
      return p.failure;
    }
    const uint64_t want = wrs.back().wr_id;
    const absl::Time deadline = absl::Now() + kCompletionWait;
    for (uint64_t polls = 0;; ++polls) {
      ibv_wc wc{};
      const int n = ibv_poll_cq(p.cq, 1, &wc);
      if (n < 0) {
        p.failure = absl::UnavailableError(absl::StrCat("verbs: ibv_poll_cq for ", p.name, " failed"));
        return p.failure;
      }
      if (n == 1) {
        if (wc.status != IBV_WC_SUCCESS) {
          p.failure = absl::UnavailableError(absl::StrCat("verbs: RDMA write to ", p.name,
                                                          " failed: ", ibv_wc_status_str(wc.status),
                                                          " (vendor error ", wc.vendor_err, ")"));
          return p.failure;
        }
        if (wc.wr_id == want) return absl::OkStatus();
        continue;
      }
      if (polls % 1024 == 1023 && absl::Now() >= deadline) {
        // The queue pair may still own the source: it cannot be used again.
        p.failure = absl::UnavailableError(absl::StrCat(
            "verbs: RDMA write to ", p.name, " did not complete in ", absl::FormatDuration(kCompletionWait)));
        return p.failure;
      }
    }
  }

  absl::StatusOr<uint64_t> ReadDoorbell(uint32_t buffer) const {
    const uint64_t* slot = static_cast<const uint64_t*>(doorbells_) + verbs::DoorbellSlot(buffer);
    if (device_doorbells()) {
#if TANDEM_VERBS_CUDA
      uint64_t v = 0;
      VERBS_CUDA(cudaSetDevice(options_.device));
      VERBS_CUDA(cudaMemcpy(&v, slot, sizeof(v), cudaMemcpyDeviceToHost));
      return v;
#endif
    }
    // The NIC writes it: read it from memory every time.
    return __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  }

  // Whether `p` is device memory of our GPU (InvalidArgument for another GPU's or managed memory).
  absl::StatusOr<bool> IsDeviceMemory(const void* p, const std::string& what) const {
    if (!device_doorbells()) return false;
#if TANDEM_VERBS_CUDA
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    if (attr.type == cudaMemoryTypeManaged) {
      return absl::InvalidArgumentError(
          absl::StrCat("verbs: ", what, " is managed memory, which RDMA cannot use"));
    }
    if (attr.type == cudaMemoryTypeDevice) {
      if (attr.device != options_.device) {
        return absl::InvalidArgumentError(absl::StrCat("verbs: ", what,
                                                       " is device memory of cuda:", attr.device,
                                                       ", this transport's GPU is cuda:", options_.device));
      }
      return true;
    }
#endif
    return false;
  }

#if TANDEM_VERBS_CUDA
  static constexpr size_t kDeviceDoorbellAllocation = size_t{2} << 20;

  template <typename Fn>
  static absl::StatusOr<Fn> Driver(const char* name) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    VERBS_CUDA(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found));
    if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
      return absl::UnavailableError(absl::StrCat("the CUDA driver has no ", name));
    }
    return reinterpret_cast<Fn>(fn);
  }

  // A dma-buf export of the pages holding [base, base + bytes), registered.
  absl::StatusOr<Mr> RegisterDmabuf(void* base, size_t bytes) {
    using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    using HandleFn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
    ASSIGN_OR_RETURN(AddressRangeFn range, Driver<AddressRangeFn>("cuMemGetAddressRange"));
    ASSIGN_OR_RETURN(HandleFn handle, Driver<HandleFn>("cuMemGetHandleForAddressRange"));
    CUdeviceptr alloc = 0;
    size_t alloc_bytes = 0;
    if (const CUresult r = range(&alloc, &alloc_bytes, reinterpret_cast<CUdeviceptr>(base));
        r != CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuMemGetAddressRange: CUDA error ", static_cast<int>(r)));
    }
    ASSIGN_OR_RETURN(
        const verbs::DmabufSpan span,
        verbs::DmabufSpanFor(reinterpret_cast<uint64_t>(base), bytes, alloc, alloc_bytes, PageSize()));
    int fd = -1;
    if (const CUresult r = handle(&fd, span.base, span.bytes, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
        r != CUDA_SUCCESS) {
      return absl::UnavailableError(
          absl::StrCat("cuMemGetHandleForAddressRange: CUDA error ", static_cast<int>(r)));
    }
    Mr mr(ibv_reg_dmabuf_mr(pd_, span.offset, bytes, reinterpret_cast<uint64_t>(base), fd, kAccess));
    const int err = errno;
    close(fd);  // the registration holds its own reference
    if (mr == nullptr) return ErrnoStatus(err, "ibv_reg_dmabuf_mr");
    return mr;
  }

  // Registers device memory: a dma-buf export first, else the device pointer itself
  // (nvidia-peermem). The error names both attempts.
  absl::StatusOr<Mr> RegisterDevice(void* base, size_t bytes, const std::string& what) {
    VERBS_CUDA(cudaSetDevice(options_.device));
    absl::StatusOr<Mr> dmabuf = RegisterDmabuf(base, bytes);
    if (dmabuf.ok()) return dmabuf;
    Mr mr(ibv_reg_mr(pd_, base, bytes, kAccess));
    if (mr != nullptr) return mr;
    const absl::Status peermem = ErrnoStatus(errno, "ibv_reg_mr on the device pointer (nvidia-peermem)");
    return absl::UnavailableError(absl::StrCat(
        "verbs: cannot register ", what, " (", bytes, " bytes of device memory of cuda:", options_.device,
        ") for RDMA: dma-buf: ", dmabuf.status().message(), "; ", peermem.message()));
  }

  struct HostWrite {
    VerbsTransport* self = nullptr;
    Peer* peer = nullptr;
    WriteOp op;
  };

  // On a CUDA thread, when the stream reaches it; no CUDA calls allowed here.
  static void CUDART_CB RunHostWrite(void* arg) {
    std::unique_ptr<HostWrite> job(static_cast<HostWrite*>(arg));
    const absl::Status s = job->self->PostAndComplete(*job->peer, job->op);
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(job->self->async_mu_);
      if (job->self->async_failure_.ok()) job->self->async_failure_ = s;
    }
  }

  // SyncStream's pump: a write the device path failed, a failed queue pair, the control plane.
  absl::Status DevicePump() {
    {
      std::lock_guard<std::mutex> lock(async_mu_);
      if (!async_failure_.ok()) return async_failure_;
    }
    for (const auto& [id, p] : peers_) {
      std::unique_lock<std::mutex> lock(p->mu, std::try_to_lock);  // a host function may be polling
      if (lock.owns_lock() && !p->failure.ok()) return p->failure;
    }
    return Pump(kPumpWait);
  }

  std::unique_ptr<DevicePath> device_path_;
  std::mutex async_mu_;
  absl::Status async_failure_;  // the first failed host write
#endif

  ibv_context* context_ = nullptr;
  VerbsOptions options_;
  Capabilities caps_;
  ibv_pd* pd_ = nullptr;
  LocalPort port_;  // our port; qp_num and psn are per peer
  uint64_t max_chunk_ = kMaxChunk;
  void* doorbells_ = nullptr;  // kDoorbellSlots u64, device or host memory
  Mr doorbell_mr_;
  std::unique_ptr<uint8_t, FreeDeleter> staging_;
  size_t staging_bytes_ = 0;
  Mr staging_mr_;
  std::map<uint32_t, std::unique_ptr<LocalBuffer>> local_;
  std::map<PeerId, std::unique_ptr<Peer>> peers_;
};

}  // namespace

std::vector<std::string> RdmaDeviceNames() {
  std::vector<std::string> names;
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) return names;
  for (int i = 0; i < n; ++i) names.emplace_back(ibv_get_device_name(list[i]));
  ibv_free_device_list(list);
  return names;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const VerbsOptions& options) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("verbs transport: no RDMA device (ibv_get_device_list: ", std::strerror(errno), ")"));
  }
  std::unique_ptr<ibv_device*, void (*)(ibv_device**)> devices(list, ibv_free_device_list);
  if (n == 0) return absl::UnavailableError("verbs transport: no RDMA device (ibv_get_device_list found 0)");
  ibv_device* chosen = nullptr;
  std::vector<std::string> present;
  for (int i = 0; i < n; ++i) {
    present.emplace_back(ibv_get_device_name(list[i]));
    if (chosen == nullptr && (options.rdma_device.empty() || options.rdma_device == present.back())) {
      chosen = list[i];
    }
  }
  if (chosen == nullptr) {
    return absl::UnavailableError(absl::StrCat("verbs transport: no RDMA device \"", options.rdma_device,
                                               "\"; this host has ", absl::StrJoin(present, ", ")));
  }
#if TANDEM_VERBS_CUDA
  if (options.device >= 0) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      count = 0;
    }
    if (count == 0) {
      return absl::UnavailableError(
          absl::StrCat("verbs transport: cuda:", options.device, " requested but there is no CUDA device"));
    }
    if (options.device >= count) {
      return absl::InvalidArgumentError(absl::StrCat("verbs transport: cuda:", options.device,
                                                     " requested but ", count, " device(s) are visible"));
    }
  }
#endif
  absl::StatusOr<std::unique_ptr<Transport>> control =
      CreateUcxTransport({.listen_address = options.listen_address});
  if (!control.ok()) return Annotate(control.status(), "verbs transport: control plane");
  ibv_context* context = ibv_open_device(chosen);
  if (context == nullptr) {
    const int err = errno;
    return Annotate(ErrnoStatus(err, absl::StrCat("ibv_open_device(", ibv_get_device_name(chosen), ")")),
                    "verbs transport");
  }
  auto t = std::make_unique<VerbsTransport>(std::move(control).value(), context, options);
  RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::transport
