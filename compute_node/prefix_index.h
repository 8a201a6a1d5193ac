// The controller's prefix registry (docs/architecture.md, "KV cache on a memory rank"): for one memory rank,
// the prompt blocks whose KV that rank holds, so that a request whose prompt starts with
// registered blocks reuses them instead of prefilling them again, and so that requests sharing
// blocks can be grouped for shared-prefix attention.
//
// The controller decides and the memory rank follows: every registration (publish), reuse
// (attach) and eviction chosen here travels in the step plan, keyed by the block's hash, and the
// memory rank applies it to its own hash -> slots map (memory_node/kv_table.h). No slot ids live
// here; the index counts tokens.
//
// Prompts are cut into blocks of `block_tokens` tokens; only full blocks are registered. Block i is
// keyed by a chained hash, hash(i) = H(hash(i-1), tokens of block i), hash(-1) = kSeed, so a block's
// key stands for the whole prefix up to its end. The hash only picks a bucket: every block also
// stores its tokens and its parent block, and a lookup compares both, so a hash collision can never
// match a different prefix. Two different registered blocks never carry the same hash (Insert
// refuses the second), so the hash alone names a block on the wire.
//
// The default H (DefaultBlockHash) is our own FNV-1a-style loop over 32-bit tokens with a
// splitmix64 finaliser per token: fixed constants, no per-process seed, so keys are equal across
// processes and runs (unlike std::hash or absl::Hash). It can be replaced (constructor argument),
// e.g. by a test that forces collisions.
//
// Users: a live request whose context holds a block's KV (attached or published by it) is a user
// of that block and of every block before it in its chain. A block with users is never evicted.
// Eviction takes blocks without users, least recently used first, leaves first (a chain is never
// broken in the middle; a block without users has no descendant with users, since users hold
// whole chains). Blocks the caller names as wanted soon (those a waiting request will match) go
// only after every other evictable block: their next use is the nearest.
//
// KV tiers (max_demoted > 0; memory_node/kv_tier_store.h): eviction demotes a block instead of
// forgetting it: the memory rank saves its KV to a lower tier and the block stays in the index as
// not resident, still matched by Match. Demoted blocks hold no pool KV (tokens_held counts resident
// blocks only); resident blocks always have resident parents, so a chain is resident up to some
// depth and demoted below it. MarkRestored makes a demoted block resident again (the controller
// plans its restore); Forget drops a block and its descendants (a restore that failed, or the
// least recently used demoted leaves beyond max_demoted). Insert of a block that is demoted with
// equal tokens makes it resident again (recomputed KV). AddDemoted registers a block that a lower
// tier already holds (a persisted disk tier found at start), demoted, after checking that its
// tokens give its hash.
//
// Thread safety: not thread-safe; the controller serialises calls.
#pragma once

#include <algorithm>
#include <cstdint>
#include <list>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/wire.h"

namespace tandem {

// The prefix settings as the controller takes them (ControllerOptions::prefix_block_tokens and
// ::prefix_sharing).
struct PrefixOptions {
  int64_t block_tokens = 0;  // 0: no registry
  PrefixSharing sharing = PrefixSharing::kOff;
};
// From kv.prefix_cache, kv.prefix_block_tokens and kv.prefix_sharing ("auto", "on", "off"): the
// registry is off without the cache, and so is sharing (which needs it: "on" without the cache is
// an error naming both keys). InvalidArgument naming the key otherwise.
absl::StatusOr<PrefixOptions> ResolvePrefixOptions(bool prefix_cache, int64_t block_tokens,
                                                   std::string_view sharing);

// hash of a block given its parent's hash (kSeed for block 0) and its tokens.
using BlockHashFn = uint64_t (*)(uint64_t parent_hash, std::span<const int32_t> tokens);

uint64_t DefaultBlockHash(uint64_t parent_hash, std::span<const int32_t> tokens);

class PrefixIndex {
 public:
  static constexpr uint64_t kSeed = 0x7a6e64656d505258ULL;  // parent hash of block 0

  struct Stats {
    int64_t blocks = 0;            // registered blocks now
    int64_t tokens_held = 0;       // blocks * block_tokens
    int64_t matched_tokens = 0;    // cumulative: tokens of blocks attached by requests
    int64_t looked_up_tokens = 0;  // cumulative: prompt tokens of admitted requests
    int64_t evictions = 0;         // cumulative: blocks evicted (demoted or forgotten)
    int64_t demoted = 0;           // blocks now in a lower tier only
  };

  // block_tokens >= 1; max_demoted: demoted blocks kept (0: eviction forgets, no tiers).
  explicit PrefixIndex(int64_t block_tokens, BlockHashFn hash = &DefaultBlockHash, int64_t max_demoted = 0);
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // Ids of the longest run of registered leading full blocks of `tokens`, at most `max_blocks`,
  // in chain order. Changes nothing.
  std::vector<int32_t> Match(std::span<const int32_t> tokens, int64_t max_blocks) const;
  // Adds one user to each block and marks it most recently used.
  void Acquire(std::span<const int32_t> blocks);
  // Removes one user from each block (each must have one).
  void Release(std::span<const int32_t> blocks);
  // Registers block `index` of `tokens` (which holds at least index + 1 full blocks) as the child
  // of `parent`, the registered block index - 1 of the same tokens (-1 for index 0). Returns its
  // id, or -1 if that block is already registered or another block has its hash (the caller then
  // keeps its own KV private). A new block has no users.
  int32_t Insert(std::span<const int32_t> tokens, int64_t index, int32_t parent);
  // Evicts resident blocks without users (see top) until `need` tokens are freed or none is left;
  // appends the evicted blocks' hashes to `evicted`, children before parents, and, when
  // `evicted_tokens` is given, their tokens to it (one entry per hash). With tiers they are
  // demoted, else forgotten. Blocks in `wanted` (ids; what waiting requests match) are taken only
  // once no other block can be. Returns the tokens freed.
  int64_t Evict(int64_t need, std::vector<uint64_t>* evicted,
                std::vector<std::vector<int32_t>>* evicted_tokens = nullptr,
                std::span<const int32_t> wanted = {});
  // As Evict, but never takes a block in `keep` (ids; stale ids are ignored): the room a prefetch
  // may make without touching the blocks that requests ahead of it need. Returns the tokens freed.
  int64_t EvictExcept(int64_t need, std::span<const int32_t> keep, std::vector<uint64_t>* evicted,
                      std::vector<std::vector<int32_t>>* evicted_tokens = nullptr);
  // Registers a block held by a lower tier, demoted: `tokens` (block_tokens of them) after the
  // registered block `parent_hash` (PrefixIndex::kSeed: the chain's first block). Returns its id, or
  // -1 (nothing changed) when the tiers are off, the parent is not registered, the tokens do not
  // give `hash`, or the hash is taken. The least recently used demoted leaves beyond max_demoted are
  // then forgotten, as after Evict (possibly this block).
  int32_t AddDemoted(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens);
  // kv.tiers.eviction next_use: the demoted blocks forgotten beyond max_demoted are those that the
  // caller's `wanted` (Evict) or `keep` (EvictExcept) do not name first, as the rank's tiers do
  // (memory_node/tier_eviction_order.h), so that the registry offers what the tiers keep. Off:
  // least recently used only.
  void set_demoted_wanted_last(bool on) { demoted_wanted_last_ = on; }
  // A demoted block whose parent is resident (or that starts a chain) becomes resident.
  void MarkRestored(int32_t id);
  // Drops `id` and every block below it (none may have users).
  void Forget(int32_t id);
  bool resident(int32_t id) const { return blocks_[static_cast<size_t>(id)].resident; }
  // Id of the registered block with this hash, or -1.
  int32_t Find(uint64_t hash) const { return FindHash(hash); }
  const std::vector<int32_t>& tokens(int32_t id) const { return blocks_[static_cast<size_t>(id)].tokens; }

  int64_t block_tokens() const { return block_tokens_; }

  // Content look-ups (kv.store_pre_rope; compute_node/shifted_match.h), off until enabled: once on,
  // every registered block is also indexed by its first anchor_tokens() tokens and by its parent.
  // Enable before the first Insert.
  void EnableContentLookup() { content_lookup_ = true; }
  bool content_lookup() const { return content_lookup_; }
  // min(block_tokens, 8): the tokens a block is anchored by.
  int64_t anchor_tokens() const { return std::min<int64_t>(block_tokens_, 8); }
  // Ids of the registered blocks whose first anchor_tokens() tokens are `tokens`' first ones
  // (compared, not only hashed); empty when `tokens` is shorter or the look-up is off.
  std::vector<int32_t> WithAnchor(std::span<const int32_t> tokens) const;
  // Ids of the registered children of block `id` (empty when the look-up is off).
  std::vector<int32_t> Children(int32_t id) const;
  // The chained hash of a block of tokens after the block `parent_hash` (kSeed for block 0).
  uint64_t HashBlock(uint64_t parent_hash, std::span<const int32_t> block) const {
    return hash_(parent_hash, block);
  }
  uint64_t hash(int32_t id) const { return blocks_[static_cast<size_t>(id)].hash; }
  int32_t parent(int32_t id) const { return blocks_[static_cast<size_t>(id)].parent; }
  int32_t users(int32_t id) const { return blocks_[static_cast<size_t>(id)].users; }
  // Tokens held by resident blocks without users: what Evict could free.
  int64_t unused_tokens() const { return unused_blocks_ * block_tokens_; }
  // Counts a request's prompt tokens and the part of them it attached (for Stats).
  void CountLookup(int64_t prompt_tokens, int64_t matched_tokens);
  const Stats& stats() const { return stats_; }

 private:
  struct Block {
    uint64_t hash = 0;
    int32_t parent = -1;  // block id, -1 for block 0 of a prompt
    int32_t num_children = 0;
    int32_t resident_children = 0;
    int32_t users = 0;
    bool live = false;
    bool resident = true;
    std::vector<int32_t> tokens;  // block_tokens
    uint64_t last_used = 0;       // tick of the last Acquire/Insert that touched it
    std::list<int32_t>::iterator lru_it;
  };

  // Id of the registered block with this hash, or -1.
  int32_t FindHash(uint64_t hash) const;
  // Takes a free id and fills it as a new block without users, counted in stats_.blocks and in the
  // parent's children; the caller does the resident accounting. Returns the id.
  int32_t NewBlock(uint64_t hash, int32_t parent, std::span<const int32_t> tokens, bool resident);
  void Touch(int32_t id);
  void Remove(int32_t id);
  // One least-recently-used pass of Evict; blocks with keep[id] set are skipped (keep may be empty).
  void EvictPass(int64_t need, const std::vector<char>& keep, int64_t* freed, std::vector<uint64_t>* evicted,
                 std::vector<std::vector<int32_t>>* evicted_tokens);
  // Forgets least recently used demoted leaves while more than max_demoted_ are kept; with
  // demoted_wanted_last_, those with keep[id] set only once no other can go (keep may be empty).
  void TrimDemoted(const std::vector<char>& keep);
  void TrimDemotedPass(const std::vector<char>& keep);

  int64_t block_tokens_;
  BlockHashFn hash_;
  int64_t max_demoted_;
  bool demoted_wanted_last_ = false;
  std::vector<Block> blocks_;                      // by id; dead ones are reused
  std::vector<int32_t> free_ids_;                  // dead block ids
  std::unordered_map<uint64_t, int32_t> by_hash_;  // chained hash -> block id
  // Content look-ups (EnableContentLookup): anchor hash -> block ids, parent id -> child ids.
  bool content_lookup_ = false;
  std::unordered_multimap<uint64_t, int32_t> by_anchor_;
  std::unordered_multimap<int32_t, int32_t> by_parent_;
  uint64_t AnchorHash(std::span<const int32_t> tokens) const;
  std::list<int32_t> lru_;  // front: least recently used
  int64_t unused_blocks_ = 0;
  uint64_t tick_ = 0;
  Stats stats_;
};

}  // namespace tandem
