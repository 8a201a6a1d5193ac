// Controller::LoseRank against a simulated deployment: each memory rank keeps the tokens whose KV
// it holds, per request and position (as a KV cache would), and a step's "model" samples, for each
// sample row, a token that is a hash of the request's KV on its rank up to that row. A run in which
// ranks are lost at random steps must give every request exactly the tokens of an uninterrupted
// run: the requeued requests recompute the same KV (prompt and generated tokens, same positions)
// on a surviving rank and go on with the same sampling counter. Requests on healthy ranks keep
// their KV; nothing is lost, duplicated or reordered.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "compute_node/controller.h"

namespace tandem {
namespace {

using Kv = std::map<int64_t, std::vector<int32_t>>;  // request id -> token at each position

int32_t Sample(const std::vector<int32_t>& kv, int64_t upto, uint64_t counter, int64_t vocab) {
  uint64_t h = 1469598103934665603ull ^ counter;
  for (int64_t i = 0; i <= upto; ++i)
    h = (h ^ static_cast<uint64_t>(kv[static_cast<size_t>(i)])) * 1099511628211ull;
  return static_cast<int32_t>(2 + h % static_cast<uint64_t>(vocab - 2));
}

// Runs `requests` to the end; before step s (if lose.count(s)) memory rank lose[s] is lost, after
// the step's rows were applied to the other ranks (as ComputeRank does: the step finishes without
// the lost rank, its requests' tokens dropped). Before step s is planned (if rejoin.count(s)),
// memory rank rejoin[s], if lost, rejoins with an empty pool (RejoinRank); `placed_after_rejoin`
// counts the requests placed on a rank after it rejoined.
std::map<int64_t, std::vector<int32_t>> RunAll(const ModelSpec& spec, int ranks,
                                               const std::vector<GenerationRequest>& requests,
                                               const std::map<int, int>& lose, int64_t* requeued,
                                               const std::map<int, int>& rejoin = {},
                                               int64_t* placed_after_rejoin = nullptr) {
  ControllerOptions o;
  o.max_batch_size = 6;
  o.max_tokens_per_step = 32;
  Controller c(spec, std::vector<int64_t>(static_cast<size_t>(ranks), 400), o);
  std::vector<Kv> kv(static_cast<size_t>(ranks));
  for (const GenerationRequest& r : requests) EXPECT_TRUE(c.Submit(r).ok());
  std::map<int64_t, std::vector<int32_t>> done;
  int step_index = 0;
  std::vector<bool> rejoined(static_cast<size_t>(ranks), false);
  while (!c.Idle()) {
    if (auto it = rejoin.find(step_index); it != rejoin.end() && c.rank_lost(it->second)) {
      EXPECT_TRUE(c.RejoinRank(it->second, 400).ok());
      rejoined[static_cast<size_t>(it->second)] = true;
    }
    PlannedStep step;
    c.Schedule(&step);
    EXPECT_FALSE(step.empty()) << "nothing scheduled while requests wait (step " << step_index << ")";
    if (step.empty()) break;
    // Apply the rows to each request's KV on its rank and sample.
    SampledTokens sampled;
    size_t row = 0, next_sample = 0;
    for (const StepRequest& r : step.plan.requests) {
      if (placed_after_rejoin != nullptr && rejoined[r.memory_rank] && r.position == 0)
        ++*placed_after_rejoin;
      std::vector<int32_t>& mine = kv[r.memory_rank][static_cast<int64_t>(r.request_id)];
      EXPECT_EQ(static_cast<int64_t>(mine.size()), r.position) << "request " << r.request_id;
      for (int32_t j = 0; j < r.q_len; ++j, ++row) {
        EXPECT_EQ(step.rows.positions[row], r.position + j);
        mine.resize(static_cast<size_t>(r.position + j) + 1);
        mine[static_cast<size_t>(r.position + j)] = step.rows.tokens[row];
      }
      if (r.sample) {
        EXPECT_EQ(step.rows.sample_rows[next_sample], static_cast<int32_t>(row) - 1);
        sampled.Append(Sample(mine, r.position + r.q_len - 1, r.counter, spec.vocab_size), -1.0f);
        ++next_sample;
      }
    }
    if (auto it = lose.find(step_index); it != lose.end()) {
      *requeued += static_cast<int64_t>(c.LoseRank(it->second).size());
      kv[static_cast<size_t>(it->second)].clear();  // its KV is gone with it
    }
    std::vector<std::pair<int64_t, GenerationResult>> finished;
    std::vector<std::vector<uint64_t>> released;
    EXPECT_TRUE(c.Complete(step, sampled, &finished, &released).ok());
    for (auto& [id, result] : finished) {
      EXPECT_EQ(result.token_ids.size(), requests[static_cast<size_t>(id)].max_tokens) << "request " << id;
      EXPECT_EQ(result.prompt_tokens, static_cast<int64_t>(requests[static_cast<size_t>(id)].prompt.size()));
      EXPECT_TRUE(done.emplace(id, result.token_ids).second) << "request " << id << " finished twice";
    }
    for (int m = 0; m < ranks; ++m) {
      for (uint64_t id : released[static_cast<size_t>(m)])
        kv[static_cast<size_t>(m)].erase(static_cast<int64_t>(id));
    }
    if (++step_index > 5000) {
      ADD_FAILURE() << "the run does not end";
      break;
    }
  }
  return done;
}

TEST(ControllerRecovery, LostRanksRequestsGetTheTokensOfAnUninterruptedRun) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  int64_t total_requeued = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int ranks = rnd(2, 4);
    std::vector<GenerationRequest> requests(static_cast<size_t>(rnd(4, 14)));
    for (GenerationRequest& r : requests) {
      for (int i = rnd(1, 40); i > 0; --i) r.prompt.push_back(rnd(2, 200));
      r.max_tokens = rnd(1, 30);
      r.ignore_eos = true;
    }
    int64_t none = 0, requeued = 0;
    const auto expect = RunAll(*spec, ranks, requests, {}, &none);
    ASSERT_EQ(expect.size(), requests.size());
    std::map<int, int> lose;  // step -> rank; never the last rank standing
    std::vector<int> order;
    for (int m = 0; m < ranks; ++m) order.push_back(m);
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < rnd(1, ranks - 1); ++k) lose[rnd(0, 6) + 8 * k] = order[static_cast<size_t>(k)];
    const auto got = RunAll(*spec, ranks, requests, lose, &requeued);
    EXPECT_EQ(got, expect);
    total_requeued += requeued;
  }
  EXPECT_GT(total_requeued, 40) << "few requests were on the lost ranks: the scenarios test little";
}

// Ranks lost and then rejoining (a restarted process, empty pool) at random steps: still the
// tokens of an uninterrupted run, and the rejoined ranks take requests again.
TEST(ControllerRecovery, RejoinedRanksTakeRequestsAndTokensStayTheSame) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  int64_t total_placed = 0;
  for (uint32_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    const int ranks = rnd(2, 3);
    std::vector<GenerationRequest> requests(static_cast<size_t>(rnd(10, 20)));
    for (GenerationRequest& r : requests) {
      for (int i = rnd(1, 40); i > 0; --i) r.prompt.push_back(rnd(2, 200));
      r.max_tokens = rnd(1, 30);
      r.ignore_eos = true;
    }
    int64_t none = 0, requeued = 0, placed = 0;
    const auto expect = RunAll(*spec, ranks, requests, {}, &none);
    ASSERT_EQ(expect.size(), requests.size());
    const int m = rnd(0, ranks - 1);
    const int lost_at = rnd(0, 4);
    const auto got =
        RunAll(*spec, ranks, requests, {{lost_at, m}}, &requeued, {{lost_at + rnd(1, 3), m}}, &placed);
    EXPECT_EQ(got, expect);
    total_placed += placed;
  }
  EXPECT_GT(total_placed, 40) << "rejoined ranks took few requests: the scenarios test little";
}

TEST(ControllerRecovery, RejoinRankGivesTheCapacityBackWithAFreshRegistry) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  ControllerOptions o;
  o.max_batch_size = 8;
  o.max_tokens_per_step = 128;
  o.prefix_block_tokens = 4;
  Controller c(*spec, {100, 100}, o);
  EXPECT_EQ(c.RejoinRank(1, 100).code(), absl::StatusCode::kInvalidArgument);  // not lost
  EXPECT_EQ(c.RejoinRank(2, 100).code(), absl::StatusCode::kInvalidArgument);  // no such rank
  for (int i = 0; i < 4; ++i) {  // different prompts: placed by free KV, not by a shared prefix
    GenerationRequest r;
    r.prompt = {2 + i, 3, 4, 5, 6, 7, 8, 9, 10};
    r.max_tokens = 3;
    r.ignore_eos = true;
    ASSERT_TRUE(c.Submit(r).ok());
  }
  PlannedStep step;
  c.Schedule(&step);
  bool on1 = false;
  for (const StepRequest& q : step.plan.requests) on1 |= q.memory_rank == 1;
  ASSERT_TRUE(on1);
  SampledTokens sampled;
  for (size_t i = 0; i < step.rows.sample_rows.size(); ++i) sampled.Append(7, -1.0f);
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  ASSERT_TRUE(c.Complete(step, sampled, &finished, &released).ok());
  ASSERT_GT(c.prefix_index(1)->stats().blocks, 0);  // rank 1 registered the prompt's blocks
  c.LoseRank(1);
  GenerationRequest big;
  big.prompt = {40, 41, 42, 43};
  big.max_tokens = 200;
  EXPECT_EQ(c.Check(big).code(), absl::StatusCode::kResourceExhausted);  // only rank 0's 100 left
  EXPECT_EQ(c.RejoinRank(1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(c.rank_lost(1));
  ASSERT_TRUE(c.RejoinRank(1, 250).ok());
  EXPECT_FALSE(c.rank_lost(1));
  EXPECT_EQ(c.live_ranks(), 2);
  EXPECT_EQ(c.kv_capacity(1), 250);
  EXPECT_EQ(c.kv_reserved(1), 0);
  EXPECT_EQ(c.prefix_index(1)->stats().blocks, 0);  // the new process holds nothing
  EXPECT_EQ(c.RejoinRank(1, 250).code(), absl::StatusCode::kInvalidArgument);  // once
  // A request that only the larger rejoined rank can hold is placed there.
  ASSERT_TRUE(c.Check(big).ok());
  const int64_t id = *c.Submit(big);
  bool placed = false;
  for (int s = 0; s < 20 && !placed; ++s) {
    c.Schedule(&step);
    for (const StepRequest& q : step.plan.requests) {
      if (static_cast<int64_t>(q.request_id) == id) {
        EXPECT_EQ(q.memory_rank, 1);
        placed = true;
      }
    }
    SampledTokens tokens;
    for (size_t i = 0; i < step.rows.sample_rows.size(); ++i) tokens.Append(7, -1.0f);
    finished.clear();
    ASSERT_TRUE(c.Complete(step, tokens, &finished, &released).ok());
  }
  EXPECT_TRUE(placed);
}

TEST(ControllerRecovery, RequeuedRequestsGoFirstInAdmissionOrderAndTheRankTakesNoMore) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  ControllerOptions o;
  o.max_batch_size = 4;
  o.max_tokens_per_step = 64;
  Controller c(*spec, {100, 100}, o);
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    r.prompt = {2, 3, 4, 5};
    r.max_tokens = 40;
    ASSERT_TRUE(c.Submit(r).ok());
  }
  PlannedStep step;
  c.Schedule(&step);
  std::vector<int64_t> on1;
  for (const StepRequest& r : step.plan.requests)
    if (r.memory_rank == 1) on1.push_back(static_cast<int64_t>(r.request_id));
  ASSERT_FALSE(on1.empty());
  EXPECT_EQ(c.LoseRank(1), on1);
  EXPECT_TRUE(c.LoseRank(1).empty());  // once
  EXPECT_TRUE(c.rank_lost(1));
  EXPECT_EQ(c.live_ranks(), 1);
  EXPECT_EQ(c.kv_capacity(1), 0);
  EXPECT_EQ(c.num_waiting(), static_cast<int64_t>(on1.size()) + 2);
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  SampledTokens sampled;
  for (size_t i = 0; i < step.rows.sample_rows.size(); ++i) sampled.Append(7, -1.0f);
  ASSERT_TRUE(c.Complete(step, sampled, &finished, &released).ok());
  EXPECT_TRUE(released[1].empty());
  c.Schedule(&step);
  for (const StepRequest& r : step.plan.requests) EXPECT_EQ(r.memory_rank, 0);
}

// After a loss, a request whose context (prompt + max_tokens) fits no surviving rank must end with
// an error at once (Controller::FailUnplaceable), not wait at the head of the queue forever and
// hold back the requests behind it; a new one is refused by Check, naming the loss.
TEST(ControllerRecovery, RequestsThatFitNoSurvivingRankFailInsteadOfWaitingForever) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  ControllerOptions o;
  o.max_batch_size = 1;  // one running request: the others wait
  o.max_tokens_per_step = 64;
  Controller c(*spec, {400, 100}, o);  // rank 0 is the large one
  auto request = [](int64_t max_tokens) {
    GenerationRequest r;
    r.prompt = {2, 3, 4, 5};
    r.max_tokens = max_tokens;
    return r;
  };
  ASSERT_EQ(*c.Submit(request(296)), 0);  // needs 300: only rank 0
  ASSERT_EQ(*c.Submit(request(146)), 1);  // needs 150: only rank 0
  ASSERT_EQ(*c.Submit(request(36)), 2);   // needs 40: fits rank 1 too
  PlannedStep step;
  c.Schedule(&step);
  ASSERT_EQ(step.plan.requests.size(), 1u);
  ASSERT_EQ(step.plan.requests[0].request_id, 0u);
  ASSERT_EQ(step.plan.requests[0].memory_rank, 0);
  SampledTokens sampled;
  sampled.Append(7, -1.0f);
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  ASSERT_TRUE(c.Complete(step, sampled, &finished, &released).ok());  // request 0 has one token

  EXPECT_EQ(c.LoseRank(0), std::vector<int64_t>{0});
  std::vector<std::pair<int64_t, GenerationResult>> failed;
  c.FailUnplaceable(&failed);
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_EQ(failed[0].first, 0);
  EXPECT_EQ(failed[1].first, 1);
  for (const auto& [id, result] : failed) {
    EXPECT_EQ(result.finish_reason, "error");
    EXPECT_EQ(result.error.code(), absl::StatusCode::kUnavailable) << result.error;
    EXPECT_NE(result.error.message().find("largest surviving memory rank holds 100 tokens"),
              std::string::npos)
        << result.error;
    EXPECT_NE(result.error.message().find("memory rank(s) 0 lost"), std::string::npos) << result.error;
  }
  // The request that failed keeps the token it had; its need counts what is left to generate.
  EXPECT_EQ(failed[0].second.token_ids, std::vector<int32_t>{7});
  EXPECT_NE(failed[0].second.error.message().find("needs 300 KV slots"), std::string::npos);
  EXPECT_EQ(c.num_waiting(), 1);
  EXPECT_EQ(c.Progress(0), nullptr);  // no longer live
  // The one that fits runs to the end on rank 1.
  c.Schedule(&step);
  ASSERT_EQ(step.plan.requests.size(), 1u);
  EXPECT_EQ(step.plan.requests[0].request_id, 2u);
  EXPECT_EQ(step.plan.requests[0].memory_rank, 1);
  // A new request that only the lost rank could hold is refused by Check, naming the loss.
  const absl::Status refused = c.Check(request(146));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("largest surviving KV cache holds 100 tokens; memory rank(s) 0 lost"),
            std::string::npos)
      << refused;
  // Nothing else fails while everything waiting fits.
  failed.clear();
  c.FailUnplaceable(&failed);
  EXPECT_TRUE(failed.empty());
}

}  // namespace
}  // namespace tandem
