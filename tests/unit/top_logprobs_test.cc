// Top log-probability alternatives (common/top_logprobs.h) end to end on the CPU:
//   * ComputeBackend::Finish reports, for each row that asks, the k most probable tokens with
//     log-probabilities equal to an independent log-softmax (long double, full sort) of the
//     logits the layer executor computes for the same rows, and nothing for rows that do not ask;
//   * the colocated engine hands them out per generated token, only to requests that asked,
//     without changing any token; greedy tokens are entry 0 with the same log-probability;
//   * a request asking for more than kMaxTopLogprobs, or fewer than 0, is refused.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "colocated/engine.h"
#include "compute_node/compute_backend.h"
#include "compute_node/layer_executor.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

std::unique_ptr<WeightSource> Model(const std::string& preset) {
  absl::StatusOr<ModelSpec> spec = PresetSpec(preset);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return RandomWeights(*spec, /*seed=*/7);
}

// Attention of rows that are each the only token of their request (position 0): softmax over one
// key is 1, so every query head's output is the value row of its KV head.
void SingleTokenAttention(const ModelSpec& s, const std::vector<float>& qkv, int64_t rows,
                          std::vector<float>* attn) {
  const int64_t width = s.q_dim() + 2 * s.kv_dim(), group = s.num_heads / s.num_kv_heads;
  attn->assign(static_cast<size_t>(rows * s.q_dim()), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const float* v = qkv.data() + r * width + s.q_dim() + s.kv_dim() + (h / group) * s.head_dim;
      std::copy(v, v + s.head_dim, attn->data() + r * s.q_dim() + h * s.head_dim);
    }
  }
}

TEST(TopLogprobs, FinishMatchesAnIndependentLogSoftmaxOfTheLogits) {
  for (const std::string preset : {"tiny-mha", "tiny-gqa"}) {
    std::unique_ptr<WeightSource> source = Model(preset);
    const ModelSpec& s = source->spec();
    absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = CreateCpuComputeBackend(*source, {});
    ASSERT_TRUE(backend.ok()) << backend.status();
    absl::StatusOr<ModelWeightsF32> weights = LoadWeightsF32(*source);
    ASSERT_TRUE(weights.ok()) << weights.status();
    CpuLayerExecutor reference(&*weights);

    // Five one-token requests in one step; rows ask for 0, 1, 5, 20 and 3 alternatives, and the
    // last is sampled (alternatives do not depend on how the token was chosen).
    StepTokens step;
    step.tokens = {3, 100, 257, 511, 42};
    step.positions.assign(step.tokens.size(), 0);
    step.sample_rows = {0, 1, 2, 3, 4};
    step.sampling.assign(5, {});
    step.sampling[4] = {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .seed = 9};
    step.counters.assign(5, 0);
    step.top_logprobs = {0, 1, 5, 20, 3};
    const int64_t rows = step.num_tokens();

    std::vector<float> qkv(static_cast<size_t>(rows * (*backend)->qkv_width())), attn;
    ASSERT_TRUE((*backend)->BeginStep(step).ok());
    for (int64_t l = 0; l < s.num_layers; ++l) {
      ASSERT_TRUE((*backend)->PreAttention(l, qkv.data()).ok());
      SingleTokenAttention(s, qkv, rows, &attn);
      ASSERT_TRUE((*backend)->PostAttention(l, attn.data()).ok());
    }
    SampledTokens got;
    ASSERT_TRUE((*backend)->Finish(&got).ok());

    // The same rows through the layer executor: the logits the backend sampled from.
    std::vector<float> x(static_cast<size_t>(rows * s.hidden_size));
    ASSERT_TRUE(reference.Embed(step.tokens, x.data()).ok());
    for (int64_t l = 0; l < s.num_layers; ++l) {
      ASSERT_TRUE(reference.PreAttention(l, x.data(), step.positions, qkv.data()).ok());
      SingleTokenAttention(s, qkv, rows, &attn);
      ASSERT_TRUE(reference.PostAttention(l, x.data(), attn.data(), rows).ok());
    }
    std::vector<float> logits(static_cast<size_t>(rows * s.vocab_size));
    ASSERT_TRUE(reference.Logits(x.data(), step.sample_rows, logits.data()).ok());

    ASSERT_EQ(got.size(), static_cast<size_t>(rows));
    ASSERT_EQ(got.top.size(), static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits.data() + r * s.vocab_size;
      long double m = row[0], sum = 0;
      for (int64_t i = 0; i < s.vocab_size; ++i) m = std::max<long double>(m, row[i]);
      for (int64_t i = 0; i < s.vocab_size; ++i) sum += std::exp(static_cast<long double>(row[i]) - m);
      auto log_softmax = [&](int32_t t) { return static_cast<double>(row[t] - m - std::log(sum)); };
      std::vector<int32_t> order(static_cast<size_t>(s.vocab_size));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });

      const size_t k = static_cast<size_t>(step.top_logprobs[static_cast<size_t>(r)]);
      const std::span<const TopLogprob> top = got.top_of(static_cast<size_t>(r));
      ASSERT_EQ(top.size(), k) << preset << " row " << r;
      for (size_t j = 0; j < k; ++j) {
        EXPECT_EQ(top[j].token, order[j]) << preset << " row " << r << " entry " << j;
        // fp32 result of a double computation against long double: |logprob| < 10 here.
        EXPECT_NEAR(top[j].logprob, log_softmax(order[j]), 2e-6) << preset << " row " << r << " entry " << j;
      }
      EXPECT_NEAR(got.logprobs[static_cast<size_t>(r)], log_softmax(got.tokens[static_cast<size_t>(r)]),
                  2e-6);
      if (r < 4) {  // greedy rows: the chosen token is the argmax, entry 0, with the same value
        EXPECT_EQ(got.tokens[static_cast<size_t>(r)], order[0]) << preset << " row " << r;
        if (k > 0) {
          EXPECT_EQ(top[0].logprob, got.logprobs[static_cast<size_t>(r)]) << preset << " row " << r;
        }
      }
    }
  }
}

TEST(TopLogprobs, FinishWithoutAskingReportsNone) {
  std::unique_ptr<WeightSource> source = Model("tiny-mha");
  absl::StatusOr<std::unique_ptr<ComputeBackend>> backend = CreateCpuComputeBackend(*source, {});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const ModelSpec& s = source->spec();
  StepTokens step;
  step.tokens = {5, 6};
  step.positions = {0, 0};
  step.sample_rows = {0, 1};
  step.sampling.assign(2, {});
  step.counters.assign(2, 0);
  for (const std::vector<int32_t>& asked : {std::vector<int32_t>{}, std::vector<int32_t>{0, 0}}) {
    step.top_logprobs = asked;
    std::vector<float> qkv(static_cast<size_t>(2 * (*backend)->qkv_width())), attn;
    ASSERT_TRUE((*backend)->BeginStep(step).ok());
    for (int64_t l = 0; l < s.num_layers; ++l) {
      ASSERT_TRUE((*backend)->PreAttention(l, qkv.data()).ok());
      SingleTokenAttention(s, qkv, 2, &attn);
      ASSERT_TRUE((*backend)->PostAttention(l, attn.data()).ok());
    }
    SampledTokens got;
    ASSERT_TRUE((*backend)->Finish(&got).ok());
    EXPECT_EQ(got.size(), 2u);
    EXPECT_TRUE(got.top.empty()) << "no row asked: no lists at all";
  }
}

std::unique_ptr<ColocatedEngine> Engine(const WeightSource& w) {
  EngineOptions o;
  o.device = "cpu";
  o.max_batch_size = 8;
  o.max_tokens_per_step = 64;  // long prompts prefill in chunks, beside other requests' decode rows
  o.kv_capacity_tokens = 4096;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

TEST(TopLogprobs, EngineReportsThemPerTokenOnlyToRequestsThatAsk) {
  std::unique_ptr<WeightSource> source = Model("tiny-gqa");
  const int64_t vocab = source->spec().vocab_size;
  std::vector<GenerationRequest> requests;
  uint32_t x = 99;
  for (int i = 0; i < 6; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 1 + 23 * i; ++j) {
      x = x * 1664525u + 1013904223u;
      r.prompt.push_back(static_cast<int32_t>((x >> 8) % static_cast<uint32_t>(vocab)));
    }
    r.max_tokens = 4 + i;
    r.ignore_eos = true;
    if (i % 2 == 1) r.sampling = {.temperature = 0.9f, .top_k = 0, .top_p = 1.0f, .seed = 5u + i};
    requests.push_back(r);
  }
  std::unique_ptr<ColocatedEngine> plain = Engine(*source);
  absl::StatusOr<std::vector<GenerationResult>> without = plain->GenerateAll(requests);
  ASSERT_TRUE(without.ok()) << without.status();
  const std::vector<int32_t> asked = {0, 1, 20, 0, 7, 3};
  for (size_t i = 0; i < requests.size(); ++i) requests[i].top_logprobs = asked[i];
  std::unique_ptr<ColocatedEngine> engine = Engine(*source);
  absl::StatusOr<std::vector<GenerationResult>> with = engine->GenerateAll(requests);
  ASSERT_TRUE(with.ok()) << with.status();
  for (size_t i = 0; i < requests.size(); ++i) {
    const GenerationResult& r = (*with)[i];
    EXPECT_EQ(r.token_ids, (*without)[i].token_ids) << "asking changed request " << i << "'s tokens";
    EXPECT_TRUE((*without)[i].top_logprobs.empty());
    if (asked[i] == 0) {
      EXPECT_TRUE(r.top_logprobs.empty()) << "request " << i;
      continue;
    }
    ASSERT_EQ(r.top_logprobs.size(), r.token_ids.size()) << "request " << i;
    for (size_t t = 0; t < r.token_ids.size(); ++t) {
      const std::vector<TopLogprob>& top = r.top_logprobs[t];
      ASSERT_EQ(top.size(), static_cast<size_t>(asked[i])) << "request " << i << " token " << t;
      for (size_t j = 1; j < top.size(); ++j) EXPECT_GE(top[j - 1].logprob, top[j].logprob);
      EXPECT_LE(r.logprobs[t], top[0].logprob);
      for (const TopLogprob& a : top) {
        if (a.token == r.token_ids[t]) {
          EXPECT_EQ(a.logprob, r.logprobs[t]) << "request " << i << " token " << t;
        }
      }
      if (requests[i].sampling.temperature == 0.0f) {
        EXPECT_EQ(top[0].token, r.token_ids[t]) << "greedy request " << i << " token " << t;
        EXPECT_EQ(top[0].logprob, r.logprobs[t]);
      }
    }
  }
}

TEST(TopLogprobs, EngineRefusesCountsOutsideTheLimit) {
  std::unique_ptr<WeightSource> source = Model("tiny-mha");
  std::unique_ptr<ColocatedEngine> engine = Engine(*source);
  GenerationRequest r;
  r.prompt = {1, 2, 3};
  for (int32_t k : {kMaxTopLogprobs + 1, -1}) {
    r.top_logprobs = k;
    const absl::Status s = engine->Check(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_NE(s.message().find("top_logprobs must be in [0, 20]"), std::string::npos) << s;
  }
  r.top_logprobs = kMaxTopLogprobs;
  EXPECT_TRUE(engine->Check(r).ok());
}

}  // namespace
}  // namespace tandem
