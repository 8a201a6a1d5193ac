#include "common/bootstrap/deployment_key.h"

#include <fcntl.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::bootstrap {
namespace {

constexpr char kHex[] = "0123456789abcdef";

std::string Hex(const uint8_t* p, size_t n) {
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    s.push_back(kHex[p[i] >> 4]);
    s.push_back(kHex[p[i] & 15]);
  }
  return s;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

struct ProcessKeyState {
  std::mutex mu;
  std::optional<absl::StatusOr<DeploymentKey>> key;
};

ProcessKeyState& State() {
  static ProcessKeyState* state = new ProcessKeyState();
  return *state;
}

}  // namespace

std::string DeploymentKey::IdHex() const { return Hex(id.data(), id.size()); }

DeploymentKey MakeKey(const std::array<uint8_t, 32>& secret) {
  DeploymentKey key;
  key.secret = secret;
  static constexpr char kLabel[] = "tandem deployment id";
  uint8_t mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()), reinterpret_cast<const uint8_t*>(kLabel),
       sizeof(kLabel) - 1, mac, &len);
  std::memcpy(key.id.data(), mac, key.id.size());
  return key;
}

absl::StatusOr<DeploymentKey> RandomKey() {
  std::array<uint8_t, 32> secret{};
  if (RAND_bytes(secret.data(), static_cast<int>(secret.size())) != 1) {
    return absl::InternalError("bootstrap: the system's random source (OpenSSL RAND_bytes) failed");
  }
  return MakeKey(secret);
}

std::string FormatKey(const DeploymentKey& key) {
  return absl::StrCat(Hex(key.secret.data(), key.secret.size()), "\n");
}

absl::StatusOr<DeploymentKey> ParseKey(const std::string& text, const std::string& source) {
  std::string_view t = text;
  if (!t.empty() && t.back() == '\n') t.remove_suffix(1);
  if (t.size() != 64) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a deployment secret of 64 hex digits, got ", t.size(), " bytes"));
  }
  std::array<uint8_t, 32> secret{};
  for (size_t i = 0; i < 32; ++i) {
    const int hi = HexDigit(t[2 * i]), lo = HexDigit(t[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": the deployment secret has a non-hex character at byte ", 2 * i));
    }
    secret[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return MakeKey(secret);
}

absl::StatusOr<DeploymentKey> CreateKeyFile(const std::string& path) {
  ASSIGN_OR_RETURN(DeploymentKey key, RandomKey());
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 && errno == EEXIST) {
    return absl::AlreadyExistsError(
        absl::StrCat("the deployment secret ", path, " exists already (one per run)"));
  }
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("create the deployment secret ", path));
  const std::string text = FormatKey(key);
  // The mode is set again in case the umask left less than 0600 (never more: O_CREAT masks).
  const bool ok = fchmod(fd, 0600) == 0 &&
                  write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && fsync(fd) == 0;
  const int err = errno;
  close(fd);
  if (!ok) {
    unlink(path.c_str());
    return ErrnoToStatus(err, absl::StrCat("write the deployment secret ", path));
  }
  return key;
}

absl::StatusOr<DeploymentKey> LoadKeyFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open the deployment secret ", path));
  struct stat st {};
  std::string text;
  absl::Status bad;
  if (fstat(fd, &st) != 0) {
    bad = ErrnoToStatus(errno, absl::StrCat("stat the deployment secret ", path));
  } else if (!S_ISREG(st.st_mode)) {
    bad = absl::InvalidArgumentError(absl::StrCat("the deployment secret ", path, " is not a regular file"));
  } else if (st.st_uid != geteuid()) {
    bad = absl::PermissionDeniedError(absl::StrCat("the deployment secret ", path, " is owned by uid ",
                                                   st.st_uid, ", not by this user (uid ", geteuid(), ")"));
  } else if ((st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    bad = absl::PermissionDeniedError(absl::StrCat("the deployment secret ", path, " has mode ", mode,
                                                   ": it must be readable by its owner only (0600)"));
  } else {
    char buf[256];
    ssize_t n;
    while ((n = read(fd, buf, sizeof(buf))) > 0 && text.size() < 4096)
      text.append(buf, static_cast<size_t>(n));
    if (n < 0) bad = ErrnoToStatus(errno, absl::StrCat("read the deployment secret ", path));
  }
  close(fd);
  RETURN_IF_ERROR(bad);
  return ParseKey(text, path);
}

absl::StatusOr<DeploymentKey> ProcessKey() {
  ProcessKeyState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.key) {
    const char* file = std::getenv("TANDEM_SECRET_FILE");
    if (file != nullptr && *file != '\0') {
      absl::StatusOr<DeploymentKey> key = LoadKeyFile(file);
      s.key = key.ok() ? key : absl::StatusOr<DeploymentKey>(Annotate(key.status(), "TANDEM_SECRET_FILE"));
    } else {
      s.key = RandomKey();
    }
  }
  return *s.key;
}

void SetProcessKey(const DeploymentKey& key) {
  ProcessKeyState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  s.key = key;
}

absl::Status ShareNewKeyWithChildren(const std::string& path) {
  ASSIGN_OR_RETURN(const DeploymentKey key, CreateKeyFile(path));
  SetProcessKey(key);
  if (setenv("TANDEM_SECRET_FILE", path.c_str(), 1) != 0)
    return ErrnoToStatus(errno, "setenv TANDEM_SECRET_FILE");
  return absl::OkStatus();
}

}  // namespace tandem::bootstrap
