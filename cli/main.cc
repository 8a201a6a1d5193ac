// tandem: one executable, one subcommand per role or tool (docs/architecture.md, "Processes").
#include <cstdio>

#include "CLI/CLI.hpp"
#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "tandem: an LLM serving runtime that disaggregates attention.\n"
      "Compute nodes run the linear layers at large batch; memory nodes own the KV cache and run\n"
      "attention.",
      "tandem"};
  app.set_version_flag("--version", "tandem 0.1.0");
  app.require_subcommand(1);
  // One line on bad arguments, non-zero exit (the default prints two).
  app.failure_message([](const CLI::App* failed, const CLI::Error& e) {
    return std::string("tandem") + (failed->get_parent() ? " " + failed->get_name() : std::string()) + ": " +
           e.what() + " (see --help)\n";
  });
  tandem::cli::AddGenerateCommand(app);
  tandem::cli::AddServeCommand(app);
  tandem::cli::AddConfigCommand(app);
  tandem::cli::AddDevicesCommand(app);
  tandem::cli::AddTokenizeCommands(app);
  tandem::cli::AddRankCommands(app);
  tandem::cli::AddBenchCommand(app);
  tandem::cli::AddPlanCommand(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
