// The online engine loop: one thread drives an Engine (compute_node/engine.h) while requests
// arrive and leave, for front ends that serve live traffic (the OpenAI-compatible server).
//
//   * Submit() hands a request to the engine thread and waits until the engine has taken it
//     (between two steps, so it joins the running batch at the next step) or refused it: the
//     caller learns InvalidArgument / ResourceExhausted before it answers its client.
//   * Each request's tokens come out of its RequestStream as soon as the step that made them
//     ends (one event per step with the new tokens), then one final event with the whole result.
//   * Cancel() (a client that went away) ends the request at the next step boundary and frees
//     its KV; its stream gets a final event with finish_reason "cancelled".
//   * With nothing to do the engine thread sleeps on a condition variable: no polling.
//   * Shutdown(grace) stops taking requests (Unavailable), lets the live ones run for `grace`,
//     cancels what is left and joins the thread. A step that fails ends every live request with
//     the step's error and the loop refuses everything after it (failure() says why).
//   * While idle, an engine that wants heartbeats (Engine::heartbeat_interval) gets a Heartbeat()
//     call that often; one that fails counts as a failed step.
//
// Thread safety: Submit, Cancel, Shutdown and stats may be called from any thread; each stream
// is read by one thread. The engine is touched only by the loop's thread once the loop exists.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "compute_node/engine.h"

namespace tandem::server {

struct StreamEvent {
  std::vector<int32_t> tokens;  // generated since the previous event
  std::vector<float> logprobs;  // one per token
  // One list per token when the request asked for alternatives (GenerationRequest::top_logprobs),
  // else empty.
  std::vector<std::vector<TopLogprob>> top_logprobs;
  bool done = false;        // the last event of the stream
  GenerationResult result;  // when done: the whole result (tokens, finish_reason, usage)
  // When done: not OK if the request ended with an error: the engine failed (engine_failed), or the
  // request itself could not be served (GenerationResult::error, e.g. Unavailable: it fits no
  // surviving memory rank).
  absl::Status error;
  bool engine_failed = false;
};

// Timings of one request (absl::Now() clock), for metrics.
struct RequestTimes {
  absl::Time submitted, admitted, first_token, finished;
};

class RequestStream {
 public:
  // The next event, waiting until `deadline`; nullopt on timeout. After the final event: nullopt.
  std::optional<StreamEvent> Next(absl::Time deadline);
  uint64_t key() const { return key_; }

 private:
  friend class EngineLoop;
  void Push(StreamEvent e);
  uint64_t key_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
  bool closed_ = false;  // the final event was taken
};

struct LoopOptions {
  int64_t max_waiting = 256;  // requests queued behind the running batch; more: ResourceExhausted
};

// Counters and gauges of the loop (a snapshot).
// A deployment's recoveries so far (EngineStats): memory ranks lost, lost ranks taken back,
// requests recomputed after a loss, compute replicas lost, steps run again after such a loss,
// replicas kept and released by those step discards, the compute ranks running micro-batches now
// and the micro-batches the replicas sampled.
struct RecoveryCounters {
  int64_t memory_ranks_lost = 0, memory_ranks_rejoined = 0, requests_recovered = 0;
  int64_t compute_ranks_lost = 0, steps_rerun = 0;
  int64_t compute_replicas_kept = 0, compute_ranks_live = 0;
  int64_t replica_micro_batches = 0;
  RecoveryCounters() = default;
  explicit RecoveryCounters(const EngineStats& s)
      : memory_ranks_lost(s.memory_ranks_lost),
        memory_ranks_rejoined(s.memory_ranks_rejoined),
        requests_recovered(s.requests_recovered),
        compute_ranks_lost(s.compute_ranks_lost),
        steps_rerun(s.steps_rerun),
        compute_replicas_kept(s.compute_replicas_kept),
        compute_ranks_live(s.compute_ranks_live),
        replica_micro_batches(s.replica_micro_batches) {}
};

struct LoopStats {
  int64_t running = 0, waiting = 0;
  int64_t finished = 0, cancelled = 0, failed = 0, refused = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0, cached_tokens = 0;
  int64_t steps = 0;
  double step_seconds = 0;
  bool healthy = true;
  std::vector<KvUsage> kv;    // per memory rank, after the last step
  KvTierCounters tiers;       // the engine's KV tiers, after the last step
  RecoveryCounters recovery;  // after the last step or idle heartbeat
  // A deployment's pipeline totals (about once a second while it steps) and the report of the
  // steps between the last two snapshots; absent for the colocated engine.
  std::optional<PipelineTotals> pipeline;
  PipelineReport pipeline_window;
};

// Called on the loop's thread when a request ends (metrics); must not block.
using FinishHook = std::function<void(const GenerationResult&, const RequestTimes&)>;

class EngineLoop {
 public:
  EngineLoop(Engine* engine, LoopOptions options, FinishHook on_finish = nullptr);
  ~EngineLoop();  // Shutdown(zero)
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Blocks until the engine took or refused the request (at most one step).
  absl::StatusOr<std::shared_ptr<RequestStream>> Submit(GenerationRequest request);
  void Cancel(uint64_t key);
  void Shutdown(absl::Duration grace);
  LoopStats stats() const;
  // OK while the engine is healthy; else the error of the step (or heartbeat) that failed it.
  absl::Status failure() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  const ModelSpec& spec() const { return spec_; }

 private:
  struct Pending {
    GenerationRequest request;
    std::shared_ptr<RequestStream> stream;
    absl::Status verdict;
    bool decided = false;
    absl::Time submitted;
  };
  struct Live {
    std::shared_ptr<RequestStream> stream;
    size_t sent = 0;  // tokens already pushed
    RequestTimes times;
  };
  void Run();
  void Admit(std::vector<std::shared_ptr<Pending>>& inbox);
  void Emit(Live& live, const GenerationResult& progress);
  void Finish(int64_t id, GenerationResult result, absl::Status error, bool engine_failed = false);

  Engine* engine_;
  const ModelSpec spec_;
  LoopOptions options_;
  FinishHook on_finish_;
  mutable std::mutex mu_;
  std::condition_variable cv_;       // wakes the loop
  std::condition_variable decided_;  // wakes submitters
  std::vector<std::shared_ptr<Pending>> inbox_;
  std::vector<uint64_t> cancels_;
  bool stopping_ = false;
  std::optional<absl::Time> stop_by_;
  uint64_t next_key_ = 1;
  LoopStats stats_;
  absl::Status failure_;
  // Loop thread only.
  std::map<int64_t, Live> live_;                         // engine id -> request
  std::map<uint64_t, int64_t> by_key_;                   // stream key -> engine id
  std::chrono::steady_clock::time_point last_pipeline_;  // the last pipeline snapshot
  std::thread thread_;
};

}  // namespace tandem::server
