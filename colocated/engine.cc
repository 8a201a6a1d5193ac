#include "colocated/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace tandem {

namespace cpu = kernels::cpu;

void AddEngineKnobs(ConfigSchema* schema) {
  const EngineOptions d;
  schema->Int("scheduler.max_batch_size", d.max_batch_size, "requests batched in one step", 1, 65536)
      .Int("scheduler.max_tokens_per_step", d.max_tokens_per_step,
           "decode tokens plus prefill-chunk tokens in one step (>= max_batch_size)", 1, 1 << 20)
      .Int("kv.capacity_tokens", d.kv_capacity_tokens,
           "KV cache size in tokens; 0 sizes it from free memory (kv.memory_fraction)", 0, 1LL << 31)
      .Double("kv.memory_fraction", d.kv_memory_fraction,
              "share of free memory, after the weights, given to the KV cache when sized automatically",
              0.01, 0.95);
}

EngineOptions EngineOptionsFromConfig(const Config& config) {
  EngineOptions o;
  o.max_batch_size = config.GetInt("scheduler.max_batch_size");
  o.max_tokens_per_step = config.GetInt("scheduler.max_tokens_per_step");
  o.kv_capacity_tokens = config.GetInt("kv.capacity_tokens");
  o.kv_memory_fraction = config.GetDouble("kv.memory_fraction");
  return o;
}

namespace {

// Bytes the kernel reports as available (MemAvailable), or 0 if unknown.
int64_t HostMemAvailable() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

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

}  // namespace

absl::StatusOr<std::unique_ptr<ColocatedEngine>> ColocatedEngine::Create(const WeightSource& source,
                                                                          const EngineOptions& options) {
  if (options.max_batch_size < 1) return absl::InvalidArgumentError("scheduler.max_batch_size must be >= 1");
  if (options.max_tokens_per_step < options.max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scheduler.max_tokens_per_step (", options.max_tokens_per_step,
        ") must be at least scheduler.max_batch_size (", options.max_batch_size,
        "): every decoding request needs one token per step"));
  }
  ASSIGN_OR_RETURN(ModelWeightsF32 weights, LoadWeightsF32(source));
  const ModelSpec& spec = weights.spec;
  const int64_t per_token = spec.kv_bytes_per_token(sizeof(float));
  int64_t slots = options.kv_capacity_tokens;
  if (slots == 0) {
    const int64_t avail = HostMemAvailable();
    const int64_t by_memory = static_cast<int64_t>(static_cast<double>(avail) * options.kv_memory_fraction) / per_token;
    // Never more than the batch could ever use.
    slots = std::min(by_memory, options.max_batch_size * spec.max_position);
    if (slots < 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no memory left for the KV cache (", avail >> 20, " MiB available, ", per_token,
          " bytes per token); set kv.capacity_tokens or use a smaller model"));
    }
  }
  if (slots > INT32_MAX) return absl::InvalidArgumentError("kv.capacity_tokens exceeds 2^31-1");
  TANDEM_LOG_INFO("engine", spec.Summary(), "; KV cache ", slots, " tokens (",
                  (slots * per_token) >> 20, " MiB fp32)");
  return std::unique_ptr<ColocatedEngine>(new ColocatedEngine(std::move(weights), options, slots));
}

ColocatedEngine::ColocatedEngine(ModelWeightsF32 weights, const EngineOptions& options, int64_t kv_slots)
    : weights_(std::move(weights)), options_(options), executor_(&weights_), allocator_(kv_slots) {
  const size_t layer_floats = static_cast<size_t>(kv_slots * weights_.spec.kv_dim());
  for (int64_t l = 0; l < weights_.spec.num_layers; ++l) {
    k_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
    v_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
  }
}

absl::StatusOr<int64_t> ColocatedEngine::Submit(GenerationRequest request) {
  const ModelSpec& s = spec();
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= s.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", i, " is ", t,
                                                     ", outside the vocabulary [0, ", s.vocab_size, ")"));
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
  std::vector<float> logits;
  RETURN_IF_ERROR(RunBatch(batch, chunk, &sampled, &logits));

  const ModelSpec& s = spec();
  for (size_t i = 0; i < sampled.size(); ++i) {
    Live& live = *sampled[i];
    const float* row = logits.data() + static_cast<int64_t>(i) * s.vocab_size;
    const uint64_t counter = live.result.token_ids.size();
    const int32_t token = cpu::SampleToken(row, s.vocab_size, live.request.sampling, counter);
    live.result.token_ids.push_back(token);
    ++stats_.decode_tokens;
    live.result.logprobs.push_back(cpu::TokenLogprob(row, s.vocab_size, token));
    const bool eos = !live.request.ignore_eos &&
                     std::find(s.eos_token_ids.begin(), s.eos_token_ids.end(), token) != s.eos_token_ids.end();
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

absl::Status ColocatedEngine::RunBatch(const std::vector<Live*>& batch, const std::vector<int64_t>& chunk,
                                       std::vector<Live*>* sampled, std::vector<float>* logits) {
  const ModelSpec& s = spec();
  const int64_t num_tokens = [&] {
    int64_t t = 0;
    for (int64_t c : chunk) t += c;
    return t;
  }();
  std::vector<int32_t> tokens, positions, rows_to_sample;
  std::vector<int32_t> q_indptr = {0}, kv_indptr = {0}, kv_slots, new_slots;
  tokens.reserve(static_cast<size_t>(num_tokens));
  positions.reserve(static_cast<size_t>(num_tokens));
  new_slots.reserve(static_cast<size_t>(num_tokens));
  for (size_t i = 0; i < batch.size(); ++i) {
    Live& live = *batch[i];
    const int64_t n = chunk[i];
    const int64_t start = static_cast<int64_t>(live.slots.size());
    RETURN_IF_ERROR(Annotate(allocator_.Allocate(n, &live.slots), "KV reservation broken"));
    reserved_ -= n;
    const bool prefill = live.prefilled < static_cast<int64_t>(live.request.prompt.size());
    for (int64_t j = 0; j < n; ++j) {
      tokens.push_back(prefill ? live.request.prompt[static_cast<size_t>(live.prefilled + j)]
                               : live.result.token_ids.back());
      positions.push_back(static_cast<int32_t>(start + j));
      new_slots.push_back(live.slots[static_cast<size_t>(start + j)]);
    }
    q_indptr.push_back(q_indptr.back() + static_cast<int32_t>(n));
    kv_slots.insert(kv_slots.end(), live.slots.begin(), live.slots.end());
    kv_indptr.push_back(static_cast<int32_t>(kv_slots.size()));
    if (prefill) {
      live.prefilled += n;
      stats_.prefill_tokens += n;
    }
    if (live.prefilled == static_cast<int64_t>(live.request.prompt.size())) {
      sampled->push_back(&live);
      rows_to_sample.push_back(q_indptr.back() - 1);
    }
  }

  const int64_t hidden = s.hidden_size, qd = s.q_dim(), kvd = s.kv_dim();
  const int64_t width = executor_.qkv_width();
  std::vector<float> x(static_cast<size_t>(num_tokens * hidden));
  std::vector<float> qkv(static_cast<size_t>(num_tokens * width));
  std::vector<float> q(static_cast<size_t>(num_tokens * qd));
  std::vector<float> attn(static_cast<size_t>(num_tokens * qd));
  RETURN_IF_ERROR(executor_.Embed(tokens, x.data()));
  for (int64_t layer = 0; layer < s.num_layers; ++layer) {
    RETURN_IF_ERROR(executor_.PreAttention(layer, x.data(), positions, qkv.data()));
    float* kc = k_cache_[static_cast<size_t>(layer)].get();
    float* vc = v_cache_[static_cast<size_t>(layer)].get();
    for (int64_t r = 0; r < num_tokens; ++r) {
      const float* row = qkv.data() + r * width;
      const int64_t slot = new_slots[static_cast<size_t>(r)];
      std::memcpy(q.data() + r * qd, row, static_cast<size_t>(qd) * sizeof(float));
      std::memcpy(kc + slot * kvd, row + qd, static_cast<size_t>(kvd) * sizeof(float));
      std::memcpy(vc + slot * kvd, row + qd + kvd, static_cast<size_t>(kvd) * sizeof(float));
    }
    RETURN_IF_ERROR(cpu::Attention({.q = q.data(),
                                    .k_cache = kc,
                                    .v_cache = vc,
                                    .out = attn.data(),
                                    .q_indptr = q_indptr.data(),
                                    .kv_indptr = kv_indptr.data(),
                                    .kv_slots = kv_slots.data(),
                                    .num_requests = static_cast<int64_t>(batch.size()),
                                    .num_slots = allocator_.num_slots(),
                                    .num_heads = s.num_heads,
                                    .num_kv_heads = s.num_kv_heads,
                                    .head_dim = s.head_dim,
                                    .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim))}));
    RETURN_IF_ERROR(executor_.PostAttention(layer, x.data(), attn.data(), num_tokens));
  }
  logits->resize(rows_to_sample.size() * static_cast<size_t>(s.vocab_size));
  if (!rows_to_sample.empty()) RETURN_IF_ERROR(executor_.Logits(x.data(), rows_to_sample, logits->data()));
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
