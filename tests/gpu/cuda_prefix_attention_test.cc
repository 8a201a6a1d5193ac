// Shared-prefix ("cascade") attention on CUDA against the CPU references, on the exact fp32 values
// of random bf16 inputs:
//   * PrefillAttention with causal == false against cpu::PrefixAttention (out and lse), several
//     prefix groups of ragged rows and prefix lengths in one call, q_len > kv_len included;
//   * MergeStates against cpu::MergeAttentionStates, gathered rows, empty (-inf), NaN and ±80 lse;
//   * GatherRows against a host gather;
//   * the whole cascade (GatherRows, non-causal PrefillAttention over the prefixes, DecodeAttention
//     and causal PrefillAttention over the suffixes, MergeStates) against cpu::Attention over
//     every request's whole context;
//   * causal PrefillAttention against cpu::Attention (a regression check of the default path).
//
// Inputs: q, k in [-2, 2) and v in [-1, 1) (as in cuda_prefill_attention_test: scores of std ≈ 1.3
// after scaling). Slot tables are shuffled over a cache whose unused slots hold NaN (a wrong
// gather turns the output NaN). Outputs are prefilled with NaN (an unwritten row fails) inside
// guard regions (a write out of bounds fails).
//
// Tolerances (bf16 storage, fp32 math):
//   attention out: max|gpu - ref| / max|ref| <= 1e-2 per case (P rounded to bf16 before P·V, out
//     rounded to bf16; the cascade adds the bf16 rounding of the two partial states before the
//     merge, each <= 2^-9 relative). Observed errors are a few 1e-3.
//   attention lse: |gpu - ref| <= 2e-3 absolute (fp32 scores and sums; ex2.approx).
//   MergeStates: per element |gpu - ref| <= 2^-8·|ref| + 1e-5 (fp32 math, one bf16 rounding at the
//     end); lse |gpu - ref| <= 1e-4 (expf/logf against glibc, O(80) values); exact bits where the
//     contract says "copied exactly" (one side empty).
//   GatherRows: exact bits.
// MergeStatesAndGatherRowsRejectInvalidParams touches no device memory and runs without a GPU;
// every other test skips there, with the reason.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::BitsOf;
using ::tandem::testing_gpu::FromBits;
using ::tandem::testing_gpu::GuardedBuffer;
using ::tandem::testing_gpu::RandomBf16;
using ::tandem::testing_gpu::ToBf16;
using ::tandem::testing_gpu::ToFloat;

constexpr double kOutTol = 1e-2;  // normalized: max|err| / max|ref|
constexpr double kLseTol = 2e-3;  // absolute
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
const bf16 kNaNBf16 = FromBits(0x7FC0);

struct Layout {
  const char* name;
  int64_t heads, kv_heads, head_dim;
};

const Layout kLayouts[] = {{"Mha4x4D64", 4, 4, 64},   {"Mha4x4D128", 4, 4, 128}, {"Gqa8x2D64", 8, 2, 64},
                           {"Gqa8x2D128", 8, 2, 128}, {"Gqa32x8D64", 32, 8, 64}, {"Gqa32x8D128", 32, 8, 128},
                           {"Mqa8x1D64", 8, 1, 64},   {"Mqa8x1D128", 8, 1, 128}};

std::string LayoutName(const Layout& l) {
  std::ostringstream os;
  os << "heads " << l.heads << "/" << l.kv_heads << " d" << l.head_dim;
  return os.str();
}

int NumSms() {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  return sms;
}

// A guarded device copy of `host` (at least one element, so that empty inputs get a pointer).
template <typename T>
std::unique_ptr<GuardedBuffer<T>> Device(const std::vector<T>& host) {
  auto buf = std::make_unique<GuardedBuffer<T>>(std::max<int64_t>(1, static_cast<int64_t>(host.size())));
  if (!host.empty()) buf->Upload(host);
  return buf;
}

// A guarded device buffer of n elements filled with `fill`.
template <typename T>
std::unique_ptr<GuardedBuffer<T>> Filled(int64_t n, T fill) {
  return Device(std::vector<T>(static_cast<size_t>(std::max<int64_t>(1, n)), fill));
}

std::vector<float> ToFloats(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = ToFloat(v[i]);
  return f;
}

// A KV cache of `used + unused` slots: random K/V everywhere except the unused slots, which hold
// NaN. Slots are handed out by Take() in a shuffled order, so that no context is contiguous.
class KvPool {
 public:
  KvPool(std::mt19937& rng, int64_t used, int64_t unused, int64_t kv_heads, int64_t head_dim)
      : num_slots_(used + unused), row_(kv_heads * head_dim) {
    order_.resize(static_cast<size_t>(num_slots_));
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng);
    RandomBf16(rng, num_slots_ * row_, -2.0f, 2.0f, &k_, &k_f_);
    RandomBf16(rng, num_slots_ * row_, -1.0f, 1.0f, &v_, &v_f_);
    for (int64_t i = used; i < num_slots_; ++i) {  // the tail of the order is never handed out
      const int64_t s = order_[static_cast<size_t>(i)];
      for (int64_t e = s * row_; e < (s + 1) * row_; ++e) {
        k_[static_cast<size_t>(e)] = v_[static_cast<size_t>(e)] = kNaNBf16;
        k_f_[static_cast<size_t>(e)] = v_f_[static_cast<size_t>(e)] = kNaN;
      }
    }
    used_ = used;
  }

  // The next n slots of the shuffled order.
  std::vector<int32_t> Take(int64_t n) {
    EXPECT_LE(next_ + n, used_) << "pool too small";
    std::vector<int32_t> s(order_.begin() + next_, order_.begin() + next_ + n);
    next_ += n;
    return s;
  }

  void Upload() {
    k_dev_ = Device(k_);
    v_dev_ = Device(v_);
  }
  const bf16* k() const { return k_dev_->get(); }
  const bf16* v() const { return v_dev_->get(); }
  const float* k_f() const { return k_f_.data(); }
  const float* v_f() const { return v_f_.data(); }
  int64_t num_slots() const { return num_slots_; }

 private:
  int64_t num_slots_, row_, used_ = 0, next_ = 0;
  std::vector<int32_t> order_;
  std::vector<bf16> k_, v_;
  std::vector<float> k_f_, v_f_;
  std::unique_ptr<GuardedBuffer<bf16>> k_dev_, v_dev_;
};

// The largest step between neighbours of an indptr (0 for fewer than two entries).
int64_t MaxStep(const std::vector<int32_t>& indptr) {
  int64_t m = 0;
  for (size_t i = 1; i < indptr.size(); ++i) m = std::max<int64_t>(m, indptr[i] - indptr[i - 1]);
  return m;
}

// The request tables of one attention call on the device: request r has the query rows
// q_indptr[r] .. q_indptr[r + 1] - 1 and the keys in slots kv_slots[kv_indptr[r] ..
// kv_indptr[r + 1] - 1]. An empty q_indptr is left null on the device: request r is query row r
// alone (decode). The bounds the kernels plan by are taken from the tables (at least 1).
struct DeviceTables {
  DeviceTables(const std::vector<int32_t>& q_indptr, const std::vector<int32_t>& kv_indptr,
               const std::vector<int32_t>& kv_slots)
      : q_indptr_d(q_indptr.empty() ? nullptr : Device(q_indptr)),
        kv_indptr_d(Device(kv_indptr)),
        kv_slots_d(Device(kv_slots)),
        num_requests(static_cast<int64_t>(kv_indptr.size()) - 1),
        max_q_len(std::max<int64_t>(1, MaxStep(q_indptr))),
        max_kv_len(std::max<int64_t>(1, MaxStep(kv_indptr))) {}

  std::unique_ptr<GuardedBuffer<int32_t>> q_indptr_d, kv_indptr_d, kv_slots_d;
  int64_t num_requests, max_q_len, max_kv_len;
};

// One attention call: the requests of `tables` over the K/V cache of `pool` in layout l, scaled by
// 1/sqrt(head_dim); query rows read from q, results written to out and lse (device pointers).
AttentionParams PoolAttention(const KvPool& pool, const Layout& l, const DeviceTables& tables, const bf16* q,
                              bf16* out, float* lse, bool causal) {
  return {.q = q,
          .k_cache = pool.k(),
          .v_cache = pool.v(),
          .out = out,
          .lse = lse,
          .q_indptr = tables.q_indptr_d ? tables.q_indptr_d->get() : nullptr,
          .kv_indptr = tables.kv_indptr_d->get(),
          .kv_slots = tables.kv_slots_d->get(),
          .num_requests = tables.num_requests,
          .num_slots = pool.num_slots(),
          .num_heads = l.heads,
          .num_kv_heads = l.kv_heads,
          .head_dim = l.head_dim,
          .scale = 1.0f / std::sqrt(static_cast<float>(l.head_dim)),
          .max_kv_len = tables.max_kv_len,
          .max_q_len = tables.max_q_len,
          .causal = causal};
}

// Merges n pairs of rows, each of `heads` heads of head_dim: row rows_b[i] of state b (out_b,
// lse_b) into row rows_a[i] of state a (out, lse), in place (null rows: row i). Device pointers.
MergeStatesParams MergeParams(bf16* out, float* lse, const int32_t* rows_a, const bf16* out_b,
                              const float* lse_b, const int32_t* rows_b, int64_t n, int64_t heads,
                              int64_t head_dim) {
  return {.out = out,
          .lse = lse,
          .out_b = out_b,
          .lse_b = lse_b,
          .rows_a = rows_a,
          .rows_b = rows_b,
          .n = n,
          .num_heads = heads,
          .head_dim = head_dim};
}

// max|gpu - ref| / max|ref| over `out` and max|gpu - ref| over lse (an lse of -inf must match
// exactly); any NaN in the GPU results fails. `what` names the case.
void ExpectClose(const std::string& what, const std::vector<float>& ref_out,
                 const std::vector<float>& ref_lse, const std::vector<float>& out,
                 const std::vector<float>& lse, int64_t heads, int64_t head_dim) {
  ASSERT_EQ(ref_out.size(), out.size());
  ASSERT_EQ(ref_lse.size(), lse.size());
  double max_ref = 0.0, max_err = 0.0, max_lse_err = 0.0;
  int64_t worst = -1, worst_lse = -1, nan_out = 0, nan_lse = 0, inf_mismatch = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double r = ref_out[i], g = out[i];
    if (std::isnan(g) || std::isnan(r)) {
      ++nan_out;
      continue;
    }
    max_ref = std::max(max_ref, std::fabs(r));
    if (std::fabs(g - r) > max_err) {
      max_err = std::fabs(g - r);
      worst = static_cast<int64_t>(i);
    }
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    const double r = ref_lse[i], g = lse[i];
    if (std::isnan(g) || std::isnan(r)) {
      ++nan_lse;
      continue;
    }
    if (std::isinf(r) || std::isinf(g)) {
      if (r != g) ++inf_mismatch;
      continue;
    }
    if (std::fabs(g - r) > max_lse_err) {
      max_lse_err = std::fabs(g - r);
      worst_lse = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(nan_out, 0) << what << ": NaN in out";
  EXPECT_EQ(nan_lse, 0) << what << ": NaN in lse";
  EXPECT_EQ(inf_mismatch, 0) << what << ": infinite lse where the reference differs";
  const double rel = max_ref > 0.0 ? max_err / max_ref : max_err;
  EXPECT_LE(rel, kOutTol) << what << ": max|err| " << max_err << " / max|ref| " << max_ref << " at row "
                          << worst / (heads * head_dim) << " head " << worst / head_dim % heads << " dim "
                          << worst % head_dim;
  EXPECT_LE(max_lse_err, kLseTol) << what << ": lse error at row " << worst_lse / heads << " head "
                                  << worst_lse % heads;
}

// ExpectClose on the leading rows of the device results out_d and lse_d (as many as the reference
// has).
void ExpectDeviceClose(const std::string& what, const std::vector<float>& ref_out,
                       const std::vector<float>& ref_lse, GuardedBuffer<bf16>& out_d,
                       GuardedBuffer<float>& lse_d, int64_t heads, int64_t head_dim) {
  std::vector<float> out = ToFloats(out_d.Download());
  std::vector<float> lse = lse_d.Download();
  out.resize(ref_out.size());
  lse.resize(ref_lse.size());
  ExpectClose(what, ref_out, ref_lse, out, lse, heads, head_dim);
}

// ---- (a) non-causal PrefillAttention against cpu::PrefixAttention ----------------------------

struct Group {
  int rows;
  int prefix_len;
};

// One PrefillAttention call (causal == false) over `groups` as requests; each group's result is
// compared with cpu::PrefixAttention over its rows and prefix.
void CheckPrefixGroups(const Layout& l, const std::vector<Group>& groups, uint32_t seed) {
  std::ostringstream desc;
  desc << LayoutName(l) << " groups [";
  for (size_t i = 0; i < groups.size(); ++i)
    desc << (i ? " " : "") << groups[i].rows << "x" << groups[i].prefix_len;
  desc << "] (rows x prefix) seed " << seed;
  SCOPED_TRACE(desc.str());
  const int64_t H = l.heads, KVH = l.kv_heads, D = l.head_dim;
  std::mt19937 rng(seed);
  std::vector<int32_t> q_indptr = {0}, kv_indptr = {0};
  for (const Group& g : groups) {
    q_indptr.push_back(q_indptr.back() + g.rows);
    kv_indptr.push_back(kv_indptr.back() + g.prefix_len);
  }
  const int64_t total_q = q_indptr.back(), total_kv = kv_indptr.back();
  KvPool pool(rng, total_kv, 97, KVH, D);
  const std::vector<int32_t> kv_slots = pool.Take(total_kv);
  std::vector<bf16> q;
  std::vector<float> q_f;
  RandomBf16(rng, total_q * H * D, -2.0f, 2.0f, &q, &q_f);

  // Reference, group by group.
  std::vector<float> ref_out(static_cast<size_t>(total_q * H * D), kNaN);
  std::vector<float> ref_lse(static_cast<size_t>(total_q * H), kNaN);
  for (size_t g = 0; g < groups.size(); ++g) {
    cpu::PrefixAttentionParams p;
    p.q = q_f.data() + q_indptr[g] * H * D;
    p.k_cache = pool.k_f();
    p.v_cache = pool.v_f();
    p.prefix_slots = kv_slots.data() + kv_indptr[g];
    p.out = ref_out.data() + q_indptr[g] * H * D;
    p.lse = ref_lse.data() + q_indptr[g] * H;
    p.rows = groups[g].rows;
    p.prefix_len = groups[g].prefix_len;
    p.num_slots = pool.num_slots();
    p.num_heads = H;
    p.num_kv_heads = KVH;
    p.head_dim = D;
    p.scale = 1.0f / std::sqrt(static_cast<float>(D));
    const absl::Status st = cpu::PrefixAttention(p);
    ASSERT_TRUE(st.ok()) << st;
  }

  pool.Upload();
  auto q_d = Device(q);
  const DeviceTables tables(q_indptr, kv_indptr, kv_slots);
  auto out_d = Filled<bf16>(total_q * H * D, kNaNBf16);
  auto lse_d = Filled<float>(total_q * H, kNaN);
  const absl::Status st = PrefillAttention(
      PoolAttention(pool, l, tables, q_d->get(), out_d->get(), lse_d->get(), /*causal=*/false), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(out_d->GuardsIntact()) << "write outside out";
  ASSERT_TRUE(lse_d->GuardsIntact()) << "write outside lse";
  ExpectDeviceClose(desc.str(), ref_out, ref_lse, *out_d, *lse_d, H, D);
}

class PrefixLayoutTest : public ::testing::TestWithParam<Layout> {};

TEST_P(PrefixLayoutTest, NonCausalPrefillMatchesPrefixAttention) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Layout l = GetParam();
  const uint32_t base = static_cast<uint32_t>(l.heads * 1000 + l.kv_heads * 10 + l.head_dim);
  // Rows 1..300 over prefixes 1..1000 (q_len > kv_len in most pairs); max_q_len 300: 128-row tiles.
  CheckPrefixGroups(l,
                    {{1, 1000},
                     {7, 5},
                     {64, 63},
                     {300, 5},
                     {300, 1000},
                     {64, 64},
                     {7, 1},
                     {1, 5},
                     {300, 64},
                     {64, 1000},
                     {7, 63},
                     {1, 1}},
                    base + 1);
  // Every group <= 64 rows: the 64-row tile kernel.
  CheckPrefixGroups(l, {{1, 1000}, {7, 5}, {64, 63}, {64, 64}, {33, 1}, {7, 1000}, {1, 64}}, base + 2);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PrefixLayoutTest, ::testing::ValuesIn(kLayouts),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(info.param.name);
                         });

// A prefix of length 0 is the empty state (out = 0, lse = -inf), as cpu::PrefixAttention.
TEST(CudaPrefixAttention, NonCausalEmptyPrefixGivesTheEmptyState) {
  TANDEM_SKIP_WITHOUT_GPU();
  CheckPrefixGroups(Layout{"Gqa8x2D128", 8, 2, 128}, {{5, 0}, {3, 17}, {70, 0}, {2, 200}}, 4242);
  CheckPrefixGroups(Layout{"Mha4x4D64", 4, 4, 64}, {{5, 0}, {3, 17}}, 4243);
}

// A single row sees every key either way: the non-causal kernel must give the causal kernel's
// bits for it (same tiles, same order; only the mask rule differs, and agrees for that row).
TEST(CudaPrefixAttention, SingleRowNonCausalIsBitIdenticalToCausal) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const Layout& l : {Layout{"Gqa8x2D128", 8, 2, 128}, Layout{"Mqa8x1D64", 8, 1, 64}}) {
    SCOPED_TRACE(LayoutName(l));
    const int64_t H = l.heads, KVH = l.kv_heads, D = l.head_dim;
    std::mt19937 rng(static_cast<uint32_t>(H + D));
    const std::vector<int32_t> lens = {1000, 5, 64, 1, 65, 127};
    std::vector<int32_t> q_indptr = {0}, kv_indptr = {0};
    for (int32_t len : lens) {
      q_indptr.push_back(q_indptr.back() + 1);
      kv_indptr.push_back(kv_indptr.back() + len);
    }
    const int64_t R = static_cast<int64_t>(lens.size()), total_kv = kv_indptr.back();
    KvPool pool(rng, total_kv, 10, KVH, D);
    const std::vector<int32_t> slots = pool.Take(total_kv);
    std::vector<bf16> q;
    std::vector<float> q_f;
    RandomBf16(rng, R * H * D, -2.0f, 2.0f, &q, &q_f);
    pool.Upload();
    auto q_d = Device(q);
    const DeviceTables tables(q_indptr, kv_indptr, slots);  // max_q_len 1, max_kv_len 1000
    std::vector<float> outs[2], lses[2];
    for (int causal = 0; causal < 2; ++causal) {
      auto out_d = Filled<bf16>(R * H * D, kNaNBf16);
      auto lse_d = Filled<float>(R * H, kNaN);
      const absl::Status st = PrefillAttention(
          PoolAttention(pool, l, tables, q_d->get(), out_d->get(), lse_d->get(), causal == 1), nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      outs[causal] = ToFloats(out_d->Download());
      lses[causal] = lse_d->Download();
    }
    ASSERT_EQ(outs[0].size(), outs[1].size());
    EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(lses[0].data(), lses[1].data(), lses[0].size() * sizeof(float)), 0);
    for (float x : outs[0]) ASSERT_FALSE(std::isnan(x));
  }
}

// ---- (b) MergeStates against cpu::MergeAttentionStates ----------------------------------------

struct MergeCase {
  int64_t heads = 8, head_dim = 128;
  int64_t rows_a = 50, rows_b = 20, n = 30;  // states a and b, pairs merged
  bool identity = false;                     // rows_a = rows_b = null (then n = rows_a = rows_b)
  bool misalign = false;                     // out and out_b 2 bytes off 16-byte alignment
  uint32_t seed = 1;
};

void CheckMerge(const MergeCase& c) {
  std::ostringstream desc;
  desc << "heads " << c.heads << " d" << c.head_dim << " a " << c.rows_a << " b " << c.rows_b << " n " << c.n
       << (c.identity ? " identity" : "") << (c.misalign ? " misaligned" : "") << " seed " << c.seed;
  SCOPED_TRACE(desc.str());
  const int64_t H = c.heads, D = c.head_dim;
  std::mt19937 rng(c.seed);
  std::vector<bf16> a, b;
  std::vector<float> a_f, b_f, unused;
  RandomBf16(rng, c.rows_a * H * D, -1.0f, 1.0f, &a, &a_f);
  RandomBf16(rng, c.rows_b * H * D, -1.0f, 1.0f, &b, &b_f);
  std::vector<float> lse_a(static_cast<size_t>(c.rows_a * H)), lse_b(static_cast<size_t>(c.rows_b * H));
  std::uniform_real_distribution<float> ul(-5.0f, 5.0f);
  for (float& x : lse_a) x = ul(rng);
  for (float& x : lse_b) x = ul(rng);

  std::vector<int32_t> rows_a(static_cast<size_t>(c.n)), rows_b(static_cast<size_t>(c.n));
  if (c.identity) {
    std::iota(rows_a.begin(), rows_a.end(), 0);
    std::iota(rows_b.begin(), rows_b.end(), 0);
  } else {
    std::vector<int32_t> perm(static_cast<size_t>(c.rows_a));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    std::copy_n(perm.begin(), c.n, rows_a.begin());  // distinct
    std::uniform_int_distribution<int32_t> ub(0, static_cast<int32_t>(c.rows_b - 1));
    for (int32_t& r : rows_b) r = ub(rng);  // repeats: one group state serves many rows
  }
  // Special states per merged (pair, head). An empty side's out is set to NaN: it must not be read.
  auto set_row = [&](std::vector<bf16>& v, std::vector<float>& vf, int64_t hrow, float x) {
    for (int64_t d = 0; d < D; ++d) {
      v[static_cast<size_t>(hrow * D + d)] = ToBf16(x);
      vf[static_cast<size_t>(hrow * D + d)] = ToFloat(ToBf16(x));
    }
  };
  std::uniform_int_distribution<int> kind(0, 9);
  for (int64_t i = 0; i < c.n; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t ha = rows_a[static_cast<size_t>(i)] * H + h, hb = rows_b[static_cast<size_t>(i)] * H + h;
      float& la = lse_a[static_cast<size_t>(ha)];
      float& lb = lse_b[static_cast<size_t>(hb)];
      switch (kind(rng)) {
        case 0:  // a empty
          la = kNegInf;
          set_row(a, a_f, ha, kNaN);
          break;
        case 1:  // b empty (every pair sharing this b row sees it empty too)
          lb = kNegInf;
          set_row(b, b_f, hb, kNaN);
          break;
        case 2:  // both empty
          la = kNegInf;
          lb = kNegInf;
          set_row(a, a_f, ha, kNaN);
          set_row(b, b_f, hb, kNaN);
          break;
        case 3:
          la = 80.0f;
          if (lb != kNegInf) lb = -80.0f;
          break;
        case 4:
          la = -80.0f;
          if (lb != kNegInf) lb = 80.0f;
          break;
        case 5:
          la = 80.0f;
          if (lb != kNegInf) lb = 79.5f;
          break;
        case 6:
          if (i % 7 == 3) la = kNaN;  // a few NaN: propagates
          break;
        default:
          break;
      }
    }
  }

  // Reference: state a gathered at rows_a, merged with b at rows_b.
  std::vector<float> ga(static_cast<size_t>(c.n * H * D)), gla(static_cast<size_t>(c.n * H));
  for (int64_t i = 0; i < c.n; ++i) {
    const int64_t r = rows_a[static_cast<size_t>(i)];
    std::copy_n(a_f.begin() + r * H * D, H * D, ga.begin() + i * H * D);
    std::copy_n(lse_a.begin() + r * H, H, gla.begin() + i * H);
  }
  std::vector<float> ref_out(ga.size()), ref_lse(gla.size());
  cpu::MergeAttentionStatesParams mp;
  mp.out_a = ga.data();
  mp.lse_a = gla.data();
  mp.out_b = b_f.data();
  mp.lse_b = lse_b.data();
  mp.rows_b = rows_b.data();
  mp.out = ref_out.data();
  mp.lse = ref_lse.data();
  mp.rows = c.n;
  mp.num_rows_b = c.rows_b;
  mp.num_heads = H;
  mp.head_dim = D;
  ASSERT_TRUE(cpu::MergeAttentionStates(mp).ok());

  const int64_t off = c.misalign ? 1 : 0;
  std::vector<bf16> a_host(static_cast<size_t>(off), FromBits(0)),
      b_host(static_cast<size_t>(off), FromBits(0));
  a_host.insert(a_host.end(), a.begin(), a.end());
  b_host.insert(b_host.end(), b.begin(), b.end());
  auto out_d = Device(a_host);
  auto outb_d = Device(b_host);
  auto lse_d = Device(lse_a);
  auto lseb_d = Device(lse_b);
  auto ra_d = Device(rows_a);
  auto rb_d = Device(rows_b);
  const MergeStatesParams p =
      MergeParams(out_d->get() + off, lse_d->get(), c.identity ? nullptr : ra_d->get(), outb_d->get() + off,
                  lseb_d->get(), c.identity ? nullptr : rb_d->get(), c.n, H, D);
  const absl::Status st = MergeStates(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(out_d->GuardsIntact() && lse_d->GuardsIntact()) << "write outside out or lse";
  std::vector<bf16> got = out_d->Download();
  got.erase(got.begin(), got.begin() + off);
  const std::vector<float> got_lse = lse_d->Download();
  // b is input only.
  const std::vector<bf16> b_after = outb_d->Download();
  ASSERT_EQ(std::memcmp(b_after.data(), b_host.data(), b_host.size() * sizeof(bf16)), 0) << "out_b written";
  ASSERT_EQ(lseb_d->Download(), lse_b) << "lse_b written";

  std::vector<bool> merged(static_cast<size_t>(c.rows_a), false);
  int64_t bad = 0;
  std::string first;
  auto fail = [&](const std::string& why) {
    if (bad++ == 0) first = why;
  };
  for (int64_t i = 0; i < c.n; ++i) {
    const int64_t r = rows_a[static_cast<size_t>(i)];
    merged[static_cast<size_t>(r)] = true;
    for (int64_t h = 0; h < H; ++h) {
      const float la = gla[static_cast<size_t>(i * H + h)];
      const float lb = lse_b[static_cast<size_t>(rows_b[static_cast<size_t>(i)] * H + h)];
      const bool exact = la == kNegInf || lb == kNegInf;  // a copy (or zeros)
      const float rl = ref_lse[static_cast<size_t>(i * H + h)], gl = got_lse[static_cast<size_t>(r * H + h)];
      const bool lse_ok = (std::isnan(rl) && std::isnan(gl)) || rl == gl || std::fabs(rl - gl) <= 1e-4;
      if (!lse_ok)
        fail("lse at pair " + std::to_string(i) + " head " + std::to_string(h) + ": " + std::to_string(gl) +
             " vs " + std::to_string(rl));
      for (int64_t d = 0; d < D; ++d) {
        const float ro = ref_out[static_cast<size_t>((i * H + h) * D + d)];
        const float go = ToFloat(got[static_cast<size_t>((r * H + h) * D + d)]);
        bool ok;
        if (std::isnan(ro) || std::isnan(go)) {
          ok = std::isnan(ro) && std::isnan(go);
        } else if (exact) {
          ok = ro == go;
        } else {
          ok = std::fabs(go - ro) <= std::ldexp(std::fabs(ro), -8) + 1e-5;
        }
        if (!ok) {
          fail("out at pair " + std::to_string(i) + " head " + std::to_string(h) + " d " + std::to_string(d) +
               ": " + std::to_string(go) + " vs " + std::to_string(ro) + " (lse " + std::to_string(la) +
               ", " + std::to_string(lb) + ")");
        }
      }
    }
  }
  // Rows of a that are not merged keep their bits.
  for (int64_t r = 0; r < c.rows_a; ++r) {
    if (merged[static_cast<size_t>(r)]) continue;
    if (std::memcmp(got.data() + r * H * D, a.data() + r * H * D, H * D * sizeof(bf16)) != 0 ||
        std::memcmp(got_lse.data() + r * H, lse_a.data() + r * H, H * sizeof(float)) != 0) {
      fail("row " + std::to_string(r) + " of a changed although not in rows_a");
    }
  }
  EXPECT_EQ(bad, 0) << "first: " << first;
}

TEST(CudaPrefixAttention, MergeStatesMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  uint32_t seed = 500;
  for (int64_t d : {128, 64}) {
    for (int64_t heads : {8, 32, 1}) {
      MergeCase c;
      c.heads = heads;
      c.head_dim = d;
      c.seed = ++seed;
      CheckMerge(c);  // 16-byte path
      c.misalign = true;
      c.seed = ++seed;
      CheckMerge(c);  // element path
    }
  }
  // head_dim not a multiple of 8 (element path), short rows (several pairs per warp).
  for (int64_t d : {36, 3, 200}) {
    MergeCase c;
    c.heads = 5;
    c.head_dim = d;
    c.seed = ++seed;
    CheckMerge(c);
  }
  // Many pairs (grid-stride) and identity rows.
  MergeCase big;
  big.heads = 32;
  big.rows_a = 3000;
  big.rows_b = 40;
  big.n = 2500;
  big.seed = ++seed;
  CheckMerge(big);
  MergeCase id;
  id.rows_a = id.rows_b = id.n = 77;
  id.identity = true;
  id.seed = ++seed;
  CheckMerge(id);
}

TEST(CudaPrefixAttention, MergeStatesNegativeRowsAreSkippedAndZeroPairsIsANoOp) {
  TANDEM_SKIP_WITHOUT_GPU();
  const int64_t H = 2, D = 64;
  std::vector<bf16> a(static_cast<size_t>(3 * H * D), ToBf16(0.5f)),
      b(static_cast<size_t>(3 * H * D), ToBf16(-1.0f));
  std::vector<float> la(static_cast<size_t>(3 * H), 1.0f), lb(static_cast<size_t>(3 * H), 1.0f);
  auto out_d = Device(a);
  auto outb_d = Device(b);
  auto lse_d = Device(la);
  auto lseb_d = Device(lb);
  auto ra_d = Device(std::vector<int32_t>{-1, 1, 2});
  auto rb_d = Device(std::vector<int32_t>{0, -5, 2});
  const MergeStatesParams p = MergeParams(out_d->get(), lse_d->get(), ra_d->get(), outb_d->get(),
                                          lseb_d->get(), rb_d->get(), /*n=*/3, H, D);
  ASSERT_TRUE(MergeStates(p, nullptr).ok());
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<bf16> got = out_d->Download();
  const std::vector<float> got_lse = lse_d->Download();
  for (int64_t r = 0; r < 3; ++r) {
    const float want = r == 2 ? -0.25f : 0.5f;  // only pair 2 (rows 2, 2) merges: (0.5 - 1) / 2
    for (int64_t e = 0; e < H * D; ++e)
      ASSERT_EQ(ToFloat(got[static_cast<size_t>(r * H * D + e)]), want) << r;
    for (int64_t h = 0; h < H; ++h) {
      const float want_lse = r == 2 ? 1.0f + std::log(2.0f) : 1.0f;
      EXPECT_NEAR(got_lse[static_cast<size_t>(r * H + h)], want_lse, 1e-6) << r;
    }
  }
  MergeStatesParams none;  // n == 0: no-op, nothing checked
  EXPECT_TRUE(MergeStates(none, nullptr).ok());
}

// out_b may point into out's buffer when the rows read are not rows written: here the upper
// third of a buffer of three partial states is merged into its lower third (a tree merge step).
TEST(CudaPrefixAttention, MergeStatesWithinOneBuffer) {
  TANDEM_SKIP_WITHOUT_GPU();
  const int64_t H = 4, D = 64, n = 10;
  std::mt19937 rng(77);
  std::vector<bf16> buf;
  std::vector<float> buf_f;
  RandomBf16(rng, 3 * n * H * D, -1.0f, 1.0f, &buf, &buf_f);
  std::vector<float> lse(static_cast<size_t>(3 * n * H));
  std::uniform_real_distribution<float> ul(-5.0f, 5.0f);
  for (float& x : lse) x = ul(rng);
  std::vector<float> ref_out(static_cast<size_t>(n * H * D)), ref_lse(static_cast<size_t>(n * H));
  cpu::MergeAttentionStatesParams mp;
  mp.out_a = buf_f.data();
  mp.lse_a = lse.data();
  mp.out_b = buf_f.data() + 2 * n * H * D;
  mp.lse_b = lse.data() + 2 * n * H;
  mp.out = ref_out.data();
  mp.lse = ref_lse.data();
  mp.rows = n;
  mp.num_heads = H;
  mp.head_dim = D;
  ASSERT_TRUE(cpu::MergeAttentionStates(mp).ok());

  auto buf_d = Device(buf);
  auto lse_d = Device(lse);
  const MergeStatesParams p =
      MergeParams(buf_d->get(), lse_d->get(), /*rows_a=*/nullptr, buf_d->get() + 2 * n * H * D,
                  lse_d->get() + 2 * n * H, /*rows_b=*/nullptr, n, H, D);
  ASSERT_TRUE(MergeStates(p, nullptr).ok());
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<bf16> got = buf_d->Download();
  const std::vector<float> got_lse = lse_d->Download();
  for (int64_t i = 0; i < n * H * D; ++i) {
    const float r = ref_out[static_cast<size_t>(i)], g = ToFloat(got[static_cast<size_t>(i)]);
    ASSERT_LE(std::fabs(g - r), std::ldexp(std::fabs(r), -8) + 1e-5) << "element " << i;
  }
  for (int64_t i = 0; i < n * H; ++i) {
    ASSERT_NEAR(got_lse[static_cast<size_t>(i)], ref_lse[static_cast<size_t>(i)], 1e-4) << i;
  }
  // The other two thirds are untouched.
  EXPECT_EQ(std::memcmp(got.data() + n * H * D, buf.data() + n * H * D, 2 * n * H * D * sizeof(bf16)), 0);
  EXPECT_EQ(std::memcmp(got_lse.data() + n * H, lse.data() + n * H, 2 * n * H * sizeof(float)), 0);
}

// ---- (c) GatherRows --------------------------------------------------------------------------

TEST(CudaPrefixAttention, GatherRowsCopiesBits) {
  TANDEM_SKIP_WITHOUT_GPU();
  struct G {
    int64_t src_rows, n, width, stride, misalign;
  };
  // 16-byte paths (packed and strided) and element paths (odd width/stride, misaligned).
  const G cases[] = {{100, 37, 4096, 0, 0}, {60, 50, 128, 384, 0}, {30, 20, 13, 20, 0},
                     {12, 9, 64, 64, 1},    {1, 5, 8, 8, 0},       {500, 3000, 1024, 1024, 0}};
  std::mt19937 rng(9);
  for (const G& g : cases) {
    SCOPED_TRACE(::testing::Message() << "src_rows " << g.src_rows << " n " << g.n << " width " << g.width
                                      << " stride " << g.stride << " misalign " << g.misalign);
    const int64_t stride = g.stride == 0 ? g.width : g.stride;
    std::vector<bf16> src;
    std::vector<float> unused;
    RandomBf16(rng, g.misalign + g.src_rows * stride, -3.0f, 3.0f, &src, &unused);
    std::vector<int32_t> rows(static_cast<size_t>(g.n));
    std::uniform_int_distribution<int32_t> ur(0, static_cast<int32_t>(g.src_rows - 1));
    for (int32_t& r : rows) r = ur(rng);
    if (g.n > 3) rows[2] = -1;  // zero-filled
    auto src_d = Device(src);
    auto rows_d = Device(rows);
    std::vector<bf16> dst_host(static_cast<size_t>(g.misalign + g.n * g.width), kNaNBf16);
    auto dst_d = Device(dst_host);
    GatherRowsParams p;
    p.src = src_d->get() + g.misalign;
    p.dst = dst_d->get() + g.misalign;
    p.rows = rows_d->get();
    p.n = g.n;
    p.width = g.width;
    p.src_stride = g.stride;
    const absl::Status st = GatherRows(p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(dst_d->GuardsIntact()) << "write outside dst";
    const std::vector<bf16> got = dst_d->Download();
    for (int64_t i = 0; i < g.n; ++i) {
      const int32_t r = rows[static_cast<size_t>(i)];
      for (int64_t e = 0; e < g.width; ++e) {
        const uint16_t want = r < 0 ? 0 : BitsOf(src[static_cast<size_t>(g.misalign + r * stride + e)]);
        const uint16_t have = BitsOf(got[static_cast<size_t>(g.misalign + i * g.width + e)]);
        ASSERT_EQ(have, want) << "row " << i << " (src row " << r << ") element " << e;
      }
    }
    if (g.misalign) {
      ASSERT_EQ(BitsOf(got[0]), BitsOf(kNaNBf16)) << "wrote before dst";
    }
  }
}

// GQA packing: dst head j·(H/pack) + g is src head g·pack + j, bits exact.
TEST(CudaPrefixAttention, GatherRowsPacksHeadsOfOneKvHead) {
  TANDEM_SKIP_WITHOUT_GPU();
  std::mt19937 rng(19);
  for (auto [heads, pack, d] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {32, 4, 128}, {4, 2, 64}, {8, 8, 128}, {6, 3, 10}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << heads << " pack " << pack << " head_dim " << d);
    const int64_t width = heads * d, src_rows = 40, n = 33;
    std::vector<bf16> src;
    std::vector<float> unused;
    RandomBf16(rng, src_rows * width, -3.0f, 3.0f, &src, &unused);
    std::vector<int32_t> rows(static_cast<size_t>(n));
    std::uniform_int_distribution<int32_t> ur(0, static_cast<int32_t>(src_rows - 1));
    for (int32_t& r : rows) r = ur(rng);
    auto src_d = Device(src);
    auto rows_d = Device(rows);
    auto dst_d = Filled<bf16>(n * width, kNaNBf16);
    GatherRowsParams p;
    p.src = src_d->get();
    p.dst = dst_d->get();
    p.rows = rows_d->get();
    p.n = n;
    p.width = width;
    p.pack = pack;
    p.head_dim = d;
    const absl::Status st = GatherRows(p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(dst_d->GuardsIntact());
    const std::vector<bf16> got = dst_d->Download();
    const int64_t kv = heads / pack;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t g = 0; g < kv; ++g) {
        for (int64_t j = 0; j < pack; ++j) {
          for (int64_t e = 0; e < d; ++e) {
            const size_t want =
                static_cast<size_t>(rows[static_cast<size_t>(i)] * width + (g * pack + j) * d + e);
            const size_t have = static_cast<size_t>(i * width + (j * kv + g) * d + e);
            ASSERT_EQ(BitsOf(got[have]), BitsOf(src[want])) << "row " << i << " kv head " << g << " j " << j;
          }
        }
      }
    }
  }
}

// b_pack: merging a packed state b equals merging the same state unpacked on the host (whose
// merge MergeStatesMatchesCpu compares with cpu::MergeAttentionStates), bit for bit.
TEST(CudaPrefixAttention, MergeStatesUnpacksPackedStates) {
  TANDEM_SKIP_WITHOUT_GPU();
  std::mt19937 rng(23);
  for (auto [heads, pack, d] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{{32, 4, 128}, {4, 2, 64}, {8, 8, 64}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << heads << " pack " << pack << " head_dim " << d);
    const int64_t rows = 50, kv = heads / pack;
    std::vector<bf16> a, b_packed;
    std::vector<float> unused;
    RandomBf16(rng, rows * heads * d, -2.0f, 2.0f, &a, &unused);
    RandomBf16(rng, rows * heads * d, -2.0f, 2.0f, &b_packed, &unused);
    std::uniform_real_distribution<float> ul(-5.0f, 5.0f);
    std::vector<float> lse_a(static_cast<size_t>(rows * heads)), lse_b_packed(lse_a.size());
    for (float& x : lse_a) x = ul(rng);
    for (float& x : lse_b_packed) x = ul(rng);
    lse_b_packed[7] = -std::numeric_limits<float>::infinity();
    std::vector<bf16> b_plain(b_packed.size());
    std::vector<float> lse_b_plain(lse_b_packed.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t stored = (h % pack) * kv + h / pack;
        lse_b_plain[static_cast<size_t>(r * heads + h)] =
            lse_b_packed[static_cast<size_t>(r * heads + stored)];
        for (int64_t e = 0; e < d; ++e) {
          b_plain[static_cast<size_t>((r * heads + h) * d + e)] =
              b_packed[static_cast<size_t>((r * heads + stored) * d + e)];
        }
      }
    }
    std::vector<int32_t> rows_a(static_cast<size_t>(rows)), rows_b(static_cast<size_t>(rows));
    for (int32_t i = 0; i < rows; ++i) {
      rows_a[static_cast<size_t>(i)] = (i * 7) % static_cast<int32_t>(rows);
      rows_b[static_cast<size_t>(i)] = (i * 3 + 1) % static_cast<int32_t>(rows);
    }
    auto ra_d = Device(rows_a);
    auto rb_d = Device(rows_b);
    std::vector<bf16> outs[2];
    std::vector<float> lses[2];
    for (int packed = 0; packed < 2; ++packed) {
      auto out_d = Device(a);
      auto lse_d = Device(lse_a);
      auto b_d = Device(packed ? b_packed : b_plain);
      auto lb_d = Device(packed ? lse_b_packed : lse_b_plain);
      MergeStatesParams p = MergeParams(out_d->get(), lse_d->get(), ra_d->get(), b_d->get(), lb_d->get(),
                                        rb_d->get(), rows, heads, d);
      p.b_pack = packed ? pack : 1;
      const absl::Status st = MergeStates(p, nullptr);
      ASSERT_TRUE(st.ok()) << st;
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      outs[packed] = out_d->Download();
      lses[packed] = lse_d->Download();
    }
    ASSERT_EQ(lses[0], lses[1]);
    ASSERT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(bf16)), 0);
  }
}

// ---- (d) the whole cascade against cpu::Attention ---------------------------------------------

struct CascadeRequest {
  int group;  // prefix group, or -1 (ungrouped)
  int q_len;  // 1: a decode row (DecodeAttention), else a chunk (causal PrefillAttention)
  int own;    // keys after the group's prefix (own chunk's keys included); ungrouped: whole context
};

struct CascadeCase {
  Layout layout;
  std::vector<int> prefix_lens;          // per group
  std::vector<CascadeRequest> requests;  // all decode rows first, then chunks
  uint32_t seed = 1;
};

void CheckCascade(const CascadeCase& c) {
  const Layout& l = c.layout;
  std::ostringstream desc;
  desc << LayoutName(l) << " prefixes [";
  for (size_t g = 0; g < c.prefix_lens.size(); ++g) desc << (g ? " " : "") << c.prefix_lens[g];
  desc << "] requests [";
  for (size_t r = 0; r < c.requests.size(); ++r) {
    desc << (r ? " " : "") << "g" << c.requests[r].group << ":" << c.requests[r].q_len << "/"
         << c.requests[r].own;
  }
  desc << "] (group:q_len/own keys) seed " << c.seed;
  SCOPED_TRACE(desc.str());
  const int64_t H = l.heads, KVH = l.kv_heads, D = l.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::mt19937 rng(c.seed);

  int64_t total_kv = 0, total_q = 0, n_dec = 0;
  for (int p : c.prefix_lens) total_kv += p;
  for (const CascadeRequest& r : c.requests) {
    ASSERT_GE(r.own, r.q_len) << "a request's own keys include its query rows";
    total_kv += r.own;
    total_q += r.q_len;
    if (r.q_len == 1) {
      ASSERT_EQ(n_dec, static_cast<int64_t>(&r - c.requests.data())) << "decode rows come first";
      ++n_dec;
    }
  }
  KvPool pool(rng, total_kv, 123, KVH, D);
  std::vector<std::vector<int32_t>> prefix(c.prefix_lens.size()), own(c.requests.size());
  for (size_t g = 0; g < prefix.size(); ++g) prefix[g] = pool.Take(c.prefix_lens[g]);
  for (size_t r = 0; r < own.size(); ++r) own[r] = pool.Take(c.requests[r].own);
  std::vector<bf16> q;
  std::vector<float> q_f;
  RandomBf16(rng, total_q * H * D, -2.0f, 2.0f, &q, &q_f);

  // Reference: plain attention over every request's whole context (prefix, then own keys).
  std::vector<int32_t> q_indptr = {0}, kv_indptr = {0}, kv_slots;
  for (size_t r = 0; r < c.requests.size(); ++r) {
    const CascadeRequest& req = c.requests[r];
    if (req.group >= 0) {
      const auto& pre = prefix[static_cast<size_t>(req.group)];
      kv_slots.insert(kv_slots.end(), pre.begin(), pre.end());
    }
    kv_slots.insert(kv_slots.end(), own[r].begin(), own[r].end());
    q_indptr.push_back(q_indptr.back() + req.q_len);
    kv_indptr.push_back(static_cast<int32_t>(kv_slots.size()));
  }
  std::vector<float> ref_out(static_cast<size_t>(total_q * H * D), kNaN),
      ref_lse(static_cast<size_t>(total_q * H), kNaN);
  {
    cpu::AttentionParams p;
    p.q = q_f.data();
    p.k_cache = pool.k_f();
    p.v_cache = pool.v_f();
    p.out = ref_out.data();
    p.lse = ref_lse.data();
    p.q_indptr = q_indptr.data();
    p.kv_indptr = kv_indptr.data();
    p.kv_slots = kv_slots.data();
    p.num_requests = static_cast<int64_t>(c.requests.size());
    p.num_slots = pool.num_slots();
    p.num_heads = H;
    p.num_kv_heads = KVH;
    p.head_dim = D;
    p.scale = scale;
    const absl::Status st = cpu::Attention(p);
    ASSERT_TRUE(st.ok()) << st;
  }

  // Device inputs: own-key tables of the decode rows and of the chunks; the members' rows and the
  // prefix tables, group by group.
  std::vector<int32_t> dec_kv_indptr = {0}, dec_slots, chk_q_indptr = {0}, chk_kv_indptr = {0}, chk_slots;
  for (size_t r = 0; r < c.requests.size(); ++r) {
    const CascadeRequest& req = c.requests[r];
    if (req.q_len == 1) {
      dec_slots.insert(dec_slots.end(), own[r].begin(), own[r].end());
      dec_kv_indptr.push_back(static_cast<int32_t>(dec_slots.size()));
    } else {
      chk_slots.insert(chk_slots.end(), own[r].begin(), own[r].end());
      chk_kv_indptr.push_back(static_cast<int32_t>(chk_slots.size()));
      chk_q_indptr.push_back(chk_q_indptr.back() + req.q_len);
    }
  }
  std::vector<int32_t> member_rows, pre_q_indptr = {0}, pre_kv_indptr = {0}, pre_slots;
  for (size_t g = 0; g < c.prefix_lens.size(); ++g) {
    for (size_t r = 0; r < c.requests.size(); ++r) {
      if (c.requests[r].group != static_cast<int>(g)) continue;
      for (int i = 0; i < c.requests[r].q_len; ++i) member_rows.push_back(q_indptr[r] + i);
    }
    pre_q_indptr.push_back(static_cast<int32_t>(member_rows.size()));
    pre_slots.insert(pre_slots.end(), prefix[g].begin(), prefix[g].end());
    pre_kv_indptr.push_back(static_cast<int32_t>(pre_slots.size()));
  }
  const int64_t n_members = static_cast<int64_t>(member_rows.size());
  std::vector<int32_t> member_index(static_cast<size_t>(n_members));
  std::iota(member_index.begin(), member_index.end(), 0);

  pool.Upload();
  auto q_d = Device(q);
  auto out_d = Filled<bf16>(total_q * H * D, kNaNBf16);
  auto lse_d = Filled<float>(total_q * H, kNaN);
  const DeviceTables dec({}, dec_kv_indptr, dec_slots);  // no q_indptr: one row per request
  const DeviceTables chunks(chk_q_indptr, chk_kv_indptr, chk_slots);
  const DeviceTables prefixes(pre_q_indptr, pre_kv_indptr, pre_slots);
  auto members_d = Device(member_rows);
  auto member_index_d = Device(member_index);
  auto q_pre_d = Filled<bf16>(n_members * H * D, kNaNBf16);
  auto out_pre_d = Filled<bf16>(n_members * H * D, kNaNBf16);
  auto lse_pre_d = Filled<float>(n_members * H, kNaN);

  // 1. Own keys: decode rows (rows [0, n_dec), one per request, q_indptr null) ...
  const DecodePlan plan =
      PlanDecodeAttention(std::max<int64_t>(n_dec, 1), H, KVH, D, dec.max_kv_len, NumSms());
  auto ws_d = Filled<unsigned char>(plan.workspace_bytes + 16, 0);
  if (n_dec > 0) {
    const AttentionParams p =
        PoolAttention(pool, l, dec, q_d->get(), out_d->get(), lse_d->get(), /*causal=*/true);
    const absl::Status st = DecodeAttention(p, plan, ws_d->get(), nullptr);
    ASSERT_TRUE(st.ok()) << st;
  }
  // ... and the chunks (the rows after them), causal over their own keys.
  if (chunks.num_requests > 0) {
    const AttentionParams p = PoolAttention(pool, l, chunks, q_d->get() + n_dec * H * D,
                                            out_d->get() + n_dec * H * D, lse_d->get() + n_dec * H,
                                            /*causal=*/true);
    const absl::Status st = PrefillAttention(p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
  }
  // 2. The groups' rows, gathered; 3. each group's prefix once for all its rows.
  if (n_members > 0) {
    GatherRowsParams gp;
    gp.src = q_d->get();
    gp.dst = q_pre_d->get();
    gp.rows = members_d->get();
    gp.n = n_members;
    gp.width = H * D;
    ASSERT_TRUE(GatherRows(gp, nullptr).ok());
    const AttentionParams p = PoolAttention(pool, l, prefixes, q_pre_d->get(), out_pre_d->get(),
                                            lse_pre_d->get(), /*causal=*/false);
    const absl::Status st = PrefillAttention(p, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    // 4. Merge each member row's prefix state into its own-keys state.
    const MergeStatesParams mp = MergeParams(out_d->get(), lse_d->get(), members_d->get(), out_pre_d->get(),
                                             lse_pre_d->get(), member_index_d->get(), n_members, H, D);
    ASSERT_TRUE(MergeStates(mp, nullptr).ok());
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(out_d->GuardsIntact() && lse_d->GuardsIntact()) << "write outside out or lse";
  ASSERT_TRUE(q_pre_d->GuardsIntact() && out_pre_d->GuardsIntact() && lse_pre_d->GuardsIntact())
      << "write outside the prefix buffers";
  ASSERT_TRUE(ws_d->GuardsIntact()) << "write outside the decode workspace";
  ExpectDeviceClose(desc.str(), ref_out, ref_lse, *out_d, *lse_d, H, D);
}

TEST(CudaPrefixAttention, CascadeMatchesPlainAttention) {
  TANDEM_SKIP_WITHOUT_GPU();
  uint32_t seed = 900;
  for (const Layout& l : kLayouts) {
    // Two groups (prefixes 300 and 64) and ungrouped requests; decode rows first (own keys >= 1:
    // a decode row's own key), then chunks, one a fresh chunk right after its prefix (own ==
    // q_len), one of 130 rows (128-row tiles).
    CascadeCase c;
    c.layout = l;
    c.prefix_lens = {300, 64};
    c.requests = {{0, 1, 1},     {0, 1, 17},    {1, 1, 5},   {-1, 1, 200},  {1, 1, 1},
                  {-1, 1, 1},    {0, 1, 600},   {0, 40, 40}, {0, 100, 250}, {1, 7, 30},
                  {-1, 50, 120}, {1, 130, 130}, {-1, 3, 3}};
    c.seed = ++seed;
    CheckCascade(c);
  }
  // Chunks <= 64 rows (64-row tiles everywhere); a group of decode rows only; a long prefix.
  for (const Layout& l : {Layout{"Gqa32x8D128", 32, 8, 128}, Layout{"Mha4x4D64", 4, 4, 64}}) {
    CascadeCase c;
    c.layout = l;
    c.prefix_lens = {1000, 5};
    c.requests = {{0, 1, 2},   {0, 1, 1},   {1, 1, 9},    {1, 1, 70},
                  {-1, 1, 33}, {0, 64, 64}, {-1, 20, 40}, {0, 9, 12}};
    c.seed = ++seed;
    CheckCascade(c);
    c.prefix_lens = {2000, 1};
    c.requests = {{0, 1, 3}, {0, 1, 1}, {0, 1, 1}, {1, 1, 4}, {1, 1, 1}, {-1, 1, 1500}};
    c.seed = ++seed;
    CheckCascade(c);
  }
}

// ---- (e) causal PrefillAttention, unchanged -----------------------------------------------------

TEST(CudaPrefixAttention, CausalPrefillStillMatchesAttention) {
  TANDEM_SKIP_WITHOUT_GPU();
  // Grouped-free cascade cases are plain causal attention: no groups, chunks and decode rows
  // through the existing kernels only.
  for (const Layout& l : {Layout{"Gqa8x2D128", 8, 2, 128}, Layout{"Gqa32x8D64", 32, 8, 64}}) {
    CascadeCase c;
    c.layout = l;
    c.requests = {{-1, 1, 77}, {-1, 200, 500}, {-1, 17, 17}, {-1, 64, 65}, {-1, 129, 300}};
    c.seed = 31;
    CheckCascade(c);
  }
}

// ---- parameter validation (host only: fails before any device access) -------------------------

// One invalid parameter: `apply` spoils a copy of valid params in `field`.
template <typename Params>
struct Mutation {
  const char* field;
  void (*apply)(Params*);
};

// Every mutation of `good` makes `call` (the op named `name`) fail with kInvalidArgument and a
// message that names the field and the op.
template <typename Params>
void ExpectRejected(absl::Status (*call)(const Params&, cudaStream_t), const char* name, const Params& good,
                    const std::vector<Mutation<Params>>& mutations) {
  for (const Mutation<Params>& m : mutations) {
    Params p = good;
    m.apply(&p);
    const absl::Status st = call(p, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << m.field << ": " << st;
    EXPECT_NE(std::string(st.message()).find(m.field), std::string::npos) << st;
    EXPECT_NE(std::string(st.message()).find(name), std::string::npos) << st;
  }
}

TEST(CudaPrefixAttention, MergeStatesAndGatherRowsRejectInvalidParams) {
  alignas(16) static bf16 dummy_bf16[64];
  alignas(16) static float dummy_f32[64];
  alignas(16) static int32_t dummy_i32[4];
  const MergeStatesParams good = MergeParams(dummy_bf16, dummy_f32, dummy_i32, dummy_bf16 + 32,
                                             dummy_f32 + 32, dummy_i32, /*n=*/2, /*heads=*/2, /*head_dim=*/8);
  const std::vector<Mutation<MergeStatesParams>> merge_mutations = {
      {"out", [](MergeStatesParams* p) { p->out = nullptr; }},
      {"lse", [](MergeStatesParams* p) { p->lse = nullptr; }},
      {"out_b", [](MergeStatesParams* p) { p->out_b = nullptr; }},
      {"lse_b", [](MergeStatesParams* p) { p->lse_b = nullptr; }},
      {"n", [](MergeStatesParams* p) { p->n = -1; }},
      {"num_heads", [](MergeStatesParams* p) { p->num_heads = 0; }},
      {"head_dim", [](MergeStatesParams* p) { p->head_dim = -3; }},
      // One buffer for both states needs both row lists (disjoint rows by precondition).
      {"out_b",
       [](MergeStatesParams* p) {
         p->out_b = p->out;
         p->rows_b = nullptr;
       }},
      {"lse_b",
       [](MergeStatesParams* p) {
         p->lse_b = p->lse;
         p->rows_a = nullptr;
       }},
  };
  ExpectRejected(MergeStates, "MergeStates", good, merge_mutations);

  GatherRowsParams g;
  g.src = dummy_bf16;
  g.dst = dummy_bf16 + 32;
  g.rows = dummy_i32;
  g.n = 2;
  g.width = 8;
  const std::vector<Mutation<GatherRowsParams>> gather_mutations = {
      {"src", [](GatherRowsParams* p) { p->src = nullptr; }},
      {"dst", [](GatherRowsParams* p) { p->dst = nullptr; }},
      {"rows", [](GatherRowsParams* p) { p->rows = nullptr; }},
      {"n", [](GatherRowsParams* p) { p->n = -2; }},
      {"width", [](GatherRowsParams* p) { p->width = 0; }},
      {"src_stride", [](GatherRowsParams* p) { p->src_stride = 4; }},
  };
  ExpectRejected(GatherRows, "GatherRows", g, gather_mutations);
  GatherRowsParams empty;  // n == 0: no-op, nothing checked
  EXPECT_TRUE(GatherRows(empty, nullptr).ok());
  MergeStatesParams empty_merge;
  EXPECT_TRUE(MergeStates(empty_merge, nullptr).ok());
}

}  // namespace
}  // namespace tandem::kernels::cuda
