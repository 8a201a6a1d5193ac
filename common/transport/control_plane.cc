#include "common/transport/control_plane.h"

#include "common/status.h"

namespace tandem::transport {

absl::Status ControlPlaneTransport::Greet(PeerId peer) {
  if (!greeted_.insert(peer).second) return absl::OkStatus();
  return OnNewPeer(peer);
}

absl::StatusOr<PeerId> ControlPlaneTransport::Connect(const std::string& address) {
  ASSIGN_OR_RETURN(const PeerId peer, control_->Connect(address));
  if (greet_when_connected_ && control_->Connecting(peer)) return peer;  // greeted by its first Send
  RETURN_IF_ERROR(Greet(peer));
  return peer;
}

absl::StatusOr<PeerId> ControlPlaneTransport::Accept(absl::Time deadline) {
  ASSIGN_OR_RETURN(const PeerId peer, control_->Accept(deadline));
  RETURN_IF_ERROR(Greet(peer));
  return peer;
}

bool ControlPlaneTransport::TakeKept(PeerId* from, std::vector<uint8_t>* message) {
  if (kept_.empty()) return false;
  *from = kept_.front().first;
  *message = std::move(kept_.front().second);
  kept_.pop_front();
  return true;
}

absl::Status ControlPlaneTransport::Receive(PeerId* from, std::vector<uint8_t>* message,
                                            absl::Time deadline) {
  if (TakeKept(from, message)) return absl::OkStatus();
  while (true) {
    RETURN_IF_ERROR(control_->Receive(from, message, deadline));
    RETURN_IF_ERROR(Greet(*from));
    ASSIGN_OR_RETURN(const bool ours, Consume(*from, *message));
    if (!ours) return absl::OkStatus();
  }
}

absl::Status ControlPlaneTransport::Pump(absl::Duration wait) {
  PeerId from = 0;
  std::vector<uint8_t> m;
  while (true) {
    const absl::Status s = control_->Receive(&from, &m, absl::Now() + wait);
    if (absl::IsDeadlineExceeded(s)) return absl::OkStatus();
    RETURN_IF_ERROR(s);
    RETURN_IF_ERROR(Greet(from));
    ASSIGN_OR_RETURN(const bool ours, Consume(from, m));
    if (!ours) kept_.emplace_back(from, std::move(m));
    wait = absl::Microseconds(1);
  }
}

}  // namespace tandem::transport
