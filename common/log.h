// Process-wide logging. Every line carries a timestamp, the level, the process tag (which process
// of a deployment wrote it: "compute:0", "memory:1", "generate") and the subsystem:
//
//   2025-01-02 03:04:05.678 I [compute:0] scheduler: admitted 3 requests
//
// Lines go to stderr, one write per line, flushed. Levels: debug < info < warn < error; a line is
// written when its level is at least the threshold. The threshold is warn until InitLogging sets
// it; the environment variable TANDEM_LOG_LEVEL ("debug", "info", "warn", "error"), read by
// InitLogging, overrides the level its caller passes.
//
// Use the macros; their arguments are absl::StrCat arguments and are not evaluated when the level
// is filtered out (the check is one relaxed atomic load):
//
//   TANDEM_LOG_INFO("scheduler", "admitted ", n, " requests");
//
// Log an error once, where it is found (STYLE.md, "Errors"); callers add context to the Status.
//
// Thread safety: every function here may be called from any thread at any time, including before
// InitLogging (lines then carry the tag "tandem").
//
// The implementation uses spdlog; it stays an implementation detail of log.cc.
#pragma once

#include <atomic>
#include <optional>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"

namespace tandem {

enum class LogLevel { kDebug, kInfo, kWarn, kError };

// Configures the process-wide log: sets the process tag and the threshold (`level`, unless
// TANDEM_LOG_LEVEL names a valid level; an invalid TANDEM_LOG_LEVEL is reported with a warning
// and ignored). Idempotent: calling it again only replaces the tag and the threshold.
void InitLogging(std::string_view process_tag, LogLevel level);

// The process tag InitLogging last set ("memory:1"), or "tandem" before it was called.
std::string LogProcessTag();

// "debug", "info", "warn" (or "warning"), "error", in any letter case; nullopt otherwise.
std::optional<LogLevel> ParseLogLevel(std::string_view text);

// The lower-case name ParseLogLevel accepts, e.g. "warn".
std::string_view LogLevelName(LogLevel level);

// Writes one line if `level` passes the threshold. `subsystem` names the part of the program
// ("scheduler", "kv", "transport"); `message` has no trailing newline.
void LogLine(LogLevel level, std::string_view subsystem, std::string_view message);

namespace log_internal {
// The threshold as an int; written by InitLogging, read by LogEnabled.
inline std::atomic<int> min_level{static_cast<int>(LogLevel::kWarn)};
}  // namespace log_internal

// Whether a line of `level` would be written now.
inline bool LogEnabled(LogLevel level) {
  return static_cast<int>(level) >= log_internal::min_level.load(std::memory_order_relaxed);
}

}  // namespace tandem

#define TANDEM_LOG_AT(level, subsystem, ...)                                                           \
  do {                                                                                                 \
    if (::tandem::LogEnabled(level)) ::tandem::LogLine(level, subsystem, ::absl::StrCat(__VA_ARGS__)); \
  } while (0)

#define TANDEM_LOG_DEBUG(subsystem, ...) TANDEM_LOG_AT(::tandem::LogLevel::kDebug, subsystem, __VA_ARGS__)
#define TANDEM_LOG_INFO(subsystem, ...) TANDEM_LOG_AT(::tandem::LogLevel::kInfo, subsystem, __VA_ARGS__)
#define TANDEM_LOG_WARN(subsystem, ...) TANDEM_LOG_AT(::tandem::LogLevel::kWarn, subsystem, __VA_ARGS__)
#define TANDEM_LOG_ERROR(subsystem, ...) TANDEM_LOG_AT(::tandem::LogLevel::kError, subsystem, __VA_ARGS__)
