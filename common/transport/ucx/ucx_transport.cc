// The UCX transport (transport.h): control messages and host-memory writes over UCP Active Messages.
//
// Objects: one ucp_context (UCP_FEATURE_AM | UCP_FEATURE_WAKEUP) and one ucp_worker
// (UCS_THREAD_MODE_SINGLE) per Transport, and one ucp_ep per peer (UCP_ERR_HANDLING_MODE_PEER).
// All progress happens inside this object's calls: nothing runs in the background that touches
// our state.
//
// Connection setup (the bootstrap; no UCX sockaddr listener is ever created): a listening
// Transport binds a TCP socket of its own at the listen address, and its address() is that
// socket's host:port. Connect() opens a TCP connection to it and both sides run the
// authenticated handshake of common/bootstrap/handshake.h on it (each proves it holds the
// deployment's secret, bootstrap::ProcessKey(), and sends its UCX worker address under that
// proof); then the socket is closed and each side creates one ep to the other's worker address,
// which UCX pairs into one connection (its ep matching: the first ep of each side to the other's
// worker). A connection that fails the handshake (no proof, a wrong HMAC, a probe of garbage, a
// replay, a peer of another deployment) or does not finish it within kIncomingTimeout is logged
// with the peer's address and closed; nothing it sent is parsed beyond the handshake, and no ep
// is created for it. Handshakes run on non-blocking sockets inside the same progress loop as UCX,
// so a stranger that connects and says nothing delays no one. An AM from an ep that no
// handshake created (UCX's own tcp listener is reachable too) is dropped unread.
//
// Interfaces: the bootstrap socket binds the listen address only; UCX's own network transports
// are limited to the interface that holds that address (NET_DEVICES, unless UCX_NET_DEVICES is set
// in the environment), so a listening Transport listens on no other interface.
//
// Wire format: two AM ids.
//   kAmControl  no header; the data is the message.
//   kAmWrite    a 32-byte little-endian header {magic u32, buffer u32, offset u64, length u64,
//               seqno u64}, then `length` bytes of payload (sent from the caller's pieces with
//               UCP_DATATYPE_IOV, so no staging copy on the sender).
// Every AM is sent with UCP_AM_SEND_FLAG_REPLY; the receiver maps `param->reply_ep` (its own ep of
// that connection, also for listener-accepted eps) back to a PeerId. An AM from an unknown ep is
// dropped and reported as DataLoss.
//
// Receiving: eager AMs are copied out inside the handler (control: into a new message; write:
// straight into base + offset). Rendezvous AMs call ucp_am_recv_data_nbx from the handler into
// the final destination (a message vector, or base + offset of the registered buffer); the
// completion callback marks the message complete / the write done. Writes are validated before
// any byte is placed (known buffer, offset + length within it without overflow, seqno > 0,
// header size and magic, length matches the AM's); a bad one is dropped and recorded as a
// DataLoss error naming peer, buffer, offset and length, returned (once) by the next
// WaitDoorbell/Receive.
//
// Ordering: UCX invokes the AM handlers of one ep in send order (relied on; the tests check it
// across eager and rendezvous sizes). Rendezvous completions may finish
// out of order, so per buffer the writes are queued in arrival order and the doorbell advances
// to max(seqno) over the completed prefix only: a doorbell at s implies every earlier write is in
// place. Control messages likewise: Receive returns the oldest complete message whose peer has no
// older incomplete one (arrival order overall, send order per peer).
//
// Waiting (Accept, Receive, WaitDoorbell, Send/Write completion, Flush): progress the worker
// while it reports work, spin briefly (kSpinTime) re-checking, then arm the worker
// (ucp_worker_arm) and block in ppoll on its event fd for at most kMaxBlock (a cap that also
// covers any wakeup UCX might not signal), so an idle rank uses no CPU. Send and Write wait
// for local completion: eager data was handed to the transport; a rendezvous one completes once
// the peer fetched it, which needs the peer to be inside a call of its own Transport; a failing
// peer ends the wait with Unavailable. The wait lasts at most UcxOptions::send_timeout: then the
// peer is marked failed (a stopped peer, SIGSTOP or hung, never fetches and, over tcp or shared
// memory, stops draining the socket or FIFO too) and its ep force-closed, which completes the
// request locally (UCX cancels the ep's outstanding requests). ucp_request_cancel alone does not
// end a send to a stopped peer: waiting on it cost a further kCloseTimeout, long enough for the
// healthy memory ranks' own deadlines to expire while compute rank 0 was still deciding. Flush
// (ucp_ep_flush_nbx per live peer) likewise needs the peers' progress.
//
// Peer failure: the ep error callback marks the peer failed with UCX's reason. Operations on that
// peer return Unavailable("ucx: peer HOST:PORT disconnected: <reason>"); and every wait
// (Receive, WaitDoorbell, Flush, a blocked Send/Write) returns that Unavailable as soon as ANY peer
// has failed, so a rank whose peer died stops instead of waiting to its deadline. A wait whose
// condition is already met (a queued message, a reached doorbell) still succeeds first. Note that
// a peer closing its Transport normally also counts as a failure for the other side.
//
// Destruction: every ep is force-closed (waiting at most kCloseTimeout for that local step), pending
// connection requests are rejected, then listener, worker and context are destroyed; the peers see
// a disconnect. Neither a flush nor a graceful close is attempted: both wait for the peer to
// progress (measured: a flush to a peer blocked elsewhere never completes), and a process must
// not hang on exit. Send/Write have already completed locally, which for tcp and shared memory
// means the bytes were handed to the socket or the peer's FIFO (rendezvous: the peer has them);
// callers that need more call Flush() before destroying the Transport.
//
// UCX configuration comes from the environment (UCX_TLS etc.) as usual; only NET_DEVICES is set
// (above) when the environment leaves it open.
// Tested here with the defaults and with UCX_TLS=tcp, posix,tcp, sysv,tcp, ^cma. cma needs
// ptrace permission; UCX leaves it out by itself where yama's ptrace_scope forbids it.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/bootstrap/handshake.h"
#include "common/bootstrap/interfaces.h"
#include "common/log.h"
#include "common/status.h"
#include "common/transport/transport.h"

namespace tandem::transport {
namespace {

constexpr unsigned kAmControl = 17;
constexpr unsigned kAmWrite = 18;
constexpr uint32_t kWriteMagic = 0x31525754;  // "TWR1"
constexpr size_t kWriteHeaderBytes = 32;
constexpr absl::Duration kSpinTime = absl::Microseconds(50);
constexpr absl::Duration kMaxBlock = absl::Milliseconds(20);
constexpr absl::Duration kCloseTimeout = absl::Seconds(3);
// How long a connecting side waits for the listener's handshake, and how long a listener gives an
// incoming connection to complete it; at most kMaxIncoming handshakes run at once (more wait in
// the socket's backlog).
constexpr absl::Duration kConnectTimeout = absl::Seconds(60);
constexpr absl::Duration kIncomingTimeout = absl::Seconds(10);
constexpr size_t kMaxIncoming = 64;
constexpr absl::Duration kAcceptInterval = absl::Milliseconds(1);

void PutLe32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void PutLe64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t GetLe32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(p[i]) << (8 * i);
  return v;
}
uint64_t GetLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

absl::Status UcxError(ucs_status_t status, std::string_view what) {
  return absl::UnavailableError(absl::StrCat("ucx: ", ToAbsl(what), ": ", ucs_status_string(status)));
}

std::string SockaddrName(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return absl::StrCat(host, ":", port);
  }
  if (ss.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    return absl::StrCat("[", host, "]:", port);
  }
  return "unknown-address";
}

// "host:port" or "[v6]:port" -> host, port. InvalidArgument if malformed.
absl::Status SplitHostPort(const std::string& address, std::string* host, uint16_t* port) {
  size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: address '", address, "' is not host:port"));
  }
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') {
    *host = host->substr(1, host->size() - 2);
  }
  uint32_t p = 0;
  if (!absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &p) || p > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: address '", address, "' has a bad port"));
  }
  *port = static_cast<uint16_t>(p);
  return absl::OkStatus();
}

// Resolves host:port to a socket address. Unavailable if the host cannot be resolved.
absl::Status Resolve(const std::string& host, uint16_t port, bool passive, sockaddr_storage* out,
                     socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::UnavailableError(absl::StrCat("ucx: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return absl::OkStatus();
}

class UcxTransport;

// One TCP connection running the bootstrap handshake.
struct Bootstrap {
  int fd = -1;
  std::unique_ptr<bootstrap::Handshake> handshake;
  std::vector<uint8_t> out;  // handshake bytes not yet sent
  absl::Time deadline;
  ~Bootstrap() {
    if (fd >= 0) close(fd);
  }
};

// A connection being accepted: its handshake, then a Peer.
struct Incoming {
  std::string name;  // the client's host:port
  Bootstrap link;
};

struct Peer {
  UcxTransport* owner = nullptr;
  PeerId id = 0;
  ucp_ep_h ep = nullptr;
  std::string name;
  bool failed = false;
  bool closing = false;                   // Close() was called: a disconnect is expected
  std::string failure;                    // UCX's reason
  std::unique_ptr<Bootstrap> connecting;  // Connect()'s handshake, until the ep exists
};

// A control message being received (complete once its data is in `data`).
struct InMessage {
  PeerId from = 0;
  std::vector<uint8_t> data;
  bool complete = false;
  bool failed = false;
};

// A write accepted into a buffer, in arrival order.
struct InWrite {
  uint64_t seqno = 0;
  bool done = false;
  bool failed = false;
};

struct Buffer {
  uint32_t id = 0;
  uint8_t* base = nullptr;
  size_t bytes = 0;
  uint64_t doorbell = 0;
  std::deque<std::unique_ptr<InWrite>> pending;  // writes whose data may still be arriving
  std::optional<PeerId> writer;                  // the last peer that wrote to it
};

// user_data of a rendezvous receive.
struct RndvRecv {
  UcxTransport* self = nullptr;
  InMessage* message = nullptr;  // control message, or
  Buffer* buffer = nullptr;      // write into this buffer
  InWrite* write = nullptr;
  PeerId from = 0;
  uint64_t offset = 0, length = 0;
};

class UcxTransport final : public Transport {
 public:
  UcxTransport() { caps_.name = "ucx"; }
  ~UcxTransport() override;

  absl::Status Init(const UcxOptions& options);

  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override { return address_; }
  absl::StatusOr<PeerId> Connect(const std::string& address) override;
  absl::StatusOr<PeerId> Accept(absl::Time deadline) override;
  std::string PeerName(PeerId peer) const override {
    return peer < peers_.size() ? peers_[peer]->name : absl::StrCat("unknown-peer-", peer);
  }
  absl::Status Send(PeerId peer, absl::Span<const uint8_t> message) override;
  absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) override;
  absl::Status RegisterBuffer(uint32_t id, void* base, size_t bytes) override;
  absl::Status Write(PeerId peer, uint32_t buffer, uint64_t offset,
                     absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) override;
  absl::Status WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) override;
  uint64_t Doorbell(uint32_t buffer) const override {
    auto it = buffers_.find(buffer);
    return it == buffers_.end() ? 0 : it->second->doorbell;
  }
  absl::Status Flush(absl::Time deadline) override;
  void Close(PeerId peer) override {
    if (peer < peers_.size()) peers_[peer]->closing = true;
  }
  void Reopen(PeerId peer) override {
    if (peer < peers_.size()) peers_[peer]->closing = false;
  }
  bool Connecting(PeerId peer) const override {
    return peer < peers_.size() && peers_[peer]->connecting != nullptr && !peers_[peer]->failed;
  }
  absl::Status PeerStatus(PeerId peer) const override {
    if (peer >= peers_.size()) return absl::InvalidArgumentError(absl::StrCat("ucx: no peer ", peer));
    return peers_[peer]->failed ? PeerFailure(*peers_[peer]) : absl::OkStatus();
  }

 private:
  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnControlAm(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnWriteAm(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);
  static void OnRndvDone(void* request, ucs_status_t status, size_t length, void* user_data);

  // Progresses until idle; then, if nothing happened for kSpinTime since `*spin_start`, blocks on
  // the worker's event fd until an event or min(deadline, now + kMaxBlock).
  void ProgressOrBlock(absl::Time deadline, absl::Time* spin_start);
  // Waits for a UCP request (send, flush) to complete; the request is freed. Returns its status.
  // With `peer`: at most send_timeout_, then the peer is marked failed, its ep force-closed
  // (AbandonEp) and UCS_ERR_TIMED_OUT returned.
  ucs_status_t WaitRequest(void* request, Peer* peer = nullptr);
  // Force-closes a peer's ep (no flush, no word from the peer): UCX completes the ep's
  // outstanding requests, so their buffers are free again. The close request is kept for the
  // destructor. Called on a failed peer, which stays failed (a later Connect to the same address
  // makes a new peer), and by the destructor on every peer.
  void AbandonEp(Peer* peer);
  absl::Status PeerFailure(const Peer& peer) const {
    return absl::UnavailableError(absl::StrCat("ucx: peer ", peer.name, " disconnected: ", peer.failure));
  }
  // Unavailable for the first failed peer, or OK. A peer that was Close()d may go away without
  // failing the others' operations.
  absl::Status AnyPeerFailure() const {
    for (const auto& p : peers_) {
      if (p->failed && !p->closing) return PeerFailure(*p);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<Peer*> LivePeer(PeerId peer);
  std::optional<PeerId> PeerOf(ucp_ep_h ep) const {
    auto it = ep_to_peer_.find(ep);
    if (it == ep_to_peer_.end()) return std::nullopt;
    return it->second;
  }
  void RecordError(absl::Status status) {
    TANDEM_LOG_WARN("transport", status.message());
    errors_.push_back(std::move(status));
  }
  absl::Status TakeError() {
    absl::Status s = std::move(errors_.front());
    errors_.pop_front();
    return s;
  }
  void AdvanceDoorbell(Buffer* buffer);
  // Validates and places one incoming write; true if a rendezvous receive was started.
  bool HandleWrite(PeerId from, const uint8_t* header, size_t header_length, void* data, size_t length,
                   bool rndv);
  Peer* NewPeer(std::string name);
  // Creates the peer's ep to a worker address received in a handshake. False (the peer failed,
  // with UCX's reason) if UCX refuses it.
  bool CreateEp(Peer* peer, const std::vector<uint8_t>& worker_address);
  // Accepts incoming bootstrap connections and moves every handshake on (without blocking);
  // finished ones become peers. True if anything happened.
  bool DriveBootstrap();
  // Sends and receives what a handshake can without blocking. An error rejects the connection.
  absl::Status PumpLink(Bootstrap& link, bool* progressed);

  Capabilities caps_;
  std::string address_;
  absl::Duration send_timeout_ = absl::InfiniteDuration();
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int listen_fd_ = -1;  // the bootstrap socket
  int efd_ = -1;
  bootstrap::DeploymentKey key_;
  bootstrap::ReplayGuard replay_guard_;
  std::vector<uint8_t> worker_address_;
  std::deque<std::unique_ptr<Incoming>> incoming_;  // handshakes of connections being accepted
  std::deque<PeerId> accepted_;                     // peers for Accept
  absl::Time last_accept_check_ = absl::InfinitePast();
  std::vector<std::unique_ptr<Peer>> peers_;
  std::unordered_map<ucp_ep_h, PeerId> ep_to_peer_;
  std::deque<std::unique_ptr<InMessage>> inbox_;
  std::unordered_map<uint32_t, std::unique_ptr<Buffer>> buffers_;
  std::deque<absl::Status> errors_;  // DataLoss records for the next wait
  std::vector<void*> closing_eps_;   // AbandonEp's close requests still in progress
};

absl::Status UcxTransport::Init(const UcxOptions& options) {
  send_timeout_ = options.send_timeout;
  ASSIGN_OR_RETURN(key_, bootstrap::ProcessKey());
  std::string host;
  uint16_t port = 0;
  std::optional<bootstrap::Interface> iface;
  if (!options.listen_address.empty()) {
    RETURN_IF_ERROR(SplitHostPort(options.listen_address, &host, &port));
    absl::StatusOr<bootstrap::Interface> found = bootstrap::ResolveInterface(host);
    if (found.ok()) iface = *found;  // a wildcard or a name: UCX keeps its own choice
  }
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcxError(st, "ucp_config_read");
  const char* env_devices = std::getenv("UCX_NET_DEVICES");
  if (iface && (env_devices == nullptr || *env_devices == '\0')) {
    st = ucp_config_modify(config, "NET_DEVICES", iface->name.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcxError(st, absl::StrCat("limiting UCX to interface ", iface->name));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return UcxError(st, "ucp_init");
  }

  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return UcxError(st, "ucp_worker_create");
  }
  st = ucp_worker_get_efd(worker_, &efd_);
  if (st != UCS_OK) return UcxError(st, "ucp_worker_get_efd");

  for (unsigned id : {kAmControl, kAmWrite}) {
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    h.id = id;
    h.cb = id == kAmControl ? &OnControlAm : &OnWriteAm;
    h.arg = this;
    h.flags = 0;
    st = ucp_worker_set_am_recv_handler(worker_, &h);
    if (st != UCS_OK) return UcxError(st, "ucp_worker_set_am_recv_handler");
  }

  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  st = ucp_worker_get_address(worker_, &address, &address_length);
  if (st != UCS_OK) return UcxError(st, "ucp_worker_get_address");
  const auto* address_bytes = reinterpret_cast<const uint8_t*>(address);
  worker_address_.assign(address_bytes, address_bytes + address_length);
  ucp_worker_release_address(worker_, address);
  if (worker_address_.size() > bootstrap::kMaxPayload) {
    return absl::InternalError(absl::StrCat("ucx: the worker address has ", worker_address_.size(),
                                            " bytes, more than a handshake carries"));
  }

  if (!options.listen_address.empty()) {
    sockaddr_storage ss{};
    socklen_t len = 0;
    RETURN_IF_ERROR(Resolve(host, port, /*passive=*/true, &ss, &len));
    listen_fd_ = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return ErrnoToStatus(errno, "ucx: socket for the bootstrap listener");
    // A process restarted on the port of one that died (a memory rank rejoining) must not wait
    // for the bootstrap connections it left in TIME_WAIT; two listeners on one port are still refused.
    const int reuse = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof(reuse));
    if (bind(listen_fd_, reinterpret_cast<const sockaddr*>(&ss), len) != 0 || listen(listen_fd_, 128) != 0) {
      return absl::UnavailableError(
          absl::StrCat("ucx: cannot listen on ", options.listen_address, ": ", std::strerror(errno)));
    }
    sockaddr_storage bound{};
    socklen_t bound_len = sizeof(bound);
    if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &bound_len) != 0) {
      return ErrnoToStatus(errno, "ucx: getsockname of the bootstrap listener");
    }
    uint16_t actual = bound.ss_family == AF_INET6
                          ? ntohs(reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port)
                          : ntohs(reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
    bool v6_literal = host.find(':') != std::string::npos;
    address_ = v6_literal ? absl::StrCat("[", host, "]:", actual) : absl::StrCat(host, ":", actual);
  }
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  if (worker_ != nullptr) {
    // Force-close: a flush or a graceful close would wait for the peer to progress.
    for (auto& p : peers_) AbandonEp(p.get());
    std::vector<void*> requests = std::move(closing_eps_);
    absl::Time deadline = absl::Now() + kCloseTimeout;
    absl::Time spin_start = absl::Now();
    for (void* req : requests) {
      while (ucp_request_check_status(req) == UCS_INPROGRESS && absl::Now() < deadline) {
        ProgressOrBlock(deadline, &spin_start);
      }
      ucp_request_free(req);
    }
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (listen_fd_ >= 0) close(listen_fd_);
}

void UcxTransport::ProgressOrBlock(absl::Time deadline, absl::Time* spin_start) {
  const bool bootstrap = DriveBootstrap();
  if (ucp_worker_progress(worker_) != 0 || bootstrap) {
    while (ucp_worker_progress(worker_) != 0) {
    }
    *spin_start = absl::Now();
    return;
  }
  absl::Time now = absl::Now();
  if (now - *spin_start < kSpinTime || now >= deadline) return;
  ucs_status_t st = ucp_worker_arm(worker_);
  if (st == UCS_ERR_BUSY) return;  // events arrived meanwhile: progress again
  absl::Duration wait = std::min(deadline - now, kMaxBlock);
  if (st != UCS_OK) wait = std::min(wait, absl::Microseconds(200));  // cannot arm: short sleeps
  timespec ts = absl::ToTimespec(wait);
  std::vector<pollfd> fds = {{efd_, POLLIN, 0}};
  if (listen_fd_ >= 0 && incoming_.size() < kMaxIncoming) fds.push_back({listen_fd_, POLLIN, 0});
  auto watch = [&fds](const Bootstrap& link) {
    fds.push_back({link.fd, static_cast<short>(POLLIN | (link.out.empty() ? 0 : POLLOUT)), 0});
  };
  for (const auto& in : incoming_) watch(in->link);
  for (const auto& p : peers_) {
    if (p->connecting) watch(*p->connecting);
  }
  ppoll(fds.data(), fds.size(), &ts, nullptr);
  *spin_start = absl::Now();
}

absl::Status UcxTransport::PumpLink(Bootstrap& link, bool* progressed) {
  for (;;) {
    std::vector<uint8_t> more = link.handshake->TakeOutput();
    link.out.insert(link.out.end(), more.begin(), more.end());
    while (!link.out.empty()) {
      const ssize_t n = send(link.fd, link.out.data(), link.out.size(), MSG_NOSIGNAL);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) break;
      if (n < 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
      link.out.erase(link.out.begin(), link.out.begin() + n);
      *progressed = true;
    }
    const size_t wanted = link.handshake->Wanted();
    if (wanted == 0) return absl::OkStatus();
    // Never more than the handshake takes: whatever follows it is left unread and closed with the socket.
    uint8_t buf[4096];
    const ssize_t n = recv(link.fd, buf, std::min(sizeof(buf), wanted), 0);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return absl::OkStatus();
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    if (n == 0) return absl::UnavailableError("the connection closed during the handshake");
    *progressed = true;
    RETURN_IF_ERROR(link.handshake->Feed(absl::MakeConstSpan(buf, static_cast<size_t>(n))));
  }
}

bool UcxTransport::DriveBootstrap() {
  bool progressed = false;
  const absl::Time now = absl::Now();
  // Waits spin through here: with no handshake running, look for new connections at most every
  // kAcceptInterval (a blocking wait polls the listening socket anyway).
  const bool busy = !incoming_.empty() || std::any_of(peers_.begin(), peers_.end(),
                                                      [](const auto& p) { return p->connecting != nullptr; });
  if (!busy && now - last_accept_check_ < kAcceptInterval) return false;
  last_accept_check_ = now;
  while (listen_fd_ >= 0 && incoming_.size() < kMaxIncoming) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) break;
    progressed = true;
    auto in = std::make_unique<Incoming>();
    in->name = SockaddrName(ss);
    in->link.fd = fd;
    in->link.deadline = now + kIncomingTimeout;
    in->link.handshake = std::make_unique<bootstrap::Handshake>(bootstrap::Handshake::Role::kServer, key_,
                                                                worker_address_, &replay_guard_);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    incoming_.push_back(std::move(in));
  }
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    Incoming& in = **it;
    absl::Status st = PumpLink(in.link, &progressed);
    if (st.ok() && in.link.handshake->done() && in.link.out.empty()) {
      Peer* peer = NewPeer(in.name);
      if (CreateEp(peer, in.link.handshake->peer_payload())) {
        accepted_.push_back(peer->id);
        TANDEM_LOG_DEBUG("transport", "ucx: ", in.name, " authenticated (deployment ", key_.IdHex(), ")");
      }
      it = incoming_.erase(it);
      continue;
    }
    if (st.ok() && now >= in.link.deadline) {
      st = absl::DeadlineExceededError(
          absl::StrCat("no complete handshake within ", absl::FormatDuration(kIncomingTimeout)));
    }
    if (!st.ok()) {
      TANDEM_LOG_WARN("transport", "ucx: rejected the connection from ", in.name, " to ", address_, ": ",
                      st.message());
      it = incoming_.erase(it);
      continue;
    }
    ++it;
  }
  for (auto& p : peers_) {
    if (!p->connecting) continue;
    Bootstrap& link = *p->connecting;
    absl::Status st = PumpLink(link, &progressed);
    if (st.ok() && link.handshake->done()) {
      const std::vector<uint8_t> address = link.handshake->peer_payload();
      p->connecting.reset();
      CreateEp(p.get(), address);
      progressed = true;
      continue;
    }
    if (st.ok() && now >= link.deadline) {
      st = absl::DeadlineExceededError(
          absl::StrCat("no handshake from it within ", absl::FormatDuration(kConnectTimeout)));
    }
    if (!st.ok()) {
      p->connecting.reset();
      p->failed = true;
      p->failure = absl::StrCat("bootstrap handshake failed: ", st.message());
      if (p->closing) {  // a probe (Close()d from the start): its refusal is expected
        TANDEM_LOG_DEBUG("transport", "ucx: connecting to ", p->name, ": ", p->failure);
      } else {
        TANDEM_LOG_WARN("transport", "ucx: connecting to ", p->name, ": ", p->failure);
      }
      progressed = true;
    }
  }
  return progressed;
}

bool UcxTransport::CreateEp(Peer* peer, const std::vector<uint8_t>& worker_address) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(worker_address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &OnEpError;
  ep.err_handler.arg = peer;
  ucs_status_t st = ucp_ep_create(worker_, &ep, &peer->ep);
  if (st != UCS_OK) {
    peer->ep = nullptr;
    peer->failed = true;
    peer->failure = absl::StrCat("ucp_ep_create: ", ucs_status_string(st));
    TANDEM_LOG_WARN("transport", "ucx: ", peer->name, ": ", peer->failure);
    return false;
  }
  ep_to_peer_[peer->ep] = peer->id;
  return true;
}

ucs_status_t UcxTransport::WaitRequest(void* request, Peer* peer) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  absl::Time spin_start = absl::Now();
  const absl::Time deadline = peer == nullptr ? absl::InfiniteFuture() : absl::Now() + send_timeout_;
  ucs_status_t st;
  while ((st = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    if (peer != nullptr && peer->failed) break;
    if (absl::Now() >= deadline) {
      peer->failed = true;
      peer->failure = absl::StrCat("a send did not complete within ", absl::FormatDuration(send_timeout_),
                                   " (the peer is not making progress)");
      TANDEM_LOG_WARN("transport", "ucx: ", peer->name, ": ", peer->failure);
      break;
    }
    ProgressOrBlock(deadline, &spin_start);
  }
  if (st == UCS_INPROGRESS) {
    // Given up (or the peer failed meanwhile): force-close its ep so that UCX completes the request
    // (its buffers are the caller's), and wait a bounded while for that local step.
    AbandonEp(peer);
    const absl::Time until = absl::Now() + kCloseTimeout;
    while (ucp_request_check_status(request) == UCS_INPROGRESS && absl::Now() < until) {
      ProgressOrBlock(until, &spin_start);
    }
    st = UCS_ERR_TIMED_OUT;
  }
  ucp_request_free(request);
  return st;
}

void UcxTransport::AbandonEp(Peer* peer) {
  if (peer == nullptr || peer->ep == nullptr) return;
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(peer->ep, &rp);
  if (UCS_PTR_IS_PTR(req)) closing_eps_.push_back(req);
  ep_to_peer_.erase(peer->ep);
  peer->ep = nullptr;
  // Release the close requests that have finished meanwhile (a long run may abandon many eps).
  std::erase_if(closing_eps_, [](void* r) {
    if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
    ucp_request_free(r);
    return true;
  });
}

Peer* UcxTransport::NewPeer(std::string name) {
  auto p = std::make_unique<Peer>();
  p->owner = this;
  p->id = static_cast<PeerId>(peers_.size());
  p->name = std::move(name);
  peers_.push_back(std::move(p));
  return peers_.back().get();
}

absl::StatusOr<Peer*> UcxTransport::LivePeer(PeerId peer) {
  if (peer >= peers_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: no peer ", peer, " (", peers_.size(), " known)"));
  }
  Peer* p = peers_[peer].get();
  absl::Time spin_start = absl::Now();
  while (p->connecting && !p->failed) ProgressOrBlock(p->connecting->deadline, &spin_start);
  if (p->failed) return PeerFailure(*p);
  return p;
}

void UcxTransport::OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* peer = static_cast<Peer*>(arg);
  if (peer->failed) return;
  peer->failed = true;
  peer->failure = ucs_status_string(status);
  if (peer->closing) {
    TANDEM_LOG_DEBUG("transport", "ucx: peer ", peer->name, " gone after close: ", peer->failure);
  } else {
    TANDEM_LOG_WARN("transport", "ucx: peer ", peer->name, " disconnected: ", peer->failure);
  }
}

absl::StatusOr<PeerId> UcxTransport::Connect(const std::string& address) {
  std::string host;
  uint16_t port = 0;
  RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  Peer* peer = NewPeer(address);
  sockaddr_storage ss{};
  socklen_t len = 0;
  absl::Status resolved = Resolve(host, port, /*passive=*/false, &ss, &len);
  if (!resolved.ok()) {
    peer->failed = true;
    peer->failure = std::string(resolved.message());
    return peer->id;
  }
  auto link = std::make_unique<Bootstrap>();
  link->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (link->fd < 0 ||
      (connect(link->fd, reinterpret_cast<const sockaddr*>(&ss), len) != 0 && errno != EINPROGRESS)) {
    peer->failed = true;
    peer->failure = absl::StrCat("connect: ", std::strerror(errno));
    return peer->id;
  }
  const int one = 1;
  setsockopt(link->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  link->deadline = absl::Now() + kConnectTimeout;
  link->handshake =
      std::make_unique<bootstrap::Handshake>(bootstrap::Handshake::Role::kClient, key_, worker_address_);
  peer->connecting = std::move(link);
  return peer->id;
}

absl::StatusOr<PeerId> UcxTransport::Accept(absl::Time deadline) {
  if (listen_fd_ < 0) return absl::FailedPreconditionError("ucx: Accept on a transport that does not listen");
  absl::Time spin_start = absl::Now();
  while (accepted_.empty()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("ucx: no incoming connection on ", address_, " before the deadline"));
    }
    ProgressOrBlock(deadline, &spin_start);
  }
  const PeerId peer = accepted_.front();
  accepted_.pop_front();
  return peer;
}

absl::Status UcxTransport::Send(PeerId peer_id, absl::Span<const uint8_t> message) {
  ASSIGN_OR_RETURN(Peer * peer, LivePeer(peer_id));
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_t st = WaitRequest(
      ucp_am_send_nbx(peer->ep, kAmControl, nullptr, 0, message.data(), message.size(), &rp), peer);
  if (peer->failed) return PeerFailure(*peer);
  if (st != UCS_OK) {
    return UcxError(st, absl::StrCat("sending a ", message.size(), "-byte message to ", peer->name));
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) {
  absl::Time spin_start = absl::Now();
  for (;;) {
    if (!errors_.empty()) return TakeError();
    std::erase_if(inbox_, [](const std::unique_ptr<InMessage>& m) { return m->failed; });
    // The oldest complete message whose peer has no older incomplete one.
    std::vector<PeerId> blocked;
    for (auto it = inbox_.begin(); it != inbox_.end(); ++it) {
      InMessage& m = **it;
      bool peer_blocked = std::find(blocked.begin(), blocked.end(), m.from) != blocked.end();
      if (peer_blocked) continue;
      if (!m.complete) {
        blocked.push_back(m.from);
        continue;
      }
      *from = m.from;
      *message = std::move(m.data);
      inbox_.erase(it);
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(AnyPeerFailure());
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("ucx: no message from any of ", peers_.size(), " peers before the deadline"));
    }
    ProgressOrBlock(deadline, &spin_start);
  }
}

absl::Status UcxTransport::RegisterBuffer(uint32_t id, void* base, size_t bytes) {
  if (buffers_.count(id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("ucx: buffer id ", id, " is already registered"));
  }
  if (base == nullptr && bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: buffer ", id, " has a null base"));
  }
  auto b = std::make_unique<Buffer>();
  b->id = id;
  b->base = static_cast<uint8_t*>(base);
  b->bytes = bytes;
  buffers_[id] = std::move(b);
  return absl::OkStatus();
}

absl::Status UcxTransport::Write(PeerId peer_id, uint32_t buffer, uint64_t offset,
                                 absl::Span<const absl::Span<const uint8_t>> pieces, uint64_t seqno) {
  ASSIGN_OR_RETURN(Peer * peer, LivePeer(peer_id));
  if (seqno == 0) return absl::InvalidArgumentError("ucx: Write with seqno 0");
  std::vector<ucp_dt_iov_t> iov;
  iov.reserve(pieces.size());
  uint64_t length = 0;
  for (const auto& piece : pieces) {
    if (piece.empty()) continue;
    iov.push_back({const_cast<uint8_t*>(piece.data()), piece.size()});
    length += piece.size();
  }
  uint8_t header[kWriteHeaderBytes];
  PutLe32(header, kWriteMagic);
  PutLe32(header + 4, buffer);
  PutLe64(header + 8, offset);
  PutLe64(header + 16, length);
  PutLe64(header + 24, seqno);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  rp.flags = UCP_AM_SEND_FLAG_REPLY;
  const void* data = nullptr;
  size_t count = 0;
  if (iov.size() == 1) {
    data = iov[0].buffer;
    count = iov[0].length;
  } else if (iov.size() > 1) {
    rp.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    rp.datatype = ucp_dt_make_iov();
    data = iov.data();
    count = iov.size();
  }
  ucs_status_t st =
      WaitRequest(ucp_am_send_nbx(peer->ep, kAmWrite, header, sizeof(header), data, count, &rp), peer);
  if (peer->failed) return PeerFailure(*peer);
  if (st != UCS_OK) {
    return UcxError(st, absl::StrCat("writing ", length, " bytes at offset ", offset, " of buffer ", buffer,
                                     " of ", peer->name));
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::WaitDoorbell(uint32_t buffer, uint64_t seqno, absl::Time deadline) {
  auto it = buffers_.find(buffer);
  if (it == buffers_.end()) {
    return absl::NotFoundError(absl::StrCat("ucx: WaitDoorbell on unknown buffer ", buffer));
  }
  const Buffer& b = *it->second;
  absl::Time spin_start = absl::Now();
  for (;;) {
    if (!errors_.empty()) return TakeError();
    if (b.doorbell >= seqno) return absl::OkStatus();
    RETURN_IF_ERROR(AnyPeerFailure());
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ucx: doorbell of buffer ", buffer, " did not reach seqno ", seqno, " before the deadline (seen ",
          b.doorbell, b.writer ? absl::StrCat(", last written by ", PeerName(*b.writer)) : "", ")"));
    }
    ProgressOrBlock(deadline, &spin_start);
  }
}

absl::Status UcxTransport::Flush(absl::Time deadline) {
  std::vector<void*> requests;
  for (auto& p : peers_) {
    if (p->failed || p->ep == nullptr) continue;
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_ep_flush_nbx(p->ep, &rp);
    if (UCS_PTR_IS_PTR(req)) requests.push_back(req);
  }
  absl::Status result;
  absl::Time spin_start = absl::Now();
  for (void* req : requests) {
    while (result.ok() && ucp_request_check_status(req) == UCS_INPROGRESS) {
      if (absl::Now() >= deadline) {
        result = absl::DeadlineExceededError("ucx: Flush did not complete before the deadline");
        break;
      }
      ProgressOrBlock(deadline, &spin_start);
    }
    ucp_request_free(req);  // a request still in progress is released when it completes
  }
  RETURN_IF_ERROR(result);
  return AnyPeerFailure();
}

ucs_status_t UcxTransport::OnControlAm(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  std::optional<PeerId> from;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) from = self->PeerOf(param->reply_ep);
  if (!from) {
    self->RecordError(absl::DataLossError(
        absl::StrCat("ucx: dropped a ", length, "-byte control message from an unknown endpoint")));
    return UCS_OK;
  }
  auto message = std::make_unique<InMessage>();
  message->from = *from;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    message->data.assign(bytes, bytes + length);
    message->complete = true;
    self->inbox_.push_back(std::move(message));
    return UCS_OK;
  }
  message->data.resize(length);
  auto* op = new RndvRecv{.self = self, .message = message.get(), .from = *from, .length = length};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = &OnRndvDone;
  rp.user_data = op;
  self->inbox_.push_back(std::move(message));
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(self->worker_, data, op->message->data.data(), length, &rp);
  // In progress: OnRndvDone reports completion and frees the request.
  if (!UCS_PTR_IS_PTR(req)) OnRndvDone(nullptr, UCS_PTR_STATUS(req), length, op);
  return UCS_INPROGRESS;
}

ucs_status_t UcxTransport::OnWriteAm(void* arg, const void* header, size_t header_length, void* data,
                                     size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxTransport*>(arg);
  std::optional<PeerId> from;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0) from = self->PeerOf(param->reply_ep);
  bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (!from) {
    self->RecordError(
        absl::DataLossError(absl::StrCat("ucx: dropped a ", length, "-byte write from an unknown endpoint")));
    return UCS_OK;  // dropped; a rendezvous sender completes normally
  }
  bool started =
      self->HandleWrite(*from, static_cast<const uint8_t*>(header), header_length, data, length, rndv);
  // A rendezvous descriptor passed to ucp_am_recv_data_nbx is UCP's (UCS_INPROGRESS); otherwise
  // UCS_OK drops it and the sender's request completes.
  return started ? UCS_INPROGRESS : UCS_OK;
}

bool UcxTransport::HandleWrite(PeerId from, const uint8_t* header, size_t header_length, void* data,
                               size_t length, bool rndv) {
  const std::string& peer = peers_[from]->name;
  if (header_length != kWriteHeaderBytes || GetLe32(header) != kWriteMagic) {
    RecordError(absl::DataLossError(absl::StrCat("ucx: dropped a ", length, "-byte write from ", peer,
                                                 " with a malformed header (", header_length, " bytes)")));
    return false;
  }
  uint32_t id = GetLe32(header + 4);
  uint64_t offset = GetLe64(header + 8);
  uint64_t declared = GetLe64(header + 16);
  uint64_t seqno = GetLe64(header + 24);
  auto it = buffers_.find(id);
  std::string what = absl::StrCat("write from ", peer, " to buffer ", id, " at offset ", offset,
                                  " of length ", declared, " (seqno ", seqno, ")");
  if (it == buffers_.end()) {
    RecordError(absl::DataLossError(absl::StrCat("ucx: dropped a ", what, ": unknown buffer id")));
    return false;
  }
  Buffer* b = it->second.get();
  if (declared != length || seqno == 0 || offset > b->bytes || length > b->bytes - offset) {
    RecordError(absl::DataLossError(absl::StrCat(
        "ucx: dropped a ", what, ": ",
        declared != length ? absl::StrCat("the header says ", declared, " bytes but ", length, " arrived")
        : seqno == 0       ? std::string("seqno 0")
                           : absl::StrCat("outside the buffer's ", b->bytes, " bytes"))));
    return false;
  }
  b->writer = from;
  if (!rndv) {
    if (length != 0) std::memcpy(b->base + offset, data, length);
    b->pending.push_back(std::make_unique<InWrite>(InWrite{.seqno = seqno, .done = true}));
    AdvanceDoorbell(b);
    return false;
  }
  b->pending.push_back(std::make_unique<InWrite>(InWrite{.seqno = seqno}));
  auto* op = new RndvRecv{.self = this,
                          .buffer = b,
                          .write = b->pending.back().get(),
                          .from = from,
                          .offset = offset,
                          .length = length};
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.recv_am = &OnRndvDone;
  rp.user_data = op;
  ucs_status_ptr_t req = ucp_am_recv_data_nbx(worker_, data, b->base + offset, length, &rp);
  // In progress: OnRndvDone reports completion and frees the request.
  if (!UCS_PTR_IS_PTR(req)) OnRndvDone(nullptr, UCS_PTR_STATUS(req), length, op);
  return true;
}

void UcxTransport::OnRndvDone(void* request, ucs_status_t status, size_t length, void* user_data) {
  std::unique_ptr<RndvRecv> op(static_cast<RndvRecv*>(user_data));
  if (request != nullptr) ucp_request_free(request);
  UcxTransport* self = op->self;
  const std::string& peer = self->peers_[op->from]->name;
  if (op->message != nullptr) {
    op->message->complete = true;
    if (status != UCS_OK) {
      // The message is lost; the peer's failure (if that is the cause) is reported by the waits.
      op->message->failed = true;
      self->RecordError(
          absl::DataLossError(absl::StrCat("ucx: receiving a ", op->length, "-byte message from ", peer,
                                           " failed: ", ucs_status_string(status))));
    }
    return;
  }
  op->write->done = true;
  if (status != UCS_OK) {
    op->write->failed = true;
    self->RecordError(absl::DataLossError(absl::StrCat(
        "ucx: write from ", peer, " to buffer ", op->buffer->id, " at offset ", op->offset, " of length ",
        op->length, " (seqno ", op->write->seqno, ") failed: ", ucs_status_string(status))));
  }
  self->AdvanceDoorbell(op->buffer);
}

// The doorbell moves over the completed prefix of the buffer's writes; a failed write stops it.
void UcxTransport::AdvanceDoorbell(Buffer* buffer) {
  while (!buffer->pending.empty() && buffer->pending.front()->done && !buffer->pending.front()->failed) {
    buffer->doorbell = std::max(buffer->doorbell, buffer->pending.front()->seqno);
    buffer->pending.pop_front();
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const UcxOptions& options) {
  auto transport = std::make_unique<UcxTransport>();
  RETURN_IF_ERROR(transport->Init(options));
  return std::unique_ptr<Transport>(std::move(transport));
}

}  // namespace tandem::transport
