#include "deploy/process_group.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {
namespace {

// ---- termination signals ----------------------------------------------------------------------

volatile sig_atomic_t g_termination_signal = 0;
// Written once, before the handlers are installed; read by the handler and the waits.
int g_signal_pipe[2] = {-1, -1};

// How long one wait step sleeps on the self-pipe before looking at the children again.
constexpr int kPollMs = 20;

void OnTerminationSignal(int signo) {
  const int saved_errno = errno;
  g_termination_signal = signo;
  if (g_signal_pipe[1] >= 0) {
    const unsigned char byte = static_cast<unsigned char>(signo);
    ssize_t ignored = write(g_signal_pipe[1], &byte, 1);  // a full pipe is fine: it is readable
    (void)ignored;
  }
  errno = saved_errno;
}

std::string SignalName(int signo) {
  switch (signo) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    default:
      return absl::StrCat("signal ", signo);
  }
}

absl::Status Interrupted(const std::string& waiting_for) {
  return absl::CancelledError(
      absl::StrCat(waiting_for, ": interrupted by ", SignalName(g_termination_signal)));
}

// Sleeps up to `ms` milliseconds, returning early when a termination signal arrives.
void PauseBriefly(int ms) {
  ms = std::max(ms, 0);
  if (g_signal_pipe[0] < 0) {
    poll(nullptr, 0, ms);
    return;
  }
  pollfd pfd{};
  pfd.fd = g_signal_pipe[0];
  pfd.events = POLLIN;
  if (poll(&pfd, 1, ms) > 0 && (pfd.revents & POLLIN) != 0) {
    // Drain; the flag (g_termination_signal) keeps the fact.
    unsigned char buf[64];
    while (read(g_signal_pipe[0], buf, sizeof(buf)) > 0) {
    }
  }
}

// ---- files ------------------------------------------------------------------------------------

// Owns one file descriptor.
class UniqueFd {
 public:
  explicit UniqueFd(int fd = -1) : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset(int fd = -1) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// Moves `fd` to a number above 2 (keeping O_CLOEXEC), so that the child's dup2 onto 0..2 cannot
// clobber it when the launcher itself runs with a standard stream closed.
absl::Status MoveAboveStdio(UniqueFd& fd, const std::string& what) {
  if (fd.get() > 2) return absl::OkStatus();
  const int moved = fcntl(fd.get(), F_DUPFD_CLOEXEC, 3);
  if (moved < 0) return ErrnoToStatus(errno, absl::StrCat("fcntl(F_DUPFD_CLOEXEC) of ", what));
  fd.Reset(moved);
  return absl::OkStatus();
}

// The last `n` lines of the file at `path`, without the final newline; reads at most kMaxBytes
// from the end (a longer tail starts with "[...]").
std::string ReadTail(const std::string& path, int n) {
  constexpr off_t kChunk = 8192;
  constexpr size_t kMaxBytes = 64 * 1024;
  if (n <= 0) return "";
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return "";
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return "";
  off_t pos = st.st_size;
  std::string buf;  // the bytes [pos, st_size)
  auto enough_lines = [&] {
    size_t end = buf.size();
    if (end > 0 && buf[end - 1] == '\n') --end;  // the final newline ends the last line
    // n lines need the newline that ends the line before them
    return std::count(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(end), '\n') >= n;
  };
  while (pos > 0 && buf.size() < kMaxBytes && !enough_lines()) {
    const off_t len = std::min(kChunk, pos);
    std::string chunk(static_cast<size_t>(len), '\0');
    off_t done = 0;
    while (done < len) {
      const ssize_t got =
          pread(fd.get(), chunk.data() + done, static_cast<size_t>(len - done), pos - len + done);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return "";  // truncated under us or unreadable
      done += got;
    }
    pos -= len;
    buf.insert(0, chunk);
  }
  if (!buf.empty() && buf.back() == '\n') buf.pop_back();
  int seen = 0;
  for (size_t i = buf.size(); i-- > 0;) {
    if (buf[i] == '\n' && ++seen == n) return buf.substr(i + 1);
  }
  if (pos > 0) return absl::StrCat("[...]", buf);  // ran into kMaxBytes
  return buf;
}

// ---- the child, between fork and exec (async-signal-safe calls only) ---------------------------

enum ChildStage : int { kStageSetup = 1, kStageExec = 2 };

[[noreturn]] void ChildFail(int err_fd, int stage) {
  const int msg[2] = {stage, errno};
  ssize_t ignored = write(err_fd, msg, sizeof(msg));
  (void)ignored;
  _exit(127);
}

[[noreturn]] void RunChild(char* const* argv, int stdin_fd, int log_fd, int err_fd, pid_t launcher,
                           int max_fd) {
  // Default dispositions for every signal (a handler would be reset by exec anyway; an inherited
  // SIG_IGN would not).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (int s = 1; s < NSIG; ++s) {
    if (s != SIGKILL && s != SIGSTOP) sigaction(s, &dfl, nullptr);  // EINVAL for reserved ones
  }
  // Die with the launcher; if it died already (we were reparented), stop here.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) ChildFail(err_fd, kStageSetup);
  if (getppid() != launcher) _exit(127);

  if (dup2(stdin_fd, STDIN_FILENO) < 0 || dup2(log_fd, STDOUT_FILENO) < 0 ||
      dup2(log_fd, STDERR_FILENO) < 0) {
    ChildFail(err_fd, kStageSetup);
  }
  // Close everything else but the error pipe (which is O_CLOEXEC: exec closes it).
  const unsigned err = static_cast<unsigned>(err_fd);
  bool closed = true;
  if (err > 3 && close_range(3, err - 1, 0) != 0) closed = false;
  if (closed && close_range(err + 1, ~0U, 0) != 0) closed = false;
  if (!closed) {  // kernels before 5.9
    for (int fd = 3; fd < max_fd; ++fd) {
      if (fd != err_fd) close(fd);
    }
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);

  execv(argv[0], argv);
  ChildFail(err_fd, kStageExec);
}

}  // namespace

// ---- free functions ---------------------------------------------------------------------------

void InstallTerminationSignals() {
  static bool installed = false;
  if (installed) return;
  int fds[2];
  TANDEM_CHECK_MSG(pipe2(fds, O_NONBLOCK | O_CLOEXEC) == 0, "pipe2: ", std::strerror(errno));
  g_signal_pipe[0] = fds[0];
  g_signal_pipe[1] = fds[1];
  struct sigaction sa {};
  sa.sa_handler = OnTerminationSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  TANDEM_CHECK(sigaction(SIGINT, &sa, nullptr) == 0);
  TANDEM_CHECK(sigaction(SIGTERM, &sa, nullptr) == 0);
  installed = true;
}

int TerminationSignal() { return g_termination_signal; }

absl::Status WriteFileAtomic(const std::string& path, const std::string& content) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const std::string what = absl::StrCat("write ", path);
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(errno, absl::StrCat(what, ": open ", tmp));
  auto fail = [&](const char* op) {
    const int err = errno;
    fd.Reset();
    unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat(what, ": ", op, " ", tmp));
  };
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = write(fd.get(), content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("write");
    done += static_cast<size_t>(n);
  }
  if (fsync(fd.get()) != 0) return fail("fsync");
  fd.Reset();  // close errors after a successful fsync carry nothing new
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return ErrnoToStatus(err, absl::StrCat(what, ": rename ", tmp));
  }
  return absl::OkStatus();
}

// ---- ProcessGroup -----------------------------------------------------------------------------

ProcessGroup::~ProcessGroup() {
  if (std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; })) {
    StopAll(absl::Seconds(5));
  }
}

ProcessGroup::Child* ProcessGroup::Find(const std::string& name) {
  for (Child& c : children_) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

const ProcessGroup::Child* ProcessGroup::Find(const std::string& name) const {
  for (const Child& c : children_) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

absl::Status ProcessGroup::Start(const std::string& name, const std::vector<std::string>& argv,
                                 const std::string& log_path) {
  return StartImpl(name, argv, log_path, nullptr);
}

absl::Status ProcessGroup::StartWithStdin(const std::string& name, const std::vector<std::string>& argv,
                                          const std::string& log_path, const std::string& stdin_data) {
  if (stdin_data.size() > 60 * 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", stdin_data.size(), " bytes for stdin (at most 60 KiB)"));
  }
  return StartImpl(name, argv, log_path, &stdin_data);
}

absl::Status ProcessGroup::StartImpl(const std::string& name, const std::vector<std::string>& argv,
                                     const std::string& log_path, const std::string* stdin_data) {
  if (name.empty()) return absl::InvalidArgumentError("a process needs a name");
  if (argv.empty() || argv[0].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": empty command line"));
  }
  if (Find(name) != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("two processes are named ", name));
  }
  int stdin_fd = -1;
  ASSIGN_OR_RETURN(const pid_t pid, Spawn(name, argv, log_path, stdin_data, &stdin_fd));
  Child child;
  child.name = name;
  child.pid = pid;
  child.log_path = log_path;
  child.running = true;
  child.stdin_fd = stdin_fd;  // closed when the child is reaped
  child.argv = argv;
  if (stdin_data != nullptr) child.stdin_data = *stdin_data;
  children_.push_back(std::move(child));
  return absl::OkStatus();
}

absl::StatusOr<pid_t> ProcessGroup::Spawn(const std::string& name, const std::vector<std::string>& argv,
                                          const std::string& log_path, const std::string* stdin_data,
                                          int* stdin_fd) {
  const std::filesystem::path dir = std::filesystem::path(log_path).parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return ErrnoToStatus(ec.value(), absl::StrCat(name, ": create directory ", dir.string()));
  }
  UniqueFd log_fd(open(log_path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
  if (log_fd.get() < 0) return ErrnoToStatus(errno, absl::StrCat(name, ": open log ", log_path));
  RETURN_IF_ERROR(MoveAboveStdio(log_fd, log_path));
  UniqueFd null_fd;
  UniqueFd stdin_write;
  if (stdin_data == nullptr) {
    null_fd.Reset(open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (null_fd.get() < 0) return ErrnoToStatus(errno, absl::StrCat(name, ": open /dev/null"));
  } else {
    // Both ends O_CLOEXEC: no other child inherits the write end (its EOF is the signal).
    int in_fds[2];
    if (pipe2(in_fds, O_CLOEXEC) != 0) return ErrnoToStatus(errno, absl::StrCat(name, ": pipe2 for stdin"));
    null_fd.Reset(in_fds[0]);
    stdin_write.Reset(in_fds[1]);
    RETURN_IF_ERROR(MoveAboveStdio(stdin_write, "a pipe"));
    // The data fits in the pipe's buffer (64 KiB): this does not block.
    size_t done = 0;
    while (done < stdin_data->size()) {
      const ssize_t n = write(stdin_write.get(), stdin_data->data() + done, stdin_data->size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoToStatus(errno, absl::StrCat(name, ": write its stdin"));
      done += static_cast<size_t>(n);
    }
  }
  RETURN_IF_ERROR(MoveAboveStdio(null_fd, "stdin"));
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return ErrnoToStatus(errno, absl::StrCat(name, ": pipe2"));
  UniqueFd err_read(pipe_fds[0]);
  UniqueFd err_write(pipe_fds[1]);
  RETURN_IF_ERROR(MoveAboveStdio(err_write, "a pipe"));

  // Everything the child needs, prepared before fork (the child may not allocate).
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  int max_fd = 1024;
  if (rlimit rl{}; getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    max_fd = static_cast<int>(std::min<rlim_t>(rl.rlim_cur, 1 << 20));
  }
  const pid_t launcher = getpid();

  // Block signals across fork so that the child never runs the launcher's handlers (which would
  // write to the launcher's self-pipe) before it resets them.
  sigset_t all;
  sigset_t old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t pid = fork();
  if (pid == 0) RunChild(cargv.data(), null_fd.get(), log_fd.get(), err_write.get(), launcher, max_fd);
  const int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) return ErrnoToStatus(fork_errno, absl::StrCat(name, ": fork"));
  err_write.Reset();

  // EOF: exec succeeded (the pipe closed with it). A message: the child failed and exited.
  int msg[2] = {0, 0};
  ssize_t got;
  do {
    got = read(err_read.get(), msg, sizeof(msg));
  } while (got < 0 && errno == EINTR);
  if (got > 0) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (msg[0] == kStageExec) return ErrnoToStatus(msg[1], absl::StrCat(name, ": cannot execute ", argv[0]));
    return ErrnoToStatus(msg[1], absl::StrCat(name, ": cannot set up the process for ", argv[0]));
  }

  if (stdin_write.get() >= 0) *stdin_fd = stdin_write.Release();
  return pid;
}

namespace {
// Whether process `pid` is stopped (SIGSTOP, or traced): its state in /proc/<pid>/stat.
bool ProcessStopped(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces and parentheses
  return paren != std::string::npos && paren + 2 < stat.size() &&
         (stat[paren + 2] == 'T' || stat[paren + 2] == 't');
}
}  // namespace

bool ProcessGroup::ServedStopped(const Child& child) const {
  if (child.serves.empty()) return false;
  const Child* served = Find(child.serves);
  return served != nullptr && served->running && ProcessStopped(served->pid);
}

bool ProcessGroup::RestartIfAllowed(Child& child) {
  if (child.restarts_left <= 0) return false;
  if (!child.serves.empty()) {
    // A rank that left because the process it serves went silent (stopped) or away would only
    // wait for it again.
    const Child* served = Find(child.serves);
    if (served == nullptr || !served->running || ProcessStopped(served->pid)) {
      std::fprintf(stderr, "tandem launch: %s; not restarted (%s is %s); the deployment goes on without it\n",
                   DescribeExit(child, "").c_str(), child.serves.c_str(),
                   served == nullptr || !served->running ? "not running" : "stopped");
      return true;
    }
  }
  --child.restarts_left;
  ++child.restarts;
  std::fprintf(stderr, "tandem launch: %s; restarting it (restart %d of %d)\n",
               DescribeExit(child, "").c_str(), child.restarts, child.restarts + child.restarts_left);
  const std::vector<std::string>& argv = child.restart_argv.empty() ? child.argv : child.restart_argv;
  int stdin_fd = -1;
  absl::StatusOr<pid_t> pid =
      Spawn(child.name, argv, child.log_path, child.stdin_data ? &*child.stdin_data : nullptr, &stdin_fd);
  if (!pid.ok()) {
    std::fprintf(stderr, "tandem launch: %s could not be restarted: %s; the deployment goes on without it\n",
                 child.name.c_str(), std::string(pid.status().message()).c_str());
    return true;
  }
  child.pid = *pid;
  child.running = true;
  child.wait_status = 0;
  child.reported = false;
  child.stdin_fd = stdin_fd;
  std::fprintf(stderr, "tandem launch: %s restarted (pid %d)\n", child.name.c_str(), static_cast<int>(*pid));
  return true;
}

void ProcessGroup::ReapRunning() {
  for (Child& c : children_) {
    if (!c.running) continue;
    int status = 0;
    const pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      c.running = false;
      c.wait_status = status;
    } else if (r < 0 && errno == ECHILD) {  // reaped by someone else (SIGCHLD ignored?)
      c.running = false;
      c.wait_status = -1;
    }
    if (!c.running && c.stdin_fd >= 0) {
      close(c.stdin_fd);
      c.stdin_fd = -1;
    }
  }
}

ProcessGroup::Child* ProcessGroup::FirstUnreportedExit() {
  // Exits found by one poll are in start order, not in the order they happened. A process killed
  // by a signal is more likely the cause than one that exited with a status (its peers see it
  // vanish and exit naming it), so it is reported first.
  Child* first = nullptr;
  for (Child& c : children_) {
    if (c.running || c.reported) continue;
    if (c.wait_status != -1 && WIFSIGNALED(c.wait_status)) return &c;
    if (first == nullptr) first = &c;
  }
  return first;
}

std::string ProcessGroup::DescribeExit(const Child& child, const std::string& context) const {
  const int st = child.wait_status;
  std::string what;
  if (st != -1 && WIFEXITED(st)) {
    what = absl::StrCat("exited with status ", WEXITSTATUS(st));
  } else if (st != -1 && WIFSIGNALED(st)) {
    const int sig = WTERMSIG(st);
    what = absl::StrCat("was killed by signal ", sig, " (", strsignal(sig), ")",
                        WCOREDUMP(st) ? " and dumped core" : "");
  } else {
    what = "ended (its exit status is unknown: it was reaped elsewhere)";
  }
  const std::string tail = ReadTail(child.log_path, 20);
  return absl::StrCat(child.name, " (pid ", child.pid, ") ", what, context,
                      tail.empty() ? absl::StrCat("; its log ", child.log_path, " is empty")
                                   : absl::StrCat("; last lines of ", child.log_path, ":\n", tail));
}

absl::StatusOr<std::string> ProcessGroup::WaitReady(const std::string& name, const std::string& ready_path,
                                                    absl::Duration timeout) {
  return WaitFor(
      name, absl::StrCat("its ready file ", ready_path),
      [&]() -> absl::StatusOr<std::optional<std::string>> {
        UniqueFd fd(open(ready_path.c_str(), O_RDONLY | O_CLOEXEC));
        if (fd.get() < 0) {
          if (errno != ENOENT) return ErrnoToStatus(errno, absl::StrCat("open ", ready_path));
          return std::nullopt;
        }
        std::string content;
        char buf[4096];
        while (true) {
          const ssize_t n = read(fd.get(), buf, sizeof(buf));
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) return ErrnoToStatus(errno, absl::StrCat("read ", ready_path));
          if (n == 0) break;
          content.append(buf, static_cast<size_t>(n));
        }
        return content;
      },
      timeout);
}

absl::StatusOr<std::string> ProcessGroup::WaitReadyLine(const std::string& name, const std::string& marker,
                                                        absl::Duration timeout) {
  const Child* c = Find(name);
  if (c == nullptr) return absl::NotFoundError(absl::StrCat("no process is named ", name));
  const std::string log = c->log_path;
  return WaitFor(
      name, absl::StrCat("its ready line (", marker, ") in ", log),
      [&]() -> absl::StatusOr<std::optional<std::string>> {
        // Logs are small until the rank is ready: read the first MiB (the marker is near its start).
        std::string tail;
        if (UniqueFd fd(open(log.c_str(), O_RDONLY | O_CLOEXEC)); fd.get() >= 0) {
          char buf[8192];
          ssize_t n;
          while (tail.size() < (1 << 20) && (n = read(fd.get(), buf, sizeof(buf))) > 0) {
            tail.append(buf, static_cast<size_t>(n));
          }
        }
        size_t at = 0;
        while ((at = tail.find(marker + " ", at)) != std::string::npos) {
          if (at == 0 || tail[at - 1] == '\n') {
            const size_t end = tail.find('\n', at);
            if (end == std::string::npos) return std::nullopt;  // the line is still being written
            return tail.substr(at + marker.size() + 1, end - at - marker.size() - 1);
          }
          at += marker.size();
        }
        return std::nullopt;
      },
      timeout);
}

absl::StatusOr<std::string> ProcessGroup::WaitFor(
    const std::string& name, const std::string& what,
    const std::function<absl::StatusOr<std::optional<std::string>>()>& read_ready, absl::Duration timeout) {
  Child* target = Find(name);
  if (target == nullptr) return absl::NotFoundError(absl::StrCat("no process is named ", name));
  const std::string waiting = absl::StrCat("waiting for ", name, " to write ", what);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (TerminationSignal() != 0) return Interrupted(waiting);
    ReapRunning();
    ASSIGN_OR_RETURN(std::optional<std::string> ready, read_ready());
    if (ready) return *ready;
    if (!target->running) {
      target->reported = true;
      return absl::UnavailableError(DescribeExit(*target, absl::StrCat(" before writing ", what)));
    }
    if (Child* other = FirstUnreportedExit(); other != nullptr) {
      other->reported = true;
      return absl::UnavailableError(DescribeExit(*other, absl::StrCat(" while ", waiting)));
    }
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      const std::string tail = ReadTail(target->log_path, 20);
      return absl::DeadlineExceededError(absl::StrCat(
          name, " (pid ", target->pid, ") did not write ", what, " within ", absl::FormatDuration(timeout),
          tail.empty() ? absl::StrCat("; its log ", target->log_path, " is empty")
                       : absl::StrCat("; last lines of ", target->log_path, ":\n", tail)));
    }
    PauseBriefly(static_cast<int>(std::min<int64_t>(kPollMs, absl::ToInt64Milliseconds(left) + 1)));
  }
}

void ProcessGroup::Tolerate(const std::string& name, int restarts, std::vector<std::string> restart_argv,
                            std::string serves, std::string left_hint) {
  Child* c = Find(name);
  if (c == nullptr) return;
  c->tolerated = true;
  c->restarts_left = std::max(0, restarts);
  c->restart_argv = std::move(restart_argv);
  c->serves = std::move(serves);
  c->left_hint = std::move(left_hint);
}

void ProcessGroup::ReportLeft(const Child& c) const {
  const std::string limit =
      c.restarts > 0 ? absl::StrCat(" (restarted ", c.restarts, " time(s), the limit)") : "";
  std::fprintf(stderr, "tandem launch: %s%s; the deployment goes on without it\n",
               DescribeExit(c, "").c_str(), limit.c_str());
  // On a line of its own: the exit's description may end with lines of the log.
  if (!c.left_hint.empty())
    std::fprintf(stderr, "tandem launch: %s: %s\n", c.name.c_str(), c.left_hint.c_str());
}

namespace {
bool CleanExit(int wait_status) {
  return wait_status != -1 && WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
}
}  // namespace

absl::Status ProcessGroup::WaitExit(const std::string& name, absl::Duration timeout) {
  Child* target = Find(name);
  if (target == nullptr) return absl::NotFoundError(absl::StrCat("no process is named ", name));
  const std::string waiting = absl::StrCat("waiting for ", name, " to exit");
  const absl::Time deadline = absl::Now() + timeout;
  auto tolerated = [this](Child& c) {
    if (!c.tolerated || CleanExit(c.wait_status) || ServedStopped(c)) return false;
    if (RestartIfAllowed(c)) return true;
    ReportLeft(c);
    return true;
  };
  while (true) {
    if (TerminationSignal() != 0) return Interrupted(waiting);
    ReapRunning();
    if (!target->running) {
      const bool was_reported = target->reported;
      target->reported = true;
      if (CleanExit(target->wait_status)) return absl::OkStatus();
      if (!was_reported && target->tolerated && !ServedStopped(*target) && RestartIfAllowed(*target))
        continue;  // wait for the new one
      if (was_reported || tolerated(*target)) return absl::OkStatus();
      return absl::UnavailableError(DescribeExit(*target, ""));
    }
    if (Child* other = FirstUnreportedExit(); other != nullptr) {
      other->reported = true;
      // A clean exit of another process is not a failure here (a memory rank told to stop by the
      // compute rank may exit before it); a failure is, unless tolerated.
      if (CleanExit(other->wait_status) || tolerated(*other)) continue;
      return absl::UnavailableError(
          DescribeExit(*other, absl::StrCat(" while waiting for ", name, " to exit")));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          name, " is still running ", absl::FormatDuration(timeout), " after it was expected to exit"));
    }
    PauseBriefly(kPollMs);
  }
}

absl::Status ProcessGroup::WaitAny() {
  while (true) {
    if (TerminationSignal() != 0) return Interrupted("waiting for the processes of the deployment");
    ReapRunning();
    if (Child* exited = FirstUnreportedExit(); exited != nullptr) {
      exited->reported = true;
      if (exited->tolerated && CleanExit(exited->wait_status)) {
        // A rank told to stop while the deployment goes on (a compute replica that compute rank 0
        // released when it went on alone).
        std::fprintf(stderr, "tandem launch: %s (pid %d) exited cleanly; the deployment goes on without it\n",
                     exited->name.c_str(), static_cast<int>(exited->pid));
        continue;
      }
      if (exited->tolerated && !ServedStopped(*exited)) {
        if (RestartIfAllowed(*exited)) continue;
        ReportLeft(*exited);
        continue;
      }
      return absl::UnavailableError(DescribeExit(*exited, ""));
    }
    if (std::none_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; })) {
      return absl::FailedPreconditionError("WaitAny: no process of the group is running");
    }
    PauseBriefly(kPollMs);
  }
}

std::vector<std::string> ProcessGroup::StopAll(absl::Duration grace) {
  std::vector<std::string> killed;
  ReapRunning();
  auto any_running = [this] {
    return std::any_of(children_.begin(), children_.end(), [](const Child& c) { return c.running; });
  };
  if (any_running()) {
    for (Child& c : children_) {
      if (!c.running) continue;
      kill(c.pid, SIGTERM);
      kill(c.pid, SIGCONT);  // a stopped rank (SIGSTOP) handles SIGTERM only once continued
    }
    const absl::Time deadline = absl::Now() + grace;
    while (true) {
      ReapRunning();
      if (!any_running()) break;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) break;
      // Not the self-pipe: a second Ctrl-C must not turn this into a busy loop.
      poll(nullptr, 0, static_cast<int>(std::min<int64_t>(10, absl::ToInt64Milliseconds(left) + 1)));
    }
    for (Child& c : children_) {
      if (!c.running) continue;
      kill(c.pid, SIGKILL);
      killed.push_back(c.name);
    }
    for (Child& c : children_) {
      if (!c.running) continue;
      int status = 0;
      pid_t r;
      do {
        r = waitpid(c.pid, &status, 0);
      } while (r < 0 && errno == EINTR);
      c.running = false;
      c.wait_status = r == c.pid ? status : -1;
    }
  }
  for (Child& c : children_) {
    if (c.stdin_fd >= 0) close(c.stdin_fd);
    c.stdin_fd = -1;
  }
  for (Child& c : children_) c.reported = true;  // stopped on purpose: no wait reports them
  return killed;
}

pid_t ProcessGroup::pid(const std::string& name) const {
  const Child* c = Find(name);
  return c == nullptr ? 0 : c->pid;
}

bool ProcessGroup::Stop(const std::string& name, absl::Duration grace) {
  Child* c = Find(name);
  if (c == nullptr) return true;
  ReapRunning();
  if (!c->running) return true;
  kill(c->pid, SIGTERM);
  kill(c->pid, SIGCONT);  // a stopped process handles SIGTERM only once continued
  const absl::Time deadline = absl::Now() + grace;
  while (c->running && absl::Now() < deadline) {
    poll(nullptr, 0, 10);
    ReapRunning();
  }
  return !c->running;
}

bool ProcessGroup::running(const std::string& name) const {
  const Child* c = Find(name);
  return c != nullptr && c->running;
}

bool ProcessGroup::stopped(const std::string& name) const {
  const Child* c = Find(name);
  return c != nullptr && c->running && ProcessStopped(c->pid);
}

std::string ProcessGroup::LogTail(const std::string& name, int n) const {
  const Child* c = Find(name);
  return c == nullptr ? "" : ReadTail(c->log_path, n);
}

}  // namespace tandem
