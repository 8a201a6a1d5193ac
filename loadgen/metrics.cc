#include "loadgen/metrics.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace tandem::loadgen {

double Quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(sorted.size() - 1, lo + 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

Stats Summarize(std::vector<double> v) {
  Stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.count = static_cast<int64_t>(v.size());
  double sum = 0;
  for (double x : v) sum += x;
  s.mean = sum / static_cast<double>(v.size());
  s.median = Quantile(v, 0.5);
  s.p90 = Quantile(v, 0.9);
  s.p99 = Quantile(v, 0.99);
  s.min = v.front();
  s.max = v.back();
  return s;
}

absl::StatusOr<Slo> ParseSlo(const std::string& s) {
  Slo slo;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    if (kv.size() != 2)
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: expected key=seconds, got \"", std::string(part), "\""));
    const std::string key(absl::StripAsciiWhitespace(kv[0]));
    absl::string_view value = absl::StripAsciiWhitespace(kv[1]);
    double scale = 1;
    if (absl::ConsumeSuffix(&value, "ms")) {
      scale = 1e-3;
    } else {
      absl::ConsumeSuffix(&value, "s");
    }
    double v;
    if (!absl::SimpleAtod(value, &v) || !(v > 0) || !std::isfinite(v))
      return absl::InvalidArgumentError(
          absl::StrCat("--slo: ", key, ": expected a positive time, got \"", std::string(kv[1]), "\""));
    v *= scale;
    if (key == "ttft") {
      slo.ttft_s = v;
    } else if (key == "tpot") {
      slo.tpot_s = v;
    } else if (key == "e2e") {
      slo.e2e_s = v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--slo: unknown key \"", key, "\" (ttft, tpot, e2e)"));
    }
  }
  return slo;
}

RunMetrics ComputeMetrics(const std::vector<RequestTiming>& timings, const Slo& slo) {
  RunMetrics m;
  m.requests = static_cast<int64_t>(timings.size());
  std::vector<double> ttft, tpot, itl, e2e;
  double start = std::numeric_limits<double>::infinity(), last = 0;
  for (const RequestTiming& t : timings) {
    if (t.sent >= 0) start = std::min(start, t.arrival);
    if (!t.error.empty()) {
      ++m.failed;
      continue;
    }
    if (!t.completed()) {
      ++m.unfinished;
      continue;
    }
    ++m.completed;
    last = std::max(last, t.end);
    m.input_tokens += t.prompt_tokens;
    m.output_tokens += t.output_tokens;
    m.cached_tokens += t.cached_tokens;
    const double first = t.token_times.front();
    const double r_ttft = first - t.arrival;
    const double r_e2e = t.end - t.arrival;
    ttft.push_back(r_ttft);
    e2e.push_back(r_e2e);
    double r_tpot = 0;
    if (t.token_times.size() >= 2) {
      r_tpot = (t.token_times.back() - first) / static_cast<double>(t.token_times.size() - 1);
      tpot.push_back(r_tpot);
      for (size_t i = 1; i < t.token_times.size(); ++i)
        itl.push_back(t.token_times[i] - t.token_times[i - 1]);
    }
    const bool good = (slo.ttft_s <= 0 || r_ttft <= slo.ttft_s) &&
                      (slo.tpot_s <= 0 || r_tpot <= slo.tpot_s) && (slo.e2e_s <= 0 || r_e2e <= slo.e2e_s);
    if (good) ++m.good;
  }
  m.duration_s = m.completed > 0 ? last - start : 0;
  if (m.duration_s > 0) {
    m.request_throughput = static_cast<double>(m.completed) / m.duration_s;
    m.input_throughput = static_cast<double>(m.input_tokens) / m.duration_s;
    m.output_throughput = static_cast<double>(m.output_tokens) / m.duration_s;
    m.goodput = static_cast<double>(m.good) / m.duration_s;
  }
  m.prefix_hit_rate =
      m.input_tokens > 0 ? static_cast<double>(m.cached_tokens) / static_cast<double>(m.input_tokens) : 0;
  m.ttft = Summarize(std::move(ttft));
  m.tpot = Summarize(std::move(tpot));
  m.itl = Summarize(std::move(itl));
  m.e2e = Summarize(std::move(e2e));
  return m;
}

}  // namespace tandem::loadgen
