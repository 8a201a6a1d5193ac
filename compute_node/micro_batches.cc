#include "compute_node/micro_batches.h"

#include <algorithm>
#include <numeric>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

MicroBatches SplitStep(const PlannedStep& step, int n) {
  const StepPlan& plan = step.plan;
  const size_t num_req = plan.requests.size();
  TANDEM_CHECK(num_req > 0 && n >= 1 && static_cast<size_t>(n) <= kMaxMicroBatches);
  const size_t parts = std::min(static_cast<size_t>(n), num_req);

  // Each request's rows in the step, and its cost: share of the rows plus share of the KV read.
  std::vector<int32_t> first_row(num_req + 1, 0);
  double total_rows = 0, total_kv = 0;
  for (size_t i = 0; i < num_req; ++i) {
    first_row[i + 1] = first_row[i] + plan.requests[i].q_len;
    total_rows += plan.requests[i].q_len;
    total_kv += plan.requests[i].kv_len;
  }
  std::vector<double> cost(num_req);
  for (size_t i = 0; i < num_req; ++i) {
    cost[i] = plan.requests[i].q_len / total_rows + plan.requests[i].kv_len / total_kv;
  }
  // Heaviest first to the lightest part (ties: the lower request index, the lower part).
  std::vector<size_t> order(num_req);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<double> load(parts, 0.0);
  std::vector<int32_t> part_of(num_req, 0);
  for (size_t k = 0; k < num_req; ++k) {
    // The first `parts` requests open one part each, so no part is empty.
    const size_t p =
        k < parts ? k : static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    part_of[order[k]] = static_cast<int32_t>(p);
    load[p] += cost[order[k]];
  }

  MicroBatches mb;
  mb.parts.resize(parts);
  // Sample rows of the step in order: the sampled requests in plan order.
  std::vector<int32_t> sample_index(num_req, -1);
  for (size_t i = 0, s = 0; i < num_req; ++i) {
    if (plan.requests[i].sample) sample_index[i] = static_cast<int32_t>(s++);
  }
  for (size_t p = 0; p < parts; ++p) {
    PlannedStep& part = mb.parts[p];
    part.plan.step_id = plan.step_id;
    part.plan.micro_batch = static_cast<uint8_t>(p);
    part.plan.micro_batches = static_cast<uint8_t>(parts);
    part.rank_rows.assign(step.rank_rows.size(), 0);
  }
  mb.samples.resize(step.rows.sample_rows.size());
  std::vector<std::vector<int32_t>> group_map(parts, std::vector<int32_t>(plan.groups.size(), -1));
  // A part's index of group g, adding g and its ancestors (parents first) the first time.
  auto map_group = [&](size_t p, int32_t g, auto&& self) -> int32_t {
    if (g < 0) return -1;
    int32_t& mapped = group_map[p][static_cast<size_t>(g)];
    if (mapped >= 0) return mapped;
    PrefixGroup group = plan.groups[static_cast<size_t>(g)];
    group.parent = self(p, group.parent, self);
    std::vector<PrefixGroup>& groups = mb.parts[p].plan.groups;
    mapped = static_cast<int32_t>(groups.size());
    groups.push_back(group);
    return mapped;
  };
  for (size_t i = 0; i < num_req; ++i) {
    const size_t p = static_cast<size_t>(part_of[i]);
    PlannedStep& part = mb.parts[p];
    StepRequest r = plan.requests[i];
    r.prefix_group = map_group(p, r.prefix_group, map_group);
    part.plan.requests.push_back(r);
    StepTokens& rows = part.rows;
    for (int32_t row = first_row[i]; row < first_row[i + 1]; ++row) {
      rows.tokens.push_back(step.rows.tokens[static_cast<size_t>(row)]);
      rows.positions.push_back(step.rows.positions[static_cast<size_t>(row)]);
    }
    // The controller counts a request's rows under its placement group, its memory_rank (rank 0,
    // the one group, under the head partition).
    part.rank_rows[static_cast<size_t>(r.memory_rank) + 1] += r.q_len;
    if (sample_index[i] >= 0) {
      const size_t s = static_cast<size_t>(sample_index[i]);
      mb.samples[s] = {static_cast<int32_t>(p), static_cast<int32_t>(rows.sample_rows.size())};
      rows.sample_rows.push_back(static_cast<int32_t>(rows.tokens.size()) - 1);
      rows.sampling.push_back(step.rows.sampling[s]);
      rows.counters.push_back(step.rows.counters[s]);
      if (!step.rows.top_logprobs.empty()) rows.top_logprobs.push_back(step.rows.top_logprobs[s]);
    }
  }
  // A publish goes with its request (a plan lists each request once).
  std::unordered_map<uint64_t, int32_t> part_of_id;
  for (size_t i = 0; i < num_req; ++i) part_of_id[plan.requests[i].request_id] = part_of[i];
  for (const PrefixPublish& pub : plan.publishes) {
    mb.parts[static_cast<size_t>(part_of_id.at(pub.request_id))].plan.publishes.push_back(pub);
  }
  mb.parts[0].plan.evictions = plan.evictions;
  mb.parts[0].plan.restores = plan.restores;
  mb.parts[0].plan.next_uses = plan.next_uses;
  for (PlannedStep& part : mb.parts) {
    for (size_t m = 1; m < part.rank_rows.size(); ++m) part.rank_rows[m] += part.rank_rows[m - 1];
  }
  return mb;
}

absl::Status MergeSampled(const MicroBatches& mb, std::span<const SampledTokens> parts,
                          SampledTokens* sampled) {
  for (size_t p = 0; p < mb.parts.size(); ++p) {
    const size_t want = mb.parts[p].rows.sample_rows.size();
    if (p >= parts.size() || parts[p].tokens.size() != want || parts[p].logprobs.size() != want ||
        !(parts[p].top.empty() || parts[p].top.size() == want)) {
      return absl::InternalError(absl::StrCat("micro-batch ", p, " of step ", mb.parts[p].plan.step_id,
                                              " returned the wrong number of tokens (", want,
                                              " sample rows)"));
    }
  }
  for (const auto& [p, k] : mb.samples)
    sampled->AppendFrom(parts[static_cast<size_t>(p)], static_cast<size_t>(k));
  return absl::OkStatus();
}

}  // namespace tandem
