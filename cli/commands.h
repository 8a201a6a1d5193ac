// Subcommands of the `tandem` executable. Each Add* registers one subcommand (options, help and
// the callback that runs it) on the top-level app. A callback that fails throws CLI::RuntimeError
// with the exit code after printing a one-line error to stderr.
#pragma once

#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/config.h"
#include "deploy/deployment.h"

namespace tandem::cli {

void AddGenerateCommand(CLI::App& app);
void AddConfigCommand(CLI::App& app);
void AddDevicesCommand(CLI::App& app);
// memory, compute and launch (cli/rank_cmds.cc).
void AddRankCommands(CLI::App& app);

// Prints "tandem <command>: <status message>" to stderr and throws CLI::RuntimeError(1).
// The path of the running `tandem` executable.
std::string SelfPath();
// Opens the deployment's model (for its shape) and resolves devices and addresses.
absl::StatusOr<DeployPlan> PlanDeployment(const Config& config);

[[noreturn]] void Fail(const std::string& command, const absl::Status& status);

}  // namespace tandem::cli
