// The colocated engine: one process holds the weights and the KV cache and runs whole decode
// steps. It batches requests continuously (prefill chunks ride along with decode tokens) and is
//   * the reference the disaggregated runtime must match token for token, and
//   * the colocated baseline of cost comparisons (every GPU runs the whole model).
//
// Scheduling (FIFO): every step first gives each decoding request one token, then spends the
// rest of the step's token budget on prefill chunks of admitted requests in arrival order, then
// admits waiting requests while the batch has room and the KV pool can hold each newcomer's
// whole context (prompt + max_tokens). Because admission reserves the whole context, a running
// request never waits for KV and is never preempted; a request that could never fit is refused
// at submission.
//
// Thread safety: not thread-safe; one thread drives Submit/Step.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colocated/runner.h"
#include "common/config.h"
#include "compute_node/weights.h"
#include "kernels/cpu/ops.h"
#include "memory_node/kv_slot_allocator.h"

namespace tandem {

struct EngineOptions {
  std::string device = "auto";         // "cpu", "cuda", "cuda:N", or "auto" (cuda:0 if present)
  int64_t max_batch_size = 0;          // requests in one step; 0: as many as the KV cache holds
                                       // (at most max_tokens_per_step)
  int64_t max_tokens_per_step = 2048;  // decode tokens + prefill chunk tokens in one step
  int64_t kv_capacity_tokens = 0;      // KV slots; 0: sized from free device or host memory
  double kv_memory_fraction = 0.9;     // share of free memory (after weights) for KV when auto
  bool profile = false;                // per-phase device times (benchmarks; see PhaseTotalsMs)
};

// The knobs of EngineOptions as config schema sections ("runtime.*", "scheduler.*", "kv.*") and
// their conversion; shared by every program that runs an engine.
void AddEngineKnobs(ConfigSchema* schema);
EngineOptions EngineOptionsFromConfig(const Config& config);

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, at least one
  int64_t max_tokens = 16;      // generated tokens at most, >= 1
  kernels::cpu::SamplingParams sampling;
  bool ignore_eos = false;  // keep going past EOS (benchmarks)
};

struct GenerationResult {
  std::vector<int32_t> token_ids;  // generated tokens (EOS included when it stopped there)
  std::vector<float> logprobs;     // natural log-probability of each generated token
  std::string finish_reason;       // "stop" (EOS) or "length" (max_tokens or context end)
  int64_t prompt_tokens = 0;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;  // generated tokens
  double busy_seconds = 0;    // wall time inside Step()
};

class ColocatedEngine {
 public:
  // Picks the device, loads all weights from `source` (all or nothing) and sizes the KV pool:
  // with kv.capacity_tokens 0, from the memory left after the weights, so the batch is limited
  // by the memory the KV needs rather than by a constant.
  static absl::StatusOr<std::unique_ptr<ColocatedEngine>> Create(const WeightSource& source,
                                                                 const EngineOptions& options);

  // Queues a request and returns its id (0, 1, 2, ... in submission order). InvalidArgument for
  // an empty prompt, an id outside the vocabulary, max_tokens < 1, bad sampling parameters, or a
  // context longer than the model supports; ResourceExhausted if its context could never fit in
  // the KV pool. A refused request leaves the engine unchanged.
  absl::StatusOr<int64_t> Submit(GenerationRequest request);

  // Runs one step. Requests that finished in it are appended to `finished` as (id, result).
  absl::Status Step(std::vector<std::pair<int64_t, GenerationResult>>* finished);

  // True when no request is waiting or running.
  bool Idle() const { return waiting_.empty() && running_.empty(); }
  // Submits every request, steps until all finish, returns the results in request order.
  absl::StatusOr<std::vector<GenerationResult>> GenerateAll(std::vector<GenerationRequest> requests);

  const ModelSpec& spec() const { return runner_->spec(); }
  std::string device() const { return runner_->device(); }
  const EngineStats& stats() const { return stats_; }
  int64_t kv_capacity_tokens() const { return allocator_.num_slots(); }
  // See ModelRunner::PhaseTotalsMs (EngineOptions::profile).
  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return runner_->PhaseTotalsMs(); }
  int64_t kv_free_tokens() const { return allocator_.num_free(); }

 private:
  struct Live {
    int64_t id = 0;
    GenerationRequest request;
    std::vector<int32_t> slots;  // KV slots of tokens processed so far, in position order
    int64_t prefilled = 0;       // prompt tokens processed
    GenerationResult result;
  };
  ColocatedEngine(std::unique_ptr<ModelRunner> runner, const EngineOptions& options);
  int64_t ContextNeed(const GenerationRequest& r) const {
    return static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
  }
  // Places the step's tokens in KV slots and describes them for the runner; `sampled` gets the
  // requests whose last row produces a token this step, in sample-row order.
  absl::Status PlanBatch(const std::vector<Live*>& batch, const std::vector<int64_t>& chunk, StepBatch* plan,
                         std::vector<Live*>* sampled);

  std::unique_ptr<ModelRunner> runner_;
  EngineOptions options_;
  KvSlotAllocator allocator_;
  int64_t reserved_ = 0;  // slots promised to running requests but not yet allocated
  int64_t next_id_ = 0;
  std::deque<Live> waiting_;
  std::vector<std::unique_ptr<Live>> running_;  // admission order
  EngineStats stats_;
};

}  // namespace tandem
