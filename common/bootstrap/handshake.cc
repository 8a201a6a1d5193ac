#include "common/bootstrap/handshake.h"

#include <openssl/crypto.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::bootstrap {
namespace {

constexpr uint32_t kMagic = 0x42444e54;  // "TNDB"
constexpr uint16_t kKindHello = 1, kKindClientProof = 2, kKindServerProof = 3;
constexpr size_t kHelloBytes = 48;
constexpr size_t kClientFixed = 84;  // magic..mac_c
constexpr size_t kServerFixed = 44;  // magic..mac_s

void Put16(std::vector<uint8_t>& v, uint16_t x) {
  for (int i = 0; i < 2; ++i) v.push_back(static_cast<uint8_t>(x >> (8 * i)));
}
void Put32(std::vector<uint8_t>& v, uint32_t x) {
  for (int i = 0; i < 4; ++i) v.push_back(static_cast<uint8_t>(x >> (8 * i)));
}
uint16_t Get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }
uint32_t Get32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
template <typename T>
void Append(std::vector<uint8_t>& v, const T& bytes) {
  v.insert(v.end(), bytes.begin(), bytes.end());
}

std::array<uint8_t, 32> Mac(const DeploymentKey& key, const char* label, const std::array<uint8_t, 32>& first,
                            const std::array<uint8_t, 32>& second, absl::Span<const uint8_t> payload) {
  std::vector<uint8_t> data(label, label + std::strlen(label));
  Append(data, key.id);
  Append(data, first);
  Append(data, second);
  data.insert(data.end(), payload.begin(), payload.end());
  std::array<uint8_t, 32> mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.secret.data(), static_cast<int>(key.secret.size()), data.data(), data.size(),
       mac.data(), &len);
  return mac;
}

std::array<uint8_t, 32> Nonce() {
  std::array<uint8_t, 32> n{};
  TANDEM_CHECK_MSG(RAND_bytes(n.data(), static_cast<int>(n.size())) == 1, "OpenSSL RAND_bytes failed");
  return n;
}

std::string IdHex(const uint8_t* p) {
  std::array<uint8_t, 8> id{};
  std::memcpy(id.data(), p, id.size());
  DeploymentKey k;
  k.id = id;
  return k.IdHex();
}

}  // namespace

void ReplayGuard::Remember(const std::array<uint8_t, 32>& nonce) {
  if (!seen_.insert(nonce).second) return;
  order_.push_back(nonce);
  if (order_.size() > kCapacity) {
    seen_.erase(order_.front());
    order_.pop_front();
  }
}

Handshake::Handshake(Role role, const DeploymentKey& key, std::vector<uint8_t> payload, ReplayGuard* guard)
    : role_(role),
      key_(key),
      payload_(std::move(payload)),
      guard_(guard),
      stage_(role == Role::kServer ? Stage::kAwaitClientProof : Stage::kAwaitHello) {
  TANDEM_CHECK(payload_.size() <= kMaxPayload);
  if (role_ == Role::kServer) {
    nonce_s_ = Nonce();
    Put32(out_, kMagic);
    Put16(out_, kHandshakeVersion);
    Put16(out_, kKindHello);
    Append(out_, key_.id);
    Append(out_, nonce_s_);
  }
}

std::vector<uint8_t> Handshake::TakeOutput() { return std::exchange(out_, {}); }

size_t Handshake::Wanted() const {
  const size_t have = in_.size();
  switch (stage_) {
    case Stage::kAwaitHello:
      return kHelloBytes - have;
    case Stage::kAwaitClientProof:
      return have < kClientFixed ? kClientFixed - have : kClientFixed + Get32(in_.data() + 48) - have;
    case Stage::kAwaitServerProof:
      return have < kServerFixed ? kServerFixed - have : kServerFixed + Get32(in_.data() + 8) - have;
    default:
      return 0;
  }
}

absl::Status Handshake::Fail(absl::Status status) {
  stage_ = Stage::kFailed;
  out_.clear();
  return status;
}

absl::Status Handshake::Feed(absl::Span<const uint8_t> bytes) {
  if (stage_ == Stage::kFailed) return absl::FailedPreconditionError("the handshake has failed already");
  if (bytes.size() > Wanted()) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("sent ", bytes.size() - Wanted(), " bytes more than the handshake has")));
  }
  in_.insert(in_.end(), bytes.begin(), bytes.end());
  const uint16_t expected_kind = stage_ == Stage::kAwaitHello         ? kKindHello
                                 : stage_ == Stage::kAwaitClientProof ? kKindClientProof
                                                                      : kKindServerProof;
  // The header fields as soon as they are there: a probe is refused at its first bytes.
  if (in_.size() >= 4 && Get32(in_.data()) != kMagic) {
    return Fail(absl::InvalidArgumentError("not a tandem handshake (bad magic in its first bytes)"));
  }
  if (in_.size() >= 8 &&
      (Get16(in_.data() + 4) != kHandshakeVersion || Get16(in_.data() + 6) != expected_kind)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("handshake version ", Get16(in_.data() + 4), " message ", Get16(in_.data() + 6),
                     ", expected version ", kHandshakeVersion, " message ", expected_kind)));
  }
  if (stage_ != Stage::kAwaitServerProof && in_.size() >= 16 &&
      std::memcmp(in_.data() + 8, key_.id.data(), 8) != 0) {
    return Fail(
        absl::PermissionDeniedError(absl::StrCat("a peer of another deployment (id ", IdHex(in_.data() + 8),
                                                 "; this deployment is ", key_.IdHex(), ")")));
  }
  const size_t length_at = stage_ == Stage::kAwaitClientProof ? 48 : 8;
  if (stage_ != Stage::kAwaitHello && in_.size() >= length_at + 4 &&
      Get32(in_.data() + length_at) > kMaxPayload) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "a handshake payload of ", Get32(in_.data() + length_at), " bytes (at most ", kMaxPayload, ")")));
  }
  if (Wanted() > 0) return absl::OkStatus();
  absl::Status st = stage_ == Stage::kAwaitHello         ? OnHello()
                    : stage_ == Stage::kAwaitClientProof ? OnClientProof()
                                                         : OnServerProof();
  in_.clear();
  return st.ok() ? st : Fail(std::move(st));
}

absl::Status Handshake::OnHello() {
  std::memcpy(nonce_s_.data(), in_.data() + 16, 32);
  nonce_c_ = Nonce();
  const std::array<uint8_t, 32> mac = Mac(key_, "tandem/1 client", nonce_s_, nonce_c_, payload_);
  Put32(out_, kMagic);
  Put16(out_, kHandshakeVersion);
  Put16(out_, kKindClientProof);
  Append(out_, key_.id);
  Append(out_, nonce_c_);
  Put32(out_, static_cast<uint32_t>(payload_.size()));
  Append(out_, mac);
  Append(out_, payload_);
  stage_ = Stage::kAwaitServerProof;
  return absl::OkStatus();
}

absl::Status Handshake::OnClientProof() {
  std::memcpy(nonce_c_.data(), in_.data() + 16, 32);
  if (nonce_c_ == nonce_s_) return absl::PermissionDeniedError("the client returned the server's own nonce");
  if (guard_ != nullptr && guard_->Seen(nonce_c_)) {
    return absl::PermissionDeniedError("a replayed handshake (its client nonce was used before)");
  }
  const absl::Span<const uint8_t> payload(in_.data() + kClientFixed, in_.size() - kClientFixed);
  const std::array<uint8_t, 32> mac = Mac(key_, "tandem/1 client", nonce_s_, nonce_c_, payload);
  if (CRYPTO_memcmp(mac.data(), in_.data() + 52, mac.size()) != 0) {
    return absl::PermissionDeniedError("wrong HMAC: the peer does not hold this deployment's secret");
  }
  if (guard_ != nullptr) guard_->Remember(nonce_c_);
  peer_payload_.assign(payload.begin(), payload.end());
  const std::array<uint8_t, 32> reply = Mac(key_, "tandem/1 server", nonce_c_, nonce_s_, payload_);
  Put32(out_, kMagic);
  Put16(out_, kHandshakeVersion);
  Put16(out_, kKindServerProof);
  Put32(out_, static_cast<uint32_t>(payload_.size()));
  Append(out_, reply);
  Append(out_, payload_);
  stage_ = Stage::kDone;
  return absl::OkStatus();
}

absl::Status Handshake::OnServerProof() {
  const absl::Span<const uint8_t> payload(in_.data() + kServerFixed, in_.size() - kServerFixed);
  const std::array<uint8_t, 32> mac = Mac(key_, "tandem/1 server", nonce_c_, nonce_s_, payload);
  if (CRYPTO_memcmp(mac.data(), in_.data() + 12, mac.size()) != 0) {
    return absl::PermissionDeniedError(
        "wrong HMAC from the server: it does not hold this deployment's secret");
  }
  peer_payload_.assign(payload.begin(), payload.end());
  stage_ = Stage::kDone;
  return absl::OkStatus();
}

}  // namespace tandem::bootstrap
