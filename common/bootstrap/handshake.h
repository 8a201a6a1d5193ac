// The handshake that opens every connection between the ranks of a deployment, before any UCX
// traffic: both sides prove that they hold the deployment's secret (deployment_key.h) without
// sending it, and exchange an authenticated payload (each side's UCX worker address). A sans-I/O
// state machine: the caller moves bytes between it and a socket (the UCX transport does, with
// non-blocking sockets and a deadline per connection).
//
// Messages (little-endian, fixed layouts; `id` is the deployment id, nonces are 32 random bytes):
//   server -> client  hello   "TNDB" u32 | version u16 | kind=1 u16 | id[8] | nonce_s[32]          (48 bytes)
//   client -> server  proof   "TNDB" | version | kind=2 | id[8] | nonce_c[32] | length u32 | mac_c[32]
//                             | payload_c[length]                                                 (84 +
//                             length)
//   server -> client  proof   "TNDB" | version | kind=3 | length u32 | mac_s[32] | payload_s[length] (44 +
//   length) mac_c = HMAC-SHA256(secret, "tandem/1 client" | id | nonce_s | nonce_c | payload_c) mac_s =
//   HMAC-SHA256(secret, "tandem/1 server" | id | nonce_c | nonce_s | payload_s)
// The server speaks first, so a client learns nothing before it has shown its proof, and the
// server's fresh nonce makes a recorded client proof worthless on any other connection. A server
// also remembers the client nonces of its successful handshakes (ReplayGuard) and names a second
// use of one as a replay. Macs are compared in constant time (CRYPTO_memcmp).
//
// Rejections (Feed returns an error; the caller logs it with the peer's address and closes):
//   bytes that do not start a handshake ("not a tandem handshake", e.g. a port scanner's probe),
//   another version, a peer of another deployment (its id differs), a payload over kMaxPayload,
//   a wrong mac ("wrong HMAC"), a replayed client nonce, and any byte after the handshake's end.
// Nothing a peer sends is used before its mac has been checked, except the fixed header fields
// above (magic, version, kind, id, length), which are compared, never interpreted further.
//
// Thread safety: none; one connection's handshake is driven by one thread. ReplayGuard likewise.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/bootstrap/deployment_key.h"

namespace tandem::bootstrap {

constexpr uint16_t kHandshakeVersion = 1;
constexpr size_t kMaxPayload = 16384;  // a UCX worker address is a few hundred bytes

// The client nonces of a server's completed handshakes (the newest kCapacity of them).
class ReplayGuard {
 public:
  static constexpr size_t kCapacity = 65536;
  bool Seen(const std::array<uint8_t, 32>& nonce) const { return seen_.count(nonce) != 0; }
  void Remember(const std::array<uint8_t, 32>& nonce);

 private:
  std::set<std::array<uint8_t, 32>> seen_;
  std::deque<std::array<uint8_t, 32>> order_;
};

class Handshake {
 public:
  enum class Role { kServer, kClient };
  // `guard` (server only; may be null) outlives the handshake. The server's hello is ready in
  // TakeOutput() at once.
  Handshake(Role role, const DeploymentKey& key, std::vector<uint8_t> payload, ReplayGuard* guard = nullptr);

  // Bytes to send now (possibly none); the caller sends all of them, in order.
  std::vector<uint8_t> TakeOutput();
  // How many bytes the handshake can still take (the caller reads no more, so that nothing after
  // the handshake is consumed); 0 once done or failed.
  size_t Wanted() const;
  // Takes bytes received from the peer (at most Wanted()). An error rejects the peer: the
  // handshake is failed for good (PermissionDenied for a failed proof, another deployment or a
  // replay; InvalidArgument for malformed bytes).
  absl::Status Feed(absl::Span<const uint8_t> bytes);
  bool done() const { return stage_ == Stage::kDone; }
  bool failed() const { return stage_ == Stage::kFailed; }
  // The peer's authenticated payload, once done().
  const std::vector<uint8_t>& peer_payload() const { return peer_payload_; }

 private:
  enum class Stage { kAwaitHello, kAwaitClientProof, kAwaitServerProof, kDone, kFailed };
  absl::Status Fail(absl::Status status);
  absl::Status OnHello();
  absl::Status OnClientProof();
  absl::Status OnServerProof();

  Role role_;
  DeploymentKey key_;
  std::vector<uint8_t> payload_;
  ReplayGuard* guard_;
  Stage stage_;
  std::array<uint8_t, 32> nonce_s_{}, nonce_c_{};
  std::vector<uint8_t> in_;   // bytes of the message being received
  std::vector<uint8_t> out_;  // bytes to send
  std::vector<uint8_t> peer_payload_;
};

}  // namespace tandem::bootstrap
