// The order in which one KV tier (host memory or disk; memory_node/kv_tier_store.h) gives up its
// blocks: by next use in the controller's waiting queue (AttentionStore's scheduler-aware
// eviction; docs/architecture.md, "KV tiers").
//
// Every block has a last-use tick (Insert and Touch set it, increasing) and a next use: -1 when no
// request of the controller's look-ahead window will reuse it, else the queue position of the first
// waiting request that will (0: the head of the queue). Victim() names the block to evict next:
//
//   1. among the blocks without a next use, the least recently used;
//   2. only when every block has one: the one whose next use is farthest (largest position), the
//      least recently used among equals.
//
// So a tier never evicts a wanted block while an unwanted one is there, and among wanted blocks the
// one needed last goes first. With every next use -1 (the `lru` policy, or nothing wanted) the order
// is least recently used. Keeps() says whether a block about to enter a full tier should take the
// victim's place at all: a block that would itself be the next victim (unwanted while every block
// held is wanted, or wanted later than all of them) is not kept.
//
// Cost: Insert, Touch, Erase, SetNextUse and Victim are O(log n) for a tier of n blocks; a caller
// that replaces the next uses each step pays for the blocks whose next use changed, never for a
// scan of the tier.
//
// Thread safety: none; the store calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace tandem {

class TierEvictionOrder {
 public:
  // Adds a block, most recently used, with its next use (-1: none). It must not be held.
  void Insert(uint64_t hash, int32_t next_use);
  // The block was used now (it must be held).
  void Touch(uint64_t hash);
  // Removes a block; no-op when it is not held.
  void Erase(uint64_t hash);
  // Sets a held block's next use (-1: none); no-op when it is not held.
  void SetNextUse(uint64_t hash, int32_t next_use);
  bool Contains(uint64_t hash) const { return entries_.contains(hash); }
  // The block to evict next; the order must not be empty.
  uint64_t Victim() const;
  // Whether a new block with this next use, most recently used, goes after Victim() in the order
  // (true: evicting the victim for it is right; false: the new block would be evicted first). True
  // when the order is empty.
  bool Keeps(int32_t next_use) const;
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }

 private:
  struct Entry {
    uint64_t tick = 0;
    int32_t next_use = -1;
  };
  void Place(uint64_t hash, const Entry& e);
  void Unplace(uint64_t hash, const Entry& e);

  uint64_t tick_ = 0;
  std::unordered_map<uint64_t, Entry> entries_;
  std::set<std::pair<uint64_t, uint64_t>> unwanted_;  // (tick, hash): begin() is the victim
  // (-next_use, tick, hash): begin() is the farthest next use, least recently used among equals.
  std::set<std::tuple<int32_t, uint64_t, uint64_t>> wanted_;
};

}  // namespace tandem
