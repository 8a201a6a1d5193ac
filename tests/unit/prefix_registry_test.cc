// Tests of memory_node/prefix_registry.h: chained block hashes, exact matches despite collisions,
// reference counts on the allocator's slots, LRU leaf-first eviction, and a randomized run against a
// shadow of what every slot holds.
#include "memory_node/prefix_registry.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>

namespace tandem {
namespace {

constexpr int64_t kBlock = 16;

std::vector<int32_t> Tokens(int64_t n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// A request's prompt KV: allocates its slots and registers its full blocks; returns its slots.
std::vector<int32_t> Prefill(KvSlotAllocator& alloc, PrefixRegistry& reg,
                             const std::vector<int32_t>& prompt) {
  std::vector<int32_t> slots;
  EXPECT_TRUE(alloc.Allocate(static_cast<int64_t>(prompt.size()), &slots).ok());
  reg.Insert(prompt, slots);
  return slots;
}

TEST(PrefixRegistry, SecondPromptMatchesSharedFullBlocks) {
  KvSlotAllocator alloc(128);
  PrefixRegistry reg(&alloc, kBlock);
  const std::vector<int32_t> a = Tokens(40, 100);  // 2.5 blocks
  const std::vector<int32_t> a_slots = Prefill(alloc, reg, a);
  EXPECT_EQ(reg.stats().blocks, 2);
  EXPECT_EQ(reg.stats().tokens_held, 32);
  for (int p = 0; p < 40; ++p) EXPECT_EQ(alloc.refcount(a_slots[p]), p < 32 ? 2 : 1) << p;

  std::vector<int32_t> b = a;  // shares all 40 tokens, then differs
  for (int i = 0; i < 20; ++i) b.push_back(7);
  PrefixRegistry::MatchResult m = reg.Match(b);
  EXPECT_EQ(m.num_tokens, 32);
  EXPECT_EQ(m.slots, std::vector<int32_t>(a_slots.begin(), a_slots.begin() + 32));
  for (int p = 0; p < 40; ++p) EXPECT_EQ(alloc.refcount(a_slots[p]), p < 32 ? 3 : 1) << p;
  EXPECT_EQ(reg.stats().matched_tokens, 32);
  EXPECT_EQ(reg.stats().looked_up_tokens, 60);
  EXPECT_EQ(reg.stats().missed_tokens(), 28);

  // A prompt shorter than a full block never matches; 31 tokens match one block only.
  EXPECT_EQ(reg.Match(std::span(a).first(15)).num_tokens, 0);
  PrefixRegistry::MatchResult m31 = reg.Match(std::span(a).first(31));
  EXPECT_EQ(m31.num_tokens, 16);

  // Inserting b registers only its new block (tokens 32..47); the first two are kept as they were.
  std::vector<int32_t> b_slots = m.slots;
  ASSERT_TRUE(alloc.Allocate(static_cast<int64_t>(b.size()) - 32, &b_slots).ok());
  EXPECT_EQ(reg.Insert(b, b_slots), 1);
  EXPECT_EQ(reg.stats().blocks, 3);
  PrefixRegistry::MatchResult mb = reg.Match(b);
  EXPECT_EQ(mb.num_tokens, 48);

  alloc.Release(a_slots);
  alloc.Release(m31.slots);
  alloc.Release(b_slots);  // includes m.slots
  alloc.Release(mb.slots);
  reg.Clear();
  EXPECT_EQ(alloc.num_free(), alloc.num_slots());
}

TEST(PrefixRegistry, NothingLeaksAfterReleaseAndClear) {
  KvSlotAllocator alloc(128);
  {
    PrefixRegistry reg(&alloc, kBlock);
    const std::vector<int32_t> a = Tokens(40, 100);
    std::vector<int32_t> a_slots = Prefill(alloc, reg, a);
    PrefixRegistry::MatchResult m = reg.Match(a);
    alloc.Release(a_slots);
    alloc.Release(m.slots);
    EXPECT_EQ(alloc.num_free(), 128 - 32);  // the registry's blocks
    reg.Clear();
    EXPECT_EQ(alloc.num_free(), 128);
    EXPECT_EQ(reg.stats().blocks, 0);
    EXPECT_EQ(reg.Match(a).num_tokens, 0);
    a_slots = Prefill(alloc, reg, a);
    alloc.Release(a_slots);
  }  // the destructor releases the registry's references
  EXPECT_EQ(alloc.num_free(), 128);
}

TEST(PrefixRegistry, ChainedHashDifferentFirstTokenNoMatch) {
  KvSlotAllocator alloc(128);
  PrefixRegistry reg(&alloc, kBlock);
  const std::vector<int32_t> a = Tokens(48, 100);
  const std::vector<int32_t> a_slots = Prefill(alloc, reg, a);
  std::vector<int32_t> b = a;
  b[0] = 1;  // blocks 1 and 2 have equal tokens, but a different prefix
  EXPECT_EQ(reg.Match(b).num_tokens, 0);
  b = a;
  b[20] = 1;  // differs in block 1: block 0 only
  PrefixRegistry::MatchResult m = reg.Match(b);
  EXPECT_EQ(m.num_tokens, 16);
  alloc.Release(m.slots);
  alloc.Release(a_slots);
}

uint64_t CollidingHash(uint64_t, std::span<const int32_t>) { return 42; }

TEST(PrefixRegistry, HashCollisionIsNeverAMatch) {
  // Every block of every prompt gets the same hash: only the token and parent comparisons decide.
  KvSlotAllocator alloc(256);
  PrefixRegistry reg(&alloc, kBlock, &CollidingHash);
  const std::vector<int32_t> a = Tokens(32, 100);
  const std::vector<int32_t> a_slots = Prefill(alloc, reg, a);
  EXPECT_EQ(reg.Match(Tokens(32, 500)).num_tokens, 0);
  // Same tokens as a's block 1, but as block 0 (different parent): no match.
  EXPECT_EQ(reg.Match(std::span(a).subspan(16)).num_tokens, 0);

  const std::vector<int32_t> b = Tokens(32, 500);
  const std::vector<int32_t> b_slots = Prefill(alloc, reg, b);
  EXPECT_EQ(reg.stats().blocks, 4);
  PrefixRegistry::MatchResult ma = reg.Match(a);
  PrefixRegistry::MatchResult mb = reg.Match(b);
  EXPECT_EQ(ma.slots, a_slots);
  EXPECT_EQ(mb.slots, b_slots);
  // Also with the default hash, two different prompts never share slots.
  EXPECT_NE(DefaultBlockHash(PrefixRegistry::kSeed, std::span(a).first(16)),
            DefaultBlockHash(PrefixRegistry::kSeed, std::span(b).first(16)));
  for (const auto& s : {a_slots, b_slots, ma.slots, mb.slots}) alloc.Release(s);
  reg.Clear();
  EXPECT_EQ(alloc.num_free(), alloc.num_slots());
}

TEST(PrefixRegistry, DefaultHashIsFixed) {
  // Deterministic across runs and processes: a fixed value, and chaining changes it.
  const std::vector<int32_t> t = Tokens(16, 0);
  const uint64_t h0 = DefaultBlockHash(PrefixRegistry::kSeed, t);
  EXPECT_EQ(h0, DefaultBlockHash(PrefixRegistry::kSeed, t));
  EXPECT_EQ(h0, 7949571757910576586ULL);  // pinned: changing the hash changes every key
  EXPECT_NE(DefaultBlockHash(h0, t), h0);
  EXPECT_NE(DefaultBlockHash(PrefixRegistry::kSeed + 1, t), h0);
}

TEST(PrefixRegistry, EvictsLeastRecentlyUsedFirst) {
  KvSlotAllocator alloc(3 * kBlock);
  PrefixRegistry reg(&alloc, kBlock);
  const std::vector<int32_t> p1 = Tokens(16, 100), p2 = Tokens(16, 200), p3 = Tokens(16, 300);
  for (const auto* p : {&p1, &p2, &p3}) alloc.Release(Prefill(alloc, reg, *p));
  EXPECT_EQ(alloc.num_free(), 0);
  alloc.Release(reg.Match(p1).slots);  // p1 is now the most recent: order p2, p3, p1

  EXPECT_EQ(reg.EvictUntilFree(1), 16);
  EXPECT_EQ(reg.stats().evictions, 1);
  EXPECT_EQ(reg.stats().blocks, 2);
  EXPECT_EQ(reg.EvictUntilFree(16), 0);  // already enough free
  EXPECT_EQ(reg.EvictUntilFree(17), 16);
  // p2 and p3 are gone, p1 is left.
  PrefixRegistry::MatchResult m1 = reg.Match(p1);
  EXPECT_EQ(m1.num_tokens, 16);
  EXPECT_EQ(reg.Match(p2).num_tokens, 0);
  EXPECT_EQ(reg.Match(p3).num_tokens, 0);

  // p1 is in use by a request: nothing more can be evicted.
  EXPECT_EQ(reg.EvictUntilFree(alloc.num_slots()), 0);
  EXPECT_LT(alloc.num_free(), alloc.num_slots());
  EXPECT_EQ(reg.stats().blocks, 1);
  alloc.Release(m1.slots);
  EXPECT_EQ(reg.EvictUntilFree(alloc.num_slots()), 16);
  EXPECT_EQ(alloc.num_free(), alloc.num_slots());
  EXPECT_EQ(reg.stats().evictions, 3);
}

TEST(PrefixRegistry, InUseBlocksAreSkippedNotEvicted) {
  KvSlotAllocator alloc(4 * kBlock);
  PrefixRegistry reg(&alloc, kBlock);
  const std::vector<int32_t> p1 = Tokens(16, 100), p2 = Tokens(16, 200);
  const std::vector<int32_t> s1 = Prefill(alloc, reg, p1);  // held by its request: in use
  alloc.Release(Prefill(alloc, reg, p2));
  EXPECT_EQ(alloc.num_free(), 32);
  // p1 is the LRU block but in use, so p2 goes; then nothing else can be freed.
  EXPECT_EQ(reg.EvictUntilFree(64), 16);
  EXPECT_EQ(alloc.num_free(), 48);
  EXPECT_EQ(reg.stats().blocks, 1);
  PrefixRegistry::MatchResult m = reg.Match(p1);
  EXPECT_EQ(m.slots, s1);
  alloc.Release(m.slots);
  alloc.Release(s1);
}

TEST(PrefixRegistry, LeavesAreEvictedBeforeParents) {
  KvSlotAllocator alloc(3 * kBlock);
  PrefixRegistry reg(&alloc, kBlock);
  const std::vector<int32_t> chain = Tokens(48, 100);
  const std::vector<int32_t> slots = Prefill(alloc, reg, chain);
  alloc.Release(slots);
  // Re-inserting block 0 alone makes it the most recent, yet the leaf (block 2) must go first.
  reg.Insert(std::span(chain).first(16), slots);
  EXPECT_EQ(reg.EvictUntilFree(1), 16);
  EXPECT_EQ(alloc.refcount(slots[40]), 0);
  EXPECT_EQ(alloc.refcount(slots[20]), 1);
  PrefixRegistry::MatchResult m = reg.Match(chain);
  EXPECT_EQ(m.num_tokens, 32);
  alloc.Release(m.slots);
  EXPECT_EQ(reg.EvictUntilFree(17), 16);  // then block 1
  EXPECT_EQ(alloc.refcount(slots[20]), 0);
  EXPECT_EQ(alloc.refcount(slots[0]), 1);
  EXPECT_EQ(reg.EvictUntilFree(48), 16);  // then block 0
  EXPECT_EQ(alloc.num_free(), 48);
  EXPECT_EQ(reg.stats().blocks, 0);
}

TEST(PrefixRegistry, RandomizedAgainstShadow) {
  constexpr int64_t kSlots = 400, kBt = 4;
  std::mt19937 rng(12345);
  KvSlotAllocator alloc(kSlots);
  PrefixRegistry reg(&alloc, kBt);
  std::vector<int32_t> shadow(kSlots, -1);  // slot -> token written there when allocated
  struct Request {
    std::vector<int32_t> prompt, slots;
  };
  std::vector<Request> active;
  std::vector<std::vector<int32_t>> seen;
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // A few shared heads (system prompts) from a 3-token vocabulary, then random tails.
  std::vector<std::vector<int32_t>> heads;
  for (int h = 0; h < 4; ++h) {
    std::vector<int32_t> head;
    for (int i = rnd(0, 14); i > 0; --i) head.push_back(rnd(0, 2));
    heads.push_back(head);
  }
  auto check_match = [&](const std::vector<int32_t>& prompt, const PrefixRegistry::MatchResult& m) {
    ASSERT_EQ(m.num_tokens % kBt, 0);
    ASSERT_LE(m.num_tokens, static_cast<int64_t>(prompt.size()));
    ASSERT_EQ(static_cast<int64_t>(m.slots.size()), m.num_tokens);
    for (int64_t p = 0; p < m.num_tokens; ++p) ASSERT_EQ(shadow[m.slots[p]], prompt[p]) << p;
  };
  auto check_invariants = [&] {
    int64_t held_by_requests = 0;
    for (const Request& r : active) {
      held_by_requests += static_cast<int64_t>(r.slots.size());
      for (size_t p = 0; p < r.slots.size(); ++p) ASSERT_EQ(shadow[r.slots[p]], r.prompt[p]);
    }
    const std::vector<int32_t> held = reg.HeldSlots();
    ASSERT_EQ(static_cast<int64_t>(held.size()), reg.stats().tokens_held);
    for (int32_t s : held) ASSERT_GE(alloc.refcount(s), 1);
    int64_t refs = 0, free_count = 0;
    for (int32_t s = 0; s < kSlots; ++s) {
      refs += alloc.refcount(s);
      free_count += alloc.refcount(s) == 0;
    }
    ASSERT_EQ(refs, held_by_requests + static_cast<int64_t>(held.size()));
    ASSERT_EQ(free_count, alloc.num_free());
  };

  for (int op = 0; op < 3000; ++op) {
    const int kind = rnd(0, 99);
    if (kind < 45) {  // a request arrives: match, allocate the rest, register
      std::vector<int32_t> prompt;
      if (!seen.empty() && rnd(0, 2) == 0) {
        prompt = seen[static_cast<size_t>(rnd(0, static_cast<int>(seen.size()) - 1))];
      } else {
        prompt = heads[static_cast<size_t>(rnd(0, 3))];
      }
      for (int i = rnd(0, 12); i > 0; --i) prompt.push_back(rnd(0, 2));
      if (prompt.empty()) prompt.push_back(rnd(0, 2));
      PrefixRegistry::MatchResult m = reg.Match(prompt);
      check_match(prompt, m);
      const int64_t rest = static_cast<int64_t>(prompt.size()) - m.num_tokens;
      std::vector<int32_t> slots = m.slots;
      if (alloc.num_free() < rest) reg.EvictUntilFree(rest);
      if (!alloc.Allocate(rest, &slots).ok()) {
        alloc.Release(m.slots);
      } else {
        for (size_t p = static_cast<size_t>(m.num_tokens); p < slots.size(); ++p)
          shadow[slots[p]] = prompt[p];
        if (rnd(0, 3) != 0) reg.Insert(prompt, slots);
        seen.push_back(prompt);
        active.push_back({prompt, slots});
      }
    } else if (kind < 85) {  // a request ends
      if (!active.empty()) {
        const size_t i = static_cast<size_t>(rnd(0, static_cast<int>(active.size()) - 1));
        alloc.Release(active[i].slots);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else if (kind < 97) {  // memory pressure
      const int64_t need = rnd(0, kSlots);
      const int64_t before = alloc.num_free();
      const int64_t freed = reg.EvictUntilFree(need);
      ASSERT_EQ(alloc.num_free(), before + freed);
      if (alloc.num_free() < need) {
        // Could not free enough: every block left is in use or has a child.
        const std::vector<int32_t> held = reg.HeldSlots();
        EXPECT_EQ(reg.EvictUntilFree(need), 0);
        EXPECT_EQ(reg.HeldSlots(), held);
      }
    } else if (kind < 98) {
      reg.Clear();
    } else {  // every prompt seen so far still matches exactly what was written for it
      for (const auto& prompt : seen) {
        PrefixRegistry::MatchResult m = reg.Match(prompt);
        check_match(prompt, m);
        alloc.Release(m.slots);
      }
    }
    check_invariants();
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(reg.stats().matched_tokens, 0);
  EXPECT_GT(reg.stats().evictions, 0);
  for (const Request& r : active) alloc.Release(r.slots);
  reg.Clear();
  EXPECT_EQ(alloc.num_free(), kSlots);
}

}  // namespace
}  // namespace tandem
