// Tests of memory_node/kv_table.h: step plans (network input) placed in KV slots, all or nothing.
#include "memory_node/kv_table.h"

#include <gtest/gtest.h>

#include <set>

namespace tandem {
namespace {

StepRequest Req(uint64_t id, int32_t position, int32_t q_len, uint16_t rank = 0) {
  StepRequest r;
  r.request_id = id;
  r.memory_rank = rank;
  r.position = position;
  r.q_len = q_len;
  r.kv_len = position + q_len;
  return r;
}

StepPlan Plan(std::vector<StepRequest> requests, uint64_t step = 1) {
  StepPlan p;
  p.step_id = step;
  p.requests = std::move(requests);
  return p;
}

TEST(KvTable, PlacesRowsAndListsContexts) {
  KvTable t(16);
  AttentionBatch b;
  // Request 7 decodes on another rank; request 1 (single row) comes before request 2 (a chunk).
  ASSERT_TRUE(t.Apply(Plan({Req(7, 0, 1, 1), Req(1, 0, 1), Req(2, 0, 3)}), 0, &b).ok());
  EXPECT_EQ(b.num_tokens(), 4);
  EXPECT_EQ(b.num_requests(), 2);
  EXPECT_EQ(b.num_single, 1);
  EXPECT_EQ(b.q_indptr, (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(b.kv_indptr, (std::vector<int32_t>{0, 1, 4}));
  EXPECT_EQ(b.max_q_len, 3);
  EXPECT_EQ(t.num_free(), 12);
  // Next step: request 2 decodes; its context is its 3 old slots plus the new one, in order.
  const std::vector<int32_t> old(b.kv_slots.begin() + 1, b.kv_slots.end());
  ASSERT_TRUE(t.Apply(Plan({Req(2, 3, 1)}, 2), 0, &b).ok());
  ASSERT_EQ(b.kv_slots.size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(b.kv_slots.begin(), b.kv_slots.begin() + 3), old);
  EXPECT_EQ(b.kv_slots.back(), b.new_slots[0]);
  std::set<int32_t> distinct(b.kv_slots.begin(), b.kv_slots.end());
  EXPECT_EQ(distinct.size(), 4u);
  EXPECT_EQ(t.context_length(2), 4);
  t.Release(std::vector<uint64_t>{2, 1, 99});  // 99 never reached this rank: ignored
  EXPECT_EQ(t.num_free(), 16);
  EXPECT_EQ(t.num_requests(), 0);
}

TEST(KvTable, BadPlansChangeNothing) {
  KvTable t(8);
  AttentionBatch b;
  ASSERT_TRUE(t.Apply(Plan({Req(1, 0, 2)}), 0, &b).ok());
  struct Case {
    StepPlan plan;
    absl::StatusCode code;
    const char* needle;
  };
  StepRequest bad_kv = Req(1, 2, 1);
  bad_kv.kv_len = 9;
  const Case cases[] = {
      {Plan({Req(1, 0, 1)}), absl::StatusCode::kInvalidArgument, "position 0 but this rank holds 2"},
      {Plan({Req(5, 3, 1)}), absl::StatusCode::kInvalidArgument, "position 3 but this rank holds 0"},
      {Plan({bad_kv}), absl::StatusCode::kInvalidArgument, "kv_len 9"},
      {Plan({Req(5, 0, 2), Req(1, 2, 1)}), absl::StatusCode::kInvalidArgument, "single-row request after"},
      {Plan({Req(1, 2, 1), Req(1, 2, 1)}), absl::StatusCode::kInvalidArgument, "listed twice"},
      {Plan({Req(1, 2, 1), Req(5, 0, 6)}), absl::StatusCode::kResourceExhausted,
       "7 new KV slots needed but 6"},
  };
  for (const Case& c : cases) {
    const absl::Status s = t.Apply(c.plan, 0, &b);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.needle), std::string::npos) << s;
    EXPECT_EQ(t.num_free(), 6);
    EXPECT_EQ(t.num_requests(), 1);
    EXPECT_EQ(t.context_length(1), 2);
  }
}

}  // namespace
}  // namespace tandem
