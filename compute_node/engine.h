// The engine interface: what a front end drives to serve requests, whatever runs them. Two
// implementations today, with the same tokens for the same requests:
//   * ColocatedEngine (colocated/engine.h): weights and KV in this process;
//   * ComputeRank (compute_node/compute_rank.h): compute rank 0 of a deployment, whose memory
//     ranks (other processes) hold the KV and run attention.
// `tandem generate` runs requests through this interface only (cli/generate.cc, RunRequests), and
// so will the OpenAI-compatible server and the benchmarks (docs/architecture.md, "Engines").
//
// Contract:
//   * Submit() checks a request (as Check()) and queues it; ids are 0, 1, 2, ... in submission
//     order. A refused request leaves the engine unchanged.
//   * Step() runs one step of continuous batching (decode rows, then prefill chunks, then
//     admission) and appends every request that finished in it to `finished` as (id, result).
//     A step that fails leaves the engine unusable: the error names the device or rank at fault.
//   * Cancel() ends a waiting or running request now; it returns the tokens generated so far
//     with finish_reason "cancelled" and frees its KV (on every memory rank that held it). It is
//     not reported by a later Step(). NotFound for an id that is not live (never submitted, or
//     already finished or cancelled).
//   * Idle(): nothing is waiting or running.
//   * Heartbeat(): a deployment checks, while idle, that its ranks are still there; the front end
//     calls it between steps while Idle(), at least every heartbeat_interval(). A rank found lost
//     is handled as in a failed step: recovered where the engine can, else the engine is unusable
//     and the error names the rank.
//   * Tokens: a request's tokens depend only on the request (its seed, for sampling), never on
//     what else is in the batch or on which implementation runs it.
//
// Thread safety: none; one thread drives an engine (a server queues its requests to that thread).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_spec.h"
#include "compute_node/controller.h"
#include "compute_node/pipeline_report.h"

namespace tandem {

// The KV tiers' traffic (kv.tiers.*; docs/architecture.md, "KV tiers"), totals since the engine
// started.
struct KvTierCounters {
  bool enabled = false;  // the engine has KV tiers
  // Counted by the controller (every engine): blocks evicted from the KV pool into the lower
  // tiers, brought back from them, and whose restore failed (recomputed); and the KV bytes those
  // blocks moved out of the pool and into it (blocks x the bytes of a block's KV on its rank).
  int64_t demoted_blocks = 0;
  int64_t restored_blocks = 0;
  int64_t restore_failed_blocks = 0;
  int64_t pool_bytes_out = 0;
  int64_t pool_bytes_in = 0;
  // Prefetch (kv.tiers.prefetch_lookahead), counted by the controller: blocks restored for waiting
  // requests before their admission (part of restored_blocks), those a request then attached, and
  // those evicted again before any request attached them (wasted).
  int64_t prefetched_blocks = 0;
  int64_t prefetch_used_blocks = 0;
  int64_t prefetch_wasted_blocks = 0;
  // kv.store_pre_rope, counted by the controller: blocks assembled from rows of other registered
  // blocks at new positions (part of restored_blocks), and those whose assembly failed (part of
  // restore_failed_blocks; their tokens were recomputed).
  int64_t shifted_blocks = 0;
  int64_t shifted_failed_blocks = 0;
  // Counted by the tiers themselves, per tier: the colocated engine. A deployment's memory ranks
  // own their tiers and log these when they end (reporting them to compute rank 0 needs a wire
  // message); per_tier is then false and the fields below are 0.
  bool per_tier = false;
  int64_t host_hits = 0;  // restores served by host memory
  int64_t disk_hits = 0;  // restores served by a block file
  int64_t misses = 0;     // restores of blocks in no tier
  int64_t discarded = 0;  // copies that failed their checks (corrupt, truncated, foreign)
  int64_t bytes_to_host = 0, bytes_from_host = 0;  // into host memory, and from it into the pool
  int64_t bytes_to_disk = 0, bytes_from_disk = 0;  // files written and read (header, tokens and KV)
  int64_t host_evictions = 0, disk_evictions = 0;  // blocks each tier dropped to make room
  int64_t disk_write_errors = 0;
  double restore_seconds = 0;  // time loading blocks back into the pool (checks and copies)
  // Of restore_seconds, the time spent before a step's layers could start (layer-wise restore
  // copies each layer into the pool just before that layer's attention; the rest is loads).
  double restore_stall_seconds = 0;
  double save_seconds = 0;  // time copying demoted blocks out of the pool into the tiers (KvTiers::Demote)
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;  // generated tokens
  int64_t cached_tokens = 0;  // prompt tokens reused from the prefix registry
  // KV tiers (kv.tiers.*): tokens of blocks evicted to a lower tier, brought back from one, and
  // whose restore failed (recomputed).
  int64_t demoted_tokens = 0;
  int64_t restored_tokens = 0;
  int64_t restore_failed_tokens = 0;
  int64_t prefetched_tokens = 0;  // of restored_tokens: restored for waiting requests (prefetch)
  KvTierCounters tiers;
  double busy_seconds = 0;  // wall time inside Step()
  // A deployment's recoveries (ComputeRank): memory ranks given up, and the requests they held
  // that went back to the queue to be recomputed on the others.
  int64_t memory_ranks_lost = 0;
  int64_t requests_recovered = 0;
  int64_t memory_ranks_rejoined = 0;  // lost ranks that a new process of took back (ComputeRank)
  // Compute replicas given up (their micro-batches run on the surviving compute ranks), and the
  // steps run again because one was lost in the middle of them.
  int64_t compute_ranks_lost = 0;
  int64_t steps_rerun = 0;
  // Compute replicas that went on after a loss (counted at each step discard that kept one), the
  // compute ranks running micro-batches now (compute rank 0 and the replicas not lost; 0 for an
  // engine without compute ranks), and the micro-batches whose tokens a replica sampled.
  int64_t compute_replicas_kept = 0;
  int64_t compute_ranks_live = 0;
  int64_t replica_micro_batches = 0;
};

// KV of one memory rank, in tokens (slots).
struct KvUsage {
  int64_t capacity = 0;
  int64_t reserved = 0;  // promised to running requests (beyond the prefix blocks they use)
  int64_t cached = 0;    // held by registered prefix blocks no running request uses (evictable)
};

// kv_usage() of an engine whose KV is planned by `controller`.
std::vector<KvUsage> KvUsageOf(const Controller& controller);

class Engine {
 public:
  virtual ~Engine() = default;

  // Whether Submit() would take `request` (see Controller::Check): InvalidArgument for an empty
  // prompt, an id outside the vocabulary, max_tokens < 1, bad sampling parameters, or a context
  // longer than the model supports; ResourceExhausted if its context could never fit in the KV.
  virtual absl::Status Check(const GenerationRequest& request) const = 0;
  virtual absl::StatusOr<int64_t> Submit(GenerationRequest request) = 0;
  virtual absl::Status Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) = 0;
  virtual absl::StatusOr<GenerationResult> Cancel(int64_t id) = 0;
  virtual bool Idle() const = 0;
  // How often Heartbeat() wants to be called while idle; InfiniteDuration: never (the default,
  // and an engine with nothing to watch).
  virtual absl::Duration heartbeat_interval() const { return absl::InfiniteDuration(); }
  virtual absl::Status Heartbeat() { return absl::OkStatus(); }
  // A live request's tokens and log-probabilities so far (what streaming front ends send as the
  // steps go), or nullptr when `id` is not live. Valid until the next Submit, Step or Cancel.
  virtual const GenerationResult* Progress(int64_t id) const = 0;
  // Requests queued for admission, and requests in the running batch.
  virtual int64_t num_waiting() const = 0;
  virtual int64_t num_running() const = 0;
  // Per memory rank (one for the colocated engine).
  virtual std::vector<KvUsage> kv_usage() const = 0;
  // A deployment's pipeline totals so far (compute_node/pipeline_report.h), asked for between
  // steps; nullopt for an engine without a pipeline (the colocated engine).
  virtual absl::StatusOr<std::optional<PipelineTotals>> PipelineSnapshot() {
    return std::optional<PipelineTotals>();
  }

  virtual EngineStats stats() const = 0;
  virtual const ModelSpec& spec() const = 0;
  // Where it runs: "cpu", "cuda:0 (NVIDIA H200)", ... (compute rank 0's device for a deployment).
  virtual std::string device() const = 0;

  // Checks every request (nothing is queued if one is refused: InvalidArgument or
  // ResourceExhausted naming "request i"), submits them all, and steps until the engine is idle;
  // results in request order. `before_step`, when given, runs before every step and ends the
  // run with its error (a stop signal). FailedPrecondition unless the engine is idle.
  absl::StatusOr<std::vector<GenerationResult>> GenerateAll(
      std::vector<GenerationRequest> requests, const std::function<absl::Status()>& before_step = nullptr);
};

}  // namespace tandem
