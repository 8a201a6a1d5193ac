// The p2p transport (docs/architecture.md, "Transports"): GPUs of one host. Registered buffers live in
// device memory; a writer's kernel copies the payload straight into the receiver's buffer (CUDA
// IPC mapping; NVLink or PCIe, or within one GPU when both processes share it) and then, after a
// system-wide fence, stores the sequence number into the receiver's doorbell, so the doorbell can
// only change after the payload has landed (common/transport/device).
//
// Control messages, connections and peer-failure detection are the UCX transport's (an inner
// transport this one wraps: common/transport/control_plane.h). Buffer descriptors travel on that
// channel: RegisterBuffer sends the
// buffer's IPC handle, offset, size and doorbell slot to every connected peer, and a new
// connection gets every buffer registered so far. The channel is ordered per peer, so a
// descriptor always arrives before any message the owner sends after registering; control
// frames of this transport are consumed inside its calls and never reach the caller.
//
// Doorbells: one device page of 64-bit counters per process, exported once; buffer `id` owns slot
// `id % kSlots` (ids must be distinct modulo kSlots). After the counters, the same allocation holds
// each slot's ring of payload checksums (common/transport/device/payload_checksum.h): every write
// kernel stores {seqno, checksum} into the receiver's ring before the doorbell, and a receiver with
// checksums on (P2pOptions::checksums, SetDeviceChecksums: a deployment's transport.checksums) checks the
// landed bytes against it after each device wait (a kernel on the same stream: DataLoss from SyncStream
// naming the wait on a mismatch). The host-driven WaitDoorbell does not check.
//
// Two data paths share the buffers and doorbells:
//   * host-driven (Write / WaitDoorbell): the pieces (gathered into device staging unless they are
//     one device buffer) go by the write kernel below on the transport's stream, which the call
//     waits for; the receiver polls its doorbell from the host (an 8-byte device-to-host copy per
//     poll, a few microseconds each). Plain copies, payload then seqno in stream order, let the
//     doorbell overtake the payload between GPUs (seen on NVLink);
//   * device (EnqueueWrite / EnqueueWait / SyncStream): on the caller's stream, one kernel copies
//     the payload into the peer's mapped buffer and stores the doorbell after a system-wide fence,
//     and the receiver's wait is a kernel that polls its doorbell with a deadline
//     (common/transport/device). No host call sits between the layers of a step.
//
// Two processes on one GPU (a compute rank and a memory rank sharing it): the GPU runs one
// process's context at a time, so a spinning wait kernel would hold the GPU against the very
// kernels it waits for. Between such peers the device path signals with CUDA IPC events instead:
// EnqueueWrite records one of the writer's interprocess events after the write kernel and sends
// a signal frame (buffer, seqno, the event's index and IPC handle, opened once by the reader) on
// the control channel; EnqueueWait waits on the host for
// the signal of that seqno (pumping the control plane, up to the wait's timeout counted from the
// call) and makes the stream wait for the event (cudaStreamWaitEvent), so the stream blocks
// without occupying the GPU and the GPU switches to the writer's work. The host stays ahead of
// the GPU (it enqueues layer l + 1 while layer l runs) as long as a signal's round trip is
// shorter than a layer's device time. A writer's events form a ring of kEvents; a reader must
// not fall kEvents signals behind its writer (a layer's request-reply keeps it at one or two). A
// signal that does not come, a peer that fails meanwhile, or an error of the caller's poll
// (SetDevicePoll, called there about every millisecond), fails the device path (DevicePath::Fail):
// later waits fall through, nothing more is written, and SyncStream reports it. ResetDevicePath
// makes the path usable again once the stream has drained (a step run again after a rank's loss).
//
// Trust: a peer with an IPC mapping can write anywhere in the mapped buffer, so bounds are checked
// by the writer (an out-of-bounds Write is InvalidArgument before any copy); a malicious peer is
// outside this transport's model, as it is for NVLink itself.
#include "common/transport/p2p/p2p_transport.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/transport/control_plane.h"
#include "common/transport/device/device_path.h"
#include "common/transport/device/payload_checksum.h"

namespace tandem::transport {
namespace {

constexpr uint32_t kDescriptorMagic = 0x42503254;  // "T2PB" on the wire: a buffer descriptor
constexpr uint32_t kHelloMagic = 0x48503254;       // "T2PH": the sender's doorbell page
constexpr uint32_t kSignalMagic = 0x53503254;      // "T2PS": a same-GPU write's event
constexpr size_t kSlots = 512;                     // doorbells per process
constexpr int kEvents = 256;                       // interprocess events per process (a ring)
constexpr size_t kMaxSignals = 1024;               // kept per buffer and peer; older ones dropped
// The doorbell allocation: the counters, then every slot's ring of checksum entries.
constexpr size_t kDoorbellBytes = kSlots * sizeof(uint64_t) + kSlots * kChecksumRing * sizeof(ChecksumEntry);

// Buffer `buffer`'s checksum entry for `seqno` in a doorbell allocation (ours or a peer's).
ChecksumEntry* EntryOf(void* doorbells, uint32_t buffer, uint64_t seqno) {
  auto* ring = reinterpret_cast<ChecksumEntry*>(static_cast<uint64_t*>(doorbells) + kSlots);
  return ring + (buffer % kSlots) * kChecksumRing + seqno % kChecksumRing;
}

#define P2P_CUDA(expr)                                                                                     \
  do {                                                                                                     \
    const cudaError_t p2p_err_ = (expr);                                                                   \
    if (p2p_err_ != cudaSuccess) {                                                                         \
      return absl::InternalError(                                                                          \
          absl::StrCat(#expr, ": ", cudaGetErrorName(p2p_err_), " (", cudaGetErrorString(p2p_err_), ")")); \
    }                                                                                                      \
  } while (0)

// Fixed little-endian frames: magic, then fields. Both sides are this code on one host.
struct DescriptorFrame {
  uint32_t magic = kDescriptorMagic;
  uint32_t buffer = 0;
  uint64_t offset = 0;  // of the buffer inside the exported allocation
  uint64_t bytes = 0;
  cudaIpcMemHandle_t handle{};
};
struct HelloFrame {
  uint32_t magic = kHelloMagic;
  int32_t device = 0;
  cudaIpcMemHandle_t doorbells{};
};
struct SignalFrame {
  uint32_t magic = kSignalMagic;
  uint32_t buffer = 0;  // the reader's
  uint32_t event = 0;   // index into the writer's ring
  uint32_t reserved = 0;
  uint64_t seqno = 0;
  cudaIpcEventHandle_t handle{};  // of that event (the reader opens it once)
};

class P2pTransport : public ControlPlaneTransport {
 public:
  P2pTransport(std::unique_ptr<Transport> control, int device, bool checksums)
      : ControlPlaneTransport(std::move(control)), device_(device), checksums_(checksums) {
    caps_.name = "p2p";
    caps_.gpu_memory = true;
    caps_.device_polling = true;
    caps_.same_host_only = true;
    caps_.device_path_reset = true;
    caps_.device_path_new_peers = true;
    // Connect does not wait for the connection: a rejoin probe must never hold up a step.
    greet_when_connected_ = true;
  }

  ~P2pTransport() override {
    cudaSetDevice(device_);
    device_path_.reset();  // aborts and drains any wait still enqueued
    for (auto& [peer, p] : peers_) {
      for (auto& [handle, mapped] : p.mappings) cudaIpcCloseMemHandle(mapped);
      if (p.doorbells) cudaIpcCloseMemHandle(p.doorbells);
      for (cudaEvent_t e : p.events) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_) cudaStreamDestroy(stream_);
    if (doorbells_) cudaFree(doorbells_);
    if (staging_) cudaFree(staging_);
  }

  absl::Status Init() {
    P2P_CUDA(cudaSetDevice(device_));
    P2P_CUDA(cudaMalloc(&doorbells_, kDoorbellBytes));
    P2P_CUDA(cudaMemset(doorbells_, 0, kDoorbellBytes));
    P2P_CUDA(cudaIpcGetMemHandle(&doorbell_handle_, doorbells_));
    P2P_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    P2P_CUDA(cudaDeviceSynchronize());
    ASSIGN_OR_RETURN(device_path_, DevicePath::Create(device_));
    return absl::OkStatus();
  }

  const Capabilities& capabilities() const override { return caps_; }

  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override {
    if (local_.contains(id)) return absl::AlreadyExistsError(absl::StrCat("buffer ", id, " is registered"));
    for (const auto& [other, b] : local_) {
      if (other % kSlots == id % kSlots) {
        return absl::InvalidArgumentError(
            absl::StrCat("buffer ", id, " shares doorbell slot ", id % kSlots, " with buffer ", other));
      }
    }
    cudaPointerAttributes attr{};
    P2P_CUDA(cudaPointerGetAttributes(&attr, base));
    if (attr.type != cudaMemoryTypeDevice || attr.device != device_) {
      return absl::InvalidArgumentError(
          absl::StrCat("p2p buffer ", id, " must be device memory of cuda:", device_));
    }
    // The IPC handle names a whole allocation: find the one holding `base`. The driver call comes
    // through the runtime's entry-point lookup, so nothing links libcuda (absent without a driver).
    using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    P2P_CUDA(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found));
    if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
      return absl::InternalError("the CUDA driver has no cuMemGetAddressRange");
    }
    CUdeviceptr alloc = 0;
    size_t alloc_bytes = 0;
    if (reinterpret_cast<AddressRangeFn>(fn)(&alloc, &alloc_bytes, reinterpret_cast<CUdeviceptr>(base)) !=
        CUDA_SUCCESS) {
      return absl::InternalError(absl::StrCat("cuMemGetAddressRange failed for buffer ", id));
    }
    DescriptorFrame d;
    d.buffer = id;
    d.offset = reinterpret_cast<CUdeviceptr>(base) - alloc;
    d.bytes = bytes;
    if (d.offset + bytes > alloc_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", id, " runs past its allocation"));
    }
    P2P_CUDA(cudaIpcGetMemHandle(&d.handle, reinterpret_cast<void*>(alloc)));
    local_[id] = d;
    local_base_[id] = base;
    // A peer that failed gets none (a rank registers buffers anew after another's loss); a send that
    // fails because the peer just failed is that peer's failure, reported where it is awaited.
    for (const auto& [peer, p] : peers_) {
      if (!control().PeerStatus(peer).ok()) continue;
      const absl::Status sent = control().Send(peer, ToBytes(d));
      if (!sent.ok() && control().PeerStatus(peer).ok()) return sent;
    }
    return absl::OkStatus();
  }

  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override {
    ASSIGN_OR_RETURN(Remote * r, RemoteBuffer(peer, buffer, absl::Now() + absl::Seconds(30)));
    uint64_t total = 0;
    for (const auto& p : pieces) total += p.size();
    if (offset > r->bytes || total > r->bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("write of ", total, " bytes at offset ", offset,
                                                     " outside buffer ", buffer, " (", r->bytes,
                                                     " bytes) of ", PeerName(peer)));
    }
    P2P_CUDA(cudaSetDevice(device_));
    // The payload must reach the peer before its doorbell. Two copies in stream order do not
    // promise that (a peer copy's completion does not order its remote writes before a later
    // copy's), so the write kernel copies and then stores the doorbell after a system-wide fence.
    // Its source is one device buffer of this GPU: a single device piece as it is, anything else
    // gathered into local staging first.
    const void* src = nullptr;
    if (pieces.size() == 1 && IsOurDeviceMemory(pieces[0].data())) {
      src = pieces[0].data();
    } else {
      if (total > staging_bytes_) {
        if (staging_ != nullptr) P2P_CUDA(cudaFree(staging_));
        staging_ = nullptr;
        staging_bytes_ = 0;
        P2P_CUDA(cudaMalloc(&staging_, total));
        staging_bytes_ = total;
      }
      auto* at = static_cast<uint8_t*>(staging_);
      for (const auto& p : pieces) {
        if (p.empty()) continue;
        P2P_CUDA(cudaMemcpyAsync(at, p.data(), p.size(), cudaMemcpyDefault, stream_));
        at += p.size();
      }
      src = staging_;
    }
    auto* dst = static_cast<uint8_t*>(r->mapped) + r->offset + offset;
    void* doorbells = peers_.at(peer).doorbells;
    auto* bell = static_cast<uint64_t*>(doorbells) + buffer % kSlots;
    RETURN_IF_ERROR(device_path_->EnqueueWriteWithDoorbell(dst, src, total, bell, seqno, stream_,
                                                           EntryOf(doorbells, buffer, seqno)));
    P2P_CUDA(cudaStreamSynchronize(stream_));  // the pieces are reusable on return
    return absl::OkStatus();
  }

  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override {
    if (!local_.contains(buffer)) return absl::NotFoundError(absl::StrCat("no buffer ", buffer));
    for (int spins = 0;; ++spins) {
      ASSIGN_OR_RETURN(const uint64_t seen, ReadDoorbell(buffer));
      if (seen >= seqno) return absl::OkStatus();
      // Keep the control channel moving (descriptors from peers, failures of peers), every 16th
      // poll so that the doorbell itself is read every few microseconds.
      if (spins % 16 == 15) RETURN_IF_ERROR(Pump());
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("waiting for doorbell ", seqno, " of buffer ", buffer, " (it is at ", seen, ")"));
      }
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  uint64_t Doorbell(uint32_t buffer) const override {
    absl::StatusOr<uint64_t> v = const_cast<P2pTransport*>(this)->ReadDoorbell(buffer);
    return v.ok() ? *v : 0;
  }

  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override {
    // Nothing leaves a failed step (a peer may have died, the others run it again once this rank
    // has drained); SyncStream says why.
    if (device_path_->failed()) return absl::OkStatus();
    ASSIGN_OR_RETURN(Remote * r, RemoteBuffer(peer, buffer, absl::Now() + absl::Seconds(30)));
    if (offset > r->bytes || bytes > r->bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("write of ", bytes, " bytes at offset ", offset,
                                                     " outside buffer ", buffer, " (", r->bytes,
                                                     " bytes) of ", PeerName(peer)));
    }
    P2P_CUDA(cudaSetDevice(device_));
    Peer& p = peers_.at(peer);
    auto* dst = static_cast<uint8_t*>(r->mapped) + r->offset + offset;
    auto* bell = static_cast<uint64_t*>(p.doorbells) + buffer % kSlots;
    RETURN_IF_ERROR(device_path_->EnqueueWriteWithDoorbell(dst, src, bytes, bell, seqno, stream,
                                                           EntryOf(p.doorbells, buffer, seqno)));
    if (!p.same_gpu) return absl::OkStatus();
    // Same GPU: the reader's stream waits for this event (see the file comment).
    SignalFrame f;
    f.buffer = buffer;
    f.event = static_cast<uint32_t>(next_event_++ % kEvents);
    f.seqno = seqno;
    if (f.event == events_.size()) {  // the ring grows to kEvents as writes need it
      cudaEvent_t e = nullptr;
      P2P_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
      cudaIpcEventHandle_t h{};
      P2P_CUDA(cudaIpcGetEventHandle(&h, e));
      events_.push_back(e);
      event_handles_.push_back(h);
    }
    f.handle = event_handles_[f.event];
    P2P_CUDA(cudaEventRecord(events_[f.event], static_cast<cudaStream_t>(stream)));
    return control().Send(peer, ToBytes(f));
  }

  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override {
    auto it = local_.find(buffer);
    if (it == local_.end()) return absl::NotFoundError(absl::StrCat("no buffer ", buffer));
    if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("wait for ", bytes, " bytes at offset ", offset,
                                                     " outside buffer ", buffer, " (", it->second.bytes,
                                                     " bytes)"));
    }
    RETURN_IF_ERROR(Greet(peer));  // a peer connected but not yet sent to (greet_when_connected_)
    P2P_CUDA(cudaSetDevice(device_));
    // Whether the peer shares our GPU is in its hello, which comes before anything it sends.
    for (const absl::Time until = absl::Now() + timeout; !peers_.at(peer).greeted;) {
      RETURN_IF_ERROR(Pump());
      if (absl::Now() >= until) {
        return absl::DeadlineExceededError(
            absl::StrCat(label, ": ", PeerName(peer), " never sent its hello"));
      }
    }
    if (peers_.at(peer).same_gpu) {
      RETURN_IF_ERROR(WaitForSignal(peer, buffer, seqno, timeout, label, stream));
    } else {
      RETURN_IF_ERROR(device_path_->EnqueueWait(static_cast<const uint64_t*>(doorbells_) + buffer % kSlots,
                                                seqno, timeout, label, stream));
    }
    if (!checksums_ || device_path_->failed()) return absl::OkStatus();
    // Beside the stream, except for a writer on this GPU (see EnqueueVerify).
    return device_path_->EnqueueVerify(static_cast<const uint8_t*>(local_base_.at(buffer)) + offset, bytes,
                                       EntryOf(doorbells_, buffer, seqno), seqno, label, stream,
                                       !peers_.at(peer).same_gpu);
  }

  void SetDeviceChecksums(bool on) override { checksums_ = on; }

  absl::Status SyncStream(void* stream, absl::Time deadline) override {
    P2P_CUDA(cudaSetDevice(device_));
    // The pump notices a failed peer (Unavailable), which releases the waits at once; so does an
    // error of the caller's poll.
    return device_path_->Sync(stream, deadline, [this] {
      RETURN_IF_ERROR(Pump(absl::Microseconds(20)));
      return poll_ ? poll_() : absl::OkStatus();
    });
  }

  void SetDevicePoll(std::function<absl::Status()> poll) override { poll_ = std::move(poll); }

  absl::Status ResetDevicePath(void* stream) override {
    P2P_CUDA(cudaSetDevice(device_));
    return device_path_->Reset(stream);
  }

  absl::Status Flush(absl::Time deadline) override {
    P2P_CUDA(cudaStreamSynchronize(stream_));
    return control().Flush(deadline);
  }

 private:
  struct Remote {
    void* mapped = nullptr;  // the peer's allocation, mapped here
    uint64_t offset = 0, bytes = 0;
  };
  struct Signal {
    uint64_t seqno;
    uint32_t event;
  };
  struct Peer {
    bool greeted = false;   // its hello (doorbell page) arrived
    bool same_gpu = false;  // it runs on our GPU: events instead of spinning waits
    void* doorbells = nullptr;
    std::vector<cudaEvent_t> events;                  // its ring (same GPU only), opened on first use
    std::map<uint32_t, std::deque<Signal>> signals;   // by our buffer: its writes' events, in order
    std::map<uint32_t, uint64_t> signalled;           // by our buffer: the last seqno signalled
    std::map<uint32_t, DescriptorFrame> descriptors;  // received, not yet mapped
    std::map<uint32_t, Remote> buffers;               // mapped
    // Allocations opened through IPC, by handle: several buffers of one allocation share one
    // mapping (a handle is opened once per process).
    std::map<std::string, void*> mappings;
  };

  // A new connection: our doorbell page, then every buffer registered so far.
  absl::Status OnNewPeer(PeerId peer) override {
    peers_[peer];
    HelloFrame h;
    h.device = device_;
    h.doorbells = doorbell_handle_;
    RETURN_IF_ERROR(control().Send(peer, ToBytes(h)));
    for (const auto& [id, d] : local_) RETURN_IF_ERROR(control().Send(peer, ToBytes(d)));
    return absl::OkStatus();
  }

  // A control frame of this transport is applied and consumed (true); anything else is the
  // caller's (false).
  absl::StatusOr<bool> Consume(PeerId from, const std::vector<uint8_t>& m) override {
    const uint32_t magic = MagicOf(m);
    if (magic == kHelloMagic && m.size() == sizeof(HelloFrame)) {
      HelloFrame h;
      std::memcpy(&h, m.data(), sizeof(h));
      Peer& p = peers_[from];
      if (p.greeted) return absl::DataLossError(absl::StrCat("second p2p hello from ", PeerName(from)));
      P2P_CUDA(cudaSetDevice(device_));
      P2P_CUDA(cudaIpcOpenMemHandle(&p.doorbells, h.doorbells, cudaIpcMemLazyEnablePeerAccess));
      if (h.device == device_) {
        p.events.assign(kEvents, nullptr);  // opened as signals first name them
        p.same_gpu = true;
      }
      p.greeted = true;
      return true;
    }
    if (magic == kSignalMagic && m.size() == sizeof(SignalFrame)) {
      SignalFrame f;
      std::memcpy(&f, m.data(), sizeof(f));
      Peer& p = peers_[from];
      if (!p.same_gpu || f.event >= p.events.size()) {
        return absl::DataLossError(
            absl::StrCat("p2p signal from ", PeerName(from), " names event ", f.event,
                         p.same_gpu ? " outside its ring" : " but it is on another GPU"));
      }
      if (p.events[f.event] == nullptr) P2P_CUDA(cudaIpcOpenEventHandle(&p.events[f.event], f.handle));
      std::deque<Signal>& q = p.signals[f.buffer];
      q.push_back({f.seqno, f.event});
      if (q.size() > kMaxSignals) q.pop_front();
      uint64_t& last = p.signalled[f.buffer];
      last = std::max(last, f.seqno);
      return true;
    }
    if (magic == kDescriptorMagic && m.size() == sizeof(DescriptorFrame)) {
      DescriptorFrame d;
      std::memcpy(&d, m.data(), sizeof(d));
      peers_[from].descriptors[d.buffer] = d;
      return true;
    }
    return false;
  }

  absl::StatusOr<Remote*> RemoteBuffer(PeerId peer, uint32_t buffer, absl::Time deadline) {
    RETURN_IF_ERROR(Greet(peer));  // a peer connected but not yet sent to (greet_when_connected_)
    while (true) {
      Peer& p = peers_.at(peer);
      auto it = p.buffers.find(buffer);
      if (it != p.buffers.end()) return &it->second;
      auto d = p.descriptors.find(buffer);
      if (p.greeted && d != p.descriptors.end()) {
        P2P_CUDA(cudaSetDevice(device_));
        Remote r;
        const std::string key(reinterpret_cast<const char*>(&d->second.handle), sizeof(cudaIpcMemHandle_t));
        auto m = p.mappings.find(key);
        if (m == p.mappings.end()) {
          void* mapped = nullptr;
          P2P_CUDA(cudaIpcOpenMemHandle(&mapped, d->second.handle, cudaIpcMemLazyEnablePeerAccess));
          m = p.mappings.emplace(key, mapped).first;
        }
        r.mapped = m->second;
        r.offset = d->second.offset;
        r.bytes = d->second.bytes;
        p.descriptors.erase(d);
        return &(p.buffers[buffer] = r);
      }
      RETURN_IF_ERROR(Pump());
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("buffer ", buffer, " of ", PeerName(peer), " was never registered"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // EnqueueWait for a write from a peer on our GPU (see the file comment). Failures go to the
  // device path, to be reported by SyncStream as a spinning wait's would be.
  absl::Status WaitForSignal(PeerId peer, uint32_t buffer, uint64_t seqno, absl::Duration timeout,
                             const std::string& label, void* stream) {
    if (device_path_->failed()) return absl::OkStatus();  // the step fails; SyncStream says why
    const absl::Time deadline = absl::Now() + timeout;
    absl::Time next_poll = absl::Now() + absl::Milliseconds(1);
    while (true) {
      Peer& p = peers_.at(peer);
      std::deque<Signal>& q = p.signals[buffer];
      // Older signals are for writes this wait covers; a later one would over-wait (the writer
      // may need this stream's output before it makes that write), so the first at or past seqno.
      while (!q.empty() && q.front().seqno < seqno) q.pop_front();
      if (!q.empty()) {
        P2P_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), p.events[q.front().event], 0));
        return absl::OkStatus();
      }
      if (absl::Now() >= deadline) {
        device_path_->Fail(absl::DeadlineExceededError(absl::StrCat(
            label, ": waited ", absl::FormatDuration(timeout), " for doorbell seqno ", seqno,
            " (signalled by ", PeerName(peer), " on this GPU), it is at ", p.signalled[buffer])));
        return absl::OkStatus();
      }
      const absl::Status pumped = Pump(absl::Microseconds(20));
      if (!pumped.ok()) {
        device_path_->Fail(Annotate(pumped, label));
        return absl::OkStatus();
      }
      if (poll_ && absl::Now() >= next_poll) {
        next_poll = absl::Now() + absl::Milliseconds(1);
        if (absl::Status polled = poll_(); !polled.ok()) {
          device_path_->Fail(std::move(polled));
          return absl::OkStatus();
        }
      }
    }
  }

  bool IsOurDeviceMemory(const void* p) const {
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return attr.type == cudaMemoryTypeDevice && attr.device == device_;
  }

  absl::StatusOr<uint64_t> ReadDoorbell(uint32_t buffer) {
    uint64_t v = 0;
    P2P_CUDA(cudaSetDevice(device_));
    P2P_CUDA(cudaMemcpy(&v, static_cast<uint64_t*>(doorbells_) + buffer % kSlots, sizeof(v),
                        cudaMemcpyDeviceToHost));
    return v;
  }

  int device_;
  bool checksums_;  // device waits check the payload's checksum
  Capabilities caps_;
  void* doorbells_ = nullptr;  // kDoorbellBytes of device memory (counters, checksum rings), exported
  cudaIpcMemHandle_t doorbell_handle_{};
  std::vector<cudaEvent_t> events_;  // interprocess, recorded after writes to same-GPU peers
  std::vector<cudaIpcEventHandle_t> event_handles_;
  uint64_t next_event_ = 0;
  cudaStream_t stream_ = nullptr;
  void* staging_ = nullptr;  // device: gathered pieces of host-driven writes
  uint64_t staging_bytes_ = 0;
  std::map<uint32_t, DescriptorFrame> local_;
  std::map<uint32_t, void*> local_base_;  // where each registered buffer starts
  std::map<PeerId, Peer> peers_;
  std::unique_ptr<DevicePath> device_path_;
  std::function<absl::Status()> poll_;  // the caller's (SetDevicePoll)
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateP2pTransport(const P2pOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError("p2p transport: no CUDA device");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("p2p transport: cuda:", options.device, " requested but ",
                                                   count, " device(s) are visible"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> control,
                   CreateUcxTransport({.listen_address = options.listen_address}));
  auto t = std::make_unique<P2pTransport>(std::move(control), options.device, options.checksums);
  RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::transport
