// `tandem generate`: run requests through an Engine (compute_node/engine.h) and print the tokens:
// the colocated engine in this process, or with --deploy a deployment on this host whose compute
// rank 0 runs them through the same RunRequests (cli/rank_cmds.cc) and hands back a results file.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/prompts.h"
#include "cli/run_files.h"
#include "colocated/engine.h"
#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/weights.h"
#include "deploy/deployment.h"
#include "nlohmann/json.hpp"
#include "text/text_model.h"
#include "tokenizer/tokenizer.h"

namespace tandem::cli {

void Fail(const std::string& command, const absl::Status& status) {
  std::fprintf(stderr, "tandem %s: %s\n", command.c_str(), std::string(status.message()).c_str());
  throw CLI::RuntimeError(1);
}

absl::StatusOr<std::vector<GenerationResult>> RunRequests(Engine& engine,
                                                          std::vector<GenerationRequest> requests,
                                                          RunStats* stats,
                                                          const std::function<absl::Status()>& before_step) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<std::vector<GenerationResult>> results =
      engine.GenerateAll(std::move(requests), before_step);
  stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats->steps = engine.stats().steps;
  stats->device = engine.device();
  stats->tiers = TierSummary(engine.stats());
  return results;
}

namespace {

struct GenerateArgs {
  std::string model;
  std::string prompt_ids;
  std::string prompt;              // text
  std::string chat;                // a user message, through the chat template
  std::string system;              // with --chat: a system message first
  std::vector<std::string> stops;  // stop strings
  std::string prompts_file;
  int64_t max_tokens = 16;
  double temperature = 0.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  uint64_t seed = 0;
  uint64_t weight_seed = 0;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  bool json = false;
  bool ignore_eos = false;
  std::string config_file;
  std::vector<std::string> sets;
  std::string log_level = "info";
  std::string device;
  std::string deploy;
};

ConfigSchema& EngineSchema() {
  static ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    AddEngineKnobs(s);
    return s;
  }();
  return *schema;
}

// The model's tokenizer and chat template, when it ships them (text::TextModel). nullptr for a
// preset or a checkpoint without a tokenizer: then only token ids go in and come out. Text input
// (`needed`) without one is an error naming the model.
absl::StatusOr<std::unique_ptr<text::TextModel>> LoadText(const std::string& model, bool needed) {
  absl::StatusOr<std::unique_ptr<text::TextModel>> tm = text::TextModel::Load(model);
  if (tm.ok()) return tm;
  if (needed) return Annotate(tm.status(), "text prompts need the model's tokenizer");
  if (!absl::IsNotFound(tm.status()))
    TANDEM_LOG_WARN("generate", "printing token ids only: ", tm.status().message());
  return std::unique_ptr<text::TextModel>();
}

bool NeedsText(const GenerateArgs& a, const std::vector<PromptSpec>& specs) {
  if (!a.stops.empty()) return true;
  for (const PromptSpec& p : specs)
    if (p.prompt || !p.messages.empty()) return true;
  return false;
}

absl::StatusOr<std::vector<PromptSpec>> BuildSpecs(const GenerateArgs& a) {
  std::vector<PromptSpec> specs;
  if (!a.prompt_ids.empty()) {
    absl::StatusOr<std::vector<int32_t>> ids = ParseIdList(a.prompt_ids);
    if (!ids.ok()) return Annotate(ids.status(), "--prompt-ids");
    specs.push_back({.prompt_ids = *std::move(ids)});
  } else if (!a.prompt.empty()) {
    specs.push_back({.prompt = a.prompt});
  } else if (!a.chat.empty()) {
    PromptSpec p;
    if (!a.system.empty()) p.messages.emplace_back("system", a.system);
    p.messages.emplace_back("user", a.chat);
    specs.push_back(std::move(p));
  } else {
    ASSIGN_OR_RETURN(specs, ReadPromptsFile(a.prompts_file));
  }
  return specs;
}

absl::StatusOr<std::vector<GenerationRequest>> BuildRequests(const GenerateArgs& a,
                                                             std::vector<PromptSpec> specs,
                                                             const text::TextModel* tm) {
  for (size_t i = 0; i < specs.size(); ++i) {
    PromptSpec& p = specs[i];
    const std::string which = specs.size() == 1 ? std::string("the prompt") : absl::StrCat("prompt ", i);
    if (p.prompt) {
      absl::StatusOr<std::vector<int32_t>> ids = tm->EncodePrompt(*p.prompt);
      if (!ids.ok()) return Annotate(ids.status(), which);
      p.prompt_ids = *std::move(ids);
    } else if (!p.messages.empty()) {
      std::vector<ChatMessage> messages;
      for (const auto& [role, content] : p.messages) messages.push_back({role, content});
      absl::StatusOr<std::vector<int32_t>> ids = tm->EncodeChat(messages);
      if (!ids.ok()) return Annotate(ids.status(), which);
      p.prompt_ids = *std::move(ids);
    }
  }
  GenerationRequest d;
  d.max_tokens = a.max_tokens;
  d.sampling.temperature = static_cast<float>(a.temperature);
  d.sampling.top_k = static_cast<int32_t>(a.top_k);
  d.sampling.top_p = static_cast<float>(a.top_p);
  d.sampling.seed = a.seed;
  d.ignore_eos = a.ignore_eos;
  d.top_logprobs = static_cast<int32_t>(a.top_logprobs);
  return RequestsFromPrompts(specs, d);
}

// Runs requests with stop strings: the engine is stepped here, each live request's new tokens are
// decoded as they come, and one whose text reaches a stop string is cancelled at once (its result
// says finish_reason "stop"); `texts` gets each output, ending before the stop string.
absl::StatusOr<std::vector<GenerationResult>> RunWithStops(Engine& engine,
                                                           std::vector<GenerationRequest> requests,
                                                           const std::vector<std::string>& stops,
                                                           const text::TextModel& tm,
                                                           std::vector<std::string>* texts, RunStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  struct Stream {
    size_t index;
    tokenizer::IncrementalDecoder decoder;
    text::StopMatcher stop;
    size_t seen = 0;
  };
  std::map<int64_t, Stream> live;
  std::vector<GenerationResult> results(requests.size());
  texts->assign(requests.size(), "");
  for (size_t i = 0; i < requests.size(); ++i)
    RETURN_IF_ERROR(Annotate(engine.Check(requests[i]), absl::StrCat("request ", i)));
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSIGN_OR_RETURN(const int64_t id, engine.Submit(std::move(requests[i])));
    live.emplace(id, Stream{i, tokenizer::IncrementalDecoder(tm.tokenizer()), text::StopMatcher(stops)});
  }
  // Feeds a request's tokens from `seen` on; true when its text reached a stop string.
  auto feed = [&](Stream& s, const std::vector<int32_t>& tokens) -> absl::StatusOr<bool> {
    for (; s.seen < tokens.size() && !s.stop.stopped(); ++s.seen) {
      ASSIGN_OR_RETURN(const std::string piece, s.decoder.Add(tokens[s.seen]));
      (*texts)[s.index] += s.stop.Add(piece);
    }
    return s.stop.stopped();
  };
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  while (!engine.Idle()) {
    finished.clear();
    RETURN_IF_ERROR(engine.Step(&finished));
    for (auto& [id, r] : finished) {
      Stream& s = live.at(id);
      ASSIGN_OR_RETURN(const bool stopped, feed(s, r.token_ids));
      if (stopped) {
        r.finish_reason = "stop";
      } else {
        (*texts)[s.index] += s.stop.Add(s.decoder.Flush());
        (*texts)[s.index] += s.stop.Flush();
      }
      results[s.index] = std::move(r);
      live.erase(id);
    }
    std::vector<int64_t> ended;
    for (auto& [id, s] : live) {
      const GenerationResult* p = engine.Progress(id);
      if (p == nullptr) continue;
      ASSIGN_OR_RETURN(const bool stopped, feed(s, p->token_ids));
      if (!stopped) continue;
      ASSIGN_OR_RETURN(GenerationResult r, engine.Cancel(id));
      r.finish_reason = "stop";
      results[s.index] = std::move(r);
      ended.push_back(id);
    }
    for (int64_t id : ended) live.erase(id);
  }
  stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stats->steps = engine.stats().steps;
  stats->device = engine.device();
  stats->tiers = TierSummary(engine.stats());
  return results;
}

// The text of each result (special tokens left out), where the model has a tokenizer.
absl::StatusOr<std::vector<std::string>> DecodeAll(const text::TextModel* tm,
                                                   const std::vector<GenerationResult>& results) {
  std::vector<std::string> texts;
  if (tm == nullptr) return texts;
  for (const GenerationResult& r : results) {
    ASSIGN_OR_RETURN(std::string t, tm->tokenizer().Decode(r.token_ids, /*skip_special=*/true));
    texts.push_back(std::move(t));
  }
  return texts;
}

// Prints every result (a request that ended with an error as its error line) and the summary;
// an error when any request failed.
absl::Status PrintResults(const GenerateArgs& a, const std::vector<GenerationResult>& results,
                          const std::vector<std::string>& texts, const RunStats& stats) {
  int64_t failed = 0;
  int64_t generated = 0, prompt_tokens = 0, cached = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const GenerationResult& r = results[i];
    generated += static_cast<int64_t>(r.token_ids.size());
    prompt_tokens += r.prompt_tokens;
    cached += r.cached_tokens;
    if (!r.error.ok()) ++failed;
    if (a.json) {
      nlohmann::json j;
      j["index"] = i;
      if (i < texts.size()) j["text"] = texts[i];
      j["token_ids"] = r.token_ids;
      if (a.logprobs) j["logprobs"] = r.logprobs;
      if (!r.top_logprobs.empty()) j["top_logprobs"] = TopLogprobsJson(r.top_logprobs);
      j["finish_reason"] = r.finish_reason;
      if (!r.error.ok()) j["error"] = std::string(r.error.message());
      j["usage"] = {{"prompt_tokens", r.prompt_tokens},
                    {"completion_tokens", static_cast<int64_t>(r.token_ids.size())},
                    {"cached_tokens", r.cached_tokens}};
      std::cout << j.dump() << "\n";
    } else if (!r.error.ok()) {
      std::cout << "[" << i << "] error: " << r.error.message() << "\n";
    } else if (i < texts.size()) {
      if (results.size() > 1) std::cout << "[" << i << "] ";
      std::cout << texts[i] << "\n";
      if (results.size() > 1) std::cout << "\n";
    } else {
      std::cout << "[" << i << "] " << r.prompt_tokens << " prompt tokens -> " << r.token_ids.size()
                << " tokens (" << r.finish_reason << "): " << absl::StrJoin(r.token_ids, " ") << "\n";
      if (a.logprobs) {
        std::cout << "    logprobs: " << absl::StrJoin(r.logprobs, " ", [](std::string* out, float v) {
          absl::StrAppend(out, absl::StrFormat("%.4f", v));
        }) << "\n";
      }
    }
  }
  std::cout.flush();
  std::fprintf(stderr,
               "tandem generate: %zu requests, %lld prompt (%lld cached) + %lld generated tokens in %.3f s "
               "(%.1f generated tok/s, %.1f total tok/s, %lld steps, device %s)\n",
               results.size(), static_cast<long long>(prompt_tokens), static_cast<long long>(cached),
               static_cast<long long>(generated), stats.seconds, generated / stats.seconds,
               (generated + prompt_tokens) / stats.seconds, static_cast<long long>(stats.steps),
               stats.device.c_str());
  if (!stats.pipeline.empty()) std::fprintf(stderr, "tandem generate: pipeline %s\n", stats.pipeline.c_str());
  if (!stats.tiers.empty()) std::fprintf(stderr, "tandem generate: KV tiers %s\n", stats.tiers.c_str());
  if (!stats.recovery.empty())
    std::fprintf(stderr, "tandem generate: recovery: %s\n", stats.recovery.c_str());
  if (failed > 0) {
    return absl::UnavailableError(
        absl::StrCat(failed, " of ", results.size(), " request(s) failed (see their error lines)"));
  }
  return absl::OkStatus();
}

// Runs the requests through a deployment started (and stopped) for them.
absl::Status RunDeployed(const GenerateArgs& a, std::vector<std::string> sets) {
  if (!a.model.empty()) sets.push_back("model.path=" + a.model);
  if (a.weight_seed != 0) sets.push_back(absl::StrCat("model.weight_seed=", a.weight_seed));
  if (!a.device.empty()) {
    sets.push_back("compute.device=" + a.device);
    sets.push_back("memory.devices=" + a.device);
  }
  ASSIGN_OR_RETURN(const Config config, LoadConfigFile(DeploySchema(), a.deploy, sets));
  for (const std::string& line : config.NonDefault()) TANDEM_LOG_INFO("config", line);
  if (!a.stops.empty()) return absl::UnimplementedError("--stop with --deploy is not supported yet");
  ASSIGN_OR_RETURN(std::vector<PromptSpec> specs, BuildSpecs(a));
  ASSIGN_OR_RETURN(std::unique_ptr<text::TextModel> tm,
                   LoadText(config.GetString("model.path"), NeedsText(a, specs)));
  ASSIGN_OR_RETURN(std::vector<GenerationRequest> requests, BuildRequests(a, std::move(specs), tm.get()));
  ASSIGN_OR_RETURN(
      std::unique_ptr<WeightSource> source,
      OpenModel(config.GetString("model.path"), static_cast<uint64_t>(config.GetInt("model.weight_seed"))));
  ASSIGN_OR_RETURN(const DeployPlan plan, ResolveDeployment(config, source->spec()));
  // Refuse bad requests here, before any rank starts (the KV sizes are checked by the ranks).
  const Controller check(source->spec(), {INT64_MAX}, {.max_batch_size = 1, .max_tokens_per_step = 1});
  for (size_t i = 0; i < requests.size(); ++i) {
    RETURN_IF_ERROR(Annotate(check.Check(requests[i]), absl::StrCat("request ", i)));
  }
  std::error_code ec;
  std::filesystem::create_directories(plan.run_dir, ec);
  const std::string req = (std::filesystem::path(plan.run_dir) / "requests.jsonl").string();
  const std::string res = (std::filesystem::path(plan.run_dir) / "results.jsonl").string();
  std::filesystem::remove(res, ec);
  RETURN_IF_ERROR(WriteRequestsFile(req, requests));
  const absl::Status launched = Launch(
      config, plan,
      {.tandem_binary = SelfPath(), .log_level = a.log_level, .requests_file = req, .results_file = res});
  std::vector<GenerationResult> results;
  RunStats stats;
  if (!launched.ok()) {
    // Compute rank 0 that lost a rank it cannot do without writes an error line per request
    // before it exits: print them, then fail with the launcher's message.
    if (!std::filesystem::exists(res, ec) || !ReadResultsFile(res, &results, &stats).ok() ||
        results.size() != requests.size()) {
      return launched;
    }
    stats.device =
        absl::StrCat("disaggregated: ", stats.device, " + ", plan.memory_devices.size(), " memory rank(s)");
    (void)PrintResults(a, results, {}, stats);
    return launched;
  }
  RETURN_IF_ERROR(ReadResultsFile(res, &results, &stats));
  if (results.size() != requests.size()) {
    return absl::DataLossError(
        absl::StrCat(res, ": ", results.size(), " results for ", requests.size(), " requests"));
  }
  stats.device =
      absl::StrCat("disaggregated: ", stats.device, " + ", plan.memory_devices.size(), " memory rank(s)");
  ASSIGN_OR_RETURN(const std::vector<std::string> texts, DecodeAll(tm.get(), results));
  return PrintResults(a, results, texts, stats);
}

absl::Status RunGenerate(const GenerateArgs& a) {
  const std::optional<LogLevel> level = ParseLogLevel(a.log_level);
  if (!level)
    return absl::InvalidArgumentError(absl::StrCat("--log-level: unknown level \"", a.log_level, "\""));
  InitLogging("generate", *level);
  if (!a.deploy.empty()) return RunDeployed(a, a.sets);
  if (a.model.empty()) return absl::InvalidArgumentError("--model is required (without --deploy)");
  std::vector<std::string> sets = a.sets;
  if (!a.device.empty()) sets.push_back("runtime.device=" + a.device);  // --device wins
  absl::StatusOr<Config> config = a.config_file.empty() ? LoadConfig(EngineSchema(), "", "", sets)
                                                        : LoadConfigFile(EngineSchema(), a.config_file, sets);
  RETURN_IF_ERROR(config.status());
  for (const std::string& line : config->NonDefault()) TANDEM_LOG_INFO("config", line);
  ASSIGN_OR_RETURN(std::vector<PromptSpec> specs, BuildSpecs(a));
  ASSIGN_OR_RETURN(std::unique_ptr<text::TextModel> tm, LoadText(a.model, NeedsText(a, specs)));
  ASSIGN_OR_RETURN(std::vector<GenerationRequest> requests, BuildRequests(a, std::move(specs), tm.get()));

  const auto t_load = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<WeightSource> source, OpenModel(a.model, a.weight_seed));
  TANDEM_LOG_INFO("generate", "loading ", source->Describe());
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                   ColocatedEngine::Create(*source, EngineOptionsFromConfig(*config)));
  TANDEM_LOG_INFO(
      "generate",
      absl::StrFormat("model ready in %.2f s",
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count()));

  RunStats stats;
  std::vector<GenerationResult> results;
  std::vector<std::string> texts;
  if (!a.stops.empty()) {
    ASSIGN_OR_RETURN(results, RunWithStops(*engine, std::move(requests), a.stops, *tm, &texts, &stats));
  } else {
    ASSIGN_OR_RETURN(results, RunRequests(*engine, std::move(requests), &stats));
    ASSIGN_OR_RETURN(texts, DecodeAll(tm.get(), results));
  }
  return PrintResults(a, results, texts, stats);
}

}  // namespace

void AddGenerateCommand(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Generate tokens for one or many prompts in one process (the colocated engine).\n"
      "Examples:\n"
      "  tandem generate --model SmolLM2-135M-Instruct.Q4_1.gguf --chat 'What is the capital of France?'\n"
      "  tandem generate --model small --prompt-ids 1,15043,3186 --max-tokens 32\n"
      "  tandem generate --model /models/Llama-3.2-1B --prompts-file prompts.jsonl --json --logprobs\n"
      "  tandem generate --deploy deploy/examples/cpu.yaml --prompt-ids 1,2,3   (disaggregated, on this "
      "host)");
  cmd->add_option(
      "--model", a->model,
      "checkpoint directory (Hugging Face layout) or preset name (with --deploy: overrides model.path)");
  auto* ids = cmd->add_option("--prompt-ids", a->prompt_ids, "comma-separated prompt token ids, e.g. 1,2,3");
  auto* text = cmd->add_option("--prompt", a->prompt, "prompt text (the model's tokenizer encodes it)");
  auto* chat = cmd->add_option("--chat", a->chat, "a user message, formatted by the model's chat template");
  cmd->add_option("--system", a->system, "with --chat: a system message before it")->needs(chat);
  cmd->add_option("--stop", a->stops,
                  "stop when the generated text contains this string (repeatable; the text ends before it)");
  auto* file =
      cmd->add_option("--prompts-file", a->prompts_file,
                      "JSON lines: {\"prompt_ids\": [...]} or {\"prompt\": \"text\"} or {\"messages\": "
                      "[{\"role\", \"content\"}]}, with \"max_tokens\"?, \"temperature\"?, \"top_k\"?, "
                      "\"top_p\"?, \"seed\"?; results print in input order");
  ids->excludes(file)->excludes(text)->excludes(chat);
  text->excludes(file)->excludes(chat);
  chat->excludes(file);
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate per request at most")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  cmd->add_option("--temperature", a->temperature, "sampling temperature; 0 is greedy")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--top-k", a->top_k, "keep the k most likely tokens; 0 keeps all")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", a->top_p, "nucleus sampling mass in (0, 1]; 1 keeps all")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  cmd->add_option("--seed", a->seed, "sampling seed (per request; same seed, same tokens)")
      ->capture_default_str();
  cmd->add_option("--weight-seed", a->weight_seed, "seed of a preset's random weights")
      ->capture_default_str();
  cmd->add_flag("--logprobs", a->logprobs, "also print the log-probability of each generated token");
  cmd->add_option(
         "--top-logprobs", a->top_logprobs,
         "with --json: also print each generated token's K most probable alternatives "
         "(top_logprobs: [[{token, logprob}, ...], ...]); a prompts file's \"top_logprobs\" overrides it")
      ->check(CLI::Range(0, static_cast<int>(kMaxTopLogprobs)));
  cmd->add_flag(
      "--json", a->json,
      "print one JSON object per request: token_ids, logprobs (with --logprobs), finish_reason, usage");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "do not stop at end-of-sequence tokens");
  auto* config = cmd->add_option("--config", a->config_file,
                                 "YAML file with scheduler.* and kv.* settings (see `tandem config help`)")
                     ->check(CLI::ExistingFile);
  cmd->add_option(
         "--deploy", a->deploy,
         "run through a disaggregated deployment on this host, started from this YAML and stopped after "
         "(compute rank 0 and memory ranks as separate processes; see deploy/examples/)")
      ->check(CLI::ExistingFile)
      ->excludes(config);
  cmd->add_option("--set", a->sets, "override a setting: --set scheduler.max_batch_size=8 (repeatable)");
  cmd->add_option("--device", a->device,
                  "cpu, cuda, cuda:N or auto (cuda:0 when a GPU is present; the default, runtime.device)");
  cmd->add_option("--log-level", a->log_level, "debug, info, warn or error")->capture_default_str();
  cmd->callback([a] {
    if (a->prompt_ids.empty() && a->prompts_file.empty() && a->prompt.empty() && a->chat.empty()) {
      Fail("generate",
           absl::InvalidArgumentError(
               "one of --prompt, --chat, --prompt-ids or --prompts-file is required (see --help)"));
    }
    absl::Status st = RunGenerate(*a);
    if (!st.ok()) Fail("generate", st);
  });
}

}  // namespace tandem::cli
