// What `tandem bench` prints and writes: the one-screen table and the JSON file with every
// request's timings (bench/plot_bench.py draws the plots from it).
//
// JSON layout (schema "tandem-bench/1"): {schema, command, started_at, model, target, workload
// {name, requests, mean_input_tokens, mean_output_tokens, notes[]}, slo {ttft_s, tpot_s, e2e_s},
// cost {priced, devices, usd_per_hour, price_table, price_table_date, estimate, amortized},
// prediction {...} or null, interrupted, runs: [{label, arrivals {kind, rate, burstiness,
// time_scale, description}, metrics {requests, completed, failed, unfinished, duration_s,
// input/output tokens and throughputs, ttft/tpot/itl/e2e {mean, median, p90, p99, min, max,
// count}, good, goodput, prefix_hit_rate}, cost {tokens_per_s, usd_per_hour,
// usd_per_million_output_tokens, price_table_date}, kv {mean_used, peak_used, mean_cached,
// samples [[t, used, cached]]}, steps, busy_seconds, skipped_turns, interrupted, requests:
// [{index, session, turn, arrival, sent, end, ttft, tpot, e2e, prompt_tokens, output_tokens,
// cached_tokens, finish_reason, error, token_times}]}]}. Times are seconds from each run's start.
#pragma once

#include <string>
#include <vector>

#include "loadgen/arrivals.h"
#include "loadgen/metrics.h"
#include "loadgen/runner.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

struct CostInfo {
  bool priced = false;
  std::string devices;  // "1 x h100 ($11.060/h)"
  double usd_per_hour = 0;
  std::string table_path, table_date;
  bool estimate = false, amortized = false;
};

// The planner's prediction for the measured layout and workload (planner/cost_model.h).
struct PredictionInfo {
  bool have = false;
  std::string why_not;  // when !have
  std::string layout;   // "1 h100 colocated"
  int64_t batch = 0;
  double step_s = 0, tokens_per_s = 0, usd_per_million = 0;
  std::string limit, bound;
};

struct RunReport {
  std::string label;  // "rate 4 req/s", "all at once"
  ArrivalSpec arrivals;
  RunResult result;
  RunMetrics metrics;
};

struct BenchReport {
  std::string command, started_at, model, target;
  std::string workload_name;
  std::vector<std::string> notes;
  int64_t workload_requests = 0;
  double mean_input = 0, mean_output = 0;
  Slo slo;
  CostInfo cost;
  PredictionInfo prediction;
  std::vector<RunReport> runs;
  bool interrupted = false;
};

std::string ReportJson(const BenchReport& report);
// The one-screen table: a header (workload, target, prices), one column per run.
std::string ReportTable(const BenchReport& report);

}  // namespace tandem::loadgen
