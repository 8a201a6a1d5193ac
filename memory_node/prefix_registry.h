// Shared-prefix reuse on one memory rank: a registry of prompt blocks whose KV the rank already
// holds, so that a request whose prompt starts with registered blocks reuses their slots instead of
// prefilling them again.
//
// Prompts are cut into blocks of `block_tokens` tokens; only full blocks are registered. Block i is
// keyed by a chained hash, hash(i) = H(hash(i-1), tokens of block i), hash(-1) = kSeed, so a block's
// key stands for the whole prefix up to its end. The hash only picks a bucket: every block also
// stores its tokens and its parent block, and a lookup compares both, so a hash collision can never
// return wrong KV (by induction from block 0, a matched block means the whole prefix is equal).
//
// The default H (DefaultBlockHash) is our own FNV-1a-style loop over 32-bit tokens with a
// splitmix64 finaliser per token: fixed constants, no per-process seed, so keys are equal across
// processes and runs (unlike std::hash or absl::Hash). It can be replaced (constructor argument),
// e.g. by a test that forces collisions.
//
// Slots belong to a KvSlotAllocator (not owned; it must outlive the registry). Each registered
// block holds one reference on each of its slots. Match retains the matched slots for the caller,
// who releases them as usual when the request ends.
//
// Eviction: a block may be evicted only when no request uses it (each of its slots has reference
// count exactly 1, the registry's own) and no registered block has it as parent (leaves first, so a
// chain is never broken in the middle). Among those, the least recently used (matched or inserted)
// goes first. A parent may be more recent than its child (a shorter prompt touched it); it is still
// kept until its children are gone.
//
// Thread safety: not thread-safe; the owning rank serialises calls.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "memory_node/kv_slot_allocator.h"

namespace tandem {

// hash of a block given its parent's hash (kSeed for block 0) and its tokens.
using BlockHashFn = uint64_t (*)(uint64_t parent_hash, std::span<const int32_t> tokens);

uint64_t DefaultBlockHash(uint64_t parent_hash, std::span<const int32_t> tokens);

class PrefixRegistry {
 public:
  static constexpr uint64_t kSeed = 0x7a6e64656d505258ULL;  // parent hash of block 0

  struct Stats {
    int64_t blocks = 0;            // registered blocks now
    int64_t tokens_held = 0;       // blocks * block_tokens
    int64_t matched_tokens = 0;    // cumulative: tokens returned by Match (hits)
    int64_t looked_up_tokens = 0;  // cumulative: tokens passed to Match
    int64_t evictions = 0;         // cumulative: blocks evicted by EvictUntilFree
    int64_t missed_tokens() const { return looked_up_tokens - matched_tokens; }
  };

  struct MatchResult {
    int64_t num_tokens = 0;      // a multiple of block_tokens
    std::vector<int32_t> slots;  // num_tokens slots, by position; retained for the caller
  };

  // `allocator` is not owned and must outlive the registry; block_tokens >= 1.
  PrefixRegistry(KvSlotAllocator* allocator, int64_t block_tokens, BlockHashFn hash = &DefaultBlockHash);
  ~PrefixRegistry();  // releases the registry's references (Clear)
  PrefixRegistry(const PrefixRegistry&) = delete;
  PrefixRegistry& operator=(const PrefixRegistry&) = delete;

  // The longest run of leading full blocks of `tokens` that is registered. Retains the returned
  // slots once each on behalf of the caller and marks the matched blocks most recently used.
  MatchResult Match(std::span<const int32_t> tokens);
  // Registers the full blocks of `tokens`, whose KV lies in `slots` (slots[p] holds position p;
  // slots.size() >= the registered tokens, i.e. n * block_tokens for n full blocks). Blocks already
  // registered are kept as they are (first writer wins) and the caller's slots for them are not
  // used. Each new block retains its slots. Marks all the prompt's blocks most recently used.
  // Returns the number of blocks newly registered.
  int64_t Insert(std::span<const int32_t> tokens, std::span<const int32_t> slots);
  // Evicts evictable blocks (see top), least recently used first, while allocator->num_free() <
  // need. Returns the number of slots returned to the free list; if it could not free enough,
  // allocator->num_free() is still < need on return. Never evicts a block in use.
  int64_t EvictUntilFree(int64_t need);
  // Drops every block, releasing the registry's references (slots still used by requests stay
  // allocated until they release them). Cumulative stats are kept.
  void Clear();

  int64_t block_tokens() const { return block_tokens_; }
  const Stats& stats() const { return stats_; }
  // Every slot the registry holds a reference on, block by block (for tests and debugging).
  std::vector<int32_t> HeldSlots() const;

 private:
  struct Block {
    uint64_t hash = 0;
    int32_t parent = -1;  // block id, -1 for block 0 of a prompt
    int32_t num_children = 0;
    bool live = false;
    std::vector<int32_t> tokens;  // block_tokens
    std::vector<int32_t> slots;   // block_tokens
    uint64_t last_used = 0;       // tick of the last Match/Insert that touched it
    std::list<int32_t>::iterator lru_it;
  };

  // Id of the registered block with this parent and tokens (hash = its chained hash), or -1.
  int32_t Find(uint64_t hash, int32_t parent, std::span<const int32_t> tokens) const;
  void Touch(int32_t id);
  bool Evictable(const Block& b) const;
  void Remove(int32_t id);

  KvSlotAllocator* allocator_;
  int64_t block_tokens_;
  BlockHashFn hash_;
  std::vector<Block> blocks_;                                   // by id; dead ones are reused
  std::vector<int32_t> free_ids_;                               // dead block ids
  std::unordered_map<uint64_t, std::vector<int32_t>> buckets_;  // chained hash -> block ids
  std::list<int32_t> lru_;                                      // front: least recently used
  uint64_t tick_ = 0;
  Stats stats_;
};

}  // namespace tandem
