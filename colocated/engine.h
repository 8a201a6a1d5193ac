// The colocated engine: one process holds the weights and the KV cache and runs whole decode
// steps. It batches requests continuously (prefill chunks ride along with decode tokens) and is
//   * the reference the disaggregated runtime must match token for token, and
//   * the colocated baseline of cost comparisons (every GPU runs the whole model).
//
// It is the disaggregated runtime's parts in one process, with no network between them: the
// controller (compute_node/controller.h: FIFO continuous batching, chunked prefill, whole-context
// KV reservation) plans each step for one "memory rank", the KV table (memory_node/kv_table.h)
// places its rows in KV slots, the compute backend runs the linear layers and sampling, and the
// attention executor appends KV and runs attention, all on one device and one stream.
//
// Thread safety: not thread-safe; one thread drives Submit/Step.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "compute_node/compute_backend.h"
#include "compute_node/controller.h"
#include "compute_node/controller_settings.h"
#include "compute_node/weights.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_table.h"

namespace tandem {

// The engine's settings: the scheduler and KV knobs (compute_node/controller_settings.h), the
// device, and profiling.
struct EngineOptions : SchedulerKvSettings {
  std::string device = "auto";  // "cpu", "cuda", "cuda:N", or "auto" (cuda:0 if present)
  bool profile = false;         // per-phase device times (benchmarks; see PhaseTotalsMs)
};

// The engine's config schema sections: "runtime.device" and the scheduler and KV knobs
// (AddSchedulerKvKnobs), and their conversion.
void AddEngineKnobs(ConfigSchema* schema);
EngineOptions EngineOptionsFromConfig(const Config& config);

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;  // generated tokens
  int64_t cached_tokens = 0;  // prompt tokens reused from the prefix registry
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
  bool Idle() const { return controller_.Idle(); }
  // Submits every request, steps until all finish, returns the results in request order.
  absl::StatusOr<std::vector<GenerationResult>> GenerateAll(std::vector<GenerationRequest> requests);

  const ModelSpec& spec() const { return backend_->spec(); }
  std::string device() const { return backend_->device(); }
  const EngineStats& stats() const { return stats_; }
  int64_t kv_capacity_tokens() const { return kv_table_.num_slots(); }
  // See ComputeBackend::PhaseTotalsMs (EngineOptions::profile).
  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return backend_->PhaseTotalsMs(); }
  int64_t kv_free_tokens() const { return kv_table_.num_free(); }
  // KV held by registered prefix blocks (kept after their requests end, for reuse).
  int64_t kv_registered_tokens() const { return kv_table_.num_blocks() * kv_table_.block_tokens(); }
  const Controller& controller() const { return controller_; }

 private:
  ColocatedEngine(std::unique_ptr<ComputeBackend> backend, std::unique_ptr<AttentionExecutor> attention,
                  const EngineOptions& options, const ControllerOptions& scheduler);

  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<AttentionExecutor> attention_;
  EngineOptions options_;
  Controller controller_;
  KvTable kv_table_;
  PlannedStep step_;
  AttentionBatch batch_;
  BackendBuffer qkv_, attn_;  // (max_tokens, qkv_width) and (max_tokens, q_dim) in backend memory
  EngineStats stats_;
};

}  // namespace tandem
