// `tandem config`: explain and check configuration files (the colocated engine's, or with
// --deploy a deployment's).
#include <iostream>

#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "colocated/engine.h"
#include "common/config.h"
#include "deploy/deployment.h"

namespace tandem::cli {

namespace {
const ConfigSchema& EngineConfigSchema() {
  static const ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    AddEngineKnobs(s);
    return s;
  }();
  return *schema;
}
}  // namespace

void AddConfigCommand(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("config", "Explain and check configuration files");
  cmd->require_subcommand(1);
  auto help_deploy = std::make_shared<bool>(false);
  CLI::App* help = cmd->add_subcommand("help", "List every setting with its type, default and meaning");
  help->add_flag("--deploy", *help_deploy,
                 "the settings of a deployment YAML (tandem launch, generate --deploy)");
  help->callback(
      [help_deploy] { std::cout << (*help_deploy ? DeploySchema() : EngineConfigSchema()).HelpText(); });
  auto file = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto deploy = std::make_shared<bool>(false);
  CLI::App* check = cmd->add_subcommand("check",
                                        "Validate a YAML file (and --set overrides) and print the effective "
                                        "configuration; with --deploy, also the "
                                        "resolved topology (devices and addresses of every rank)");
  check->add_option("file", *file, "YAML configuration file")->required();
  check->add_option("--set", *sets, "override a setting, e.g. --set kv.capacity_tokens=4096 (repeatable)");
  check->add_flag("--deploy", *deploy, "the file is a deployment (tandem launch, generate --deploy)");
  check->callback([file, sets, deploy] {
    absl::StatusOr<Config> config =
        LoadConfigFile(*deploy ? DeploySchema() : EngineConfigSchema(), *file, *sets);
    if (!config.ok()) Fail("config check", config.status());
    std::cout << config->DumpYaml();
    if (!*deploy) return;
    absl::StatusOr<DeployPlan> plan = PlanDeployment(*config);
    if (!plan.ok()) Fail("config check", plan.status());
    std::cout << DescribePlacement(*plan);
  });
}

}  // namespace tandem::cli
