// The colocated engine: continuous batching must not change any request's tokens; KV limits,
// stop conditions and bad requests behave as documented in colocated/engine.h.
#include "colocated/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "gtest/gtest.h"
#include "param_names.h"

namespace tandem {
namespace {

// Batch composition changes the order of fp32 sums (BLAS blocking), so log-probabilities of the
// same token may differ in the last bits; 1e-4 is far above that and far below any real change.
constexpr double kLogprobTol = 1e-4;

std::unique_ptr<WeightSource> Tiny(const std::string& preset, std::vector<int32_t> eos = {}) {
  absl::StatusOr<ModelSpec> spec = PresetSpec(preset);
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!eos.empty()) spec->eos_token_ids = eos;
  return RandomWeights(*spec, /*seed=*/42);
}

std::unique_ptr<ColocatedEngine> MakeEngine(const WeightSource& w, int64_t batch, int64_t step_tokens,
                                            int64_t kv = 4096) {
  EngineOptions o;
  o.device = "cpu";  // the CPU reference engine; tests/reference covers the CUDA one
  o.max_batch_size = batch;
  o.max_tokens_per_step = step_tokens;
  o.kv_capacity_tokens = kv;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

std::vector<GenerationRequest> MixedRequests(int64_t vocab) {
  // Different prompt lengths and lengths of output; two sampled with seeds, the rest greedy.
  const std::vector<int> prompt_len = {1, 5, 17, 40, 3, 64, 9};
  const std::vector<int> max_tokens = {12, 3, 20, 7, 1, 10, 16};
  std::vector<GenerationRequest> out;
  uint32_t x = 12345;
  for (size_t i = 0; i < prompt_len.size(); ++i) {
    GenerationRequest r;
    for (int j = 0; j < prompt_len[i]; ++j) {
      x = x * 1664525u + 1013904223u;
      r.prompt.push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2)));
    }
    r.max_tokens = max_tokens[i];
    r.ignore_eos = true;
    if (i % 3 == 1) r.sampling = {.temperature = 0.8f, .top_k = 50, .top_p = 0.9f, .seed = 7 + i};
    out.push_back(r);
  }
  return out;
}

void ExpectSameResults(const std::vector<GenerationResult>& a, const std::vector<GenerationResult>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].token_ids, b[i].token_ids) << "request " << i;
    EXPECT_EQ(a[i].finish_reason, b[i].finish_reason) << "request " << i;
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    for (size_t t = 0; t < a[i].logprobs.size(); ++t) {
      ASSERT_FALSE(std::isnan(a[i].logprobs[t]));
      EXPECT_NEAR(a[i].logprobs[t], b[i].logprobs[t], kLogprobTol) << "request " << i << " token " << t;
    }
  }
}

// Each request alone, one after the other: the ground truth for batching.
std::vector<GenerationResult> RunAlone(const WeightSource& w, const std::vector<GenerationRequest>& reqs) {
  std::vector<GenerationResult> out;
  for (const GenerationRequest& r : reqs) {
    auto e = MakeEngine(w, 1, 4096);
    absl::StatusOr<std::vector<GenerationResult>> res = e->GenerateAll({r});
    EXPECT_TRUE(res.ok()) << res.status();
    out.push_back((*res)[0]);
  }
  return out;
}

// Cancel (the Engine interface): a running or waiting request ends at once with the tokens so
// far and finish_reason "cancelled", its KV is freed, it is never reported by Step, and the other
// requests' tokens do not change.
TEST(EngineCancel, EndsTheRequestFreesItsKvAndLeavesTheOthersAlone) {
  auto w = Tiny("tiny-gqa");
  const auto reqs = MixedRequests(w->spec().vocab_size);
  const auto alone = RunAlone(*w, reqs);
  auto e = MakeEngine(*w, 3, 16);
  Engine& engine = *e;  // only the interface from here on
  for (const GenerationRequest& r : reqs) ASSERT_TRUE(engine.Submit(r).ok());
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  // Batch 3, 16 tokens a step: request 2 (17 prompt tokens, 20 to generate) is prefilled in two
  // steps and decoding after four; request 6 is still waiting.
  for (int step = 0; step < 4; ++step) ASSERT_TRUE(engine.Step(&finished).ok());
  absl::StatusOr<GenerationResult> running = engine.Cancel(2);
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_EQ(running->finish_reason, "cancelled");
  EXPECT_EQ(running->prompt_tokens, 17);
  ASSERT_GE(running->token_ids.size(), 1u);
  ASSERT_LT(running->token_ids.size(), 20u);
  EXPECT_TRUE(std::equal(running->token_ids.begin(), running->token_ids.end(), alone[2].token_ids.begin()));
  absl::StatusOr<GenerationResult> waiting = engine.Cancel(6);
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  EXPECT_EQ(waiting->finish_reason, "cancelled");
  EXPECT_TRUE(waiting->token_ids.empty());
  EXPECT_EQ(engine.Cancel(2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine.Cancel(99).status().code(), absl::StatusCode::kNotFound);

  while (!engine.Idle()) ASSERT_TRUE(engine.Step(&finished).ok());
  ASSERT_EQ(finished.size(), reqs.size() - 2);
  for (const auto& [id, result] : finished) {
    SCOPED_TRACE(testing::Message() << "request " << id);
    ASSERT_NE(id, 2);
    ASSERT_NE(id, 6);
    EXPECT_EQ(result.token_ids, alone[static_cast<size_t>(id)].token_ids);
    EXPECT_EQ(result.finish_reason, alone[static_cast<size_t>(id)].finish_reason);
  }
  EXPECT_EQ(e->kv_free_tokens() + e->kv_registered_tokens(), e->kv_capacity_tokens()) << "KV leaked";
  EXPECT_EQ(engine.stats().decode_tokens, e->controller().stats().decode_tokens);
}

class EngineBatching : public ::testing::TestWithParam<std::string> {};

TEST_P(EngineBatching, BatchedEqualsAloneForEverySchedule) {
  auto w = Tiny(GetParam());
  const auto reqs = MixedRequests(w->spec().vocab_size);
  const auto alone = RunAlone(*w, reqs);
  for (auto [batch, step_tokens] :
       std::vector<std::pair<int64_t, int64_t>>{{8, 4096}, {3, 8}, {7, 7}, {2, 64}}) {
    SCOPED_TRACE(testing::Message() << "batch " << batch << " step tokens " << step_tokens);
    auto e = MakeEngine(*w, batch, step_tokens);
    absl::StatusOr<std::vector<GenerationResult>> res = e->GenerateAll(reqs);
    ASSERT_TRUE(res.ok()) << res.status();
    ExpectSameResults(*res, alone);
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ((*res)[i].token_ids.size(), static_cast<size_t>(reqs[i].max_tokens));
      EXPECT_EQ((*res)[i].prompt_tokens, static_cast<int64_t>(reqs[i].prompt.size()));
    }
    // Only registered prompt blocks (kept for reuse) may hold KV once every request is done.
    EXPECT_EQ(e->kv_free_tokens() + e->kv_registered_tokens(), e->kv_capacity_tokens()) << "KV leaked";
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, EngineBatching, ::testing::Values("tiny-mha", "tiny-gqa", "tiny-mqa"),
                         testing_names::ModelParamName());

TEST(Engine, RequestsArrivingWhileOthersRunGetTheSameTokens) {
  auto w = Tiny("tiny-gqa");
  const auto reqs = MixedRequests(w->spec().vocab_size);
  const auto alone = RunAlone(*w, reqs);
  auto e = MakeEngine(*w, 4, 16);
  std::vector<GenerationResult> got(reqs.size());
  std::vector<std::pair<int64_t, GenerationResult>> done;
  size_t next = 0;
  int steps = 0;
  while (next < reqs.size() || !e->Idle()) {
    if (next < reqs.size() && steps % 3 == 0) {  // one arrival every third step
      absl::StatusOr<int64_t> id = e->Submit(reqs[next]);
      ASSERT_TRUE(id.ok()) << id.status();
      ASSERT_EQ(*id, static_cast<int64_t>(next));
      ++next;
    }
    ASSERT_TRUE(e->Step(&done).ok());
    ++steps;
    ASSERT_LT(steps, 10000);
  }
  for (auto& [id, r] : done) got[static_cast<size_t>(id)] = r;
  ExpectSameResults(got, alone);
}

// Prompts that share prefixes at several depths (blocks of 8): a 24-token system prompt for all,
// then one of two 16-token few-shot blocks for most, then each request's own tail (some tails
// shorter than a block, one request that is the system prompt alone plus one token).
std::vector<GenerationRequest> SharedPrefixRequests(int64_t vocab) {
  uint32_t x = 777;
  auto tokens = [&](int n) {
    std::vector<int32_t> t;
    for (int j = 0; j < n; ++j) {
      x = x * 1664525u + 1013904223u;
      t.push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2)));
    }
    return t;
  };
  const std::vector<int32_t> system = tokens(24), shot_a = tokens(16), shot_b = tokens(16);
  const std::vector<int> tail = {5, 13, 1, 8, 21, 3, 9, 2, 17, 6, 11, 4};
  std::vector<GenerationRequest> out;
  for (size_t i = 0; i < tail.size(); ++i) {
    GenerationRequest r;
    r.prompt = system;
    if (i % 4 != 3) {
      const std::vector<int32_t>& shot = i % 2 == 0 ? shot_a : shot_b;
      r.prompt.insert(r.prompt.end(), shot.begin(), shot.end());
    }
    const std::vector<int32_t> own = tokens(tail[i]);
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    r.max_tokens = 4 + static_cast<int64_t>(i % 5) * 3;
    r.ignore_eos = true;
    if (i % 3 == 1) r.sampling = {.temperature = 0.8f, .top_k = 50, .top_p = 0.9f, .seed = 11 + i};
    out.push_back(r);
  }
  // The system prompt alone plus one token: it can reuse all three system blocks.
  GenerationRequest s;
  s.prompt = system;
  s.prompt.push_back(5);
  s.max_tokens = 6;
  s.ignore_eos = true;
  out.push_back(s);
  return out;
}

struct PrefixVariant {
  bool cache;
  const char* sharing;
};

class EnginePrefix : public ::testing::TestWithParam<std::string> {};

// The prefix cache (reused KV) and shared-prefix attention (cascade: the prefix read once per
// group and merged by log-sum-exp) change which KV a request reads and the order of the sums, never
// the tokens: every variant equals the cache-off run, and the logprobs agree to rounding.
TEST_P(EnginePrefix, CacheAndSharingChangeNoToken) {
  auto w = Tiny(GetParam());
  const auto reqs = SharedPrefixRequests(w->spec().vocab_size);
  auto run = [&](PrefixVariant v, int64_t batch, int64_t step_tokens, int64_t kv,
                 const ControllerStats** stats) {
    EngineOptions o;
    o.device = "cpu";
    o.max_batch_size = batch;
    o.max_tokens_per_step = step_tokens;
    o.kv_capacity_tokens = kv;
    o.prefix_cache = v.cache;
    o.prefix_block_tokens = 8;
    o.prefix_sharing = v.sharing;
    absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*w, o);
    EXPECT_TRUE(e.ok()) << e.status();
    absl::StatusOr<std::vector<GenerationResult>> res = (*e)->GenerateAll(reqs);
    EXPECT_TRUE(res.ok()) << res.status();
    static ControllerStats last;
    last = (*e)->controller().stats();
    *stats = &last;
    // Only registered blocks may hold KV once all requests are done.
    EXPECT_EQ((*e)->kv_free_tokens() + (*e)->kv_registered_tokens(), (*e)->kv_capacity_tokens());
    return *res;
  };
  const ControllerStats* stats = nullptr;
  const std::vector<GenerationResult> base = run({false, "off"}, 4, 32, 4096, &stats);
  for (const GenerationResult& r : base) EXPECT_EQ(r.cached_tokens, 0);
  for (PrefixVariant v :
       {PrefixVariant{true, "off"}, PrefixVariant{true, "on"}, PrefixVariant{true, "auto"}}) {
    // Batch 4: the first requests publish their blocks, later ones attach them and share them
    // within a step. 32 tokens per step: prompts are prefilled in chunks.
    for (auto [batch, step_tokens, kv] :
         std::vector<std::tuple<int64_t, int64_t, int64_t>>{{4, 32, 4096}, {13, 512, 4096}, {3, 16, 150}}) {
      SCOPED_TRACE(testing::Message() << "sharing " << v.sharing << " batch " << batch << " step tokens "
                                      << step_tokens << " kv " << kv);
      const std::vector<GenerationResult> got = run(v, batch, step_tokens, kv, &stats);
      ExpectSameResults(got, base);
      int64_t cached = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].cached_tokens % 8, 0);
        EXPECT_LT(got[i].cached_tokens, static_cast<int64_t>(reqs[i].prompt.size()));
        cached += got[i].cached_tokens;
      }
      EXPECT_EQ(stats->cached_tokens, cached);
      EXPECT_EQ(stats->prefill_tokens + cached, [&] {
        int64_t n = 0;
        for (const auto& r : reqs) n += static_cast<int64_t>(r.prompt.size());
        return n;
      }());
      // Also when all arrive together (batch 13): the first to prefill a block is waited for.
      EXPECT_GT(cached, 0);
      if (batch != 3 && std::string(v.sharing) == "on") {
        EXPECT_GT(stats->grouped_rows, 0);
      }
      if (std::string(v.sharing) == "off") {
        EXPECT_EQ(stats->grouped_rows, 0);
      }
    }
  }
}

// A conversation's next turn repeats the previous prompt and answer: their KV (generated tokens
// included) is reused, and the tokens equal a run without the cache.
TEST(Engine, NextTurnReusesThePreviousAnswer) {
  auto w = Tiny("tiny-gqa");
  const auto first = SharedPrefixRequests(w->spec().vocab_size)[0];  // 24 + 16 + 5 prompt tokens
  auto engine = [&](bool cache) {
    EngineOptions o;
    o.device = "cpu";
    o.max_batch_size = 4;
    o.max_tokens_per_step = 64;
    o.kv_capacity_tokens = 4096;
    o.prefix_cache = cache;
    o.prefix_block_tokens = 8;
    absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(*w, o);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(*e);
  };
  for (bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "cache on" : "cache off");
    auto e = engine(cache);
    GenerationRequest turn1 = first;
    turn1.max_tokens = 30;
    absl::StatusOr<std::vector<GenerationResult>> r1 = e->GenerateAll({turn1});
    ASSERT_TRUE(r1.ok()) << r1.status();
    GenerationRequest turn2 = turn1;
    turn2.prompt.insert(turn2.prompt.end(), (*r1)[0].token_ids.begin(), (*r1)[0].token_ids.end());
    for (int32_t t : {7, 8, 9}) turn2.prompt.push_back(t);  // the user's next message
    turn2.max_tokens = 10;
    absl::StatusOr<std::vector<GenerationResult>> r2 = e->GenerateAll({turn2});
    ASSERT_TRUE(r2.ok()) << r2.status();
    static std::vector<GenerationResult> without;
    if (!cache) {
      without = *r2;
      EXPECT_EQ((*r2)[0].cached_tokens, 0);
      continue;
    }
    // Turn 1 left KV for 45 + 30 - 1 = 74 positions: 9 full blocks of 8, answer included.
    EXPECT_EQ((*r2)[0].cached_tokens, 72);
    ExpectSameResults(*r2, without);
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, EnginePrefix, ::testing::Values("tiny-mha", "tiny-gqa", "tiny-mqa"),
                         testing_names::ModelParamName());

TEST(Engine, KvFullMakesRequestsWaitNotFail) {
  auto w = Tiny("tiny-mha");
  const auto reqs = MixedRequests(w->spec().vocab_size);
  const auto alone = RunAlone(*w, reqs);
  // 80 slots: the 64+10 request fits alone, never together with most others.
  auto e = MakeEngine(*w, 8, 4096, /*kv=*/80);
  absl::StatusOr<std::vector<GenerationResult>> res = e->GenerateAll(reqs);
  ASSERT_TRUE(res.ok()) << res.status();
  ExpectSameResults(*res, alone);
  EXPECT_EQ(e->kv_free_tokens() + e->kv_registered_tokens(), 80);
}

TEST(Engine, RequestThatCanNeverFitIsRefusedAndChangesNothing) {
  auto w = Tiny("tiny-mha");
  auto e = MakeEngine(*w, 8, 4096, /*kv=*/32);
  GenerationRequest r;
  r.prompt.assign(30, 5);
  r.max_tokens = 10;
  absl::StatusOr<int64_t> id = e->Submit(r);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(id.status().message().find("40 KV slots"), std::string::npos) << id.status();
  EXPECT_TRUE(e->Idle());
}

TEST(Engine, StopsAtEos) {
  // Find what greedy decoding produces, then declare its 4th token an EOS id.
  auto w = Tiny("tiny-gqa");
  GenerationRequest r;
  r.prompt = {3, 9, 27, 81};
  r.max_tokens = 12;
  auto e = MakeEngine(*w, 4, 64);
  auto base = e->GenerateAll({r});
  ASSERT_TRUE(base.ok());
  const int32_t eos = (*base)[0].token_ids[3];
  size_t first = 0;
  while ((*base)[0].token_ids[first] != eos) ++first;

  auto w2 = Tiny("tiny-gqa", {eos});
  auto e2 = MakeEngine(*w2, 4, 64);
  auto res = e2->GenerateAll({r});
  ASSERT_TRUE(res.ok());
  EXPECT_EQ((*res)[0].finish_reason, "stop");
  ASSERT_EQ((*res)[0].token_ids.size(), first + 1);
  EXPECT_EQ((*res)[0].token_ids.back(), eos);
  r.ignore_eos = true;
  auto res2 = e2->GenerateAll({r});
  ASSERT_TRUE(res2.ok());
  EXPECT_EQ((*res2)[0].finish_reason, "length");
  EXPECT_EQ((*res2)[0].token_ids, (*base)[0].token_ids);
}

TEST(Engine, SeededSamplingIsReproducibleAndSeedSensitive) {
  auto w = Tiny("tiny-mha");
  GenerationRequest r;
  r.prompt = {7, 8, 9};
  r.max_tokens = 24;
  r.ignore_eos = true;
  r.sampling = {.temperature = 1.5f, .top_k = 0, .top_p = 1.0f, .seed = 1};
  auto e = MakeEngine(*w, 4, 64);
  auto a = e->GenerateAll({r, r});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)[0].token_ids, (*a)[1].token_ids);
  GenerationRequest r2 = r;
  r2.sampling.seed = 2;
  auto b = e->GenerateAll({r2});
  ASSERT_TRUE(b.ok());
  EXPECT_NE((*a)[0].token_ids, (*b)[0].token_ids);
}

TEST(Engine, GreedyEqualsTopKOne) {
  auto w = Tiny("tiny-mqa");
  GenerationRequest g;
  g.prompt = {11, 12, 13, 14};
  g.max_tokens = 10;
  g.ignore_eos = true;
  GenerationRequest k1 = g;
  k1.sampling = {.temperature = 1.0f, .top_k = 1, .top_p = 1.0f, .seed = 3};
  auto e = MakeEngine(*w, 4, 64);
  auto res = e->GenerateAll({g, k1});
  ASSERT_TRUE(res.ok());
  EXPECT_EQ((*res)[0].token_ids, (*res)[1].token_ids);
}

TEST(Engine, BadRequestsAreRefusedWithTheReason) {
  auto w = Tiny("tiny-mha");
  auto e = MakeEngine(*w, 4, 64);
  const int64_t vocab = w->spec().vocab_size;
  struct Bad {
    GenerationRequest r;
    std::string needle;
  };
  std::vector<Bad> bad;
  bad.push_back({GenerationRequest{}, "prompt is empty"});
  GenerationRequest r{.prompt = {1, static_cast<int32_t>(vocab)}};
  bad.push_back({r, "prompt token 1"});
  r = {.prompt = {1, -4}};
  bad.push_back({r, "outside the vocabulary"});
  r = {.prompt = {1}, .max_tokens = 0};
  bad.push_back({r, "max_tokens must be >= 1"});
  r = {.prompt = {1}, .max_tokens = w->spec().max_position};
  bad.push_back({r, "exceeds the model's context"});
  r = {.prompt = {1, 2}, .max_tokens = std::numeric_limits<int64_t>::max()};  // prompt + it overflows
  bad.push_back({r, "exceeds the model's context"});
  r = {.prompt = {1}, .sampling = {.temperature = -1.0f}};
  bad.push_back({r, "temperature"});
  r = {.prompt = {1}, .sampling = {.top_p = 0.0f}};
  bad.push_back({r, "top_p"});
  for (const Bad& b : bad) {
    absl::StatusOr<int64_t> id = e->Submit(b.r);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << b.needle;
    EXPECT_NE(id.status().message().find(b.needle), std::string::npos) << id.status();
  }
  EXPECT_TRUE(e->Idle());
  // One bad request in a batch: nothing of the batch is queued.
  GenerationRequest good{.prompt = {1, 2}, .max_tokens = 2};
  auto all = e->GenerateAll({good, bad[0].r, good});
  EXPECT_EQ(all.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(all.status().message().find("request 1"), std::string::npos) << all.status();
  EXPECT_TRUE(e->Idle());
  auto ok = e->GenerateAll({good});
  ASSERT_TRUE(ok.ok()) << ok.status();
}

TEST(Engine, OptionsAreChecked) {
  auto w = Tiny("tiny-mha");
  EngineOptions o;
  o.device = "cpu";
  o.max_batch_size = 16;
  o.max_tokens_per_step = 8;
  auto e = ColocatedEngine::Create(*w, o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("max_tokens_per_step"), std::string::npos);
}

}  // namespace
}  // namespace tandem
