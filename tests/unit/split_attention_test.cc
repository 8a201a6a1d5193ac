// q-first attention (AttentionExecutor::LayerContext / LayerNew, pipeline.q_first): the CPU
// executor's two-part layer against its whole layer on the same batches and pools. The split
// must give the same outputs up to float rounding and leave the same KV in the pool; a step
// where the split does not hold must run whole and match bit for bit.
#include <cmath>
#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "memory_node/attention_executor.h"

namespace tandem {
namespace {

constexpr int64_t kSlots = 512;

AttentionShape Shape() {
  return AttentionShape{.num_layers = 2,
                        .num_heads = 6,
                        .num_kv_heads = 2,
                        .head_dim = 16,
                        .max_tokens = 64,
                        .max_requests = 8};
}

// Two executors whose pools hold the same random K and V in every slot.
struct Pair {
  std::unique_ptr<AttentionExecutor> whole, split;
};
Pair MakePair(uint32_t seed) {
  const AttentionShape s = Shape();
  Pair p;
  p.whole = *CreateCpuAttentionExecutor(s, {.capacity_tokens = kSlots});
  p.split = *CreateCpuAttentionExecutor(s, {.capacity_tokens = kSlots});
  std::mt19937 gen(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<int32_t> slots(kSlots);
  for (int32_t i = 0; i < kSlots; ++i) slots[static_cast<size_t>(i)] = i;
  std::vector<float> kv(static_cast<size_t>(kSlots * 2 * s.num_layers * s.kv_dim()));
  for (float& x : kv) x = n(gen);
  const auto* bytes = reinterpret_cast<const uint8_t*>(kv.data());
  EXPECT_TRUE(p.whole->WriteSlots(slots, bytes).ok());
  EXPECT_TRUE(p.split->WriteSlots(slots, bytes).ok());
  return p;
}

// A request of `q_len` new rows after `context` keys; slots are handed out from `next`.
void AddRequest(AttentionBatch* b, int32_t context, int32_t q_len, int32_t* next) {
  for (int32_t i = 0; i < context; ++i) b->kv_slots.push_back((*next)++);
  for (int32_t i = 0; i < q_len; ++i) {
    b->new_slots.push_back(*next);
    b->kv_slots.push_back((*next)++);
  }
  b->q_indptr.push_back(b->q_indptr.back() + q_len);
  b->kv_indptr.push_back(static_cast<int32_t>(b->kv_slots.size()));
  if (q_len == 1) ++b->num_single;
  b->max_q_len = std::max<int64_t>(b->max_q_len, q_len);
  b->max_kv_len = std::max<int64_t>(b->max_kv_len, context + q_len);
}

// Runs both layers of `b` on both executors with the same random rows; returns the largest
// absolute difference of the outputs, and checks the pools hold the same KV afterwards.
float Compare(const AttentionBatch& b, uint32_t seed) {
  const AttentionShape s = Shape();
  Pair p = MakePair(seed);
  EXPECT_TRUE(p.whole->BeginStep(b).ok());
  EXPECT_TRUE(p.split->BeginStep(b).ok());
  const int64_t t = b.num_tokens(), qd = s.q_dim(), kvd = s.kv_dim();
  std::mt19937 gen(seed + 1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  float worst = 0.0f;
  for (int64_t layer = 0; layer < s.num_layers; ++layer) {
    std::vector<float> qkv(static_cast<size_t>(t * s.qkv_width()));
    for (float& x : qkv) x = n(gen);
    std::vector<float> q(static_cast<size_t>(t * qd)), kv(static_cast<size_t>(t * 2 * kvd));
    for (int64_t r = 0; r < t; ++r) {
      std::memcpy(q.data() + r * qd, qkv.data() + r * s.qkv_width(), static_cast<size_t>(qd) * 4);
      std::memcpy(kv.data() + r * 2 * kvd, qkv.data() + r * s.qkv_width() + qd,
                  static_cast<size_t>(2 * kvd) * 4);
    }
    // Guard values: every output element must be written.
    std::vector<float> want(static_cast<size_t>(t * qd), NAN), got(want.size(), NAN);
    EXPECT_TRUE(p.whole->Layer(layer, qkv.data(), want.data()).ok());
    EXPECT_TRUE(p.split->LayerContext(layer, q.data()).ok());
    EXPECT_TRUE(p.split->LayerNew(layer, kv.data(), got.data()).ok());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_FALSE(std::isnan(got[i])) << "output " << i << " of layer " << layer;
      worst = std::max(worst, std::fabs(got[i] - want[i]));
    }
  }
  std::vector<int32_t> slots(kSlots);
  for (int32_t i = 0; i < kSlots; ++i) slots[static_cast<size_t>(i)] = i;
  const size_t bytes = static_cast<size_t>(kSlots * 2 * s.num_layers * kvd) * 4;
  std::vector<uint8_t> a(bytes), c(bytes);
  EXPECT_TRUE(p.whole->ReadSlots(slots, a.data()).ok());
  EXPECT_TRUE(p.split->ReadSlots(slots, c.data()).ok());
  EXPECT_TRUE(a == c) << "the pools differ after the step";
  return worst;
}

AttentionBatch Empty() {
  AttentionBatch b;
  b.Clear();
  return b;
}

// Outputs are convex combinations of unit-normal values: an absolute error of 1e-5 is a few ulps
// of the merge's rescaling, far below any real mistake (a missing or extra key moves outputs by
// about 1/context).
constexpr float kTolerance = 1e-5f;

TEST(SplitAttention, DecodeAndChunksMatchWholeLayer) {
  AttentionBatch b = Empty();
  int32_t next = 0;
  AddRequest(&b, 97, 1, &next);  // decode rows first
  AddRequest(&b, 1, 1, &next);
  AddRequest(&b, 0, 1, &next);    // a one-token prompt: no context
  AddRequest(&b, 33, 17, &next);  // a later prefill chunk
  AddRequest(&b, 0, 9, &next);    // a first chunk
  const float worst = Compare(b, 7);
  EXPECT_LT(worst, kTolerance);
  // The merge rounds differently from one softmax over every key: an exact match (with these
  // fixed seeds) would mean the step fell back to the whole layer.
  EXPECT_GT(worst, 0.0f);
}

TEST(SplitAttention, SharedPrefixGroupsMatchWholeLayer) {
  // Two requests share a 40-key prefix (a group); their own keys are their suffixes.
  AttentionBatch b = Empty();
  int32_t next = 40;  // slots 0..39: the shared prefix
  AddRequest(&b, 5, 1, &next);
  AddRequest(&b, 0, 3, &next);
  b.group_kv_indptr = {0, 40};
  for (int32_t i = 0; i < 40; ++i) b.group_kv_slots.push_back(i);
  b.group_row_indptr = {0, 4};
  b.group_rows = {0, 1, 2, 3};
  b.group_parent = {-1};
  b.group_level = {0};
  b.max_group_rows = 4, b.max_group_kv = 40;
  b.max_kv_len = 46;
  const float worst = Compare(b, 11);
  EXPECT_LT(worst, kTolerance);
  EXPECT_GT(worst, 0.0f);  // split, not run whole (see above)
}

TEST(SplitAttention, StepThatDoesNotSplitRunsWhole) {
  // Request 1 reads request 0's new slot as context: the split does not hold, so LayerNew runs
  // the whole layer, bit for bit.
  AttentionBatch b = Empty();
  int32_t next = 0;
  AddRequest(&b, 10, 1, &next);  // new slot 10
  b.kv_slots.insert(b.kv_slots.begin() + b.kv_indptr.back(), 10);
  AddRequest(&b, 4, 1, &next);
  // AddRequest counted from kv_slots' size, so request 1 has 6 keys: 10, then 4 context, then new.
  b.max_kv_len = 6 + 5;
  EXPECT_EQ(Compare(b, 13), 0.0f);
}

}  // namespace
}  // namespace tandem
