// Tests of compute_node/prefix_index.h: chained block hashes, exact matches despite collisions, users
// (requests holding chains), LRU leaf-first eviction, and a randomized run against a shadow model of
// every registered block.
#include "compute_node/prefix_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <vector>

#include "compute_node/shifted_match.h"

namespace tandem {
namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kAll = std::numeric_limits<int64_t>::max();

std::vector<int32_t> Tokens(int64_t n, int32_t first) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<int32_t> Ids(std::initializer_list<int32_t> ids) { return std::vector<int32_t>(ids); }

// Registers the full blocks of `tokens` after those already matched, in order, stopping at the first
// refusal; returns the whole chain (matched + inserted). Users are left as they were.
std::vector<int32_t> Publish(PrefixIndex& idx, const std::vector<int32_t>& tokens) {
  std::vector<int32_t> chain = idx.Match(tokens, kAll);
  const int64_t full = static_cast<int64_t>(tokens.size()) / idx.block_tokens();
  for (int64_t i = static_cast<int64_t>(chain.size()); i < full; ++i) {
    const int32_t id = idx.Insert(tokens, i, chain.empty() ? -1 : chain.back());
    if (id < 0) break;
    chain.push_back(id);
  }
  return chain;
}

TEST(PrefixIndex, SecondPromptMatchesSharedFullBlocks) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> a = Tokens(40, 100);  // 2.5 blocks
  const int32_t a0 = idx.Insert(a, 0, -1);
  const int32_t a1 = idx.Insert(a, 1, a0);
  ASSERT_GE(a0, 0);
  ASSERT_GE(a1, 0);
  EXPECT_NE(a0, a1);
  EXPECT_EQ(idx.stats().blocks, 2);
  EXPECT_EQ(idx.stats().tokens_held, 32);
  EXPECT_EQ(idx.unused_tokens(), 32);

  std::vector<int32_t> b = a;  // shares all 40 tokens, then differs
  for (int i = 0; i < 20; ++i) b.push_back(7);
  EXPECT_EQ(idx.Match(b, kAll), Ids({a0, a1}));
  EXPECT_EQ(idx.Match(b, 2), Ids({a0, a1}));
  EXPECT_EQ(idx.Match(b, 1), Ids({a0}));  // max_blocks caps the match
  EXPECT_TRUE(idx.Match(b, 0).empty());
  // Match changes nothing: no users, nothing touched.
  EXPECT_EQ(idx.users(a0), 0);
  EXPECT_EQ(idx.users(a1), 0);
  EXPECT_EQ(idx.unused_tokens(), 32);

  // A prompt shorter than a full block never matches; 31 tokens match one block only.
  EXPECT_TRUE(idx.Match(std::span(a).first(15), kAll).empty());
  EXPECT_EQ(idx.Match(std::span(a).first(16), kAll), Ids({a0}));
  EXPECT_EQ(idx.Match(std::span(a).first(31), kAll), Ids({a0}));
  EXPECT_EQ(idx.Match(std::span(a).first(32), kAll), Ids({a0, a1}));

  // Registering b adds only its new block (tokens 32..47) under a's two.
  const int32_t b2 = idx.Insert(b, 2, a1);
  ASSERT_GE(b2, 0);
  EXPECT_EQ(idx.parent(b2), a1);
  EXPECT_EQ(idx.stats().blocks, 3);
  EXPECT_EQ(idx.stats().tokens_held, 48);
  EXPECT_EQ(idx.Match(b, kAll), Ids({a0, a1, b2}));
  EXPECT_EQ(idx.Match(a, kAll), Ids({a0, a1}));  // a has no third full block

  idx.CountLookup(60, 32);
  idx.CountLookup(40, 0);
  EXPECT_EQ(idx.stats().matched_tokens, 32);
  EXPECT_EQ(idx.stats().looked_up_tokens, 100);
}

TEST(PrefixIndex, InsertBuildsChains) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> a = Tokens(48, 100);
  const std::vector<int32_t> chain = Publish(idx, a);
  ASSERT_EQ(chain.size(), 3u);
  EXPECT_EQ(idx.parent(chain[0]), -1);
  EXPECT_EQ(idx.parent(chain[1]), chain[0]);
  EXPECT_EQ(idx.parent(chain[2]), chain[1]);
  const std::span<const int32_t> s(a);
  EXPECT_EQ(idx.hash(chain[0]), DefaultBlockHash(PrefixIndex::kSeed, s.subspan(0, 16)));
  EXPECT_EQ(idx.hash(chain[1]), DefaultBlockHash(idx.hash(chain[0]), s.subspan(16, 16)));
  EXPECT_EQ(idx.hash(chain[2]), DefaultBlockHash(idx.hash(chain[1]), s.subspan(32, 16)));
  for (int32_t id : chain) EXPECT_EQ(idx.users(id), 0);
  EXPECT_EQ(idx.unused_tokens(), 48);

  // Already registered: refused, nothing changes.
  EXPECT_EQ(idx.Insert(a, 0, -1), -1);
  EXPECT_EQ(idx.Insert(a, 1, chain[0]), -1);
  EXPECT_EQ(idx.Insert(a, 2, chain[1]), -1);
  EXPECT_EQ(idx.stats().blocks, 3);
  EXPECT_EQ(idx.stats().tokens_held, 48);

  // A branch: b differs from a in block 2 only.
  std::vector<int32_t> b = a;
  b[40] = 1;
  const int32_t b2 = idx.Insert(b, 2, chain[1]);
  ASSERT_GE(b2, 0);
  EXPECT_EQ(idx.parent(b2), chain[1]);
  EXPECT_EQ(idx.users(b2), 0);
  EXPECT_EQ(idx.Match(a, kAll), chain);
  EXPECT_EQ(idx.Match(b, kAll), Ids({chain[0], chain[1], b2}));
  EXPECT_EQ(idx.stats().blocks, 4);
  EXPECT_EQ(idx.stats().tokens_held, 64);
  EXPECT_EQ(idx.unused_tokens(), 64);

  // Block 3 of a 48-token prompt does not exist.
  EXPECT_DEATH(idx.Insert(a, 3, chain[2]), "Insert: block 3 of 48 tokens");
}

TEST(PrefixIndex, ChainedHashDifferentFirstTokenNoMatch) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> a = Tokens(48, 100);
  const std::vector<int32_t> chain = Publish(idx, a);
  ASSERT_EQ(chain.size(), 3u);
  std::vector<int32_t> b = a;
  b[0] = 1;  // blocks 1 and 2 have equal tokens, but a different prefix
  EXPECT_TRUE(idx.Match(b, kAll).empty());
  b = a;
  b[20] = 1;  // differs in block 1: block 0 only
  EXPECT_EQ(idx.Match(b, kAll), Ids({chain[0]}));
}

uint64_t CollidingHash(uint64_t, std::span<const int32_t>) { return 42; }

TEST(PrefixIndex, HashCollisionIsNeverAMatch) {
  // Every block of every prompt gets the same hash: only the token and parent comparisons decide.
  PrefixIndex idx(kBlock, &CollidingHash);
  const std::vector<int32_t> a = Tokens(32, 100);
  const int32_t a0 = idx.Insert(a, 0, -1);
  ASSERT_GE(a0, 0);
  EXPECT_EQ(idx.hash(a0), 42u);
  // a's block 1 has a taken hash: refused, so that 42 names one block only on the wire.
  EXPECT_EQ(idx.Insert(a, 1, a0), -1);
  EXPECT_EQ(idx.stats().blocks, 1);
  EXPECT_EQ(idx.Match(a, kAll), Ids({a0}));

  // Different tokens under the same hash: no match.
  EXPECT_TRUE(idx.Match(Tokens(32, 500), kAll).empty());
  // Block 1 of c has a0's tokens and hash, but its parent is a0, not -1: one block only.
  std::vector<int32_t> c(a.begin(), a.begin() + 16);
  c.insert(c.end(), a.begin(), a.begin() + 16);
  EXPECT_EQ(idx.Match(c, kAll), Ids({a0}));

  // Another prompt's block 0 collides with a0: refused as well.
  const std::vector<int32_t> b = Tokens(32, 500);
  EXPECT_EQ(idx.Insert(b, 0, -1), -1);
  EXPECT_EQ(idx.stats().blocks, 1);
  EXPECT_EQ(idx.Match(a, kAll), Ids({a0}));
  EXPECT_TRUE(idx.Match(b, kAll).empty());

  // Once a0 is evicted, the hash is free for b.
  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(kAll, &evicted), kBlock);
  EXPECT_EQ(evicted, std::vector<uint64_t>{42});
  const int32_t b0 = idx.Insert(b, 0, -1);
  ASSERT_GE(b0, 0);
  EXPECT_EQ(idx.Match(b, kAll), Ids({b0}));
  EXPECT_TRUE(idx.Match(a, kAll).empty());

  // With the default hash, two different prompts get different keys.
  EXPECT_NE(DefaultBlockHash(PrefixIndex::kSeed, std::span(a).first(16)),
            DefaultBlockHash(PrefixIndex::kSeed, std::span(b).first(16)));
}

TEST(PrefixIndex, DefaultHashIsFixed) {
  // Deterministic across runs and processes: a fixed value, and chaining changes it.
  const std::vector<int32_t> t = Tokens(16, 0);
  const uint64_t h0 = DefaultBlockHash(PrefixIndex::kSeed, t);
  EXPECT_EQ(h0, DefaultBlockHash(PrefixIndex::kSeed, t));
  EXPECT_EQ(h0, 7949571757910576586ULL);  // pinned: changing the hash changes every key
  EXPECT_NE(DefaultBlockHash(h0, t), h0);
  EXPECT_NE(DefaultBlockHash(PrefixIndex::kSeed + 1, t), h0);
  // The block length is part of the key.
  EXPECT_NE(DefaultBlockHash(PrefixIndex::kSeed, std::span(t).first(15)), h0);
}

TEST(PrefixIndex, BlocksWithUsersAreNeverEvicted) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> p = Tokens(32, 100);
  const std::vector<int32_t> chain = Publish(idx, p);
  ASSERT_EQ(chain.size(), 2u);
  const int32_t p0 = chain[0], p1 = chain[1];
  EXPECT_EQ(idx.unused_tokens(), 32);

  idx.Acquire(chain);  // request 1 holds both blocks
  EXPECT_EQ(idx.users(p0), 1);
  EXPECT_EQ(idx.users(p1), 1);
  EXPECT_EQ(idx.unused_tokens(), 0);
  idx.Acquire(Ids({p0}));  // request 2 holds block 0 only
  EXPECT_EQ(idx.users(p0), 2);
  EXPECT_EQ(idx.unused_tokens(), 0);

  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(kAll, &evicted), 0);
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(idx.stats().blocks, 2);

  idx.Release(chain);  // request 1 ends: block 1 has no users left
  EXPECT_EQ(idx.users(p0), 1);
  EXPECT_EQ(idx.users(p1), 0);
  EXPECT_EQ(idx.unused_tokens(), 16);
  const uint64_t h1 = idx.hash(p1);
  EXPECT_EQ(idx.Evict(kAll, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{h1});
  EXPECT_EQ(idx.Match(p, kAll), Ids({p0}));
  EXPECT_EQ(idx.unused_tokens(), 0);
  EXPECT_EQ(idx.stats().tokens_held, 16);

  idx.Release(Ids({p0}));  // request 2 ends
  EXPECT_EQ(idx.unused_tokens(), 16);
  evicted.clear();
  EXPECT_EQ(idx.Evict(kAll, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{DefaultBlockHash(PrefixIndex::kSeed, std::span(p).first(16))});
  EXPECT_EQ(idx.stats().blocks, 0);
  EXPECT_EQ(idx.stats().tokens_held, 0);
  EXPECT_EQ(idx.unused_tokens(), 0);
  EXPECT_EQ(idx.stats().evictions, 2);
}

TEST(PrefixIndex, ReleaseWithoutUsersDies) {
  PrefixIndex idx(kBlock);
  const int32_t id = idx.Insert(Tokens(16, 0), 0, -1);
  ASSERT_GE(id, 0);
  idx.Acquire(Ids({id}));
  idx.Release(Ids({id}));
  EXPECT_DEATH(idx.Release(Ids({id})), "without users");
}

TEST(PrefixIndex, InUseBlocksAreSkippedNotEvicted) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> p1 = Tokens(16, 100), p2 = Tokens(16, 200);
  const int32_t i1 = idx.Insert(p1, 0, -1);
  const int32_t i2 = idx.Insert(p2, 0, -1);
  idx.Acquire(Ids({i1}));  // held by its request
  idx.Acquire(Ids({i2}));  // touched after i1, then released: i1 stays the least recently used
  idx.Release(Ids({i2}));
  // i1 is the LRU block but in use, so i2 goes; then nothing else can be freed.
  std::vector<uint64_t> evicted;
  const uint64_t h2 = idx.hash(i2);
  EXPECT_EQ(idx.Evict(64, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{h2});
  EXPECT_EQ(idx.stats().blocks, 1);
  EXPECT_EQ(idx.Match(p1, kAll), Ids({i1}));
  EXPECT_TRUE(idx.Match(p2, kAll).empty());
  EXPECT_EQ(idx.users(i1), 1);
}

TEST(PrefixIndex, EvictsLeastRecentlyUsedFirst) {
  PrefixIndex idx(kBlock);
  std::vector<std::vector<int32_t>> p;
  std::vector<int32_t> id;
  std::vector<uint64_t> h;
  for (int i = 0; i < 4; ++i) {
    p.push_back(Tokens(16, 100 * (i + 1)));
    id.push_back(idx.Insert(p.back(), 0, -1));
    ASSERT_GE(id.back(), 0);
    h.push_back(idx.hash(id.back()));
  }
  idx.Acquire(Ids({id[0]}));  // p0 is now the most recent: order p1, p2, p3, p0
  idx.Release(Ids({id[0]}));
  EXPECT_EQ(idx.Match(p[1], kAll), Ids({id[1]}));  // Match does not touch

  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(1, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{h[1]});
  EXPECT_EQ(idx.stats().evictions, 1);
  EXPECT_EQ(idx.stats().blocks, 3);
  evicted.clear();
  EXPECT_EQ(idx.Evict(0, &evicted), 0);  // nothing needed
  EXPECT_TRUE(evicted.empty());
  EXPECT_EQ(idx.Evict(17, &evicted), 32);  // stops once 17 tokens are freed: two blocks
  EXPECT_EQ(evicted, (std::vector<uint64_t>{h[2], h[3]}));
  EXPECT_EQ(idx.stats().blocks, 1);
  EXPECT_EQ(idx.Match(p[0], kAll), Ids({id[0]}));
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(idx.Match(p[i], kAll).empty()) << i;

  evicted.clear();
  EXPECT_EQ(idx.Evict(kAll, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{h[0]});
  EXPECT_EQ(idx.stats().evictions, 4);
  EXPECT_EQ(idx.stats().blocks, 0);
  EXPECT_EQ(idx.stats().tokens_held, 0);
  EXPECT_EQ(idx.Evict(kAll, &evicted), 0);
}

TEST(PrefixIndex, WantedBlocksAreEvictedLast) {
  // Chains a (2 blocks, oldest), b (2 blocks) and c (1 block, newest). A waiting request wants a:
  // b and c go first, least recently used first; a only when nothing else is left, leaf first.
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> a = Publish(idx, Tokens(32, 100)), b = Publish(idx, Tokens(32, 500)),
                             c = Publish(idx, Tokens(16, 900));
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  ASSERT_EQ(c.size(), 1u);
  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(32, &evicted, nullptr, a), 32);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{idx.hash(b[1]), idx.hash(b[0])}));
  EXPECT_EQ(idx.Match(Tokens(32, 100), kAll), a);
  EXPECT_EQ(idx.Evict(32, &evicted, nullptr, a), 32);  // c, then a's leaf: a is all that is left
  ASSERT_EQ(evicted.size(), 4u);
  EXPECT_EQ(evicted[2], idx.hash(c[0]));
  EXPECT_EQ(idx.Match(Tokens(32, 100), kAll), Ids({a[0]}));
  // Without wanted blocks the order is plain LRU again: the same three chains evict a first.
  PrefixIndex lru(kBlock);
  const std::vector<int32_t> a2 = Publish(lru, Tokens(32, 100));
  Publish(lru, Tokens(32, 500));
  evicted.clear();
  EXPECT_EQ(lru.Evict(32, &evicted), 32);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{lru.hash(a2[1]), lru.hash(a2[0])}));
  // Ids that are not registered blocks are ignored.
  evicted.clear();
  EXPECT_EQ(lru.Evict(16, &evicted, nullptr, Ids({-1, 12345})), 16);
  EXPECT_EQ(evicted.size(), 1u);
}

TEST(PrefixIndex, LeavesAreEvictedBeforeParents) {
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> chain_tokens = Tokens(48, 100);
  const std::vector<int32_t> chain = Publish(idx, chain_tokens);
  ASSERT_EQ(chain.size(), 3u);
  const int32_t other = idx.Insert(Tokens(16, 900), 0, -1);
  ASSERT_GE(other, 0);
  const uint64_t h0 = idx.hash(chain[0]), h1 = idx.hash(chain[1]), h2 = idx.hash(chain[2]),
                 ho = idx.hash(other);
  // Block 0 alone is touched: it is now the most recent (order 1, 2, other, 0), yet its descendants
  // must go first.
  idx.Acquire(Ids({chain[0]}));
  idx.Release(Ids({chain[0]}));

  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(1, &evicted), 16);
  EXPECT_EQ(evicted, std::vector<uint64_t>{h2});  // block 1 is older, but has a child
  EXPECT_EQ(idx.Match(chain_tokens, kAll), Ids({chain[0], chain[1]}));
  // Then block 1 (now a leaf, least recently used), then `other`, older than block 0.
  EXPECT_EQ(idx.Evict(32, &evicted), 32);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{h2, h1, ho}));
  EXPECT_EQ(idx.Match(chain_tokens, kAll), Ids({chain[0]}));
  EXPECT_EQ(idx.Evict(kAll, &evicted), 16);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{h2, h1, ho, h0}));
  EXPECT_EQ(idx.stats().blocks, 0);
  EXPECT_EQ(idx.stats().evictions, 4);
}

TEST(PrefixIndex, ParentFreedByEvictionComesBeforeNewerBlocks) {
  // Chain a0 <- a1, then an unrelated newer block: after a1, its parent a0 (older than `other`) is the
  // least recently used block without users or children, so it goes before `other`.
  PrefixIndex idx(kBlock);
  const std::vector<int32_t> a = Tokens(32, 100);
  const std::vector<int32_t> chain = Publish(idx, a);
  ASSERT_EQ(chain.size(), 2u);
  const int32_t other = idx.Insert(Tokens(16, 900), 0, -1);
  ASSERT_GE(other, 0);
  const uint64_t h0 = idx.hash(chain[0]), h1 = idx.hash(chain[1]);
  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(32, &evicted), 32);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{h1, h0}));
  EXPECT_EQ(idx.stats().blocks, 1);
  EXPECT_EQ(idx.Match(Tokens(16, 900), kAll), Ids({other}));

  // Evicting everything lists children before parents, whatever the touch order.
  const std::vector<int32_t> b = Tokens(64, 300);
  const std::vector<int32_t> bc = Publish(idx, b);
  ASSERT_EQ(bc.size(), 4u);
  idx.Acquire(Ids({bc[0], bc[1]}));  // the head of the chain is the most recent
  idx.Release(Ids({bc[0], bc[1]}));
  evicted.clear();
  const std::vector<uint64_t> hb = {idx.hash(bc[0]), idx.hash(bc[1]), idx.hash(bc[2]), idx.hash(bc[3])};
  const uint64_t ho = idx.hash(other);
  EXPECT_EQ(idx.Evict(kAll, &evicted), 80);
  EXPECT_EQ(evicted, (std::vector<uint64_t>{ho, hb[3], hb[2], hb[1], hb[0]}));
}

// Blocks a persisted disk tier offers at start: taken demoted when their tokens give their hash
// below a registered parent, matched like evicted blocks, and refused otherwise.
TEST(PrefixIndex, AddDemotedChecksTokensAndParent) {
  PrefixIndex idx(kBlock, &DefaultBlockHash, /*max_demoted=*/8);
  const std::vector<int32_t> prompt = Tokens(3 * kBlock, 5);
  const auto block = [&](int i) {
    return std::span(prompt).subspan(static_cast<size_t>(i * kBlock), kBlock);
  };
  const uint64_t h0 = idx.HashBlock(PrefixIndex::kSeed, block(0));
  const uint64_t h1 = idx.HashBlock(h0, block(1));
  const uint64_t h2 = idx.HashBlock(h1, block(2));
  EXPECT_EQ(idx.AddDemoted(h1, h0, block(1)), -1) << "parent not registered yet";
  EXPECT_EQ(idx.AddDemoted(h0, PrefixIndex::kSeed, block(1)), -1) << "tokens that do not give the hash";
  const int32_t b0 = idx.AddDemoted(h0, PrefixIndex::kSeed, block(0));
  ASSERT_GE(b0, 0);
  EXPECT_EQ(idx.AddDemoted(h0, PrefixIndex::kSeed, block(0)), -1) << "hash taken";
  const int32_t b1 = idx.AddDemoted(h1, h0, block(1));
  ASSERT_GE(b1, 0);
  EXPECT_FALSE(idx.resident(b0));
  EXPECT_EQ(idx.stats().demoted, 2);
  EXPECT_EQ(idx.stats().tokens_held, 0);
  EXPECT_EQ(idx.Match(prompt, kAll), Ids({b0, b1}));
  idx.MarkRestored(b0);
  idx.MarkRestored(b1);
  EXPECT_EQ(idx.stats().tokens_held, 2 * kBlock);
  const int32_t b2 = idx.Insert(prompt, 2, b1);  // computed after the restored chain
  ASSERT_GE(b2, 0);
  EXPECT_EQ(idx.Find(h2), b2);
  PrefixIndex no_tiers(kBlock);
  EXPECT_EQ(no_tiers.AddDemoted(h0, PrefixIndex::kSeed, block(0)), -1) << "without tiers nothing is demoted";
}

TEST(PrefixIndex, RandomizedAgainstShadow) {
  constexpr int64_t kBt = 4;
  std::mt19937 rng(12345);
  PrefixIndex idx(kBt);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  // The shadow: every registered block, by id, with the whole prefix up to its end.
  struct ShadowBlock {
    std::vector<int32_t> prefix;  // tokens 0 .. (index + 1) * kBt
    int32_t parent = -1;
    uint64_t hash = 0;
    uint64_t tick = 0;  // mirrors the index's recency: Insert and Acquire touch
  };
  std::map<int32_t, ShadowBlock> live;                 // id -> block
  std::map<std::vector<int32_t>, int32_t> by_prefix;   // prefix -> id
  std::map<uint64_t, int32_t> by_hash;                 // hash -> id
  std::map<int32_t, std::vector<int32_t>> ids_tokens;  // id -> the block's own tokens, as inserted
  uint64_t tick = 0;
  struct Request {
    std::vector<int32_t> prompt, chain;
  };
  std::vector<Request> active;
  std::vector<std::vector<int32_t>> seen;
  std::set<std::vector<int32_t>> seen_set;
  int64_t evictions = 0, looked_up = 0, matched = 0;

  auto expected_users = [&] {
    std::map<int32_t, int32_t> users;
    for (const auto& [id, b] : live) users[id] = 0;
    for (const Request& r : active)
      for (int32_t id : r.chain) ++users[id];
    return users;
  };
  auto expected_match = [&](const std::vector<int32_t>& prompt, int64_t max_blocks) {
    std::vector<int32_t> ids;
    for (size_t end = kBt; end <= prompt.size() && static_cast<int64_t>(ids.size()) < max_blocks;
         end += kBt) {
      auto it = by_prefix.find(std::vector<int32_t>(prompt.begin(), prompt.begin() + end));
      if (it == by_prefix.end()) break;
      ids.push_back(it->second);
    }
    return ids;
  };
  // A chain for `prompt`: linked by parents, every block live, its tokens those of the prompt.
  auto check_chain = [&](const std::vector<int32_t>& prompt, const std::vector<int32_t>& chain) {
    ASSERT_LE(static_cast<int64_t>(chain.size()) * kBt, static_cast<int64_t>(prompt.size()));
    for (size_t i = 0; i < chain.size(); ++i) {
      const int32_t id = chain[i];
      auto t = ids_tokens.find(id);
      ASSERT_NE(t, ids_tokens.end()) << "block " << id << " is not live";
      const auto start = prompt.begin() + static_cast<std::ptrdiff_t>(i) * kBt;
      ASSERT_TRUE(std::equal(t->second.begin(), t->second.end(), start, start + kBt)) << "block " << i;
      ASSERT_EQ(idx.parent(id), i == 0 ? -1 : chain[i - 1]);
    }
  };
  auto check_match = [&](const std::vector<int32_t>& prompt, int64_t max_blocks) {
    const std::vector<int32_t> m = idx.Match(prompt, max_blocks);
    check_chain(prompt, m);
    ASSERT_LE(static_cast<int64_t>(m.size()), std::max<int64_t>(max_blocks, 0));
    ASSERT_EQ(m, expected_match(prompt, max_blocks));
  };
  auto check_invariants = [&] {
    const std::map<int32_t, int32_t> users = expected_users();
    ASSERT_EQ(idx.stats().blocks, static_cast<int64_t>(live.size()));
    ASSERT_EQ(idx.stats().tokens_held, static_cast<int64_t>(live.size()) * kBt);
    ASSERT_EQ(idx.stats().evictions, evictions);
    ASSERT_EQ(idx.stats().looked_up_tokens, looked_up);
    ASSERT_EQ(idx.stats().matched_tokens, matched);
    int64_t unused = 0;
    for (const auto& [id, b] : live) {
      ASSERT_EQ(idx.hash(id), b.hash) << id;
      ASSERT_EQ(idx.parent(id), b.parent) << id;
      ASSERT_EQ(idx.users(id), users.at(id)) << id;
      unused += users.at(id) == 0;
    }
    ASSERT_EQ(idx.unused_tokens(), unused * kBt);
    for (const Request& r : active) {
      check_chain(r.prompt, r.chain);
      for (int32_t id : r.chain) ASSERT_GE(idx.users(id), 1);
    }
    for (const auto& prompt : seen_set) check_match(prompt, kAll);
  };
  auto forget = [&](int32_t id) {
    const ShadowBlock& b = live.at(id);
    by_prefix.erase(b.prefix);
    by_hash.erase(b.hash);
    ids_tokens.erase(id);
    live.erase(id);
  };

  // A few shared heads (system prompts) from a 3-token vocabulary, then random tails.
  std::vector<std::vector<int32_t>> heads;
  for (int h = 0; h < 4; ++h) {
    std::vector<int32_t> head;
    for (int i = rnd(0, 14); i > 0; --i) head.push_back(rnd(0, 2));
    heads.push_back(head);
  }

  int64_t inserted_total = 0, refused_total = 0, max_live = 0;
  for (int op = 0; op < 4000; ++op) {
    const int kind = rnd(0, 99);
    if (kind < 45) {  // a request arrives: match, attach, publish the rest of its full blocks
      std::vector<int32_t> prompt;
      if (!seen.empty() && rnd(0, 2) == 0) {
        prompt = seen[static_cast<size_t>(rnd(0, static_cast<int>(seen.size()) - 1))];
      } else {
        prompt = heads[static_cast<size_t>(rnd(0, 3))];
      }
      for (int i = rnd(0, 12); i > 0; --i) prompt.push_back(rnd(0, 2));
      if (prompt.empty()) prompt.push_back(rnd(0, 2));
      const int64_t max_blocks = rnd(0, 4) == 0 ? rnd(0, 3) : kAll;
      check_match(prompt, max_blocks);
      if (HasFatalFailure()) return;
      std::vector<int32_t> chain = idx.Match(prompt, max_blocks);
      idx.Acquire(chain);
      for (int32_t id : chain) live.at(id).tick = ++tick;
      idx.CountLookup(static_cast<int64_t>(prompt.size()), static_cast<int64_t>(chain.size()) * kBt);
      looked_up += static_cast<int64_t>(prompt.size());
      matched += static_cast<int64_t>(chain.size()) * kBt;
      if (rnd(0, 3) != 0) {  // most requests publish their blocks; some keep their KV private
        std::vector<int32_t> inserted;
        const int64_t full = static_cast<int64_t>(prompt.size()) / kBt;
        for (int64_t i = static_cast<int64_t>(chain.size()); i < full; ++i) {
          const int32_t parent = chain.empty() ? -1 : chain.back();
          std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + (i + 1) * kBt);
          const int32_t id = idx.Insert(prompt, i, parent);
          if (id < 0) {
            // Only when registered already (the match was capped by max_blocks).
            ASSERT_TRUE(by_prefix.count(prefix)) << "op " << op << ": Insert refused a new block";
            ASSERT_LT(max_blocks, full);
            ++refused_total;
            break;
          }
          ASSERT_FALSE(by_prefix.count(prefix)) << "op " << op << ": Insert registered a block twice";
          ASSERT_FALSE(live.count(id)) << "op " << op << ": Insert reused the live id " << id;
          const uint64_t parent_hash = parent < 0 ? PrefixIndex::kSeed : live.at(parent).hash;
          const uint64_t hash = DefaultBlockHash(
              parent_hash, std::span(prompt).subspan(static_cast<size_t>(i * kBt), static_cast<size_t>(kBt)));
          ASSERT_EQ(idx.hash(id), hash);
          ASSERT_FALSE(by_hash.count(hash));
          ASSERT_EQ(idx.parent(id), parent);
          ASSERT_EQ(idx.users(id), 0);
          live[id] = {prefix, parent, hash, ++tick};
          by_prefix[prefix] = id;
          by_hash[hash] = id;
          ids_tokens[id].assign(prefix.end() - kBt, prefix.end());
          inserted.push_back(id);
          chain.push_back(id);
          ++inserted_total;
        }
        idx.Acquire(inserted);
        for (int32_t id : inserted) live.at(id).tick = ++tick;
      }
      max_live = std::max<int64_t>(max_live, static_cast<int64_t>(live.size()));
      if (seen_set.insert(prompt).second) seen.push_back(prompt);
      active.push_back({prompt, chain});
    } else if (kind < 85) {  // a request ends
      if (!active.empty()) {
        const size_t i = static_cast<size_t>(rnd(0, static_cast<int>(active.size()) - 1));
        idx.Release(active[i].chain);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
      }
    } else {  // memory pressure (now and then: everything that can go)
      const int64_t need = kind < 98 ? rnd(0, 30) * (rnd(0, 1) == 0 ? 1 : kBt) : kAll;
      const int64_t unused_before = idx.unused_tokens();
      std::vector<uint64_t> evicted = {0x5eed};  // Evict appends
      const int64_t freed = idx.Evict(need, &evicted);
      ASSERT_EQ(evicted.front(), 0x5eedu);
      evicted.erase(evicted.begin());
      ASSERT_EQ(freed, static_cast<int64_t>(evicted.size()) * kBt);
      if (need <= 0) {
        ASSERT_EQ(freed, 0);
      }
      if (freed < need) {
        ASSERT_EQ(idx.unused_tokens(), 0) << "op " << op << ": stopped with blocks left to evict";
      } else {
        ASSERT_LT(freed - kBt, need) << "op " << op << ": evicted past need";
      }
      ASSERT_EQ(idx.unused_tokens(), unused_before - freed);
      // Each evicted block, in order, is the least recently used block without users or live
      // children at that moment.
      std::map<int32_t, int32_t> users = expected_users();
      for (uint64_t h : evicted) {
        auto it = by_hash.find(h);
        ASSERT_NE(it, by_hash.end()) << "op " << op << ": evicted an unknown hash " << h;
        const int32_t id = it->second;
        ASSERT_EQ(users.at(id), 0) << "op " << op << ": evicted block " << id << " with users";
        int32_t lru = -1;
        std::set<int32_t> parents;
        for (const auto& [bid, b] : live) parents.insert(b.parent);
        for (const auto& [bid, b] : live) {
          if (users.at(bid) != 0 || parents.count(bid)) continue;
          if (lru < 0 || b.tick < live.at(lru).tick) lru = bid;
        }
        ASSERT_EQ(id, lru) << "op " << op << ": evicted out of LRU leaf-first order";
        forget(id);
        ++evictions;
      }
    }
    check_invariants();
    if (HasFatalFailure()) return;
  }
  // The run exercised what it should.
  EXPECT_GT(matched, 0);
  EXPECT_GT(evictions, 100);
  EXPECT_GT(inserted_total, 200);
  EXPECT_GT(refused_total, 0);
  EXPECT_GT(max_live, 20);

  for (const Request& r : active) idx.Release(r.chain);
  active.clear();
  std::vector<uint64_t> evicted;
  EXPECT_EQ(idx.Evict(kAll, &evicted), static_cast<int64_t>(live.size()) * kBt);
  EXPECT_EQ(idx.stats().blocks, 0);
  EXPECT_EQ(idx.stats().tokens_held, 0);
  EXPECT_EQ(idx.unused_tokens(), 0);
  for (const auto& prompt : seen_set) EXPECT_TRUE(idx.Match(prompt, kAll).empty());
}

// Shifted matches (compute_node/shifted_match.h): a history registered as one chain of 4-token
// blocks (tokens 100, 101, ...), asked for with its tokens 104..109 dropped. The block after the
// chained match starts inside the old block 2 (found through the block anchored two positions
// on), and the next one continues where it stopped, across the old blocks' boundaries.
TEST(ShiftedMatch, TruncatedHistoryIsCoveredByRunsOfTheOldChain) {
  PrefixIndex index(4, &DefaultBlockHash, 64);
  index.EnableContentLookup();
  std::vector<int32_t> old(24);
  std::iota(old.begin(), old.end(), 100);
  std::vector<int32_t> ids;
  for (int64_t b = 0; b < 6; ++b) ids.push_back(index.Insert(old, b, b == 0 ? -1 : ids.back()));
  ASSERT_EQ(std::count(ids.begin(), ids.end(), -1), 0);
  std::vector<int32_t> prompt = {100, 101, 102, 103};
  for (int32_t t = 110; t < 124; ++t) prompt.push_back(t);
  const std::vector<int32_t> match = index.Match(prompt, 4);
  ASSERT_EQ(match.size(), 1u);
  const auto any = [](int32_t) { return true; };
  ShiftedCursor next;
  std::optional<std::vector<ShiftedRun>> runs = FindShiftedBlock(index, prompt, 4, match[0], {}, any, &next);
  ASSERT_TRUE(runs.has_value());
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[0].block, ids[2]);
  EXPECT_EQ((*runs)[0].row, 2);
  EXPECT_EQ((*runs)[0].rows, 2);
  EXPECT_EQ((*runs)[1].block, ids[3]);
  EXPECT_EQ((*runs)[1].row, 0);
  EXPECT_EQ((*runs)[1].rows, 2);
  runs = FindShiftedBlock(index, prompt, 8, -1, next, any, &next);
  ASSERT_TRUE(runs.has_value());
  ASSERT_EQ(runs->size(), 2u);
  EXPECT_EQ((*runs)[0].block, ids[3]);
  EXPECT_EQ((*runs)[0].row, 2);
  EXPECT_EQ((*runs)[1].block, ids[4]);
  EXPECT_EQ((*runs)[1].rows, 2);
  // Every run's tokens are the prompt's.
  int64_t at = 12;
  runs = FindShiftedBlock(index, prompt, at, -1, next, any, nullptr);
  ASSERT_TRUE(runs.has_value());
  for (const ShiftedRun& r : *runs) {
    for (int32_t i = 0; i < r.rows; ++i)
      EXPECT_EQ(index.tokens(r.block)[static_cast<size_t>(r.row + i)], prompt[static_cast<size_t>(at++)]);
  }
  EXPECT_EQ(at, 16);
  // A token no block holds, or sources the caller may not use: no cover.
  std::vector<int32_t> unknown = prompt;
  unknown[9] = 999;
  EXPECT_FALSE(FindShiftedBlock(index, unknown, 8, -1, {}, any, nullptr).has_value());
  EXPECT_FALSE(FindShiftedBlock(
                   index, prompt, 4, match[0], {}, [&](int32_t id) { return id != ids[3]; }, nullptr)
                   .has_value());
}

}  // namespace
}  // namespace tandem
