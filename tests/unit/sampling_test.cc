// Sampling: the counter-based generator, greedy / top-k / top-p sampling against naive
// references, empirical distributions, and log-probabilities. All seeds are fixed, so every
// statistical bound below is checked on one deterministic sequence.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {
namespace {

std::vector<float> RandomLogits(uint32_t seed, int64_t vocab, float lo = -5.0f, float hi = 5.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(vocab));
  for (float& x : v) x = dist(rng);
  return v;
}

int32_t NaiveArgmax(const std::vector<float>& logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// softmax(logits / T) in double.
std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  std::vector<double> p(logits.size());
  double m = -std::numeric_limits<double>::infinity();
  for (float l : logits) m = std::max(m, l / temperature);
  double sum = 0.0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp(logits[i] / temperature - m);
  for (double& x : p) x /= sum;
  return p;
}

// The tokens top-k then top-p keep (transformers' order: top-p on the top-k renormalised mass).
std::set<int32_t> NaiveKeepSet(const std::vector<double>& prob, int32_t top_k, double top_p) {
  std::vector<int32_t> order(prob.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return prob[static_cast<size_t>(a)] > prob[static_cast<size_t>(b)];
  });
  size_t kept = order.size();
  if (top_k > 0) kept = std::min(kept, static_cast<size_t>(top_k));
  double mass = 0.0;
  for (size_t i = 0; i < kept; ++i) mass += prob[static_cast<size_t>(order[i])];
  double cum = 0.0;
  std::set<int32_t> keep;
  for (size_t i = 0; i < kept; ++i) {
    keep.insert(order[i]);
    cum += prob[static_cast<size_t>(order[i])] / mass;
    if (cum >= top_p) break;
  }
  return keep;
}

// Pearson's chi-square of `counts` against probabilities `expected` (zero-probability cells
// must have zero counts, checked separately).
double ChiSquare(const std::vector<int64_t>& counts, const std::vector<double>& expected, int64_t n) {
  double chi2 = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expected[i] == 0.0) continue;
    const double e = expected[i] * static_cast<double>(n);
    chi2 += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
  }
  return chi2;
}

std::vector<int64_t> Histogram(const std::vector<float>& logits, const SamplingParams& params,
                               int64_t draws) {
  std::vector<int64_t> counts(logits.size(), 0);
  for (int64_t c = 0; c < draws; ++c) {
    const int32_t t =
        SampleToken(logits.data(), static_cast<int64_t>(logits.size()), params, static_cast<uint64_t>(c));
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(logits.size()));
    if (t >= 0 && t < static_cast<int32_t>(logits.size())) ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

// ---- CounterUniform -----------------------------------------------------------------------------

TEST(CounterUniformTest, MatchesTheDocumentedFormula) {
  // Values from an independent Python implementation of the formula in ops.h; the CUDA sampler
  // must reproduce these bits.
  EXPECT_EQ(CounterUniform(0, 0), 4727170.0f / 16777216.0f);
  EXPECT_EQ(CounterUniform(0, 1), 9599612.0f / 16777216.0f);
  EXPECT_EQ(CounterUniform(42, 7), 5793018.0f / 16777216.0f);
  EXPECT_EQ(CounterUniform(~uint64_t{0}, 123456789), 5574179.0f / 16777216.0f);
  EXPECT_EQ(CounterUniform(12345, uint64_t{1} << 63), 11045987.0f / 16777216.0f);
}

TEST(CounterUniformTest, InUnitIntervalDeterministicAndUniform) {
  constexpr int64_t kN = 1 << 20;
  double sum = 0.0;
  float lo = 1.0f, hi = 0.0f;
  std::vector<int64_t> buckets(16, 0);
  for (int64_t c = 0; c < kN; ++c) {
    const float u = CounterUniform(7, static_cast<uint64_t>(c));
    ASSERT_GE(u, 0.0f) << c;
    ASSERT_LT(u, 1.0f) << c;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
    ++buckets[static_cast<size_t>(u * 16.0f)];
  }
  EXPECT_EQ(CounterUniform(7, 12345), CounterUniform(7, 12345));
  // Mean of 2^20 uniforms: sd = 1/sqrt(12 · 2^20) ≈ 2.8e-4; 5 sd.
  EXPECT_NEAR(sum / kN, 0.5, 1.5e-3);
  EXPECT_LT(lo, 1e-5f);
  EXPECT_GT(hi, 1.0f - 1e-5f);
  // 16 equal buckets, 15 dof: chi-square 37.7 is the p = 0.001 quantile.
  EXPECT_LT(ChiSquare(buckets, std::vector<double>(16, 1.0 / 16), kN), 37.7);
  // Neighbouring counters and seeds give unrelated values.
  std::set<float> distinct;
  for (uint64_t c = 0; c < 1000; ++c) distinct.insert(CounterUniform(1, c));
  EXPECT_GT(distinct.size(), 990u);  // 24-bit values: collisions in 1000 draws are rare
  int same = 0;
  for (uint64_t s = 0; s < 1000; ++s) same += CounterUniform(s, 5) == CounterUniform(s + 1, 5);
  EXPECT_LT(same, 3);
}

// ---- SampleToken --------------------------------------------------------------------------------

TEST(SampleTokenTest, GreedyIsArgmaxWithLowestIdOnTies) {
  const std::vector<float> ties = {0.0f, 3.0f, 1.0f, 3.0f, -2.0f};
  SamplingParams greedy;  // temperature 0
  EXPECT_EQ(SampleToken(ties.data(), 5, greedy, 0), 1);
  greedy.temperature = -1.0f;  // negative counts as greedy too
  EXPECT_EQ(SampleToken(ties.data(), 5, greedy, 9), 1);
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const std::vector<float> logits = RandomLogits(seed, 1000);
    EXPECT_EQ(SampleToken(logits.data(), 1000, SamplingParams{}, seed), NaiveArgmax(logits));
  }
  const std::vector<float> one = {-7.0f};
  EXPECT_EQ(SampleToken(one.data(), 1, SamplingParams{}, 0), 0);
}

TEST(SampleTokenTest, SameCounterSameTokenDifferentCountersVary) {
  const std::vector<float> logits = RandomLogits(1, 50, -1.0f, 1.0f);  // a flat distribution
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 99;
  std::set<int32_t> seen;
  for (uint64_t c = 0; c < 200; ++c) {
    const int32_t t = SampleToken(logits.data(), 50, p, c);
    EXPECT_EQ(SampleToken(logits.data(), 50, p, c), t);
    seen.insert(t);
  }
  EXPECT_GT(seen.size(), 30u);  // ~49 expected from 200 draws over ~50 similar tokens
  // Another seed, other tokens for most counters.
  SamplingParams q = p;
  q.seed = 100;
  int same = 0;
  for (uint64_t c = 0; c < 200; ++c) {
    same += SampleToken(logits.data(), 50, p, c) == SampleToken(logits.data(), 50, q, c);
  }
  EXPECT_LT(same, 30);  // ~4 expected when independent
}

TEST(SampleTokenTest, TopKOneAndTinyTopPAreGreedy) {
  for (uint32_t seed = 0; seed < 10; ++seed) {
    const std::vector<float> logits = RandomLogits(seed, 1000, -2.0f, 2.0f);
    const int32_t want = NaiveArgmax(logits);
    SamplingParams k1;
    k1.temperature = 1.5f;
    k1.top_k = 1;
    k1.seed = seed;
    SamplingParams p0 = k1;
    p0.top_k = 0;
    p0.top_p = 1e-6f;
    for (uint64_t c = 0; c < 50; ++c) {
      ASSERT_EQ(SampleToken(logits.data(), 1000, k1, c), want) << seed << " " << c;
      ASSERT_EQ(SampleToken(logits.data(), 1000, p0, c), want) << seed << " " << c;
    }
  }
  // top_k = 1 with tied maxima keeps the lower id, like greedy.
  const std::vector<float> ties = {1.0f, 4.0f, 4.0f, 0.0f};
  SamplingParams k1;
  k1.temperature = 1.0f;
  k1.top_k = 1;
  for (uint64_t c = 0; c < 50; ++c) ASSERT_EQ(SampleToken(ties.data(), 4, k1, c), 1);
}

const std::vector<float> kFiveLogits = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f};
constexpr int64_t kDraws = 20000;

TEST(SampleTokenTest, EmpiricalDistributionMatchesSoftmax) {
  for (float temperature : {0.8f, 1.0f, 3.0f}) {
    SamplingParams p;
    p.temperature = temperature;
    p.seed = 1234;
    const std::vector<int64_t> counts = Histogram(kFiveLogits, p, kDraws);
    // 5 cells, 4 dof: 18.47 is the p = 0.001 quantile of chi-square.
    EXPECT_LT(ChiSquare(counts, Softmax(kFiveLogits, temperature), kDraws), 18.47) << temperature;
  }
}

TEST(SampleTokenTest, TopKAndTopPNeverPickFilteredTokens) {
  const std::vector<double> prob = Softmax(kFiveLogits, 0.8);  // {.183, .098, .052, .028, .639}
  struct Case {
    int32_t top_k;
    float top_p;
    std::set<int32_t> keep;  // worked out by hand from `prob`
  };
  const Case cases[] = {
      {3, 1.0f, {4, 0, 1}},
      {0, 0.7f, {4, 0}},         // .639 < .7 <= .822
      {0, 0.95f, {4, 0, 1, 2}},  // .920 < .95 <= .972
      // top-p on the top-3 renormalised mass {.695, .199, .106}: .695 < .85 <= .894, so {4, 0}
      // (top-p on the raw mass would keep token 1 as well: .822 < .85).
      {3, 0.85f, {4, 0}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("top_k " + std::to_string(c.top_k) + " top_p " + std::to_string(c.top_p));
    ASSERT_EQ(NaiveKeepSet(prob, c.top_k, c.top_p), c.keep);
    SamplingParams p;
    p.temperature = 0.8f;
    p.top_k = c.top_k;
    p.top_p = c.top_p;
    p.seed = 77;
    const std::vector<int64_t> counts = Histogram(kFiveLogits, p, kDraws);
    std::vector<double> expected(prob.size(), 0.0);
    double mass = 0.0;
    for (int32_t t : c.keep) mass += prob[static_cast<size_t>(t)];
    for (int32_t t : c.keep) expected[static_cast<size_t>(t)] = prob[static_cast<size_t>(t)] / mass;
    for (size_t t = 0; t < counts.size(); ++t) {
      if (!c.keep.contains(static_cast<int32_t>(t))) {
        EXPECT_EQ(counts[t], 0) << "filtered token " << t;
      }
    }
    // p = 0.001 quantiles of chi-square with |keep| - 1 dof.
    const double limit[] = {0.0, 10.83, 13.82, 16.27};
    EXPECT_LT(ChiSquare(counts, expected, kDraws), limit[c.keep.size() - 1]);
  }
}

TEST(SampleTokenTest, FilteredSetsMatchNaiveReferenceOnLargeVocab) {
  const int64_t vocab = 500;
  for (uint32_t seed = 0; seed < 4; ++seed) {
    const std::vector<float> logits = RandomLogits(seed, vocab, -3.0f, 3.0f);
    for (int32_t top_k : {0, 1, 7, 40}) {
      for (float top_p : {1.0f, 0.9f, 0.5f, 0.05f}) {
        SamplingParams p;
        p.temperature = 0.7f;
        p.top_k = top_k;
        p.top_p = top_p;
        p.seed = seed;
        const std::set<int32_t> keep = NaiveKeepSet(Softmax(logits, 0.7), top_k, top_p);
        for (uint64_t c = 0; c < 300; ++c) {
          const int32_t t = SampleToken(logits.data(), vocab, p, c);
          ASSERT_TRUE(keep.contains(t)) << "token " << t << " top_k " << top_k << " top_p " << top_p;
        }
      }
    }
  }
}

TEST(SampleTokenTest, TopKTiesAtTheBoundaryKeepLowerIds) {
  const std::vector<float> logits = {1.0f, 2.0f, 1.0f, 1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;  // token 1, then the lowest id among the tied 1.0s: token 0
  const std::vector<int64_t> counts = Histogram(logits, p, 2000);
  EXPECT_GT(counts[0], 0);
  EXPECT_GT(counts[1], 0);
  EXPECT_EQ(counts[2] + counts[3] + counts[4], 0);
}

TEST(SampleTokenTest, NanAndMinusInfinityAreNeverPicked) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> logits = {nan, -inf, 0.5f, nan, 0.2f};
  EXPECT_EQ(SampleToken(logits.data(), 5, SamplingParams{}, 0), 2);
  SamplingParams p;
  p.temperature = 1.0f;
  const std::vector<int64_t> counts = Histogram(logits, p, 2000);
  EXPECT_EQ(counts[0] + counts[1] + counts[3], 0);
  EXPECT_EQ(counts[2] + counts[4], 2000);
}

// ---- TokenLogprob -------------------------------------------------------------------------------

TEST(TokenLogprobTest, MatchesDoubleLogSoftmax) {
  for (float offset : {0.0f, 1000.0f, -1000.0f}) {  // large offsets: must stay stable
    const int64_t vocab = 1000;
    std::vector<float> logits = RandomLogits(3, vocab, -10.0f, 10.0f);
    for (float& l : logits) l += offset;
    double m = -std::numeric_limits<double>::infinity();
    for (float l : logits) m = std::max(m, double{l});
    double sum = 0.0;
    for (float l : logits) sum += std::exp(l - m);
    double total = 0.0;
    for (int32_t t = 0; t < vocab; ++t) {
      const float lp = TokenLogprob(logits.data(), vocab, t);
      ASSERT_FALSE(std::isnan(lp));
      // A double result rounded to fp32: |lp| <= ~30 here, so one rounding is <= 2e-6.
      ASSERT_NEAR(lp, logits[static_cast<size_t>(t)] - m - std::log(sum), 2e-6 + 1e-7 * std::abs(lp))
          << "token " << t << " offset " << offset;
      total += std::exp(double{lp});
    }
    // 1000 terms each off by a relative ~1e-7: the probabilities sum to 1 within 1e-5.
    EXPECT_NEAR(total, 1.0, 1e-5) << offset;
  }
  const std::vector<float> two = {0.0f, 0.0f};
  EXPECT_FLOAT_EQ(TokenLogprob(two.data(), 2, 1), static_cast<float>(-std::log(2.0)));
}

// ---- TopLogprobs --------------------------------------------------------------------------------

// The reference: every id sorted by (logit descending, id ascending), NaN as -inf, then the first k.
std::vector<int32_t> NaiveTopIds(const std::vector<float>& logits, int64_t k) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  auto key = [&](int32_t i) {
    const float l = logits[static_cast<size_t>(i)];
    return std::isnan(l) ? -std::numeric_limits<double>::infinity() : double{l};
  };
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return key(a) > key(b); });
  ids.resize(static_cast<size_t>(std::min<int64_t>(k, static_cast<int64_t>(ids.size()))));
  return ids;
}

TEST(TopLogprobsTest, MatchesFullSortAndTokenLogprob) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t vocab = 1 + static_cast<int64_t>(rng() % 3000);
    std::vector<float> logits = RandomLogits(100 + static_cast<uint32_t>(trial), vocab, -8.0f, 8.0f);
    // Ties on purpose in every other trial: logits rounded to integers, so equal values occur and
    // must order by id.
    if (trial % 2 == 0)
      for (float& l : logits) l = std::round(l);
    const int32_t k = static_cast<int32_t>(rng() % (kMaxTopLogprobs + 1));
    std::vector<TopLogprob> top;
    TopLogprobs(logits.data(), vocab, k, &top);
    const std::vector<int32_t> want = NaiveTopIds(logits, k);
    ASSERT_EQ(top.size(), want.size()) << "trial " << trial;
    for (size_t j = 0; j < top.size(); ++j) {
      ASSERT_EQ(top[j].token, want[j]) << "trial " << trial << " entry " << j;
      // Bit-identical to the chosen token's log-probability of the same row.
      ASSERT_EQ(top[j].logprob, TokenLogprob(logits.data(), vocab, top[j].token)) << "trial " << trial;
    }
    // Greedy picks entry 0.
    if (!top.empty()) {
      EXPECT_EQ(top[0].token, SampleToken(logits.data(), vocab, SamplingParams{}, 0)) << "trial " << trial;
    }
  }
}

TEST(TopLogprobsTest, EdgeCases) {
  std::vector<TopLogprob> top = {{7, -1.0f}};
  const std::vector<float> three = {1.0f, 3.0f, 3.0f};
  TopLogprobs(three.data(), 3, 0, &top);
  EXPECT_TRUE(top.empty()) << "k = 0 gives none and replaces what was there";
  TopLogprobs(three.data(), 3, 20, &top);  // k above vocab: every token
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].token, 1);
  EXPECT_EQ(top[1].token, 2);
  EXPECT_EQ(top[2].token, 0);
  TopLogprobs(three.data(), 3, -4, &top);
  EXPECT_TRUE(top.empty()) << "negative k clamps to 0";
  // NaN ranks as -inf and makes every log-probability NaN, as TokenLogprob does.
  const std::vector<float> nan = {std::numeric_limits<float>::quiet_NaN(), 2.0f, -1.0f};
  TopLogprobs(nan.data(), 3, 3, &top);
  ASSERT_EQ(top.size(), 3u);
  EXPECT_EQ(top[0].token, 1);
  EXPECT_EQ(top[1].token, 2);
  EXPECT_EQ(top[2].token, 0);
  for (const TopLogprob& t : top) EXPECT_TRUE(std::isnan(t.logprob));
}

}  // namespace
}  // namespace tandem::kernels::cpu
