// Ranks on other hosts, started by the launcher through the OpenSSH client (`launch.ssh`, the
// `tandem` binary path per host in the pools: deploy/placement.h). No shared file system is
// needed: everything a remote rank needs and everything it reports travel over its ssh session.
//
//   launcher                                  ssh session                 remote rank
//   stdin pipe: "tandem-bootstrap 1"          ───────────────────────►    ReadStdinBootstrap():
//               "secret <64 hex>"                                          the deployment secret (never
//               "config <n>" + n bytes of YAML                             on a command line or a disk),
//               then held open                                             the effective config
//   <run dir>/<rank>.log  ◄── the rank's stdout and stderr (its log, and the ready line
//                             "TANDEM-READY <address>", which ProcessGroup::WaitReadyLine finds)
//
// No orphan survives: the ssh client is a child of the launcher that dies with it
// (PR_SET_PDEATHSIG), and the launcher holds the write end of its stdin. When the launcher exits,
// is killed (even with SIGKILL), stops the rank, or the ssh connection drops, the remote rank reads
// EOF on stdin (WatchStdinForLauncher): it stops as on SIGTERM and, if it has not exited
// kOrphanGrace later, exits at once. A remote rank that dies ends its ssh session, which the
// launcher sees as that rank's exit.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/bootstrap/deployment_key.h"

namespace tandem {

inline constexpr char kReadyMarker[] = "TANDEM-READY";
inline constexpr absl::Duration kOrphanGrace = absl::Seconds(15);

// The ssh client's argv: `ssh_command` split at spaces (its first word looked up in PATH), "-T",
// the host, and the remote command (`remote_argv` quoted for the remote shell, run with exec).
std::vector<std::string> SshArgv(const std::string& ssh_command, const std::string& host,
                                 const std::vector<std::string>& remote_argv);
// `argv` as one POSIX shell command line: a word made only of [A-Za-z0-9_@%+=:,./-] as it is, any
// other quoted ('...', a ' inside as '\''), so that a shell reads back the same words.
std::string ShellCommandLine(const std::vector<std::string>& argv);
// What the launcher writes to a remote rank's stdin.
std::string StdinBootstrap(const bootstrap::DeploymentKey& key, const std::string& config_yaml);
// The remote rank's side: reads the bootstrap from stdin (deadline `timeout`), sets this process's
// deployment key (bootstrap::SetProcessKey) and returns the config YAML. Then call
// WatchStdinForLauncher. InvalidArgument naming what was malformed; DeadlineExceeded.
absl::StatusOr<std::string> ReadStdinBootstrap(absl::Duration timeout);
// Starts a thread that waits for EOF (or an error) on stdin, then raises SIGTERM in this process
// and, kOrphanGrace later, ends it with exit status 3.
void WatchStdinForLauncher();

}  // namespace tandem
