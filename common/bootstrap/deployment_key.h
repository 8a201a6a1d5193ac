// The per-deployment secret that every connection between a deployment's ranks proves it knows
// (common/bootstrap/handshake.h). The launcher creates one per run (CreateKeyFile: 32 random bytes
// as 64 hex digits, a file of mode 0600 in the run's directory) and hands it to every rank, by
// file (`--secret-file`) on its own host or on the ssh session's stdin (`--secret-stdin`) on
// another; the secret itself never travels on a connection between ranks.
//
// A process's key (ProcessKey) is, in this order: the one set with SetProcessKey (the rank
// commands do that from --secret-file / --secret-stdin); the file named by the environment
// variable TANDEM_SECRET_FILE (how test programs share one key with the processes they start);
// else a random key made for this process alone, so that a process nobody gave a key reaches only
// transports of its own (and of children it forks afterwards) and is reached by no one else.
//
// Thread safety: ProcessKey and SetProcessKey may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tandem::bootstrap {

struct DeploymentKey {
  std::array<uint8_t, 32> secret{};
  // Public name of the deployment: the first 8 bytes of HMAC-SHA256(secret, "tandem deployment id").
  // Sent in the clear so that a peer of another deployment is told apart from a forged one; it
  // reveals nothing of the secret.
  std::array<uint8_t, 8> id{};
  std::string IdHex() const;  // 16 hex digits, for logs
};

// A key from 32 secret bytes (the id is derived).
DeploymentKey MakeKey(const std::array<uint8_t, 32>& secret);
// A fresh key from the system's random source. Internal error if it cannot be read.
absl::StatusOr<DeploymentKey> RandomKey();

// Writes a fresh key to `path` (created with mode 0600; an existing file is an error: AlreadyExists,
// so two launches never share one) and returns it.
absl::StatusOr<DeploymentKey> CreateKeyFile(const std::string& path);
// Reads the key at `path`: a regular file (not a symbolic link) owned by this user, with no
// permission for group or others, holding 64 hex digits and an optional newline. Errors name the
// file and what is wrong ("... has mode 0644: it must be readable by its owner only (0600)").
absl::StatusOr<DeploymentKey> LoadKeyFile(const std::string& path);
// The key from text (64 hex digits, optional trailing newline); `source` names it in errors.
absl::StatusOr<DeploymentKey> ParseKey(const std::string& text, const std::string& source);
// 64 hex digits and a newline: the file format.
std::string FormatKey(const DeploymentKey& key);

// This process's key (see the header comment). The first call decides it; errors (a bad
// TANDEM_SECRET_FILE) are returned by every call.
absl::StatusOr<DeploymentKey> ProcessKey();
// Sets this process's key; must precede the first transport. Later calls replace it.
void SetProcessKey(const DeploymentKey& key);
// For a program that starts ranks or helpers itself (tests, benches): creates a fresh key file
// at `path` (CreateKeyFile), makes it this process's key and exports TANDEM_SECRET_FILE=path, so
// that the processes it starts afterwards share it.
absl::Status ShareNewKeyWithChildren(const std::string& path);

}  // namespace tandem::bootstrap
