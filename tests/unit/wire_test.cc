// Tests of common/wire.h: CRC-32C, step plan and layer message header frames (round trips, golden
// bytes, truncation, byte flips, forged counts, field ranges, a randomized corpus).
#include "common/wire.h"

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
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
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
};

// A frame around `body` with explicit header fields; the crc is computed unless given.
Bytes MakeFrame(uint32_t magic, const Bytes& body, uint16_t version = 1, uint16_t header_bytes = 16,
                std::optional<uint32_t> crc = std::nullopt) {
  Le f;
  f.U32(magic).U16(version).U16(header_bytes).U32(static_cast<uint32_t>(body.size()));
  f.U32(crc ? *crc : Crc32c(body));
  f.b.insert(f.b.end(), body.begin(), body.end());
  return f.b;
}

// A step request as raw wire fields, so tests can write values the struct cannot hold.
struct RawRequest {
  uint64_t request_id = 7;
  uint64_t seed = 1;
  uint64_t counter = 2;
  int32_t prefix_group = -1;
  int32_t position = 10;
  int32_t q_len = 2;
  int32_t kv_len = 12;
  float temperature = 0.7f;
  int32_t top_k = 50;
  float top_p = 0.9f;
  uint16_t memory_rank = 1;
  uint8_t sample = 1;
  uint8_t reserved = 0;
};

Bytes PlanBody(uint64_t step_id, const std::vector<RawRequest>& reqs,
               std::optional<uint32_t> count = std::nullopt, uint32_t reserved = 0) {
  Le w;
  w.U64(step_id).U32(count ? *count : static_cast<uint32_t>(reqs.size())).U32(reserved);
  for (const RawRequest& q : reqs) {
    w.U64(q.request_id).U64(q.seed).U64(q.counter);
    w.I32(q.prefix_group).I32(q.position).I32(q.q_len).I32(q.kv_len);
    w.F32(q.temperature).I32(q.top_k).F32(q.top_p);
    w.U16(q.memory_rank).U8(q.sample).U8(q.reserved);
  }
  return w.b;
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
    q.prefix_group = static_cast<int32_t>(u(0, 4)) - 1;
    q.position = static_cast<int32_t>(u(0, 4096));
    q.q_len = static_cast<int32_t>(u(1, 512));
    q.kv_len = q.position + q.q_len + static_cast<int32_t>(u(0, 2));
    q.sample = u(0, 1) == 1;
    q.temperature = std::uniform_real_distribution<float>(0.0f, 2.0f)(rng);
    q.top_k = static_cast<int32_t>(u(0, 100));
    q.top_p = std::uniform_real_distribution<float>(0.01f, 1.0f)(rng);
    q.seed = rng();
    q.counter = rng();
    return q;
  }
  const float temps[] = {0.0f, -0.0f, std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()};
  const float top_ps[] = {1.0f, std::numeric_limits<float>::denorm_min(), std::nextafter(1.0f, 0.0f),
                          std::numeric_limits<float>::min()};
  q.request_id = u(0, 1) ? kU64Max : 0;
  q.memory_rank = u(0, 1) ? 0xffff : 0;
  q.prefix_group = u(0, 1) ? kI32Max : -1;
  switch (u(0, 2)) {
    case 0:
      q.position = 0, q.q_len = kI32Max, q.kv_len = kI32Max;
      break;
    case 1:
      q.position = kI32Max - 1, q.q_len = 1, q.kv_len = kI32Max;
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
  return q;
}

StepPlan RandomPlan(std::mt19937_64& rng, size_t n, bool extreme) {
  StepPlan plan;
  plan.step_id = extreme ? kU64Max : rng();
  for (size_t i = 0; i < n; ++i) plan.requests.push_back(RandomRequest(rng, extreme));
  return plan;
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

// A small valid plan of `n` RawRequests (defaults).
Bytes SmallPlanFrame(size_t n = 1) {
  return MakeFrame(kStepPlanMagic, PlanBody(3, std::vector<RawRequest>(n)));
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
      const Bytes frame = EncodeStepPlan(plan);
      ASSERT_EQ(frame.size(), kFrameHeaderBytes + kStepPlanFixedBytes + n * kStepRequestBytes);
      absl::StatusOr<StepPlan> back = DecodeStepPlan(frame);
      ASSERT_TRUE(back.ok()) << "n=" << n << " extreme=" << extreme << ": " << back.status();
      EXPECT_TRUE(*back == plan) << "n=" << n << " extreme=" << extreme;
      EXPECT_EQ(EncodeStepPlan(*back), frame);
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
  StepRequest q;
  q.request_id = 0x1122334455667788;
  q.memory_rank = 0x0203;
  q.prefix_group = -1;
  q.position = 5;
  q.q_len = 3;
  q.kv_len = 8;
  q.sample = true;
  q.temperature = 0.5f;
  q.top_k = 40;
  q.top_p = 0.9f;
  q.seed = 42;
  q.counter = 7;
  plan.requests.push_back(q);
  // crc computed independently (bitwise Python reference).
  const Bytes golden = {
      0x54, 0x44, 0x53, 0x50, 0x01, 0x00, 0x10, 0x00, 0x48, 0x00, 0x00, 0x00,
      0x47, 0x7f, 0x31, 0x31,  // frame
      0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, 0x01, 0x00, 0x00, 0x00,
      0x00, 0x00, 0x00, 0x00,                          // plan
      0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // id
      0x2a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // seed
      0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // counter
      0xff, 0xff, 0xff, 0xff, 0x05, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00,
      0x08, 0x00, 0x00, 0x00,                                                  // grp..kv
      0x00, 0x00, 0x00, 0x3f, 0x28, 0x00, 0x00, 0x00, 0x66, 0x66, 0x66, 0x3f,  // t, k, p
      0x03, 0x02, 0x01, 0x00,                                                  // rank..
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
      0x54, 0x44, 0x4c, 0x4d, 0x01, 0x00, 0x10, 0x00,
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
}

TEST(StepPlanWire, HandBuiltBodyMatchesEncoder) {
  const Bytes frame = SmallPlanFrame(3);
  absl::StatusOr<StepPlan> plan = DecodeStepPlan(frame);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(EncodeStepPlan(*plan), frame);
}

TEST(Wire, EveryStrictPrefixIsDataLoss) {
  std::mt19937_64 rng(1);
  const Bytes plan = EncodeStepPlan(RandomPlan(rng, 17, false));
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
  const Bytes plan = SmallPlanFrame(2);
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

TEST(StepPlanWire, ForgedRequestCountFailsFastWithoutAllocating) {
  for (uint32_t count : {uint32_t{1} << 31, kU32Max, uint32_t{2}}) {
    const Bytes frame = MakeFrame(kStepPlanMagic, PlanBody(1, {RawRequest{}}, count));
    g_max_alloc = 0;
    g_track_allocs = true;
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = DecodeStepPlan(frame).status();
    const auto elapsed = std::chrono::steady_clock::now() - start;
    g_track_allocs = false;
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_CONTAINS(std::string(s.message()), "request_count " + std::to_string(count));
    EXPECT_LT(g_max_alloc.load(), 4096u) << "count " << count;  // only the error message
    EXPECT_LT(elapsed, std::chrono::milliseconds(50));
  }
  // A count smaller than the records present leaves unused bytes.
  absl::Status s =
      DecodeStepPlan(MakeFrame(kStepPlanMagic, PlanBody(1, {RawRequest{}, RawRequest{}}, 1))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "request_count 1 leaves 56 unused body bytes at byte offset 88");
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
      {[](RawRequest& q) { q.sample = 2; }, "request 3: sample 2 at byte offset 254 must be 0 or 1"},
      {[](RawRequest& q) { q.reserved = 1; }, "request 3: reserved at byte offset 255 is 1, must be 0"},
  };
  for (const Case& c : cases) {
    std::vector<RawRequest> reqs(5);
    c.mutate(reqs[3]);
    absl::Status s = DecodeStepPlan(MakeFrame(kStepPlanMagic, PlanBody(9, reqs))).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want << ": " << s;
    EXPECT_CONTAINS(std::string(s.message()), c.want);
  }
  absl::Status s = DecodeStepPlan(MakeFrame(kStepPlanMagic, PlanBody(9, {}, std::nullopt, 0x100))).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "reserved at byte offset 29 is 1, must be 0");
  // The struct validator says the same.
  StepPlan plan;
  plan.requests.resize(2);
  plan.requests[1].q_len = 0;
  EXPECT_CONTAINS(std::string(ValidateStepPlan(plan).message()),
                  "step plan: request 1: q_len 0 must be >= 1");
}

TEST(LayerMessageWire, FieldRangeViolationsNameField) {
  struct Case {
    std::function<void(RawHeader&)> mutate;
    std::string want;
  };
  const std::vector<Case> cases = {
      {[](RawHeader& h) { h.kind = 0; }, "layer message header: kind 0 must be 1 (qkv) or 2 (attn_out)"},
      {[](RawHeader& h) { h.kind = 3; }, "kind 3"},
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
  const Bytes body = PlanBody(1, {RawRequest{}});
  auto code_and_message = [](const Bytes& f) { return DecodeStepPlan(f).status(); };

  absl::Status s = code_and_message(MakeFrame(kLayerMessageMagic, body));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "step plan: magic 0x4d4c4454 ('TDLM') at byte offset 0 is not 0x50534454 ('TDSP')");
  s = DecodeLayerMessageHeader(SmallPlanFrame()).status();
  EXPECT_CONTAINS(std::string(s.message()), "layer message header: magic 0x50534454 ('TDSP')");

  s = code_and_message(MakeFrame(kStepPlanMagic, body, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_CONTAINS(std::string(s.message()), "version 2 is newer than the supported version 1");
  s = code_and_message(MakeFrame(kStepPlanMagic, body, 0));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "version 0 at byte offset 4 is invalid");
  s = code_and_message(MakeFrame(kStepPlanMagic, body, 1, 20));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "header_bytes 20 at byte offset 6 must be 16");
  s = code_and_message(MakeFrame(kStepPlanMagic, body, 1, 16, Crc32c(body) ^ 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()), "body crc32c");

  Bytes trailing = MakeFrame(kStepPlanMagic, body);
  trailing.push_back(0);
  s = code_and_message(trailing);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_CONTAINS(std::string(s.message()), "1 trailing bytes after the frame at byte offset 88");

  // A body that claims a request it lacks (crc recomputed): truncated inside the body.
  Bytes short_body = body;
  short_body.resize(kStepPlanFixedBytes + 20);
  s = code_and_message(MakeFrame(kStepPlanMagic, short_body));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()),
                  "request_count 1 needs 56 bytes of requests at byte offset 32 but 20");
  s = code_and_message(MakeFrame(kStepPlanMagic, Bytes(10, 0)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_CONTAINS(std::string(s.message()), "request_count needs 4 bytes at byte offset 24 but 2 remain");
}

// Random and mutated frames: decoding never crashes, and an OK result re-encodes to the input.
TEST(Wire, RandomizedCorpus) {
  std::mt19937_64 rng(20240601);
  auto u = [&](uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng); };
  std::vector<Bytes> seeds;
  for (size_t n : {0, 1, 2, 5}) seeds.push_back(EncodeStepPlan(RandomPlan(rng, n, false)));
  seeds.push_back(EncodeStepPlan(RandomPlan(rng, 3, true)));
  for (int i = 0; i < 4; ++i) seeds.push_back(EncodeLayerMessageHeader(RandomHeader(rng)));

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
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The corpus must reach the field checks, not just the crc: some mutants stay valid.
  EXPECT_GT(plan_ok, 1000);
  EXPECT_GT(header_ok, 1000);
  EXPECT_LT(seconds, 5.0);
  std::printf("corpus: %d frames, %d plans ok, %d headers ok, %.2f s\n", kFrames, plan_ok, header_ok,
              seconds);
}

}  // namespace
}  // namespace tandem
