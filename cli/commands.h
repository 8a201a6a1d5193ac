// Subcommands of the `tandem` executable. Each Add* registers one subcommand (options, help and
// the callback that runs it) on the top-level app. A callback that fails throws CLI::RuntimeError
// with the exit code after printing a one-line error to stderr.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cli/run_files.h"
#include "common/config.h"
#include "compute_node/engine.h"
#include "deploy/deployment.h"
#include "text/text_model.h"

namespace tandem::cli {

void AddGenerateCommand(CLI::App& app);
// The OpenAI-compatible HTTP API over the colocated engine (cli/serve.cc).
void AddServeCommand(CLI::App& app);
void AddConfigCommand(CLI::App& app);
// Serving benchmark and cost planner (cli/bench_cmd.cc, cli/plan_cmd.cc).
void AddBenchCommand(CLI::App& app);
void AddPlanCommand(CLI::App& app);
void AddDevicesCommand(CLI::App& app);
// tokenize and detokenize (cli/tokenize_cmd.cc).
void AddTokenizeCommands(CLI::App& app);
// memory, compute and launch (cli/rank_cmds.cc).
void AddRankCommands(CLI::App& app);

// Runs `requests` through `engine` to completion (Engine::GenerateAll) and times it: the one
// code path of `tandem generate`, whether the engine is the colocated one in this process or
// compute rank 0 of a deployment (`tandem compute --requests`, which `generate --deploy`
// starts). `stats` gets the wall time, the engine's step count and device.
absl::StatusOr<std::vector<GenerationResult>> RunRequests(
    Engine& engine, std::vector<GenerationRequest> requests, RunStats* stats,
    const std::function<absl::Status()>& before_step = nullptr);

// The model's tokenizer and chat template for `tandem serve` and compute rank 0's API, or nullptr
// (token ids only; logged) when the model ships none or they do not load.
std::unique_ptr<text::TextModel> LoadServeText(const std::string& model);

// The path of the running `tandem` executable.
std::string SelfPath();
// Opens the deployment's model (for its shape) and resolves devices and addresses.
absl::StatusOr<DeployPlan> PlanDeployment(const Config& config);

// Prints "tandem <command>: <status message>" to stderr and throws CLI::RuntimeError(1).
[[noreturn]] void Fail(const std::string& command, const absl::Status& status);

}  // namespace tandem::cli
