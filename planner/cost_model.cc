#include "planner/cost_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::planner {

WorkloadShape WorkloadShape::FromLengths(double prompt_tokens, double output_tokens, double cached_fraction) {
  WorkloadShape w;
  w.context_tokens = prompt_tokens + output_tokens / 2;
  w.reserved_tokens = prompt_tokens + output_tokens;
  w.prefill_rows_per_token = output_tokens > 0 ? prompt_tokens * (1 - cached_fraction) / output_tokens : 0;
  w.description = absl::StrFormat("prompt %.0f, output %.0f tokens (mean)", prompt_tokens, output_tokens);
  if (cached_fraction > 0)
    absl::StrAppend(&w.description, absl::StrFormat(", %.0f%% cached", 100 * cached_fraction));
  return w;
}

const char* PipelineModeName(PipelineMode mode) {
  switch (mode) {
    case PipelineMode::kColocated:
      return "colocated";
    case PipelineMode::kSequential:
      return "sequential";
    case PipelineMode::kPingPong:
      return "ping-pong";
  }
  return "?";
}

namespace {

struct Terms {
  double linear = 0, attention = 0, exchange = 0, step = 0;
};

}  // namespace

Prediction Predict(const ModelSpec& model, const WorkloadShape& w, const DeviceSpec& compute,
                   double compute_usd_per_hour, const DeviceSpec* memory, double memory_usd_per_hour,
                   int memory_count, PipelineMode mode, const PlanOptions& o) {
  Prediction p;
  p.mode = mode;
  p.compute_device = compute.name;
  const bool colocated = mode == PipelineMode::kColocated;
  if (!colocated) {
    p.memory_device = memory != nullptr ? memory->name : "";
    p.memory_count = memory_count;
  }
  p.usd_per_hour = compute_usd_per_hour + (colocated ? 0.0 : memory_count * memory_usd_per_hour);
  const double n_params = static_cast<double>(model.num_parameters());
  const double weight_bytes = n_params * o.elem_bytes;
  const double kv_per_token = static_cast<double>(model.kv_bytes_per_token(1)) * o.elem_bytes;
  const double bw_c = compute.read_bandwidth * o.efficiency;
  const double flops_c = compute.bf16_flops * o.efficiency;
  if (!colocated && (memory == nullptr || memory_count < 1)) {
    p.infeasible = "no memory devices";
    return p;
  }
  if (weight_bytes > compute.memory_bytes * o.kv_memory_fraction) {
    p.infeasible = absl::StrFormat("weights (%.1f GB) do not fit on %s", weight_bytes / 1e9, compute.name);
    return p;
  }
  if (!(flops_c > 0)) {
    p.infeasible = absl::StrCat(compute.name, " has no FLOP/s figure (memory role only)");
    return p;
  }
  double kv_bytes, kv_bw;
  if (colocated) {
    kv_bytes = compute.memory_bytes * o.kv_memory_fraction - weight_bytes;
    kv_bw = bw_c;
  } else {
    kv_bytes = memory_count * memory->memory_bytes * o.kv_memory_fraction;
    kv_bw = memory_count * memory->read_bandwidth * o.efficiency;
  }
  p.kv_capacity_tokens = kv_bytes / kv_per_token;
  double link = o.link_bandwidth;
  if (!colocated && !(link > 0)) {
    link = compute.link_bandwidth;
    if (memory->link_bandwidth > 0) link = std::min(link, memory->link_bandwidth * memory_count);
  }
  const double exchange_per_row =
      static_cast<double>(model.num_layers) * (2.0 * model.q_dim() + 2.0 * model.kv_dim()) * o.elem_bytes;
  auto linear = [&](double rows) { return std::max(weight_bytes / bw_c, 2.0 * n_params * rows / flops_c); };
  auto terms = [&](int64_t b) {
    Terms t;
    const double rows = b * (1.0 + w.prefill_rows_per_token);
    t.attention = b * w.context_tokens * kv_per_token / kv_bw;
    switch (mode) {
      case PipelineMode::kColocated:
        t.linear = linear(rows);
        t.step = t.linear + t.attention;
        break;
      case PipelineMode::kSequential:
        t.linear = linear(rows);
        t.exchange = rows * exchange_per_row / link + 2.0 * model.num_layers * o.link_latency_s;
        t.step = t.linear + t.attention + t.exchange;
        break;
      case PipelineMode::kPingPong:
        t.linear = 2.0 * linear(rows / 2.0);
        t.exchange = rows * exchange_per_row / link + 4.0 * model.num_layers * o.link_latency_s;
        t.step = std::max({t.linear, t.attention, t.exchange});
        break;
    }
    return t;
  };
  const int64_t by_kv = static_cast<int64_t>(std::floor(p.kv_capacity_tokens / w.reserved_tokens));
  if (by_kv < 1) {
    p.infeasible = absl::StrFormat("one request (%.0f tokens) does not fit in the KV (%.0f tokens)",
                                   w.reserved_tokens, p.kv_capacity_tokens);
    return p;
  }
  int64_t hi = std::min(by_kv, o.max_batch);
  p.limit = by_kv <= o.max_batch ? "KV capacity" : "max batch";
  if (o.tpot_slo_s > 0 && terms(hi).step > o.tpot_slo_s) {
    // step time grows with B: the largest B within the SLO, by bisection.
    if (terms(1).step > o.tpot_slo_s) {
      p.infeasible =
          absl::StrFormat("one request's step (%.2f ms) exceeds the TPOT SLO", terms(1).step * 1e3);
      return p;
    }
    int64_t lo = 1;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      (terms(mid).step <= o.tpot_slo_s ? lo : hi) = mid;
    }
    hi = lo;
    p.limit = "TPOT SLO";
  }
  const Terms t = terms(hi);
  p.feasible = true;
  p.batch = hi;
  p.rows = hi * (1.0 + w.prefill_rows_per_token);
  p.linear_s = t.linear;
  p.attention_s = t.attention;
  p.exchange_s = t.exchange;
  p.step_s = t.step;
  p.tokens_per_s = hi / t.step;
  p.usd_per_million = UsdPerMillionTokens(p.usd_per_hour, p.tokens_per_s);
  p.tokens_per_usd = p.usd_per_hour > 0 ? p.tokens_per_s * 3600.0 / p.usd_per_hour : 0;
  const bool compute_bound = 2.0 * n_params * p.rows / flops_c >= weight_bytes / bw_c;
  const double largest = std::max({t.linear, t.attention, t.exchange});
  if (largest == t.exchange) {
    p.bound = "link";
  } else if (largest == t.attention) {
    p.bound = "KV bandwidth";
  } else {
    p.bound = compute_bound ? "compute" : "weight reads";
  }
  return p;
}

std::vector<Prediction> Plan(const ModelSpec& model, const WorkloadShape& workload, const DeviceSpec& compute,
                             double compute_usd_per_hour,
                             const std::vector<std::pair<DeviceSpec, double>>& memory_devices,
                             const PlanOptions& options) {
  std::vector<Prediction> all;
  all.push_back(Predict(model, workload, compute, compute_usd_per_hour, nullptr, 0, 0,
                        PipelineMode::kColocated, options));
  for (const auto& [mem, price] : memory_devices) {
    for (int m = 1; m <= options.max_memory_per_compute; ++m) {
      for (PipelineMode mode : {PipelineMode::kSequential, PipelineMode::kPingPong}) {
        all.push_back(Predict(model, workload, compute, compute_usd_per_hour, &mem, price, m, mode, options));
      }
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Prediction& a, const Prediction& b) {
    if (a.feasible != b.feasible) return a.feasible;
    return a.tokens_per_usd > b.tokens_per_usd;
  });
  return all;
}

double MinLinkBandwidth(const ModelSpec& model, double mfu, double peak_flops, double elem_bytes) {
  const double bytes_per_row =
      static_cast<double>(model.num_layers) * (2.0 * model.q_dim() + 2.0 * model.kv_dim()) * elem_bytes;
  const double flops_per_row = 2.0 * static_cast<double>(model.num_parameters());
  return bytes_per_row * mfu * peak_flops / flops_per_row;
}

std::string FormatPrediction(const Prediction& p) {
  const std::string layout = p.mode == PipelineMode::kColocated
                                 ? absl::StrCat("1 ", p.compute_device, " colocated")
                                 : absl::StrCat("1 ", p.compute_device, " + ", p.memory_count, " ",
                                                p.memory_device, " ", PipelineModeName(p.mode));
  if (!p.feasible) return absl::StrFormat("%-44s infeasible: %s", layout, p.infeasible);
  return absl::StrFormat(
      "%-44s B %5d  step %7.2f ms (lin %6.2f att %6.2f xfer %5.2f)  %9.0f tok/s  $%6.2f/h  $%7.3f/M  %-11s "
      "%s",
      layout, p.batch, p.step_s * 1e3, p.linear_s * 1e3, p.attention_s * 1e3, p.exchange_s * 1e3,
      p.tokens_per_s, p.usd_per_hour, p.usd_per_million, p.limit, p.bound);
}

}  // namespace tandem::planner
