// Errors in tandem: absl::Status / absl::StatusOr across every boundary.
//
// Canonical codes keep their written meaning:
//   InvalidArgument    the caller's input (request, config, file, frame) is wrong
//   NotFound           a named thing (file, tensor, preset, key) does not exist
//   DataLoss           a file or frame is corrupt or truncated
//   Unavailable        a peer or device is absent now; retrying may help
//   DeadlineExceeded   a wait ran past its budget
//   ResourceExhausted  back-pressure: memory, KV slots, queue space
//   Unimplemented      a feature of the input that tandem does not support
//   Internal           a bug of ours that was caught without aborting
//
// Programmer invariants abort through TANDEM_CHECK; input, config, network and peer failures
// return a Status. Foreign error codes (errno, cudaError_t, ...) become a Status at the call site,
// keeping the failing expression and file:line (see common/cuda_check.h for CUDA).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace tandem {

// Debian 12's Abseil is built with its own absl::string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0),
// which does not convert from std::string_view: pass std::string_view to absl::StrCat and friends
// through this.
inline absl::string_view ToAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Returns `status` with `context` prepended to its message ("context: message"); OK stays OK.
absl::Status Annotate(const absl::Status& status, std::string_view context);

// `status` (a failed wait or send) blamed on a peer that failed: "<who> is gone: <message>", with
// the peer's own failure `peer` in brackets unless the message already says it.
absl::Status AnnotateGone(const absl::Status& status, std::string_view who, const absl::Status& peer);

// errno value -> Status with the matching canonical code; `what` names the failed operation and
// its object, e.g. "open(/models/x/config.json)".
absl::Status ErrnoToStatus(int err, std::string_view what);

namespace internal {
[[noreturn]] void CheckFailed(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace internal

}  // namespace tandem

#define TANDEM_STATUS_CONCAT_INNER(a, b) a##b
#define TANDEM_STATUS_CONCAT(a, b) TANDEM_STATUS_CONCAT_INNER(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status tandem_status_ = (expr);          \
    if (!tandem_status_.ok()) return tandem_status_; \
  } while (0)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status, else move-assigns the value to `lhs` (which may be a declaration: `auto x`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  TANDEM_ASSIGN_OR_RETURN_IMPL(TANDEM_STATUS_CONCAT(tandem_statusor_, __LINE__), lhs, expr)
#define TANDEM_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()

// Aborts with file:line and the expression when a programmer invariant is broken. Never use it
// for input that comes from outside the process.
#define TANDEM_CHECK(cond)                                                                  \
  do {                                                                                      \
    if (!(cond)) ::tandem::internal::CheckFailed(#cond, __FILE__, __LINE__, std::string()); \
  } while (0)
#define TANDEM_CHECK_MSG(cond, ...)                                                                       \
  do {                                                                                                    \
    if (!(cond)) ::tandem::internal::CheckFailed(#cond, __FILE__, __LINE__, ::absl::StrCat(__VA_ARGS__)); \
  } while (0)
