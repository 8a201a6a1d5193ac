#include "common/log.h"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "spdlog/logger.h"
#include "spdlog/sinks/stdout_sinks.h"

namespace tandem {
namespace {

constexpr char kEnvVar[] = "TANDEM_LOG_LEVEL";

// spdlog pattern: the tag is fixed per process, so it lives in the pattern ('%' escaped).
std::string PatternFor(std::string_view tag) {
  return absl::StrCat("%Y-%m-%d %H:%M:%S.%e %L [", absl::StrReplaceAll(ToAbsl(tag), {{"%", "%%"}}), "] %v");
}

// One logger for the process, never registered with spdlog's global registry (so it cannot clash
// with anyone else's) and never destroyed (so lines logged during static destruction still work).
spdlog::logger& Logger() {
  static spdlog::logger* const logger = [] {
    auto* l = new spdlog::logger("tandem", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    l->set_level(spdlog::level::trace);  // filtering is ours (log_internal::min_level)
    l->set_pattern(PatternFor("tandem"));
    return l;
  }();
  return *logger;
}

spdlog::level::level_enum ToSpdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
  }
  return spdlog::level::err;
}

std::mutex& TagMutex() {
  static std::mutex mu;
  return mu;
}
std::string& Tag() {
  static std::string tag = "tandem";
  return tag;
}

}  // namespace

std::string LogProcessTag() {
  std::lock_guard<std::mutex> lock(TagMutex());
  return Tag();
}

void InitLogging(std::string_view process_tag, LogLevel level) {
  {
    std::lock_guard<std::mutex> lock(TagMutex());
    Tag() = std::string(process_tag);
  }
  Logger().set_pattern(PatternFor(process_tag));
  const char* env = std::getenv(kEnvVar);
  std::optional<LogLevel> env_level = env != nullptr ? ParseLogLevel(env) : std::nullopt;
  log_internal::min_level.store(static_cast<int>(env_level.value_or(level)), std::memory_order_relaxed);
  if (env != nullptr && !env_level) {
    LogLine(LogLevel::kWarn, "log",
            absl::StrCat("ignoring ", kEnvVar, "='", env, "' (expected debug, info, warn or error); using ",
                         ToAbsl(LogLevelName(level))));
  }
}

std::optional<LogLevel> ParseLogLevel(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(ToAbsl(text));
  if (lower == "debug") return LogLevel::kDebug;
  if (lower == "info") return LogLevel::kInfo;
  if (lower == "warn" || lower == "warning") return LogLevel::kWarn;
  if (lower == "error") return LogLevel::kError;
  return std::nullopt;
}

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "debug";
    case LogLevel::kInfo:
      return "info";
    case LogLevel::kWarn:
      return "warn";
    case LogLevel::kError:
      return "error";
  }
  return "error";
}

void LogLine(LogLevel level, std::string_view subsystem, std::string_view message) {
  if (!LogEnabled(level)) return;
  Logger().log(ToSpdlog(level), "{}: {}", subsystem, message);
}

}  // namespace tandem
