#include "common/status.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/match.h"

namespace tandem {

absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(ToAbsl(context), ": ", status.message()));
}

absl::Status AnnotateGone(const absl::Status& status, std::string_view who, const absl::Status& peer) {
  if (status.ok()) return status;
  const bool said = peer.ok() || absl::StrContains(status.message(), peer.message());
  return Annotate(status,
                  absl::StrCat(ToAbsl(who), " is gone", said ? "" : absl::StrCat(" (", peer.message(), ")")));
}

absl::Status ErrnoToStatus(int err, std::string_view what) {
  std::string msg = absl::StrCat(ToAbsl(what), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(msg);
    case EINVAL:
    case EISDIR:
      return absl::InvalidArgumentError(msg);
    case EAGAIN:
    case EINTR:
    case ECONNREFUSED:
    case ECONNRESET:
      return absl::UnavailableError(msg);
    case ETIMEDOUT:
      return absl::DeadlineExceededError(msg);
    default:
      return absl::UnknownError(msg);
  }
}

namespace internal {
void CheckFailed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "tandem: CHECK failed at %s:%d: %s%s%s\n", file, line, expr, msg.empty() ? "" : ": ",
               msg.c_str());
  std::fflush(stderr);
  std::abort();
}
}  // namespace internal

}  // namespace tandem
