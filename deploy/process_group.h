// The processes of one deployment on this host, as the launcher sees them: started with their
// output appended to one log file each, watched until they are ready, brought down together.
//
// Guarantees:
//   * a child dies with the launcher (PR_SET_PDEATHSIG = SIGKILL, set before exec and re-checked
//     against a race with the launcher's own death), so no rank outlives a killed launcher;
//   * StopAll() sends SIGTERM (then SIGCONT, so that a stopped child handles it) to every child
//     still running, waits up to `grace`, then SIGKILLs the rest and reaps all of them: nothing is
//     left behind, not even a zombie;
//   * a child that exits while the group is expected to be running is reported by name, with its
//     exit status (or signal) and the last lines of its log.
//
// Termination signals: InstallTerminationSignals() makes SIGINT and SIGTERM set a flag (through a
// self-pipe, async-signal-safe) instead of killing the launcher; every wait of this class returns
// Cancelled ("interrupted by SIGINT") as soon as one arrives, so the caller can StopAll() and exit.
//
// Thread safety: none; one thread drives a ProcessGroup.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem {

// Routes SIGINT and SIGTERM to a flag that ProcessGroup waits observe. Idempotent.
void InstallTerminationSignals();
// The termination signal received so far (SIGINT or SIGTERM), or 0.
int TerminationSignal();

// Writes `content` to `path` atomically (a temporary file in the same directory, fsync, rename),
// so a reader never sees a partial file. Used by ranks for their ready files.
absl::Status WriteFileAtomic(const std::string& path, const std::string& content);

class ProcessGroup {
 public:
  ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  // StopAll(absl::Seconds(5)) if anything still runs.
  ~ProcessGroup();

  // Starts argv[0] (a path; not searched in PATH) with `argv`, stdin from /dev/null, stdout and
  // stderr appended to `log_path` (created, with parent directories). `name` ("memory-1") names
  // the process in every message; names are unique. Errors: InvalidArgument (empty argv,
  // duplicate name), or the errno of open/fork/exec (an exec failure is detected here, not later).
  absl::Status Start(const std::string& name, const std::vector<std::string>& argv,
                     const std::string& log_path);
  // Same, but stdin is a pipe: `stdin_data` (at most 60 KiB) is written to it at once and the pipe
  // stays open until the process is reaped (or this launcher dies: then the child reads EOF). An
  // ssh child forwards both to its remote rank, which exits on that EOF (deploy/ssh_launcher.h).
  absl::Status StartWithStdin(const std::string& name, const std::vector<std::string>& argv,
                              const std::string& log_path, const std::string& stdin_data);

  // Waits until `ready_path` exists (it is written with WriteFileAtomic) and returns its content.
  // Fails with Unavailable naming the process, its exit status and its log's last lines if the
  // process `name` exits first; DeadlineExceeded after `timeout` (naming the process and the
  // file); Cancelled on a termination signal.
  absl::StatusOr<std::string> WaitReady(const std::string& name, const std::string& ready_path,
                                        absl::Duration timeout);
  // Same, but readiness is a line "<marker> <text>" in the process's log (a remote rank's stdout,
  // streamed by ssh; no shared file system): returns <text>.
  absl::StatusOr<std::string> WaitReadyLine(const std::string& name, const std::string& marker,
                                            absl::Duration timeout);

  // Waits until process `name` exits. OK if it exited with status 0. Otherwise (or if another
  // process of the group fails first: a non-zero status or a signal; another process exiting
  // with status 0 meanwhile is not an error) Unavailable naming the process that exited:
  //   "memory-1 (pid 4242) exited with status 3; last lines of logs/memory-1.log:\n..."
  // or "... was killed by signal 9 (Killed) ...". Cancelled on a termination signal;
  // DeadlineExceeded naming it if it is still running after `timeout`.
  absl::Status WaitExit(const std::string& name, absl::Duration timeout = absl::InfiniteDuration());

  // Waits until any process exits (reported as in WaitExit, even with status 0, except a tolerated
  // one: a line on stderr, and the wait goes on) or a termination signal arrives (Cancelled). For a
  // deployment that runs until stopped.
  absl::Status WaitAny();

  // From now on the failure of process `name` is not an error of the group's waits (WaitExit of
  // it or of another process, WaitAny): it is reported on stderr, once, and the wait goes on (a
  // memory rank whose requests compute rank 0 recovers; see launch.recover_memory_ranks). With
  // `restarts` > 0 a failure (not a clean exit) is followed by a restart, up to `restarts` times
  // in all: the same log (appended), the same stdin data, the command line `restart_argv` (empty:
  // the one it was started with); each restart is a line on stderr ("restarting it (restart 1 of
  // 3)", then "restarted (pid N)"), and a WaitExit of it waits for the new process. A failure past
  // the limit is reported as without restarts. With `serves` (the name of another process of the
  // group, e.g. compute-0) there is no restart while that process is not running or is stopped
  // (SIGSTOP): a rank that left because it went silent would only wait for it again; a failure
  // while it is stopped is not tolerated (the waits return it: the ranks gave the stopped process
  // up, and the deployment cannot go on). Calling it again replaces the limit (0: no more
  // restarts). `left_hint`, when given, is a line of its own after the report of a failure not
  // restarted (what an operator can do about it).
  void Tolerate(const std::string& name, int restarts = 0, std::vector<std::string> restart_argv = {},
                std::string serves = "", std::string left_hint = "");

  // SIGTERM to every running process, up to `grace` for them to exit, then SIGKILL; reaps all.
  // Returns the names of the processes that needed SIGKILL (for the launcher's message).
  std::vector<std::string> StopAll(absl::Duration grace);
  // SIGTERM to process `name` alone and up to `grace` for it to exit (reaped); true if it did.
  bool Stop(const std::string& name, absl::Duration grace);

  // pid of a started process (0 if unknown); whether it is still running (not yet reaped).
  pid_t pid(const std::string& name) const;
  bool running(const std::string& name) const;
  // Whether process `name` is running but stopped (SIGSTOP, or traced).
  bool stopped(const std::string& name) const;
  // The last `n` lines of a process's log ("" if unreadable).
  std::string LogTail(const std::string& name, int n = 20) const;

 private:
  struct Child {
    std::string name;
    pid_t pid = 0;
    std::string log_path;
    bool running = false;
    int wait_status = 0;     // from waitpid, once reaped (-1: reaped by someone else, status unknown)
    bool reported = false;   // its exit was returned by a wait (or it was stopped by StopAll)
    bool tolerated = false;  // Tolerate(): a failure is reported on stderr, not returned
    int stdin_fd = -1;       // write end of its stdin pipe (StartWithStdin), closed once reaped
    // What a restart needs (Tolerate with restarts).
    std::vector<std::string> argv, restart_argv;
    std::optional<std::string> stdin_data;
    int restarts_left = 0, restarts = 0;
    std::string serves;     // no restart while this process is not running or stopped
    std::string left_hint;  // a line after the report of a failure not restarted
  };
  // The line on stderr for a tolerated child that failed and is not restarted (the limit reached,
  // or none allowed).
  void ReportLeft(const Child& child) const;
  absl::Status StartImpl(const std::string& name, const std::vector<std::string>& argv,
                         const std::string& log_path, const std::string* stdin_data);
  // Forks and execs (StartImpl's work): the pid, and the write end of its stdin pipe in *stdin_fd
  // when `stdin_data` is given.
  absl::StatusOr<pid_t> Spawn(const std::string& name, const std::vector<std::string>& argv,
                              const std::string& log_path, const std::string* stdin_data, int* stdin_fd);
  // A tolerated child that failed: restarts it when restarts are left (true: reported and
  // restarted, or reported as not restartable), else false (the caller reports it).
  bool RestartIfAllowed(Child& child);
  // Whether the process `child` serves (Tolerate) is running but stopped.
  bool ServedStopped(const Child& child) const;
  // Waits for `read_ready` to return a value (polling), as WaitReady describes.
  absl::StatusOr<std::string> WaitFor(
      const std::string& name, const std::string& what,
      const std::function<absl::StatusOr<std::optional<std::string>>()>& read_ready, absl::Duration timeout);
  Child* Find(const std::string& name);
  const Child* Find(const std::string& name) const;
  // waitpid(WNOHANG) on every running child; records the exits.
  void ReapRunning();
  // The first child that exited and whose exit no wait has returned yet (one killed by a signal
  // before one that exited with a status), or null.
  Child* FirstUnreportedExit();
  // "<name> (pid N) exited with status 3<context>; last lines of <log>:\n<tail>".
  std::string DescribeExit(const Child& child, const std::string& context) const;
  std::vector<Child> children_;
};

}  // namespace tandem
