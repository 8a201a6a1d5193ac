#include "common/transport/local/local_transport.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

#if TANDEM_LOCAL_CUDA
#include <cuda_runtime.h>

#include "common/transport/device/device_path.h"
#endif

namespace tandem::transport {
namespace {

constexpr size_t kMaxMessageBytes = size_t{1} << 30;

#if TANDEM_LOCAL_CUDA
#define LOCAL_CUDA(expr)                                                                       \
  do {                                                                                         \
    const cudaError_t local_err_ = (expr);                                                     \
    if (local_err_ != cudaSuccess) {                                                           \
      return absl::InternalError(absl::StrCat(#expr, ": ", cudaGetErrorName(local_err_), " (", \
                                              cudaGetErrorString(local_err_), ")"));           \
    }                                                                                          \
  } while (0)

// Events a writer records after its device-path copies; a reader gives each back once its stream
// waits on it (the wait keeps the record it saw, so the event may be recorded again).
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    cudaSetDevice(device_);
    for (cudaEvent_t e : all_) cudaEventDestroy(e);
  }
  absl::StatusOr<cudaEvent_t> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    LOCAL_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    all_.push_back(e);
    return e;
  }
  void Give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> all_, free_;
};

bool IsDeviceMemory(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}
#endif

// What other transports of the process touch of one transport, under its mutex: its queues, its
// buffers and its view of its peers.
struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::string address;
  bool alive = true;  // false once its transport is destroyed: nothing may write into it any more
  struct Peer {
    std::weak_ptr<Mailbox> remote;
    PeerId id_there = 0;  // the id the remote knows this side by
    std::string address;
    bool gone = false;      // its transport was destroyed
    bool closed = false;    // Close(): its going is expected
    bool reported = false;  // its going was reported once by Receive or WaitDoorbell
  };
  std::vector<Peer> peers;  // by PeerId
  std::deque<PeerId> accepts;
  std::deque<std::pair<PeerId, std::vector<uint8_t>>> messages;
  struct Buffer {
    uint8_t* base = nullptr;
    size_t bytes = 0;
    uint64_t doorbell = 0;
  };
  std::map<uint32_t, Buffer> buffers;
#if TANDEM_LOCAL_CUDA
  struct Signal {
    uint64_t seqno;
    cudaEvent_t event;
    std::shared_ptr<EventPool> pool;
  };
  std::map<uint32_t, std::deque<Signal>> signals;  // by buffer, in seqno order
#endif

  // A peer that went away unexpectedly and has not been reported yet (marks it reported).
  absl::Status TakeFailure() {
    for (Peer& p : peers) {
      if (p.gone && !p.closed && !p.reported) {
        p.reported = true;
        return absl::UnavailableError(absl::StrCat("local transport: peer ", p.address, " went away"));
      }
    }
    return absl::OkStatus();
  }
};

struct Registry {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<Mailbox>> listening;
  uint64_t next = 0;
};
Registry& TheRegistry() {
  static Registry* r = new Registry();  // never destroyed: transports may outlive static teardown
  return *r;
}

class LocalTransport : public Transport {
 public:
  explicit LocalTransport(int device) : device_(device) {
    caps_.name = "local";
    caps_.same_host_only = true;
#if TANDEM_LOCAL_CUDA
    caps_.gpu_memory = true;
    caps_.device_polling = device >= 0;
#endif
    me_ = std::make_shared<Mailbox>();
    Registry& r = TheRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    me_->address = absl::StrCat("local:", r.next++);
    r.listening[me_->address] = me_;
  }

  ~LocalTransport() override {
    std::vector<Mailbox::Peer> peers;
    {
      std::lock_guard<std::mutex> lock(me_->mu);
      me_->alive = false;
      peers = me_->peers;
#if TANDEM_LOCAL_CUDA
      for (auto& [buffer, q] : me_->signals) {
        for (Mailbox::Signal& s : q) s.pool->Give(s.event);
      }
      me_->signals.clear();
#endif
    }
    for (const Mailbox::Peer& p : peers) {
      std::shared_ptr<Mailbox> remote = p.remote.lock();
      if (!remote) continue;
      std::lock_guard<std::mutex> lock(remote->mu);
      if (p.id_there < remote->peers.size()) remote->peers[p.id_there].gone = true;
      remote->cv.notify_all();
    }
    Registry& r = TheRegistry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.listening.erase(me_->address);
  }

  absl::Status Init() {
#if TANDEM_LOCAL_CUDA
    if (device_ >= 0) {
      LOCAL_CUDA(cudaSetDevice(device_));
      ASSIGN_OR_RETURN(device_path_, DevicePath::Create(device_));
      pool_ = std::make_shared<EventPool>(device_);
    }
#endif
    return absl::OkStatus();
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override { return me_->address; }

  absl::StatusOr<PeerId> Connect(const std::string& address) override {
    if (address.rfind("local:", 0) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("local transport: address \"", address, "\" is not local:N"));
    }
    std::shared_ptr<Mailbox> remote;
    {
      Registry& r = TheRegistry();
      std::lock_guard<std::mutex> lock(r.mu);
      auto it = r.listening.find(address);
      if (it != r.listening.end()) remote = it->second.lock();
    }
    if (!remote) {
      return absl::UnavailableError(absl::StrCat("local transport: nothing in this process listens at ",
                                                 address, " (local ranks must be threads of one process)"));
    }
    if (remote == me_) return absl::InvalidArgumentError("local transport: cannot connect to itself");
    std::scoped_lock lock(me_->mu, remote->mu);
    if (!remote->alive)
      return absl::UnavailableError(absl::StrCat("local transport: ", address, " has closed"));
    const PeerId mine = static_cast<PeerId>(me_->peers.size());
    const PeerId theirs = static_cast<PeerId>(remote->peers.size());
    me_->peers.push_back({.remote = remote, .id_there = theirs, .address = address});
    remote->peers.push_back({.remote = me_, .id_there = mine, .address = me_->address});
    remote->accepts.push_back(theirs);
    remote->cv.notify_all();
    return mine;
  }

  absl::StatusOr<PeerId> Accept(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(me_->mu);
    while (me_->accepts.empty()) {
      if (!WaitUntil(lock, deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("local transport ", me_->address, ": no connection"));
      }
    }
    const PeerId p = me_->accepts.front();
    me_->accepts.pop_front();
    return p;
  }

  std::string PeerName(PeerId peer) const override {
    std::lock_guard<std::mutex> lock(me_->mu);
    return peer < me_->peers.size() ? me_->peers[peer].address : absl::StrCat("peer ", peer);
  }

  absl::Status Send(PeerId peer, absl::Span<const uint8_t> message) override {
    if (message.empty() || message.size() > kMaxMessageBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("local transport: a message of ", message.size(), " bytes (1 byte to 1 GiB)"));
    }
    ASSIGN_OR_RETURN(Remote r, RemoteOf(peer));
    std::lock_guard<std::mutex> lock(r.mailbox->mu);
    if (!r.mailbox->alive) return Gone(r);
    r.mailbox->messages.emplace_back(r.id_there, std::vector<uint8_t>(message.begin(), message.end()));
    r.mailbox->cv.notify_all();
    return absl::OkStatus();
  }

  absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(me_->mu);
    while (true) {
      if (!me_->messages.empty()) {
        *from = me_->messages.front().first;
        *message = std::move(me_->messages.front().second);
        me_->messages.pop_front();
        return absl::OkStatus();
      }
      RETURN_IF_ERROR(me_->TakeFailure());
      if (!WaitUntil(lock, deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("local transport ", me_->address, ": no message"));
      }
    }
  }

  void Close(PeerId peer) override {
    std::lock_guard<std::mutex> lock(me_->mu);
    if (peer < me_->peers.size()) me_->peers[peer].closed = true;
  }

  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override {
    std::lock_guard<std::mutex> lock(me_->mu);
    if (me_->buffers.contains(id))
      return absl::AlreadyExistsError(absl::StrCat("buffer ", id, " is registered"));
    me_->buffers[id] = {.base = static_cast<uint8_t*>(base), .bytes = bytes};
    return absl::OkStatus();
  }

  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override {
    ASSIGN_OR_RETURN(Remote r, RemoteOf(peer));
    uint64_t total = 0;
    for (const auto& p : pieces) total += p.size();
    std::lock_guard<std::mutex> lock(r.mailbox->mu);
    if (!r.mailbox->alive) return Gone(r);
    ASSIGN_OR_RETURN(Mailbox::Buffer * b, Bounds(r, buffer, offset, total));
    uint8_t* at = b->base + offset;
    for (const auto& p : pieces) {
      if (p.empty()) continue;
#if TANDEM_LOCAL_CUDA
      if (IsDeviceMemory(at) || IsDeviceMemory(p.data())) {
        LOCAL_CUDA(cudaMemcpy(at, p.data(), p.size(), cudaMemcpyDefault));
      } else {
        std::memcpy(at, p.data(), p.size());
      }
#else
      std::memcpy(at, p.data(), p.size());
#endif
      at += p.size();
    }
    b->doorbell = std::max(b->doorbell, seqno);
    r.mailbox->cv.notify_all();
    return absl::OkStatus();
  }

  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(me_->mu);
    auto it = me_->buffers.find(buffer);
    if (it == me_->buffers.end()) return absl::NotFoundError(absl::StrCat("no buffer ", buffer));
    while (it->second.doorbell < seqno) {
      RETURN_IF_ERROR(me_->TakeFailure());
      if (!WaitUntil(lock, deadline)) {
        return absl::DeadlineExceededError(absl::StrCat("waiting for doorbell ", seqno, " of buffer ", buffer,
                                                        " (it is at ", it->second.doorbell, ")"));
      }
    }
    return absl::OkStatus();
  }

  uint64_t Doorbell(uint32_t buffer) const override {
    std::lock_guard<std::mutex> lock(me_->mu);
    auto it = me_->buffers.find(buffer);
    return it == me_->buffers.end() ? 0 : it->second.doorbell;
  }

  absl::Status Flush(absl::Time deadline) override { return absl::OkStatus(); }

#if TANDEM_LOCAL_CUDA
  absl::Status EnqueueWrite(PeerId peer, uint32_t buffer, uint64_t offset, const void* src, size_t bytes,
                            uint64_t seqno, void* stream) override {
    if (!device_path_) return Unsupported("EnqueueWrite");
    ASSIGN_OR_RETURN(Remote r, RemoteOf(peer));
    std::lock_guard<std::mutex> lock(r.mailbox->mu);
    if (!r.mailbox->alive) return Gone(r);
    ASSIGN_OR_RETURN(Mailbox::Buffer * b, Bounds(r, buffer, offset, bytes));
    LOCAL_CUDA(cudaSetDevice(device_));
    auto* s = static_cast<cudaStream_t>(stream);
    if (bytes > 0) LOCAL_CUDA(cudaMemcpyAsync(b->base + offset, src, bytes, cudaMemcpyDefault, s));
    ASSIGN_OR_RETURN(cudaEvent_t event, pool_->Take());
    LOCAL_CUDA(cudaEventRecord(event, s));
    r.mailbox->signals[buffer].push_back({.seqno = seqno, .event = event, .pool = pool_});
    r.mailbox->cv.notify_all();
    return absl::OkStatus();
  }

  absl::Status EnqueueWait(PeerId peer, uint32_t buffer, uint64_t offset, size_t bytes, uint64_t seqno,
                           absl::Duration timeout, const std::string& label, void* stream) override {
    if (!device_path_) return Unsupported("EnqueueWait");
    std::unique_lock<std::mutex> lock(me_->mu);
    auto it = me_->buffers.find(buffer);
    if (it == me_->buffers.end()) return absl::NotFoundError(absl::StrCat("no buffer ", buffer));
    if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("wait for ", bytes, " bytes at offset ", offset,
                                                     " outside buffer ", buffer, " (", it->second.bytes,
                                                     " bytes)"));
    }
    if (peer >= me_->peers.size()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    if (device_path_->failed()) return absl::OkStatus();  // the step fails; SyncStream says why
    LOCAL_CUDA(cudaSetDevice(device_));
    const absl::Time deadline = absl::Now() + timeout;
    uint64_t last = 0;
    while (true) {
      std::deque<Mailbox::Signal>& q = me_->signals[buffer];
      // Older signals are covered by this wait; a later one would over-wait (its write may need
      // this stream's output first), so the first at or past seqno, kept if past it.
      while (!q.empty() && q.front().seqno < seqno) {
        last = std::max(last, q.front().seqno);
        q.front().pool->Give(q.front().event);
        q.pop_front();
      }
      if (!q.empty()) {
        LOCAL_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), q.front().event, 0));
        if (q.front().seqno == seqno) {
          q.front().pool->Give(q.front().event);
          q.pop_front();
        }
        return absl::OkStatus();
      }
      const Mailbox::Peer& p = me_->peers[peer];
      if (p.gone) {
        device_path_->Fail(absl::UnavailableError(absl::StrCat(label, ": ", p.address, " went away")));
        return absl::OkStatus();
      }
      if (!WaitUntil(lock, deadline)) {
        device_path_->Fail(absl::DeadlineExceededError(
            absl::StrCat(label, ": waited ", absl::FormatDuration(timeout), " for doorbell seqno ", seqno,
                         " from ", p.address, ", it is at ", last)));
        return absl::OkStatus();
      }
    }
  }

  absl::Status SyncStream(void* stream, absl::Time deadline) override {
    if (!device_path_) return Unsupported("SyncStream");
    LOCAL_CUDA(cudaSetDevice(device_));
    return device_path_->Sync(stream, deadline, [this] {
      std::lock_guard<std::mutex> lock(me_->mu);
      return me_->TakeFailure();
    });
  }
#endif

 private:
  struct Remote {
    std::shared_ptr<Mailbox> mailbox;
    PeerId id_there = 0;
    std::string address;
  };

  absl::StatusOr<Remote> RemoteOf(PeerId peer) {
    std::lock_guard<std::mutex> lock(me_->mu);
    if (peer >= me_->peers.size()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    const Mailbox::Peer& p = me_->peers[peer];
    Remote r{.mailbox = p.remote.lock(), .id_there = p.id_there, .address = p.address};
    if (!r.mailbox || p.gone) {
      return absl::UnavailableError(absl::StrCat("local transport: peer ", p.address, " went away"));
    }
    return r;
  }

  static absl::Status Gone(const Remote& r) {
    return absl::UnavailableError(absl::StrCat("local transport: peer ", r.address, " went away"));
  }

  // The remote buffer (its mailbox locked by the caller), or why a write of `bytes` at `offset`
  // does not fit: NotFound for an unknown buffer, InvalidArgument outside it.
  static absl::StatusOr<Mailbox::Buffer*> Bounds(const Remote& r, uint32_t buffer, uint64_t offset,
                                                 uint64_t bytes) {
    auto it = r.mailbox->buffers.find(buffer);
    if (it == r.mailbox->buffers.end()) {
      return absl::NotFoundError(absl::StrCat("buffer ", buffer, " of ", r.address, " is not registered"));
    }
    if (offset > it->second.bytes || bytes > it->second.bytes - offset) {
      return absl::InvalidArgumentError(absl::StrCat("write of ", bytes, " bytes at offset ", offset,
                                                     " outside buffer ", buffer, " (", it->second.bytes,
                                                     " bytes) of ", r.address));
    }
    return &it->second;
  }

  // Waits on the mailbox's condition; false once `deadline` has passed.
  bool WaitUntil(std::unique_lock<std::mutex>& lock, absl::Time deadline) {
    if (absl::Now() >= deadline) return false;
    if (deadline == absl::InfiniteFuture()) {
      me_->cv.wait(lock);
    } else {
      me_->cv.wait_until(lock, absl::ToChronoTime(deadline));
    }
    return true;
  }

  int device_;
  Capabilities caps_;
  std::shared_ptr<Mailbox> me_;
#if TANDEM_LOCAL_CUDA
  std::unique_ptr<DevicePath> device_path_;
  std::shared_ptr<EventPool> pool_;
#endif
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateLocalTransport(const LocalOptions& options) {
#if !TANDEM_LOCAL_CUDA
  if (options.device >= 0) {
    return absl::UnavailableError("local transport: a CUDA device was named but this build has no CUDA");
  }
#endif
  auto t = std::make_unique<LocalTransport>(options.device);
  RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::transport
