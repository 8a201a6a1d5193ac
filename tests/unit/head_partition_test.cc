// The head partition's column slices (common/head_partition.h): PackHeadSlice and UnpackHeadSlice
// through the host MemorySpace against a per-element reference written from the layout (q heads,
// then k heads, then v heads; output heads in order), on random shapes (H, Hkv, d, M, T) and
// element sizes, with guard bytes around every output (equal slices, and the unequal ones where
// the ranks do not divide the KV heads); the setting's parsing and the check of a KV head per
// rank.
#include "common/head_partition.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tandem {
namespace {

constexpr size_t kGuard = 64;  // bytes before and after every output buffer
constexpr uint8_t kGuardByte = 0xa5;

// A buffer of `bytes` with guard bytes on both sides.
struct Guarded {
  explicit Guarded(size_t bytes, uint8_t fill) : data(bytes + 2 * kGuard, kGuardByte) {
    std::memset(data.data() + kGuard, fill, bytes);
  }
  uint8_t* get() { return data.data() + kGuard; }
  const uint8_t* get() const { return data.data() + kGuard; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (data[i] != kGuardByte || data[data.size() - 1 - i] != kGuardByte) return false;
    }
    return true;
  }
  std::vector<uint8_t> data;
};

// Every byte of a q,k,v row says where it came from (row, column), so a misplaced one names itself.
uint8_t Origin(int64_t row, int64_t byte) { return static_cast<uint8_t>(row * 131 + byte * 7 + 1); }

struct Shape {
  int64_t heads, kv_heads, head_dim, ranks, rows;
  size_t elem;
};

Shape RandomShape(std::mt19937& rng) {
  auto u = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  Shape s;
  s.ranks = u(0, 1) ? int64_t{1} << u(0, 3) : u(1, 7);  // 1, 2, 4, 8, or any up to 7
  // A multiple of M (a deployment's slices), or any number from M up (slices that differ by one).
  s.kv_heads = u(0, 1) ? s.ranks * u(1, 3) : u(s.ranks, 3 * s.ranks);
  s.heads = s.kv_heads * u(1, 4);                 // GQA groups of 1..4 (MHA included)
  s.head_dim = u(0, 1) ? u(1, 9) : 16 * u(1, 8);  // odd and aligned
  s.rows = u(0, 3) == 0 ? 1 : u(1, 37);
  s.elem = u(0, 1) ? 2 : 4;
  return s;
}

HeadSlice SliceOf(const Shape& s, int64_t rank) {
  return {.num_heads = s.heads,
          .num_kv_heads = s.kv_heads,
          .head_dim = s.head_dim,
          .num_ranks = s.ranks,
          .rank = rank};
}

TEST(HeadSlice, WidthsAndGqaGroupsOfASlice) {
  const HeadSlice s{.num_heads = 32, .num_kv_heads = 8, .head_dim = 128, .num_ranks = 4, .rank = 2};
  EXPECT_EQ(s.kv_head_begin(), 4);
  EXPECT_EQ(s.kv_head_end(), 6);
  EXPECT_EQ(s.slice_heads(), 8);
  EXPECT_EQ(s.slice_kv_heads(), 2);
  EXPECT_EQ(s.qkv_width(), (32 + 16) * 128);
  EXPECT_EQ(s.slice_qkv_width(), (8 + 4) * 128);
  EXPECT_EQ(s.q_dim(), 32 * 128);
  EXPECT_EQ(s.slice_q_dim(), 8 * 128);
  // Local query head j of rank m is global head m·H/M + j, whose KV head (global / G) is the
  // slice's local KV head j / G: the slice is a model of H/M and Hkv/M heads with the same groups.
  for (int64_t ranks : {1, 2, 4, 8}) {
    for (int64_t m = 0; m < ranks; ++m) {
      const HeadSlice t{.num_heads = 32, .num_kv_heads = 8, .head_dim = 4, .num_ranks = ranks, .rank = m};
      const int64_t g = t.num_heads / t.num_kv_heads;
      for (int64_t j = 0; j < t.slice_heads(); ++j) {
        EXPECT_EQ((m * t.slice_heads() + j) / g, t.kv_head_begin() + j / g) << m << " of " << ranks;
      }
    }
  }
  // Three survivors of four ranks over 8 KV heads: slices of 2, 3 and 3 KV heads that tile the row.
  int64_t next = 0;
  for (int64_t m = 0; m < 3; ++m) {
    const HeadSlice t{.num_heads = 32, .num_kv_heads = 8, .head_dim = 128, .num_ranks = 3, .rank = m};
    EXPECT_EQ(t.kv_head_begin(), next);
    EXPECT_EQ(t.slice_kv_heads(), m == 0 ? 2 : 3);
    EXPECT_EQ(t.slice_heads(), 4 * t.slice_kv_heads());
    EXPECT_EQ(t.slice_qkv_width(), 6 * t.slice_kv_heads() * 128);
    EXPECT_EQ(t.slice_q_dim(), 4 * t.slice_kv_heads() * 128);
    next = t.kv_head_end();
  }
  EXPECT_EQ(next, 8);
}

TEST(HeadSlice, PackMatchesTheLayoutOnRandomShapes) {
  std::mt19937 rng(2024);
  HostMemorySpace memory;
  for (int iter = 0; iter < 300; ++iter) {
    const Shape sh = RandomShape(rng);
    SCOPED_TRACE(testing::Message() << "H " << sh.heads << " Hkv " << sh.kv_heads << " d " << sh.head_dim
                                    << " M " << sh.ranks << " T " << sh.rows << " elem " << sh.elem);
    const int64_t d = sh.head_dim, e = static_cast<int64_t>(sh.elem);
    const int64_t row_bytes = (sh.heads + 2 * sh.kv_heads) * d * e;
    std::vector<uint8_t> qkv(static_cast<size_t>(sh.rows * row_bytes));
    for (int64_t r = 0; r < sh.rows; ++r) {
      for (int64_t b = 0; b < row_bytes; ++b) qkv[static_cast<size_t>(r * row_bytes + b)] = Origin(r, b);
    }
    for (int64_t m = 0; m < sh.ranks; ++m) {
      const HeadSlice slice = SliceOf(sh, m);
      const int64_t packed_row = slice.slice_qkv_width() * e;
      Guarded packed(static_cast<size_t>(sh.rows * packed_row), 0);
      ASSERT_TRUE(PackHeadSlice(memory, slice, sh.rows, sh.elem, qkv.data(), packed.get()).ok());
      ASSERT_TRUE(packed.GuardsIntact());
      // The reference: head by head. Local head j of the q part is global q head b·G + j; of the
      // k and v parts, global KV head b + j, where b = m·Hkv/M (rounded down) begins the slice.
      const int64_t b = m * sh.kv_heads / sh.ranks, hkv = (m + 1) * sh.kv_heads / sh.ranks - b;
      const int64_t g = sh.heads / sh.kv_heads, hq = hkv * g;
      for (int64_t r = 0; r < sh.rows; ++r) {
        int64_t out = 0;
        auto expect_head = [&](int64_t src_head_byte) {
          for (int64_t b = 0; b < d * e; ++b, ++out) {
            ASSERT_EQ(packed.get()[r * packed_row + out], Origin(r, src_head_byte + b))
                << "rank " << m << " row " << r << " packed byte " << out;
          }
        };
        for (int64_t j = 0; j < hq; ++j) expect_head((b * g + j) * d * e);
        for (int64_t j = 0; j < hkv; ++j) expect_head((sh.heads + b + j) * d * e);
        for (int64_t j = 0; j < hkv; ++j) expect_head((sh.heads + sh.kv_heads + b + j) * d * e);
        ASSERT_EQ(out, packed_row);
      }
    }
  }
}

TEST(HeadSlice, UnpackOfEveryRankFillsTheOutputOnRandomShapes) {
  std::mt19937 rng(77);
  HostMemorySpace memory;
  for (int iter = 0; iter < 300; ++iter) {
    const Shape sh = RandomShape(rng);
    SCOPED_TRACE(testing::Message() << "H " << sh.heads << " Hkv " << sh.kv_heads << " d " << sh.head_dim
                                    << " M " << sh.ranks << " T " << sh.rows << " elem " << sh.elem);
    const int64_t d = sh.head_dim, e = static_cast<int64_t>(sh.elem);
    const int64_t attn_row = sh.heads * d * e, g = sh.heads / sh.kv_heads;
    Guarded attn(static_cast<size_t>(sh.rows * attn_row), 0);
    // Rank m's output byte b of row r is Origin(r, m·10007 + b).
    for (int64_t m = 0; m < sh.ranks; ++m) {
      const HeadSlice slice = SliceOf(sh, m);
      const int64_t out_row = slice.slice_q_dim() * e;
      std::vector<uint8_t> out(static_cast<size_t>(sh.rows * out_row));
      for (int64_t r = 0; r < sh.rows; ++r) {
        for (int64_t b = 0; b < out_row; ++b)
          out[static_cast<size_t>(r * out_row + b)] = Origin(r, m * 10007 + b);
      }
      ASSERT_TRUE(UnpackHeadSlice(memory, slice, sh.rows, sh.elem, out.data(), attn.get()).ok());
      ASSERT_TRUE(attn.GuardsIntact());
    }
    // The reference: global output head h (of KV head h / G) comes from the rank whose slice
    // [m·Hkv/M, (m+1)·Hkv/M) holds that KV head, its local head h - (m·Hkv/M)·G.
    for (int64_t r = 0; r < sh.rows; ++r) {
      for (int64_t h = 0; h < sh.heads; ++h) {
        int64_t m = 0;
        while ((m + 1) * sh.kv_heads / sh.ranks <= h / g) ++m;
        const int64_t j = h - (m * sh.kv_heads / sh.ranks) * g;
        for (int64_t b = 0; b < d * e; ++b) {
          ASSERT_EQ(attn.get()[r * attn_row + h * d * e + b], Origin(r, m * 10007 + j * d * e + b))
              << "row " << r << " head " << h << " byte " << b;
        }
      }
    }
  }
}

TEST(HeadSlice, CopyStridedHostCopiesRowsBetweenPitches) {
  std::vector<uint8_t> src(5 * 11), dst(5 * 7, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i + 1);
  CopyStridedHost(dst.data() + 1, 7, src.data() + 2, 11, 4, 5);
  for (size_t r = 0; r < 5; ++r) {
    for (size_t c = 0; c < 7; ++c) {
      const uint8_t want = c >= 1 && c < 5 ? src[r * 11 + 2 + (c - 1)] : 0;
      EXPECT_EQ(dst[r * 7 + c], want) << r << "," << c;
    }
  }
  CopyStridedHost(dst.data(), 7, src.data(), 11, 0, 5);  // nothing to copy
}

TEST(AttentionPartitionSetting, ParseNameAndDivisibility) {
  ASSERT_TRUE(ParseAttentionPartition("request").ok());
  EXPECT_EQ(*ParseAttentionPartition("request"), AttentionPartition::kRequest);
  EXPECT_EQ(*ParseAttentionPartition("head"), AttentionPartition::kHead);
  EXPECT_STREQ(AttentionPartitionName(AttentionPartition::kRequest), "request");
  EXPECT_STREQ(AttentionPartitionName(AttentionPartition::kHead), "head");
  for (const char* bad : {"", "Head", "heads", "tensor"}) {
    absl::StatusOr<AttentionPartition> p = ParseAttentionPartition(bad);
    ASSERT_FALSE(p.ok()) << bad;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(p.status().message(),
              std::string("memory.partition: expected request or head, got \"") + bad + "\"");
  }
  EXPECT_TRUE(CheckAttentionPartition(AttentionPartition::kRequest, 8, 3).ok());
  EXPECT_TRUE(CheckAttentionPartition(AttentionPartition::kHead, 8, 4).ok());
  EXPECT_TRUE(CheckAttentionPartition(AttentionPartition::kHead, 8, 8).ok());
  EXPECT_TRUE(CheckAttentionPartition(AttentionPartition::kHead, 8, 3).ok());  // slices of 2, 3 and 3
  const absl::Status st = CheckAttentionPartition(AttentionPartition::kHead, 2, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      st.message(),
      "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks (3)");
  EXPECT_FALSE(CheckAttentionPartition(AttentionPartition::kHead, 8, 9).ok());
}

}  // namespace
}  // namespace tandem
