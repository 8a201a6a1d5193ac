// Prometheus metrics of the server, written in the text exposition format (version 0.0.4) by hand:
// the format is small and Debian packages no C++ client library. Names follow vLLM's where a user
// would compare the two (tandem:num_requests_running, tandem:time_to_first_token_seconds, ...).
//
// Histograms have fixed buckets (seconds) and are fed by the engine loop's finish hook; gauges and
// counters are read from the loop and the engine when /metrics is scraped.
//
// KV tiers (kv.tiers.*; compute_node/engine.h, KvTierCounters), when the engine has them:
//   tandem:kv_tier_restored_blocks_total, tandem:kv_tier_restore_failed_blocks_total
//   tandem:kv_tier_evictions_total{tier="pool"}             blocks the pool demoted
//   tandem:kv_tier_bytes_total{tier="pool",direction="out"|"in"}
// and where the engine owns its tiers (the colocated engine; a deployment's memory ranks log
// theirs when they end):
//   tandem:kv_tier_hits_total{tier="host"|"disk"}, tandem:kv_tier_misses_total,
//   tandem:kv_tier_discarded_total, tandem:kv_tier_disk_write_errors_total,
//   tandem:kv_tier_restore_seconds_total, tandem:kv_tier_save_seconds_total,
//   tandem:kv_tier_evictions_total{tier="host"|"disk"},
//   tandem:kv_tier_bytes_total{tier="host"|"disk",direction="in"|"out"}
//
// Thread safety: Observe() and Render() may run concurrently (one mutex).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "compute_node/controller.h"
#include "server/engine_loop.h"

namespace tandem::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds)
      : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void Observe(double v);
  // Appends "# HELP", "# TYPE" and the _bucket/_sum/_count lines of `name`.
  void Render(const std::string& name, const std::string& help, std::string* out) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); the last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();
  // The engine loop's finish hook: latency histograms of one finished request.
  void Observe(const GenerationResult& result, const RequestTimes& times);
  // The whole exposition: the loop's counters and gauges, then the histograms.
  std::string Render(const LoopStats& loop, const std::string& model_name) const;

 private:
  mutable std::mutex mu_;
  Histogram ttft_, tpot_, e2e_, queue_;
};

}  // namespace tandem::server
