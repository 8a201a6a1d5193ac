// Serving metrics of one benchmark run, from every request's timeline.
//
// A request's times are seconds from the run's start: `arrival` (when it was due to be sent),
// `token_times` (when each generated token became visible to the client: the end of the engine
// step that made it, or the arrival of the streamed chunk that carried it), `end` (the last
// token, or the failure). Definitions (the ones vLLM's and SGLang's benchmarks use):
//   TTFT  = first token - arrival (queueing included)
//   TPOT  = (last token - first token) / (tokens - 1), per request with >= 2 tokens
//   ITL   = every gap between consecutive tokens of a request, pooled over requests
//   E2E   = end - arrival
// Percentiles interpolate linearly between order statistics (numpy's default). Throughputs
// divide the completed requests' tokens by the run's duration: first arrival to last token.
// Goodput counts completed requests that meet every SLO given (TTFT, TPOT, E2E; 0 = none).
//
// Thread safety: values only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::loadgen {

struct RequestTiming {
  int64_t index = 0;  // position in the workload
  int64_t session = -1, turn = 0;
  double arrival = 0;
  double sent = -1;  // when the target took it (-1: never)
  std::vector<double> token_times;
  double end = -1;  // -1: not finished (interrupted)
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens reused from a prefix cache (when the target says)
  std::string finish_reason;  // "length", "stop", "cancelled", "error", "" (never sent)
  std::string error;

  bool completed() const { return error.empty() && end >= 0 && !token_times.empty(); }
};

struct Stats {
  int64_t count = 0;
  double mean = 0, median = 0, p90 = 0, p99 = 0, min = 0, max = 0;
};
// Stats of `values` (all zero for none).
Stats Summarize(std::vector<double> values);
// The q-quantile (q in [0, 1]) of sorted values, interpolated linearly.
double Quantile(const std::vector<double>& sorted, double q);

struct Slo {
  double ttft_s = 0, tpot_s = 0, e2e_s = 0;  // 0: not part of the SLO
  bool any() const { return ttft_s > 0 || tpot_s > 0 || e2e_s > 0; }
};
// "ttft=2,tpot=0.1,e2e=30" (seconds; "ms" suffix for milliseconds: ttft=500ms), as --slo takes it.
absl::StatusOr<Slo> ParseSlo(const std::string& s);

struct RunMetrics {
  int64_t requests = 0, completed = 0, failed = 0, unfinished = 0;
  double duration_s = 0;
  int64_t input_tokens = 0, output_tokens = 0, cached_tokens = 0;
  double request_throughput = 0, input_throughput = 0, output_throughput = 0;  // per second
  Stats ttft, tpot, itl, e2e;
  int64_t good = 0;            // completed and within the SLO
  double goodput = 0;          // good requests per second
  double prefix_hit_rate = 0;  // cached / input tokens of completed requests
};

RunMetrics ComputeMetrics(const std::vector<RequestTiming>& timings, const Slo& slo);

}  // namespace tandem::loadgen
