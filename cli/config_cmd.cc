// `tandem config`: explain and check configuration files.
#include <iostream>

#include "cli/commands.h"
#include "colocated/engine.h"
#include "common/config.h"

namespace tandem::cli {

namespace {
const ConfigSchema& Schema() {
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
  cmd->add_subcommand("help", "List every setting with its type, default and meaning")->callback([] {
    std::cout << Schema().HelpText();
  });
  auto file = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  CLI::App* check = cmd->add_subcommand(
      "check", "Validate a YAML file (and --set overrides) and print the effective configuration");
  check->add_option("file", *file, "YAML configuration file")->required();
  check->add_option("--set", *sets, "override a setting, e.g. --set kv.capacity_tokens=4096 (repeatable)");
  check->callback([file, sets] {
    absl::StatusOr<Config> config = LoadConfigFile(Schema(), *file, *sets);
    if (!config.ok()) Fail("config check", config.status());
    std::cout << config->DumpYaml();
  });
}

}  // namespace tandem::cli
