#include "compute_node/pipeline_report.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace tandem {

PipelineReport MakePipelineReport(const PipelineTotals& now, const PipelineTotals& before) {
  PipelineReport r;
  r.steps = now.steps - before.steps;
  if (r.steps <= 0) {
    r.steps = 0;
    return r;
  }
  const double n = static_cast<double>(r.steps);
  r.step_ms = (now.step_ms - before.step_ms) / n;
  r.compute_ms = (now.compute_ms - before.compute_ms) / n;
  r.attention_phase_ms = (now.attention_phase_ms - before.attention_phase_ms) / n;
  for (size_t m = 0; m < now.rank_attention_ms.size(); ++m) {
    const double was = m < before.rank_attention_ms.size() ? before.rank_attention_ms[m] : 0.0;
    // A rank that could not say (lost: -1) stays unknown.
    r.rank_attention_ms.push_back(now.rank_attention_ms[m] < 0 ? -1.0 : (now.rank_attention_ms[m] - was) / n);
    r.attention_ms = std::max(r.attention_ms, r.rank_attention_ms.back());
  }
  r.phases_timed = now.phases_timed;
  if (!r.phases_timed) {
    r.compute_ms = r.attention_phase_ms = 0;
    return r;
  }
  r.exchange_ms = std::max(0.0, r.attention_phase_ms - r.attention_ms);
  r.idle_ms = std::max(0.0, r.step_ms - r.compute_ms - r.attention_phase_ms);
  const double busiest = std::max({r.compute_ms, r.attention_ms, r.exchange_ms});
  r.efficiency = r.step_ms > 0 ? std::min(1.0, busiest / r.step_ms) : 0.0;
  return r;
}

std::string PipelineReport::ToString() const {
  if (steps == 0) return "no steps";
  std::vector<std::string> ranks;
  for (double ms : rank_attention_ms)
    ranks.push_back(ms < 0 ? std::string("lost") : absl::StrFormat("%.2f", ms));
  if (!phases_timed) {
    return absl::StrFormat(
        "per step %.2f ms: attention %.2f (memory ranks %s); compute, exchange and efficiency need "
        "compute.profile: true; over %d steps",
        step_ms, attention_ms, absl::StrJoin(ranks, ", "), steps);
  }
  return absl::StrFormat(
      "per step %.2f ms: compute %.2f, attention %.2f (memory ranks %s), exchange %.2f, idle %.2f; "
      "efficiency %.2f over %d steps",
      step_ms, compute_ms, attention_ms, absl::StrJoin(ranks, ", "), exchange_ms, idle_ms, efficiency, steps);
}

}  // namespace tandem
