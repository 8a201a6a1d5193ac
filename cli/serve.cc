// `tandem serve`: the OpenAI-compatible HTTP API (server/api_server.h) over the colocated engine.
// The socket is bound first (so /health answers 503 while the model loads), then the engine is
// created and handed to an EngineLoop. SIGTERM or SIGINT drains: /health and new requests answer
// 503, requests in flight get api.shutdown_grace_s to finish, the rest are cancelled, and the
// process exits 0.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "colocated/engine.h"
#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/weights.h"
#include "deploy/deployment.h"
#include "server/api_server.h"
#include "server/engine_loop.h"
#include "server/metrics.h"
#include "text/text_model.h"

namespace tandem::cli {

namespace {

struct ServeArgs {
  std::string deploy;
  std::string model;
  uint64_t weight_seed = 0;
  std::string config_file;
  std::vector<std::string> sets;
  std::string device;
  std::string ready_file;
  std::string log_level = "info";
};

ConfigSchema& ServeSchema() {
  static ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    AddEngineKnobs(s);
    server::AddApiKnobs(s);
    return s;
  }();
  return *schema;
}

// SIGINT and SIGTERM through a handler that writes the signal number to a pipe (async-signal-safe
// whichever thread takes it: libraries start threads before main, so masks cannot cover them all);
// Wait() reads it.
class Signals {
 public:
  Signals() {
    if (pipe(fds_) != 0) fds_[0] = fds_[1] = -1;
    write_fd_ = fds_[1];
    struct sigaction sa {};
    sa.sa_handler = [](int sig) {
      const unsigned char b = static_cast<unsigned char>(sig);
      if (write_fd_ >= 0) (void)!write(write_fd_, &b, 1);
    };
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
  }
  int Wait() {
    unsigned char b = 0;
    while (read(fds_[0], &b, 1) < 0 && errno == EINTR) {
    }
    return b;
  }

 private:
  static inline int write_fd_ = -1;
  int fds_[2] = {-1, -1};
};

}  // namespace

// The model's tokenizer and chat template for the API, or nullptr (token ids only) with a note.
std::unique_ptr<text::TextModel> LoadServeText(const std::string& model) {
  absl::StatusOr<std::unique_ptr<text::TextModel>> tm = text::TextModel::Load(model);
  if (tm.ok()) {
    TANDEM_LOG_INFO("serve", "text: ", (*tm)->source(),
                    (*tm)->has_chat_template() ? ", with a chat template" : "");
    return *std::move(tm);
  }
  TANDEM_LOG_WARN("serve", "token ids only (no text, chat or stop strings): ", tm.status().message());
  return nullptr;
}

namespace {

// --deploy: the launcher starts the memory ranks and compute rank 0, which serves the API; the
// launcher stays in the foreground and drains compute rank 0 first on SIGTERM.
absl::Status RunServeDeployed(const ServeArgs& a) {
  std::vector<std::string> sets = a.sets;
  if (!a.model.empty()) sets.push_back("model.path=" + a.model);
  ASSIGN_OR_RETURN(const Config config, LoadConfigFile(DeploySchema(), a.deploy, sets));
  ASSIGN_OR_RETURN(const DeployPlan plan, PlanDeployment(config));
  std::string ready;
  if (!a.ready_file.empty()) ready = std::filesystem::absolute(a.ready_file).string();
  return Launch(config, plan,
                {.tandem_binary = SelfPath(), .log_level = a.log_level, .api_ready_file = ready});
}

absl::Status RunServe(const ServeArgs& a) {
  if (!a.deploy.empty()) return RunServeDeployed(a);
  if (a.model.empty()) return absl::InvalidArgumentError("--model is required (without --deploy)");
  Signals signals;
  const std::optional<LogLevel> level = ParseLogLevel(a.log_level);
  if (!level)
    return absl::InvalidArgumentError(absl::StrCat("--log-level: unknown level \"", a.log_level, "\""));
  InitLogging("serve", *level);
  std::vector<std::string> sets = a.sets;
  if (!a.device.empty()) sets.push_back("runtime.device=" + a.device);
  ASSIGN_OR_RETURN(const Config config, a.config_file.empty()
                                            ? LoadConfig(ServeSchema(), "", "", sets)
                                            : LoadConfigFile(ServeSchema(), a.config_file, sets));
  for (const std::string& line : config.NonDefault()) TANDEM_LOG_INFO("config", line);
  const server::ApiOptions api = server::ApiOptionsFromConfig(config);
  ASSIGN_OR_RETURN(std::unique_ptr<server::ApiServer> http, server::ApiServer::Start(api));
  std::fprintf(
      stderr,
      "tandem serve: listening on http://%s:%d (loading the model; /health answers 503 until ready)\n",
      api.host.c_str(), http->port());
  const auto t0 = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<WeightSource> source, OpenModel(a.model, a.weight_seed));
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                   ColocatedEngine::Create(*source, EngineOptionsFromConfig(config)));
  std::unique_ptr<text::TextModel> text = LoadServeText(a.model);
  http->SetText(text.get());
  server::ServerMetrics metrics;
  server::EngineLoop loop(
      engine.get(), server::LoopOptionsFromConfig(config),
      [&metrics](const GenerationResult& r, const server::RequestTimes& t) { metrics.Observe(r, t); });
  http->SetLoop(&loop, &metrics);
  std::fprintf(stderr, "tandem serve: ready in %.1f s: model \"%s\" (%s) on %s at http://%s:%d/v1\n",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               api.served_model_name.c_str(), source->Describe().c_str(), engine->device().c_str(),
               api.host.c_str(), http->port());
  if (!a.ready_file.empty()) {
    std::ofstream(a.ready_file) << "http://" << api.host << ":" << http->port() << "\n";
  }
  const int sig = signals.Wait();
  std::fprintf(stderr, "tandem serve: %s: draining (api.shutdown_grace_s %.0f)\n",
               sig == SIGTERM ? "SIGTERM" : "SIGINT", api.shutdown_grace_s);
  http->Draining();
  loop.Shutdown(absl::Seconds(api.shutdown_grace_s));
  http->Stop();
  const server::LoopStats s = loop.stats();
  std::fprintf(stderr,
               "tandem serve: stopped; %lld requests finished, %lld cancelled, %lld generated tokens\n",
               static_cast<long long>(s.finished), static_cast<long long>(s.cancelled),
               static_cast<long long>(s.generation_tokens));
  return absl::OkStatus();
}

}  // namespace

void AddServeCommand(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "serve",
      "Serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health,\n"
      "/metrics) over the colocated engine or, with --deploy, a deployment on this host. Prompts are text\n"
      "when the checkpoint has a tokenizer (and chat needs its chat template), else token ids.\n"
      "Example:\n"
      "  tandem serve --model small --set api.port=8000\n"
      "  tandem serve --deploy deploy/examples/cpu.yaml --set api.port=8000   (disaggregated, on this host)\n"
      "  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
      "    -d '{\"model\": \"tandem\", \"prompt\": [1, 450, 4996], \"max_tokens\": 8}'");
  cmd->add_option(
      "--model", a->model,
      "checkpoint directory (Hugging Face layout) or preset name (with --deploy: overrides model.path)");
  cmd->add_option(
         "--deploy", a->deploy,
         "serve through a disaggregated deployment on this host, started from this YAML: compute rank 0 "
         "serves the API (api.* settings in the YAML), memory ranks hold the KV")
      ->check(CLI::ExistingFile);
  cmd->add_option("--weight-seed", a->weight_seed, "seed of a preset's random weights")
      ->capture_default_str();
  cmd->add_option("--config", a->config_file,
                  "YAML file with api.*, runtime.*, scheduler.* and kv.* settings")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", a->sets, "override a setting: --set api.port=8080 (repeatable)");
  cmd->add_option("--device", a->device, "cpu, cuda, cuda:N or auto (runtime.device)");
  cmd->add_option("--ready-file", a->ready_file, "write the API's base URL to this file once it is ready");
  cmd->add_option("--log-level", a->log_level, "debug, info, warn or error")->capture_default_str();
  cmd->callback([a] {
    absl::Status st = RunServe(*a);
    if (!st.ok()) Fail("serve", st);
  });
}

}  // namespace tandem::cli
