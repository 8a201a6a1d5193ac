#include "memory_node/kv_slot_allocator.h"

#include <algorithm>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(KvSlotAllocator, FreshPoolHandsOutAscendingSlots) {
  KvSlotAllocator a(8);
  std::vector<int32_t> s;
  ASSERT_TRUE(a.Allocate(3, &s).ok());
  EXPECT_EQ(s, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(a.num_free(), 5);
}

TEST(KvSlotAllocator, AllOrNothingWhenFull) {
  KvSlotAllocator a(4);
  std::vector<int32_t> s;
  ASSERT_TRUE(a.Allocate(3, &s).ok());
  std::vector<int32_t> t = {99};
  absl::Status st = a.Allocate(2, &t);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("2 slots requested, 1 of 4 free"), std::string::npos) << st;
  EXPECT_EQ(t, std::vector<int32_t>{99});
  EXPECT_EQ(a.num_free(), 1);
}

TEST(KvSlotAllocator, LifoReuseOfFreedSlots) {
  KvSlotAllocator a(8);
  std::vector<int32_t> s;
  ASSERT_TRUE(a.Allocate(4, &s).ok());
  a.Release(std::vector<int32_t>{1});
  a.Release(std::vector<int32_t>{3});
  std::vector<int32_t> t;
  ASSERT_TRUE(a.Allocate(2, &t).ok());
  EXPECT_EQ(t, (std::vector<int32_t>{3, 1}));  // last freed, first reused
}

TEST(KvSlotAllocator, RefcountsKeepSharedSlotsAlive) {
  KvSlotAllocator a(4);
  std::vector<int32_t> prefix;
  ASSERT_TRUE(a.Allocate(2, &prefix).ok());
  a.Retain(prefix);  // a second request shares the prefix
  EXPECT_EQ(a.refcount(prefix[0]), 2);
  a.Release(prefix);
  EXPECT_EQ(a.num_free(), 2);  // still held by the second request
  a.Release(prefix);
  EXPECT_EQ(a.num_free(), 4);
}

TEST(KvSlotAllocator, RandomisedNeverHandsOutALiveSlot) {
  KvSlotAllocator a(64);
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> live;
  std::set<int32_t> held;
  for (int it = 0; it < 2000; ++it) {
    if (live.empty() || rng() % 2 == 0) {
      std::vector<int32_t> s;
      const int64_t n = rng() % 9;
      const bool fits = n <= a.num_free();
      ASSERT_EQ(a.Allocate(n, &s).ok(), fits);
      for (int32_t x : s) ASSERT_TRUE(held.insert(x).second) << "slot " << x << " handed out twice";
      if (!s.empty()) live.push_back(s);
    } else {
      const size_t i = rng() % live.size();
      a.Release(live[i]);
      for (int32_t x : live[i]) held.erase(x);
      live.erase(live.begin() + static_cast<long>(i));
    }
    ASSERT_EQ(a.num_free() + static_cast<int64_t>(held.size()), 64);
  }
}

TEST(KvSlotAllocatorDeathTest, DoubleReleaseAborts) {
  KvSlotAllocator a(2);
  std::vector<int32_t> s;
  ASSERT_TRUE(a.Allocate(1, &s).ok());
  a.Release(s);
  EXPECT_DEATH(a.Release(s), "release of free or invalid slot");
}

}  // namespace
}  // namespace tandem
