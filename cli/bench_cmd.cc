// `tandem bench`: replay a workload (a trace or a synthetic one) against the colocated engine in
// this process, a deployment on this host, or any OpenAI-compatible endpoint, and report serving
// metrics, tokens per dollar and the planner's prediction (loadgen/, planner/).
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "colocated/engine.h"
#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/weights.h"
#include "deploy/deployment.h"
#include "deploy/process_group.h"
#include "loadgen/arrivals.h"
#include "loadgen/report.h"
#include "loadgen/runner.h"
#include "loadgen/workload.h"
#include "planner/cost_model.h"
#include "planner/devices.h"

namespace tandem::cli {

namespace {

struct BenchArgs {
  // target
  std::string model, deploy, url, served_model, api_key, config_file, device;
  std::vector<std::string> sets;
  uint64_t weight_seed = 0;
  // workload
  std::string trace, synthetic;
  int64_t trace_skip = 0, num_requests = 100;
  int64_t input_len = 128, output_len = 32, prefix_len = 0, turns = 3;
  double think_time = 0;
  double length_scale = 1;
  int64_t max_input = 0, max_output = 0, max_context = 0, vocab_size = 0;
  // arrivals
  std::string arrival;
  std::string rates;
  double burstiness = 1, time_scale = 1;
  uint64_t seed = 0;
  int64_t max_concurrency = -1, warmup = 2;
  // results
  std::string slo, out = "tandem-run/bench", prices = "deploy/prices.yaml";
  std::string compute_device, memory_device;
  int compute_count = 1, memory_count = 0;
  std::string log_level = "warn";
  bool quiet = false;
};

ConfigSchema& BenchEngineSchema() {
  static ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    AddEngineKnobs(s);
    return s;
  }();
  return *schema;
}

std::string Now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// This process's command line, for the report ("tandem bench --model small ...").
std::string CommandLine() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args = absl::StrSplit(all, '\0', absl::SkipEmpty());
  if (!args.empty()) args[0] = "tandem";
  return absl::StrJoin(args, " ");
}

absl::StatusOr<std::vector<double>> ParseRates(const std::string& s) {
  std::vector<double> rates;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    double r;
    if (!absl::SimpleAtod(part, &r) || !(r > 0) || !std::isfinite(r))
      return absl::InvalidArgumentError(absl::StrCat(
          "--rate: expected positive requests/s, comma-separated, got \"", std::string(part), "\""));
    rates.push_back(r);
  }
  return rates;
}

// The workload for run `run` (token seed offset per run, so no run hits another's prefix cache).
absl::StatusOr<loadgen::Workload> BuildWorkload(const BenchArgs& a, const loadgen::TokenSpace& base, int run,
                                                bool* from_trace) {
  loadgen::TokenSpace tokens = base;
  tokens.seed = a.seed + static_cast<uint64_t>(run) * 0x10001ULL;
  loadgen::Caps caps{a.max_input, a.max_output, a.max_context};
  *from_trace = !a.trace.empty();
  if (!a.trace.empty()) {
    loadgen::TraceFormat format;
    ASSIGN_OR_RETURN(std::vector<loadgen::TraceRow> rows,
                     loadgen::ReadTrace(a.trace, a.trace_skip, a.num_requests, &format));
    return loadgen::MakeTraceWorkload(std::filesystem::path(a.trace).filename().string(), format, rows,
                                      tokens, caps, a.length_scale);
  }
  loadgen::Workload w;
  if (a.synthetic == "fixed") {
    w = loadgen::MakeFixedWorkload(a.num_requests, a.input_len, a.output_len, tokens);
  } else if (a.synthetic == "shared-prefix") {
    if (a.prefix_len < 1)
      return absl::InvalidArgumentError("--synthetic shared-prefix needs --prefix-len >= 1");
    w = loadgen::MakeSharedPrefixWorkload(a.num_requests, a.prefix_len, a.input_len, a.output_len, tokens);
  } else if (a.synthetic == "multi-turn") {
    const int64_t sessions = std::max<int64_t>(1, a.num_requests / std::max<int64_t>(1, a.turns));
    w = loadgen::MakeMultiTurnWorkload(sessions, a.turns, a.prefix_len, a.input_len, a.output_len,
                                       a.think_time, tokens);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--synthetic: expected fixed, shared-prefix or multi-turn, got \"", a.synthetic, "\""));
  }
  loadgen::ApplyCaps(caps, &w);
  return w;
}

void PrintProgress(const std::string& label, const loadgen::ProgressInfo& p) {
  std::string eta = "?";
  if (p.finished > 0 && p.finished < p.total)
    eta = absl::StrFormat(
        "%.0fs", p.elapsed_s * static_cast<double>(p.total - p.finished) / static_cast<double>(p.finished));
  else if (p.finished == p.total)
    eta = "0s";
  std::fprintf(stderr, "\r[bench %s] %lld/%lld done, %lld in flight, %lld tokens, %.1fs, ETA %s   ",
               label.c_str(), static_cast<long long>(p.finished), static_cast<long long>(p.total),
               static_cast<long long>(p.in_flight), static_cast<long long>(p.output_tokens), p.elapsed_s,
               eta.c_str());
  std::fflush(stderr);
}

absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot write"));
  out << text;
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

// The planner's prediction for the measured workload on the priced layout.
// `measured_batch` > 0 (the in-process engine's generated tokens per step) pins the batch, so the
// prediction is for the run as it went; otherwise the planner picks the batch (KV, SLO).
loadgen::PredictionInfo Predict(const BenchArgs& a, const ModelSpec* spec, const loadgen::RunMetrics& m,
                                const planner::PriceTable* prices, const loadgen::Slo& slo,
                                int64_t measured_batch) {
  loadgen::PredictionInfo p;
  if (spec == nullptr) {
    p.why_not = "no prediction: the model's shape is unknown (give --model with --url)";
    return p;
  }
  if (a.compute_device.empty()) {
    p.why_not = "no prediction: give --compute-device (a device the planner knows: tandem plan --help)";
    return p;
  }
  absl::StatusOr<planner::DeviceSpec> c = planner::FindDevice(a.compute_device);
  if (!c.ok()) {
    p.why_not = absl::StrCat("no prediction: ", c.status().message());
    return p;
  }
  if (m.completed == 0) {
    p.why_not = "no prediction: nothing completed";
    return p;
  }
  const double in = static_cast<double>(m.input_tokens) / static_cast<double>(m.completed);
  const double out = static_cast<double>(m.output_tokens) / static_cast<double>(m.completed);
  planner::WorkloadShape w = planner::WorkloadShape::FromLengths(in, out, m.prefix_hit_rate);
  planner::PlanOptions o;
  o.tpot_slo_s = measured_batch > 0 ? 0 : slo.tpot_s;
  if (measured_batch > 0) o.max_batch = measured_batch;
  auto price = [&](const std::string& name) -> double {
    if (prices == nullptr) return 0;
    absl::StatusOr<double> h = prices->HourlyUsd(name);
    return h.ok() ? *h : 0;
  };
  planner::Prediction pr;
  if (a.memory_count > 0) {
    absl::StatusOr<planner::DeviceSpec> mem = planner::FindDevice(a.memory_device);
    if (!mem.ok()) {
      p.why_not = absl::StrCat("no prediction: ", mem.status().message());
      return p;
    }
    pr = planner::Predict(*spec, w, *c, price(a.compute_device), &*mem, price(a.memory_device),
                          a.memory_count / std::max(1, a.compute_count), planner::PipelineMode::kSequential,
                          o);
  } else {
    pr = planner::Predict(*spec, w, *c, price(a.compute_device), nullptr, 0, 0,
                          planner::PipelineMode::kColocated, o);
  }
  if (!pr.feasible) {
    p.why_not = absl::StrCat("no prediction: ", pr.infeasible);
    return p;
  }
  p.have = true;
  p.layout = pr.mode == planner::PipelineMode::kColocated
                 ? absl::StrCat(a.compute_count, " x ", a.compute_device, " colocated")
                 : absl::StrCat(a.compute_count, " x ", a.compute_device, " + ", a.memory_count, " x ",
                                a.memory_device, " sequential");
  if (measured_batch > 0) p.layout += absl::StrCat(", at the measured batch ", measured_batch);
  p.batch = pr.batch;
  p.step_s = pr.step_s;
  p.tokens_per_s = pr.tokens_per_s * a.compute_count;
  p.usd_per_million = pr.usd_per_million;
  p.limit = pr.limit;
  p.bound = pr.bound;
  return p;
}

absl::Status RunBench(const BenchArgs& a_in) {
  BenchArgs a = a_in;
  const std::optional<LogLevel> level = ParseLogLevel(a.log_level);
  if (!level)
    return absl::InvalidArgumentError(absl::StrCat("--log-level: unknown level \"", a.log_level, "\""));
  InitLogging("bench", *level);
  InstallTerminationSignals();
  const int targets = (a.deploy.empty() ? 0 : 1) + (a.url.empty() ? 0 : 1);
  if (targets == 0 && a.model.empty()) return absl::InvalidArgumentError("give --model, --deploy or --url");
  if (targets > 1) return absl::InvalidArgumentError("--deploy and --url exclude each other");
  if (a.trace.empty() == a.synthetic.empty())
    return absl::InvalidArgumentError("give exactly one workload: --trace FILE or --synthetic KIND");
  if (a.trace.empty() && a.num_requests == 0)
    return absl::InvalidArgumentError("--num-requests 0 (the whole trace) needs --trace");
  if (a.arrival.empty()) a.arrival = a.trace.empty() ? "all" : "trace";
  ASSIGN_OR_RETURN(const loadgen::ArrivalKind kind, loadgen::ParseArrivalKind(a.arrival));
  ASSIGN_OR_RETURN(const std::vector<double> rates, ParseRates(a.rates));
  if (kind == loadgen::ArrivalKind::kPoisson && rates.empty())
    return absl::InvalidArgumentError("--arrival poisson needs --rate (one or more, comma-separated)");
  if (kind == loadgen::ArrivalKind::kAllAtOnce && !rates.empty())
    return absl::InvalidArgumentError("--rate does not apply to --arrival all");
  ASSIGN_OR_RETURN(const loadgen::Slo slo, loadgen::ParseSlo(a.slo));

  // Prices: read when devices are named (an error then names the file); otherwise unpriced.
  std::optional<planner::PriceTable> prices;
  loadgen::CostInfo cost;
  if (!a.compute_device.empty()) {
    absl::StatusOr<planner::PriceTable> t = planner::LoadPriceTable(a.prices);
    if (!t.ok()) return Annotate(t.status(), "--prices");
    prices = *std::move(t);
    ASSIGN_OR_RETURN(
        const planner::DevicesCost c,
        planner::PriceDevices(*prices, a.compute_device, a.compute_count, a.memory_device, a.memory_count));
    cost = {true, c.description, c.usd_per_hour, c.table_path, c.table_date, c.any_estimate, c.any_amortized};
  } else if (!a.memory_device.empty() || a.memory_count > 0) {
    return absl::InvalidArgumentError("--memory-device and --memory-count need --compute-device");
  }

  // The model's shape (vocabulary, context, planner), and the target.
  std::unique_ptr<WeightSource> source;
  std::optional<ModelSpec> spec;
  std::string model_path = a.model;
  std::optional<Config> deploy_config;
  if (!a.deploy.empty()) {
    std::vector<std::string> sets = a.sets;
    if (!a.model.empty()) sets.push_back("model.path=" + a.model);
    ASSIGN_OR_RETURN(Config c, LoadConfigFile(DeploySchema(), a.deploy, sets));
    model_path = c.GetString("model.path");
    a.weight_seed = static_cast<uint64_t>(c.GetInt("model.weight_seed"));
    deploy_config = std::move(c);
  }
  if (!model_path.empty()) {
    ASSIGN_OR_RETURN(source, OpenModel(model_path, a.weight_seed));
    spec = source->spec();
  }
  loadgen::TokenSpace tokens;
  if (spec) {
    tokens.vocab_size = spec->vocab_size;
    tokens.avoid = spec->eos_token_ids;
    tokens.first_token_id = static_cast<int32_t>(std::min<int64_t>(3, spec->vocab_size - 1));
    if (a.max_context == 0) a.max_context = spec->max_position;
  }
  if (a.vocab_size > 0) tokens.vocab_size = a.vocab_size;

  std::error_code ec;
  std::filesystem::create_directories(a.out, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("--out ", a.out, ": ", ec.message()));

  std::unique_ptr<Engine> engine;
  ProcessGroup group;
  loadgen::HttpTarget http{a.url, a.served_model, a.api_key};
  std::string target_name;
  if (!a.deploy.empty()) {
    const std::string ready = (std::filesystem::absolute(a.out) / "deploy.url").string();
    const std::string log = (std::filesystem::absolute(a.out) / "deploy.log").string();
    std::filesystem::remove(ready, ec);
    std::vector<std::string> argv = {
        SelfPath(),     "serve", "--deploy", std::filesystem::absolute(a.deploy).string(),
        "--ready-file", ready,   "--set",    "api.port=0",
        "--log-level",  "info"};
    if (!a.model.empty()) argv.insert(argv.end(), {"--model", a.model});
    for (const std::string& s : a.sets) argv.insert(argv.end(), {"--set", s});
    std::fprintf(stderr, "tandem bench: starting the deployment %s (log %s)\n", a.deploy.c_str(),
                 log.c_str());
    RETURN_IF_ERROR(group.Start("serve", argv, log));
    ASSIGN_OR_RETURN(
        std::string url,
        group.WaitReady("serve", ready, absl::Seconds(deploy_config->GetDouble("launch.startup_timeout_s"))));
    while (!url.empty() && (url.back() == '\n' || url.back() == '\r')) url.pop_back();
    http.url = url;  // the API base ("http://127.0.0.1:PORT" or ".../v1"); /v1 is the default path
    http.api_key = deploy_config->GetString("api.key");
    target_name = absl::StrCat("deployment ", a.deploy, " over HTTP (", http.url, ")");
    if (a.max_concurrency < 0) a.max_concurrency = 256;
  } else if (!a.url.empty()) {
    target_name = absl::StrCat("endpoint ", a.url);
    if (a.max_concurrency < 0) a.max_concurrency = 256;
  } else {
    std::vector<std::string> sets = a.sets;
    if (!a.device.empty()) sets.push_back("runtime.device=" + a.device);
    ASSIGN_OR_RETURN(const Config config, a.config_file.empty()
                                              ? LoadConfig(BenchEngineSchema(), "", "", sets)
                                              : LoadConfigFile(BenchEngineSchema(), a.config_file, sets));
    ASSIGN_OR_RETURN(engine, ColocatedEngine::Create(*source, EngineOptionsFromConfig(config)));
    target_name = absl::StrCat("colocated engine in process on ", engine->device());
    if (a.max_concurrency < 0) a.max_concurrency = 0;
  }

  auto run_once = [&](const loadgen::Workload& w,
                      const loadgen::RunOptions& o) -> absl::StatusOr<loadgen::RunResult> {
    if (engine) return loadgen::RunOnEngine(*engine, w, o);
    return loadgen::RunOnHttp(http, w, o);
  };
  auto stop = [] { return TerminationSignal() != 0; };

  // Warm-up: a few short requests, not measured.
  if (a.warmup > 0) {
    loadgen::TokenSpace wt = tokens;
    wt.seed = a.seed ^ 0xa11ce;
    const loadgen::Workload w = loadgen::MakeFixedWorkload(a.warmup, 16, 4, wt);
    loadgen::RunOptions o;
    o.arrivals.assign(w.requests.size(), 0.0);
    o.stop_requested = stop;
    ASSIGN_OR_RETURN(const loadgen::RunResult r, run_once(w, o));
    for (const loadgen::RequestTiming& t : r.timings)
      if (!t.error.empty()) return absl::UnavailableError(absl::StrCat("warm-up request failed: ", t.error));
  }

  loadgen::BenchReport report;
  report.started_at = Now();
  report.model = model_path.empty() ? "(unknown)" : model_path;
  report.target = target_name;
  report.slo = slo;
  report.cost = cost;
  report.command = CommandLine();
  std::vector<loadgen::ArrivalSpec> specs;
  if (rates.empty()) {
    specs.push_back({kind, 0, a.time_scale, a.burstiness, a.seed});
  } else {
    for (double r : rates) specs.push_back({kind, r, a.time_scale, a.burstiness, a.seed});
  }
  const std::string json_path = (std::filesystem::path(a.out) / "bench.json").string();
  const std::string table_path = (std::filesystem::path(a.out) / "summary.txt").string();
  for (size_t run = 0; run < specs.size(); ++run) {
    bool from_trace = false;
    ASSIGN_OR_RETURN(const loadgen::Workload w, BuildWorkload(a, tokens, static_cast<int>(run), &from_trace));
    if (run == 0) {
      report.workload_name = w.name;
      report.notes = w.notes;
      report.workload_requests = static_cast<int64_t>(w.requests.size());
      double in = 0, out = 0;
      for (const loadgen::BenchRequest& r : w.requests) {
        in += static_cast<double>(r.prompt.size());
        out += static_cast<double>(r.max_tokens);
      }
      report.mean_input = w.requests.empty() ? 0 : in / static_cast<double>(w.requests.size());
      report.mean_output = w.requests.empty() ? 0 : out / static_cast<double>(w.requests.size());
      if (a.synthetic == "multi-turn")
        report.notes.push_back(
            "multi-turn: later turns carry the session's history before their new tokens "
            "(mean input above counts new tokens only)");
    }
    loadgen::RunOptions o;
    ASSIGN_OR_RETURN(o.arrivals, loadgen::ArrivalTimes(w, specs[run], from_trace));
    o.max_concurrency = a.max_concurrency;
    o.max_context = a.max_context;
    o.seed = a.seed;
    o.stop_requested = stop;
    loadgen::RunReport rr;
    rr.arrivals = specs[run];
    rr.label = specs[run].kind == loadgen::ArrivalKind::kAllAtOnce ? "all at once"
               : specs[run].rate > 0 ? absl::StrFormat("%g req/s", specs[run].rate)
                                     : absl::StrFormat("trace x%g", specs[run].time_scale);
    if (!a.quiet) o.on_progress = [&](const loadgen::ProgressInfo& p) { PrintProgress(rr.label, p); };
    ASSIGN_OR_RETURN(rr.result, run_once(w, o));
    if (!a.quiet) std::fprintf(stderr, "\n");
    rr.metrics = loadgen::ComputeMetrics(rr.result.timings, slo);
    report.interrupted = report.interrupted || rr.result.interrupted;
    report.runs.push_back(std::move(rr));
    if (report.interrupted) break;
  }
  if (engine == nullptr) group.StopAll(absl::Seconds(30));
  // The planner's prediction, for the first run's measured workload.
  const loadgen::RunReport& first = report.runs.front();
  const int64_t measured_batch =
      engine != nullptr && first.result.steps > 0
          ? std::max<int64_t>(1, std::llround(static_cast<double>(first.metrics.output_tokens) /
                                              static_cast<double>(first.result.steps)))
          : 0;
  report.prediction =
      Predict(a, spec ? &*spec : nullptr, first.metrics, prices ? &*prices : nullptr, slo, measured_batch);
  const std::string table = loadgen::ReportTable(report);
  RETURN_IF_ERROR(WriteText(json_path, loadgen::ReportJson(report)));
  RETURN_IF_ERROR(WriteText(table_path, table));
  std::fputs(table.c_str(), stdout);
  std::fflush(stdout);
  std::fprintf(stderr,
               "tandem bench: wrote %s and %s; plots: .cache/venv/bin/python bench/plot_bench.py %s\n",
               json_path.c_str(), table_path.c_str(), json_path.c_str());
  if (report.interrupted) return absl::CancelledError("interrupted; wrote what was measured so far");
  return absl::OkStatus();
}

}  // namespace

void AddBenchCommand(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Replay a workload against the colocated engine, a deployment on this host or an OpenAI-compatible\n"
      "endpoint, and report TTFT, TPOT, ITL, end-to-end latency, throughput, goodput, KV usage, prefix\n"
      "hits and tokens per dollar (a table on stdout; OUT/bench.json with every request's timings;\n"
      "bench/plot_bench.py draws the plots). Ctrl-C writes what was measured so far.\n"
      "Examples:\n"
      "  tandem bench --model small --synthetic fixed --num-requests 20 --input-len 64 --output-len 16\n"
      "  tandem bench --model llama3-8b --trace azure_llm_conv_2023.csv --num-requests 500 --time-scale 0.1 "
      "\\\n"
      "      --slo ttft=2,tpot=100ms --compute-device h100\n"
      "  tandem bench --model small --synthetic shared-prefix --prefix-len 256 --input-len 32 \\\n"
      "      --arrival poisson --rate 2,4,8 --burstiness 0.5\n"
      "  tandem bench --deploy deploy/examples/gpu.yaml --model llama3-8b --trace "
      "mooncake_conversation_trace.jsonl\n"
      "  tandem bench --url http://127.0.0.1:8000/v1 --model llama3-8b --synthetic fixed --num-requests 100");
  cmd->option_defaults()->always_capture_default();
  // target
  cmd->add_option(
      "--model", a->model,
      "checkpoint directory, GGUF file or preset: the colocated engine in this process (with --deploy: "
      "overrides model.path; with --url: the served model's shape, for token ids and the planner)");
  cmd->add_option(
         "--deploy", a->deploy,
         "start this deployment on this host (tandem serve --deploy, on any free port) and measure it over "
         "its HTTP API; stopped afterwards (its log: OUT/deploy.log)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--url", a->url, "an OpenAI-compatible endpoint: http://host:port[/v1]");
  cmd->add_option("--served-model", a->served_model,
                  "with --url: the model name to send (default: the first listed)");
  cmd->add_option("--api-key", a->api_key, "with --url: bearer token");
  cmd->add_option("--config", a->config_file, "engine YAML (runtime.*, scheduler.*, kv.*) for --model")
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", a->sets, "override a setting, e.g. --set kv.capacity_tokens=65536 (repeatable)");
  cmd->add_option("--device", a->device, "cpu, cuda, cuda:N or auto (runtime.device) for --model");
  cmd->add_option("--weight-seed", a->weight_seed, "seed of a preset's random weights");
  // workload
  cmd->add_option(
         "--trace", a->trace,
         "a trace: Azure LLM 2023 CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Mooncake JSON lines "
         "(timestamp ms, input_length, output_length, hash_ids: prefix blocks become identical tokens)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--synthetic", a->synthetic,
                  "fixed (--input-len, --output-len), shared-prefix (--prefix-len shared + --input-len own), "
                  "multi-turn (--turns per session, --input-len new tokens per turn, --think-time)");
  cmd->add_option("--num-requests", a->num_requests,
                  "requests (trace rows from --trace-skip; 0: the whole trace)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--trace-skip", a->trace_skip, "trace rows to skip first")->check(CLI::NonNegativeNumber);
  cmd->add_option("--input-len", a->input_len, "synthetic: prompt tokens (shared-prefix: the suffix)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--output-len", a->output_len, "synthetic: output tokens")->check(CLI::PositiveNumber);
  cmd->add_option("--prefix-len", a->prefix_len, "synthetic: tokens of the shared system prompt")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--turns", a->turns, "multi-turn: turns per session")->check(CLI::PositiveNumber);
  cmd->add_option("--think-time", a->think_time, "multi-turn: seconds between a turn's end and the next turn")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option(
         "--length-scale", a->length_scale,
         "multiply trace lengths (and Mooncake's 512-token blocks) by this, e.g. 0.125 for a small model")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-input", a->max_input, "cut prompts to this many tokens (0: no cap)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-output", a->max_output, "cap outputs at this many tokens (0: no cap)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-context", a->max_context,
                  "prompt + output at most (default: the model's max_position; prompts are cut to fit)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--vocab-size", a->vocab_size, "token ids below this (default: the model's vocabulary)")
      ->check(CLI::NonNegativeNumber);
  // arrivals
  cmd->add_option("--arrival", a->arrival,
                  "trace (the trace's timestamps), poisson, or all (at once; default "
                  "without a trace)");
  cmd->add_option(
      "--rate", a->rates,
      "requests/s; a comma list sweeps (one run each). poisson: required; trace: rescale the trace's "
      "timestamps to this mean rate");
  cmd->add_option("--burstiness", a->burstiness,
                  "poisson: gamma shape of the gaps (1: Poisson; < 1 burstier)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--time-scale", a->time_scale,
                  "trace: multiply the trace's time offsets (0.1: ten times faster)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", a->seed, "seed of prompts, arrivals and sampling");
  cmd->add_option(
      "--max-concurrency", a->max_concurrency,
      "requests in flight at most (default: no limit in process, 256 over HTTP); more wait, their wait "
      "counted in TTFT");
  cmd->add_option("--warmup", a->warmup, "short requests sent first, not measured")
      ->check(CLI::NonNegativeNumber);
  // results
  cmd->add_option("--slo", a->slo, "goodput SLOs: ttft=2,tpot=100ms,e2e=30 (seconds unless 'ms')");
  cmd->add_option("--out", a->out, "directory for bench.json (every request's timings) and summary.txt");
  cmd->add_option("--prices", a->prices, "the price table (YAML, planner/devices.h)");
  cmd->add_option("--compute-device", a->compute_device,
                  "price (and predict) the run on this device offer of --prices, e.g. h100, h100@market, "
                  "a100-80g@purchase");
  cmd->add_option("--compute-count", a->compute_count, "compute devices used")->check(CLI::PositiveNumber);
  cmd->add_option("--memory-device", a->memory_device, "memory devices' offer (a deployment's memory ranks)");
  cmd->add_option("--memory-count", a->memory_count, "memory devices used")->check(CLI::NonNegativeNumber);
  cmd->add_option("--log-level", a->log_level, "debug, info, warn or error");
  cmd->add_flag("--quiet", a->quiet, "no progress line on stderr");
  cmd->callback([a] {
    absl::Status st = RunBench(*a);
    if (!st.ok()) Fail("bench", st);
  });
}

}  // namespace tandem::cli
