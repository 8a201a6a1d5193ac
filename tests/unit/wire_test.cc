// Tests of common/wire.h: CRC-32C, step plan, layer message header and control message frames
// (round trips, golden bytes, truncation, byte flips, forged counts and lengths, field ranges, the
// links between step plan records, PeekFrameMagic, status conversions, a randomized corpus).
#include "common/wire.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <new>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

// Records the largest single allocation while `g_track_allocs` is set, so the forged-count test
// can show the decoder allocated nothing proportional to the count.
namespace {
std::atomic<bool> g_track_allocs{false};
std::atomic<size_t> g_max_alloc{0};
}  // namespace

// GCC 12 flags free() on memory from the (replaced) operator new as mismatched once both are
// inlined into a caller: a false positive, since this operator new allocates with malloc.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(size_t n) {
  if (g_track_allocs.load(std::memory_order_relaxed)) {
    size_t prev = g_max_alloc.load(std::memory_order_relaxed);
    while (n > prev && !g_max_alloc.compare_exchange_weak(prev, n)) {
    }
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

namespace tandem {
namespace {

using Bytes = std::vector<uint8_t>;
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr uint64_t kU64Max = std::numeric_limits<uint64_t>::max();
constexpr uint32_t kU32Max = std::numeric_limits<uint32_t>::max();

::testing::AssertionResult Contains(const char* haystack_expr, const char* needle_expr,
                                    const std::string& haystack, const std::string& needle) {
  if (haystack.find(needle) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << haystack_expr << " does not contain " << needle_expr
                                       << "\n  haystack: " << haystack << "\n  needle: " << needle;
}
#define EXPECT_CONTAINS(haystack, needle) EXPECT_PRED_FORMAT2(Contains, haystack, needle)

absl::Span<const uint8_t> AsSpan(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Little-endian writer for hand-built bodies: independent of the library's encoder.
// The decoders' message for a frame of an older wire version, after "<format>: version N".
constexpr char kOlderVersion[] =
    " at byte offset 4 is older than the supported version 13 (versions 2 to 4 changed the hello, step plan "
    "and replica result layouts; 5 added the heartbeat; 6 the rotational pipeline's hello field and "
    "messages; 7 the step discard; 8 the step plan's next-use records; 9 the evictions' tokens and the "
    "persisted blocks report; 10 the restores' segments and the hello's rope; 11 the step discard's lost "
    "memory ranks; 12 the hello's compute mask and the memory rejoin; 13 the head split and the step "
    "discard's drop)";

struct Le {
  Bytes b;
  Le& U8(uint8_t v) {
    b.push_back(v);
    return *this;
  }
  Le& U16(uint16_t v) { return U8(v & 0xff).U8(v >> 8); }
  Le& U32(uint32_t v) { return U16(v & 0xffff).U16(v >> 16); }
  Le& U64(uint64_t v) { return U32(static_cast<uint32_t>(v)).U32(static_cast<uint32_t>(v >> 32)); }
  Le& I32(int32_t v) { return U32(static_cast<uint32_t>(v)); }
  Le& F32(float v) { return U32(std::bit_cast<uint32_t>(v)); }
  Le& F64(double v) { return U64(std::bit_cast<uint64_t>(v)); }
};

// A frame around `body` with explicit header fields; the crc is computed unless given.
Bytes MakeFrame(uint32_t magic, const Bytes& body, uint16_t version = kWireVersion,
                uint16_t header_bytes = 16, std::optional<uint32_t> crc = std::nullopt) {
  Le f;
  f.U32(magic).U16(version).U16(header_bytes).U32(static_cast<uint32_t>(body.size()));
  f.U32(crc ? *crc : Crc32c(body));
  f.b.insert(f.b.end(), body.begin(), body.end());
  return f.b;
}

// Step plan records as raw wire fields, so tests can write values the structs cannot hold. The
// defaults make a valid plan: every record of memory rank 1, each publish naming request 7.
struct RawRequest {
  uint64_t request_id = 7;
  uint64_t seed = 1;
  uint64_t counter = 2;
  uint64_t attach_hash = 0;
  int32_t prefix_group = -1;
  int32_t position = 10;
  int32_t q_len = 2;
  int32_t kv_len = 12;
  float temperature = 0.7f;
  int32_t top_k = 50;
  float top_p = 0.9f;
  uint16_t memory_rank = 1;
  uint8_t sample = 1;
  uint8_t top_logprobs = 3;
};

struct RawGroup {
  uint64_t block_hash = 0xb10c;
  int32_t prefix_tokens = 16;
  int32_t parent = -1;
  uint16_t memory_rank = 1;
  uint8_t reserved[6] = {0, 0, 0, 0, 0, 0};
};

struct RawPublish {
  uint64_t request_id = 7;
  uint64_t block_hash = 0x9b;
  uint64_t parent_hash = 0x9a;
  int32_t block_index = 1;
  uint16_t memory_rank = 1;
  uint8_t reserved[2] = {0, 0};
};

struct RawEvict {
  uint64_t block_hash = 0xe1;
  uint16_t memory_rank = 1;
  uint16_t token_count = 0;  // its tokens are not written (PlanBody): a forged count
  uint8_t reserved[4] = {0, 0, 0, 0};
};

struct RawPlan {
  uint64_t step_id = 3;
  uint8_t micro_batch = 0;
  uint8_t micro_batches = 1;
  uint8_t reserved[6] = {0, 0, 0, 0, 0, 0};
  std::vector<RawRequest> requests;
  std::vector<RawGroup> groups;
  std::vector<RawPublish> publishes;
  std::vector<RawEvict> evictions;
  // Counts written instead of the vectors' sizes.
  std::optional<uint32_t> request_count, group_count, publish_count, evict_count;
};

Bytes PlanBody(const RawPlan& p) {
  auto count = [](std::optional<uint32_t> forced, size_t n) {
    return forced ? *forced : static_cast<uint32_t>(n);
  };
  Le w;
  w.U64(p.step_id).U32(count(p.request_count, p.requests.size())).U32(count(p.group_count, p.groups.size()));
  w.U32(count(p.publish_count, p.publishes.size())).U32(count(p.evict_count, p.evictions.size()));
  w.U8(p.micro_batch).U8(p.micro_batches);
  for (uint8_t r : p.reserved) w.U8(r);
  for (const RawRequest& q : p.requests) {
    w.U64(q.request_id).U64(q.seed).U64(q.counter).U64(q.attach_hash);
    w.I32(q.prefix_group).I32(q.position).I32(q.q_len).I32(q.kv_len);
    w.F32(q.temperature).I32(q.top_k).F32(q.top_p);
    w.U16(q.memory_rank).U8(q.sample).U8(q.top_logprobs);
  }
  for (const RawGroup& g : p.groups) {
    w.U64(g.block_hash).I32(g.prefix_tokens).I32(g.parent).U16(g.memory_rank);
    for (uint8_t r : g.reserved) w.U8(r);
  }
  for (const RawPublish& x : p.publishes) {
    w.U64(x.request_id).U64(x.block_hash).U64(x.parent_hash).I32(x.block_index).U16(x.memory_rank);
    for (uint8_t r : x.reserved) w.U8(r);
  }
  for (const RawEvict& e : p.evictions) {
    w.U64(e.block_hash).U16(e.memory_rank).U16(e.token_count);
    for (uint8_t r : e.reserved) w.U8(r);
  }
  return w.b;
}

Bytes PlanFrame(const RawPlan& p) { return MakeFrame(kStepPlanMagic, PlanBody(p)); }

// A valid plan of 5 requests (ids 100..104; request 4 in group 2 of rank 2, requests 1 and 2 in
// the nested group 1, request 3 attaching), 3 groups, 2 publishes and 2 evictions; micro-batch 2
// of 3. Frame offsets: micro_batch at 40, micro_batches at 41, reserved at 42..47, requests at
// 48, groups at 368, publishes at 440, evictions at 504, end at 536.
RawPlan FullRawPlan() {
  RawPlan p;
  p.step_id = 9;
  p.micro_batch = 2, p.micro_batches = 3;
  p.requests.resize(5);
  for (size_t i = 0; i < 5; ++i) p.requests[i].request_id = 100 + i;
  p.requests[0].prefix_group = 0;
  p.requests[1].prefix_group = p.requests[2].prefix_group = 1;
  p.requests[3].attach_hash = 0xa77ac4;
  p.requests[4].memory_rank = 2, p.requests[4].prefix_group = 2;
  p.groups.resize(3);
  p.groups[0].block_hash = 0x10, p.groups[0].prefix_tokens = 16;
  p.groups[1].block_hash = 0x11, p.groups[1].prefix_tokens = 32, p.groups[1].parent = 0;
  p.groups[2].block_hash = 0x10, p.groups[2].prefix_tokens = 16, p.groups[2].memory_rank = 2;
  p.publishes.resize(2);
  p.publishes[0].request_id = 101, p.publishes[0].block_hash = 0x20, p.publishes[0].block_index = 0;
  p.publishes[0].parent_hash = 0;
  p.publishes[1].request_id = 104, p.publishes[1].block_hash = 0x20, p.publishes[1].memory_rank = 2;
  p.evictions.resize(2);
  p.evictions[0].block_hash = 0x30;
  p.evictions[1].block_hash = 0x30, p.evictions[1].memory_rank = 2;
  return p;
}

struct RawHeader {
  uint64_t step_id = 5;
  uint64_t seqno = 9;
  uint64_t payload_bytes = 3 * 128;
  uint32_t layer = 4;
  uint32_t rows = 3;
  uint32_t row_bytes = 128;
  uint32_t payload_crc32c = 0x12345678;
  uint8_t kind = 1;
  uint8_t dtype = 1;
  uint8_t reserved[6] = {0, 0, 0, 0, 0, 0};
};

Bytes HeaderBody(const RawHeader& h) {
  Le w;
  w.U64(h.step_id).U64(h.seqno).U64(h.payload_bytes).U32(h.layer).U32(h.rows).U32(h.row_bytes);
  w.U32(h.payload_crc32c).U8(h.kind).U8(h.dtype);
  for (uint8_t r : h.reserved) w.U8(r);
  return w.b;
}

StepRequest RandomRequest(std::mt19937_64& rng, bool extreme) {
  auto u = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  StepRequest q;
  if (!extreme) {
    q.request_id = rng();
    q.memory_rank = static_cast<uint16_t>(u(0, 7));
    q.position = static_cast<int32_t>(u(0, 4096));
    q.q_len = static_cast<int32_t>(u(1, 512));
    q.kv_len = q.position + q.q_len + static_cast<int32_t>(u(0, 2));
    if (q.position > 0 && u(0, 2) == 0) q.attach_hash = rng() | 1;
    q.sample = u(0, 1) == 1;
    q.temperature = std::uniform_real_distribution<float>(0.0f, 2.0f)(rng);
    q.top_k = static_cast<int32_t>(u(0, 100));
    q.top_p = std::uniform_real_distribution<float>(0.01f, 1.0f)(rng);
    q.seed = rng();
    q.counter = rng();
    q.top_logprobs = static_cast<uint8_t>(u(0, kMaxTopLogprobs));
    return q;
  }
  const float temps[] = {0.0f, -0.0f, std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()};
  const float top_ps[] = {1.0f, std::numeric_limits<float>::denorm_min(), std::nextafter(1.0f, 0.0f),
                          std::numeric_limits<float>::min()};
  q.request_id = u(0, 1) ? kU64Max : 0;
  q.memory_rank = u(0, 1) ? 0xffff : 0;
  switch (u(0, 2)) {
    case 0:
      q.position = 0, q.q_len = kI32Max, q.kv_len = kI32Max;
      break;
    case 1:
      q.position = kI32Max - 1, q.q_len = 1, q.kv_len = kI32Max;
      q.attach_hash = u(0, 1) ? kU64Max : 1;
      break;
    default:
      q.position = 0, q.q_len = 1, q.kv_len = kI32Max;
  }
  q.sample = u(0, 1) == 1;
  q.temperature = temps[u(0, 4)];
  q.top_k = u(0, 1) ? kI32Max : 0;
  q.top_p = top_ps[u(0, 3)];
  q.seed = u(0, 1) ? kU64Max : 0;
  q.counter = u(0, 1) ? kU64Max : 0;
  q.top_logprobs = u(0, 1) ? kMaxTopLogprobs : 0;
  return q;
}

// A valid plan of `n` requests with prefix groups (some nested), publishes and evictions: at least
// one of each when n >= 1 (evictions and groups also when n == 0), and a random micro-batch.
// `extreme` uses limit values (the last of kMaxMicroBatches micro-batches).
StepPlan RandomPlan(std::mt19937_64& rng, size_t n, bool extreme) {
  auto u = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  StepPlan plan;
  plan.step_id = extreme ? kU64Max : rng();
  plan.micro_batches = static_cast<uint8_t>(extreme ? kMaxMicroBatches : u(1, kMaxMicroBatches));
  plan.micro_batch = static_cast<uint8_t>(extreme ? plan.micro_batches - 1 : u(0, plan.micro_batches - 1));
  for (size_t i = 0; i < n; ++i) plan.requests.push_back(RandomRequest(rng, extreme));
  auto by_rank = [&] {  // a valid plan lists its requests in memory rank order
    std::stable_sort(
        plan.requests.begin(), plan.requests.end(),
        [](const StepRequest& a, const StepRequest& b) { return a.memory_rank < b.memory_rank; });
  };
  if (extreme) {
    by_rank();
    // Groups 0 <- 1 of rank 0xffff, group 2 of rank 0; requests join the deepest or none.
    plan.groups = {{kU64Max, 1, -1, 0xffff}, {0, kI32Max, 0, 0xffff}, {kU64Max, kI32Max, -1, 0}};
    for (StepRequest& q : plan.requests) {
      q.prefix_group = q.memory_rank == 0 ? (u(0, 1) ? 2 : -1) : static_cast<int32_t>(u(0, 1));
    }
    for (size_t i = 0; i < std::min<size_t>(n, 2); ++i) {
      const StepRequest& q = plan.requests[i];
      plan.publishes.push_back(i == 0 ? PrefixPublish{q.request_id, kU64Max, kU64Max, kI32Max, q.memory_rank}
                                      : PrefixPublish{q.request_id, 0, 0, 0, q.memory_rank});
    }
    plan.evictions = {{kU64Max, 0xffff}, {0, 0}, {kU64Max, 0}, {0, 0xffff}};
    return plan;
  }
  // Groups: some nest in an earlier group of their rank with a shorter prefix.
  const size_t num_groups = u(1, 6);
  for (size_t i = 0; i < num_groups; ++i) {
    PrefixGroup g;
    g.block_hash = rng();
    g.memory_rank = static_cast<uint16_t>(u(0, 3));
    g.prefix_tokens = static_cast<int32_t>(u(1, 4096));
    std::vector<int32_t> parents;
    for (size_t j = 0; j < i; ++j) {
      const PrefixGroup& p = plan.groups[j];
      if (p.memory_rank == g.memory_rank && p.prefix_tokens < g.prefix_tokens) {
        parents.push_back(static_cast<int32_t>(j));
      }
    }
    if (!parents.empty() && u(0, 3) != 0) g.parent = parents[u(0, parents.size() - 1)];
    plan.groups.push_back(g);
  }
  for (StepRequest& q : plan.requests) {
    if (u(0, 2) == 0) continue;
    q.prefix_group = static_cast<int32_t>(u(0, plan.groups.size() - 1));
    q.memory_rank = plan.groups[q.prefix_group].memory_rank;
  }
  by_rank();  // joining a group moved requests between ranks
  // Publishes and evictions of distinct (memory_rank, block_hash) each (random hashes; rarely
  // repeated by chance, and then dropped).
  auto distinct = [](const auto& records, uint16_t rank, uint64_t hash) {
    return std::none_of(records.begin(), records.end(),
                        [&](const auto& x) { return x.memory_rank == rank && x.block_hash == hash; });
  };
  const size_t num_publishes = n == 0 ? 0 : u(1, std::min<size_t>(n, 8));
  for (size_t i = 0; i < num_publishes; ++i) {
    const StepRequest& q = plan.requests[u(0, n - 1)];
    PrefixPublish x;
    x.request_id = q.request_id, x.memory_rank = q.memory_rank;
    x.block_hash = u(0, 3) == 0 ? plan.groups[0].block_hash : rng();  // a group's hash on another rank
    x.block_index = static_cast<int32_t>(u(0, 2) == 0 ? 0 : u(1, 1000));
    x.parent_hash = x.block_index == 0 ? 0 : rng();
    if (distinct(plan.publishes, x.memory_rank, x.block_hash)) plan.publishes.push_back(x);
  }
  const size_t num_evictions = u(1, 6);
  for (size_t i = 0; i < num_evictions; ++i) {
    PrefixEvict e;
    e.block_hash = u(0, 3) == 0 && !plan.publishes.empty() ? plan.publishes[0].block_hash : rng();
    e.memory_rank = static_cast<uint16_t>(u(0, 3));
    if (distinct(plan.evictions, e.memory_rank, e.block_hash)) plan.evictions.push_back(e);
  }
  const size_t num_restores = u(0, 4);
  for (size_t i = 0; i < num_restores; ++i) {
    PrefixRestore e;
    e.block_hash = rng() | 1;
    e.block_index = static_cast<int32_t>(u(0, 3));
    e.parent_hash = e.block_index == 0 ? 0 : (rng() | 1);
    e.memory_rank = static_cast<uint16_t>(u(0, 3));
    const size_t num_segments = u(0, 2) == 0 ? u(1, kMaxPrefixSegments) : 0;
    for (size_t j = 0; j < num_segments; ++j) {
      PrefixSegment g{.source_hash = rng() | 1, .source_index = static_cast<int32_t>(u(0, 1000))};
      g.source_row = static_cast<uint16_t>(u(0, kMaxPrefixBlockTokens - 1));
      g.rows = static_cast<uint16_t>(u(1, kMaxPrefixBlockTokens - g.source_row));
      e.segments.push_back(g);
    }
    if (distinct(plan.restores, e.memory_rank, e.block_hash)) plan.restores.push_back(e);
  }
  return plan;
}

// The frame size of `plan`.
size_t PlanFrameBytes(const StepPlan& plan) {
  return kFrameHeaderBytes + kStepPlanFixedBytes + kStepRequestBytes * plan.requests.size() +
         kPrefixGroupBytes * plan.groups.size() + kPrefixPublishBytes * plan.publishes.size() +
         kPrefixEvictBytes * plan.evictions.size() + kPrefixRestoreBytes * plan.restores.size() +
         std::accumulate(
             plan.restores.begin(), plan.restores.end(), size_t{0},
             [](size_t n, const PrefixRestore& e) { return n + kPrefixSegmentBytes * e.segments.size(); });
}

LayerMessageHeader RandomHeader(std::mt19937_64& rng) {
  LayerMessageHeader h;
  h.step_id = rng();
  h.layer = static_cast<uint32_t>(rng() % 128);
  h.kind = rng() % 2 ? LayerMessageKind::kQkv : LayerMessageKind::kAttnOut;
  h.dtype = static_cast<DType>(rng() % 3);
  h.rows = static_cast<uint32_t>(rng() % 4096);
  h.row_bytes = static_cast<uint32_t>(rng() % 65536) * static_cast<uint32_t>(DTypeSize(h.dtype));
  h.seqno = rng();
  h.payload_bytes = static_cast<uint64_t>(h.rows) * h.row_bytes;
  h.payload_crc32c = static_cast<uint32_t>(rng());
  return h;
}

// A small valid plan of `n` RawRequests (defaults), nothing else.
Bytes SmallPlanFrame(size_t n = 1) {
  RawPlan p;
  p.requests.resize(n);
  return PlanFrame(p);
}

// The instruction path (where the CPU has SSE4.2) and the table agree on every length and
// alignment, random contents.
TEST(Crc32c, FastPathMatchesTheTable) {
  std::mt19937_64 rng(42);
  std::vector<uint8_t> buf(4096 + 16);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  for (size_t off = 0; off < 9; ++off) {
    for (size_t n : {0, 1, 7, 8, 9, 15, 16, 63, 64, 65, 1000, 4096}) {
      const absl::Span<const uint8_t> s(buf.data() + off, n);
      EXPECT_EQ(Crc32c(s), Crc32cPortableForTest(s)) << "offset " << off << " length " << n;
    }
  }
}

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c(AsSpan("123456789")), 0xE3069283u);
  EXPECT_EQ(Crc32c({}), 0u);
  // RFC 3720 (iSCSI), appendix B.4.
  Bytes zeros(32, 0), ones(32, 0xff), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<uint8_t>(i), dec[i] = static_cast<uint8_t>(31 - i);
  EXPECT_EQ(Crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(inc), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(dec), 0x113FDB5Cu);
  // Extend continues a crc.
  const std::string s = "The quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= s.size(); ++cut) {
    EXPECT_EQ(Crc32cExtend(Crc32c(AsSpan(s.substr(0, cut))), AsSpan(s.substr(cut))), Crc32c(AsSpan(s)));
  }
}

TEST(StepPlanWire, RoundTripsRandomPlans) {
  std::mt19937_64 rng(12345);
  for (size_t n : {0, 1, 17, 1000}) {
    for (bool extreme : {false, true}) {
      const StepPlan plan = RandomPlan(rng, n, extreme);
      ASSERT_TRUE(ValidateStepPlan(plan).ok()) << ValidateStepPlan(plan);
      ASSERT_LT(plan.micro_batch, plan.micro_batches);
      ASSERT_FALSE(plan.groups.empty());
      ASSERT_FALSE(plan.evictions.empty());
      ASSERT_EQ(plan.publishes.empty(), n == 0);
      const Bytes frame = EncodeStepPlan(plan);
      ASSERT_EQ(frame.size(), PlanFrameBytes(plan));
      absl::StatusOr<StepPlan> back = DecodeStepPlan(frame);
      ASSERT_TRUE(back.ok()) << "n=" << n << " extreme=" << extreme << ": " << back.status();
      EXPECT_TRUE(*back == plan) << "n=" << n << " extreme=" << extreme;
      EXPECT_EQ(EncodeStepPlan(*back), frame);
      EXPECT_EQ(frame[40], plan.micro_batch);
      EXPECT_EQ(frame[41], plan.micro_batches);
      // -0.0 keeps its sign bit (operator== cannot tell).
      for (size_t i = 0; i < n; ++i) {
        EXPECT_EQ(std::bit_cast<uint32_t>(back->requests[i].temperature),
                  std::bit_cast<uint32_t>(plan.requests[i].temperature));
      }
    }
  }
}

TEST(StepPlanWire, GoldenBytes) {
  StepPlan plan;
  plan.step_id = 0x0102030405060708;
  plan.micro_batch = 5, plan.micro_batches = 7;
  StepRequest q;
  q.request_id = 0x1122334455667788;
  q.memory_rank = 0x0203;
  q.prefix_group = 0;
  q.attach_hash = 0x0a0b0c0d0e0f1011;
  q.position = 5;
  q.q_len = 3;
  q.kv_len = 8;
  q.sample = true;
  q.temperature = 0.5f;
  q.top_k = 40;
  q.top_p = 0.9f;
  q.seed = 42;
  q.counter = 7;
  q.top_logprobs = 5;
  plan.requests.push_back(q);
  plan.groups.push_back(PrefixGroup{0x2122232425262728, 5, -1, 0x0203});
  plan.publishes.push_back(
      PrefixPublish{0x1122334455667788, 0x3132333435363738, 0x4142434445464748, 1, 0x0203});
  plan.evictions.push_back(PrefixEvict{0x5152535455565758, 0x0405});
  // Layout written out by hand; crc computed independently (bitwise Python reference).
  const Bytes golden = {
      0x54, 0x44, 0x53, 0x50, 0x0d, 0x00, 0x10, 0x00,
      0xa8, 0x00, 0x00, 0x00, 0xce, 0x90, 0x0d, 0xf1,  // frame: version 13, body_bytes 168
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // step_id
      0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // request_count, group_count
      0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // publish_count, evict_count
      0x05, 0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // micro_batch, micro_batches, reserved
      0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // request 0: request_id
      0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // seed
      0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // counter
      0x11, 0x10, 0x0f, 0x0e, 0x0d, 0x0c, 0x0b, 0x0a,  // attach_hash
      0x00, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00,  // prefix_group, position
      0x03, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00,  // q_len, kv_len
      0x00, 0x00, 0x00, 0x3f, 0x28, 0x00, 0x00, 0x00,  // temperature, top_k
      0x66, 0x66, 0x66, 0x3f, 0x03, 0x02, 0x01, 0x05,  // top_p, memory_rank, sample, top_logprobs
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,  // group 0: block_hash
      0x05, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff,  // prefix_tokens, parent
      0x03, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // memory_rank, reserved
      0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // publish 0: request_id
      0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31,  // block_hash
      0x48, 0x47, 0x46, 0x45, 0x44, 0x43, 0x42, 0x41,  // parent_hash
      0x01, 0x00, 0x00, 0x00, 0x03, 0x02, 0x00, 0x00,  // block_index, memory_rank, reserved
      0x58, 0x57, 0x56, 0x55, 0x54, 0x53, 0x52, 0x51,  // eviction 0: block_hash
      0x05, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // memory_rank, reserved
  };
  EXPECT_EQ(EncodeStepPlan(plan), golden);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
}

TEST(LayerMessageWire, RoundTripsAndGoldenBytes) {
  std::mt19937_64 rng(777);
  for (int i = 0; i < 1000; ++i) {
    const LayerMessageHeader h = RandomHeader(rng);
    const Bytes frame = EncodeLayerMessageHeader(h);
    ASSERT_EQ(frame.size(), 64u);
    absl::StatusOr<LayerMessageHeader> back = DecodeLayerMessageHeader(frame);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == h);
  }
  LayerMessageHeader x;
  x.step_id = kU64Max, x.seqno = kU64Max, x.layer = kU32Max, x.rows = kU32Max, x.row_bytes = kU32Max - 3;
  x.payload_bytes = static_cast<uint64_t>(x.rows) * x.row_bytes, x.payload_crc32c = kU32Max;
  x.kind = LayerMessageKind::kAttnOut, x.dtype = DType::kF32;
  absl::StatusOr<LayerMessageHeader> xb = DecodeLayerMessageHeader(EncodeLayerMessageHeader(x));
  ASSERT_TRUE(xb.ok()) << xb.status();
  EXPECT_TRUE(*xb == x);

  LayerMessageHeader h;
  h.step_id = 1, h.seqno = 2, h.payload_bytes = 256, h.layer = 3, h.rows = 4, h.row_bytes = 64;
  h.payload_crc32c = 0xdeadbeef, h.kind = LayerMessageKind::kAttnOut, h.dtype = DType::kBF16;
  const Bytes golden = {
      0x54, 0x44, 0x4c, 0x4d, 0x0d, 0x00, 0x10, 0x00,
      0x30, 0x00, 0x00, 0x00, 0xc4, 0x00, 0x01, 0xea,  // frame
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // id, seq
      0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x03, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00,  // pb, l, r
      0x40, 0x00, 0x00, 0x00, 0xef, 0xbe, 0xad, 0xde,
      0x02, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // rb..
  };
  EXPECT_EQ(EncodeLayerMessageHeader(h), golden);
  absl::StatusOr<LayerMessageHeader> back = DecodeLayerMessageHeader(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == h);

  // pipeline.q_first's two kinds, q (4) and kv (5): the same header in f32, only byte 40 and the
  // body crc differ (crcs from the bitwise Python reference).
  for (const auto& [kind, crc] : {std::pair{LayerMessageKind::kQ, Bytes{0x77, 0x21, 0x62, 0x89}},
                                  std::pair{LayerMessageKind::kKv, Bytes{0x50, 0x5c, 0x5e, 0xc0}}}) {
    LayerMessageHeader q = h;
    q.kind = kind, q.dtype = DType::kF32;
    Bytes want = golden;
    std::copy(crc.begin(), crc.end(), want.begin() + 12);
    want[16 + 40] = static_cast<uint8_t>(kind), want[16 + 41] = 0;
    EXPECT_EQ(EncodeLayerMessageHeader(q), want);
    absl::StatusOr<LayerMessageHeader> qb = DecodeLayerMessageHeader(want);
    ASSERT_TRUE(qb.ok()) << qb.status();
    EXPECT_TRUE(*qb == q);
  }
}

TEST(StepPlanWire, HandBuiltBodyMatchesEncoder) {
  for (const Bytes& frame : {SmallPlanFrame(3), PlanFrame(FullRawPlan()), PlanFrame(RawPlan{})}) {
    absl::StatusOr<StepPlan> plan = DecodeStepPlan(frame);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(EncodeStepPlan(*plan), frame);
  }
  const Bytes full = PlanFrame(FullRawPlan());
  ASSERT_EQ(full.size(), 536u);
  const StepPlan plan = DecodeStepPlan(full).value();
  EXPECT_EQ(plan.micro_batch, 2);
  EXPECT_EQ(plan.micro_batches, 3);
  EXPECT_EQ(plan.requests.size(), 5u);
  EXPECT_EQ(plan.requests[3].attach_hash, 0xa77ac4u);
  EXPECT_EQ(plan.requests[4].prefix_group, 2);
  EXPECT_TRUE(plan.groups[1] == (PrefixGroup{0x11, 32, 0, 1}));
  EXPECT_TRUE(plan.publishes[1] == (PrefixPublish{104, 0x20, 0x9a, 1, 2}));
  EXPECT_TRUE(plan.evictions[1] == (PrefixEvict{0x30, 2}));
}

// The micro-batch fields, for every pair of byte values: micro_batch < micro_batches <= 8 decodes
// (from frame offsets 40 and 41) and re-encodes to the same bytes; any other pair is refused by the
// decoder and by ValidateStepPlan with the same error.
TEST(StepPlanWire, MicroBatchFields) {
  const std::string range = " must satisfy micro_batch < micro_batches <= 8";
  const StepPlan bases[] = {DecodeStepPlan(PlanFrame(RawPlan{})).value(),
                            DecodeStepPlan(PlanFrame(FullRawPlan())).value()};
  int valid = 0;
  for (int batches = 0; batches <= 255; ++batches) {
    for (int batch = 0; batch <= 255; ++batch) {
      RawPlan raw = batches % 2 ? FullRawPlan() : RawPlan{};
      raw.micro_batch = static_cast<uint8_t>(batch), raw.micro_batches = static_cast<uint8_t>(batches);
      const Bytes frame = PlanFrame(raw);
      ASSERT_EQ(frame[40], batch);
      ASSERT_EQ(frame[41], batches);
      absl::StatusOr<StepPlan> plan = DecodeStepPlan(frame);
      if (batches >= 1 && batches <= 8 && batch < batches) {
        ++valid;
        ASSERT_TRUE(plan.ok()) << batch << " of " << batches << ": " << plan.status();
        ASSERT_EQ(plan->micro_batch, batch);
        ASSERT_EQ(plan->micro_batches, batches);
        ASSERT_TRUE(ValidateStepPlan(*plan).ok());
        ASSERT_EQ(EncodeStepPlan(*plan), frame) << batch << " of " << batches;
        continue;
      }
      ASSERT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument) << plan.status();
      ASSERT_EQ(plan.status().message(), "step plan: micro_batch " + std::to_string(batch) +
                                             " of micro_batches " + std::to_string(batches) + range);
      StepPlan invalid = bases[batches % 2];
      invalid.micro_batch = static_cast<uint8_t>(batch);
      invalid.micro_batches = static_cast<uint8_t>(batches);
      ASSERT_EQ(ValidateStepPlan(invalid), plan.status());
      // The encoder writes invalid values as given.
      ASSERT_EQ(EncodeStepPlan(invalid), frame);
    }
  }
  EXPECT_EQ(valid, 36);  // 1 + 2 + ... + 8

  // The last micro-batch of the most, 7 of 8, with every record kind; the defaults, 0 of 1.
  RawPlan raw = FullRawPlan();
  raw.micro_batch = 7, raw.micro_batches = 8;
  absl::StatusOr<StepPlan> plan = DecodeStepPlan(PlanFrame(raw));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->micro_batch, 7);
  EXPECT_EQ(plan->micro_batches, 8);
  EXPECT_EQ(plan->requests.size(), 5u);
  EXPECT_EQ(plan->evictions.size(), 2u);
  StepPlan copy = *plan;
  copy.micro_batch = 6;
  EXPECT_FALSE(copy == *plan);  // operator== sees the fields
  absl::StatusOr<StepPlan> back = DecodeStepPlan(EncodeStepPlan(*plan));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == *plan);
  EXPECT_EQ(StepPlan{}.micro_batch, 0);
  EXPECT_EQ(StepPlan{}.micro_batches, 1);
  const Bytes defaults = EncodeStepPlan(StepPlan{});
  ASSERT_EQ(defaults.size(), kFrameHeaderBytes + kStepPlanFixedBytes);
  EXPECT_EQ(defaults, MakeFrame(kStepPlanMagic, Bytes{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                      0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0}));

  // The bytes after them (frame offsets 42..43, reserved before version 8) are next_use_count: a
  // count whose records are missing is truncation.
  for (size_t k = 0; k < 2; ++k) {
    for (uint8_t v : {uint8_t{1}, uint8_t{0x80}, uint8_t{0xff}}) {
      RawPlan p = FullRawPlan();
      p.reserved[k] = v;
      absl::Status s = DecodeStepPlan(PlanFrame(p)).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      const uint32_t count = k == 0 ? v : uint32_t{v} << 8;
      EXPECT_CONTAINS(std::string(s.message()), "step plan: truncated: next_use_count " +
                                                    std::to_string(count) + " needs " +
                                                    std::to_string(16 * count) + " bytes of next uses");
    }
  }
}

TEST(Wire, EveryStrictPrefixIsDataLoss) {
  std::mt19937_64 rng(1);
  const StepPlan random_plan = RandomPlan(rng, 17, false);
  ASSERT_FALSE(random_plan.groups.empty() || random_plan.publishes.empty() || random_plan.evictions.empty());
  const Bytes plan = EncodeStepPlan(random_plan);
  for (size_t n = 0; n < plan.size(); ++n) {
    absl::Status s = DecodeStepPlan(absl::MakeConstSpan(plan.data(), n)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "prefix " << n << ": " << s;
  }
  const Bytes header = EncodeLayerMessageHeader(RandomHeader(rng));
  for (size_t n = 0; n < header.size(); ++n) {
    absl::Status s = DecodeLayerMessageHeader(absl::MakeConstSpan(header.data(), n)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << "prefix " << n << ": " << s;
  }
  EXPECT_CONTAINS(std::string(DecodeStepPlan(absl::MakeConstSpan(plan.data(), 3)).status().message()),
                  "magic needs 4 bytes at byte offset 0");
}

TEST(Wire, EverySingleByteChangeIsRejected) {
  std::mt19937_64 rng(2);
  const Bytes plan = PlanFrame(FullRawPlan());  // every record kind; the crc covers them all
  const Bytes header = EncodeLayerMessageHeader(RandomHeader(rng));
  for (size_t pos = 0; pos < plan.size(); ++pos) {
    for (int mask = 1; mask < 256; ++mask) {
      Bytes f = plan;
      f[pos] ^= static_cast<uint8_t>(mask);
      ASSERT_FALSE(DecodeStepPlan(f).ok()) << "byte " << pos << " ^ " << mask;
    }
  }
  for (size_t pos = 0; pos < header.size(); ++pos) {
    for (int mask = 1; mask < 256; ++mask) {
      Bytes f = header;
      f[pos] ^= static_cast<uint8_t>(mask);
      ASSERT_FALSE(DecodeLayerMessageHeader(f).ok()) << "byte " << pos << " ^ " << mask;
    }
  }
}

TEST(StepPlanWire, ForgedCountsFailFastWithoutAllocating) {
  // One record of each kind present: requests at frame offset 48, the group at 112, the publish
  // at 136, the eviction at 168, the end at 184.
  RawPlan base;
  base.requests.resize(1), base.groups.resize(1), base.publishes.resize(1), base.evictions.resize(1);
  ASSERT_TRUE(DecodeStepPlan(PlanFrame(base)).ok());
  struct Case {
    std::optional<uint32_t> RawPlan::*count;
    const char* field;
    size_t record_bytes;
    const char* contents;
    size_t at;         // frame offset of the area
    size_t remaining;  // body bytes from there
  };
  const Case cases[] = {
      {&RawPlan::request_count, "request_count", 64, "requests", 48, 136},
      {&RawPlan::group_count, "group_count", 24, "groups", 112, 72},
      {&RawPlan::publish_count, "publish_count", 32, "publishes", 136, 48},
      {&RawPlan::evict_count, "evict_count", 16, "evictions", 168, 16},
  };
  for (const Case& c : cases) {
    // The last: one record more than the bytes from the area to the end hold.
    for (uint32_t count : {uint32_t{1} << 31, kU32Max, uint32_t{1} << 28,
                           static_cast<uint32_t>(c.remaining / c.record_bytes + 1)}) {
      RawPlan p = base;
      p.*c.count = count;
      const Bytes frame = PlanFrame(p);
      g_max_alloc = 0;
      g_track_allocs = true;
      const auto start = std::chrono::steady_clock::now();
      absl::Status s = DecodeStepPlan(frame).status();
      const auto elapsed = std::chrono::steady_clock::now() - start;
      g_track_allocs = false;
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_EQ(s.message(), "step plan: truncated: " + std::string(c.field) + " " + std::to_string(count) +
                                 " needs " + std::to_string(uint64_t{count} * c.record_bytes) + " bytes of " +
                                 c.contents + " at byte offset " + std::to_string(c.at) + " but " +
                                 std::to_string(c.remaining) + " remain");
      EXPECT_LT(g_max_alloc.load(), 4096u) << c.field << " " << count;  // only the error message
      EXPECT_LT(elapsed, std::chrono::milliseconds(50));
    }
  }
  // All four forged at once: the first area that does not fit is named; nothing wraps.
  RawPlan p = base;
  p.request_count = p.group_count = p.publish_count = p.evict_count = kU32Max;
  absl::Status s = DecodeStepPlan(PlanFrame(p)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()), "request_count 4294967295 needs 274877906880 bytes");
  // Areas that fit one by one but not together: three groups fit in the bytes after the
  // request, but then the publish does not.
  p = base;
  p.group_count = 3;
  s = DecodeStepPlan(PlanFrame(p)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(
      s.message(),
      "step plan: truncated: publish_count 1 needs 32 bytes of publishes at byte offset 184 but 0 remain");

  // Counts smaller than the records present leave unused bytes.
  p = base;
  p.evict_count = 0;
  s = DecodeStepPlan(PlanFrame(p)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(),
            "step plan: request_count 1, group_count 1, publish_count 1, evict_count 0, restore_count 0 and "
            "next_use_count 0 leave 16 unused body bytes at byte offset 168");
  s = DecodeStepPlan(MakeFrame(kStepPlanMagic, PlanBody(RawPlan{.requests = {RawRequest{}, RawRequest{}},
                                                                .request_count = 1})))
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "next_use_count 0 leave 64 unused body bytes at byte offset 112");
}

TEST(StepPlanWire, FieldRangeViolationsNameFieldAndRequest) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Case {
    std::function<void(RawRequest&)> mutate;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](RawRequest& q) { q.q_len = 0; }, "step plan: request 3: q_len 0 must be >= 1"},
      {[](RawRequest& q) { q.q_len = -5; }, "request 3: q_len -5 must be >= 1"},
      {[](RawRequest& q) { q.prefix_group = -2; }, "request 3: prefix_group -2"},
      {[](RawRequest& q) { q.position = -1; }, "request 3: position -1 must be >= 0"},
      {[](RawRequest& q) { q.position = 0, q.q_len = 4, q.kv_len = 3; },
       "request 3: kv_len 3 must be >= q_len 4"},
      {[](RawRequest& q) { q.position = 10, q.q_len = 4, q.kv_len = 13; },
       "request 3: position 10 + q_len 4 must be <= kv_len 13"},
      {[](RawRequest& q) { q.position = kI32Max, q.q_len = 2, q.kv_len = kI32Max; },
       "request 3: position 2147483647 + q_len 2 must be <= kv_len"},
      {[&](RawRequest& q) { q.temperature = nan; }, "request 3: temperature nan must be finite and >= 0"},
      {[&](RawRequest& q) { q.temperature = inf; }, "request 3: temperature inf"},
      {[](RawRequest& q) { q.temperature = -0.5f; }, "request 3: temperature -0.5"},
      {[](RawRequest& q) { q.top_k = -1; }, "request 3: top_k -1 must be >= 0"},
      {[](RawRequest& q) { q.top_p = 0.0f; }, "request 3: top_p 0 must be in (0, 1]"},
      {[](RawRequest& q) { q.top_p = 1.5f; }, "request 3: top_p 1.5"},
      {[&](RawRequest& q) { q.top_p = nan; }, "request 3: top_p nan"},
      {[](RawRequest& q) { q.top_p = -0.0f; }, "request 3: top_p -0"},
      {[](RawRequest& q) { q.position = 0, q.attach_hash = 1; },
       "request 3: attach_hash 0x0000000000000001 needs position > 0, not 0 (0: no attach)"},
      {[](RawRequest& q) { q.sample = 2; }, "request 3: sample 2 at byte offset 302 must be 0 or 1"},
      {[](RawRequest& q) { q.top_logprobs = 21; }, "request 3: top_logprobs 21 must be <= 20"},
      {[](RawRequest& q) { q.top_logprobs = 255; }, "request 3: top_logprobs 255 must be <= 20"},
  };
  ASSERT_TRUE(DecodeStepPlan(PlanFrame(FullRawPlan())).ok());
  for (const Case& c : cases) {
    RawPlan p = FullRawPlan();
    c.mutate(p.requests[3]);
    absl::Status s = DecodeStepPlan(PlanFrame(p)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
  }
  // Reserved bytes of the fixed part and of the other records (offsets: see FullRawPlan).
  const std::vector<std::pair<std::function<void(RawPlan&)>, std::string>> reserved = {
      {[](RawPlan& p) { p.groups[1].reserved[0] = 1; },
       "step plan: group 1: reserved at byte offset 410 is 1"},
      {[](RawPlan& p) { p.groups[2].reserved[5] = 0x80; },
       "step plan: group 2: reserved at byte offset 439 is 128, must be 0"},
      {[](RawPlan& p) { p.publishes[0].reserved[0] = 2; },
       "step plan: publish 0: reserved at byte offset 470 is 2, must be 0"},
      {[](RawPlan& p) { p.publishes[1].reserved[1] = 3; },
       "step plan: publish 1: reserved at byte offset 503 is 3, must be 0"},
      {[](RawPlan& p) { p.evictions[0].reserved[0] = 4; },
       "step plan: eviction 0: reserved at byte offset 516 is 4, must be 0"},
      {[](RawPlan& p) { p.evictions[1].reserved[3] = 5; },
       "step plan: eviction 1: reserved at byte offset 535 is 5, must be 0"},
  };
  for (const auto& [mutate, want] : reserved) {
    RawPlan p = FullRawPlan();
    mutate(p);
    absl::Status s = DecodeStepPlan(PlanFrame(p)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), want);
  }
  // The struct validator says the same.
  StepPlan plan;
  plan.requests.resize(2);
  plan.requests[1].q_len = 0;
  EXPECT_CONTAINS(std::string(ValidateStepPlan(plan).message()),
                  "step plan: request 1: q_len 0 must be >= 1");
}

// Checks between records: ValidateStepPlan and the decoder (on the encoded plan) report the same
// error, naming the record and field.
TEST(StepPlanWire, PlanLevelViolationsNameRecord) {
  const StepPlan base = DecodeStepPlan(PlanFrame(FullRawPlan())).value();
  ASSERT_TRUE(ValidateStepPlan(base).ok());
  struct Case {
    std::function<void(StepPlan&)> mutate;
    std::string want;  // the whole message
  };
  const std::vector<Case> cases = {
      // Micro-batch (the base is micro_batch 2 of 3).
      {[](StepPlan& p) { p.micro_batches = 0; },
       "step plan: micro_batch 2 of micro_batches 0 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batch = 0, p.micro_batches = 0; },
       "step plan: micro_batch 0 of micro_batches 0 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batches = 9; },
       "step plan: micro_batch 2 of micro_batches 9 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batch = 0, p.micro_batches = 255; },
       "step plan: micro_batch 0 of micro_batches 255 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batch = 3; },
       "step plan: micro_batch 3 of micro_batches 3 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batches = 2; },
       "step plan: micro_batch 2 of micro_batches 2 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batch = 8, p.micro_batches = 8; },
       "step plan: micro_batch 8 of micro_batches 8 must satisfy micro_batch < micro_batches <= 8"},
      {[](StepPlan& p) { p.micro_batch = 255, p.micro_batches = 8; },
       "step plan: micro_batch 255 of micro_batches 8 must satisfy micro_batch < micro_batches <= 8"},
      // Groups.
      {[](StepPlan& p) { p.groups[1].prefix_tokens = 0; },
       "step plan: group 1: prefix_tokens 0 must be >= 1"},
      {[](StepPlan& p) { p.groups[2].prefix_tokens = -4; },
       "step plan: group 2: prefix_tokens -4 must be >= 1"},
      {[](StepPlan& p) { p.groups[2].parent = 3; }, "step plan: group 2: parent 3 must be -1 or < 2"},
      {[](StepPlan& p) { p.groups[2].parent = 2; }, "step plan: group 2: parent 2 must be -1 or < 2"},
      {[](StepPlan& p) { p.groups[0].parent = 0; }, "step plan: group 0: parent 0 must be -1 or < 0"},
      {[](StepPlan& p) { p.groups[1].parent = -2; }, "step plan: group 1: parent -2 must be -1 or < 1"},
      {[](StepPlan& p) { p.groups[1].parent = kI32Max; },
       "step plan: group 1: parent 2147483647 must be -1 or < 1"},
      {[](StepPlan& p) { p.groups[2].parent = 0; },
       "step plan: group 2: memory_rank 2 must equal parent group 0's memory_rank 1"},
      {[](StepPlan& p) { p.groups[1].prefix_tokens = 16; },
       "step plan: group 1: prefix_tokens 16 must be > parent group 0's prefix_tokens 16"},
      {[](StepPlan& p) { p.groups[1].prefix_tokens = 15; },
       "step plan: group 1: prefix_tokens 15 must be > parent group 0's prefix_tokens 16"},
      // Request order.
      {[](StepPlan& p) { std::swap(p.requests[3], p.requests[4]); },
       "step plan: request 4: memory_rank 1 after request 3's memory_rank 2 (requests go in memory rank "
       "order)"},
      // Requests' groups and attach hashes.
      {[](StepPlan& p) { p.requests[3].prefix_group = 3; },
       "step plan: request 3: prefix_group 3 must be -1 (none) or < 3 (the group count)"},
      {[](StepPlan& p) { p.requests[3].prefix_group = kI32Max; },
       "step plan: request 3: prefix_group 2147483647 must be -1 (none) or < 3 (the group count)"},
      {[](StepPlan& p) { p.requests[3].prefix_group = -2; },
       "step plan: request 3: prefix_group -2 must be -1 (none) or >= 0"},
      {[](StepPlan& p) { p.requests[3].prefix_group = 2; },
       "step plan: request 3: memory_rank 1 must equal group 2's memory_rank 2"},
      {[](StepPlan& p) { p.groups.clear(); },
       "step plan: request 0: prefix_group 0 must be -1 (none) or < 0 (the group count)"},
      {[](StepPlan& p) { p.requests[1].position = 0, p.requests[1].attach_hash = kU64Max; },
       "step plan: request 1: attach_hash 0xffffffffffffffff needs position > 0, not 0 (0: no attach)"},
      // Publishes.
      {[](StepPlan& p) { p.publishes[1].block_index = -1; },
       "step plan: publish 1: block_index -1 must be >= 0"},
      {[](StepPlan& p) { p.publishes[1].block_index = 0; },
       "step plan: publish 1: parent_hash 0x000000000000009a must be 0 when block_index is 0"},
      {[](StepPlan& p) { p.publishes[0].request_id = 17; },
       "step plan: publish 0: request 17 is not in the plan"},
      {[](StepPlan& p) { p.requests.clear(), p.groups.clear(); },
       "step plan: publish 0: request 101 is not in the plan"},
      {[](StepPlan& p) { p.publishes[1].memory_rank = 1; },
       "step plan: publish 1: memory_rank 1 must equal request 104's memory_rank 2"},
      {[](StepPlan& p) { p.publishes[0].memory_rank = 2; },
       "step plan: publish 0: memory_rank 2 must equal request 101's memory_rank 1"},
      {[](StepPlan& p) {
         p.publishes.push_back(p.publishes[0]);
         p.publishes.back().block_index = 7, p.publishes.back().parent_hash = 3;
       },
       "step plan: publish 2: memory_rank 1, block_hash 0x0000000000000020 repeats publish 0"},
      {[](StepPlan& p) {
         p.publishes.push_back(p.publishes[1]);
         p.publishes.push_back(p.publishes[0]);
       },
       "step plan: publish 2: memory_rank 2, block_hash 0x0000000000000020 repeats publish 1"},
      // Evictions.
      {[](StepPlan& p) { p.evictions.push_back(p.evictions[1]); },
       "step plan: eviction 2: memory_rank 2, block_hash 0x0000000000000030 repeats eviction 1"},
      {[](StepPlan& p) {
         // Several repeats: the earliest repeating record is named.
         p.evictions = {{5, 1}, {6, 1}, {7, 1}, {6, 1}, {5, 1}, {5, 1}};
       },
       "step plan: eviction 3: memory_rank 1, block_hash 0x0000000000000006 repeats eviction 1"},
  };
  for (const Case& c : cases) {
    StepPlan plan = base;
    c.mutate(plan);
    const absl::Status v = ValidateStepPlan(plan);
    EXPECT_EQ(v.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << v;
    EXPECT_EQ(v.message(), c.want);
    const absl::Status d = DecodeStepPlan(EncodeStepPlan(plan)).status();
    EXPECT_EQ(d, v) << c.want;
  }
  // Valid plans: the same block hash on different ranks, or published and evicted in one step; a
  // request id that appears twice (on two ranks) published on either; group chains of any depth.
  StepPlan plan = base;
  plan.publishes[0].block_hash = plan.evictions[0].block_hash;
  plan.evictions.push_back({0x20, 1});
  plan.requests.push_back(plan.requests[4]);
  plan.requests.back().request_id = 101, plan.requests.back().prefix_group = -1;
  plan.publishes.push_back({101, 0x21, 0, 0, 2});
  for (int32_t i = 0; i < 50; ++i) {
    plan.groups.push_back(
        {static_cast<uint64_t>(i), 100 + i, i == 0 ? 1 : static_cast<int32_t>(plan.groups.size()) - 1, 1});
  }
  EXPECT_TRUE(ValidateStepPlan(plan).ok()) << ValidateStepPlan(plan);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(EncodeStepPlan(plan));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
}

TEST(LayerMessageWire, FieldRangeViolationsNameField) {
  struct Case {
    std::function<void(RawHeader&)> mutate;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](RawHeader& h) { h.kind = 0; },
       "layer message header: kind 0 must be 1 (qkv), 2 (attn_out), 3 (residual), 4 (q) or 5 (kv)"},
      {[](RawHeader& h) { h.kind = 6; }, "kind 6"},
      {[](RawHeader& h) { h.dtype = 3; }, "dtype 3 must be 0 (f32), 1 (f16) or 2 (bf16)"},
      {[](RawHeader& h) { h.dtype = 0, h.row_bytes = 6, h.payload_bytes = 18; },
       "row_bytes 6 must be a multiple of 4 (f32)"},
      {[](RawHeader& h) { h.payload_bytes = 1; }, "payload_bytes 1 must equal rows 3 * row_bytes 128 = 384"},
      {[](RawHeader& h) {
         h.rows = kU32Max, h.row_bytes = kU32Max - 1;
         h.payload_bytes = static_cast<uint32_t>(static_cast<uint64_t>(h.rows) * h.row_bytes);  // wrapped
       },
       "must equal rows 4294967295 * row_bytes 4294967294 = 18446744060824649730"},
      {[](RawHeader& h) { h.reserved[5] = 7; }, "reserved at byte offset 63 is 7, must be 0"},
  };
  for (const Case& c : cases) {
    RawHeader h;
    c.mutate(h);
    absl::Status s = DecodeLayerMessageHeader(MakeFrame(kLayerMessageMagic, HeaderBody(h))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
  }
  // A body of the wrong size with a valid crc.
  for (size_t size : {40, 52}) {
    Bytes body = HeaderBody(RawHeader{});
    body.resize(size);
    absl::Status s = DecodeLayerMessageHeader(MakeFrame(kLayerMessageMagic, body)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()),
                    "body_bytes " + std::to_string(size) + " at byte offset 8 must be 48");
  }
}

TEST(Wire, FrameHeaderChecks) {
  const Bytes body = PlanBody(RawPlan{.requests = {RawRequest{}}});
  auto code_and_message = [](const Bytes& f) { return DecodeStepPlan(f).status(); };

  absl::Status s = code_and_message(MakeFrame(kLayerMessageMagic, body));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "step plan: magic 0x4d4c4454 ('TDLM') at byte offset 0 is not 0x50534454 ('TDSP')");
  s = DecodeLayerMessageHeader(SmallPlanFrame()).status();
  EXPECT_CONTAINS(std::string(s.message()), "layer message header: magic 0x50534454 ('TDSP')");

  ASSERT_EQ(kWireVersion, 13);
  for (uint16_t version : {uint16_t{14}, uint16_t{0xffff}}) {
    s = code_and_message(MakeFrame(kStepPlanMagic, body, version));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    EXPECT_EQ(s.message(),
              "step plan: version " + std::to_string(version) + " is newer than the supported version 13");
  }
  // An older version is refused too, whatever the format: version 2 (the step plan's 24-byte
  // fixed part) and version 1 (also the hello's older layout).
  for (uint16_t version : {uint16_t{12}, uint16_t{11}, uint16_t{10}, uint16_t{9}, uint16_t{8}, uint16_t{7},
                           uint16_t{6}, uint16_t{5}, uint16_t{4}, uint16_t{3}, uint16_t{2}, uint16_t{1}}) {
    s = code_and_message(MakeFrame(kStepPlanMagic, body, version));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "step plan: version " + std::to_string(version) + kOlderVersion);
  }
  // A version 2 plan as a version 2 encoder wrote it (records right after evict_count, at body
  // offset 24) is refused by its version, not misread as a version 6 plan.
  {
    Bytes v2 = PlanBody(RawPlan{.requests = {RawRequest{}}});
    v2.erase(v2.begin() + 24, v2.begin() + 32);
    ASSERT_EQ(v2.size(), 24u + kStepRequestBytes);
    s = code_and_message(MakeFrame(kStepPlanMagic, v2, 2));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "step plan: version 2 at byte offset 4 is older");
  }
  s = code_and_message(MakeFrame(kStepPlanMagic, body, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "version 0 at byte offset 4 is invalid");
  s = code_and_message(MakeFrame(kStepPlanMagic, body, kWireVersion, 20));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "header_bytes 20 at byte offset 6 must be 16");
  s = code_and_message(MakeFrame(kStepPlanMagic, body, kWireVersion, 16, Crc32c(body) ^ 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()), "body crc32c");

  Bytes trailing = MakeFrame(kStepPlanMagic, body);
  trailing.push_back(0);
  s = code_and_message(trailing);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "1 trailing bytes after the frame at byte offset 112");

  // A body that claims a request it lacks (crc recomputed): truncated inside the body.
  Bytes short_body = body;
  short_body.resize(kStepPlanFixedBytes + 20);
  s = code_and_message(MakeFrame(kStepPlanMagic, short_body));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "request_count 1 needs 64 bytes of requests at byte offset 48 but 20 remain");
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(10, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()), "request_count needs 4 bytes at byte offset 24 but 2 remain");
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(23, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(), "step plan: truncated: evict_count needs 4 bytes at byte offset 36 but 3 remain");
  // The version 2 fixed part alone: the micro-batch fields and reserved bytes are missing.
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(24, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(), "step plan: truncated: micro_batch needs 1 bytes at byte offset 40 but 0 remain");
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(25, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(), "step plan: truncated: micro_batches needs 1 bytes at byte offset 41 but 0 remain");
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(kStepPlanFixedBytes - 1, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_EQ(s.message(), "step plan: truncated: restore_count needs 4 bytes at byte offset 44 but 3 remain");
  // An empty plan is the fixed fields alone; all zeros is micro-batch 0 of 0, which is refused.
  Bytes fixed(kStepPlanFixedBytes, 0);
  s = code_and_message(MakeFrame(kStepPlanMagic, fixed));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(),
            "step plan: micro_batch 0 of micro_batches 0 must satisfy micro_batch < micro_batches <= 8");
  fixed[25] = 1;  // micro_batches
  absl::StatusOr<StepPlan> empty = DecodeStepPlan(MakeFrame(kStepPlanMagic, fixed));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(*empty == StepPlan{});
}

// ---- Control messages ---------------------------------------------------------------------------

// Wire fields of a hello, so tests can write values the struct cannot hold.
struct RawHello {
  uint64_t kv_capacity_tokens = 0;
  uint32_t num_layers = 4;
  uint32_t num_heads = 8;
  uint32_t num_kv_heads = 2;
  uint32_t head_dim = 64;
  uint32_t max_tokens_per_step = 512;
  uint32_t max_requests_per_step = 16;
  uint32_t max_position = 4096;
  float kv_memory_fraction = 0.9f;
  uint32_t attn_out_buffer = 3;
  uint16_t memory_rank = 1;
  uint16_t num_memory_ranks = 2;
  uint8_t dtype = 2;
  uint8_t checksums = 1;
  uint16_t prefix_block_tokens = 16;
  uint8_t prefix_sharing = 2;
  uint8_t partition = 0;
  uint8_t lanes = 1;
  uint8_t compute_ranks = 1;
  uint32_t kv_head_begin = 0;
  uint32_t kv_head_end = 2;  // request partition: every KV head
  uint16_t slice_layers = 0;
  uint8_t q_first = 0;
  uint8_t rope_type = 0;
  uint8_t compute_mask = 1;
  uint8_t reserved[3] = {};
  double rope_theta = 10000.0, rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  uint64_t rope_original_max_position = 8192;
};

Bytes HelloBody(const RawHello& h) {
  Le w;
  w.U64(h.kv_capacity_tokens).U32(h.num_layers).U32(h.num_heads).U32(h.num_kv_heads).U32(h.head_dim);
  w.U32(h.max_tokens_per_step).U32(h.max_requests_per_step).U32(h.max_position);
  w.F32(h.kv_memory_fraction).U32(h.attn_out_buffer).U16(h.memory_rank).U16(h.num_memory_ranks);
  w.U8(h.dtype).U8(h.checksums).U16(h.prefix_block_tokens).U8(h.prefix_sharing).U8(h.partition);
  w.U8(h.lanes).U8(h.compute_ranks);
  w.U32(h.kv_head_begin).U32(h.kv_head_end).U16(h.slice_layers).U8(h.q_first).U8(h.rope_type);
  w.U8(h.compute_mask);
  for (uint8_t b : h.reserved) w.U8(b);
  w.F64(h.rope_theta).F64(h.rope_factor).F64(h.rope_low_freq_factor).F64(h.rope_high_freq_factor);
  w.U64(h.rope_original_max_position);
  return w.b;
}

struct RawReply {
  uint64_t kv_capacity_tokens = 1000;
  uint32_t qkv_buffer = 5;
  uint16_t memory_rank = 1;
  uint8_t dtype = 2;
  uint8_t persisted = 0;
  std::optional<uint16_t> device_bytes;  // default: device.size()
  std::string device = "cuda:0";
};

Bytes ReplyBody(const RawReply& h) {
  Le w;
  w.U64(h.kv_capacity_tokens).U32(h.qkv_buffer).U16(h.memory_rank).U8(h.dtype).U8(h.persisted);
  w.U16(h.device_bytes ? *h.device_bytes : static_cast<uint16_t>(h.device.size()));
  w.b.insert(w.b.end(), h.device.begin(), h.device.end());
  return w.b;
}

Bytes ReleaseBody(uint64_t step_id, const std::vector<uint64_t>& ids,
                  std::optional<uint32_t> count = std::nullopt, uint32_t reserved = 0) {
  Le w;
  w.U64(step_id).U32(count ? *count : static_cast<uint32_t>(ids.size())).U32(reserved);
  for (uint64_t id : ids) w.U64(id);
  return w.b;
}

Bytes ErrorBody(uint32_t code, const std::string& message, std::optional<uint32_t> length = std::nullopt) {
  Le w;
  w.U32(code).U32(length ? *length : static_cast<uint32_t>(message.size()));
  w.b.insert(w.b.end(), message.begin(), message.end());
  return w.b;
}

std::string RandomText(std::mt19937_64& rng, size_t n) {
  std::string s(n, ' ');
  for (char& c : s) c = static_cast<char>(1 + rng() % 255);  // any byte but NUL
  return s;
}

HelloMessage RandomHello(std::mt19937_64& rng, bool extreme) {
  auto u = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  HelloMessage h;
  if (extreme) {
    h.num_memory_ranks = 0xffff, h.memory_rank = 0xfffe;
    h.num_layers = h.num_heads = h.num_kv_heads = kU32Max;
    h.head_dim = kMaxHeadDim;
    h.max_tokens_per_step = h.max_requests_per_step = h.max_position = kU32Max;
    h.dtype = DType::kF32;
    h.kv_capacity_tokens = kMaxKvCapacityTokens;
    h.kv_memory_fraction = u(0, 1) ? 1.0f : std::numeric_limits<float>::denorm_min();
    h.attn_out_buffer = kU32Max;
    h.checksums = true;
    h.prefix_block_tokens = kMaxPrefixBlockTokens;
    h.prefix_sharing = static_cast<uint8_t>(PrefixSharing::kAuto);
    // 2^32 - 1 = 65535 * 65537: the head partition splits kU32Max KV heads over 65535 ranks.
    h.partition = u(0, 1) ? AttentionPartition::kHead : AttentionPartition::kRequest;
    h.kv_head_begin = h.partition == AttentionPartition::kHead ? 65537u * h.memory_rank : 0;
    h.kv_head_end = kU32Max;
    h.lanes = static_cast<uint8_t>(kMaxMicroBatches);
    return h;
  }
  h.num_memory_ranks = static_cast<uint16_t>(u(1, 64));
  h.memory_rank = static_cast<uint16_t>(u(0, h.num_memory_ranks - 1));
  h.num_layers = static_cast<uint32_t>(u(1, 128));
  h.num_kv_heads = static_cast<uint32_t>(1u << u(0, 4));
  h.num_heads = h.num_kv_heads * static_cast<uint32_t>(u(1, 8));
  h.head_dim = static_cast<uint32_t>(u(1, kMaxHeadDim));
  h.max_tokens_per_step = static_cast<uint32_t>(u(1, 1 << 20));
  h.max_requests_per_step = static_cast<uint32_t>(u(1, h.max_tokens_per_step));
  h.max_position = static_cast<uint32_t>(u(1, kU32Max));
  h.dtype = static_cast<DType>(u(0, 2));
  h.kv_capacity_tokens = u(0, 1) ? 0 : u(1, kMaxKvCapacityTokens);
  h.kv_memory_fraction = static_cast<float>(u(1, 1 << 24)) / static_cast<float>(1 << 24);
  h.attn_out_buffer = static_cast<uint32_t>(rng());
  h.checksums = u(0, 1) == 1;
  h.prefix_block_tokens = static_cast<uint16_t>(u(0, 1) ? 0 : u(1, kMaxPrefixBlockTokens));
  h.prefix_sharing = static_cast<uint8_t>(h.prefix_block_tokens == 0 ? 0 : u(0, 2));
  h.partition = h.num_kv_heads % h.num_memory_ranks == 0 && u(0, 1) ? AttentionPartition::kHead
                                                                    : AttentionPartition::kRequest;
  const uint32_t per_rank =
      h.partition == AttentionPartition::kHead ? h.num_kv_heads / h.num_memory_ranks : h.num_kv_heads;
  h.kv_head_begin = h.partition == AttentionPartition::kHead ? per_rank * h.memory_rank : 0;
  h.kv_head_end = h.kv_head_begin + per_rank;
  h.lanes = static_cast<uint8_t>(u(1, kMaxMicroBatches));
  h.compute_ranks = static_cast<uint8_t>(u(1, h.lanes));
  h.compute_mask = static_cast<uint8_t>(1 | (u(0, 255) & ((1u << h.compute_ranks) - 1)));
  h.slice_layers = h.compute_ranks > 1 && u(0, 1) ? static_cast<uint16_t>(u(1, h.num_layers)) : 0;
  h.q_first = u(0, 1) == 1;
  h.rope = {.type = static_cast<RopeType>(u(0, 1)),
            .theta = static_cast<double>(u(1, 1u << 24)),
            .factor = static_cast<double>(u(1, 64)) / 4,
            .low_freq_factor = static_cast<double>(u(1, 64)) / 8,
            .high_freq_factor = static_cast<double>(u(1, 64)) / 2,
            .original_max_position = static_cast<int64_t>(u(1, kMaxKvCapacityTokens))};
  return h;
}

HelloReplyMessage RandomReply(std::mt19937_64& rng) {
  HelloReplyMessage h;
  h.memory_rank = static_cast<uint16_t>(rng());
  h.dtype = static_cast<DType>(rng() % 3);
  h.kv_capacity_tokens = 1 + rng() % kMaxKvCapacityTokens;
  h.qkv_buffer = static_cast<uint32_t>(rng());
  h.device = RandomText(rng, rng() % (kMaxDeviceBytes + 1));
  h.persisted = rng() % 2 == 1;
  return h;
}

ReleaseMessage RandomRelease(std::mt19937_64& rng, size_t n) {
  ReleaseMessage m;
  m.step_id = rng();
  for (size_t i = 0; i < n; ++i) m.request_ids.push_back(rng() % 2 ? rng() : i);  // distinct w.h.p.
  std::sort(m.request_ids.begin(), m.request_ids.end());
  m.request_ids.erase(std::unique(m.request_ids.begin(), m.request_ids.end()), m.request_ids.end());
  std::shuffle(m.request_ids.begin(), m.request_ids.end(), rng);
  return m;
}

ErrorMessage RandomError(std::mt19937_64& rng, size_t n) {
  ErrorMessage m;
  m.code = static_cast<uint32_t>(1 + rng() % 16);
  m.message = RandomText(rng, n);
  return m;
}

// Every decoder, type-erased to its status, with the magic it accepts.
struct AnyDecoder {
  const char* name;
  uint32_t magic;
  std::function<absl::Status(absl::Span<const uint8_t>)> decode;
};

template <typename T>
std::function<absl::Status(absl::Span<const uint8_t>)> StatusOf(
    absl::StatusOr<T> (*decode)(absl::Span<const uint8_t>)) {
  return [decode](absl::Span<const uint8_t> f) { return decode(f).status(); };
}

const std::vector<AnyDecoder>& ControlDecoders() {
  static const std::vector<AnyDecoder> decoders = {
      {"hello", kHelloMagic, StatusOf(&DecodeHello)},
      {"hello reply", kHelloReplyMagic, StatusOf(&DecodeHelloReply)},
      {"release", kReleaseMagic, StatusOf(&DecodeRelease)},
      {"error message", kErrorMagic, StatusOf(&DecodeError)},
      {"bye", kByeMagic, StatusOf(&DecodeBye)},
      {"stats request", kStatsRequestMagic, StatusOf(&DecodeStatsRequest)},
      {"memory stats", kMemoryStatsMagic, StatusOf(&DecodeMemoryStats)},
      {"heartbeat", kHeartbeatMagic, StatusOf(&DecodeHeartbeat)},
      {"heartbeat reply", kHeartbeatReplyMagic, StatusOf(&DecodeHeartbeatReply)},
      {"step discard", kStepDiscardMagic, StatusOf(&DecodeStepDiscard)},
      {"persisted blocks", kPersistedBlocksMagic, StatusOf(&DecodePersistedBlocks)},
      {"memory rejoin", kMemoryRejoinMagic, StatusOf(&DecodeMemoryRejoin)},
      {"head split", kHeadSplitMagic, StatusOf(&DecodeHeadSplit)},
  };
  return decoders;
}

// One valid frame of each control message, in ControlDecoders() order.
std::vector<Bytes> ControlFrames() {
  std::mt19937_64 rng(99);
  return {
      EncodeHello(RandomHello(rng, false)),
      EncodeHelloReply(RandomReply(rng)),
      EncodeRelease(RandomRelease(rng, 5)),
      EncodeError(RandomError(rng, 40)),
      EncodeBye(ByeMessage{77}),
      EncodeStatsRequest(StatsRequestMessage{9}),
      EncodeMemoryStats(MemoryStatsMessage{.cookie = 9, .memory_rank = 3, .steps = 12, .attention_ns = 34}),
      EncodeHeartbeat(HeartbeatMessage{.seq = 21, .silence_ms = 122000}),
      EncodeHeartbeatReply(HeartbeatReplyMessage{.seq = 21, .memory_rank = 2}),
      EncodeStepDiscard(StepDiscardMessage{.step_id = 31, .seqno_base = 960, .compute_mask = 3}),
      EncodePersistedBlocks(
          PersistedBlocksMessage{.memory_rank = 1,
                                 .last = true,
                                 .blocks = {{.hash = 5, .parent_hash = 0, .depth = 1, .tokens = {1, 2}},
                                            {.hash = 6, .parent_hash = 5, .depth = 2, .tokens = {3, 4}}}}),
      EncodeMemoryRejoin(
          MemoryRejoinMessage{.memory_rank = 1, .attn_out_buffer = 130, .text = "127.0.0.1:4000"}),
      EncodeHeadSplit(HeadSplitMessage{
          .split = 2, .ranks = {{.memory_rank = 0, .attn_out_buffer = 140, .qkv_buffer = 9}}})};
}

TEST(ControlWire, RoundTrips) {
  std::mt19937_64 rng(4242);
  for (int i = 0; i < 300; ++i) {
    const HelloMessage h = RandomHello(rng, i % 10 == 0);
    ASSERT_TRUE(ValidateHello(h).ok()) << ValidateHello(h);
    const Bytes f = EncodeHello(h);
    ASSERT_EQ(f.size(), kFrameHeaderBytes + kHelloBodyBytes);
    ASSERT_GE(h.lanes, 1);
    ASSERT_LE(h.lanes, kMaxMicroBatches);
    EXPECT_EQ(f[70], h.lanes);
    absl::StatusOr<HelloMessage> back = DecodeHello(f);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == h);
    EXPECT_EQ(EncodeHello(*back), f);

    const HelloReplyMessage r = RandomReply(rng);
    ASSERT_TRUE(ValidateHelloReply(r).ok()) << ValidateHelloReply(r);
    const Bytes fr = EncodeHelloReply(r);
    ASSERT_EQ(fr.size(), kFrameHeaderBytes + kHelloReplyFixedBytes + r.device.size());
    absl::StatusOr<HelloReplyMessage> rback = DecodeHelloReply(fr);
    ASSERT_TRUE(rback.ok()) << rback.status();
    EXPECT_TRUE(*rback == r);

    const ReleaseMessage m = RandomRelease(rng, i % 50);
    const Bytes fm = EncodeRelease(m);
    ASSERT_EQ(fm.size(), kFrameHeaderBytes + kReleaseFixedBytes + 8 * m.request_ids.size());
    absl::StatusOr<ReleaseMessage> mback = DecodeRelease(fm);
    ASSERT_TRUE(mback.ok()) << mback.status();
    EXPECT_TRUE(*mback == m);

    const ErrorMessage e = RandomError(rng, rng() % 300);
    const Bytes fe = EncodeError(e);
    ASSERT_EQ(fe.size(), kFrameHeaderBytes + kErrorFixedBytes + e.message.size());
    absl::StatusOr<ErrorMessage> eback = DecodeError(fe);
    ASSERT_TRUE(eback.ok()) << eback.status();
    EXPECT_TRUE(*eback == e);

    const ByeMessage b{i == 0 ? kU64Max : rng()};
    const Bytes fb = EncodeBye(b);
    ASSERT_EQ(fb.size(), kFrameHeaderBytes + kByeBodyBytes);
    absl::StatusOr<ByeMessage> bback = DecodeBye(fb);
    ASSERT_TRUE(bback.ok()) << bback.status();
    EXPECT_TRUE(*bback == b);
  }
  // The largest strings and an empty release.
  HelloReplyMessage r;
  r.device = std::string(kMaxDeviceBytes, '\xff');
  absl::StatusOr<HelloReplyMessage> rback = DecodeHelloReply(EncodeHelloReply(r));
  ASSERT_TRUE(rback.ok()) << rback.status();
  EXPECT_TRUE(*rback == r);
  ErrorMessage e;
  e.code = 16;
  e.message = std::string(kMaxErrorMessageBytes, 'x');
  absl::StatusOr<ErrorMessage> eback = DecodeError(EncodeError(e));
  ASSERT_TRUE(eback.ok()) << eback.status();
  EXPECT_TRUE(*eback == e);
  absl::StatusOr<ReleaseMessage> mback = DecodeRelease(EncodeRelease(ReleaseMessage{}));
  ASSERT_TRUE(mback.ok()) << mback.status();
  EXPECT_TRUE(mback->request_ids.empty());
}

TEST(ControlWire, GoldenBytes) {
  // Layouts written out by hand; crcs computed independently (bitwise Python reference). The crc
  // covers the body alone: of these frames, versions 3 and 6 changed only the hello's body (its lanes
  // and compute_ranks; its slice_layers) and version 10 its length (the rope), and versions 4 and 5 none
  // of their bodies.
  HelloMessage h;
  h.memory_rank = 2, h.num_memory_ranks = 4, h.num_layers = 32, h.num_heads = 32, h.num_kv_heads = 8;
  h.head_dim = 128, h.max_tokens_per_step = 8192, h.max_requests_per_step = 256, h.max_position = 131072;
  h.dtype = DType::kBF16, h.kv_capacity_tokens = 0x12345678, h.kv_memory_fraction = 0.5f;
  h.attn_out_buffer = 0xa1b2c3d4, h.checksums = true;
  h.prefix_block_tokens = 0x0810, h.prefix_sharing = static_cast<uint8_t>(PrefixSharing::kAuto);
  h.partition = AttentionPartition::kHead, h.kv_head_begin = 4, h.kv_head_end = 6, h.lanes = 4;
  h.compute_ranks = 2, h.compute_mask = 3, h.slice_layers = 3;
  h.rope = {.type = RopeType::kLlama3, .theta = 500000.0, .factor = 8.0, .original_max_position = 8192};
  const Bytes hello = {
      0x54, 0x44, 0x48, 0x49, 0x0d, 0x00, 0x10, 0x00, 0x70, 0x00, 0x00, 0x00, 0x27, 0xc9, 0x0c,
      0x4f,                                            // frame
      0x78, 0x56, 0x34, 0x12, 0x00, 0x00, 0x00, 0x00,  // kv_capacity_tokens
      0x20, 0x00, 0x00, 0x00, 0x20, 0x00, 0x00, 0x00,  // num_layers, num_heads
      0x08, 0x00, 0x00, 0x00, 0x80, 0x00, 0x00, 0x00,  // num_kv_heads, head_dim
      0x00, 0x20, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00,  // max_tokens, max_requests
      0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x3f,  // max_position, kv_memory_fraction
      0xd4, 0xc3, 0xb2, 0xa1, 0x02, 0x00, 0x04, 0x00,  // attn_out_buffer, memory_rank, num_memory_ranks
      0x02, 0x01, 0x10, 0x08, 0x02, 0x01, 0x04, 0x02,  // dtype, checksums, prefix_block_tokens,
                                                       // prefix_sharing, partition, lanes, compute_ranks
      0x04, 0x00, 0x00, 0x00, 0x06, 0x00, 0x00, 0x00,  // kv_head_begin, kv_head_end
      0x03, 0x00, 0x00, 0x01, 0x03, 0x00, 0x00, 0x00,  // slice_layers, q_first, rope_type,
                                                       // compute_mask 0b11, reserved
      0x00, 0x00, 0x00, 0x00, 0x80, 0x84, 0x1e, 0x41,  // rope_theta 500000
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x20, 0x40,  // rope_factor 8
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf0, 0x3f,  // rope_low_freq_factor 1
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x40,  // rope_high_freq_factor 4
      0x00, 0x20, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // rope_original_max_position 8192
  };
  EXPECT_EQ(EncodeHello(h), hello);
  absl::StatusOr<HelloMessage> hb = DecodeHello(hello);
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_TRUE(*hb == h);
  // pipeline.q_first: byte 66 of the body (reserved before), and the body crc.
  h.q_first = true;
  Bytes q_hello = hello;
  q_hello[16 + 66] = 0x01;
  const Bytes q_crc = {0xc9, 0xa8, 0x1c, 0x0f};
  std::copy(q_crc.begin(), q_crc.end(), q_hello.begin() + 12);
  EXPECT_EQ(EncodeHello(h), q_hello);
  hb = DecodeHello(q_hello);
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_TRUE(*hb == h);
  h.q_first = false;

  HelloReplyMessage r;
  r.kv_capacity_tokens = 0x01020304, r.qkv_buffer = 7, r.memory_rank = 2, r.dtype = DType::kBF16;
  r.device = "cuda:0";
  const Bytes reply = {
      0x54, 0x44, 0x48, 0x52, 0x0d, 0x00, 0x10, 0x00,
      0x18, 0x00, 0x00, 0x00, 0xdb, 0xf4, 0x8d, 0x50,  // frame
      0x04, 0x03, 0x02, 0x01, 0x00, 0x00, 0x00, 0x00,  // kv_capacity_tokens
      0x07, 0x00, 0x00, 0x00, 0x02, 0x00, 0x02, 0x00,  // qkv_buffer, memory_rank, dtype, reserved
      0x06, 0x00, 'c',  'u',  'd',  'a',  ':',  '0',   // device_bytes, device
  };
  EXPECT_EQ(EncodeHelloReply(r), reply);
  absl::StatusOr<HelloReplyMessage> rb = DecodeHelloReply(reply);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_TRUE(*rb == r);

  const ReleaseMessage m{0x0102030405060708, {5, kU64Max}};
  const Bytes release = {
      0x54, 0x44, 0x52, 0x4c, 0x0d, 0x00, 0x10, 0x00,
      0x20, 0x00, 0x00, 0x00, 0x21, 0x77, 0x58, 0xc2,  // frame
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // step_id
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request_count, reserved
      0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request_ids
      0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
  };
  EXPECT_EQ(EncodeRelease(m), release);
  absl::StatusOr<ReleaseMessage> mb = DecodeRelease(release);
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_TRUE(*mb == m);

  const ErrorMessage e{14, "peer gone"};
  const Bytes error = {
      0x54, 0x44, 0x45, 0x52, 0x0d, 0x00, 0x10, 0x00, 0x11,
      0x00, 0x00, 0x00, 0x56, 0xa5, 0x51, 0x47,        // frame
      0x0e, 0x00, 0x00, 0x00, 0x09, 0x00, 0x00, 0x00,  // code, message_bytes
      'p',  'e',  'e',  'r',  ' ',  'g',  'o',  'n',  'e',
  };
  EXPECT_EQ(EncodeError(e), error);
  absl::StatusOr<ErrorMessage> eb = DecodeError(error);
  ASSERT_TRUE(eb.ok()) << eb.status();
  EXPECT_TRUE(*eb == e);

  const Bytes bye = {
      0x54, 0x44, 0x42, 0x59, 0x0d, 0x00, 0x10, 0x00,
      0x08, 0x00, 0x00, 0x00, 0xc7, 0xfb, 0x17, 0x55,  // frame
      0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // steps
  };
  EXPECT_EQ(EncodeBye(ByeMessage{1000}), bye);
  absl::StatusOr<ByeMessage> bb = DecodeBye(bye);
  ASSERT_TRUE(bb.ok()) << bb.status();
  EXPECT_EQ(bb->steps, 1000u);

  const Bytes heartbeat = {
      0x54, 0x44, 0x48, 0x42, 0x0d, 0x00, 0x10, 0x00,
      0x10, 0x00, 0x00, 0x00, 0x6e, 0x14, 0x17, 0xba,  // frame
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // seq
      0x88, 0x13, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // silence_ms 5000, reserved
  };
  EXPECT_EQ(EncodeHeartbeat(HeartbeatMessage{.seq = 0x0102030405060708, .silence_ms = 5000}), heartbeat);
  absl::StatusOr<HeartbeatMessage> beat = DecodeHeartbeat(heartbeat);
  ASSERT_TRUE(beat.ok()) << beat.status();
  EXPECT_EQ(beat->seq, 0x0102030405060708u);
  EXPECT_EQ(beat->silence_ms, 5000u);

  const Bytes heartbeat_reply = {
      0x54, 0x44, 0x48, 0x41, 0x0d, 0x00, 0x10, 0x00,
      0x10, 0x00, 0x00, 0x00, 0x47, 0x8e, 0x37, 0x33,  // frame
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // seq
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // memory_rank 3, reserved
  };
  EXPECT_EQ(EncodeHeartbeatReply(HeartbeatReplyMessage{.seq = 0x0102030405060708, .memory_rank = 3}),
            heartbeat_reply);
  absl::StatusOr<HeartbeatReplyMessage> beat_reply = DecodeHeartbeatReply(heartbeat_reply);
  ASSERT_TRUE(beat_reply.ok()) << beat_reply.status();
  EXPECT_EQ(beat_reply->seq, 0x0102030405060708u);
  EXPECT_EQ(beat_reply->memory_rank, 3);

  const Bytes discard = {
      0x54, 0x44, 0x53, 0x44, 0x0d, 0x00, 0x10, 0x00,
      0x1c, 0x00, 0x00, 0x00, 0x8f, 0x2f, 0xbd, 0xc9,  // frame
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // step_id
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // seqno_base
      0x05, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,  // compute_mask 0b101, reserved, lost_count 2
      0x01, 0x00, 0x03, 0x00,                          // lost memory ranks 1 and 3
  };
  const StepDiscardMessage want_discard{.step_id = 0x0102030405060708,
                                        .seqno_base = 0x1112131415161718,
                                        .compute_mask = 5,
                                        .lost_memory_ranks = {1, 3}};
  EXPECT_EQ(EncodeStepDiscard(want_discard), discard);
  absl::StatusOr<StepDiscardMessage> got_discard = DecodeStepDiscard(discard);
  ASSERT_TRUE(got_discard.ok()) << got_discard.status();
  EXPECT_TRUE(*got_discard == want_discard);

  // The magic constants are the documented ASCII bytes.
  for (const Bytes* f : {&hello, &reply, &release, &error, &bye, &heartbeat, &heartbeat_reply, &discard}) {
    absl::StatusOr<uint32_t> magic = PeekFrameMagic(*f);
    ASSERT_TRUE(magic.ok()) << magic.status();
    EXPECT_EQ(*magic, static_cast<uint32_t>((*f)[0]) | (*f)[1] << 8 | (*f)[2] << 16 |
                          static_cast<uint32_t>((*f)[3]) << 24);
  }
}

TEST(ControlWire, EveryStrictPrefixIsDataLoss) {
  const std::vector<Bytes> frames = ControlFrames();
  for (size_t k = 0; k < frames.size(); ++k) {
    const AnyDecoder& d = ControlDecoders()[k];
    ASSERT_TRUE(d.decode(frames[k]).ok()) << d.name << ": " << d.decode(frames[k]);
    for (size_t n = 0; n < frames[k].size(); ++n) {
      absl::Status s = d.decode(absl::MakeConstSpan(frames[k].data(), n));
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << d.name << " prefix " << n << ": " << s;
      EXPECT_TRUE(absl::StartsWith(s.message(), std::string(d.name) + ": ")) << s;
    }
  }
}

TEST(ControlWire, EverySingleByteChangeIsRejected) {
  const std::vector<Bytes> frames = ControlFrames();
  for (size_t k = 0; k < frames.size(); ++k) {
    const AnyDecoder& d = ControlDecoders()[k];
    for (size_t pos = 0; pos < frames[k].size(); ++pos) {
      for (int mask = 1; mask < 256; ++mask) {
        Bytes f = frames[k];
        f[pos] ^= static_cast<uint8_t>(mask);
        ASSERT_FALSE(d.decode(f).ok()) << d.name << ": byte " << pos << " ^ " << mask;
      }
    }
  }
}

TEST(ControlWire, EachDecoderRejectsOtherFramesAndBadHeaders) {
  const std::vector<Bytes> frames = ControlFrames();
  std::vector<Bytes> all = frames;
  all.push_back(SmallPlanFrame());
  all.push_back(EncodeLayerMessageHeader(LayerMessageHeader{}));
  for (size_t k = 0; k < frames.size(); ++k) {
    const AnyDecoder& d = ControlDecoders()[k];
    for (size_t j = 0; j < all.size(); ++j) {
      if (j == k) continue;
      absl::Status s = d.decode(all[j]);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << d.name << " on frame " << j << ": " << s;
      EXPECT_CONTAINS(std::string(s.message()), std::string(d.name) + ": magic 0x");
    }
    const Bytes body(frames[k].begin() + kFrameHeaderBytes, frames[k].end());
    absl::Status s = d.decode(MakeFrame(d.magic, body, kWireVersion + 1));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
    s = d.decode(MakeFrame(d.magic, body, 0));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "version 0 at byte offset 4");
    s = d.decode(MakeFrame(d.magic, body, kWireVersion, 17));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "header_bytes 17 at byte offset 6 must be 16");
    s = d.decode(MakeFrame(d.magic, body, kWireVersion, 16, Crc32c(body) + 1));
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_CONTAINS(std::string(s.message()), "body crc32c");
    Bytes trailing = frames[k];
    trailing.push_back(0);
    s = d.decode(trailing);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "1 trailing bytes after the frame");
  }
}

TEST(ControlWire, ForgedLengthsFailFastWithoutAllocating) {
  struct Case {
    const char* name;
    Bytes frame;
    std::function<absl::Status(absl::Span<const uint8_t>)> decode;
    std::string want;
  };
  std::vector<Case> cases;
  for (uint32_t count : {uint32_t{1} << 31, kU32Max, uint32_t{3}}) {
    cases.push_back(
        {"release", MakeFrame(kReleaseMagic, ReleaseBody(1, {4, 5}, count)), StatusOf(&DecodeRelease),
         "release: truncated: request_count " + std::to_string(count) + " needs " +
             std::to_string(uint64_t{count} * 8) + " bytes of request ids at byte offset 32 but 16"});
  }
  for (uint16_t n : {uint16_t{0xffff}, uint16_t{257}, uint16_t{7}}) {
    RawReply r;
    r.device_bytes = n;
    cases.push_back({"hello reply", MakeFrame(kHelloReplyMagic, ReplyBody(r)), StatusOf(&DecodeHelloReply),
                     "hello reply: truncated: device_bytes " + std::to_string(n) + " needs " +
                         std::to_string(n) + " bytes of device at byte offset 34 but 6 remain"});
  }
  for (uint32_t n : {kU32Max, uint32_t{1} << 31, uint32_t{65537}, uint32_t{10}}) {
    cases.push_back({"error", MakeFrame(kErrorMagic, ErrorBody(3, "boom", n)), StatusOf(&DecodeError),
                     "error message: truncated: message_bytes " + std::to_string(n) + " needs " +
                         std::to_string(n) + " bytes of message at byte offset 24 but 4 remain"});
  }
  for (const Case& c : cases) {
    g_max_alloc = 0;
    g_track_allocs = true;
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = c.decode(c.frame);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    g_track_allocs = false;
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << c.name << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
    EXPECT_LT(g_max_alloc.load(), 4096u) << c.name;  // only the error message
    EXPECT_LT(elapsed, std::chrono::milliseconds(50));
  }

  // Fewer than the bytes present leaves unused bytes.
  absl::Status s = DecodeRelease(MakeFrame(kReleaseMagic, ReleaseBody(1, {4, 5}, 1))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "release: request_count 1 leaves 8 unused body bytes at byte offset 40");
  RawReply r;
  r.device_bytes = 2;
  s = DecodeHelloReply(MakeFrame(kHelloReplyMagic, ReplyBody(r))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "hello reply: device_bytes 2 leaves 4 unused body bytes at byte offset 36");
  s = DecodeError(MakeFrame(kErrorMagic, ErrorBody(3, "boom", 1))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "error message: message_bytes 1 leaves 3 unused body bytes at byte offset 25");

  // Lengths over the limits with the bytes present (crc valid).
  r = RawReply{};
  r.device = std::string(kMaxDeviceBytes + 1, 'a');
  s = DecodeHelloReply(MakeFrame(kHelloReplyMagic, ReplyBody(r))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "hello reply: device_bytes 257 at byte offset 32 must be <= 256");
  s = DecodeError(MakeFrame(kErrorMagic, ErrorBody(3, std::string(kMaxErrorMessageBytes + 1, 'a')))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "error message: message_bytes 65537 at byte offset 20 must be <= 65536");

  // Bodies shorter than their fixed fields (crc valid).
  for (const AnyDecoder& d : ControlDecoders()) {
    s = d.decode(MakeFrame(d.magic, Bytes(3, 0)));
    EXPECT_TRUE(s.code() == absl::StatusCode::kDataLoss || s.code() == absl::StatusCode::kInvalidArgument)
        << d.name << ": " << s;
    EXPECT_TRUE(absl::StartsWith(s.message(), std::string(d.name) + ": ")) << s;
  }
  s = DecodeRelease(MakeFrame(kReleaseMagic, Bytes(10, 0))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "release: truncated: request_count needs 4 bytes at byte offset 24 but 2");
}

TEST(HelloWire, FieldRangeViolationsNameField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::function<void(RawHello&)> mutate;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](RawHello& h) { h.num_memory_ranks = 0, h.memory_rank = 0; },
       "hello: num_memory_ranks 0 must be >= 1"},
      {[](RawHello& h) { h.memory_rank = 2; }, "hello: memory_rank 2 must be < num_memory_ranks 2"},
      {[](RawHello& h) { h.num_layers = 0; }, "hello: num_layers 0 must be >= 1"},
      {[](RawHello& h) { h.num_heads = 0; }, "hello: num_heads 0 must be >= 1"},
      {[](RawHello& h) { h.num_kv_heads = 0; }, "hello: num_kv_heads 0 must be >= 1"},
      {[](RawHello& h) { h.num_heads = 32, h.num_kv_heads = 3; },
       "hello: num_kv_heads 3 must divide num_heads 32"},
      {[](RawHello& h) { h.num_heads = 8, h.num_kv_heads = 16; },
       "hello: num_kv_heads 16 must divide num_heads 8"},
      {[](RawHello& h) { h.head_dim = 0; }, "hello: head_dim 0 must be in [1, 1024]"},
      {[](RawHello& h) { h.head_dim = 1025; }, "hello: head_dim 1025 must be in [1, 1024]"},
      {[](RawHello& h) { h.max_tokens_per_step = 0, h.max_requests_per_step = 0; },
       "hello: max_tokens_per_step 0 must be >= 1"},
      {[](RawHello& h) { h.max_requests_per_step = 0; },
       "hello: max_requests_per_step 0 must be in [1, max_tokens_per_step 512]"},
      {[](RawHello& h) { h.max_requests_per_step = 513; },
       "hello: max_requests_per_step 513 must be in [1, max_tokens_per_step 512]"},
      {[](RawHello& h) { h.max_position = 0; }, "hello: max_position 0 must be >= 1"},
      {[](RawHello& h) { h.dtype = 3; }, "hello: dtype 3 must be 0 (f32), 1 (f16) or 2 (bf16)"},
      {[](RawHello& h) { h.dtype = 255; }, "hello: dtype 255"},
      {[](RawHello& h) { h.kv_capacity_tokens = uint64_t{1} << 31; },
       "hello: kv_capacity_tokens 2147483648 must be 0 (sized from memory) or <= 2147483647"},
      {[](RawHello& h) { h.kv_capacity_tokens = kU64Max; }, "hello: kv_capacity_tokens 18446744073709551615"},
      {[](RawHello& h) { h.kv_memory_fraction = 0.0f; }, "hello: kv_memory_fraction 0 must be in (0, 1]"},
      {[](RawHello& h) { h.kv_memory_fraction = -0.0f; }, "hello: kv_memory_fraction -0 must be in (0, 1]"},
      {[](RawHello& h) { h.kv_memory_fraction = 1.0001f; }, "hello: kv_memory_fraction 1.0001"},
      {[&](RawHello& h) { h.kv_memory_fraction = nan; }, "hello: kv_memory_fraction nan"},
      {[](RawHello& h) { h.kv_memory_fraction = std::numeric_limits<float>::infinity(); },
       "hello: kv_memory_fraction inf"},
      {[](RawHello& h) { h.checksums = 2; }, "hello: checksums 2 at byte offset 65 must be 0 or 1"},
      {[](RawHello& h) { h.q_first = 2; }, "hello: q_first 2 at byte offset 82 must be 0 or 1"},
      {[](RawHello& h) { h.reserved[0] = 1; }, "reserved at byte offset 85 is 1, must be 0"},
      {[](RawHello& h) { h.rope_type = 2; }, "hello: rope_type 2 must be 0 (default) or 1 (llama3)"},
      {[](RawHello& h) { h.rope_theta = 0; }, "hello: rope_theta 0 must be finite and > 0"},
      {[](RawHello& h) { h.rope_factor = -1; }, "hello: rope_factor -1 must be finite and > 0"},
      {[](RawHello& h) { h.rope_low_freq_factor = std::numeric_limits<double>::quiet_NaN(); },
       "hello: rope_low_freq_factor nan must be finite and > 0"},
      {[](RawHello& h) { h.rope_high_freq_factor = std::numeric_limits<double>::infinity(); },
       "hello: rope_high_freq_factor inf must be finite and > 0"},
      {[](RawHello& h) { h.rope_original_max_position = 0; },
       "hello: rope_original_max_position 0 must be in [1, 2147483647]"},
      {[](RawHello& h) { h.rope_original_max_position = kU64Max; },
       "hello: rope_original_max_position 18446744073709551615 must be in [1, 2147483647]"},
      {[](RawHello& h) { h.prefix_block_tokens = 4097; },
       "hello: prefix_block_tokens 4097 must be 0 (no prefix registry) or in [1, 4096]"},
      {[](RawHello& h) { h.prefix_block_tokens = 0xffff; }, "hello: prefix_block_tokens 65535"},
      {[](RawHello& h) { h.prefix_sharing = 3; },
       "hello: prefix_sharing 3 must be 0 (off), 1 (on) or 2 (auto)"},
      {[](RawHello& h) { h.prefix_sharing = 255; }, "hello: prefix_sharing 255 must be"},
      {[](RawHello& h) { h.prefix_block_tokens = 0, h.prefix_sharing = 1; },
       "hello: prefix_sharing 1 needs prefix_block_tokens >= 1 (a prefix registry)"},
      {[](RawHello& h) { h.prefix_block_tokens = 0, h.prefix_sharing = 2; },
       "hello: prefix_sharing 2 needs prefix_block_tokens >= 1"},
      {[](RawHello& h) { h.compute_ranks = 0; }, "hello: compute_ranks 0 must be in [1, lanes 1]"},
      {[](RawHello& h) { h.compute_ranks = 2; }, "hello: compute_ranks 2 must be in [1, lanes 1]"},
      {[](RawHello& h) { h.lanes = 2, h.compute_ranks = 1, h.slice_layers = 1; },
       "hello: slice_layers 1 must be 0 or in [1, num_layers 4] with compute_ranks >= 2 (compute_ranks 1)"},
      {[](RawHello& h) { h.lanes = 2, h.compute_ranks = 2, h.slice_layers = 5; },
       "hello: slice_layers 5 must be 0 or in [1, num_layers 4]"},
      {[](RawHello& h) { h.reserved[2] = 1; }, "hello: reserved at byte offset 87 is 1, must be 0"},
      {[](RawHello& h) { h.compute_mask = 0; },
       "hello: compute_mask 0x0 must have bit 0 set and none at or above compute_ranks 1"},
      {[](RawHello& h) { h.lanes = 4, h.compute_ranks = 3, h.compute_mask = 6; },
       "hello: compute_mask 0x6 must have bit 0 set"},
      {[](RawHello& h) { h.lanes = 4, h.compute_ranks = 3, h.compute_mask = 9; },
       "hello: compute_mask 0x9 must have bit 0 set and none at or above compute_ranks 3"},
      {[](RawHello& h) { h.lanes = 0; }, "hello: lanes 0 must be in [1, 8]"},
      {[](RawHello& h) { h.lanes = 9; }, "hello: lanes 9 must be in [1, 8]"},
      {[](RawHello& h) { h.lanes = 255; }, "hello: lanes 255 must be in [1, 8]"},
      {[](RawHello& h) { h.partition = 2; }, "hello: partition 2 must be 0 (request) or 1 (head)"},
      {[](RawHello& h) { h.partition = 255; }, "hello: partition 255 must be"},
      {[](RawHello& h) { h.kv_head_end = 1; },
       "hello: KV heads [0, 1) must be [0, 2) for partition request, memory_rank 1 of 2 and num_kv_heads 2"},
      {[](RawHello& h) { h.kv_head_begin = 1; },
       "hello: KV heads [1, 2) must be [0, 2) for partition request"},
      {[](RawHello& h) { h.partition = 1, h.kv_head_begin = 1, h.kv_head_end = 3; },
       "hello: KV heads [1, 3) must be a non-empty range within [0, 2) for partition head"},
      {[](RawHello& h) { h.partition = 1, h.kv_head_begin = 2, h.kv_head_end = 1; },
       "hello: KV heads [2, 1) must be a non-empty range within [0, 2)"},
      {[](RawHello& h) { h.partition = 1, h.kv_head_begin = 1, h.kv_head_end = 1; },
       "hello: KV heads [1, 1) must be a non-empty range within [0, 2)"},
      {[](RawHello& h) { h.partition = 1, h.num_memory_ranks = 3, h.kv_head_begin = 1, h.kv_head_end = 2; },
       "hello: partition head needs num_kv_heads 2 >= num_memory_ranks 3"},
      {[](RawHello& h) { h.partition = 1, h.num_heads = 12, h.num_kv_heads = 3, h.num_memory_ranks = 4; },
       "hello: partition head needs num_kv_heads 3 >= num_memory_ranks 4"},
  };
  // The head partition's slices: rank m of M holds [m·Hkv/M, (m+1)·Hkv/M) at start, and after a
  // re-partition over the survivors any non-empty range (here 3 survivors of 4 over 8 KV heads:
  // [0, 2), [2, 5), [5, 8); and one survivor holding every head).
  for (auto [rank, ranks, kv_heads, begin, end] :
       {std::tuple<uint16_t, uint16_t, uint32_t, uint32_t, uint32_t>{1, 2, 2, 1, 2},
        {0, 2, 2, 0, 1},
        {3, 4, 8, 6, 8},
        {0, 1, 8, 0, 8},
        {7, 8, 8, 7, 8},
        {0, 4, 8, 0, 2},
        {1, 4, 8, 2, 5},
        {3, 4, 8, 5, 8},
        {1, 2, 2, 0, 2}}) {
    RawHello h;
    h.partition = 1, h.memory_rank = rank, h.num_memory_ranks = ranks, h.num_kv_heads = kv_heads;
    h.num_heads = 2 * kv_heads, h.kv_head_begin = begin, h.kv_head_end = end;
    absl::StatusOr<HelloMessage> m = DecodeHello(MakeFrame(kHelloMagic, HelloBody(h)));
    ASSERT_TRUE(m.ok()) << rank << " of " << ranks << ": " << m.status();
    EXPECT_EQ(m->partition, AttentionPartition::kHead);
    EXPECT_EQ(m->kv_head_begin, begin);
    EXPECT_EQ(m->kv_head_end, end);
  }
  // A version 1 hello (before the partition) and a version 2 hello (byte 54 reserved, 0: no lanes)
  // are refused by their version, not read as version 9.
  for (uint16_t version : {uint16_t{1}, uint16_t{2}}) {
    RawHello old;
    old.lanes = 0;
    const absl::Status s = DecodeHello(MakeFrame(kHelloMagic, HelloBody(old), version)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "hello: version " + std::to_string(version) + kOlderVersion);
  }
  // The limits and combinations that are valid.
  for (auto [tokens, sharing] : {std::pair<uint16_t, uint8_t>{0, 0}, {1, 0}, {1, 1}, {4096, 2}, {4096, 0}}) {
    RawHello h;
    h.prefix_block_tokens = tokens, h.prefix_sharing = sharing;
    absl::StatusOr<HelloMessage> m = DecodeHello(MakeFrame(kHelloMagic, HelloBody(h)));
    ASSERT_TRUE(m.ok()) << tokens << " " << int{sharing} << ": " << m.status();
    EXPECT_EQ(m->prefix_block_tokens, tokens);
    EXPECT_EQ(m->prefix_sharing, sharing);
  }
  ASSERT_TRUE(DecodeHello(MakeFrame(kHelloMagic, HelloBody(RawHello{}))).ok());
  for (uint8_t mask : {1, 3, 5, 7}) {  // a rank that rejoins after compute ranks were given up
    RawHello h;
    h.lanes = 4, h.compute_ranks = 3, h.compute_mask = mask;
    absl::StatusOr<HelloMessage> m = DecodeHello(MakeFrame(kHelloMagic, HelloBody(h)));
    ASSERT_TRUE(m.ok()) << int{mask} << ": " << m.status();
    EXPECT_EQ(m->compute_mask, mask);
  }
  for (const Case& c : cases) {
    RawHello h;
    c.mutate(h);
    absl::Status s = DecodeHello(MakeFrame(kHelloMagic, HelloBody(h))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
  }
  for (size_t size : {56, 64, 72, 111, 113}) {  // versions 1, 2 to 9, this one's less or more
    Bytes body = HelloBody(RawHello{});
    body.resize(size);
    absl::Status s = DecodeHello(MakeFrame(kHelloMagic, body)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()),
                    "hello: body_bytes " + std::to_string(size) + " at byte offset 8 must be 112");
  }
  // The struct validator says the same, and the encoder writes invalid values as given.
  HelloMessage h;
  h.num_heads = 32, h.num_kv_heads = 3;
  EXPECT_EQ(ValidateHello(h).message(), "hello: num_kv_heads 3 must divide num_heads 32");
  EXPECT_EQ(DecodeHello(EncodeHello(h)).status().message(), "hello: num_kv_heads 3 must divide num_heads 32");
  h = HelloMessage{};
  h.dtype = static_cast<DType>(7);
  EXPECT_CONTAINS(std::string(ValidateHello(h).message()), "hello: dtype 7");
  h = HelloMessage{};
  h.prefix_sharing = static_cast<uint8_t>(PrefixSharing::kOn);
  EXPECT_EQ(ValidateHello(h).message(),
            "hello: prefix_sharing 1 needs prefix_block_tokens >= 1 (a prefix registry)");
  EXPECT_EQ(DecodeHello(EncodeHello(h)).status(), ValidateHello(h));
  h = HelloMessage{};
  h.num_heads = 16, h.num_kv_heads = 8, h.num_memory_ranks = 9, h.memory_rank = 1;
  h.partition = AttentionPartition::kHead;
  EXPECT_EQ(ValidateHello(h).message(), "hello: partition head needs num_kv_heads 8 >= num_memory_ranks 9");
  EXPECT_EQ(DecodeHello(EncodeHello(h)).status(), ValidateHello(h));
  h.partition = static_cast<AttentionPartition>(9);
  EXPECT_EQ(ValidateHello(h).message(), "hello: partition 9 must be 0 (request) or 1 (head)");
  for (uint8_t lanes : {uint8_t{0}, uint8_t{9}, uint8_t{200}}) {
    h = HelloMessage{};
    h.lanes = lanes;
    EXPECT_EQ(ValidateHello(h).message(), "hello: lanes " + std::to_string(lanes) + " must be in [1, 8]");
    EXPECT_EQ(DecodeHello(EncodeHello(h)).status(), ValidateHello(h));
  }
  EXPECT_TRUE(ValidateHello(HelloMessage{}).ok());
}

// The hello's lanes, for every byte value: [1, 8] decodes (from frame offset 70, before the
// reserved byte 71) and re-encodes to the same bytes; any other value is refused.
TEST(HelloWire, Lanes) {
  EXPECT_EQ(HelloMessage{}.lanes, 1);
  EXPECT_EQ(EncodeHello(HelloMessage{})[70], 1);
  EXPECT_EQ(EncodeHello(HelloMessage{})[71], 1);  // compute_ranks
  int valid = 0;
  for (int lanes = 0; lanes <= 255; ++lanes) {
    RawHello raw;
    raw.lanes = static_cast<uint8_t>(lanes);
    const Bytes frame = MakeFrame(kHelloMagic, HelloBody(raw));
    ASSERT_EQ(frame[70], lanes);
    absl::StatusOr<HelloMessage> h = DecodeHello(frame);
    if (lanes >= 1 && lanes <= 8) {
      ++valid;
      ASSERT_TRUE(h.ok()) << lanes << ": " << h.status();
      EXPECT_EQ(h->lanes, lanes);
      EXPECT_EQ(h->memory_rank, 1);  // the fields around it are unchanged
      EXPECT_EQ(h->partition, AttentionPartition::kRequest);
      EXPECT_EQ(h->kv_head_begin, 0u);
      EXPECT_EQ(h->kv_head_end, 2u);
      EXPECT_EQ(EncodeHello(*h), frame);
      HelloMessage other = *h;
      other.lanes = static_cast<uint8_t>(lanes % 8 + 1);
      EXPECT_FALSE(other == *h);  // operator== sees the field
      continue;
    }
    ASSERT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
    ASSERT_EQ(h.status().message(), "hello: lanes " + std::to_string(lanes) + " must be in [1, 8]");
  }
  EXPECT_EQ(valid, 8);
}

TEST(HelloReplyWire, FieldRangeViolationsNameField) {
  struct Case {
    std::function<void(RawReply&)> mutate;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](RawReply& r) { r.dtype = 3; }, "hello reply: dtype 3 must be 0 (f32), 1 (f16) or 2 (bf16)"},
      {[](RawReply& r) { r.kv_capacity_tokens = 0; },
       "hello reply: kv_capacity_tokens 0 must be in [1, 2147483647]"},
      {[](RawReply& r) { r.kv_capacity_tokens = uint64_t{1} << 31; },
       "hello reply: kv_capacity_tokens 2147483648 must be in [1, 2147483647]"},
      {[](RawReply& r) { r.persisted = 9; }, "hello reply: persisted 9 at byte offset 31 must be 0 or 1"},
      {[](RawReply& r) { r.device = std::string("cuda\0:0", 7); },
       "hello reply: device has a NUL byte at index 4"},
      {[](RawReply& r) { r.device = std::string(1, '\0'); }, "hello reply: device has a NUL byte at index 0"},
  };
  for (const Case& c : cases) {
    RawReply r;
    c.mutate(r);
    absl::Status s = DecodeHelloReply(MakeFrame(kHelloReplyMagic, ReplyBody(r))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
  }
  HelloReplyMessage r;
  r.device = std::string(kMaxDeviceBytes + 1, 'a');
  EXPECT_EQ(ValidateHelloReply(r).message(), "hello reply: device of 257 bytes exceeds 256");
  r.device = "";
  EXPECT_TRUE(ValidateHelloReply(r).ok());

  // The reply must answer the hello.
  HelloMessage hello;
  hello.memory_rank = 3, hello.num_memory_ranks = 4, hello.dtype = DType::kF16;
  HelloReplyMessage reply;
  reply.memory_rank = 3, reply.dtype = DType::kF16, reply.kv_capacity_tokens = 12345;
  EXPECT_TRUE(ValidateHelloReplyMatches(hello, reply).ok());
  hello.kv_capacity_tokens = 12345;
  EXPECT_TRUE(ValidateHelloReplyMatches(hello, reply).ok());
  hello.kv_capacity_tokens = 100;
  EXPECT_EQ(ValidateHelloReplyMatches(hello, reply).message(),
            "hello reply: kv_capacity_tokens 12345 must equal the hello's kv_capacity_tokens 100");
  hello.kv_capacity_tokens = 0;
  reply.dtype = DType::kBF16;
  EXPECT_EQ(ValidateHelloReplyMatches(hello, reply).message(),
            "hello reply: dtype 2 must equal the hello's dtype 1");
  reply.memory_rank = 0;
  EXPECT_EQ(ValidateHelloReplyMatches(hello, reply).message(),
            "hello reply: memory_rank 0 must equal the hello's memory_rank 3");
}

TEST(ReleaseWire, DuplicatesAndReservedRejected) {
  absl::Status s = DecodeRelease(MakeFrame(kReleaseMagic, ReleaseBody(1, {4, 9, 7, 9, 4}))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "release: request_id 4 at index 4 repeats index 0");
  s = DecodeRelease(MakeFrame(kReleaseMagic, ReleaseBody(1, {kU64Max, 0, kU64Max}))).status();
  EXPECT_EQ(s.message(), "release: request_id 18446744073709551615 at index 2 repeats index 0");
  s = DecodeRelease(MakeFrame(kReleaseMagic, ReleaseBody(1, {1}, std::nullopt, 0x01000000))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "release: reserved at byte offset 31 is 1, must be 0");
  EXPECT_EQ(ValidateRelease(ReleaseMessage{5, {1, 2, 2}}).message(),
            "release: request_id 2 at index 2 repeats index 1");
  EXPECT_TRUE(ValidateRelease(ReleaseMessage{5, {3, 2, 1}}).ok());
  // Many distinct ids decode; one repeat among them is found.
  ReleaseMessage big;
  for (uint64_t i = 0; i < 20000; ++i) big.request_ids.push_back(i * 0x9e3779b97f4a7c15ull);
  ASSERT_TRUE(DecodeRelease(EncodeRelease(big)).ok());
  big.request_ids[17000] = big.request_ids[123];
  EXPECT_CONTAINS(std::string(DecodeRelease(EncodeRelease(big)).status().message()),
                  "at index 17000 repeats index 123");
}

TEST(ErrorWire, FieldRangeViolationsNameField) {
  for (uint32_t code : {0u, 17u, kU32Max}) {
    absl::Status s = DecodeError(MakeFrame(kErrorMagic, ErrorBody(code, "x"))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "error message: code " + std::to_string(code) +
                               " must be in [1, 16] (an absl::StatusCode other than OK)");
  }
  absl::Status s = DecodeError(MakeFrame(kErrorMagic, ErrorBody(2, std::string("ab\0c", 4)))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "error message: message has a NUL byte at index 2");
  ErrorMessage e{2, std::string(kMaxErrorMessageBytes + 1, 'a')};
  EXPECT_EQ(ValidateError(e).message(), "error message: message of 65537 bytes exceeds 65536");
  EXPECT_TRUE(ValidateError(ErrorMessage{1, ""}).ok());
  EXPECT_TRUE(ValidateBye(ByeMessage{}).ok());
  for (size_t size : {7, 9}) {
    s = DecodeBye(MakeFrame(kByeMagic, Bytes(size, 0))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "bye: body_bytes " + std::to_string(size) + " at byte offset 8 must be 8");
  }
}

TEST(ControlWire, StatsRoundTripAndReservedBytes) {
  std::mt19937_64 rng(77);
  for (int i = 0; i < 200; ++i) {
    const StatsRequestMessage q{i == 0 ? kU64Max : rng()};
    const Bytes fq = EncodeStatsRequest(q);
    ASSERT_EQ(fq.size(), kFrameHeaderBytes + kStatsRequestBodyBytes);
    absl::StatusOr<StatsRequestMessage> qback = DecodeStatsRequest(fq);
    ASSERT_TRUE(qback.ok()) << qback.status();
    EXPECT_TRUE(*qback == q);
    const MemoryStatsMessage m{.cookie = rng(),
                               .memory_rank = static_cast<uint16_t>(rng()),
                               .steps = rng(),
                               .attention_ns = i == 1 ? kU64Max : rng()};
    const Bytes fm = EncodeMemoryStats(m);
    ASSERT_EQ(fm.size(), kFrameHeaderBytes + kMemoryStatsBodyBytes);
    absl::StatusOr<MemoryStatsMessage> mback = DecodeMemoryStats(fm);
    ASSERT_TRUE(mback.ok()) << mback.status();
    EXPECT_TRUE(*mback == m);
  }
  // A reserved byte that is not 0 (behind a valid frame header) and a body of the wrong size.
  Bytes body(kMemoryStatsBodyBytes, 0);
  body[12] = 1;
  absl::Status s = DecodeMemoryStats(MakeFrame(kMemoryStatsMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "memory stats: reserved");
  s = DecodeStatsRequest(MakeFrame(kStatsRequestMagic, Bytes(9, 0))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "stats request: body_bytes 9 at byte offset 8 must be 8");
}

TEST(ControlWire, HeartbeatRoundTripRangesAndReservedBytes) {
  std::mt19937_64 rng(78);
  for (int i = 0; i < 200; ++i) {
    const HeartbeatMessage h{.seq = i == 0 ? kU64Max : rng(),
                             .silence_ms = i == 1 ? 1u
                                           : i == 2
                                               ? kMaxHeartbeatSilenceMs
                                               : static_cast<uint32_t>(1 + rng() % kMaxHeartbeatSilenceMs)};
    const Bytes fh = EncodeHeartbeat(h);
    ASSERT_EQ(fh.size(), kFrameHeaderBytes + kHeartbeatBodyBytes);
    absl::StatusOr<HeartbeatMessage> hback = DecodeHeartbeat(fh);
    ASSERT_TRUE(hback.ok()) << hback.status();
    EXPECT_TRUE(*hback == h);
    const HeartbeatReplyMessage r{.seq = rng(), .memory_rank = static_cast<uint16_t>(rng())};
    absl::StatusOr<HeartbeatReplyMessage> rback = DecodeHeartbeatReply(EncodeHeartbeatReply(r));
    ASSERT_TRUE(rback.ok()) << rback.status();
    EXPECT_TRUE(*rback == r);
  }
  // silence_ms outside [1, 2^31-1], a reserved byte that is not 0, a body of the wrong size.
  for (uint32_t silence : {0u, kMaxHeartbeatSilenceMs + 1, 0xffffffffu}) {
    Bytes body(kHeartbeatBodyBytes, 0);
    for (int k = 0; k < 4; ++k) body[8 + k] = static_cast<uint8_t>(silence >> (8 * k));
    const absl::Status s = DecodeHeartbeat(MakeFrame(kHeartbeatMagic, body)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), absl::StrCat("heartbeat: silence_ms ", silence,
                                        " at byte offset 24 must be in [1, 2147483647]"));
  }
  Bytes body(kHeartbeatBodyBytes, 0);
  body[8] = 1;
  body[15] = 1;
  absl::Status s = DecodeHeartbeat(MakeFrame(kHeartbeatMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "heartbeat: reserved");
  body.assign(kHeartbeatBodyBytes, 0);
  body[10] = 1;
  s = DecodeHeartbeatReply(MakeFrame(kHeartbeatReplyMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "heartbeat reply: reserved");
  s = DecodeHeartbeatReply(MakeFrame(kHeartbeatReplyMagic, Bytes(17, 0))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "heartbeat reply: body_bytes 17 at byte offset 8 must be 16");
}

TEST(ControlWire, StepDiscardRoundTripRangesAndReservedBytes) {
  std::mt19937_64 rng(17);
  for (int i = 0; i < 200; ++i) {
    StepDiscardMessage d{.step_id = i == 0 ? kU64Max : rng(),
                         .seqno_base = i == 0 ? kU64Max : 1 + rng() % kU64Max,
                         .compute_mask = static_cast<uint8_t>(rng() | 1),
                         .drop = i % 2 == 1};
    // Lost memory ranks: none, a few, or the largest ids.
    for (uint32_t rank = static_cast<uint32_t>(rng() % 4); rank <= 0xffff && d.lost_memory_ranks.size() < 40;
         rank += 1 + static_cast<uint32_t>(rng() % (i % 2 == 0 ? 3 : 5000))) {
      if (i % 3 == 0) break;
      d.lost_memory_ranks.push_back(static_cast<uint16_t>(rank));
    }
    const Bytes f = EncodeStepDiscard(d);
    ASSERT_EQ(f.size(), kFrameHeaderBytes + kStepDiscardFixedBytes + 2 * d.lost_memory_ranks.size());
    absl::StatusOr<StepDiscardMessage> back = DecodeStepDiscard(f);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == d);
  }
  // seqno_base 0, a mask without compute rank 0, a drop byte that is not 0 or 1, a reserved byte
  // that is not 0, a wrong size, a lost_count that does not match the size, lost ranks out of order.
  Bytes body(kStepDiscardFixedBytes, 0);
  body[16] = 1;
  absl::Status s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "step discard: seqno_base 0 at byte offset 24 must be >= 1");
  body[8] = 1;
  body[16] = 6;
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "compute_mask 0x06 at byte offset 32 must have bit 0");
  body[16] = 1;
  body[17] = 2;
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "step discard: drop 2");
  body[17] = 0;
  for (size_t reserved : {20, 23}) {
    Bytes bad = body;
    bad[reserved] = 1;
    s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, bad)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "step discard: reserved");
  }
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, Bytes(23, 0))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "step discard: body_bytes 23 at byte offset 8 must be 24");
  Bytes odd = body;
  odd.push_back(0);
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, odd)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "step discard: lost_count 0 at byte offset 34 needs a body of 24 bytes, not 25");
  Bytes two = body;
  two[18] = 2;
  for (uint8_t b : {4, 0, 5, 0}) two.push_back(b);
  ASSERT_TRUE(DecodeStepDiscard(MakeFrame(kStepDiscardMagic, two)).ok());
  two[18] = 3;
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, two)).status();
  EXPECT_EQ(s.message(), "step discard: lost_count 3 at byte offset 34 needs a body of 30 bytes, not 28");
  two[18] = 2;
  two[26] = 3;
  s = DecodeStepDiscard(MakeFrame(kStepDiscardMagic, two)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(),
            "step discard: lost memory rank 3 at byte offset 42 must be above the one before it (4)");
}

TEST(ErrorWire, StatusConversions) {
  for (int code = 1; code <= 16; ++code) {
    const absl::Status st(static_cast<absl::StatusCode>(code), "something failed: x=1");
    const ErrorMessage e = ErrorMessageFromStatus(st);
    EXPECT_EQ(e.code, static_cast<uint32_t>(code));
    ASSERT_TRUE(ValidateError(e).ok()) << ValidateError(e);
    absl::StatusOr<ErrorMessage> back = DecodeError(EncodeError(e));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(StatusFromErrorMessage(*back), st);
  }
  // OK and codes outside [1, 16] become Unknown.
  ErrorMessage e = ErrorMessageFromStatus(absl::OkStatus());
  EXPECT_EQ(e.code, 2u);
  EXPECT_TRUE(ValidateError(e).ok());
  e = ErrorMessageFromStatus(absl::Status(static_cast<absl::StatusCode>(42), "odd"));
  EXPECT_EQ(e.code, 2u);
  EXPECT_TRUE(ValidateError(e).ok());
  for (uint32_t code : {0u, 17u, 1000u}) {
    absl::Status st = StatusFromErrorMessage(ErrorMessage{code, "m"});
    EXPECT_EQ(st.code(), absl::StatusCode::kUnknown);
    EXPECT_EQ(st.message(), "error code " + std::to_string(code) + ": m");
  }
  // NUL bytes and overlong messages are made valid.
  e = ErrorMessageFromStatus(absl::InternalError(std::string("a\0b", 3)));
  EXPECT_EQ(e.message, "a?b");
  e = ErrorMessageFromStatus(absl::InternalError(std::string(kMaxErrorMessageBytes + 10, 'z')));
  EXPECT_EQ(e.message.size(), kMaxErrorMessageBytes);
  EXPECT_TRUE(ValidateError(e).ok());
  EXPECT_TRUE(DecodeError(EncodeError(e)).ok());
}

TEST(PeekFrameMagic, KnownUnknownAndShort) {
  std::vector<Bytes> frames = ControlFrames();
  frames.push_back(SmallPlanFrame());
  frames.push_back(EncodeLayerMessageHeader(LayerMessageHeader{}));
  const uint32_t want[] = {
      kHelloMagic,           kHelloReplyMagic,   kReleaseMagic,   kErrorMagic,          kByeMagic,
      kStatsRequestMagic,    kMemoryStatsMagic,  kHeartbeatMagic, kHeartbeatReplyMagic, kStepDiscardMagic,
      kPersistedBlocksMagic, kMemoryRejoinMagic, kHeadSplitMagic, kStepPlanMagic,       kLayerMessageMagic};
  for (size_t k = 0; k < frames.size(); ++k) {
    absl::StatusOr<uint32_t> m = PeekFrameMagic(frames[k]);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(*m, want[k]);
    // Only the magic is looked at: a bad version or a truncated body still peeks.
    Bytes f = frames[k];
    f[4] = 99;
    f.resize(kFrameHeaderBytes);
    EXPECT_EQ(PeekFrameMagic(f).value_or(0), want[k]);
    for (size_t n = 0; n < kFrameHeaderBytes; ++n) {
      absl::Status s = PeekFrameMagic(absl::MakeConstSpan(f.data(), n)).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    }
  }
  Bytes f = ControlFrames()[0];
  f[3] = 'X';
  absl::Status s = PeekFrameMagic(f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "unknown frame magic 0x58484454 ('TDHX')");
  f[0] = 0;
  EXPECT_CONTAINS(std::string(PeekFrameMagic(f).status().message()),
                  "unknown frame magic 0x58484400 ('.DHX')");
  EXPECT_CONTAINS(std::string(PeekFrameMagic(Bytes(3, 0)).status().message()), "needs 16 bytes but 3");
}

// Random and mutated frames: decoding never crashes, and an OK result re-encodes to the input.
TEST(Wire, RandomizedCorpus) {
  std::mt19937_64 rng(20240601);
  auto u = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  std::vector<Bytes> seeds;
  for (size_t n : {0, 1, 2, 5}) seeds.push_back(EncodeStepPlan(RandomPlan(rng, n, false)));
  seeds.push_back(EncodeStepPlan(RandomPlan(rng, 3, true)));
  for (int i = 0; i < 4; ++i) seeds.push_back(EncodeLayerMessageHeader(RandomHeader(rng)));
  for (int i = 0; i < 2; ++i) seeds.push_back(EncodeHello(RandomHello(rng, i == 1)));
  for (size_t n : {0, 9, 40}) {
    HelloReplyMessage r = RandomReply(rng);
    r.device = RandomText(rng, n);
    seeds.push_back(EncodeHelloReply(r));
  }
  for (size_t n : {0, 1, 4}) seeds.push_back(EncodeRelease(RandomRelease(rng, n)));
  for (size_t n : {0, 12}) seeds.push_back(EncodeError(RandomError(rng, n)));
  seeds.push_back(EncodeBye(ByeMessage{rng()}));
  seeds.push_back(EncodeStatsRequest(StatsRequestMessage{rng()}));
  seeds.push_back(EncodeMemoryStats(MemoryStatsMessage{.cookie = rng(), .memory_rank = 1, .steps = rng()}));
  // Every decoder with the encoder of its result, type-erased: decodes `f`, and on success checks
  // that the result re-encodes to `f`.
  struct Codec {
    uint32_t magic;
    std::function<bool(const Bytes&)> decode_reencodes;  // false when decoding fails
    int ok = 0;
  };
  auto codec = [](uint32_t magic, auto decode, auto encode) {
    return Codec{magic, [decode, encode](const Bytes& f) {
                   auto v = decode(f);
                   if (!v.ok()) {
                     EXPECT_FALSE(v.status().message().empty());
                     return false;
                   }
                   EXPECT_EQ(encode(*v), f);
                   return true;
                 }};
  };
  std::vector<Codec> codecs = {
      codec(kHelloMagic, DecodeHello, EncodeHello),
      codec(kHelloReplyMagic, DecodeHelloReply, EncodeHelloReply),
      codec(kReleaseMagic, DecodeRelease, EncodeRelease),
      codec(kErrorMagic, DecodeError, EncodeError),
      codec(kByeMagic, DecodeBye, EncodeBye),
      codec(kStatsRequestMagic, DecodeStatsRequest, EncodeStatsRequest),
      codec(kMemoryStatsMagic, DecodeMemoryStats, EncodeMemoryStats),
  };

  const auto start = std::chrono::steady_clock::now();
  int plan_ok = 0, header_ok = 0;
  constexpr int kFrames = 200000;
  for (int iter = 0; iter < kFrames; ++iter) {
    Bytes f;
    if (u(0, 9) == 0) {  // random bytes, sometimes behind a plausible frame header
      f.resize(u(0, 160));
      for (uint8_t& b : f) b = static_cast<uint8_t>(rng());
    } else {
      f = seeds[u(0, seeds.size() - 1)];
      for (int m = static_cast<int>(u(1, 4)); m > 0; --m) {
        switch (u(0, 5)) {
          case 0:
          case 1:
            if (!f.empty()) f[u(0, f.size() - 1)] ^= static_cast<uint8_t>(1u << u(0, 7));
            break;
          case 2:
            if (!f.empty()) f[u(0, f.size() - 1)] = static_cast<uint8_t>(rng());
            break;
          case 3:
            f.resize(u(0, f.size()));
            break;
          case 4:
            for (int k = static_cast<int>(u(1, 60)); k > 0; --k) f.push_back(static_cast<uint8_t>(rng()));
            break;
          default:  // interesting values into an aligned field
            if (f.size() >= 4) {
              const uint32_t vals[] = {0, 1, 0x7fffffff, 0x80000000, 0xffffffff, 0x7fc00000, 0x3f800000};
              const size_t at = u(0, (f.size() - 4) / 4) * 4;
              const uint32_t v = vals[u(0, 6)];
              for (int k = 0; k < 4; ++k) f[at + k] = static_cast<uint8_t>(v >> (8 * k));
            }
        }
      }
    }
    if (f.size() >= kFrameHeaderBytes && u(0, 9) < 8) {  // mostly make the frame header consistent
      const Bytes body(f.begin() + kFrameHeaderBytes, f.end());
      if (u(0, 3) != 0) {
        f[8] = static_cast<uint8_t>(body.size()), f[9] = static_cast<uint8_t>(body.size() >> 8);
        f[10] = static_cast<uint8_t>(body.size() >> 16), f[11] = static_cast<uint8_t>(body.size() >> 24);
      }
      const uint32_t crc = Crc32c(body);
      for (int k = 0; k < 4; ++k) f[12 + k] = static_cast<uint8_t>(crc >> (8 * k));
    }
    absl::StatusOr<StepPlan> plan = DecodeStepPlan(f);
    if (plan.ok()) {
      ++plan_ok;
      ASSERT_EQ(EncodeStepPlan(*plan), f) << "iteration " << iter;
    } else {
      ASSERT_FALSE(plan.status().message().empty());
    }
    absl::StatusOr<LayerMessageHeader> header = DecodeLayerMessageHeader(f);
    if (header.ok()) {
      ++header_ok;
      ASSERT_EQ(EncodeLayerMessageHeader(*header), f) << "iteration " << iter;
    }
    int accepted = plan.ok() + header.ok();
    std::optional<uint32_t> accepted_magic;
    if (plan.ok()) accepted_magic = kStepPlanMagic;
    if (header.ok()) accepted_magic = kLayerMessageMagic;
    // The control decoders see every frame whose magic is theirs, and every 8th frame whatever its
    // magic (a wrong magic is rejected up front; building that error for all of them, every
    // frame, would dominate the run time under ASan).
    const uint32_t magic =
        f.size() >= 4 ? (f[0] | f[1] << 8 | f[2] << 16 | static_cast<uint32_t>(f[3]) << 24) : 0;
    for (Codec& c : codecs) {
      if ((iter % 8 == 0 || magic == c.magic) && c.decode_reencodes(f)) {
        ++c.ok, ++accepted;
        accepted_magic = c.magic;
      }
    }
    ASSERT_FALSE(::testing::Test::HasFailure()) << "iteration " << iter;
    ASSERT_LE(accepted, 1) << "iteration " << iter;
    absl::StatusOr<uint32_t> peeked = PeekFrameMagic(f);
    if (f.size() < kFrameHeaderBytes) {
      ASSERT_EQ(peeked.status().code(), absl::StatusCode::kDataLoss) << "iteration " << iter;
    } else if (accepted_magic) {
      ASSERT_EQ(peeked.value_or(0), *accepted_magic) << "iteration " << iter;
    } else if (!peeked.ok()) {
      ASSERT_EQ(peeked.status().code(), absl::StatusCode::kInvalidArgument) << "iteration " << iter;
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The corpus must reach the field checks, not just the crc: some mutants stay valid.
  EXPECT_GT(plan_ok, 1000);
  EXPECT_GT(header_ok, 1000);
  for (const Codec& c : codecs) EXPECT_GT(c.ok, 300) << "magic 0x" << std::hex << c.magic;
  EXPECT_LT(seconds, 5.0);
  std::printf("corpus: %d frames, %d plans ok, %d headers ok, %d/%d/%d/%d/%d control ok, %.2f s\n", kFrames,
              plan_ok, header_ok, codecs[0].ok, codecs[1].ok, codecs[2].ok, codecs[3].ok, codecs[4].ok,
              seconds);
}

TEST(RestoreWire, RoundTripsAndRefusesBadPlansAndFrames) {
  const RestoreReplyMessage reply{.step_id = 9, .memory_rank = 2, .failed = {0x11, 0x22}};
  const std::vector<uint8_t> frame = EncodeRestoreReply(reply);
  EXPECT_EQ(frame.size(), kFrameHeaderBytes + kRestoreReplyFixedBytes + 16);
  absl::StatusOr<RestoreReplyMessage> back = DecodeRestoreReply(frame);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, reply);
  EXPECT_EQ(*PeekFrameMagic(frame), kRestoreReplyMagic);
  for (size_t n = 0; n < frame.size(); ++n) {
    EXPECT_FALSE(DecodeRestoreReply(absl::Span<const uint8_t>(frame.data(), n)).ok()) << n;
  }
  StepPlan plan;
  plan.restores.push_back({.block_hash = 5, .parent_hash = 0, .block_index = 0, .memory_rank = 1});
  plan.restores.push_back({.block_hash = 6, .parent_hash = 5, .block_index = 1, .memory_rank = 1});
  absl::StatusOr<StepPlan> decoded = DecodeStepPlan(EncodeStepPlan(plan));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, plan);
  StepPlan bad = plan;
  bad.restores[1].parent_hash = 0;  // block_index 1 needs a parent
  EXPECT_NE(ValidateStepPlan(bad).message().find("restore 1"), std::string_view::npos);
  bad = plan;
  bad.restores.push_back(plan.restores[0]);
  EXPECT_FALSE(ValidateStepPlan(bad).ok());
}

// Version 8 carries the plan's next-use records (next_use_count in the fixed part's bytes 26..27,
// the records after the restores): golden bytes written out by hand (crc by the bitwise
// reference), round trips, and every malformed list refused naming what is wrong.
TEST(NextUseWire, GoldenBytesAndRefusals) {
  StepPlan plan;
  plan.step_id = 9;
  plan.next_uses.push_back({.block_hash = 0x1112131415161718, .next_use = 0, .memory_rank = 1});
  plan.next_uses.push_back({.block_hash = 0x2122232425262728, .next_use = 5, .memory_rank = 1});
  const Bytes golden = {
      0x54, 0x44, 0x53, 0x50, 0x0d, 0x00, 0x10, 0x00,
      0x40, 0x00, 0x00, 0x00, 0xa5, 0x74, 0x3a, 0x3a,  // frame: version 13, body_bytes 64
      0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // step_id
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request_count, group_count
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // publish_count, evict_count
      0x00, 0x01, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,  // micro-batch fields, next_use_count, restores
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // next use 0: block_hash
      0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // next_use, memory_rank, reserved
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,  // next use 1: block_hash
      0x05, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // next_use, memory_rank, reserved
  };
  EXPECT_EQ(EncodeStepPlan(plan), golden);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);

  // The largest list round-trips; a random plan with one does too.
  StepPlan full;
  for (size_t i = 0; i < kMaxPrefixNextUses; ++i)
    full.next_uses.push_back({.block_hash = i + 1,
                              .next_use = static_cast<int32_t>(i % 64),
                              .memory_rank = static_cast<uint16_t>(i % 3)});
  back = DecodeStepPlan(EncodeStepPlan(full));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == full);
  std::mt19937_64 rng(8);
  StepPlan random = RandomPlan(rng, 17, false);
  random.micro_batch = 0;
  random.next_uses = plan.next_uses;
  back = DecodeStepPlan(EncodeStepPlan(random));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == random);

  // Refused by the decoder and by ValidateStepPlan alike, naming the record.
  const std::vector<std::pair<std::function<void(StepPlan&)>, std::string>> cases = {
      {[](StepPlan& p) { p.next_uses[1].block_hash = 0; },
       "step plan: next use 1: block_hash 0, next_use 5: the hash must not be 0 and next_use must be >= 0"},
      {[](StepPlan& p) { p.next_uses[0].next_use = -1; },
       "step plan: next use 0: block_hash 1230066625199609624, "
       "next_use -1"},
      {[](StepPlan& p) { p.next_uses[1].block_hash = p.next_uses[0].block_hash; }, "next use"},
      {[](StepPlan& p) { p.micro_batch = 1, p.micro_batches = 2; },
       "step plan: micro_batch 1 carries next-use records (only micro-batch 0 may)"},
  };
  for (const auto& [mutate, want] : cases) {
    StepPlan p = plan;
    mutate(p);
    EXPECT_EQ(ValidateStepPlan(p).code(), absl::StatusCode::kInvalidArgument) << want;
    EXPECT_CONTAINS(std::string(ValidateStepPlan(p).message()), want);
    const absl::Status s = DecodeStepPlan(EncodeStepPlan(p)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), want);
  }
  // A reserved byte of a record, and a count above kMaxPrefixNextUses (with its records present).
  Bytes bad = golden;
  bad[16 + 32 + 14] = 7;
  absl::Status s = DecodeStepPlan(MakeFrame(kStepPlanMagic, Bytes(bad.begin() + 16, bad.end()))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "step plan: next use 0: reserved at byte offset 62 is 7, must be 0");
  Le over;
  over.U64(9).U32(0).U32(0).U32(0).U32(0).U8(0).U8(1).U16(kMaxPrefixNextUses + 1).U32(0);
  for (size_t i = 0; i <= kMaxPrefixNextUses; ++i) over.U64(i + 1).I32(0).U16(0).U16(0);
  s = DecodeStepPlan(MakeFrame(kStepPlanMagic, over.b)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "step plan: next_use_count 2049 at byte offset 42 exceeds 2048");
}

// Version 4 carries both the step request's top_logprobs (its last byte, 63) and the plan's
// restores (restore_count in the fixed part's bytes 28..31, the records after the evictions): one
// plan with both, and a restore reply, written out by hand (crc by the bitwise reference).
TEST(RestoreWire, GoldenBytesWithTopLogprobs) {
  StepPlan plan;
  plan.step_id = 9;
  plan.requests.push_back({.request_id = 1,
                           .memory_rank = 1,
                           .prefix_group = -1,
                           .position = 0,
                           .q_len = 4,
                           .kv_len = 4,
                           .sample = true,
                           .seed = 2,
                           .counter = 3,
                           .top_logprobs = kMaxTopLogprobs});
  plan.restores.push_back({.block_hash = 0x1112131415161718,
                           .parent_hash = 0x2122232425262728,
                           .block_index = 1,
                           .memory_rank = 1});
  const Bytes golden = {
      0x54, 0x44, 0x53, 0x50, 0x0d, 0x00, 0x10, 0x00,
      0x78, 0x00, 0x00, 0x00, 0x9a, 0x4c, 0xa6, 0x6d,  // frame: version 13, body_bytes 120
      0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // step_id
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request_count, group_count
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // publish_count, evict_count
      0x00, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // micro_batch, micro_batches, reserved, restore_count
      0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request 0: request_id
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // seed
      0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // counter
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // attach_hash
      0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00,  // prefix_group, position
      0x04, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00,  // q_len, kv_len
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // temperature, top_k
      0x00, 0x00, 0x80, 0x3f, 0x01, 0x00, 0x01, 0x14,  // top_p, memory_rank, sample, top_logprobs
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // restore 0: block_hash
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,  // parent_hash
      0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // block_index, memory_rank, reserved
  };
  EXPECT_EQ(EncodeStepPlan(plan), golden);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
  EXPECT_EQ(back->requests[0].top_logprobs, kMaxTopLogprobs);
  ASSERT_EQ(back->restores.size(), 1u);

  const RestoreReplyMessage reply{.step_id = 9, .memory_rank = 1, .failed = {0x1112131415161718}};
  const Bytes reply_golden = {
      0x54, 0x44, 0x52, 0x54, 0x0d, 0x00, 0x10, 0x00,
      0x18, 0x00, 0x00, 0x00, 0xdb, 0xa6, 0x65, 0x76,  // frame: version 13, body_bytes 24
      0x09, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // step_id
      0x01, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // memory_rank, reserved, failed_count
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // failed[0]
  };
  EXPECT_EQ(EncodeRestoreReply(reply), reply_golden);
  absl::StatusOr<RestoreReplyMessage> reply_back = DecodeRestoreReply(reply_golden);
  ASSERT_TRUE(reply_back.ok()) << reply_back.status();
  EXPECT_EQ(*reply_back, reply);
}

// Version 10: a shifted restore (kv.store_pre_rope) with two segments, written out by hand (crc by
// the bitwise reference), and segment fields out of range.
TEST(RestoreWire, SegmentsGoldenBytesAndRanges) {
  StepPlan plan;
  plan.step_id = 5;
  plan.restores.push_back(
      {.block_hash = 0x1112131415161718,
       .parent_hash = 0x2122232425262728,
       .block_index = 3,
       .memory_rank = 2,
       .segments = {{.source_hash = 0x3132333435363738, .source_index = 1, .source_row = 10, .rows = 6},
                    {.source_hash = 0x4142434445464748, .source_index = 2, .source_row = 0, .rows = 10}}});
  const Bytes golden = {
      0x54, 0x44, 0x53, 0x50, 0x0d, 0x00, 0x10, 0x00,  // frame: magic, version 13, header_bytes
      0x58, 0x00, 0x00, 0x00, 0x73, 0x90, 0xc6, 0x16,  // body_bytes 88, crc
      0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // step_id
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // request_count, group_count
      0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // publish_count, evict_count
      0x00, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // micro_batch, micro_batches, next_use_count,
                                                       // restore_count
      0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11,  // restore 0: block_hash
      0x28, 0x27, 0x26, 0x25, 0x24, 0x23, 0x22, 0x21,  // parent_hash
      0x03, 0x00, 0x00, 0x00, 0x02, 0x00, 0x02, 0x00,  // block_index, memory_rank, segment_count
      0x38, 0x37, 0x36, 0x35, 0x34, 0x33, 0x32, 0x31,  // segment 0: source_hash
      0x01, 0x00, 0x00, 0x00, 0x0a, 0x00, 0x06, 0x00,  // source_index, source_row, rows
      0x48, 0x47, 0x46, 0x45, 0x44, 0x43, 0x42, 0x41,  // segment 1: source_hash
      0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0a, 0x00,  // source_index, source_row, rows
  };
  EXPECT_EQ(EncodeStepPlan(plan), golden);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);

  // One segment fewer than segment_count says: the body is short.
  Bytes body(golden.begin() + 16, golden.end() - 16);
  absl::Status s = DecodeStepPlan(MakeFrame(kStepPlanMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "the restores' 2 segments need 32 bytes at byte offset 72 but 16 remain");
  // segment_count above the limit.
  body.assign(golden.begin() + 16, golden.end());
  body[54] = 17;
  s = DecodeStepPlan(MakeFrame(kStepPlanMagic, body)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "step plan: restore 0: segment_count 17 at byte offset 70 exceeds 16");
  // Fields out of range, each named.
  const std::vector<std::pair<std::function<void(PrefixSegment&)>, std::string>> cases = {
      {[](PrefixSegment& g) { g.source_hash = 0; }, "source_hash 0,"},
      {[](PrefixSegment& g) { g.source_index = -1; }, "source_index -1"},
      {[](PrefixSegment& g) { g.rows = 0; }, "rows [0, 0)"},
      {[](PrefixSegment& g) { g.source_row = 4000, g.rows = 97; }, "rows [4000, 4097)"},
  };
  for (const auto& [mutate, want] : cases) {
    StepPlan bad = plan;
    mutate(bad.restores[0].segments[1]);
    Le w;
    w.U64(5).U32(0).U32(0).U32(0).U32(0).U8(0).U8(1).U16(0).U32(1);
    w.U64(0x1112131415161718).U64(0x2122232425262728).I32(3).U16(2).U16(2);
    for (const PrefixSegment& g : bad.restores[0].segments)
      w.U64(g.source_hash).I32(g.source_index).U16(g.source_row).U16(g.rows);
    s = DecodeStepPlan(MakeFrame(kStepPlanMagic, w.b)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_CONTAINS(std::string(s.message()), "step plan: restore 0: segment 1: ");
    EXPECT_CONTAINS(std::string(s.message()), want);
  }
}

TEST(ComputeReplicaWire, RoundTripsAndRefusesBadFrames) {
  // Compute hello: golden bytes (crc by the bitwise reference), round trip, every bad rank pair.
  const ComputeHelloMessage hello{.compute_rank = 2, .compute_ranks = 3};
  const Bytes frame = EncodeComputeHello(hello);
  ASSERT_EQ(frame.size(), kFrameHeaderBytes + kComputeHelloBodyBytes);
  EXPECT_EQ(Bytes(frame.begin() + 16, frame.end()), (Bytes{0x02, 0x00, 0x03, 0x00, 0, 0, 0, 0}));
  absl::StatusOr<ComputeHelloMessage> back = DecodeComputeHello(frame);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, hello);
  EXPECT_EQ(PeekFrameMagic(frame).value_or(0), kComputeHelloMagic);
  for (const auto& [rank, ranks] : std::vector<std::pair<int, int>>{{0, 2}, {2, 2}, {1, 1}, {1, 9}, {9, 9}}) {
    Le w;
    w.U16(static_cast<uint16_t>(rank)).U16(static_cast<uint16_t>(ranks)).U32(0);
    absl::StatusOr<ComputeHelloMessage> bad = DecodeComputeHello(MakeFrame(kComputeHelloMagic, w.b));
    ASSERT_FALSE(bad.ok()) << rank << " of " << ranks;
    EXPECT_NE(bad.status().message().find("compute hello: compute_rank"), std::string::npos) << bad.status();
  }
  Le reserved;
  reserved.U16(1).U16(2).U32(0x100);
  EXPECT_FALSE(DecodeComputeHello(MakeFrame(kComputeHelloMagic, reserved.b)).ok());

  // Replica ring: golden body, round trips, and every malformed body refused with the field named.
  const Bytes ring = EncodeReplicaRing({.next_address = "h:1"});
  EXPECT_EQ(Bytes(ring.begin() + 16, ring.end()), (Bytes{0x03, 0x00, 0, 0, 0, 0, 0, 0, 'h', ':', '1'}));
  EXPECT_EQ(PeekFrameMagic(ring).value_or(0), kReplicaRingMagic);
  for (const std::string& address :
       {std::string(), std::string("127.0.0.1:40123"), std::string(kMaxAddressBytes, 'a')}) {
    absl::StatusOr<ReplicaRingMessage> got = DecodeReplicaRing(EncodeReplicaRing({.next_address = address}));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->next_address, address);
  }
  auto ring_body = [](uint16_t bytes, const std::string& text, uint8_t reserved = 0) {
    Le w;
    w.U16(bytes).U8(reserved).U8(0).U32(0);
    w.b.insert(w.b.end(), text.begin(), text.end());
    return w.b;
  };
  for (const auto& [body, want] : std::vector<std::pair<Bytes, std::string>>{
           {ring_body(4, "h:1"), "replica ring: truncated: address_bytes 4"},
           {ring_body(2, "h:1"), "replica ring: address_bytes 2 leaves 1 unused body bytes"},
           {ring_body(3, std::string("h\0", 2) + "1"), "next_address"},
           {ring_body(3, "h:1", 1), "replica ring: reserved"},
           {ring_body(kMaxAddressBytes + 1, std::string(kMaxAddressBytes + 1, 'a')), "must be <= 1024"},
       }) {
    absl::StatusOr<ReplicaRingMessage> bad = DecodeReplicaRing(MakeFrame(kReplicaRingMagic, body));
    ASSERT_FALSE(bad.ok()) << want;
    EXPECT_CONTAINS(std::string(bad.status().message()), want);
  }

  // Memory rejoin: golden body, round trips (a request and both answers), and every malformed body
  // refused with the field named.
  const Bytes rejoin = EncodeMemoryRejoin(
      {.memory_rank = 0x0201, .answer = true, .attn_out_buffer = 0x0a0b0c0d, .text = "no"});
  EXPECT_EQ(Bytes(rejoin.begin() + 16, rejoin.end()),
            (Bytes{0x01, 0x02, 0x01, 0, 0x0d, 0x0c, 0x0b, 0x0a, 0x02, 0x00, 0, 0, 0, 0, 0, 0, 'n', 'o'}));
  EXPECT_EQ(PeekFrameMagic(rejoin).value_or(0), kMemoryRejoinMagic);
  for (const MemoryRejoinMessage& m :
       {MemoryRejoinMessage{.memory_rank = 3, .attn_out_buffer = 1u << 20, .text = "127.0.0.1:40123"},
        MemoryRejoinMessage{.memory_rank = 3, .answer = true, .attn_out_buffer = 7},
        MemoryRejoinMessage{.memory_rank = 0xffff,
        .answer = true,
        .attn_out_buffer = kU32Max,
        .text = std::string(kMaxAddressBytes, 'e')}}) {
    absl::StatusOr<MemoryRejoinMessage> got = DecodeMemoryRejoin(EncodeMemoryRejoin(m));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == m);
  }
  auto rejoin_body = [](uint8_t answer, uint16_t bytes, const std::string& text, uint8_t reserved = 0) {
    Le w;
    w.U16(1).U8(answer).U8(reserved).U32(130).U16(bytes).U16(0).U32(0);
    w.b.insert(w.b.end(), text.begin(), text.end());
    return w.b;
  };
  for (const auto& [body, want] : std::vector<std::pair<Bytes, std::string>>{
           {rejoin_body(0, 4, "h:1"), "memory rejoin: truncated: text_bytes 4"},
           {rejoin_body(0, 2, "h:1"), "memory rejoin: text_bytes 2 leaves 1 unused body bytes"},
           {rejoin_body(0, 3, std::string("h\0", 2) + "1"), "memory rejoin: text"},
           {rejoin_body(0, 3, "h:1", 1), "memory rejoin: reserved"},
           {rejoin_body(2, 3, "h:1"), "memory rejoin: answer 2"},
           {rejoin_body(0, 0, ""), "memory rejoin: a request needs the rank's address (text_bytes 0)"},
           {rejoin_body(1, kMaxAddressBytes + 1, std::string(kMaxAddressBytes + 1, 'a')), "must be <= 1024"},
       }) {
    absl::StatusOr<MemoryRejoinMessage> bad = DecodeMemoryRejoin(MakeFrame(kMemoryRejoinMagic, body));
    ASSERT_FALSE(bad.ok()) << want;
    EXPECT_CONTAINS(std::string(bad.status().message()), want);
  }

  // Head split: golden body, round trips (requests and answers), and every malformed body refused
  // with the field named.
  const Bytes split = EncodeHeadSplit(
      {.split = 0x0102, .ranks = {{.memory_rank = 0x0201, .attn_out_buffer = 0x0a0b0c0d, .qkv_buffer = 5}}});
  EXPECT_EQ(Bytes(split.begin() + 16, split.end()),
            (Bytes{0x02, 0x01, 0, 0, 0,    0,    0,    0,    0, 0, 0x01, 0, 0, 0, 0, 0,  //
                   0x01, 0x02, 0, 0, 0x0d, 0x0c, 0x0b, 0x0a, 5, 0, 0,    0}));
  EXPECT_EQ(PeekFrameMagic(split).value_or(0), kHeadSplitMagic);
  for (const HeadSplitMessage& m :
       {HeadSplitMessage{.split = 1,
       .ranks = {{.memory_rank = 0, .attn_out_buffer = 1, .qkv_buffer = 2},
                 {.memory_rank = 3, .attn_out_buffer = kU32Max, .qkv_buffer = 0},
                 {.memory_rank = 0xffff, .attn_out_buffer = 4, .qkv_buffer = 5}}},
        HeadSplitMessage{.split = ~uint64_t{0}, .answer = true},
        HeadSplitMessage{.split = 7, .answer = true, .text = std::string(kMaxAddressBytes, 'e')}}) {
    absl::StatusOr<HeadSplitMessage> got = DecodeHeadSplit(EncodeHeadSplit(m));
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == m);
  }
  auto split_body = [](uint64_t id, uint8_t answer, std::vector<uint16_t> ranks, uint16_t bytes,
                       const std::string& text, uint8_t reserved = 0) {
    Le w;
    w.U64(id).U8(answer).U8(0).U16(static_cast<uint16_t>(ranks.size())).U16(bytes).U16(0);
    for (uint16_t r : ranks) w.U16(r).U16(reserved).U32(130).U32(9);
    w.b.insert(w.b.end(), text.begin(), text.end());
    return w.b;
  };
  for (const auto& [body, want] : std::vector<std::pair<Bytes, std::string>>{
           {split_body(0, 0, {1}, 0, ""), "head split: split 0"},
           {split_body(1, 2, {1}, 0, ""), "head split: answer 2"},
           {split_body(1, 0, {}, 0, ""), "head split: a request with rank_count 0"},
           {split_body(1, 0, {1}, 2, "no"), "head split: a request with rank_count 1 and text_bytes 2"},
           {split_body(1, 1, {1}, 0, ""), "head split: an answer with rank_count 1"},
           {split_body(1, 0, {2, 2}, 0, ""), "head split: rank 1: memory_rank 2 must be above"},
           {split_body(1, 0, {1}, 0, "", 1), "head split: reserved"},
           {split_body(1, 0, {1}, 0, "x"), "need a body of 28 bytes, not 29"},
           {split_body(1, 1, {}, 3, "no"), "need a body of 19 bytes, not 18"},
           {split_body(1, 1, {}, 2, std::string("a\0", 2)), "head split: text"},
           {split_body(1, 1, {}, kMaxAddressBytes + 1, std::string(kMaxAddressBytes + 1, 'a')),
            "must be <= 1024"},
       }) {
    absl::StatusOr<HeadSplitMessage> bad = DecodeHeadSplit(MakeFrame(kHeadSplitMagic, body));
    ASSERT_FALSE(bad.ok()) << want;
    EXPECT_CONTAINS(std::string(bad.status().message()), want);
  }

  // Replica step: a part of a real-looking plan with its tokens.
  std::mt19937_64 rng(31);
  for (int iter = 0; iter < 200; ++iter) {
    ReplicaStepMessage step;
    step.plan.step_id = rng();
    step.plan.micro_batches = static_cast<uint8_t>(1 + rng() % 8);
    step.plan.micro_batch = static_cast<uint8_t>(rng() % step.plan.micro_batches);
    const int requests = static_cast<int>(rng() % 5);
    int32_t rows = 0;
    for (int i = 0; i < requests; ++i) {
      StepRequest q;
      q.request_id = static_cast<uint64_t>(i);
      q.q_len = static_cast<int32_t>(1 + rng() % 4);
      q.position = static_cast<int32_t>(rng() % 100);
      q.kv_len = q.position + q.q_len;
      q.sample = rng() % 2 == 0;
      rows += q.q_len;
      step.plan.requests.push_back(q);
    }
    std::sort(step.plan.requests.begin(), step.plan.requests.end(),
              [](const StepRequest& a, const StepRequest& b) { return (a.q_len == 1) > (b.q_len == 1); });
    for (int32_t t = 0; t < rows; ++t) step.tokens.push_back(static_cast<int32_t>(rng() % 50000));
    const Bytes f = EncodeReplicaStep(step);
    absl::StatusOr<ReplicaStepMessage> got = DecodeReplicaStep(f);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(*got, step);
    // A token count that disagrees with the plan's rows, a truncated frame, a broken nested plan.
    ReplicaStepMessage off = step;
    off.tokens.push_back(7);
    absl::StatusOr<ReplicaStepMessage> bad = DecodeReplicaStep(EncodeReplicaStep(off));
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("replica step: token_count"), std::string::npos) << bad.status();
    Bytes body(f.begin() + kFrameHeaderBytes, f.end());
    body.resize(body.size() - 1);
    EXPECT_FALSE(DecodeReplicaStep(MakeFrame(kReplicaStepMagic, body)).ok());
    Bytes broken(f.begin() + kFrameHeaderBytes, f.end());
    broken[broken.size() - 1] ^= 1;  // inside the nested plan frame: its crc no longer matches
    if (!step.plan.requests.empty()) {
      EXPECT_FALSE(DecodeReplicaStep(MakeFrame(kReplicaStepMagic, broken)).ok());
    }
  }
  Le huge;
  huge.U32(0xffffffffu).U32(0);
  absl::StatusOr<ReplicaStepMessage> forged = DecodeReplicaStep(MakeFrame(kReplicaStepMagic, huge.b));
  ASSERT_EQ(forged.status().code(), absl::StatusCode::kDataLoss) << forged.status();

  // Replica result.
  const ReplicaResultMessage result{
      .step_id = 77, .micro_batch = 3, .tokens = {5, 6, -1}, .logprobs = {-0.5f, -1.25f, 0.0f}};
  absl::StatusOr<ReplicaResultMessage> rb = DecodeReplicaResult(EncodeReplicaResult(result));
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(*rb, result);
  Bytes rbody = EncodeReplicaResult(result);
  rbody.erase(rbody.begin(), rbody.begin() + kFrameHeaderBytes);
  rbody.pop_back();
  absl::StatusOr<ReplicaResultMessage> short_result =
      DecodeReplicaResult(MakeFrame(kReplicaResultMagic, rbody));
  ASSERT_FALSE(short_result.ok());
  EXPECT_NE(short_result.status().message().find("replica result: count 3 needs 24 bytes"), std::string::npos)
      << short_result.status();

  // Replica result with top log-probability alternatives: round trips (a token may have none),
  // golden bytes, and each malformed variant refused naming what is wrong.
  const ReplicaResultMessage with_top{.step_id = 9,
                                      .micro_batch = 1,
                                      .tokens = {4, 8},
                                      .logprobs = {-0.25f, -2.0f},
                                      .top = {{{4, -0.25f}, {1, -1.5f}}, {}}};
  const Bytes top_frame = EncodeReplicaResult(with_top);
  absl::StatusOr<ReplicaResultMessage> tb = DecodeReplicaResult(top_frame);
  ASSERT_TRUE(tb.ok()) << tb.status();
  EXPECT_EQ(*tb, with_top);
  const Bytes top_body(top_frame.begin() + kFrameHeaderBytes, top_frame.end());
  Le golden_top;
  golden_top.U64(9).U8(1).U8(1).U8(0).U8(0).U32(2);  // step, micro-batch, has_top, count
  golden_top.I32(4).I32(8).F32(-0.25f).F32(-2.0f);   // tokens, logprobs
  golden_top.U8(2).U8(0);                            // alternative counts
  golden_top.I32(4).F32(-0.25f).I32(1).F32(-1.5f);   // token 0's alternatives
  EXPECT_EQ(top_body, golden_top.b);
  for (int n = 1; n <= 3; ++n) {
    Bytes cut(top_body.begin(), top_body.end() - n);
    EXPECT_FALSE(DecodeReplicaResult(MakeFrame(kReplicaResultMagic, cut)).ok()) << "cut " << n;
  }
  auto refused = [&](Bytes body, const std::string& want) {
    absl::StatusOr<ReplicaResultMessage> got = DecodeReplicaResult(MakeFrame(kReplicaResultMagic, body));
    ASSERT_FALSE(got.ok()) << want;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_NE(got.status().message().find(want), std::string::npos) << got.status();
  };
  Bytes bad = top_body;
  bad[9] = 2;
  refused(bad, "replica result: has_top 2 at byte offset 25 must be 0 or 1");
  bad = top_body;
  bad[10] = 1;
  refused(bad, "replica result: reserved at byte offset 26 is 1");
  bad = top_body;
  bad[32] = 21;  // token 0's alternative count
  refused(bad, "replica result: token 0: alternative count 21 at byte offset 48 must be <= 20");
  bad = top_body;
  bad[33] = 1;  // token 1 claims one more alternative than the body holds
  refused(bad, "replica result: 3 alternatives need 24 bytes at byte offset 50 but 16 remain");
  bad = top_body;
  bad[34 + 8 + 3] = 0x80;  // token 0's second alternative: token id negative
  refused(bad, "replica result: token 0: alternative 1 token -2147483647 at byte offset 58 must be >= 0");
  bad = top_body;
  bad.resize(28);  // has_top, but not even the counts fit
  refused(bad, "replica result: count 2 needs at least 18 bytes at byte offset 32 but 12 remain");
  // Bytes after the alternatives.
  bad = top_body;
  bad.push_back(0);
  refused(bad, "replica result: 2 alternatives need 16 bytes at byte offset 50 but 17 remain");
}

}  // namespace
}  // namespace tandem

namespace tandem {
namespace {

// Version 9: an eviction's tokens (its token_count in the record's bytes 10..11, the tokens after
// the next-use records), written out by hand (crc by the bitwise reference); round trips, and
// every malformed count refused naming what is wrong.
TEST(EvictionTokensWire, GoldenBytesAndRefusals) {
  StepPlan plan;
  plan.step_id = 9;
  plan.evictions.push_back({.block_hash = 0x1112131415161718, .memory_rank = 1, .tokens = {5, -1}});
  plan.evictions.push_back({.block_hash = 0x21, .memory_rank = 1});
  plan.next_uses.push_back({.block_hash = 0x31, .next_use = 2, .memory_rank = 1});
  Le body;
  body.U64(9).U32(0).U32(0).U32(0).U32(2).U8(0).U8(1).U16(1).U32(0);  // fixed part
  body.U64(0x1112131415161718).U16(1).U16(2).U32(0);                  // eviction 0: 2 tokens
  body.U64(0x21).U16(1).U16(0).U32(0);                                // eviction 1: none
  body.U64(0x31).I32(2).U16(1).U16(0);                                // next use 0
  body.I32(5).I32(-1);                                                // eviction 0's tokens
  const Bytes golden = MakeFrame(kStepPlanMagic, body.b);
  EXPECT_EQ(EncodeStepPlan(plan), golden);
  absl::StatusOr<StepPlan> back = DecodeStepPlan(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == plan);
  // The largest block round-trips; one token more is refused by the validator.
  StepPlan big = plan;
  big.evictions[1].tokens.assign(kMaxPrefixBlockTokens, 7);
  back = DecodeStepPlan(EncodeStepPlan(big));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == big);
  big.evictions[1].tokens.push_back(7);
  EXPECT_EQ(ValidateStepPlan(big).message(), "step plan: eviction 1: 4097 tokens, at most 4096");
  // Forged counts: tokens missing (truncation), tokens left over, a count above the limit.
  auto with_count = [&](uint16_t count) {
    Bytes b = body.b;
    b[32 + 10] = static_cast<uint8_t>(count), b[32 + 11] = static_cast<uint8_t>(count >> 8);
    return MakeFrame(kStepPlanMagic, b);
  };
  absl::Status st = DecodeStepPlan(with_count(3)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_EQ(st.message(),
            "step plan: truncated: the evictions' 3 tokens need 12 bytes at byte offset 96 but 8 remain");
  st = DecodeStepPlan(with_count(1)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_CONTAINS(std::string(st.message()),
                  "next_use_count 1 (with 1 eviction tokens) leave 4 unused body bytes at byte offset 100");
  st = DecodeStepPlan(with_count(4097)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_EQ(st.message(), "step plan: eviction 0: token_count 4097 at byte offset 58 exceeds 4096");
}

// The persisted blocks report: golden bytes, round trips, splitting under the size bound, and
// every malformed record refused naming the block and field.
TEST(PersistedBlocksWire, GoldenBytesSplitAndRefusals) {
  const PersistedBlocksMessage m{.memory_rank = 2,
                                 .last = true,
                                 .blocks = {{.hash = 0x11, .parent_hash = 0, .depth = 1, .tokens = {7, 8}},
                                            {.hash = 0x12, .parent_hash = 0x11, .depth = 2, .tokens = {9}}}};
  Le body;
  body.U16(2).U8(1).U8(0).U32(2);
  body.U64(0x11).U64(0).I32(1).U32(2).I32(7).I32(8);
  body.U64(0x12).U64(0x11).I32(2).U32(1).I32(9);
  const Bytes golden = MakeFrame(kPersistedBlocksMagic, body.b);
  EXPECT_EQ(EncodePersistedBlocks(m), golden);
  absl::StatusOr<PersistedBlocksMessage> back = DecodePersistedBlocks(golden);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, m);
  EXPECT_EQ(*PeekFrameMagic(golden), kPersistedBlocksMagic);
  const std::vector<PersistedBlocksMessage> none = SplitPersistedBlocks(3, {});
  ASSERT_EQ(none.size(), 1u);
  EXPECT_TRUE(none[0].last && none[0].blocks.empty() && none[0].memory_rank == 3);
  back = DecodePersistedBlocks(EncodePersistedBlocks(none[0]));
  ASSERT_TRUE(back.ok()) << back.status();

  // 600 blocks of 4096 tokens (about 9.8 MB) take several reports, each within the bound, only the
  // last marked, the blocks in order.
  std::vector<PersistedBlock> many;
  for (int i = 0; i < 600; ++i) {
    many.push_back({.hash = static_cast<uint64_t>(i + 1),
                    .parent_hash = static_cast<uint64_t>(i),
                    .depth = i + 1,
                    .tokens = std::vector<int32_t>(kMaxPrefixBlockTokens, i)});
  }
  const std::vector<PersistedBlock> want = many;
  const std::vector<PersistedBlocksMessage> parts = SplitPersistedBlocks(1, std::move(many));
  ASSERT_GE(parts.size(), 10u);
  std::vector<PersistedBlock> got;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Bytes frame = EncodePersistedBlocks(parts[i]);
    EXPECT_LE(frame.size() - kFrameHeaderBytes, kMaxPersistedBlocksBodyBytes);
    absl::StatusOr<PersistedBlocksMessage> p = DecodePersistedBlocks(frame);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->last, i + 1 == parts.size());
    EXPECT_EQ(p->memory_rank, 1);
    got.insert(got.end(), p->blocks.begin(), p->blocks.end());
  }
  EXPECT_TRUE(got == want);

  // Malformed bodies.
  auto refused = [](const Le& b) {
    return DecodePersistedBlocks(MakeFrame(kPersistedBlocksMagic, b.b)).status();
  };
  Le bad;
  bad.U16(2).U8(2).U8(0).U32(0);
  EXPECT_EQ(refused(bad).message(), "persisted blocks: last 2 at byte offset 18 must be 0 or 1");
  bad = Le();
  bad.U16(2).U8(1).U8(0).U32(0x10000000);
  EXPECT_EQ(refused(bad).code(), absl::StatusCode::kDataLoss);
  const std::vector<std::pair<std::function<void(Le&)>, std::string>> records = {
      {[](Le& b) { b.U64(0).U64(0).I32(1).U32(1).I32(3); }, "block 0 at byte offset 24: hash 0"},
      {[](Le& b) { b.U64(4).U64(3).I32(1).U32(1).I32(3); }, "parent_hash 3, depth 1"},
      {[](Le& b) { b.U64(4).U64(0).I32(2).U32(1).I32(3); }, "parent_hash 0, depth 2"},
      {[](Le& b) { b.U64(4).U64(0).I32(1).U32(0); }, "token_count 0"},
      {[](Le& b) { b.U64(4).U64(0).I32(1).U32(4097); }, "token_count 4097"},
  };
  for (const auto& [write, want_text] : records) {
    Le b;
    b.U16(2).U8(1).U8(0).U32(1);
    write(b);
    const absl::Status st = refused(b);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << want_text << ": " << st;
    EXPECT_CONTAINS(std::string(st.message()), want_text);
  }
  Le trunc;
  trunc.U16(2).U8(1).U8(0).U32(1).U64(4).U64(0).I32(1).U32(3).I32(1);
  EXPECT_EQ(refused(trunc).message(),
            "persisted blocks: truncated: block 0's 3 tokens need 12 bytes at byte offset 48 but 4 remain");
  Le extra;
  extra.U16(2).U8(1).U8(0).U32(0).U32(0);
  EXPECT_EQ(refused(extra).message(),
            "persisted blocks: block_count 0 leaves 4 unused body bytes at byte offset 24");
  Le huge;
  huge.U16(2).U8(1).U8(0).U32(0);
  huge.b.resize(kMaxPersistedBlocksBodyBytes + 1);
  EXPECT_EQ(refused(huge).message(), "persisted blocks: body_bytes 1048577 exceeds 1048576");
}

}  // namespace
}  // namespace tandem
