// Tests of deploy/process_group.h with real processes (/bin/sh, /bin/sleep).
#include "deploy/process_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "deploy/ssh_launcher.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

::testing::AssertionResult Contains(const char* haystack_expr, const char* needle_expr,
                                    const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << haystack_expr << " does not contain " << needle_expr
                                       << "\n  haystack: " << haystack << "\n  needle: " << needle;
}
#define EXPECT_CONTAINS(haystack, needle) EXPECT_PRED_FORMAT2(Contains, haystack, needle)

std::vector<std::string> Sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A script fragment that writes `content` to `path` the way WriteFileAtomic does (rename).
std::string AtomicWrite(const std::string& path, const std::string& content) {
  return absl::StrCat("printf '", content, "' > '", path, ".tmp'; mv '", path, ".tmp' '", path, "'");
}

// True once `pid` (our own child, already reaped) no longer exists at all.
bool Gone(pid_t pid) { return kill(pid, 0) == -1 && errno == ESRCH; }

// True once `pid` (not our child) is dead: no such process, or a zombie its new parent has not
// reaped yet.
bool DeadOrZombie(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  if (!in) return true;
  std::string stat;
  std::getline(in, stat);
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || (paren + 2 < stat.size() && stat[paren + 2] == 'Z');
}

// Runs `fn` in a forked process (for process-wide state such as signal handlers, or to die
// without cleanup) and returns what it returned.
std::string RunInSubprocess(const std::function<std::string()>& fn) {
  int fds[2];
  if (pipe(fds) != 0) return "pipe failed";
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    const std::string result = fn();
    size_t done = 0;
    while (done < result.size()) {
      const ssize_t n = write(fds[1], result.data() + done, result.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[1024];
  ssize_t n;
  while ((n = read(fds[0], buf, sizeof(buf))) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) out.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    out += absl::StrCat(" [subprocess status ", status, "]");
  return out;
}

class ProcessGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = "/tmp/tandem_pg_test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }
  std::string Log(const std::string& name) const { return absl::StrCat(dir_, "/logs/", name, ".log"); }

  std::string dir_;
};

TEST_F(ProcessGroupTest, WaitExitSucceedsOnStatusZero) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("a", Sh("echo hello-out; echo hello-err >&2; exit 0"), Log("a")).ok());
  EXPECT_GT(g.pid("a"), 0);
  EXPECT_TRUE(g.WaitExit("a").ok());
  EXPECT_FALSE(g.running("a"));
  const std::string log = ReadFile(Log("a"));
  EXPECT_CONTAINS(log, "hello-out");
  EXPECT_CONTAINS(log, "hello-err");
}

TEST_F(ProcessGroupTest, WaitExitReportsStatusAndLogTail) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("memory-1", Sh("echo first-line; echo boom-line; exit 3"), Log("memory-1")).ok());
  const pid_t pid = g.pid("memory-1");
  const absl::Status s = g.WaitExit("memory-1");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  const std::string msg(s.message());
  EXPECT_CONTAINS(msg, absl::StrCat("memory-1 (pid ", pid, ") exited with status 3"));
  EXPECT_CONTAINS(msg, absl::StrCat("last lines of ", Log("memory-1"), ":\nfirst-line\nboom-line"));
}

TEST_F(ProcessGroupTest, WaitExitOfSeveralInTurn) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("a", Sh("exit 0"), Log("a")).ok());
  ASSERT_TRUE(g.Start("b", Sh("sleep 0.2; exit 0"), Log("b")).ok());
  EXPECT_TRUE(g.WaitExit("a").ok());
  EXPECT_TRUE(g.WaitExit("b").ok());
  EXPECT_TRUE(g.WaitExit("a").ok());  // asking again returns the same answer
}

TEST_F(ProcessGroupTest, WaitExitReportsAnotherProcessThatDiesFirst) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("compute", {"/bin/sleep", "100"}, Log("compute")).ok());
  ASSERT_TRUE(g.Start("memory-0", Sh("sleep 0.1; echo out-of-memory; exit 7"), Log("memory-0")).ok());
  const absl::Status s = g.WaitExit("compute");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  const std::string msg(s.message());
  EXPECT_CONTAINS(msg, absl::StrCat("memory-0 (pid ", g.pid("memory-0"), ") exited with status 7"));
  EXPECT_CONTAINS(msg, "out-of-memory");
  EXPECT_TRUE(g.running("compute"));
}

TEST_F(ProcessGroupTest, WaitExitToleratesAnotherCleanExit) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("compute", Sh("sleep 0.3; exit 0"), Log("compute")).ok());
  ASSERT_TRUE(g.Start("memory-0", Sh("exit 0"), Log("memory-0")).ok());
  EXPECT_TRUE(g.WaitExit("compute").ok());
  EXPECT_TRUE(g.WaitExit("memory-0").ok());
}

// Tolerate with restarts: a tolerated process that dies is started again (its restart command,
// the same log), up to the limit; past it the failure is reported and the group goes on. A clean
// exit is not restarted.
TEST_F(ProcessGroupTest, ToleratedProcessIsRestartedUpToTheLimit) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("compute", {"/bin/sleep", "100"}, Log("compute")).ok());
  ASSERT_TRUE(g.Start("memory-1", Sh("echo first; kill -9 $$"), Log("memory-1")).ok());
  g.Tolerate("memory-1", 2, Sh("echo again; exit 3"), "compute");
  // compute runs on: the waits return only at their deadline, meanwhile memory-1 runs 3 times.
  const absl::Status s = g.WaitExit("compute", absl::Seconds(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_FALSE(g.running("memory-1"));
  EXPECT_EQ(ReadFile(Log("memory-1")), "first\nagain\nagain\n");
  ASSERT_TRUE(g.Start("memory-2", Sh("exit 0"), Log("memory-2")).ok());
  g.Tolerate("memory-2", 2, Sh("echo restarted"), "compute");
  EXPECT_EQ(g.WaitExit("compute", absl::Seconds(1)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(ReadFile(Log("memory-2")), "");  // a clean exit: not restarted
}

// No restart while the process that the rank serves is stopped (SIGSTOP): it would only wait for it.
// Nor is the failure tolerated then: the rank gave the stopped process up, and the wait returns it.
TEST_F(ProcessGroupTest, NoRestartWhileTheServedProcessIsStopped) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("compute", {"/bin/sleep", "100"}, Log("compute")).ok());
  ASSERT_TRUE(kill(g.pid("compute"), SIGSTOP) == 0);
  ASSERT_TRUE(g.Start("memory-0", Sh("sleep 0.3; echo left; exit 1"), Log("memory-0")).ok());
  g.Tolerate("memory-0", 3, {}, "compute");
  const absl::Status waited = g.WaitExit("compute", absl::Seconds(1.5));
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
  EXPECT_CONTAINS(std::string(waited.message()), "memory-0");
  EXPECT_FALSE(g.running("memory-0"));
  EXPECT_EQ(ReadFile(Log("memory-0")), "left\n");
  kill(g.pid("compute"), SIGCONT);
}

// The command line the launcher prints for starting a rank by hand: plain words as they are, the rest
// quoted, and a shell reads back the same words.
TEST_F(ProcessGroupTest, ShellCommandLineIsReadBackByAShell) {
  const std::vector<std::string> words = {
      "/opt/tandem/bin/tandem",  "memory", "--listen", "127.0.0.1:40123", "--config",
      "/runs/run 1/deploy.yaml", "it's",   "",         "$HOME",           "a\nb"};
  const std::string line = ShellCommandLine(words);
  EXPECT_EQ(line,
            "/opt/tandem/bin/tandem memory --listen 127.0.0.1:40123 --config '/runs/run 1/deploy.yaml' "
            "'it'\\''s' '' '$HOME' 'a\nb'");
  ProcessGroup g;
  ASSERT_TRUE(g.Start("sh", Sh("printf '%s|' " + line), Log("sh")).ok());
  ASSERT_TRUE(g.WaitExit("sh").ok());
  std::string want;
  for (const std::string& w : words) want += w + "|";
  EXPECT_EQ(ReadFile(Log("sh")), want);
}

TEST_F(ProcessGroupTest, KilledBySignalIsNamed) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("victim", Sh("echo before-death; kill -9 $$"), Log("victim")).ok());
  const absl::Status s = g.WaitExit("victim");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_CONTAINS(std::string(s.message()), "was killed by signal 9 (Killed)");
  EXPECT_CONTAINS(std::string(s.message()), "before-death");
}

TEST_F(ProcessGroupTest, WaitAnyReportsEvenStatusZero) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("server", {"/bin/sleep", "100"}, Log("server")).ok());
  ASSERT_TRUE(g.Start("quitter", Sh("sleep 0.1"), Log("quitter")).ok());
  const absl::Status s = g.WaitAny();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_CONTAINS(std::string(s.message()), "quitter (pid");
  EXPECT_CONTAINS(std::string(s.message()), "exited with status 0");
  EXPECT_CONTAINS(std::string(s.message()), absl::StrCat("its log ", Log("quitter"), " is empty"));
  EXPECT_TRUE(g.StopAll(absl::Seconds(2)).empty());
  EXPECT_EQ(g.WaitAny().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ProcessGroupTest, WaitReadyReturnsTheContent) {
  ProcessGroup g;
  const std::string ready = Path("memory-0.ready");
  ASSERT_TRUE(g.Start("memory-0",
                      Sh(absl::StrCat("sleep 0.3; ", AtomicWrite(ready, "ucx://addr-1"), "; exec sleep 100")),
                      Log("memory-0"))
                  .ok());
  const absl::StatusOr<std::string> content = g.WaitReady("memory-0", ready, absl::Seconds(10));
  ASSERT_TRUE(content.ok()) << content.status();
  EXPECT_EQ(*content, "ucx://addr-1");
  EXPECT_TRUE(g.running("memory-0"));
}

TEST_F(ProcessGroupTest, WaitReadyFailsWhenTheProcessExitsFirst) {
  ProcessGroup g;
  const std::string ready = Path("memory-0.ready");
  ASSERT_TRUE(g.Start("memory-0", Sh("echo cannot-bind; exit 5"), Log("memory-0")).ok());
  const absl::StatusOr<std::string> content = g.WaitReady("memory-0", ready, absl::Seconds(10));
  EXPECT_EQ(content.status().code(), absl::StatusCode::kUnavailable) << content.status();
  const std::string msg(content.status().message());
  EXPECT_CONTAINS(msg, "memory-0 (pid");
  EXPECT_CONTAINS(msg, "exited with status 5 before writing its ready file");
  EXPECT_CONTAINS(msg, ready);
  EXPECT_CONTAINS(msg, "cannot-bind");
}

TEST_F(ProcessGroupTest, WaitReadyFailsWhenAnotherProcessExits) {
  ProcessGroup g;
  ASSERT_TRUE(g.Start("memory-0", {"/bin/sleep", "100"}, Log("memory-0")).ok());
  ASSERT_TRUE(g.Start("memory-1", Sh("sleep 0.1; exit 4"), Log("memory-1")).ok());
  const absl::StatusOr<std::string> content = g.WaitReady("memory-0", Path("never"), absl::Seconds(10));
  EXPECT_EQ(content.status().code(), absl::StatusCode::kUnavailable) << content.status();
  EXPECT_CONTAINS(std::string(content.status().message()), "memory-1 (pid");
  EXPECT_CONTAINS(std::string(content.status().message()), "exited with status 4");
}

TEST_F(ProcessGroupTest, WaitReadyTimesOut) {
  ProcessGroup g;
  const std::string ready = Path("memory-0.ready");
  ASSERT_TRUE(g.Start("memory-0", Sh("echo still-loading; exec sleep 100"), Log("memory-0")).ok());
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::string> content = g.WaitReady("memory-0", ready, absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(content.status().code(), absl::StatusCode::kDeadlineExceeded) << content.status();
  const std::string msg(content.status().message());
  EXPECT_CONTAINS(msg, absl::StrCat("memory-0 (pid ", g.pid("memory-0"), ")"));
  EXPECT_CONTAINS(msg, ready);
  EXPECT_CONTAINS(msg, "still-loading");
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(3));
}

TEST_F(ProcessGroupTest, StopAllKillsWhatIgnoresSigterm) {
  ProcessGroup g;
  const std::string ready = Path("stubborn.ready");
  ASSERT_TRUE(g.Start("stubborn",
                      Sh(absl::StrCat("trap '' TERM; ", AtomicWrite(ready, "x"), "; exec sleep 100")),
                      Log("s"))
                  .ok());
  ASSERT_TRUE(g.Start("polite", {"/bin/sleep", "100"}, Log("p")).ok());
  ASSERT_TRUE(g.WaitReady("stubborn", ready, absl::Seconds(10)).ok());  // the trap is in place
  const pid_t stubborn = g.pid("stubborn");
  const pid_t polite = g.pid("polite");

  const absl::Time start = absl::Now();
  const std::vector<std::string> killed = g.StopAll(absl::Milliseconds(300));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(killed, std::vector<std::string>{"stubborn"});
  EXPECT_GE(took, absl::Milliseconds(300));
  EXPECT_LT(took, absl::Seconds(3));
  EXPECT_FALSE(g.running("stubborn"));
  EXPECT_FALSE(g.running("polite"));
  // Reaped: not even a zombie is left.
  EXPECT_TRUE(Gone(stubborn));
  EXPECT_TRUE(Gone(polite));
  EXPECT_TRUE(g.StopAll(absl::Seconds(1)).empty());  // idempotent
}

TEST_F(ProcessGroupTest, DestructorStopsChildren) {
  pid_t pid = 0;
  {
    ProcessGroup g;
    ASSERT_TRUE(g.Start("sleeper", {"/bin/sleep", "100"}, Log("sleeper")).ok());
    pid = g.pid("sleeper");
  }
  EXPECT_TRUE(Gone(pid));
}

TEST_F(ProcessGroupTest, ExecFailureIsReportedByStart) {
  ProcessGroup g;
  const absl::Status s = g.Start("memory-0", {"/nonexistent/tandem-rank"}, Log("memory-0"));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_EQ(s.message(), "memory-0: cannot execute /nonexistent/tandem-rank: No such file or directory");
  EXPECT_EQ(g.pid("memory-0"), 0);

  const std::string not_executable = Path("data.txt");
  std::ofstream(not_executable) << "not a program\n";
  const absl::Status s2 = g.Start("memory-1", {not_executable}, Log("memory-1"));
  EXPECT_EQ(s2.code(), absl::StatusCode::kPermissionDenied) << s2;
  EXPECT_CONTAINS(std::string(s2.message()), absl::StrCat("memory-1: cannot execute ", not_executable));

  // The failed name is free again.
  EXPECT_TRUE(g.Start("memory-0", Sh("exit 0"), Log("memory-0")).ok());
  EXPECT_TRUE(g.WaitExit("memory-0").ok());
}

TEST_F(ProcessGroupTest, BadArguments) {
  ProcessGroup g;
  EXPECT_EQ(g.Start("a", {}, Log("a")).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(g.Start("a", Sh("exit 0"), Log("a")).ok());
  const absl::Status dup = g.Start("a", Sh("exit 0"), Log("a2"));
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(std::string(dup.message()), "a");
  EXPECT_EQ(g.WaitExit("nobody").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.WaitReady("nobody", Path("r"), absl::Seconds(1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.pid("nobody"), 0);
  EXPECT_FALSE(g.running("nobody"));
  EXPECT_EQ(g.LogTail("nobody"), "");
}

TEST_F(ProcessGroupTest, ChildEnvironment) {
  // A descriptor the launcher leaks (no O_CLOEXEC), a blocked and an ignored signal: the child
  // must see none of them.
  const int leaked = open("/dev/null", O_RDONLY);
  ASSERT_GE(leaked, 0);
  sigset_t usr1;
  sigset_t old_mask;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  ASSERT_EQ(sigprocmask(SIG_BLOCK, &usr1, &old_mask), 0);
  void (*old_usr2)(int) = signal(SIGUSR2, SIG_IGN);

  ProcessGroup g;
  const absl::Status started = g.Start("probe", {"/bin/sleep", "100"}, Log("probe"));
  ASSERT_TRUE(g.Start("env",
                      Sh(absl::StrCat("if [ -e /proc/self/fd/", leaked,
                                      " ]; then echo fd-leaked; else echo fd-closed; fi; "
                                      "if read line; then echo stdin-data; else echo stdin-eof; fi")),
                      Log("env"))
                  .ok());
  signal(SIGUSR2, old_usr2);
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  close(leaked);
  ASSERT_TRUE(started.ok()) << started;

  const std::string status = ReadFile(absl::StrCat("/proc/", g.pid("probe"), "/status"));
  EXPECT_CONTAINS(status, "SigBlk:\t0000000000000000");
  EXPECT_CONTAINS(status, "SigIgn:\t0000000000000000");
  EXPECT_TRUE(g.WaitExit("env").ok());
  EXPECT_EQ(g.LogTail("env"), "fd-closed\nstdin-eof");
}

TEST_F(ProcessGroupTest, LogIsAppendedInNewDirectories) {
  const std::string log = Path("deep/er/shared.log");
  ProcessGroup g;
  ASSERT_TRUE(g.Start("one", Sh("echo from-one"), log).ok());
  ASSERT_TRUE(g.WaitExit("one").ok());
  ASSERT_TRUE(g.Start("two", Sh("echo from-two"), log).ok());
  ASSERT_TRUE(g.WaitExit("two").ok());
  EXPECT_EQ(ReadFile(log), "from-one\nfrom-two\n");
}

TEST_F(ProcessGroupTest, LogTailReadsTheEndOfALargeLog) {
  ProcessGroup g;
  ASSERT_TRUE(
      g.Start("chatty", Sh("i=0; while [ $i -lt 5000 ]; do echo line-$i; i=$((i+1)); done"), Log("chatty"))
          .ok());
  ASSERT_TRUE(g.WaitExit("chatty").ok());
  EXPECT_EQ(g.LogTail("chatty", 3), "line-4997\nline-4998\nline-4999");
  EXPECT_EQ(g.LogTail("chatty", 1), "line-4999");
  EXPECT_EQ(g.LogTail("chatty", 0), "");
  const std::string tail = g.LogTail("chatty", 2000);
  EXPECT_EQ(tail.substr(0, tail.find('\n')), "line-3000");

  ASSERT_TRUE(g.Start("short", Sh("printf 'a\\n\\nb'"), Log("short")).ok());
  ASSERT_TRUE(g.WaitExit("short").ok());
  EXPECT_EQ(g.LogTail("short", 10), "a\n\nb");
  EXPECT_EQ(g.LogTail("short", 2), "\nb");
}

TEST_F(ProcessGroupTest, TerminationSignalCancelsWaitAny) {
  const std::string log_a = Log("signaller");
  const std::string log_b = Log("worker");
  const std::string result = RunInSubprocess([&] {
    InstallTerminationSignals();
    InstallTerminationSignals();  // idempotent
    ProcessGroup g;
    // The child signals its parent (this subprocess) while it sits in WaitAny.
    if (!g.Start("signaller", Sh("sleep 0.2; kill -TERM $PPID; exec sleep 100"), log_a).ok())
      return std::string("start");
    if (!g.Start("worker", {"/bin/sleep", "100"}, log_b).ok()) return std::string("start");
    const absl::Status s = g.WaitAny();
    const absl::Status again = g.WaitExit("worker");
    const pid_t a = g.pid("signaller");
    const pid_t b = g.pid("worker");
    const std::vector<std::string> killed = g.StopAll(absl::Seconds(2));
    return absl::StrCat("code=", absl::StatusCodeToString(s.code()), " msg=", s.message(),
                        " signal=", TerminationSignal(), " again=", absl::StatusCodeToString(again.code()),
                        " killed=", killed.size(), " gone=", Gone(a) && Gone(b));
  });
  EXPECT_CONTAINS(result, "code=CANCELLED");
  EXPECT_CONTAINS(result, "interrupted by SIGTERM");
  EXPECT_CONTAINS(result, absl::StrCat("signal=", SIGTERM));
  EXPECT_CONTAINS(result, "again=CANCELLED");
  EXPECT_CONTAINS(result, "killed=0");
  EXPECT_CONTAINS(result, "gone=1");
}

TEST_F(ProcessGroupTest, SigintCancelsWaitReady) {
  const std::string log = Log("rank");
  const std::string ready = Path("rank.ready");
  const std::string result = RunInSubprocess([&] {
    InstallTerminationSignals();
    ProcessGroup g;
    if (!g.Start("rank", Sh("sleep 0.2; kill -INT $PPID; exec sleep 100"), log).ok())
      return std::string("start");
    const absl::StatusOr<std::string> s = g.WaitReady("rank", ready, absl::Seconds(20));
    return absl::StrCat("code=", absl::StatusCodeToString(s.status().code()), " msg=", s.status().message());
  });
  EXPECT_CONTAINS(result, "code=CANCELLED");
  EXPECT_CONTAINS(result, "interrupted by SIGINT");
}

// The launcher dies without cleaning up (_exit, or SIGKILL): its children must die with it.
void ExpectChildDiesWithLauncher(bool sigkill_launcher, const std::string& log) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    close(fds[0]);
    auto* g = new ProcessGroup;  // never destroyed
    pid_t child = -1;
    if (g->Start("sleeper", {"/bin/sleep", "100"}, log).ok()) child = g->pid("sleeper");
    ssize_t ignored = write(fds[1], &child, sizeof(child));
    (void)ignored;
    if (sigkill_launcher) pause();
    _exit(0);
  }
  close(fds[1]);
  pid_t child = -1;
  ASSERT_EQ(read(fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  close(fds[0]);
  if (sigkill_launcher) kill(launcher, SIGKILL);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  ASSERT_GT(child, 0);
  const absl::Time deadline = absl::Now() + absl::Seconds(2);
  while (!DeadOrZombie(child) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  const bool dead = DeadOrZombie(child);
  EXPECT_TRUE(dead) << "pid " << child << " outlived its launcher";
  if (!dead) kill(child, SIGKILL);
}

TEST_F(ProcessGroupTest, ChildDiesWhenLauncherExits) { ExpectChildDiesWithLauncher(false, Log("a")); }
TEST_F(ProcessGroupTest, ChildDiesWhenLauncherIsKilled) { ExpectChildDiesWithLauncher(true, Log("b")); }

TEST_F(ProcessGroupTest, WriteFileAtomic) {
  const std::string path = Path("memory-0.ready");
  ASSERT_TRUE(WriteFileAtomic(path, "first").ok());
  EXPECT_EQ(ReadFile(path), "first");
  ASSERT_TRUE(WriteFileAtomic(path, std::string(100000, 'x')).ok());
  EXPECT_EQ(ReadFile(path), std::string(100000, 'x'));
  ASSERT_TRUE(WriteFileAtomic(path, "").ok());
  EXPECT_EQ(ReadFile(path), "");
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir_)) ++files;
  EXPECT_EQ(files, 1);  // no temporary left behind

  const std::string bad = Path("no/such/dir/ready");
  const absl::Status s = WriteFileAtomic(bad, "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_CONTAINS(std::string(s.message()), bad);
  EXPECT_CONTAINS(std::string(s.message()), "No such file or directory");
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// A rank started over ssh (deploy/ssh_launcher.h) gets its bootstrap on stdin, reports ready on
// its output, and sees EOF on stdin once the launcher lets it go: here with /bin/sh in its place.
TEST_F(ProcessGroupTest, StdinIsHeldOpenAndTheReadyLineIsFoundInTheLog) {
  ProcessGroup group;
  const std::string script =
      "read first; echo \"starting\"; echo \"TANDEM-READY got-$first\"; cat >/dev/null; echo \"stdin "
      "closed\"; "
      "sleep 30";
  ASSERT_TRUE(group.StartWithStdin("remote", Sh(script), Log("remote"), "bootstrap-line\n").ok());
  absl::StatusOr<std::string> ready = group.WaitReadyLine("remote", "TANDEM-READY", absl::Seconds(20));
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_EQ(*ready, "got-bootstrap-line");
  // stdin stays open while the group holds the process: `cat` has not returned.
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(ReadFile(Log("remote")).find("stdin closed"), std::string::npos);
  EXPECT_TRUE(group.running("remote"));
  group.StopAll(absl::Seconds(5));
  EXPECT_FALSE(group.running("remote"));

  // A process that never prints the line: the wait names it, the marker and the log.
  ASSERT_TRUE(group.StartWithStdin("silent", Sh("cat >/dev/null"), Log("silent"), "x\n").ok());
  absl::StatusOr<std::string> none = group.WaitReadyLine("silent", "TANDEM-READY", absl::Milliseconds(300));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded) << none.status();
  EXPECT_CONTAINS(std::string(none.status().message()), "silent");
  EXPECT_CONTAINS(std::string(none.status().message()), "TANDEM-READY");
  group.StopAll(absl::Seconds(5));
}

// The launcher dying closes the stdin it held: a child that waits on it sees EOF at once.
TEST_F(ProcessGroupTest, StdinClosesWhenTheLauncherDies) {
  const std::string marker = Path("eof-seen");
  const std::string pid_file = Path("child.pid");
  RunInSubprocess([&] {
    ProcessGroup group;
    // The child outlives nothing: PR_SET_PDEATHSIG kills it with the launcher, so it writes the
    // marker from a grandchild that ignores that (a stand-in for the remote side of ssh).
    const std::string script =
        absl::StrCat("( cat >/dev/null; touch '", marker, "' ) & echo $! > '", pid_file, "'; wait");
    (void)group.StartWithStdin("remote", Sh(script), Log("remote"), "");
    for (int i = 0; i < 200 && ReadFile(pid_file).empty(); ++i) absl::SleepFor(absl::Milliseconds(10));
    _exit(0);  // the launcher dies without cleanup
    return std::string();
  });
  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    seen = std::filesystem::exists(marker);
    if (!seen) absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(seen) << "the grandchild never saw EOF on the stdin the dead launcher held";
}

}  // namespace
}  // namespace tandem
