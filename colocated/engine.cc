#include "colocated/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cuda/device.h"

namespace tandem {

namespace cpu = kernels::cpu;

void AddEngineKnobs(ConfigSchema* schema) {
  const EngineOptions d;
  schema->String("runtime.device", d.device, "cpu, cuda, cuda:N, or auto (cuda:0 when a GPU is present)")
      .Int("scheduler.max_batch_size", d.max_batch_size,
           "requests batched in one step; 0: as many as the KV cache holds (at most max_tokens_per_step)", 0,
           65536)
      .Int("scheduler.max_tokens_per_step", d.max_tokens_per_step,
           "decode tokens plus prefill-chunk tokens in one step (>= max_batch_size)", 1, 1 << 20)
      .Int("kv.capacity_tokens", d.kv_capacity_tokens,
           "KV cache size in tokens; 0 sizes it from free memory (kv.memory_fraction)", 0, 1LL << 31)
      .Double("kv.memory_fraction", d.kv_memory_fraction,
              "share of free device (or host) memory, after the weights, given to the KV cache when sized "
              "automatically",
              0.01, 0.98);
}

EngineOptions EngineOptionsFromConfig(const Config& config) {
  EngineOptions o;
  o.device = config.GetString("runtime.device");
  o.max_batch_size = config.GetInt("scheduler.max_batch_size");
  o.max_tokens_per_step = config.GetInt("scheduler.max_tokens_per_step");
  o.kv_capacity_tokens = config.GetInt("kv.capacity_tokens");
  o.kv_memory_fraction = config.GetDouble("kv.memory_fraction");
  return o;
}

namespace {

absl::Status ValidateSampling(const cpu::SamplingParams& s) {
  if (!std::isfinite(s.temperature) || s.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0, got ", s.temperature));
  }
  if (s.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", s.top_k));
  if (!(s.top_p > 0 && s.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", s.top_p));
  }
  return absl::OkStatus();
}

// "cpu" -> -1; "cuda" -> 0; "cuda:N" -> N; "auto" -> 0 if a CUDA device is present and the CUDA
// runner supports the model, else -1.
absl::StatusOr<int> ResolveDevice(const std::string& device, const ModelSpec& spec) {
  if (device == "cpu") return -1;
  if (device == "auto") {
    absl::StatusOr<int> n = kernels::CudaDeviceCount();
    if (!n.ok() || *n == 0) return -1;
    const std::string why = CudaRunnerUnsupported(spec);
    if (!why.empty()) {
      TANDEM_LOG_WARN("engine", "running on the CPU although a GPU is present: ", why);
      return -1;
    }
    return 0;
  }
  int index = 0;
  if (device == "cuda" ||
      (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &index) && index >= 0)) {
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("runtime.device: expected cpu, cuda, cuda:N or auto, got \"", device, "\""));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ColocatedEngine>> ColocatedEngine::Create(const WeightSource& source,
                                                                         const EngineOptions& requested) {
  EngineOptions options = requested;
  if (options.max_batch_size < 0) return absl::InvalidArgumentError("scheduler.max_batch_size must be >= 0");
  if (options.max_tokens_per_step < 1)
    return absl::InvalidArgumentError("scheduler.max_tokens_per_step must be >= 1");
  if (options.max_batch_size == 0) options.max_batch_size = options.max_tokens_per_step;  // the KV limits it
  if (options.max_tokens_per_step < options.max_batch_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("scheduler.max_tokens_per_step (", options.max_tokens_per_step,
                     ") must be at least scheduler.max_batch_size (", options.max_batch_size,
                     "): every decoding request needs one token per step"));
  }
  ASSIGN_OR_RETURN(const int device, ResolveDevice(options.device, source.spec()));
  const RunnerOptions ro{.max_batch_size = options.max_batch_size,
                         .max_tokens_per_step = options.max_tokens_per_step,
                         .kv_capacity_tokens = options.kv_capacity_tokens,
                         .kv_memory_fraction = options.kv_memory_fraction,
                         .profile = options.profile};
  std::unique_ptr<ModelRunner> runner;
  if (device < 0) {
    ASSIGN_OR_RETURN(runner, CreateCpuRunner(source, ro));
  } else {
    ASSIGN_OR_RETURN(runner, CreateCudaRunner(source, ro, device));
  }
  return std::unique_ptr<ColocatedEngine>(new ColocatedEngine(std::move(runner), options));
}

ColocatedEngine::ColocatedEngine(std::unique_ptr<ModelRunner> runner, const EngineOptions& options)
    : runner_(std::move(runner)), options_(options), allocator_(runner_->kv_capacity()) {}

absl::StatusOr<int64_t> ColocatedEngine::Submit(GenerationRequest request) {
  const ModelSpec& s = spec();
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= s.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token ", i, " is ", t, ", outside the vocabulary [0, ", s.vocab_size, ")"));
    }
  }
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", request.max_tokens));
  }
  RETURN_IF_ERROR(ValidateSampling(request.sampling));
  const int64_t prompt_len = static_cast<int64_t>(request.prompt.size());
  if (prompt_len + request.max_tokens > s.max_position) {
    return absl::InvalidArgumentError(absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (",
                                                   request.max_tokens, ") exceeds the model's context of ",
                                                   s.max_position, " tokens"));
  }
  if (ContextNeed(request) > allocator_.num_slots()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", ContextNeed(request), " KV slots (prompt + max_tokens) but the KV cache holds ",
        allocator_.num_slots(), " tokens; raise kv.capacity_tokens or shorten the request"));
  }
  Live live;
  live.id = next_id_++;
  live.request = std::move(request);
  live.result.prompt_tokens = prompt_len;
  waiting_.push_back(std::move(live));
  return waiting_.back().id;
}

absl::Status ColocatedEngine::Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  const auto t0 = std::chrono::steady_clock::now();
  // Admission: FIFO, reserving each newcomer's whole context so nobody waits for KV later.
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_batch_size) {
    const int64_t need = ContextNeed(waiting_.front().request);
    if (allocator_.num_free() - reserved_ < need) break;
    reserved_ += need;
    running_.push_back(std::make_unique<Live>(std::move(waiting_.front())));
    waiting_.pop_front();
  }
  // Decode tokens first, then prefill chunks in admission order within the token budget.
  std::vector<Live*> batch;
  std::vector<int64_t> chunk;
  int64_t budget = options_.max_tokens_per_step;
  for (auto& live : running_) {
    if (live->prefilled == static_cast<int64_t>(live->request.prompt.size())) {
      batch.push_back(live.get());
      chunk.push_back(1);
      --budget;
    }
  }
  for (auto& live : running_) {
    const int64_t left = static_cast<int64_t>(live->request.prompt.size()) - live->prefilled;
    if (left > 0 && budget > 0) {
      const int64_t n = std::min(left, budget);
      batch.push_back(live.get());
      chunk.push_back(n);
      budget -= n;
    }
  }
  if (batch.empty()) return absl::OkStatus();

  std::vector<Live*> sampled;
  StepBatch plan;
  RETURN_IF_ERROR(PlanBatch(batch, chunk, &plan, &sampled));
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  RETURN_IF_ERROR(runner_->Forward(plan, &tokens, &logprobs));
  if (tokens.size() != sampled.size() || logprobs.size() != sampled.size()) {
    return absl::InternalError(
        absl::StrCat("runner returned ", tokens.size(), " tokens for ", sampled.size(), " rows"));
  }

  const ModelSpec& s = spec();
  for (size_t i = 0; i < sampled.size(); ++i) {
    Live& live = *sampled[i];
    const int32_t token = tokens[i];
    live.result.token_ids.push_back(token);
    live.result.logprobs.push_back(logprobs[i]);
    ++stats_.decode_tokens;
    const bool eos = !live.request.ignore_eos && std::find(s.eos_token_ids.begin(), s.eos_token_ids.end(),
                                                           token) != s.eos_token_ids.end();
    if (eos) {
      live.result.finish_reason = "stop";
    } else if (static_cast<int64_t>(live.result.token_ids.size()) == live.request.max_tokens) {
      live.result.finish_reason = "length";
    }
  }
  // Retire finished requests: free their slots and the unused part of their reservation.
  for (auto it = running_.begin(); it != running_.end();) {
    Live& live = **it;
    if (live.result.finish_reason.empty()) {
      ++it;
      continue;
    }
    reserved_ -= ContextNeed(live.request) - static_cast<int64_t>(live.slots.size());
    allocator_.Release(live.slots);
    finished->emplace_back(live.id, std::move(live.result));
    it = running_.erase(it);
  }
  ++stats_.steps;
  stats_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status ColocatedEngine::PlanBatch(const std::vector<Live*>& batch, const std::vector<int64_t>& chunk,
                                        StepBatch* plan, std::vector<Live*>* sampled) {
  int64_t num_tokens = 0;
  for (int64_t c : chunk) num_tokens += c;
  plan->tokens.reserve(static_cast<size_t>(num_tokens));
  plan->positions.reserve(static_cast<size_t>(num_tokens));
  plan->new_slots.reserve(static_cast<size_t>(num_tokens));
  plan->q_indptr = {0};
  plan->kv_indptr = {0};
  // Single-row requests first (the decode kernel takes them), then multi-row prefill chunks.
  std::vector<size_t> order;
  for (size_t i = 0; i < batch.size(); ++i)
    if (chunk[i] == 1) order.push_back(i);
  plan->num_single = static_cast<int64_t>(order.size());
  for (size_t i = 0; i < batch.size(); ++i)
    if (chunk[i] != 1) order.push_back(i);

  for (size_t i : order) {
    Live& live = *batch[i];
    const int64_t n = chunk[i];
    const int64_t start = static_cast<int64_t>(live.slots.size());
    RETURN_IF_ERROR(Annotate(allocator_.Allocate(n, &live.slots), "KV reservation broken"));
    reserved_ -= n;
    const bool prefill = live.prefilled < static_cast<int64_t>(live.request.prompt.size());
    for (int64_t j = 0; j < n; ++j) {
      plan->tokens.push_back(prefill ? live.request.prompt[static_cast<size_t>(live.prefilled + j)]
                                     : live.result.token_ids.back());
      plan->positions.push_back(static_cast<int32_t>(start + j));
      plan->new_slots.push_back(live.slots[static_cast<size_t>(start + j)]);
    }
    plan->q_indptr.push_back(plan->q_indptr.back() + static_cast<int32_t>(n));
    plan->kv_slots.insert(plan->kv_slots.end(), live.slots.begin(), live.slots.end());
    plan->kv_indptr.push_back(static_cast<int32_t>(plan->kv_slots.size()));
    plan->max_q_len = std::max(plan->max_q_len, n);
    plan->max_kv_len = std::max(plan->max_kv_len, static_cast<int64_t>(live.slots.size()));
    if (prefill) {
      live.prefilled += n;
      stats_.prefill_tokens += n;
    }
    if (live.prefilled == static_cast<int64_t>(live.request.prompt.size())) {
      sampled->push_back(&live);
      plan->sample_rows.push_back(plan->q_indptr.back() - 1);
      plan->sampling.push_back(live.request.sampling);
      plan->counters.push_back(live.result.token_ids.size());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GenerationResult>> ColocatedEngine::GenerateAll(
    std::vector<GenerationRequest> requests) {
  if (!Idle()) return absl::FailedPreconditionError("GenerateAll needs an idle engine");
  std::vector<int64_t> ids;
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<int64_t> id = Submit(std::move(requests[i]));
    if (!id.ok()) {
      // Nothing half-applied: drop what this call queued before the bad request.
      waiting_.clear();
      next_id_ -= static_cast<int64_t>(ids.size());
      return Annotate(id.status(), absl::StrCat("request ", i));
    }
    ids.push_back(*id);
  }
  std::vector<GenerationResult> results(requests.size());
  if (ids.empty()) return results;
  std::vector<std::pair<int64_t, GenerationResult>> done;
  while (!Idle()) RETURN_IF_ERROR(Step(&done));
  for (auto& [id, result] : done) results[static_cast<size_t>(id - ids.front())] = std::move(result);
  return results;
}

}  // namespace tandem
