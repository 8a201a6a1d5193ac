// Shared-prefix (cascade) attention: PrefixAttention + Attention over suffixes +
// MergeAttentionStates must equal plain Attention over each request's whole context.
//
// A batch is a set of prefix groups (optionally nested: a group extends its parent's context by its
// own segment) and requests, each in at most one (innermost) group with its own suffix. The KV pool
// is a random permutation of slots, so no context is contiguous.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kRtol = 1e-5, kAtol = 1e-6;

std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& ref) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << "size mismatch";
  int bad = 0;
  std::string first;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i], r = ref[i];
    const bool ok = (g == r) || std::abs(g - r) <= kAtol + kRtol * std::abs(r);  // == covers ±inf
    if (!ok) {
      if (bad++ == 0)
        first = "at " + std::to_string(i) + ": got " + std::to_string(g) + " want " + std::to_string(r);
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " mismatches, first " << first;
}

struct Shape {
  int64_t heads, kv_heads, d;
};

struct GroupSpec {
  int64_t len;      // own segment length (may be 0)
  int parent = -1;  // enclosing group, or -1
};

struct RequestSpec {
  int group;  // innermost group, or -1 (ungrouped)
  int64_t suffix, q_len;
};

class Batch {
 public:
  Batch(Shape s, std::vector<GroupSpec> groups, std::vector<RequestSpec> requests, uint32_t seed)
      : s_(s), groups_(std::move(groups)), requests_(std::move(requests)) {
    std::mt19937 rng(seed);
    int64_t needed = 0;
    for (const GroupSpec& g : groups_) needed += g.len;
    for (const RequestSpec& r : requests_) needed += r.suffix;
    num_slots_ = needed + 17;
    std::vector<int32_t> perm(static_cast<size_t>(num_slots_));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    size_t next = 0;
    for (const GroupSpec& g : groups_) {
      group_slots_.emplace_back(perm.begin() + static_cast<int64_t>(next),
                                perm.begin() + static_cast<int64_t>(next + static_cast<size_t>(g.len)));
      next += static_cast<size_t>(g.len);
    }
    q_indptr_ = {0};
    for (const RequestSpec& r : requests_) {
      suffix_slots_.emplace_back(perm.begin() + static_cast<int64_t>(next),
                                 perm.begin() + static_cast<int64_t>(next + static_cast<size_t>(r.suffix)));
      next += static_cast<size_t>(r.suffix);
      q_indptr_.push_back(q_indptr_.back() + static_cast<int32_t>(r.q_len));
    }
    total_q_ = q_indptr_.back();
    q_ = RandomFloats(rng, total_q_ * s_.heads * s_.d, -2.0f, 2.0f);
    k_ = RandomFloats(rng, num_slots_ * s_.kv_heads * s_.d, -1.0f, 1.0f);
    v_ = RandomFloats(rng, num_slots_ * s_.kv_heads * s_.d, -1.0f, 1.0f);
  }

  int64_t total_q() const { return total_q_; }
  int64_t row_floats() const { return s_.heads * s_.d; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(s_.d)); }

  // Groups enclosing request r, outermost first.
  std::vector<int> Chain(size_t r) const {
    std::vector<int> chain;
    for (int g = requests_[r].group; g >= 0; g = groups_[static_cast<size_t>(g)].parent) chain.push_back(g);
    std::reverse(chain.begin(), chain.end());
    return chain;
  }

  // Plain Attention over every request's whole context (prefix segments + suffix), one call.
  void Reference(std::vector<float>* out, std::vector<float>* lse) const {
    std::vector<int32_t> kv_indptr = {0}, slots;
    for (size_t r = 0; r < requests_.size(); ++r) {
      for (int g : Chain(r)) {
        const auto& gs = group_slots_[static_cast<size_t>(g)];
        slots.insert(slots.end(), gs.begin(), gs.end());
      }
      slots.insert(slots.end(), suffix_slots_[r].begin(), suffix_slots_[r].end());
      kv_indptr.push_back(static_cast<int32_t>(slots.size()));
    }
    out->assign(static_cast<size_t>(total_q_ * row_floats()), kNaN);
    lse->assign(static_cast<size_t>(total_q_ * s_.heads), kNaN);
    AttentionParams p = Base(kv_indptr.data(), slots.data(), static_cast<int64_t>(requests_.size()));
    p.q = q_.data();
    p.out = out->data();
    p.lse = lse->data();
    p.q_indptr = q_indptr_.data();
    ASSERT_TRUE(Attention(p).ok());
  }

  // Cascade: suffix states from Attention (empty suffix: out 0, lse -inf, no call), then for each
  // group one PrefixAttention over its own segment for all rows of all member requests (gathered
  // into one q block), merged into each member's rows through rows_b.
  void Cascade(std::vector<float>* out, std::vector<float>* lse) const {
    const int64_t H = s_.heads, RF = row_floats();
    out->assign(static_cast<size_t>(total_q_ * RF), kNaN);
    lse->assign(static_cast<size_t>(total_q_ * H), kNaN);
    for (size_t r = 0; r < requests_.size(); ++r) {
      const int64_t row0 = q_indptr_[r], q_len = requests_[r].q_len, suffix = requests_[r].suffix;
      if (suffix == 0) {
        // The rows must then sit at the last prefix position, seeing the whole prefix unmasked.
        ASSERT_LE(q_len, 1) << "request " << r;
        std::fill_n(out->data() + row0 * RF, q_len * RF, 0.0f);
        std::fill_n(lse->data() + row0 * H, q_len * H, kNegInf);
        continue;
      }
      ASSERT_LE(q_len, suffix) << "request " << r << ": query rows inside the prefix need a mask";
      const int32_t q_indptr[2] = {0, static_cast<int32_t>(q_len)};
      const int32_t kv_indptr[2] = {0, static_cast<int32_t>(suffix)};
      AttentionParams p = Base(kv_indptr, suffix_slots_[r].data(), 1);
      p.q = q_.data() + row0 * RF;
      p.out = out->data() + row0 * RF;
      p.lse = lse->data() + row0 * H;
      p.q_indptr = q_indptr;
      ASSERT_TRUE(Attention(p).ok());
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      // Member requests (g anywhere in their chain) and their rows, gathered in request order.
      std::vector<size_t> members;
      std::vector<float> group_q;
      for (size_t r = 0; r < requests_.size(); ++r) {
        const std::vector<int> chain = Chain(r);
        if (std::find(chain.begin(), chain.end(), static_cast<int>(g)) == chain.end()) continue;
        members.push_back(r);
        group_q.insert(group_q.end(), q_.begin() + q_indptr_[r] * RF, q_.begin() + q_indptr_[r + 1] * RF);
      }
      const int64_t group_rows = static_cast<int64_t>(group_q.size()) / RF;
      if (group_rows == 0) continue;
      std::vector<float> group_out(static_cast<size_t>(group_rows * RF), kNaN);
      std::vector<float> group_lse(static_cast<size_t>(group_rows * H), kNaN);
      PrefixAttentionParams pp;
      pp.q = group_q.data();
      pp.k_cache = k_.data();
      pp.v_cache = v_.data();
      pp.prefix_slots = group_slots_[g].data();
      pp.out = group_out.data();
      pp.lse = group_lse.data();
      pp.rows = group_rows;
      pp.prefix_len = groups_[g].len;
      pp.num_slots = num_slots_;
      pp.num_heads = H;
      pp.num_kv_heads = s_.kv_heads;
      pp.head_dim = s_.d;
      pp.scale = scale();
      ASSERT_TRUE(PrefixAttention(pp).ok());
      int32_t group_row = 0;
      for (size_t r : members) {
        const int64_t row0 = q_indptr_[r], q_len = requests_[r].q_len;
        std::vector<int32_t> rows_b(static_cast<size_t>(q_len));
        std::iota(rows_b.begin(), rows_b.end(), group_row);
        group_row += static_cast<int32_t>(q_len);
        MergeAttentionStatesParams mp;
        mp.out_a = out->data() + row0 * RF;  // in place
        mp.lse_a = lse->data() + row0 * H;
        mp.out_b = group_out.data();
        mp.lse_b = group_lse.data();
        mp.rows_b = rows_b.data();
        mp.out = out->data() + row0 * RF;
        mp.lse = lse->data() + row0 * H;
        mp.rows = q_len;
        mp.num_rows_b = group_rows;
        mp.num_heads = H;
        mp.head_dim = s_.d;
        ASSERT_TRUE(MergeAttentionStates(mp).ok());
      }
    }
  }

 private:
  AttentionParams Base(const int32_t* kv_indptr, const int32_t* slots, int64_t num_requests) const {
    AttentionParams p;
    p.k_cache = k_.data();
    p.v_cache = v_.data();
    p.kv_indptr = kv_indptr;
    p.kv_slots = slots;
    p.num_requests = num_requests;
    p.num_slots = num_slots_;
    p.num_heads = s_.heads;
    p.num_kv_heads = s_.kv_heads;
    p.head_dim = s_.d;
    p.scale = scale();
    return p;
  }

  Shape s_;
  std::vector<GroupSpec> groups_;
  std::vector<RequestSpec> requests_;
  std::vector<std::vector<int32_t>> group_slots_, suffix_slots_;
  std::vector<int32_t> q_indptr_;
  int64_t num_slots_ = 0, total_q_ = 0;
  std::vector<float> q_, k_, v_;
};

const Shape kShapes[] = {{4, 4, 16}, {8, 2, 64}, {4, 1, 24}, {6, 3, 24}, {8, 8, 64}};

void ExpectCascadeMatches(const std::vector<GroupSpec>& groups, const std::vector<RequestSpec>& requests) {
  for (const Shape& s : kShapes) {
    for (uint32_t seed = 1; seed <= 3; ++seed) {
      SCOPED_TRACE(::testing::Message()
                   << "heads " << s.heads << " kv_heads " << s.kv_heads << " d " << s.d << " seed " << seed);
      const Batch b(s, groups, requests, seed * 7919u + static_cast<uint32_t>(s.d));
      std::vector<float> ref_out, ref_lse, out, lse;
      ASSERT_NO_FATAL_FAILURE(b.Reference(&ref_out, &ref_lse));
      ASSERT_NO_FATAL_FAILURE(b.Cascade(&out, &lse));
      EXPECT_TRUE(AllClose(out, ref_out));
      EXPECT_TRUE(AllClose(lse, ref_lse));
    }
  }
}

// ---- Cascade vs plain attention ------------------------------------------------------------------

TEST(PrefixAttentionTest, DecodeRowsOneGroup) {
  ExpectCascadeMatches({{70}}, {{0, 5, 1}, {0, 1, 1}, {0, 33, 1}, {0, 2, 1}});
}

TEST(PrefixAttentionTest, MultiRowChunksCausalInSuffix) {
  // Chunks of 1..suffix rows: the last rows of each suffix, causal inside it.
  ExpectCascadeMatches({{45}}, {{0, 20, 20}, {0, 31, 7}, {0, 9, 1}, {0, 3, 3}});
}

TEST(PrefixAttentionTest, EmptySuffixRowAtLastPrefixPosition) {
  // Requests 0 and 2 have exactly the prefix as context: their row sees it all, unmasked.
  ExpectCascadeMatches({{38}}, {{0, 0, 1}, {0, 6, 2}, {0, 0, 1}});
}

TEST(PrefixAttentionTest, OneTokenPrefix) {
  ExpectCascadeMatches({{1}}, {{0, 12, 4}, {0, 1, 1}, {0, 0, 1}, {0, 7, 1}});
}

TEST(PrefixAttentionTest, ZeroTokenPrefixGivesSuffixAttention) {
  ExpectCascadeMatches({{0}}, {{0, 12, 4}, {0, 1, 1}, {0, 7, 1}});
}

TEST(PrefixAttentionTest, ManyGroupsAndUngroupedRequests) {
  // Rows of one group are not contiguous in the batch: ungrouped requests sit between them.
  ExpectCascadeMatches({{50}, {17}, {1}, {64}}, {{0, 3, 1},
                                                 {-1, 40, 1},
                                                 {1, 9, 5},
                                                 {0, 11, 1},
                                                 {2, 4, 4},
                                                 {-1, 23, 6},
                                                 {3, 0, 1},
                                                 {1, 1, 1},
                                                 {3, 25, 2},
                                                 {0, 0, 1}});
}

TEST(PrefixAttentionTest, NestedGroupsThreeStates) {
  // Group 0: system prompt for everyone; groups 1, 2: few-shot blocks for subsets. Requests in
  // group 1 or 2 merge three states (system, few-shot, suffix); those in group 0 only two.
  ExpectCascadeMatches(
      {{40}, {25, 0}, {9, 0}},
      {{1, 6, 1}, {1, 14, 3}, {0, 8, 1}, {2, 5, 5}, {1, 0, 1}, {2, 1, 1}, {-1, 19, 2}, {0, 0, 1}});
}

TEST(PrefixAttentionTest, LongPrefixManyRowsSpansRowBlocks) {
  // 100 rows in one group: more than one block of rows (64) per KV head, the last one partial.
  std::vector<RequestSpec> requests;
  for (int i = 0; i < 50; ++i) requests.push_back({0, 3 + i % 4, 1 + i % 3});
  ExpectCascadeMatches({{300}}, requests);
}

// A fully visible prefix: PrefixAttention alone is Attention over it, bit for bit.
TEST(PrefixAttentionTest, FullyVisiblePrefixIsBitExactAttention) {
  for (const Shape& s : kShapes) {
    const Batch b(s, {{57}}, {{0, 0, 1}, {0, 0, 1}, {0, 0, 1}}, 99);
    std::vector<float> ref_out, ref_lse, out, lse;
    b.Reference(&ref_out, &ref_lse);
    b.Cascade(&out, &lse);  // merge with an empty suffix copies the prefix state exactly
    EXPECT_EQ(std::memcmp(out.data(), ref_out.data(), out.size() * sizeof(float)), 0) << s.d;
    EXPECT_EQ(std::memcmp(lse.data(), ref_lse.data(), lse.size() * sizeof(float)), 0) << s.d;
  }
}

TEST(PrefixAttentionTest, EmptyPrefixGivesZeroAndNegInf) {
  const int64_t rows = 3, H = 4, D = 8;
  std::vector<float> q(rows * H * D, 1.0f), kv(H * D, 1.0f), out(rows * H * D, kNaN), lse(rows * H, kNaN);
  PrefixAttentionParams p;
  p.q = q.data();
  p.k_cache = kv.data();
  p.v_cache = kv.data();
  p.out = out.data();
  p.lse = lse.data();
  p.rows = rows;
  p.prefix_len = 0;  // prefix_slots null is fine
  p.num_slots = 1;
  p.num_heads = H;
  p.num_kv_heads = 2;
  p.head_dim = D;
  p.scale = 0.5f;
  ASSERT_TRUE(PrefixAttention(p).ok());
  for (float x : out) EXPECT_EQ(x, 0.0f);
  for (float x : lse) EXPECT_EQ(x, kNegInf);
}

// ---- MergeAttentionStates edge cases --------------------------------------------------------------

struct MergeCase {
  int64_t rows = 2, H = 3, D = 5;
  std::vector<float> out_a, lse_a, out_b, lse_b, out, lse;
  explicit MergeCase(uint32_t seed) {
    std::mt19937 rng(seed);
    out_a = RandomFloats(rng, rows * H * D, -1, 1);
    out_b = RandomFloats(rng, rows * H * D, -1, 1);
    lse_a = RandomFloats(rng, rows * H, -3, 3);
    lse_b = RandomFloats(rng, rows * H, -3, 3);
    out.assign(out_a.size(), kNaN);
    lse.assign(lse_a.size(), kNaN);
  }
  MergeAttentionStatesParams Params() {
    MergeAttentionStatesParams p;
    p.out_a = out_a.data();
    p.lse_a = lse_a.data();
    p.out_b = out_b.data();
    p.lse_b = lse_b.data();
    p.out = out.data();
    p.lse = lse.data();
    p.rows = rows;
    p.num_heads = H;
    p.head_dim = D;
    return p;
  }
  // Double-precision merge of element (row i of a, row ib of b, head h).
  void Expect(const std::vector<float>& got_out, const std::vector<float>& got_lse,
              const std::vector<int32_t>* rows_b = nullptr) const {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t ib = rows_b ? (*rows_b)[static_cast<size_t>(i)] : i;
      for (int64_t h = 0; h < H; ++h) {
        const double la = lse_a[static_cast<size_t>(i * H + h)], lb = lse_b[static_cast<size_t>(ib * H + h)];
        const double m = std::max(la, lb);
        const double wa = std::exp(la - m), wb = std::exp(lb - m);
        EXPECT_NEAR(got_lse[static_cast<size_t>(i * H + h)], m + std::log(wa + wb), 1e-6 * (1 + std::abs(m)));
        for (int64_t t = 0; t < D; ++t) {
          const double want = (wa * out_a[static_cast<size_t>((i * H + h) * D + t)] +
                               wb * out_b[static_cast<size_t>((ib * H + h) * D + t)]) /
                              (wa + wb);
          EXPECT_NEAR(got_out[static_cast<size_t>((i * H + h) * D + t)], want, 1e-6) << i << " " << h;
        }
      }
    }
  }
};

TEST(MergeAttentionStatesTest, MatchesDoubleFormula) {
  MergeCase c(1);
  ASSERT_TRUE(MergeAttentionStates(c.Params()).ok());
  c.Expect(c.out, c.lse);
}

TEST(MergeAttentionStatesTest, BothEmptyGivesZeroAndNegInf) {
  MergeCase c(2);
  std::fill(c.lse_a.begin(), c.lse_a.end(), kNegInf);
  std::fill(c.lse_b.begin(), c.lse_b.end(), kNegInf);
  std::fill(c.out_a.begin(), c.out_a.end(), kNaN);  // never read
  std::fill(c.out_b.begin(), c.out_b.end(), kNaN);
  ASSERT_TRUE(MergeAttentionStates(c.Params()).ok());
  for (float x : c.out) EXPECT_EQ(x, 0.0f);
  for (float x : c.lse) EXPECT_EQ(x, kNegInf);
}

TEST(MergeAttentionStatesTest, OneEmptyCopiesTheOtherExactly) {
  for (int empty_side = 0; empty_side < 2; ++empty_side) {
    MergeCase c(3);
    auto& empty_lse = empty_side == 0 ? c.lse_a : c.lse_b;
    auto& empty_out = empty_side == 0 ? c.out_a : c.out_b;
    const auto& full_lse = empty_side == 0 ? c.lse_b : c.lse_a;
    const auto& full_out = empty_side == 0 ? c.out_b : c.out_a;
    std::fill(empty_lse.begin(), empty_lse.end(), kNegInf);
    std::fill(empty_out.begin(), empty_out.end(), kNaN);  // an empty part's out is not read
    ASSERT_TRUE(MergeAttentionStates(c.Params()).ok());
    EXPECT_EQ(c.out, full_out) << empty_side;
    EXPECT_EQ(c.lse, full_lse) << empty_side;
  }
}

TEST(MergeAttentionStatesTest, LargeLseDifferencesStayFinite) {
  MergeCase c(4);
  const float offsets[] = {80.0f, -80.0f, 0.0f, 200.0f, -200.0f, 1.0f};
  for (size_t i = 0; i < c.lse_a.size(); ++i) {
    c.lse_a[i] = 50.0f + offsets[i % 6];
    c.lse_b[i] = 50.0f - offsets[i % 6];
  }
  ASSERT_TRUE(MergeAttentionStates(c.Params()).ok());
  for (float x : c.out) ASSERT_TRUE(std::isfinite(x));
  for (float x : c.lse) ASSERT_TRUE(std::isfinite(x));
  c.Expect(c.out, c.lse);
}

TEST(MergeAttentionStatesTest, InPlaceIntoA) {
  MergeCase c(5);
  const MergeCase orig = c;
  MergeAttentionStatesParams p = c.Params();
  p.out = c.out_a.data();
  p.lse = c.lse_a.data();
  ASSERT_TRUE(MergeAttentionStates(p).ok());
  orig.Expect(c.out_a, c.lse_a);
}

TEST(MergeAttentionStatesTest, InPlaceIntoBWithoutGather) {
  MergeCase c(6);
  const MergeCase orig = c;
  MergeAttentionStatesParams p = c.Params();
  p.out = c.out_b.data();
  p.lse = c.lse_b.data();
  ASSERT_TRUE(MergeAttentionStates(p).ok());
  orig.Expect(c.out_b, c.lse_b);
}

TEST(MergeAttentionStatesTest, GatheredRowsBroadcastAndPermute) {
  MergeCase c(7);
  c.rows = 2;
  // b has 2 rows; a's rows read b rows {1, 1}, then {1, 0}.
  for (const std::vector<int32_t>& rows_b : {std::vector<int32_t>{1, 1}, std::vector<int32_t>{1, 0}}) {
    MergeAttentionStatesParams p = c.Params();
    p.rows_b = rows_b.data();
    p.num_rows_b = 2;
    ASSERT_TRUE(MergeAttentionStates(p).ok());
    c.Expect(c.out, c.lse, &rows_b);
  }
}

TEST(MergeAttentionStatesTest, NullLseIsNotWritten) {
  MergeCase c(8);
  MergeAttentionStatesParams p = c.Params();
  p.lse = nullptr;
  ASSERT_TRUE(MergeAttentionStates(p).ok());
  MergeCase d(8);
  ASSERT_TRUE(MergeAttentionStates(d.Params()).ok());
  EXPECT_EQ(c.out, d.out);
}

// ---- Validation -----------------------------------------------------------------------------------

void ExpectInvalid(const absl::Status& st, const std::string& field) {
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find(field), std::string::npos) << st << " should name " << field;
}

TEST(PrefixAttentionTest, Validation) {
  std::vector<float> q(2 * 4 * 8), kv(3 * 2 * 8), out(2 * 4 * 8), lse(2 * 4);
  const int32_t slots[2] = {0, 2};
  auto valid = [&] {
    PrefixAttentionParams p;
    p.q = q.data();
    p.k_cache = kv.data();
    p.v_cache = kv.data();
    p.prefix_slots = slots;
    p.out = out.data();
    p.lse = lse.data();
    p.rows = 2;
    p.prefix_len = 2;
    p.num_slots = 3;
    p.num_heads = 4;
    p.num_kv_heads = 2;
    p.head_dim = 8;
    p.scale = 0.25f;
    return p;
  };
  ASSERT_TRUE(PrefixAttention(valid()).ok());
  PrefixAttentionParams p = valid();
  p.q = nullptr;
  ExpectInvalid(PrefixAttention(p), "q is null");
  p = valid();
  p.k_cache = nullptr;
  ExpectInvalid(PrefixAttention(p), "k_cache");
  p = valid();
  p.v_cache = nullptr;
  ExpectInvalid(PrefixAttention(p), "v_cache");
  p = valid();
  p.out = nullptr;
  ExpectInvalid(PrefixAttention(p), "out");
  p = valid();
  p.lse = nullptr;
  ExpectInvalid(PrefixAttention(p), "lse");
  p = valid();
  p.prefix_slots = nullptr;
  ExpectInvalid(PrefixAttention(p), "prefix_slots");
  p = valid();
  p.rows = -1;
  ExpectInvalid(PrefixAttention(p), "rows");
  p = valid();
  p.prefix_len = -2;
  ExpectInvalid(PrefixAttention(p), "prefix_len");
  p = valid();
  p.num_heads = 0;
  ExpectInvalid(PrefixAttention(p), "num_heads");
  p = valid();
  p.num_kv_heads = 3;
  ExpectInvalid(PrefixAttention(p), "num_kv_heads");
  p = valid();
  p.head_dim = -8;
  ExpectInvalid(PrefixAttention(p), "head_dim");
  p = valid();
  p.num_slots = 0;
  ExpectInvalid(PrefixAttention(p), "num_slots");
  p = valid();
  p.scale = 0.0f;
  ExpectInvalid(PrefixAttention(p), "scale");
  p = valid();
  const int32_t bad_slots[2] = {0, 3};
  p.prefix_slots = bad_slots;
  ExpectInvalid(PrefixAttention(p), "prefix_slots[1]");
  p = valid();
  p.rows = 0;  // no-op
  EXPECT_TRUE(PrefixAttention(p).ok());
}

TEST(MergeAttentionStatesTest, Validation) {
  MergeCase c(9);
  ASSERT_TRUE(MergeAttentionStates(c.Params()).ok());
  MergeAttentionStatesParams p = c.Params();
  p.out_a = nullptr;
  ExpectInvalid(MergeAttentionStates(p), "out_a");
  p = c.Params();
  p.lse_a = nullptr;
  ExpectInvalid(MergeAttentionStates(p), "lse_a");
  p = c.Params();
  p.out_b = nullptr;
  ExpectInvalid(MergeAttentionStates(p), "out_b");
  p = c.Params();
  p.lse_b = nullptr;
  ExpectInvalid(MergeAttentionStates(p), "lse_b");
  p = c.Params();
  p.out = nullptr;
  ExpectInvalid(MergeAttentionStates(p), "out is null");
  p = c.Params();
  p.rows = -1;
  ExpectInvalid(MergeAttentionStates(p), "rows");
  p = c.Params();
  p.num_heads = 0;
  ExpectInvalid(MergeAttentionStates(p), "num_heads");
  p = c.Params();
  p.head_dim = -1;
  ExpectInvalid(MergeAttentionStates(p), "head_dim");
  const int32_t rows_b[2] = {0, 2};
  p = c.Params();
  p.rows_b = rows_b;
  p.num_rows_b = 2;
  ExpectInvalid(MergeAttentionStates(p), "rows_b[1]");
  p.num_rows_b = -1;
  ExpectInvalid(MergeAttentionStates(p), "num_rows_b");
  p.num_rows_b = 3;
  p.out = c.out_b.data();
  ExpectInvalid(MergeAttentionStates(p), "out_b");
}

}  // namespace
}  // namespace tandem::kernels::cpu
