// The part every GPU transport (p2p, nccl, verbs) shares: an inner transport (UCX) that carries
// the control plane (connections, the caller's control messages, peer-failure detection) and
// this transport's own frames (buffer descriptors, hellos, queue-pair info). Those frames are
// consumed inside this transport's calls and never reach the caller; the caller's messages that
// turn up while the transport pumps for its own frames are kept, in order, for Receive.
//
// A subclass names its frames (Consume), greets each new peer (OnNewPeer), and implements the
// data path; it calls Pump() wherever it waits for frames of its own.
//
// Every peer is greeted exactly once, before anything it sent is handed on: by Connect, by Accept,
// or by the first Receive or Pump that meets a message from it. A subclass that greets only once
// connected (greet_when_connected_: p2p) is greeted by Connect when the inner connection is up
// already, else by the first Send to the peer (or message from it): so a Connect never waits for
// the connection, and a refused one (a rejoin probe, Close()d at once) is never sent to and fails
// nothing. The inner transport takes
// connections as it makes progress, so a peer's first message can arrive in a Receive before an
// Accept has returned that peer (or with no Accept to follow: a memory rank stops accepting once
// its compute ranks have said hello); greeting only in Accept once left such a peer without this
// transport's hello, and its writes waiting for a buffer that was "never registered".
#pragma once

#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "common/transport/transport.h"

namespace tandem::transport {

class ControlPlaneTransport : public Transport {
 public:
  std::string address() const override { return control_->address(); }
  std::string PeerName(PeerId peer) const override { return control_->PeerName(peer); }
  absl::StatusOr<PeerId> Connect(const std::string& address) override;
  absl::StatusOr<PeerId> Accept(absl::Time deadline) override;
  absl::Status Send(PeerId peer, absl::Span<const uint8_t> message) override {
    RETURN_IF_ERROR(Greet(peer));  // a no-op once greeted
    return control_->Send(peer, message);
  }
  // The caller's next message: one kept by Pump first, else the next from the inner transport
  // (applying this transport's frames met on the way).
  absl::Status Receive(PeerId* from, std::vector<uint8_t>* message, absl::Time deadline) override;
  // The control plane's connection is the peer's: its failure is the peer's.
  absl::Status PeerStatus(PeerId peer) const override { return control_->PeerStatus(peer); }
  void Close(PeerId peer) override { control_->Close(peer); }
  void Reopen(PeerId peer) override { control_->Reopen(peer); }
  bool Connecting(PeerId peer) const override { return control_->Connecting(peer); }

 protected:
  explicit ControlPlaneTransport(std::unique_ptr<Transport> control) : control_(std::move(control)) {}

  // A new connection (see the top): send it what it needs of us. Called once per peer.
  virtual absl::Status OnNewPeer(PeerId peer) = 0;
  // Calls OnNewPeer the first time `peer` is met; a subclass that receives from control() itself
  // calls it before it looks at a message.
  absl::Status Greet(PeerId peer);
  // Applies one of this transport's frames (true), or leaves `message` to the caller (false).
  virtual absl::StatusOr<bool> Consume(PeerId from, const std::vector<uint8_t>& message) = 0;

  // Handles the frames that have arrived, waiting at most `wait` for the first (what is already
  // there after it is drained without waiting further); the caller's messages are kept for Receive. A failed
  // peer surfaces here as Unavailable. `wait` must be positive: UCX makes progress only before a deadline it
  // has not reached.
  absl::Status Pump(absl::Duration wait = absl::Microseconds(50));
  // The next message addressed to the caller, without Consume-ing anything (for a subclass that
  // overrides Receive and still wants the kept ones first); false when none is kept.
  bool TakeKept(PeerId* from, std::vector<uint8_t>* message);

  // This transport's frames are fixed layouts of one host's processes (both ends are this code):
  // a frame's bytes, and the 32-bit magic that starts one (0 if too short).
  template <typename T>
  static std::vector<uint8_t> ToBytes(const T& frame) {
    std::vector<uint8_t> v(sizeof(T));
    std::memcpy(v.data(), &frame, sizeof(T));
    return v;
  }
  static uint32_t MagicOf(const std::vector<uint8_t>& m) {
    uint32_t magic = 0;
    if (m.size() >= 4) std::memcpy(&magic, m.data(), 4);
    return magic;
  }

  // Set by a subclass's constructor: Connect greets a peer only once its connection is up (see the
  // top); otherwise Connect greets at once (which waits for the connection).
  bool greet_when_connected_ = false;

  Transport& control() { return *control_; }
  const Transport& control() const { return *control_; }
  // For a subclass that must end its inner transport at a point of its own teardown.
  void ResetControl() { control_.reset(); }

 private:
  std::unique_ptr<Transport> control_;
  std::deque<std::pair<PeerId, std::vector<uint8_t>>> kept_;  // caller's messages seen by Pump
  std::unordered_set<PeerId> greeted_;                        // peers OnNewPeer was called for
};

}  // namespace tandem::transport
