#include "deploy/ssh_launcher.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace tandem {
namespace {

// 'text' for a POSIX shell (a ' inside becomes '\'').
std::string ShellQuote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Reads from stdin until `n` bytes have come or the deadline passes.
absl::StatusOr<std::string> ReadExactly(size_t n, absl::Time deadline, const std::string& what) {
  std::string out;
  while (out.size() < n) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError(absl::StrCat("stdin bootstrap: no ", what, " in time"));
    pollfd p{STDIN_FILENO, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000))) <= 0) continue;
    char buf[4096];
    const ssize_t got = read(STDIN_FILENO, buf, std::min(sizeof(buf), n - out.size()));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      return absl::InvalidArgumentError(absl::StrCat("stdin bootstrap: stdin ended before the ", what));
    out.append(buf, static_cast<size_t>(got));
  }
  return out;
}

// One line (without its newline), read byte by byte so that nothing after it is consumed.
absl::StatusOr<std::string> ReadLine(absl::Time deadline, const std::string& what) {
  std::string line;
  while (line.size() < 256) {
    ASSIGN_OR_RETURN(std::string c, ReadExactly(1, deadline, what));
    if (c[0] == '\n') return line;
    line += c;
  }
  return absl::InvalidArgumentError(absl::StrCat("stdin bootstrap: the ", what, " line is too long"));
}

}  // namespace

std::vector<std::string> SshArgv(const std::string& ssh_command, const std::string& host,
                                 const std::vector<std::string>& remote_argv) {
  std::vector<std::string> argv = absl::StrSplit(ssh_command, ' ', absl::SkipEmpty());
  if (argv.empty()) argv.push_back("ssh");
  // The launcher executes a path (ProcessGroup does not search PATH): find the client here.
  if (argv[0].find('/') == std::string::npos) {
    const char* path = std::getenv("PATH");
    for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
      const std::string candidate = absl::StrCat(dir, "/", argv[0]);
      if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) {
        argv[0] = candidate;
        break;
      }
    }
  }
  argv.push_back("-T");
  argv.push_back(host);
  std::vector<std::string> quoted;
  for (const std::string& a : remote_argv) quoted.push_back(ShellQuote(a));
  argv.push_back(absl::StrCat("exec ", absl::StrJoin(quoted, " ")));
  return argv;
}

std::string ShellCommandLine(const std::vector<std::string>& argv) {
  std::vector<std::string> words;
  for (const std::string& a : argv) {
    const bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](unsigned char c) {
      return absl::ascii_isalnum(c) ||
             absl::string_view("_@%+=:,./-").find(static_cast<char>(c)) != absl::string_view::npos;
    });
    words.push_back(plain ? a : ShellQuote(a));
  }
  return absl::StrJoin(words, " ");
}

std::string StdinBootstrap(const bootstrap::DeploymentKey& key, const std::string& config_yaml) {
  return absl::StrCat("tandem-bootstrap 1\nsecret ", bootstrap::FormatKey(key), "config ", config_yaml.size(),
                      "\n", config_yaml);
}

absl::StatusOr<std::string> ReadStdinBootstrap(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ASSIGN_OR_RETURN(const std::string version, ReadLine(deadline, "version"));
  if (version != "tandem-bootstrap 1") {
    return absl::InvalidArgumentError("stdin bootstrap: expected \"tandem-bootstrap 1\" first");
  }
  ASSIGN_OR_RETURN(const std::string secret, ReadLine(deadline, "secret"));
  if (secret.rfind("secret ", 0) != 0)
    return absl::InvalidArgumentError("stdin bootstrap: expected the secret");
  ASSIGN_OR_RETURN(const bootstrap::DeploymentKey key,
                   bootstrap::ParseKey(secret.substr(7), "stdin bootstrap"));
  ASSIGN_OR_RETURN(const std::string size_line, ReadLine(deadline, "config size"));
  size_t size = 0;
  if (size_line.rfind("config ", 0) != 0 || !absl::SimpleAtoi(size_line.substr(7), &size) ||
      size > (1 << 20)) {
    return absl::InvalidArgumentError("stdin bootstrap: expected \"config <bytes>\" (at most 1 MiB)");
  }
  ASSIGN_OR_RETURN(std::string yaml, ReadExactly(size, deadline, "config"));
  bootstrap::SetProcessKey(key);
  return yaml;
}

void WatchStdinForLauncher() {
  std::thread([] {
    char buf[256];
    while (true) {
      const ssize_t n = read(STDIN_FILENO, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
    }
    std::fprintf(stderr, "stdin closed: the launcher or its ssh session is gone; stopping\n");
    kill(getpid(), SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(absl::ToInt64Milliseconds(kOrphanGrace)));
    std::fprintf(stderr, "still running %lld s after the launcher went; exiting\n",
                 static_cast<long long>(absl::ToInt64Seconds(kOrphanGrace)));
    _exit(3);
  }).detach();
}

}  // namespace tandem
