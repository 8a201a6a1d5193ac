// Replays a workload (loadgen/workload.h) against a target and records every request's timeline
// (loadgen/metrics.h). Two targets:
//
//   * RunOnEngine: an in-process Engine (compute_node/engine.h: the colocated engine, or compute
//     rank 0 of a deployment), driven from the calling thread: between steps, requests whose
//     arrival time has come are submitted; a token's time is the end of the step that made it
//     (what a streaming client of `tandem serve` would see, less the HTTP hop). KV usage is
//     sampled every step (Engine::kv_usage), prefix hits come from each result's cached_tokens.
//   * RunOnHttp: an OpenAI-compatible server (`tandem serve`, or another server), one streaming
//     POST /v1/completions per request with the prompt as token ids, `ignore_eos` and
//     `stream_options.include_usage`; a token's time is when the server-sent event carrying it
//     arrived (tandem's events carry `token_ids`; for a server whose events do not, each event
//     with text counts as one token and the usage chunk gives the total). KV usage is scraped from
//     /metrics every 0.5 s where the server exports tandem's or vLLM's gauges.
//
// Multi-turn sessions: turn k+1 is released `think_s` after turn k finishes, with turn k's prompt
// and generated tokens before its own; a turn that would overflow `max_context` ends the session
// (counted in skipped_turns). A request the target refuses is recorded with its error, and ends
// its session. Over HTTP the generated tokens come from the events' `token_ids`; a server that
// sends none gives later turns the previous prompt and the new tokens only (no answer between).
//
// Stopping: when `stop_requested()` returns true (Ctrl-C) the run cancels what is in flight and returns
// what it measured (interrupted = true); unfinished requests keep the tokens they got.
//
// Thread safety: RunOnEngine uses the engine from the calling thread only. RunOnHttp uses one
// thread per request in flight (at most max_concurrency) and one for /metrics; `on_progress` is
// called from the calling thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "compute_node/engine.h"
#include "loadgen/metrics.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

struct ProgressInfo {
  int64_t finished = 0, total = 0, in_flight = 0;
  int64_t output_tokens = 0;
  double elapsed_s = 0;
};

struct RunOptions {
  std::vector<double> arrivals;  // one per request (loadgen/arrivals.h)
  int64_t max_concurrency = 0;   // requests in flight at most; 0: no limit
  int64_t max_context = 0;       // model context, for later session turns; 0: none
  double temperature = 0;
  uint64_t seed = 0;
  bool ignore_eos = true;                                // generate the workload's output lengths
  std::function<bool()> stop_requested;                  // polled between steps; true ends the run (Ctrl-C)
  std::function<void(const ProgressInfo&)> on_progress;  // about twice a second
};

struct KvSample {
  double t = 0;       // seconds from the start
  double used = 0;    // reserved / capacity over all memory ranks
  double cached = 0;  // evictable prefix blocks / capacity
};

struct RunResult {
  std::vector<RequestTiming> timings;  // one per workload request, in workload order
  std::vector<KvSample> kv;
  bool interrupted = false;
  int64_t skipped_turns = 0;
  int64_t steps = 0;        // engine steps (in-process target)
  double busy_seconds = 0;  // time inside Engine::Step (in-process target)
  std::string target;       // "engine on cpu", "http://127.0.0.1:8000/v1"
};

absl::StatusOr<RunResult> RunOnEngine(Engine& engine, const Workload& workload, const RunOptions& options);

struct HttpTarget {
  std::string url;          // base URL: "http://host:port" or "http://host:port/v1"
  std::string model;        // the `model` to send; empty: the first of GET /v1/models
  std::string api_key;      // bearer token, if the server wants one
  double timeout_s = 3600;  // per request
};

// Unavailable when the server cannot be reached (naming the URL); per-request failures (HTTP
// errors, error events) are recorded in the request's timing, not returned.
absl::StatusOr<RunResult> RunOnHttp(const HttpTarget& target, const Workload& workload,
                                    const RunOptions& options);

}  // namespace tandem::loadgen
