// cuda::SampleTokens against cpu::SampleToken and cpu::TokenLogprob on the same fp32 logits.
//
// * Greedy rows (temperature <= 0 or NaN) must give exactly the CPU's argmax, ties (lowest id)
//   and NaN / inf rows included.
// * Sampling rows (temperature, top-k, top-p mixed in one batch) must give the CPU's token. The
//   GPU sums probabilities in another order than the CPU's sequential loops, so a row may differ
//   only where a cumulative sum lies within rounding of a decision boundary (the top-p target or
//   u * total). The test computes each row's distance to those boundaries and requires
//     - an exact match for every row farther than 1e-9 (relative) from a boundary: double sums of
//       up to 128256 terms differ by ~1e-12 relative at most, and CUDA's exp() and glibc's differ
//       by at most an ulp (~1e-16);
//     - a GPU token that the CPU's top-k / top-p would keep, with p > 0, for every row;
//     - at least 99.9% identical tokens overall.
// * Log-probabilities: |gpu - cpu| <= 1e-5 (both NaN where the CPU gives NaN). The GPU sums
//   exp(l - max) terms computed in fp32 (relative error ~1e-7 each) in double; the CPU is all
//   double. log(sum) moves by ~1e-7, and a float near -20 has an ulp of 2e-6.
// Output buffers are guarded; launches repeat bit-identically; one batch is captured in a graph.
// RejectsInvalidParams touches no device memory and runs without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
// gpu_test_util.h memcpy's into __nv_bfloat16 (fine, but -Wclass-memaccess flags it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclass-memaccess"
#include "gpu_test_util.h"
#pragma GCC diagnostic pop
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::GuardedBuffer;
using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kBoundary = 1e-9;  // relative distance to a decision boundary (see the header)
constexpr double kLogprobTol = 1e-5;

struct RowParams {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0, counter = 0;
};

struct Batch {
  int64_t rows = 0, vocab = 0;
  std::vector<float> logits;  // (rows, vocab)
  std::vector<RowParams> params;
  const float* row(int64_t r) const { return logits.data() + r * vocab; }
};

struct GpuResult {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  bool guards_ok = false;
  absl::Status status;
};

// Runs SampleTokens on `b` (twice when repeat, requiring identical outputs).
GpuResult RunGpu(const Batch& b, bool repeat = true) {
  GpuResult res;
  const int64_t R = b.rows;
  GuardedBuffer<float> logits(R * b.vocab), temperature(R), top_p(R), logprobs(R);
  GuardedBuffer<int32_t> top_k(R), tokens(R);
  GuardedBuffer<uint64_t> seed(R), counter(R);
  const int64_t ws_bytes = SampleWorkspaceBytes(R, b.vocab);
  EXPECT_GE(ws_bytes, 0);
  GuardedBuffer<unsigned char> workspace(std::max<int64_t>(ws_bytes, 1));
  std::vector<float> t(R), pp(R);
  std::vector<int32_t> k(R);
  std::vector<uint64_t> s(R), c(R);
  for (int64_t r = 0; r < R; ++r) {
    const RowParams& q = b.params[static_cast<size_t>(r)];
    t[r] = q.temperature;
    pp[r] = q.top_p;
    k[r] = q.top_k;
    s[r] = q.seed;
    c[r] = q.counter;
  }
  logits.Upload(b.logits);
  temperature.Upload(t);
  top_p.Upload(pp);
  top_k.Upload(k);
  seed.Upload(s);
  counter.Upload(c);
  SampleParams p;
  p.logits = logits.get();
  p.temperature = temperature.get();
  p.top_k = top_k.get();
  p.top_p = top_p.get();
  p.seed = seed.get();
  p.counter = counter.get();
  p.out_tokens = tokens.get();
  p.out_logprobs = logprobs.get();
  p.rows = R;
  p.vocab = b.vocab;
  for (int run = 0; run < (repeat ? 2 : 1); ++run) {
    res.status = SampleTokens(p, workspace.get(), nullptr);
    if (!res.status.ok()) return res;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int32_t> tk = tokens.Download();
    std::vector<float> lp = logprobs.Download();
    if (run == 0) {
      res.tokens = std::move(tk);
      res.logprobs = std::move(lp);
    } else {
      EXPECT_EQ(tk, res.tokens) << "a repeated launch gave other tokens";
      EXPECT_EQ(std::memcmp(lp.data(), res.logprobs.data(), lp.size() * sizeof(float)), 0)
          << "a repeated launch gave other log-probabilities";
    }
  }
  res.guards_ok =
      logits.GuardsIntact() && tokens.GuardsIntact() && logprobs.GuardsIntact() && workspace.GuardsIntact();
  return res;
}

// Runs fn(r) for r in [0, n) on all hardware threads.
template <typename F>
void ParallelRows(int64_t n, F fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(n, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int64_t r = t; r < n; r += threads) fn(r);
    });
  }
  for (std::thread& th : pool) th.join();
}

// What the CPU's SampleToken does with one row, recomputed with the distances to its decision
// boundaries: the kept set (top-k then top-p) and the margins of the top-p cut and of u * total.
struct RowAnalysis {
  std::vector<char> keep;
  std::vector<double> prob;
  double margin = std::numeric_limits<double>::infinity();  // relative to the kept / top-k mass
};

RowAnalysis Analyze(const float* logits, int64_t vocab, const RowParams& q) {
  RowAnalysis a;
  auto logit = [&](int64_t i) { return std::isnan(logits[i]) ? -kInf : logits[i]; };
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, static_cast<double>(logit(i)));
  const double inv_t = 1.0 / static_cast<double>(q.temperature);
  a.prob.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) a.prob[static_cast<size_t>(i)] = std::exp((logit(i) - m) * inv_t);
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    const double px = a.prob[static_cast<size_t>(x)], py = a.prob[static_cast<size_t>(y)];
    return px > py || (px == py && x < y);
  });
  size_t kept = order.size();
  if (q.top_k > 0 && q.top_k < vocab) kept = static_cast<size_t>(q.top_k);
  if (q.top_p < 1.0f) {
    double total = 0.0;
    for (size_t i = 0; i < kept; ++i) total += a.prob[static_cast<size_t>(order[i])];
    const double target = static_cast<double>(q.top_p) * total;
    double cum = 0.0, before = 0.0;
    size_t prefix = 0;
    while (prefix < kept) {
      before = cum;
      cum += a.prob[static_cast<size_t>(order[prefix])];
      ++prefix;
      if (cum >= target) break;
    }
    if (prefix > 1 || target > 0.0) {
      a.margin = std::min(a.margin, std::abs(cum - target) / total);
      if (prefix > 1) a.margin = std::min(a.margin, std::abs(target - before) / total);
    }
    kept = std::max<size_t>(prefix, 1);
  }
  a.keep.assign(static_cast<size_t>(vocab), 0);
  for (size_t i = 0; i < kept; ++i) a.keep[static_cast<size_t>(order[i])] = 1;
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (a.keep[static_cast<size_t>(i)]) total += a.prob[static_cast<size_t>(i)];
  }
  const double u = static_cast<double>(cpu::CounterUniform(q.seed, q.counter)) * total;
  double cum = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double pi = a.prob[static_cast<size_t>(i)];
    if (!a.keep[static_cast<size_t>(i)] || pi <= 0.0) continue;
    a.margin = std::min(a.margin, std::abs(u - cum) / total);
    cum += pi;
    if (u < cum) {
      a.margin = std::min(a.margin, (cum - u) / total);
      break;
    }
  }
  return a;
}

bool Greedy(const RowParams& q) { return !(q.temperature > 0.0f); }

// Compares every row of `b` with the CPU. Returns the number of rows whose token differs.
int64_t CheckBatch(const Batch& b, const GpuResult& g, const std::string& what) {
  EXPECT_TRUE(g.status.ok()) << what << ": " << g.status;
  EXPECT_TRUE(g.guards_ok) << what << ": a guard region around an output was overwritten";
  if (!g.status.ok() || static_cast<int64_t>(g.tokens.size()) != b.rows) return b.rows;
  std::vector<int32_t> want(static_cast<size_t>(b.rows));
  std::vector<float> want_lp(static_cast<size_t>(b.rows));
  std::vector<char> boundary(static_cast<size_t>(b.rows), 0), filtered(static_cast<size_t>(b.rows), 0);
  ParallelRows(b.rows, [&](int64_t r) {
    const RowParams& q = b.params[static_cast<size_t>(r)];
    cpu::SamplingParams sp;
    sp.temperature = q.temperature;
    sp.top_k = q.top_k;
    sp.top_p = q.top_p;
    sp.seed = q.seed;
    const int32_t t = cpu::SampleToken(b.row(r), b.vocab, sp, q.counter);
    want[static_cast<size_t>(r)] = t;
    const int32_t got = g.tokens[static_cast<size_t>(r)];
    want_lp[static_cast<size_t>(r)] =
        (got >= 0 && got < b.vocab) ? cpu::TokenLogprob(b.row(r), b.vocab, got) : kNaN;
    float max_logit = -kInf;
    for (int64_t i = 0; i < b.vocab; ++i) {
      if (!std::isnan(b.row(r)[i])) max_logit = std::max(max_logit, b.row(r)[i]);
    }
    if (Greedy(q) || !std::isfinite(max_logit)) return;  // the argmax, exactly
    const RowAnalysis a = Analyze(b.row(r), b.vocab, q);
    boundary[static_cast<size_t>(r)] = a.margin < kBoundary;
    filtered[static_cast<size_t>(r)] = got < 0 || got >= b.vocab || !a.keep[static_cast<size_t>(got)] ||
                                       !(a.prob[static_cast<size_t>(got)] > 0.0);
  });
  int64_t differ = 0, reported = 0;
  for (int64_t r = 0; r < b.rows; ++r) {
    const RowParams& q = b.params[static_cast<size_t>(r)];
    const int32_t got = g.tokens[static_cast<size_t>(r)], exp = want[static_cast<size_t>(r)];
    const std::string row_desc = what + " row " + std::to_string(r) + " (T=" + std::to_string(q.temperature) +
                                 " top_k=" + std::to_string(q.top_k) + " top_p=" + std::to_string(q.top_p) +
                                 ")";
    if (got != exp) {
      ++differ;
      const bool allowed = boundary[static_cast<size_t>(r)] && !Greedy(q);
      if (!allowed && reported++ < 10) {
        ADD_FAILURE() << row_desc << ": token " << got << ", CPU " << exp << " (not at a boundary)";
      }
    }
    if (filtered[static_cast<size_t>(r)] && reported++ < 10) {
      ADD_FAILURE() << row_desc << ": token " << got << " is one the CPU filters out";
    }
    const float lp = g.logprobs[static_cast<size_t>(r)], lp_want = want_lp[static_cast<size_t>(r)];
    const bool lp_ok = std::isnan(lp_want) ? std::isnan(lp)
                                           : (!std::isnan(lp) && std::abs(lp - lp_want) <= kLogprobTol) ||
                                                 (std::isinf(lp_want) && lp == lp_want);
    if (!lp_ok && reported++ < 10) {
      ADD_FAILURE() << row_desc << ": logprob " << lp << ", CPU " << lp_want;
    }
  }
  return differ;
}

// ---- inputs ------------------------------------------------------------------------------------

enum class Shape {
  kUniform,  // uniform in [-8, 8)
  kPeaked,   // normal(0, 2) plus a few logits raised by 6..12
  kLevels,   // 12 distinct values: many exact ties
};

void FillRow(std::mt19937& rng, Shape shape, float* row, int64_t vocab) {
  switch (shape) {
    case Shape::kUniform: {
      std::uniform_real_distribution<float> u(-8.0f, 8.0f);
      for (int64_t i = 0; i < vocab; ++i) row[i] = u(rng);
      break;
    }
    case Shape::kPeaked: {
      std::normal_distribution<float> n(0.0f, 2.0f);
      for (int64_t i = 0; i < vocab; ++i) row[i] = n(rng);
      std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
      std::uniform_real_distribution<float> lift(6.0f, 12.0f);
      for (int j = 0; j < 5; ++j) row[pick(rng)] += lift(rng);
      break;
    }
    case Shape::kLevels: {
      std::uniform_int_distribution<int> level(0, 11);
      for (int64_t i = 0; i < vocab; ++i) row[i] = 0.375f * static_cast<float>(level(rng)) - 2.0f;
      break;
    }
  }
}

// Temperature / top-k / top-p mixes, cycled over the rows of a batch.
std::vector<RowParams> Configs(int64_t vocab) {
  const int32_t v = static_cast<int32_t>(std::min<int64_t>(vocab, 1 << 30));
  std::vector<RowParams> c = {
      {1.0f, 0, 1.0f},       {0.7f, 50, 1.0f},    {1.0f, 0, 0.9f},  {1.3f, 40, 0.8f},
      {0.5f, 1, 1.0f},       {1.0f, v - 1, 0.5f}, {2.0f, 0, 0.2f},  {1.0f, 5, 0.0f},
      {1.0f, v + 3, 0.999f}, {0.0f, 0, 1.0f},     {1.0f, 0, kNaN},  {0.8f, 37, 0.95f},
      {1.0f, 2, 0.6f},       {3.0f, 1000, 0.99f}, {0.25f, 0, 0.5f}, {1.0f, -4, 0.7f},
  };
  return c;
}

Batch MakeBatch(uint32_t seed, int64_t rows, int64_t vocab, Shape shape) {
  std::mt19937 rng(seed);
  Batch b;
  b.rows = rows;
  b.vocab = vocab;
  b.logits.resize(static_cast<size_t>(rows * vocab));
  const std::vector<RowParams> configs = Configs(vocab);
  std::uniform_int_distribution<uint64_t> u64;
  for (int64_t r = 0; r < rows; ++r) {
    FillRow(rng, shape, b.logits.data() + r * vocab, vocab);
    RowParams q = configs[static_cast<size_t>(r) % configs.size()];
    q.seed = u64(rng);
    q.counter = u64(rng) % 100000;
    b.params.push_back(q);
  }
  return b;
}

// ---- tests -------------------------------------------------------------------------------------

TEST(CudaSamplingTest, GreedyMatchesCpuArgmaxIncludingTiesNanAndInf) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const int64_t vocab : {int64_t{1}, int64_t{17}, int64_t{1000}, int64_t{32000}, int64_t{128256}}) {
    for (const int64_t rows : {int64_t{1}, int64_t{257}}) {
      std::mt19937 rng(static_cast<uint32_t>(vocab * 31 + rows));
      Batch b;
      b.rows = rows;
      b.vocab = vocab;
      b.logits.resize(static_cast<size_t>(rows * vocab));
      std::uniform_int_distribution<int64_t> pick(0, vocab - 1);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = b.logits.data() + r * vocab;
        FillRow(rng, r % 5 == 4 ? Shape::kLevels : Shape::kUniform, row, vocab);
        RowParams q;
        q.temperature = r % 3 == 0 ? 0.0f : (r % 3 == 1 ? -1.0f : kNaN);
        q.top_k = 5;
        q.top_p = 0.5f;
        switch (r % 8) {
          case 1: {  // the maximum twice: the lower id wins
            const int64_t i = pick(rng), j = pick(rng);
            row[i] = row[j] = 9.0f;
            break;
          }
          case 2:  // NaN (counts as -inf), -inf
            row[pick(rng)] = kNaN;
            row[0] = kNaN;
            row[pick(rng)] = -kInf;
            break;
          case 3:  // all -inf: token 0, logprob NaN
            if (r % 16 == 3) std::fill(row, row + vocab, -kInf);
            break;
          case 5:  // +inf wins, logprob NaN
            row[pick(rng)] = kInf;
            break;
          case 6:  // all NaN: token 0
            if (r % 16 == 6) std::fill(row, row + vocab, kNaN);
            break;
          default:
            break;
        }
        b.params.push_back(q);
      }
      const std::string what = "greedy vocab " + std::to_string(vocab) + " rows " + std::to_string(rows);
      const GpuResult g = RunGpu(b);
      EXPECT_EQ(CheckBatch(b, g, what), 0) << what;
    }
  }
}

TEST(CudaSamplingTest, SamplingMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  int64_t total = 0, differ = 0;
  struct Case {
    int64_t vocab, rows;
    Shape shape;
  };
  const Case cases[] = {
      {1, 1, Shape::kUniform},      {1, 257, Shape::kUniform},      {17, 1, Shape::kUniform},
      {17, 257, Shape::kUniform},   {17, 257, Shape::kLevels},      {1000, 1, Shape::kPeaked},
      {1000, 257, Shape::kUniform}, {1000, 257, Shape::kPeaked},    {1000, 257, Shape::kLevels},
      {32000, 1, Shape::kUniform},  {32000, 257, Shape::kPeaked},   {32000, 129, Shape::kLevels},
      {128256, 1, Shape::kPeaked},  {128256, 257, Shape::kUniform}, {128256, 64, Shape::kPeaked},
  };
  uint32_t seed = 1;
  for (const Case& c : cases) {
    const Batch b = MakeBatch(seed++, c.rows, c.vocab, c.shape);
    const std::string what = "vocab " + std::to_string(c.vocab) + " rows " + std::to_string(c.rows) +
                             " shape " + std::to_string(static_cast<int>(c.shape));
    const GpuResult g = RunGpu(b);
    const int64_t d = CheckBatch(b, g, what);
    total += c.rows;
    differ += d;
  }
  // At most 0.1% of the rows may differ (and only at a boundary, checked per row above).
  EXPECT_LE(differ * 1000, total) << differ << " of " << total << " rows differ";
  RecordProperty("rows", static_cast<int>(total));
}

TEST(CudaSamplingTest, NanAndInfLogitsInSamplingRows) {
  TANDEM_SKIP_WITHOUT_GPU();
  // NaN counts as -inf (never sampled); a +inf logit makes the row greedy; extreme temperatures.
  Batch b = MakeBatch(77, 64, 1000, Shape::kPeaked);
  std::mt19937 rng(78);
  std::uniform_int_distribution<int64_t> pick(0, 999);
  for (int64_t r = 0; r < b.rows; ++r) {
    float* row = b.logits.data() + r * b.vocab;
    RowParams& q = b.params[static_cast<size_t>(r)];
    if (q.temperature <= 0.0f) q.temperature = 1.0f;
    for (int j = 0; j < 50; ++j) row[pick(rng)] = (j % 2 == 0) ? kNaN : -kInf;
    if (r % 8 == 1) row[pick(rng)] = kInf;
    if (r % 8 == 2) q.temperature = 1e-3f;  // only the maximum survives
    if (r % 8 == 3) q.temperature = 1e4f;   // nearly uniform over the finite logits
    if (r % 8 == 4) {                       // a single live token
      std::fill(row, row + b.vocab, -kInf);
      row[500] = 1.0f;
    }
    if (r % 8 == 5) std::fill(row, row + b.vocab, 0.5f);  // all tied
    if (r % 8 == 6) {                                     // masked with a finite -1e30: p underflows to 0
      std::fill(row, row + b.vocab, -1e30f);
      row[3] = row[9] = 2.0f;
    }
  }
  // Mismatches away from a boundary fail inside CheckBatch; all-tied rows sit exactly on one.
  EXPECT_LE(CheckBatch(b, RunGpu(b), "nan/inf rows"), 1);
}

TEST(CudaSamplingTest, RowsAreIndependentOfTheBatch) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Batch b = MakeBatch(5, 33, 32000, Shape::kPeaked);
  const GpuResult all = RunGpu(b, false);
  ASSERT_TRUE(all.status.ok()) << all.status;
  for (const int64_t r : {int64_t{0}, int64_t{7}, int64_t{32}}) {
    Batch one;
    one.rows = 1;
    one.vocab = b.vocab;
    one.logits.assign(b.row(r), b.row(r) + b.vocab);
    one.params = {b.params[static_cast<size_t>(r)]};
    const GpuResult g = RunGpu(one, false);
    ASSERT_TRUE(g.status.ok()) << g.status;
    EXPECT_EQ(g.tokens[0], all.tokens[static_cast<size_t>(r)]) << "row " << r;
    EXPECT_EQ(std::memcmp(&g.logprobs[0], &all.logprobs[static_cast<size_t>(r)], sizeof(float)), 0)
        << "row " << r;
  }
}

TEST(CudaSamplingTest, CapturesInCudaGraph) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Batch b = MakeBatch(9, 40, 32000, Shape::kUniform);
  const GpuResult eager = RunGpu(b, false);
  ASSERT_TRUE(eager.status.ok()) << eager.status;
  const int64_t R = b.rows;
  GuardedBuffer<float> logits(R * b.vocab), temperature(R), top_p(R), logprobs(R);
  GuardedBuffer<int32_t> top_k(R), tokens(R);
  GuardedBuffer<uint64_t> seed(R), counter(R);
  std::vector<float> t, pp;
  std::vector<int32_t> k;
  std::vector<uint64_t> s, c;
  for (const RowParams& q : b.params) {
    t.push_back(q.temperature);
    pp.push_back(q.top_p);
    k.push_back(q.top_k);
    s.push_back(q.seed);
    c.push_back(q.counter);
  }
  logits.Upload(b.logits);
  temperature.Upload(t);
  top_p.Upload(pp);
  top_k.Upload(k);
  seed.Upload(s);
  counter.Upload(c);
  SampleParams p;
  p.logits = logits.get();
  p.temperature = temperature.get();
  p.top_k = top_k.get();
  p.top_p = top_p.get();
  p.seed = seed.get();
  p.counter = counter.get();
  p.out_tokens = tokens.get();
  p.out_logprobs = logprobs.get();
  p.rows = R;
  p.vocab = b.vocab;
  cudaStream_t stream = nullptr;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status st = SampleTokens(p, nullptr, stream);
  CUDA_ASSERT_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_ASSERT_OK(cudaGraphLaunch(exec, stream));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(tokens.Download(), eager.tokens);
  const std::vector<float> lp = logprobs.Download();
  EXPECT_EQ(std::memcmp(lp.data(), eager.logprobs.data(), lp.size() * sizeof(float)), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// 256 rows x 128256: greedy well under 1 ms, top-p and top-k + top-p within a few ms.
TEST(CudaSamplingTest, FastEnoughForBatch256Vocab128256) {
  TANDEM_SKIP_WITHOUT_GPU();
  constexpr int64_t kRows = 256, kVocab = 128256;
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 2.5f);
  std::vector<float> host(static_cast<size_t>(kRows * kVocab));
  for (float& x : host) x = n(rng);
  GuardedBuffer<float> logits(kRows * kVocab), temperature(kRows), top_p(kRows), logprobs(kRows);
  GuardedBuffer<int32_t> top_k(kRows), tokens(kRows);
  GuardedBuffer<uint64_t> seed(kRows), counter(kRows);
  logits.Upload(host);
  seed.Upload(std::vector<uint64_t>(kRows, 42));
  std::vector<uint64_t> ctr(kRows);
  std::iota(ctr.begin(), ctr.end(), 0);
  counter.Upload(ctr);
  SampleParams p;
  p.logits = logits.get();
  p.temperature = temperature.get();
  p.top_k = top_k.get();
  p.top_p = top_p.get();
  p.seed = seed.get();
  p.counter = counter.get();
  p.out_tokens = tokens.get();
  p.out_logprobs = logprobs.get();
  p.rows = kRows;
  p.vocab = kVocab;
  struct Mode {
    const char* name;
    float t;
    int32_t k;
    float top_p;
    double limit_ms;
  };
  const Mode modes[] = {{"greedy", 0.0f, 0, 1.0f, 1.0},
                        {"top-p 0.9", 1.0f, 0, 0.9f, 5.0},
                        {"top-k 50 + top-p 0.9", 1.0f, 50, 0.9f, 5.0},
                        {"temperature only", 1.0f, 0, 1.0f, 5.0}};
  cudaEvent_t start, stop;
  CUDA_ASSERT_OK(cudaEventCreate(&start));
  CUDA_ASSERT_OK(cudaEventCreate(&stop));
  for (const Mode& m : modes) {
    temperature.Upload(std::vector<float>(kRows, m.t));
    top_k.Upload(std::vector<int32_t>(kRows, m.k));
    top_p.Upload(std::vector<float>(kRows, m.top_p));
    ASSERT_TRUE(SampleTokens(p, nullptr, nullptr).ok());  // warm-up
    constexpr int kIters = 10;
    CUDA_ASSERT_OK(cudaEventRecord(start));
    for (int i = 0; i < kIters; ++i) ASSERT_TRUE(SampleTokens(p, nullptr, nullptr).ok());
    CUDA_ASSERT_OK(cudaEventRecord(stop));
    CUDA_ASSERT_OK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CUDA_ASSERT_OK(cudaEventElapsedTime(&ms, start, stop));
    const double per_call = ms / kIters;
    std::printf("SampleTokens %d x %d, %s: %.3f ms\n", static_cast<int>(kRows), static_cast<int>(kVocab),
                m.name, per_call);
    EXPECT_LT(per_call, m.limit_ms) << m.name;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

TEST(CudaSamplingTest, RejectsInvalidParams) {
  float f = 0.0f;
  int32_t i = 0;
  uint64_t u = 0;
  SampleParams ok;
  ok.logits = &f, ok.temperature = &f, ok.top_k = &i, ok.top_p = &f, ok.seed = &u, ok.counter = &u;
  ok.out_tokens = &i, ok.out_logprobs = &f, ok.rows = 1, ok.vocab = 1;
  struct Bad {
    const char* field;
    SampleParams p;
  };
  std::vector<Bad> bad;
  auto add = [&](const char* field, auto mutate) {
    SampleParams p = ok;
    mutate(p);
    bad.push_back({field, p});
  };
  add("logits", [](SampleParams& p) { p.logits = nullptr; });
  add("temperature", [](SampleParams& p) { p.temperature = nullptr; });
  add("top_k", [](SampleParams& p) { p.top_k = nullptr; });
  add("top_p", [](SampleParams& p) { p.top_p = nullptr; });
  add("seed", [](SampleParams& p) { p.seed = nullptr; });
  add("counter", [](SampleParams& p) { p.counter = nullptr; });
  add("out_tokens", [](SampleParams& p) { p.out_tokens = nullptr; });
  add("out_logprobs", [](SampleParams& p) { p.out_logprobs = nullptr; });
  add("rows", [](SampleParams& p) { p.rows = 0; });
  add("vocab", [](SampleParams& p) { p.vocab = 0; });
  add("vocab", [](SampleParams& p) { p.vocab = int64_t{1} << 40; });
  for (const Bad& c : bad) {
    const absl::Status st = SampleTokens(c.p, nullptr, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.field));
  }
  EXPECT_GE(SampleWorkspaceBytes(256, 128256), 0);
}

}  // namespace
}  // namespace tandem::kernels::cuda
