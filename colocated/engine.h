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
// With kv.tiers.* (CPU only), blocks evicted from the KV pool are saved to host memory and disk
// (memory_node/kv_tiers.h) and restored when a later prompt starts with them. With
// kv.tiers.persist, the engine saves its registered blocks to disk when it is destroyed, and a new
// engine over the same kv.tiers.disk_dir registers the blocks it finds there (with their tokens,
// checked against their hashes), so that a conversation continued after a restart restores its KV.
//
// It implements the Engine interface (compute_node/engine.h), as compute rank 0 of a deployment does.
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
#include "compute_node/engine.h"
#include "compute_node/weights.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_table.h"
#include "memory_node/kv_tiers.h"

namespace tandem {

// The engine's settings: the scheduler and KV knobs (compute_node/controller_settings.h), the
// device, and profiling.
struct EngineOptions : SchedulerKvSettings {
  std::string device = "auto";  // "cpu", "cuda", "cuda:N", or "auto" (cuda:0 if present)
  bool profile = false;         // per-phase device times (benchmarks; see PhaseTotalsMs)
  bool cuda_graphs = false;     // layer parts as CUDA graphs (ComputeBackendOptions)
  bool gemv = true;             // one-row GEMMs through tandem's kernel (ComputeBackendOptions)
};

// The engine's config schema sections: "runtime.device" and the scheduler and KV knobs
// (AddSchedulerKvKnobs), and their conversion.
void AddEngineKnobs(ConfigSchema* schema);
EngineOptions EngineOptionsFromConfig(const Config& config);

class ColocatedEngine : public Engine {
 public:
  // Picks the device, loads all weights from `source` (all or nothing) and sizes the KV pool:
  // with kv.capacity_tokens 0, from the memory left after the weights, so the batch is limited
  // by the memory the KV needs rather than by a constant.
  static absl::StatusOr<std::unique_ptr<ColocatedEngine>> Create(const WeightSource& source,
                                                                 const EngineOptions& options);

  // kv.tiers.persist: saves the registered blocks to the disk tier.
  ~ColocatedEngine() override;

  // The Engine interface (compute_node/engine.h). Submit: ResourceExhausted if the request's
  // context could never fit in this engine's KV pool.
  absl::Status Check(const GenerationRequest& request) const override { return controller_.Check(request); }
  absl::StatusOr<int64_t> Submit(GenerationRequest request) override;
  absl::Status Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) override;
  absl::StatusOr<GenerationResult> Cancel(int64_t id) override;
  bool Idle() const override { return controller_.Idle(); }
  const GenerationResult* Progress(int64_t id) const override { return controller_.Progress(id); }
  int64_t num_waiting() const override { return controller_.num_waiting(); }
  int64_t num_running() const override { return controller_.num_running(); }
  std::vector<KvUsage> kv_usage() const override { return KvUsageOf(controller_); }
  EngineStats stats() const override { return stats_; }
  const ModelSpec& spec() const override { return backend_->spec(); }
  std::string device() const override { return backend_->device(); }

  int64_t kv_capacity_tokens() const { return kv_table_.num_slots(); }
  // See ComputeBackend::PhaseTotalsMs (EngineOptions::profile).
  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return backend_->PhaseTotalsMs(); }
  int64_t kv_free_tokens() const { return kv_table_.num_free(); }
  // KV held by registered prefix blocks (kept after their requests end, for reuse).
  int64_t kv_registered_tokens() const { return kv_table_.num_blocks() * kv_table_.block_tokens(); }
  const Controller& controller() const { return controller_; }
  // The KV tiers (kv.tiers.*), or nullptr when they are off.
  KvTiers* tiers() { return tiers_.get(); }

 private:
  ColocatedEngine(std::unique_ptr<ComputeBackend> backend, std::unique_ptr<AttentionExecutor> attention,
                  const EngineOptions& options, const ControllerOptions& scheduler);

  std::unique_ptr<ComputeBackend> backend_;
  std::unique_ptr<AttentionExecutor> attention_;
  EngineOptions options_;
  Controller controller_;
  KvTable kv_table_;
  std::unique_ptr<KvTiers> tiers_;
  PlannedStep step_;
  AttentionBatch batch_;
  BackendBuffer qkv_, attn_;  // (max_tokens, qkv_width) and (max_tokens, q_dim) in backend memory
  EngineStats stats_;
};

}  // namespace tandem
