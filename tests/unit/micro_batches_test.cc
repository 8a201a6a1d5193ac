// The micro-batch split of pipelining (compute_node/micro_batches.h) on the controller's real
// plans: a randomized run (shared prompts, bursts, cancellations, small KV pools that force
// eviction, prefix groups on) in which every step is split into 1..8 micro-batches. Checked for
// every step:
//   * no request is lost, duplicated or moved to another memory rank, each part keeps the step's
//     order, and no part is empty (min(n, requests) parts);
//   * each part's rows, sample rows, sampling parameters, counters and rank_rows are its requests'
//     own, and MergeSampled puts the parts' tokens back in the step's order;
//   * each part carries the groups its requests use (with their ancestors), its requests'
//     publishes, and part 0 the step's evictions;
//   * applying the parts in order to one KvTable per memory rank (as a memory rank does) leaves
//     exactly the state that applying the whole step leaves, and every part applies;
//   * balance: no part's cost exceeds the mean by more than the heaviest request's cost.
#include "compute_node/micro_batches.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "memory_node/kv_table.h"

namespace tandem {
namespace {

TEST(MicroBatches, RandomizedPlansSplitWithoutLossAndApplyLikeTheWholeStep) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  constexpr int kRanks = 3;
  constexpr int64_t kCapacity = 160, kBlock = 4;
  ControllerOptions o;
  o.max_batch_size = 12;
  o.max_tokens_per_step = 48;
  o.prefix_block_tokens = kBlock;
  o.prefix_sharing = PrefixSharing::kOn;
  Controller c(*spec, std::vector<int64_t>(kRanks, kCapacity), o);
  // Per rank: one table that gets the parts, one that gets the whole step.
  std::vector<std::unique_ptr<KvTable>> split, whole;
  for (int m = 0; m < kRanks; ++m) {
    for (auto* tables : {&split, &whole}) {
      tables->push_back(std::make_unique<KvTable>(kCapacity, kBlock));
      tables->back()->SetPrefixSharing(PrefixSharing::kOn, nullptr);
    }
  }
  std::mt19937 rng(20261125);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto tokens = [&](int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(rnd(2, static_cast<int>(spec->vocab_size) - 1));
    return t;
  };
  std::vector<std::vector<int32_t>> systems;
  for (int i = 0; i < 3; ++i) systems.push_back(tokens(rnd(1, 4) * static_cast<int>(kBlock) + rnd(0, 3)));

  int64_t steps = 0, multi_part_steps = 0, grouped_parts = 0, evicting_steps = 0;
  std::set<int64_t> live;
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  auto release = [&] {
    for (int m = 0; m < kRanks; ++m) {
      split[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
      whole[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
    }
  };
  for (int iter = 0; iter < 500; ++iter) {
    if (iter < 380 && rnd(0, 2) == 0) {
      for (int k = rnd(1, 6); k > 0; --k) {
        GenerationRequest r;
        r.prompt = systems[static_cast<size_t>(rnd(0, 2))];
        const std::vector<int32_t> own = tokens(rnd(0, 3 * static_cast<int>(kBlock)));
        r.prompt.insert(r.prompt.end(), own.begin(), own.end());
        r.max_tokens = rnd(1, 10);
        r.ignore_eos = true;
        r.sampling.temperature = static_cast<float>(rnd(0, 2)) * 0.5f;
        r.sampling.seed = static_cast<uint64_t>(rnd(0, 1000));
        r.top_logprobs = rnd(0, 3) == 0 ? static_cast<int32_t>(rnd(1, kMaxTopLogprobs)) : 0;
        if (c.Check(r).code() == absl::StatusCode::kResourceExhausted) continue;
        absl::StatusOr<int64_t> id = c.Submit(r);
        ASSERT_TRUE(id.ok()) << id.status();
        live.insert(*id);
      }
    }
    if (!live.empty() && rnd(0, 24) == 0) {
      auto it = live.begin();
      std::advance(it, rnd(0, static_cast<int>(live.size()) - 1));
      GenerationResult res;
      ASSERT_TRUE(c.Cancel(*it, &res, &released).ok());
      release();
      live.erase(it);
    }
    PlannedStep ps;
    c.Schedule(&ps);
    if (ps.empty()) {
      if (c.Idle() && iter >= 380) break;
      continue;
    }
    ++steps;
    const int n = rnd(1, static_cast<int>(kMaxMicroBatches));
    const MicroBatches mb = SplitStep(ps, n);
    const size_t parts = mb.parts.size();
    ASSERT_EQ(parts, std::min<size_t>(static_cast<size_t>(n), ps.plan.requests.size()));
    multi_part_steps += parts > 1;
    evicting_steps += !ps.plan.evictions.empty();

    // Requests: each exactly once, in the step's order within its part, on its rank, rows its own.
    std::vector<int32_t> first_row(ps.plan.requests.size() + 1, 0);
    std::map<uint64_t, size_t> index_of;
    for (size_t i = 0; i < ps.plan.requests.size(); ++i) {
      first_row[i + 1] = first_row[i] + ps.plan.requests[i].q_len;
      index_of[ps.plan.requests[i].request_id] = i;
    }
    size_t seen = 0;
    double total_cost = 0, max_cost = 0;
    std::vector<double> part_cost(parts, 0.0);
    double rows_all = 0, kv_all = 0;
    for (const StepRequest& r : ps.plan.requests) rows_all += r.q_len, kv_all += r.kv_len;
    for (size_t p = 0; p < parts; ++p) {
      const PlannedStep& part = mb.parts[p];
      ASSERT_FALSE(part.plan.requests.empty()) << "part " << p;
      EXPECT_EQ(part.plan.step_id, ps.plan.step_id);
      EXPECT_EQ(part.plan.micro_batch, p);
      EXPECT_EQ(part.plan.micro_batches, parts);
      size_t last = 0;
      int32_t row = 0;
      std::vector<int32_t> rank_rows(ps.rank_rows.size(), 0);
      for (size_t k = 0; k < part.plan.requests.size(); ++k) {
        const StepRequest& r = part.plan.requests[k];
        ASSERT_TRUE(index_of.contains(r.request_id));
        const size_t i = index_of[r.request_id];
        if (k > 0) {
          EXPECT_GT(i, last) << "part " << p << " reorders the step's requests";
        }
        last = i;
        StepRequest want = ps.plan.requests[i];
        // The group is re-indexed; it must name the same prefix chain.
        if (want.prefix_group >= 0) {
          ASSERT_GE(r.prefix_group, 0);
          int32_t g = want.prefix_group, h = r.prefix_group;
          while (g >= 0) {
            ASSERT_GE(h, 0);
            const PrefixGroup& a = ps.plan.groups[static_cast<size_t>(g)];
            const PrefixGroup& b = part.plan.groups[static_cast<size_t>(h)];
            EXPECT_EQ(a.block_hash, b.block_hash);
            EXPECT_EQ(a.prefix_tokens, b.prefix_tokens);
            EXPECT_EQ(a.memory_rank, b.memory_rank);
            g = a.parent, h = b.parent;
          }
          EXPECT_EQ(h, -1);
          ++grouped_parts;
        } else {
          EXPECT_EQ(r.prefix_group, -1);
        }
        want.prefix_group = r.prefix_group;
        EXPECT_EQ(r, want);
        for (int32_t t = first_row[i]; t < first_row[i + 1]; ++t, ++row) {
          EXPECT_EQ(part.rows.tokens[static_cast<size_t>(row)], ps.rows.tokens[static_cast<size_t>(t)]);
          EXPECT_EQ(part.rows.positions[static_cast<size_t>(row)], ps.rows.positions[static_cast<size_t>(t)]);
        }
        rank_rows[static_cast<size_t>(r.memory_rank) + 1] += r.q_len;
        const double cost = r.q_len / rows_all + r.kv_len / kv_all;
        part_cost[p] += cost;
        total_cost += cost;
        max_cost = std::max(max_cost, cost);
        ++seen;
      }
      EXPECT_EQ(part.rows.num_tokens(), row);
      for (size_t m = 1; m < rank_rows.size(); ++m) rank_rows[m] += rank_rows[m - 1];
      EXPECT_EQ(part.rank_rows, rank_rows) << "part " << p;
      for (const PrefixPublish& pub : part.plan.publishes) {
        bool mine = false;
        for (const StepRequest& r : part.plan.requests) mine |= r.request_id == pub.request_id;
        EXPECT_TRUE(mine) << "part " << p << " publishes a block of another part's request";
      }
      EXPECT_EQ(part.plan.evictions.size(), p == 0 ? ps.plan.evictions.size() : 0);
      ASSERT_TRUE(ValidateStepPlan(part.plan).ok()) << ValidateStepPlan(part.plan);
    }
    EXPECT_EQ(seen, ps.plan.requests.size());
    // Each rank's rows, summed over the parts, are the step's (as the controller counted them).
    std::vector<int32_t> rows_per_group(ps.rank_rows.size() - 1, 0);
    for (const PlannedStep& part : mb.parts) {
      for (size_t g = 0; g + 1 < part.rank_rows.size(); ++g)
        rows_per_group[g] += part.rank_rows[g + 1] - part.rank_rows[g];
    }
    for (size_t g = 0; g + 1 < ps.rank_rows.size(); ++g) {
      EXPECT_EQ(rows_per_group[g], ps.rank_rows[g + 1] - ps.rank_rows[g]) << "placement group " << g;
    }
    size_t publishes = 0;
    for (const PlannedStep& part : mb.parts) publishes += part.plan.publishes.size();
    EXPECT_EQ(publishes, ps.plan.publishes.size());
    for (double cost : part_cost) EXPECT_LE(cost, total_cost / parts + max_cost + 1e-9);

    // Samples: the mapping names each sampled request's last row, with its parameters.
    ASSERT_EQ(mb.samples.size(), ps.rows.sample_rows.size());
    // Each part's results name their part and row; the alternatives' count is the row's own.
    std::vector<SampledTokens> part_sampled(parts);
    for (size_t p = 0; p < parts; ++p) {
      const StepTokens& rows = mb.parts[p].rows;
      ASSERT_TRUE(rows.top_logprobs.empty() || rows.top_logprobs.size() == rows.sample_rows.size());
      for (size_t k = 0; k < rows.sample_rows.size(); ++k) {
        std::vector<TopLogprob> top(static_cast<size_t>(rows.top_logprobs_of(k)),
                                    TopLogprob{static_cast<int32_t>(1000 * p + k), -1.0f});
        part_sampled[p].Append(static_cast<int32_t>(1000 * p + k), -static_cast<float>(1000 * p + k), top);
      }
    }
    SampledTokens merged;
    ASSERT_TRUE(MergeSampled(mb, part_sampled, &merged).ok());
    ASSERT_EQ(merged.size(), mb.samples.size());
    for (size_t s = 0; s < mb.samples.size(); ++s) {
      const auto [p, k] = mb.samples[s];
      const PlannedStep& part = mb.parts[static_cast<size_t>(p)];
      EXPECT_EQ(part.rows.counters[static_cast<size_t>(k)], ps.rows.counters[s]);
      EXPECT_EQ(part.rows.sampling[static_cast<size_t>(k)].seed, ps.rows.sampling[s].seed);
      EXPECT_EQ(part.rows.top_logprobs_of(static_cast<size_t>(k)), ps.rows.top_logprobs_of(s));
      EXPECT_EQ(part.rows.tokens[static_cast<size_t>(part.rows.sample_rows[static_cast<size_t>(k)])],
                ps.rows.tokens[static_cast<size_t>(ps.rows.sample_rows[s])]);
      EXPECT_EQ(merged.tokens[s], static_cast<int32_t>(1000 * p + k));
      EXPECT_EQ(merged.logprobs[s], -static_cast<float>(1000 * p + k));
      ASSERT_EQ(merged.top_of(s).size(), static_cast<size_t>(ps.rows.top_logprobs_of(s)));
      for (const TopLogprob& t : merged.top_of(s)) EXPECT_EQ(t.token, static_cast<int32_t>(1000 * p + k));
    }
    part_sampled.back().Append(1, -1.0f);
    EXPECT_FALSE(MergeSampled(mb, part_sampled, &merged).ok());

    // The parts, applied in order, leave each rank as the whole step does.
    for (int m = 0; m < kRanks; ++m) {
      AttentionBatch batch;
      int64_t rows = 0;
      for (const PlannedStep& part : mb.parts) {
        const absl::Status st =
            split[static_cast<size_t>(m)]->Apply(part.plan, static_cast<uint16_t>(m), &batch);
        ASSERT_TRUE(st.ok()) << "step " << ps.plan.step_id << " rank " << m << ": " << st;
        rows += batch.num_tokens();
      }
      const absl::Status st = whole[static_cast<size_t>(m)]->Apply(ps.plan, static_cast<uint16_t>(m), &batch);
      ASSERT_TRUE(st.ok()) << st;
      EXPECT_EQ(rows, batch.num_tokens());
      EXPECT_EQ(split[static_cast<size_t>(m)]->num_free(), whole[static_cast<size_t>(m)]->num_free());
      EXPECT_EQ(split[static_cast<size_t>(m)]->num_blocks(), whole[static_cast<size_t>(m)]->num_blocks());
      for (const StepRequest& r : ps.plan.requests) {
        EXPECT_EQ(split[static_cast<size_t>(m)]->context_length(r.request_id),
                  whole[static_cast<size_t>(m)]->context_length(r.request_id));
      }
    }
    SampledTokens sampled;
    for (size_t i = 0; i < ps.rows.sample_rows.size(); ++i) {
      sampled.Append(5, -1.0f, std::vector<TopLogprob>(static_cast<size_t>(ps.rows.top_logprobs_of(i))));
    }
    finished.clear();
    ASSERT_TRUE(c.Complete(ps, sampled, &finished, &released).ok());
    release();
    for (const auto& [id, res] : finished) live.erase(id);
  }
  std::printf(
      "%lld steps, %lld split in several parts, %lld with evictions, %lld grouped requests in parts\n",
      static_cast<long long>(steps), static_cast<long long>(multi_part_steps),
      static_cast<long long>(evicting_steps), static_cast<long long>(grouped_parts));
  EXPECT_GT(multi_part_steps, 100);
  EXPECT_GT(evicting_steps, 0) << "the pools never forced an eviction";
  EXPECT_GT(grouped_parts, 0) << "no prefix group reached a part";
}

}  // namespace
}  // namespace tandem
