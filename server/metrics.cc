#include "server/metrics.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::server {

namespace {
const std::vector<double> kLatencyBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                             0.75,  1.0,   2.5,  5.0,  7.5,  10,   20,   40,  80,   160};
const std::vector<double> kTokenBuckets = {0.001, 0.0025, 0.005, 0.0075, 0.01,  0.015, 0.02,
                                           0.025, 0.03,   0.04,  0.05,   0.075, 0.1,   0.15,
                                           0.2,   0.3,    0.4,   0.5,    0.75,  1.0,   2.5};

std::string Num(double v) { return absl::StrFormat("%.9g", v); }

// The KV tiers' counters (compute_node/engine.h, KvTierCounters): the controller's on every engine,
// the per-tier ones where the engine owns its tiers (the colocated engine).
void RenderTiers(const KvTierCounters& t, const std::string& model_name, std::string* out) {
  struct Sample {
    std::string labels;  // after model_name, each with its leading comma
    double value;
  };
  auto family = [&](const char* name, const char* type, const char* help,
                    const std::vector<Sample>& samples) {
    absl::StrAppend(out, "# HELP tandem:", name, " ", help, "\n# TYPE tandem:", name, " ", type, "\n");
    for (const Sample& x : samples)
      absl::StrAppend(out, "tandem:", name, "{model_name=\"", model_name, "\"", x.labels, "} ", Num(x.value),
                      "\n");
  };
  auto d = [](int64_t v) { return static_cast<double>(v); };
  family("kv_tier_restored_blocks_total", "counter",
         "Prefix blocks brought back into the KV pool from a lower tier instead of recomputed.",
         {{"", d(t.restored_blocks)}});
  family("kv_tier_restore_failed_blocks_total", "counter",
         "Prefix blocks whose restore found no good copy (their tokens were recomputed).",
         {{"", d(t.restore_failed_blocks)}});
  family("kv_tier_prefetched_blocks_total", "counter",
         "Prefix blocks restored for waiting requests before their admission (kv.tiers.prefetch_lookahead; "
         "part of kv_tier_restored_blocks_total).",
         {{"", d(t.prefetched_blocks)}});
  family("kv_tier_prefetch_used_blocks_total", "counter",
         "Prefetched blocks that an admitted request then attached.", {{"", d(t.prefetch_used_blocks)}});
  family("kv_tier_prefetch_wasted_blocks_total", "counter",
         "Prefetched blocks evicted again before any request attached them.",
         {{"", d(t.prefetch_wasted_blocks)}});
  family("kv_tier_shifted_blocks_total", "counter",
         "Prefix blocks assembled from rows of other registered blocks at new positions (kv.store_pre_rope; "
         "part of kv_tier_restored_blocks_total).",
         {{"", d(t.shifted_blocks)}});
  family("kv_tier_shifted_failed_blocks_total", "counter",
         "kv.store_pre_rope blocks whose assembly failed (recomputed; part of "
         "kv_tier_restore_failed_blocks_total).",
         {{"", d(t.shifted_failed_blocks)}});
  std::vector<Sample> evictions = {{",tier=\"pool\"", d(t.demoted_blocks)}};
  std::vector<Sample> bytes = {{",tier=\"pool\",direction=\"out\"", d(t.pool_bytes_out)},
                               {",tier=\"pool\",direction=\"in\"", d(t.pool_bytes_in)}};
  if (t.per_tier) {
    evictions.push_back({",tier=\"host\"", d(t.host_evictions)});
    evictions.push_back({",tier=\"disk\"", d(t.disk_evictions)});
    bytes.push_back({",tier=\"host\",direction=\"in\"", d(t.bytes_to_host)});
    bytes.push_back({",tier=\"host\",direction=\"out\"", d(t.bytes_from_host)});
    bytes.push_back({",tier=\"disk\",direction=\"in\"", d(t.bytes_to_disk)});
    bytes.push_back({",tier=\"disk\",direction=\"out\"", d(t.bytes_from_disk)});
    family("kv_tier_hits_total", "counter", "Restores served by each lower tier.",
           {{",tier=\"host\"", d(t.host_hits)}, {",tier=\"disk\"", d(t.disk_hits)}});
    family("kv_tier_misses_total", "counter", "Restores of blocks found in no lower tier.",
           {{"", d(t.misses)}});
    family("kv_tier_discarded_total", "counter",
           "Block copies that failed their checks (corrupt, truncated, another version or model).",
           {{"", d(t.discarded)}});
    family("kv_tier_disk_write_errors_total", "counter", "Block files that could not be written.",
           {{"", d(t.disk_write_errors)}});
    family("kv_tier_restore_seconds_total", "counter",
           "Time loading blocks from the lower tiers back into the KV pool.", {{"", t.restore_seconds}});
    family("kv_tier_restore_stall_seconds_total", "counter",
           "Of the restore time, the part spent before a step's layers could start (the rest is copied "
           "layer by layer, just before each layer's attention).",
           {{"", t.restore_stall_seconds}});
    family("kv_tier_save_seconds_total", "counter",
           "Time copying blocks evicted from the KV pool into the lower tiers (it delays the step whose "
           "admission evicted them).",
           {{"", t.save_seconds}});
  }
  family("kv_tier_evictions_total", "counter",
         "Blocks evicted from each tier: the pool's go to the lower tiers, the lower tiers' are dropped.",
         evictions);
  family("kv_tier_bytes_total", "counter",
         "KV bytes moved into (in) and out of (out) each tier; the pool's out is what the lower tiers took.",
         bytes);
}
}  // namespace

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::Render(const std::string& name, const std::string& help, std::string* out) const {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    absl::StrAppend(out, name, "_bucket{le=\"", Num(bounds_[i]), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(out, name, "_bucket{le=\"+Inf\"} ", count_, "\n", name, "_sum ", Num(sum_), "\n", name,
                  "_count ", count_, "\n");
}

ServerMetrics::ServerMetrics()
    : ttft_(kLatencyBuckets), tpot_(kTokenBuckets), e2e_(kLatencyBuckets), queue_(kLatencyBuckets) {}

void ServerMetrics::Observe(const GenerationResult& result, const RequestTimes& t) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.Observe(absl::ToDoubleSeconds(t.admitted - t.submitted));
  e2e_.Observe(absl::ToDoubleSeconds(t.finished - t.submitted));
  if (result.token_ids.empty()) return;
  ttft_.Observe(absl::ToDoubleSeconds(t.first_token - t.submitted));
  if (result.token_ids.size() > 1) {
    tpot_.Observe(absl::ToDoubleSeconds(t.finished - t.first_token) /
                  static_cast<double>(result.token_ids.size() - 1));
  }
}

std::string ServerMetrics::Render(const LoopStats& s, const std::string& model_name) const {
  std::string out;
  const std::string label = absl::StrCat("{model_name=\"", model_name, "\"}");
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    absl::StrAppend(&out, "# HELP tandem:", name, " ", help, "\n# TYPE tandem:", name, " ", type,
                    "\ntandem:", name, label, " ", Num(v), "\n");
  };
  metric("num_requests_running", "gauge", "Requests in the running batch.", static_cast<double>(s.running));
  metric("num_requests_waiting", "gauge", "Requests queued for admission.", static_cast<double>(s.waiting));
  metric("healthy", "gauge", "1 while the engine works, 0 after a step failed.", s.healthy ? 1 : 0);
  metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
         static_cast<double>(s.prompt_tokens));
  metric("generation_tokens_total", "counter", "Tokens generated for finished requests.",
         static_cast<double>(s.generation_tokens));
  metric("prefix_cache_hit_tokens_total", "counter",
         "Prompt tokens whose KV was reused from the prefix cache.", static_cast<double>(s.cached_tokens));
  metric("request_success_total", "counter", "Requests that finished (stop or length).",
         static_cast<double>(s.finished));
  metric("request_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).",
         static_cast<double>(s.cancelled));
  metric("request_failed_total", "counter", "Requests ended by an engine failure.",
         static_cast<double>(s.failed));
  metric("request_refused_total", "counter", "Requests refused at submission (queue full, bad request).",
         static_cast<double>(s.refused));
  metric("engine_steps_total", "counter", "Engine steps run.", static_cast<double>(s.steps));
  metric("memory_ranks_lost_total", "counter",
         "Memory ranks given up (their requests recomputed on the others).",
         static_cast<double>(s.recovery.memory_ranks_lost));
  metric("memory_ranks_rejoined_total", "counter",
         "Lost memory ranks taken back (a new process of the rank).",
         static_cast<double>(s.recovery.memory_ranks_rejoined));
  metric("requests_recovered_total", "counter", "Requests recomputed on another memory rank after a loss.",
         static_cast<double>(s.recovery.requests_recovered));
  metric("compute_ranks_lost_total", "counter",
         "Compute replicas given up (their micro-batches run on the surviving compute ranks).",
         static_cast<double>(s.recovery.compute_ranks_lost));
  metric("steps_rerun_total", "counter",
         "Steps run again after a step discard: a compute replica lost in them, or a memory rank lost while "
         "replicas ran.",
         static_cast<double>(s.recovery.steps_rerun));
  metric("compute_replicas_kept_total", "counter",
         "Compute replicas that went on after a loss (counted at each step discard that kept one).",
         static_cast<double>(s.recovery.compute_replicas_kept));
  metric("compute_ranks_live", "gauge",
         "Compute ranks running micro-batches (compute rank 0 and the replicas not lost; 0 "
         "without compute ranks).",
         static_cast<double>(s.recovery.compute_ranks_live));
  metric("replica_micro_batches_total", "counter", "Micro-batches whose tokens a compute replica sampled.",
         static_cast<double>(s.recovery.replica_micro_batches));
  metric("engine_step_seconds_total", "counter", "Wall time inside engine steps.", s.step_seconds);
  if (s.pipeline) {
    // A deployment's pipeline (compute_node/pipeline_report.h): totals as counters, and the split
    // of the steps between the last two snapshots (about a second) as gauges.
    const PipelineTotals& p = *s.pipeline;
    metric("pipeline_steps_total", "counter", "Deployment steps measured by the pipeline report.",
           static_cast<double>(p.steps));
    metric("pipeline_step_seconds_total", "counter", "Wall time of those steps on compute rank 0.",
           p.step_ms / 1e3);
    metric("pipeline_compute_seconds_total", "counter",
           "Compute rank 0's time in embedding, linear layers and sampling (0 without compute.profile).",
           p.compute_ms / 1e3);
    metric("pipeline_attention_phase_seconds_total", "counter",
           "Compute rank 0's time from q,k,v ready to the last attention output in place.",
           p.attention_phase_ms / 1e3);
    absl::StrAppend(
        &out, "# HELP tandem:pipeline_memory_attention_seconds_total Attention time of each memory rank.\n",
        "# TYPE tandem:pipeline_memory_attention_seconds_total counter\n");
    for (size_t m = 0; m < p.rank_attention_ms.size(); ++m)
      absl::StrAppend(&out, "tandem:pipeline_memory_attention_seconds_total{model_name=\"", model_name,
                      "\",rank=\"", m, "\"} ", Num(p.rank_attention_ms[m] / 1e3), "\n");
    const PipelineReport& w = s.pipeline_window;
    metric("pipeline_efficiency", "gauge",
           "max(compute, attention, exchange) / step over the last window (0 before two snapshots).",
           w.efficiency);
    metric("pipeline_exchange_ms", "gauge", "Exchange time per step over the last window.", w.exchange_ms);
    metric("pipeline_idle_ms", "gauge", "Idle time per step of compute rank 0 over the last window.",
           w.idle_ms);
  }
  if (s.tiers.enabled) RenderTiers(s.tiers, model_name, &out);
  absl::StrAppend(
      &out, "# HELP tandem:kv_cache_usage_perc KV slots promised to running requests, per memory rank.\n",
      "# TYPE tandem:kv_cache_usage_perc gauge\n");
  for (size_t m = 0; m < s.kv.size(); ++m) {
    const double used = s.kv[m].capacity > 0 ? static_cast<double>(s.kv[m].reserved) / s.kv[m].capacity : 0;
    absl::StrAppend(&out, "tandem:kv_cache_usage_perc{model_name=\"", model_name, "\",rank=\"", m, "\"} ",
                    Num(used), "\n");
  }
  absl::StrAppend(&out, "# HELP tandem:kv_cache_reserved_tokens KV slots promised to running requests.\n",
                  "# TYPE tandem:kv_cache_reserved_tokens gauge\n");
  for (size_t m = 0; m < s.kv.size(); ++m)
    absl::StrAppend(&out, "tandem:kv_cache_reserved_tokens{model_name=\"", model_name, "\",rank=\"", m,
                    "\"} ", s.kv[m].reserved, "\n");
  absl::StrAppend(&out, "# HELP tandem:kv_cache_capacity_tokens KV slots of each memory rank.\n",
                  "# TYPE tandem:kv_cache_capacity_tokens gauge\n");
  for (size_t m = 0; m < s.kv.size(); ++m)
    absl::StrAppend(&out, "tandem:kv_cache_capacity_tokens{model_name=\"", model_name, "\",rank=\"", m,
                    "\"} ", s.kv[m].capacity, "\n");
  absl::StrAppend(&out,
                  "# HELP tandem:prefix_cache_tokens KV held by prefix blocks no running request uses.\n",
                  "# TYPE tandem:prefix_cache_tokens gauge\n");
  for (size_t m = 0; m < s.kv.size(); ++m)
    absl::StrAppend(&out, "tandem:prefix_cache_tokens{model_name=\"", model_name, "\",rank=\"", m, "\"} ",
                    s.kv[m].cached, "\n");
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.Render("tandem:time_to_first_token_seconds", "Time from arrival to the first generated token.", &out);
  tpot_.Render("tandem:time_per_output_token_seconds", "Mean time between a request's generated tokens.",
               &out);
  e2e_.Render("tandem:e2e_request_latency_seconds", "Time from arrival to the last token.", &out);
  queue_.Render("tandem:request_queue_time_seconds", "Time from arrival until the engine took the request.",
                &out);
  return out;
}

}  // namespace tandem::server
