#include "deploy/slurm_launcher.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"

namespace tandem {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? "" : v;
}

// The output of a command (its stdout), or an error naming it.
absl::StatusOr<std::string> Output(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return absl::InternalError(absl::StrCat("cannot run ", command));
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) return absl::UnavailableError(absl::StrCat(command, " failed (status ", rc, ")"));
  return out;
}

// "2(x3),1" -> {2, 2, 2, 1}.
absl::StatusOr<std::vector<int>> TasksPerNode(const std::string& text, const std::string& var) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int tasks = 0, times = 1;
    const size_t paren = part.find("(x");
    if (!absl::SimpleAtoi(part.substr(0, paren), &tasks) ||
        (paren != absl::string_view::npos &&
         !absl::SimpleAtoi(part.substr(paren + 2, part.size() - paren - 3), &times))) {
      return absl::InvalidArgumentError(absl::StrCat(var, ": cannot read \"", text, "\""));
    }
    for (int i = 0; i < times; ++i) out.push_back(tasks);
  }
  return out;
}

bool Heterogeneous() { return !Env("SLURM_JOB_NODELIST_HET_GROUP_1").empty(); }

}  // namespace

absl::StatusOr<std::vector<std::string>> SlurmOverrides(const std::string& devices) {
  const bool het = Heterogeneous();
  const std::string nodes_var = het ? "SLURM_JOB_NODELIST_HET_GROUP_1" : "SLURM_JOB_NODELIST";
  const std::string tasks_var = het ? "SLURM_TASKS_PER_NODE_HET_GROUP_1" : "SLURM_TASKS_PER_NODE";
  const std::string nodelist = Env(nodes_var.c_str()), tasks = Env(tasks_var.c_str());
  if (nodelist.empty() || tasks.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--slurm: ", nodes_var, " and ", tasks_var,
                     " are not set: run it inside a Slurm job (deploy/slurm/)"));
  }
  ASSIGN_OR_RETURN(const std::string names, Output(absl::StrCat("scontrol show hostnames '", nodelist, "'")));
  const std::vector<std::string> nodes = absl::StrSplit(names, '\n', absl::SkipEmpty());
  ASSIGN_OR_RETURN(const std::vector<int> per_node, TasksPerNode(tasks, tasks_var));
  if (per_node.size() != nodes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(tasks_var, " (", tasks, ") does not match the ",
                                                   nodes.size(), " nodes of ", nodes_var, " (", nodelist,
                                                   ")"));
  }
  std::vector<std::string> hosts;
  for (size_t i = 0; i < nodes.size(); ++i) {
    // Where the node is reached: Slurm's NodeAddr (its name may not resolve).
    ASSIGN_OR_RETURN(const std::string info, Output(absl::StrCat("scontrol show node -o '", nodes[i], "'")));
    std::string address = nodes[i];
    if (const size_t at = info.find("NodeAddr="); at != std::string::npos) {
      address = info.substr(at + 9, info.find(' ', at) - at - 9);
    }
    std::vector<std::string> devs;
    for (int t = 0; t < per_node[i]; ++t) devs.push_back(devices == "gpu" ? absl::StrCat("cuda:", t) : "cpu");
    hosts.push_back(absl::StrCat("{host: ", nodes[i], ", address: '", address, "', devices: [",
                                 absl::StrJoin(devs, ", "), "], device_type: slurm}"));
  }
  return std::vector<std::string>{absl::StrCat("memory.hosts=[", absl::StrJoin(hosts, ", "), "]"),
                                  "launch.remote=srun"};
}

std::vector<std::string> SrunArgv(const std::string& node, const std::vector<std::string>& rank_argv) {
  std::vector<std::string> argv = {"srun"};
  if (Heterogeneous()) argv.push_back("--het-group=1");
  argv.insert(argv.end(), {"--nodes=1", "--ntasks=1", "--exact", "--kill-on-bad-exit=1", "--nodelist=" + node,
                           "--job-name=tandem-memory"});
  argv.insert(argv.end(), rank_argv.begin(), rank_argv.end());
  // The launcher executes a path: find srun in PATH.
  const std::string path = Env("PATH");
  for (absl::string_view dir : absl::StrSplit(path.empty() ? "/usr/bin:/bin" : path, ':')) {
    const std::string candidate = absl::StrCat(dir, "/srun");
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) {
      argv[0] = candidate;
      break;
    }
  }
  return argv;
}

}  // namespace tandem
