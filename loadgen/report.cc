#include "loadgen/report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "planner/devices.h"

namespace tandem::loadgen {

namespace {

using nlohmann::json;

json StatsJson(const Stats& s) {
  return {{"mean", s.mean}, {"median", s.median}, {"p90", s.p90},    {"p99", s.p99},
          {"min", s.min},   {"max", s.max},       {"count", s.count}};
}

const char* KindName(ArrivalKind k) {
  switch (k) {
    case ArrivalKind::kTrace:
      return "trace";
    case ArrivalKind::kPoisson:
      return "poisson";
    case ArrivalKind::kAllAtOnce:
      return "all";
  }
  return "?";
}

struct KvSummary {
  double mean_used = 0, peak_used = 0, mean_cached = 0;
};

KvSummary SummarizeKv(const std::vector<KvSample>& kv) {
  KvSummary s;
  if (kv.empty()) return s;
  for (const KvSample& k : kv) {
    s.mean_used += k.used;
    s.mean_cached += k.cached;
    s.peak_used = std::max(s.peak_used, k.used);
  }
  s.mean_used /= static_cast<double>(kv.size());
  s.mean_cached /= static_cast<double>(kv.size());
  return s;
}

double RunCost(const BenchReport& r, const RunMetrics& m) {
  return r.cost.priced ? planner::UsdPerMillionTokens(r.cost.usd_per_hour, m.output_throughput) : 0;
}

}  // namespace

std::string ReportJson(const BenchReport& r) {
  json j;
  j["schema"] = "tandem-bench/1";
  j["command"] = r.command;
  j["started_at"] = r.started_at;
  j["model"] = r.model;
  j["target"] = r.target;
  j["workload"] = {{"name", r.workload_name},
                   {"requests", r.workload_requests},
                   {"mean_input_tokens", r.mean_input},
                   {"mean_output_tokens", r.mean_output},
                   {"notes", r.notes}};
  j["slo"] = {{"ttft_s", r.slo.ttft_s}, {"tpot_s", r.slo.tpot_s}, {"e2e_s", r.slo.e2e_s}};
  j["cost"] = {{"priced", r.cost.priced},
               {"devices", r.cost.devices},
               {"usd_per_hour", r.cost.usd_per_hour},
               {"price_table", r.cost.table_path},
               {"price_table_date", r.cost.table_date},
               {"estimate", r.cost.estimate},
               {"amortized", r.cost.amortized}};
  if (r.prediction.have) {
    j["prediction"] = {{"layout", r.prediction.layout},
                       {"batch", r.prediction.batch},
                       {"step_s", r.prediction.step_s},
                       {"tokens_per_s", r.prediction.tokens_per_s},
                       {"usd_per_million_output_tokens", r.prediction.usd_per_million},
                       {"limit", r.prediction.limit},
                       {"bound", r.prediction.bound}};
  } else {
    j["prediction"] = nullptr;
    j["prediction_missing"] = r.prediction.why_not;
  }
  j["interrupted"] = r.interrupted;
  json runs = json::array();
  for (const RunReport& run : r.runs) {
    const RunMetrics& m = run.metrics;
    json jr;
    jr["label"] = run.label;
    jr["arrivals"] = {{"kind", KindName(run.arrivals.kind)},
                      {"rate", run.arrivals.rate},
                      {"burstiness", run.arrivals.burstiness},
                      {"time_scale", run.arrivals.time_scale},
                      {"description", DescribeArrivals(run.arrivals)}};
    jr["metrics"] = {{"requests", m.requests},
                     {"completed", m.completed},
                     {"failed", m.failed},
                     {"unfinished", m.unfinished},
                     {"duration_s", m.duration_s},
                     {"input_tokens", m.input_tokens},
                     {"output_tokens", m.output_tokens},
                     {"cached_tokens", m.cached_tokens},
                     {"request_throughput", m.request_throughput},
                     {"input_throughput", m.input_throughput},
                     {"output_throughput", m.output_throughput},
                     {"ttft", StatsJson(m.ttft)},
                     {"tpot", StatsJson(m.tpot)},
                     {"itl", StatsJson(m.itl)},
                     {"e2e", StatsJson(m.e2e)},
                     {"good", m.good},
                     {"goodput", m.goodput},
                     {"prefix_hit_rate", m.prefix_hit_rate}};
    jr["cost"] = {{"tokens_per_s", m.output_throughput},
                  {"usd_per_hour", r.cost.priced ? json(r.cost.usd_per_hour) : json(nullptr)},
                  {"usd_per_million_output_tokens", r.cost.priced ? json(RunCost(r, m)) : json(nullptr)},
                  {"price_table_date", r.cost.table_date}};
    const KvSummary kv = SummarizeKv(run.result.kv);
    json samples = json::array();
    const size_t stride = std::max<size_t>(1, run.result.kv.size() / 2000);
    for (size_t i = 0; i < run.result.kv.size(); i += stride) {
      const KvSample& s = run.result.kv[i];
      samples.push_back({s.t, s.used, s.cached});
    }
    jr["kv"] = {{"mean_used", kv.mean_used},
                {"peak_used", kv.peak_used},
                {"mean_cached", kv.mean_cached},
                {"samples", samples}};
    jr["steps"] = run.result.steps;
    jr["busy_seconds"] = run.result.busy_seconds;
    jr["skipped_turns"] = run.result.skipped_turns;
    jr["interrupted"] = run.result.interrupted;
    json reqs = json::array();
    for (const RequestTiming& t : run.result.timings) {
      json q = {{"index", t.index},
                {"session", t.session},
                {"turn", t.turn},
                {"arrival", t.arrival},
                {"sent", t.sent},
                {"end", t.end},
                {"prompt_tokens", t.prompt_tokens},
                {"output_tokens", t.output_tokens},
                {"cached_tokens", t.cached_tokens},
                {"finish_reason", t.finish_reason},
                {"error", t.error},
                {"token_times", t.token_times}};
      q["ttft"] = t.token_times.empty() ? json(nullptr) : json(t.token_times.front() - t.arrival);
      q["tpot"] = t.token_times.size() >= 2 ? json((t.token_times.back() - t.token_times.front()) /
                                                   static_cast<double>(t.token_times.size() - 1))
                                            : json(nullptr);
      q["e2e"] = t.completed() ? json(t.end - t.arrival) : json(nullptr);
      reqs.push_back(std::move(q));
    }
    jr["requests"] = std::move(reqs);
    runs.push_back(std::move(jr));
  }
  j["runs"] = std::move(runs);
  return j.dump(1);
}

std::string ReportTable(const BenchReport& r) {
  std::string out;
  absl::StrAppend(
      &out, "workload  ", r.workload_name, ": ", r.workload_requests,
      absl::StrFormat(" requests, mean %.1f in / %.1f out tokens\n", r.mean_input, r.mean_output));
  for (const std::string& n : r.notes) absl::StrAppend(&out, "          ", n, "\n");
  absl::StrAppend(&out, "target    ", r.target, "  (model ", r.model, ")\n");
  if (r.cost.priced) {
    absl::StrAppend(&out, "devices   ", r.cost.devices, absl::StrFormat(" = $%.3f/h", r.cost.usd_per_hour),
                    "  (prices ", r.cost.table_path, ", dated ", r.cost.table_date,
                    r.cost.estimate ? "; includes estimates" : "", ")\n");
  } else {
    absl::StrAppend(&out, "devices   not priced (give --compute-device, see --help)\n");
  }
  if (r.slo.any())
    absl::StrAppend(&out, absl::StrFormat("SLO       ttft <= %gs, tpot <= %gs, e2e <= %gs (0: none)\n",
                                          r.slo.ttft_s, r.slo.tpot_s, r.slo.e2e_s));
  const int w = 16;
  auto row = [&](const std::string& name, auto&& cell) {
    absl::StrAppend(&out, absl::StrFormat("%-26s", name));
    for (const RunReport& run : r.runs) absl::StrAppend(&out, absl::StrFormat("%*s", w, cell(run)));
    absl::StrAppend(&out, "\n");
  };
  auto f = [](const char* fmt, double v) { return absl::StrFormat(fmt, v); };
  auto ms = [](double s) { return absl::StrFormat("%.1f", s * 1e3); };
  row("run", [](const RunReport& run) { return run.label; });
  row("completed / failed", [](const RunReport& run) {
    return absl::StrCat(run.metrics.completed, " / ", run.metrics.failed + run.metrics.unfinished);
  });
  row("duration s", [&](const RunReport& run) { return f("%.2f", run.metrics.duration_s); });
  row("requests/s", [&](const RunReport& run) { return f("%.3f", run.metrics.request_throughput); });
  row("input tok/s", [&](const RunReport& run) { return f("%.1f", run.metrics.input_throughput); });
  row("output tok/s", [&](const RunReport& run) { return f("%.1f", run.metrics.output_throughput); });
  for (const auto& [name, get] :
       std::vector<std::pair<std::string, const Stats RunMetrics::*>>{{"TTFT", &RunMetrics::ttft},
                                                                      {"TPOT", &RunMetrics::tpot},
                                                                      {"ITL", &RunMetrics::itl},
                                                                      {"E2E", &RunMetrics::e2e}}) {
    row(name + " mean/p50 ms", [&, get = get](const RunReport& run) {
      const Stats& s = run.metrics.*get;
      return absl::StrCat(ms(s.mean), "/", ms(s.median));
    });
    row(name + " p90/p99 ms", [&, get = get](const RunReport& run) {
      const Stats& s = run.metrics.*get;
      return absl::StrCat(ms(s.p90), "/", ms(s.p99));
    });
  }
  if (r.slo.any()) {
    row("goodput req/s (good %)", [&](const RunReport& run) {
      const double pct = run.metrics.completed > 0 ? 100.0 * static_cast<double>(run.metrics.good) /
                                                         static_cast<double>(run.metrics.requests)
                                                   : 0;
      return absl::StrFormat("%.3f (%.0f%%)", run.metrics.goodput, pct);
    });
  }
  row("KV used mean/peak %", [&](const RunReport& run) {
    const KvSummary kv = SummarizeKv(run.result.kv);
    return run.result.kv.empty() ? std::string("n/a")
                                 : absl::StrFormat("%.1f/%.1f", 100 * kv.mean_used, 100 * kv.peak_used);
  });
  row("prefix hits % of input",
      [&](const RunReport& run) { return f("%.1f", 100 * run.metrics.prefix_hit_rate); });
  if (r.cost.priced) {
    row("$ / M output tokens", [&](const RunReport& run) { return f("%.4f", RunCost(r, run.metrics)); });
  }
  if (r.prediction.have) {
    absl::StrAppend(
        &out, absl::StrFormat("predicted (planner, %s): batch %d, step %.2f ms, %.0f output tok/s, $%.4f/M "
                              "(limit %s, bound %s); measured/predicted tok/s:",
                              r.prediction.layout, r.prediction.batch, r.prediction.step_s * 1e3,
                              r.prediction.tokens_per_s, r.prediction.usd_per_million, r.prediction.limit,
                              r.prediction.bound));
    for (const RunReport& run : r.runs)
      absl::StrAppend(&out,
                      absl::StrFormat(" %.2f", run.metrics.output_throughput / r.prediction.tokens_per_s));
    absl::StrAppend(&out, "\n");
  } else if (!r.prediction.why_not.empty()) {
    absl::StrAppend(&out, "predicted: ", r.prediction.why_not, "\n");
  }
  if (r.interrupted) absl::StrAppend(&out, "INTERRUPTED: figures cover what finished before Ctrl-C\n");
  return out;
}

}  // namespace tandem::loadgen
