// cuda::DecodeAttention against cpu::Attention (fp32) on the exact fp32 values of random bf16
// inputs, through shuffled slot tables whose unused slots hold NaN (a wrong gather shows up as
// NaN). Every run checks guard regions around out, lse and the workspace, repeats the launch (3
// times) and requires bit-identical results; a difference is reported with the shape and the
// first differing element.
//
// Tolerances (reasons):
//   out: |gpu - ref| <= 2^-7 · |ref| + 1e-4 · max|v|. The output is rounded to bf16 (unit
//        roundoff 2^-8, doubled for margin); the absolute term covers fp32 accumulation in a
//        different order (~1e-6 · max|v| expected). A key missing or counted twice moves the
//        output by ~|v|/L, far beyond this at the short contexts (and NaN-poisoned unused slots
//        make wrong gathers loud at every length).
//   lse: |gpu - ref| <= 1e-3 absolute: fp32 rounding of scores (~1e-6 · |s|) and of the row sum
//        (the reference sums up to 4096 terms sequentially).
// PlanChoosesSplits and RejectsInvalidParams touch no device memory and run without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::FromBits;
using ::tandem::testing_gpu::GuardedBuffer;
using ::tandem::testing_gpu::RandomBf16;
using ::tandem::testing_gpu::ToBf16;
using ::tandem::testing_gpu::ToFloat;
using ::testing::HasSubstr;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Problem {
  int64_t R = 0, H = 0, KVH = 0, D = 0, num_slots = 0, rows = 0;
  float scale = 0.0f;
  std::vector<int32_t> lens;
  std::vector<int32_t> q_indptr;  // host copy; request r's row is q_indptr[r] if it has one
  bool pass_q_indptr = false;     // else q_indptr is the identity and the kernel gets nullptr
  std::vector<int32_t> kv_indptr, kv_slots;
  std::vector<bf16> q, k, v;
  std::vector<float> qf, kf, vf;
  float vmax = 0.0f;
};

struct ProblemOptions {
  float scale = 0.0f;  // 0: 1/sqrt(D)
  float q_amp = 2.0f;  // q in [-q_amp, q_amp), k and v in [-1, 1)
  float trend = 0.0f;  // adds trend · j / len to k[.., 0] of key j and sets q[.., 0] = 1
  bool pass_q_indptr = false;
  std::vector<int32_t> q_lens;  // per request, 0 or 1 (empty: all 1); needs pass_q_indptr
};

Problem MakeProblem(uint32_t seed, int64_t H, int64_t KVH, int64_t D, std::vector<int32_t> lens,
                    const ProblemOptions& opt = {}) {
  std::mt19937 rng(seed);
  Problem pb;
  pb.R = static_cast<int64_t>(lens.size());
  pb.H = H;
  pb.KVH = KVH;
  pb.D = D;
  pb.scale = opt.scale > 0.0f ? opt.scale : 1.0f / std::sqrt(static_cast<float>(D));
  pb.lens = std::move(lens);
  pb.pass_q_indptr = opt.pass_q_indptr;
  pb.q_indptr.assign(1, 0);
  for (int64_t r = 0; r < pb.R; ++r) {
    const int32_t ql = opt.q_lens.empty() ? 1 : opt.q_lens[static_cast<size_t>(r)];
    pb.q_indptr.push_back(pb.q_indptr.back() + ql);
  }
  pb.rows = pb.q_indptr.back();
  pb.kv_indptr.assign(1, 0);
  for (int32_t len : pb.lens) pb.kv_indptr.push_back(pb.kv_indptr.back() + len);
  const int64_t total = pb.kv_indptr.back();
  // A third more slots than keys: the unused ones hold NaN.
  pb.num_slots = total + total / 3 + 5;
  std::vector<int32_t> perm(static_cast<size_t>(pb.num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  pb.kv_slots.assign(perm.begin(), perm.begin() + total);
  if (pb.kv_slots.empty()) pb.kv_slots.push_back(0);  // never read; keeps the pointer non-null

  RandomBf16(rng, pb.rows * H * D, -opt.q_amp, opt.q_amp, &pb.q, &pb.qf);
  const int64_t kv_elems = pb.num_slots * KVH * D;
  RandomBf16(rng, kv_elems, -1.0f, 1.0f, &pb.k, &pb.kf);
  RandomBf16(rng, kv_elems, -1.0f, 1.0f, &pb.v, &pb.vf);
  std::vector<bool> used(static_cast<size_t>(pb.num_slots), false);
  for (int64_t i = 0; i < total; ++i) used[static_cast<size_t>(pb.kv_slots[static_cast<size_t>(i)])] = true;
  const bf16 nan = FromBits(0x7FC0);
  for (int64_t s = 0; s < pb.num_slots; ++s) {
    if (used[static_cast<size_t>(s)]) continue;
    for (int64_t i = s * KVH * D; i < (s + 1) * KVH * D; ++i) {
      pb.k[static_cast<size_t>(i)] = pb.v[static_cast<size_t>(i)] = nan;
      pb.kf[static_cast<size_t>(i)] = pb.vf[static_cast<size_t>(i)] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  if (opt.trend != 0.0f) {
    for (int64_t r = 0; r < pb.R; ++r) {
      const int32_t len = pb.lens[static_cast<size_t>(r)];
      for (int32_t j = 0; j < len; ++j) {
        const int64_t slot = pb.kv_slots[static_cast<size_t>(pb.kv_indptr[static_cast<size_t>(r)] + j)];
        for (int64_t kvh = 0; kvh < KVH; ++kvh) {
          const size_t i = static_cast<size_t>((slot * KVH + kvh) * D);
          pb.k[i] = ToBf16(opt.trend * static_cast<float>(j) / static_cast<float>(len));
          pb.kf[i] = ToFloat(pb.k[i]);
        }
      }
    }
    for (int64_t i = 0; i < pb.rows * H; ++i) {
      pb.q[static_cast<size_t>(i * D)] = ToBf16(1.0f);
      pb.qf[static_cast<size_t>(i * D)] = 1.0f;
    }
  }
  for (int64_t i = 0; i < total; ++i) {
    const int64_t s = pb.kv_slots[static_cast<size_t>(i)];
    for (int64_t e = s * KVH * D; e < (s + 1) * KVH * D; ++e)
      pb.vmax = std::max(pb.vmax, std::fabs(pb.vf[static_cast<size_t>(e)]));
  }
  return pb;
}

struct Reference {
  std::vector<float> out;  // (rows, H, D)
  std::vector<float> lse;  // (rows, H)
};

// cpu::Attention on the requests that have a query row and keys; rows of requests without keys
// expect out = 0 and lse = -inf.
Reference CpuReference(const Problem& pb) {
  Reference ref;
  ref.out.assign(static_cast<size_t>(pb.rows * pb.H * pb.D), 0.0f);
  ref.lse.assign(static_cast<size_t>(pb.rows * pb.H), kNegInf);
  std::vector<int32_t> cq{0}, ckv{0}, cslots, row_of;
  std::vector<float> cqf;
  for (int64_t r = 0; r < pb.R; ++r) {
    const int32_t q0 = pb.q_indptr[static_cast<size_t>(r)], q1 = pb.q_indptr[static_cast<size_t>(r) + 1];
    const int32_t len = pb.lens[static_cast<size_t>(r)];
    if (q1 == q0 || len == 0) continue;
    row_of.push_back(q0);
    cq.push_back(cq.back() + 1);
    ckv.push_back(ckv.back() + len);
    for (int32_t j = 0; j < len; ++j)
      cslots.push_back(pb.kv_slots[static_cast<size_t>(pb.kv_indptr[static_cast<size_t>(r)] + j)]);
    cqf.insert(cqf.end(), pb.qf.begin() + q0 * pb.H * pb.D, pb.qf.begin() + (q0 + 1) * pb.H * pb.D);
  }
  if (row_of.empty()) return ref;
  const int64_t n = static_cast<int64_t>(row_of.size());
  std::vector<float> out(static_cast<size_t>(n * pb.H * pb.D)), lse(static_cast<size_t>(n * pb.H));
  cpu::AttentionParams p;
  p.q = cqf.data();
  p.k_cache = pb.kf.data();
  p.v_cache = pb.vf.data();
  p.out = out.data();
  p.lse = lse.data();
  p.q_indptr = cq.data();
  p.kv_indptr = ckv.data();
  p.kv_slots = cslots.data();
  p.num_requests = n;
  p.num_slots = pb.num_slots;
  p.num_heads = pb.H;
  p.num_kv_heads = pb.KVH;
  p.head_dim = pb.D;
  p.scale = pb.scale;
  const absl::Status st = cpu::Attention(p);
  EXPECT_TRUE(st.ok()) << st;
  const int64_t row_elems = pb.H * pb.D;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = row_of[static_cast<size_t>(i)];
    std::copy(out.begin() + i * row_elems, out.begin() + (i + 1) * row_elems,
              ref.out.begin() + row * row_elems);
    std::copy(lse.begin() + i * pb.H, lse.begin() + (i + 1) * pb.H, ref.lse.begin() + row * pb.H);
  }
  return ref;
}

struct GpuResult {
  absl::Status status;
  std::vector<bf16> out;
  std::vector<float> lse;
  bool guards_ok = false;
};

int NumSms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

DecodePlan PlanFor(const Problem& pb) {
  const int64_t max_len = std::max<int64_t>(1, *std::max_element(pb.lens.begin(), pb.lens.end()));
  return PlanDecodeAttention(pb.R, pb.H, pb.KVH, pb.D, max_len, NumSms());
}

// A plan with `splits` splits and a workspace at least as large as any the launcher needs.
DecodePlan ForcedPlan(const Problem& pb, int splits) {
  DecodePlan plan;
  plan.num_splits = splits;
  plan.workspace_bytes = splits == 1 ? 0 : pb.R * pb.H * splits * (pb.D + 1) * 4 + 1024;
  return plan;
}

std::string Describe(const Problem& pb, const DecodePlan& plan) {
  std::string lens;
  for (size_t i = 0; i < pb.lens.size() && i < 6; ++i) lens += std::to_string(pb.lens[i]) + " ";
  if (pb.lens.size() > 6) lens += "...";
  return "H=" + std::to_string(pb.H) + " KVH=" + std::to_string(pb.KVH) + " D=" + std::to_string(pb.D) +
         " R=" + std::to_string(pb.R) + " lens=[" + lens + "] splits=" + std::to_string(plan.num_splits);
}

// Empty when a == b bit for bit; else how many elements of the (rows, heads, cols) arrays differ
// and where the first one is, e.g. "3 of 4096 elements differ, first at [row 2, head 1, d 17]:
// bits 0x3f80 vs 0x3f81".
template <typename T>
std::string BitDiff(const std::vector<T>& a, const std::vector<T>& b, int64_t heads, int64_t cols) {
  if (a.size() != b.size())
    return "sizes differ: " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  int64_t count = 0, first = -1;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++count;
    }
  }
  if (count == 0) return "";
  uint32_t ba = 0, bb = 0;
  std::memcpy(&ba, &a[static_cast<size_t>(first)], sizeof(T));
  std::memcpy(&bb, &b[static_cast<size_t>(first)], sizeof(T));
  char bits[64];
  std::snprintf(bits, sizeof(bits), "bits 0x%x vs 0x%x", static_cast<unsigned>(ba),
                static_cast<unsigned>(bb));
  std::string at =
      "row " + std::to_string(first / (heads * cols)) + ", head " + std::to_string(first / cols % heads);
  if (cols > 1) at += ", d " + std::to_string(first % cols);
  return std::to_string(count) + " of " + std::to_string(a.size()) + " elements differ, first at [" + at +
         "]: " + bits;
}

// Uploads the problem, runs DecodeAttention `repeats` times (in a CUDA graph when `graph`), and
// returns the last result; fails the test (naming the shape) if any run differs from the first in
// any bit.
GpuResult RunOnGpu(const Problem& pb, const DecodePlan& plan, int repeats = 3, bool graph = false) {
  const std::string shape = Describe(pb, plan) + (graph ? " (graph)" : "");
  SCOPED_TRACE(shape);
  GpuResult res;
  GuardedBuffer<bf16> q(pb.rows * pb.H * pb.D), k(static_cast<int64_t>(pb.k.size())),
      v(static_cast<int64_t>(pb.v.size()));
  GuardedBuffer<int32_t> q_indptr(pb.R + 1), kv_indptr(pb.R + 1),
      kv_slots(static_cast<int64_t>(pb.kv_slots.size()));
  GuardedBuffer<bf16> out(pb.rows * pb.H * pb.D);
  GuardedBuffer<float> lse(pb.rows * pb.H);
  GuardedBuffer<float> workspace((plan.workspace_bytes + 3) / 4);
  q.Upload(pb.q);
  k.Upload(pb.k);
  v.Upload(pb.v);
  q_indptr.Upload(pb.q_indptr);
  kv_indptr.Upload(pb.kv_indptr);
  kv_slots.Upload(pb.kv_slots);
  // The uploads (cudaMemcpy from pageable memory) and the sentinel fills (cudaMemset) run on the
  // legacy default stream; a pageable cudaMemcpy may return before its DMA has landed, and the
  // non-blocking stream below does not wait for the legacy stream. Without this the first launch
  // can read the tail of the last upload (kv_slots) still holding the sentinel.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  AttentionParams p;
  p.q = q.get();
  p.k_cache = k.get();
  p.v_cache = v.get();
  p.out = out.get();
  p.lse = lse.get();
  p.q_indptr = pb.pass_q_indptr ? q_indptr.get() : nullptr;
  p.kv_indptr = kv_indptr.get();
  p.kv_slots = kv_slots.get();
  p.num_requests = pb.R;
  p.num_slots = pb.num_slots;
  p.num_heads = pb.H;
  p.num_kv_heads = pb.KVH;
  p.head_dim = pb.D;
  p.scale = pb.scale;
  p.max_kv_len = std::max<int64_t>(1, *std::max_element(pb.lens.begin(), pb.lens.end()));
  p.max_q_len = 1;
  void* ws = plan.workspace_bytes > 0 ? workspace.get() : nullptr;

  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::vector<bf16> first_out;
  std::vector<float> first_lse;
  for (int rep = 0; rep < repeats; ++rep) {
    if (graph) {
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      res.status = DecodeAttention(p, plan, ws, stream);
      EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
      if (res.status.ok()) {
        EXPECT_EQ(cudaGraphInstantiate(&exec, g, 0), cudaSuccess);
        EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      }
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      if (exec) cudaGraphExecDestroy(exec);
      if (g) cudaGraphDestroy(g);
    } else {
      res.status = DecodeAttention(p, plan, ws, stream);
      EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    }
    if (!res.status.ok()) break;
    res.out = out.Download();
    res.lse = lse.Download();
    if (rep == 0) {
      first_out = res.out;
      first_lse = res.lse;
    } else {
      const std::string out_diff = BitDiff(first_out, res.out, pb.H, pb.D);
      const std::string lse_diff = BitDiff(first_lse, res.lse, pb.H, 1);
      EXPECT_TRUE(out_diff.empty()) << shape << ": out differs between identical runs (repeat " << rep
                                    << " vs 0): " << out_diff;
      EXPECT_TRUE(lse_diff.empty()) << shape << ": lse differs between identical runs (repeat " << rep
                                    << " vs 0): " << lse_diff;
    }
  }
  cudaStreamDestroy(stream);
  res.guards_ok = out.GuardsIntact() && lse.GuardsIntact() && workspace.GuardsIntact();
  return res;
}

void ExpectMatches(const Problem& pb, const Reference& ref, const GpuResult& got, const std::string& what) {
  ASSERT_TRUE(got.status.ok()) << what << ": " << got.status;
  EXPECT_TRUE(got.guards_ok) << what << ": a guard region around out, lse or the workspace was overwritten";
  ASSERT_EQ(got.out.size(), ref.out.size());
  ASSERT_EQ(got.lse.size(), ref.lse.size());
  int reported = 0;
  int64_t bad = 0;
  double worst = 0.0;
  for (int64_t row = 0; row < pb.rows; ++row) {
    for (int64_t h = 0; h < pb.H; ++h) {
      for (int64_t d = 0; d < pb.D; ++d) {
        const size_t i = static_cast<size_t>((row * pb.H + h) * pb.D + d);
        const float g = ToFloat(got.out[i]), r = ref.out[i];
        const double err = std::fabs(static_cast<double>(g) - r);
        const double tol = std::ldexp(1.0, -7) * std::fabs(r) + 1e-4 * pb.vmax;
        worst = std::max(worst, std::isnan(err) ? 1e30 : err / tol);
        if (std::isnan(g) || !(err <= tol)) {
          ++bad;
          if (reported++ < 5) {
            ADD_FAILURE() << what << ": out[row " << row << ", head " << h << ", d " << d << "] = " << g
                          << ", reference " << r << " (tolerance " << tol << ")";
          }
        }
      }
      const size_t j = static_cast<size_t>(row * pb.H + h);
      const float gl = got.lse[j], rl = ref.lse[j];
      const bool both_empty = gl == kNegInf && rl == kNegInf;
      if (!both_empty && !(std::fabs(gl - rl) <= 1e-3f)) {
        ++bad;
        if (reported++ < 10) {
          ADD_FAILURE() << what << ": lse[row " << row << ", head " << h << "] = " << gl << ", reference "
                        << rl;
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " mismatches; worst error / tolerance " << worst;
}

// Runs `pb` with the plan's split count and with the given forced ones; each must match the
// reference (and repeat bit-exactly).
void CheckProblem(const Problem& pb, std::vector<int> forced_splits = {1}) {
  const Reference ref = CpuReference(pb);
  const DecodePlan plan = PlanFor(pb);
  ExpectMatches(pb, ref, RunOnGpu(pb, plan), "planned " + Describe(pb, plan));
  for (int s : forced_splits) {
    if (s == plan.num_splits) continue;
    const DecodePlan forced = ForcedPlan(pb, s);
    ExpectMatches(pb, ref, RunOnGpu(pb, forced), "forced " + Describe(pb, forced));
  }
}

std::vector<int32_t> RandomLens(uint32_t seed, int n, int lo, int hi) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(lo, hi);
  std::vector<int32_t> lens(static_cast<size_t>(n));
  for (auto& l : lens) l = u(rng);
  return lens;
}

struct Heads {
  int64_t h, kvh;
};

TEST(CudaDecodeAttention, PlanChoosesSplits) {
  // Host-only: no device memory is touched.
  const DecodePlan big = PlanDecodeAttention(512, 32, 32, 128, 4096, 132);
  EXPECT_EQ(big.num_splits, 1);
  EXPECT_EQ(big.workspace_bytes, 0);
  const DecodePlan one = PlanDecodeAttention(1, 32, 8, 128, 32768, 132);
  EXPECT_GT(one.num_splits, 16);
  EXPECT_LE(one.num_splits, 32768 / 256);
  EXPECT_GE(one.workspace_bytes, int64_t{1} * 32 * one.num_splits * (128 + 1) * 4);
  const DecodePlan short_ctx = PlanDecodeAttention(1, 32, 8, 128, 300, 132);
  EXPECT_EQ(short_ctx.num_splits, 2);  // chunks of at least 256 keys
  const DecodePlan tiny = PlanDecodeAttention(1, 4, 4, 64, 1, 132);
  EXPECT_EQ(tiny.num_splits, 1);
  const DecodePlan bad = PlanDecodeAttention(1, 6, 4, 128, 1000, 132);
  EXPECT_EQ(bad.num_splits, 1);
  EXPECT_EQ(bad.workspace_bytes, 0);
}

TEST(CudaDecodeAttention, RejectsInvalidParams) {
  // Host-only: validation fails before any device access (the pointers are never dereferenced).
  alignas(16) static bf16 dummy_bf16[256];
  alignas(16) static int32_t dummy_i32[4];
  alignas(16) static float dummy_f32[4096];
  AttentionParams good;
  good.q = dummy_bf16;
  good.k_cache = dummy_bf16;
  good.v_cache = dummy_bf16;
  good.out = dummy_bf16;
  good.lse = dummy_f32;
  good.kv_indptr = dummy_i32;
  good.kv_slots = dummy_i32;
  good.num_requests = 2;
  good.num_slots = 8;
  good.num_heads = 8;
  good.num_kv_heads = 2;
  good.head_dim = 128;
  good.scale = 0.1f;
  good.max_kv_len = 4;
  good.max_q_len = 1;

  struct Case {
    std::string field;
    AttentionParams p;
    DecodePlan plan;
    void* ws;
  };
  std::vector<Case> cases;
  auto add = [&](const std::string& field, auto mutate, DecodePlan plan = DecodePlan{}, void* ws = nullptr) {
    AttentionParams p = good;
    mutate(p);
    cases.push_back({field, p, plan, ws});
  };
  add("q", [](AttentionParams& p) { p.q = nullptr; });
  add("k_cache", [](AttentionParams& p) { p.k_cache = nullptr; });
  add("v_cache", [](AttentionParams& p) { p.v_cache = nullptr; });
  add("out", [](AttentionParams& p) { p.out = nullptr; });
  add("kv_indptr", [](AttentionParams& p) { p.kv_indptr = nullptr; });
  add("kv_slots", [](AttentionParams& p) { p.kv_slots = nullptr; });
  add("num_requests", [](AttentionParams& p) { p.num_requests = 0; });
  add("num_slots", [](AttentionParams& p) { p.num_slots = -1; });
  add("num_heads", [](AttentionParams& p) { p.num_heads = 0; });
  add("num_kv_heads", [](AttentionParams& p) { p.num_kv_heads = 0; });
  add("head_dim", [](AttentionParams& p) { p.head_dim = 96; });
  add("head_dim", [](AttentionParams& p) { p.head_dim = 0; });
  add("num_kv_heads", [](AttentionParams& p) { p.num_kv_heads = 3; });
  add("scale", [](AttentionParams& p) { p.scale = 0.0f; });
  add("scale", [](AttentionParams& p) { p.scale = std::numeric_limits<float>::quiet_NaN(); });
  add("max_kv_len", [](AttentionParams& p) { p.max_kv_len = 0; });
  add("max_q_len", [](AttentionParams& p) { p.max_q_len = 2; });
  add("16-byte aligned", [](AttentionParams& p) { p.k_cache = dummy_bf16 + 1; });
  DecodePlan zero_splits;
  zero_splits.num_splits = 0;
  add(
      "num_splits", [](AttentionParams&) {}, zero_splits);
  DecodePlan four;
  four.num_splits = 4;
  four.workspace_bytes = 1 << 20;
  add(
      "workspace", [](AttentionParams&) {}, four, nullptr);
  DecodePlan small = four;
  small.workspace_bytes = 64;
  add(
      "workspace too small", [](AttentionParams&) {}, small, dummy_f32);

  for (const Case& c : cases) {
    const absl::Status st = DecodeAttention(c.p, c.plan, c.ws, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.field << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr(c.field));
  }
}

TEST(CudaDecodeAttention, MatchesCpuAcrossShapes) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Heads heads[] = {{4, 4}, {32, 8}, {8, 2}, {8, 1}};
  uint32_t seed = 1;
  for (const Heads& hd : heads) {
    for (int64_t d : {64, 128}) {
      const std::vector<std::vector<int32_t>> patterns = {
          {1},
          {97},
          std::vector<int32_t>(17, 97),
          RandomLens(seed + 100, 17, 1, 1000),
          std::vector<int32_t>(64, 1000),
          RandomLens(seed + 200, 64, 1, 1000),
      };
      for (const auto& lens : patterns) {
        CheckProblem(MakeProblem(seed++, hd.h, hd.kvh, d, lens), {1, 3});
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaDecodeAttention, OtherGroupSizes) {
  TANDEM_SKIP_WITHOUT_GPU();
  // Group 2 (kernel for 2 heads), 3 (4-head kernel with a padding head), 16 (two chunks of 8),
  // 12 (two chunks of 6 in the 8-head kernel).
  const Heads heads[] = {{4, 2}, {6, 2}, {16, 1}, {24, 2}};
  uint32_t seed = 300;
  for (const Heads& hd : heads) {
    for (int64_t d : {64, 128}) {
      CheckProblem(MakeProblem(seed, hd.h, hd.kvh, d, RandomLens(seed + 1000, 9, 1, 700)), {1, 2});
      ++seed;
      if (HasFatalFailure()) return;
    }
  }
}

TEST(CudaDecodeAttention, LongContextManySplits) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Heads heads[] = {{4, 4}, {32, 8}, {8, 2}, {8, 1}};
  uint32_t seed = 400;
  for (const Heads& hd : heads) {
    for (int64_t d : {64, 128}) {
      for (const std::vector<int32_t>& lens :
           {std::vector<int32_t>{4096}, std::vector<int32_t>{4096, 1, 2500}}) {
        const Problem pb = MakeProblem(seed++, hd.h, hd.kvh, d, lens);
        EXPECT_GT(PlanFor(pb).num_splits, 4) << Describe(pb, PlanFor(pb));
        CheckProblem(pb, {1, 5});
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(CudaDecodeAttention, AnySplitCountGivesTheSameAnswer) {
  TANDEM_SKIP_WITHOUT_GPU();
  // Includes split counts that leave splits empty (64 splits for at most 1000 keys).
  const Problem pb = MakeProblem(500, 32, 8, 128, {1000, 33, 1, 257, 640});
  CheckProblem(pb, {1, 2, 3, 7, 64});
}

TEST(CudaDecodeAttention, RisingScoresRescaleAcrossTiles) {
  TANDEM_SKIP_WITHOUT_GPU();
  // Scores grow along the context (and are sharp), so the running max changes in nearly every
  // tile and the accumulators are rescaled many times.
  ProblemOptions opt;
  opt.scale = 0.5f;
  opt.q_amp = 1.0f;
  opt.trend = 24.0f;
  for (int64_t d : {64, 128}) {
    CheckProblem(MakeProblem(600 + static_cast<uint32_t>(d), 8, 2, d, {3000, 100, 4096}, opt), {1, 4});
  }
}

TEST(CudaDecodeAttention, RequestWithoutKeysGivesZeroAndMinusInf) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Problem pb = MakeProblem(700, 8, 2, 128, {50, 0, 300, 0});
  const Reference ref = CpuReference(pb);
  for (int splits : {1, 4}) {
    const DecodePlan plan = ForcedPlan(pb, splits);
    const GpuResult got = RunOnGpu(pb, plan);
    ExpectMatches(pb, ref, got, Describe(pb, plan));
    for (int64_t r : {1, 3}) {
      for (int64_t h = 0; h < pb.H; ++h) {
        EXPECT_EQ(got.lse[static_cast<size_t>(r * pb.H + h)], kNegInf) << "request " << r << " head " << h;
        for (int64_t d = 0; d < pb.D; ++d) {
          EXPECT_EQ(ToFloat(got.out[static_cast<size_t>((r * pb.H + h) * pb.D + d)]), 0.0f);
        }
      }
    }
  }
}

TEST(CudaDecodeAttention, QIndptrSelectsRows) {
  TANDEM_SKIP_WITHOUT_GPU();
  // Request 1 has no query row: rows are 0, (none), 1, 2; nothing may be written for it.
  ProblemOptions opt;
  opt.pass_q_indptr = true;
  opt.q_lens = {1, 0, 1, 1};
  const Problem pb = MakeProblem(800, 32, 8, 64, {40, 70, 1300, 1}, opt);
  ASSERT_EQ(pb.rows, 3);
  CheckProblem(pb, {1, 3});
}

TEST(CudaDecodeAttention, CapturesInCudaGraph) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Problem pb = MakeProblem(900, 32, 8, 128, {2048, 77, 1});
  const Reference ref = CpuReference(pb);
  const DecodePlan plan = PlanFor(pb);
  ASSERT_GT(plan.num_splits, 1);
  const GpuResult direct = RunOnGpu(pb, plan, 3, /*graph=*/false);
  const GpuResult graphed = RunOnGpu(pb, plan, 3, /*graph=*/true);
  ExpectMatches(pb, ref, graphed, "graph " + Describe(pb, plan));
  ASSERT_EQ(direct.out.size(), graphed.out.size());
  const std::string out_diff = BitDiff(direct.out, graphed.out, pb.H, pb.D);
  const std::string lse_diff = BitDiff(direct.lse, graphed.lse, pb.H, 1);
  EXPECT_TRUE(out_diff.empty()) << Describe(pb, plan)
                                << ": out differs between direct and graph launch: " << out_diff;
  EXPECT_TRUE(lse_diff.empty()) << Describe(pb, plan)
                                << ": lse differs between direct and graph launch: " << lse_diff;
}

}  // namespace
}  // namespace tandem::kernels::cuda
