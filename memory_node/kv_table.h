// The requests whose KV lives on one memory rank (or in the colocated engine), the slots of their
// contexts, and the registered prefix blocks they share. Turns a step plan into the attention
// executor's batch: applies the plan's prefix evictions, attaches and publishes, allocates slots
// for each request's new rows, lists the keys each row reads, and resolves the plan's prefix
// groups into cascade groups (docs/architecture.md, "KV cache on a memory rank").
//
// Registered blocks: the controller (compute_node/prefix_index.h) decides what is registered,
// reused and evicted; this table keeps the result, block hash -> {parent, slots}, holding one
// reference on each block's slots (KvSlotAllocator counts), so a block outlives the request that
// published it until the controller evicts it.
//
// A step plan comes from the network, so Apply checks it against this table before changing
// anything: a new request starts at position 0 or attaches a registered chain of exactly
// `position` tokens; a known one continues where its context ends; kv_len = position + q_len;
// single-row requests come before multi-row ones; an evicted block exists and has neither users nor
// children; a published block extends its request's chain by one and lies within its context; a
// group's block exists, its members hold it and start after it. Any violation, or too few free
// slots, fails the whole step with nothing applied.
//
// KV tiers (SetTiers; memory_node/kv_tier_store.h): an evicted block's KV is handed to the tiers
// before its slots are freed (Demote), and a plan's restores take free slots, ask the tiers to
// fill them (Restore) and register the block with no users; a restore that finds no good copy, or
// whose parent failed, registers nothing, frees its slots and is reported to the caller. A restore
// must name a block that is not registered (after the plan's evictions) and a parent that is
// registered or restored earlier in the plan. Before the evictions, the plan's next-use records of
// the rank go to the tiers (SetNextUse; micro-batch 0 only, since the others carry none), with the
// plan's own restores of the rank at position 0 (the evictions' saves must not push out a block
// the same plan loads), so that the blocks demoted by the plan take their place in the tiers'
// eviction order.
//
// Thread safety: not thread-safe; the owning rank serialises calls.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "common/wire.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_slot_allocator.h"
#include "memory_node/kv_tier_store.h"

namespace tandem {

// A shifted restore's source (kv.store_pre_rope; PrefixRestore::segments): rows [row, row + rows) of
// block `hash` at depth source_index + 1, from the pool (pool_slots, which the KV table resolves
// for a source registered there) or else from the tiers.
struct KvShiftedSource {
  uint64_t hash = 0;
  int32_t source_index = 0;
  int32_t row = 0;
  int32_t rows = 0;
  std::span<const int32_t> pool_slots;  // `rows` slots, or empty: from the tiers
};

// Moves a block's KV between the pool and the lower tiers (memory_node/kv_tiers.h).
class KvBlockTiers {
 public:
  virtual ~KvBlockTiers() = default;
  // Saves the KV of `slots` (one block, in position order) under `hash`; `tokens` are the block's
  // token ids when the caller knows them (empty otherwise).
  virtual void Demote(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots,
                      std::span<const int32_t> tokens) = 0;
  // Fills `slots` with block `hash`'s KV; false when no good copy exists (the slots are then unused).
  virtual bool Restore(uint64_t hash, uint64_t parent_hash, int32_t depth,
                       std::span<const int32_t> slots) = 0;
  // The demoted blocks waiting requests will reuse (the plan's next-use records for this rank),
  // replacing the last list: the tiers' eviction order (KvTierStore::SetNextUse).
  virtual void SetNextUse(std::span<const KvTierNextUse> uses) = 0;
  // Fills `slots` (one block, positions first_position on) with the sources' rows in order, their
  // keys turned to the new positions; false when that cannot be done (the slots are then unused).
  virtual bool RestoreShifted(std::span<const KvShiftedSource> sources, std::span<const int32_t> slots,
                              int64_t first_position) = 0;
};

class KvTable {
 public:
  // Whether a group of `rows` rows should read its `prefix_tokens` shared keys once (cascade).
  using CascadeFilter = std::function<bool(int64_t rows, int64_t prefix_tokens)>;

  // block_tokens: tokens per registered block (0: no registry; plans that attach, publish, evict or
  // group are refused).
  explicit KvTable(int64_t num_slots, int64_t block_tokens = 0)
      : allocator_(num_slots), block_tokens_(block_tokens) {}

  // How groups are used: off ignores them (every request reads its whole context), on takes every
  // group, auto the groups `filter` accepts (a group it refuses hands its rows to its parent).
  void SetPrefixSharing(PrefixSharing mode, CascadeFilter filter = nullptr) {
    sharing_ = mode;
    filter_ = std::move(filter);
  }

  // Demoted and restored blocks go through `tiers` (not owned; nullptr: evictions drop the KV and
  // restores are refused).
  void SetTiers(KvBlockTiers* tiers) { tiers_ = tiers; }

  // Fills `batch` with the rows of the plan's requests owned by `memory_rank`, in plan order,
  // allocating their new slots. Errors (nothing changed): InvalidArgument naming the request,
  // block or group and the rule it breaks; ResourceExhausted when the pool lacks free slots.
  // `failed_restores` (may be nullptr) gets the hashes of this rank's restores that failed. An
  // eviction's tokens (PrefixEvict::tokens, when the plan carries them) go to the tiers with the
  // block.
  absl::Status Apply(const StepPlan& plan, uint16_t memory_rank, AttentionBatch* batch,
                     std::vector<uint64_t>* failed_restores = nullptr);
  // Hands every registered block to the tiers (Demote; the blocks stay registered), parents first,
  // with the tokens `tokens_of` gives for its hash (empty when unknown): what a clean shutdown
  // with a persisted disk tier keeps. No-op without tiers.
  void SaveRegistered(const std::function<std::span<const int32_t>(uint64_t hash)>& tokens_of);
  // Frees the KV of requests that ended or were cancelled (registered blocks stay). Ids not in the
  // table are ignored (a request may end before its first step reached this rank).
  void Release(std::span<const uint64_t> request_ids);

  int64_t num_slots() const { return allocator_.num_slots(); }
  int64_t num_free() const { return allocator_.num_free(); }
  int64_t num_requests() const { return static_cast<int64_t>(contexts_.size()); }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_tokens() const { return block_tokens_; }
  // Tokens of context held for a request (0 if unknown).
  int64_t context_length(uint64_t request_id) const;

 private:
  struct Block {
    uint64_t parent = 0;  // hash; meaningless at depth 1
    int32_t depth = 0;    // blocks in the chain up to and including this one
    int32_t num_children = 0;
    int32_t users = 0;           // requests whose chain holds it
    std::vector<int32_t> slots;  // block_tokens; the table holds one reference on each
  };
  struct Context {
    std::vector<int32_t> slots;   // by position
    std::vector<uint64_t> chain;  // hashes of the registered blocks it holds, from block 0
  };

  // A restore with segments: its sources resolved (pool or tiers) and handed to the tiers.
  bool RestoreShifted(const PrefixRestore& restore, std::span<const int32_t> slots);
  // The chain of hashes from block 0 to `hash` (which must be registered).
  std::vector<uint64_t> ChainTo(uint64_t hash) const;
  absl::Status Check(const StepPlan& plan, uint16_t memory_rank, std::vector<const StepRequest*>* mine) const;
  void BuildGroups(const StepPlan& plan, uint16_t memory_rank, const std::vector<const StepRequest*>& mine,
                   AttentionBatch* batch) const;

  KvSlotAllocator allocator_;
  KvBlockTiers* tiers_ = nullptr;
  int64_t block_tokens_;
  PrefixSharing sharing_ = PrefixSharing::kOff;
  CascadeFilter filter_;
  std::unordered_map<uint64_t, Context> contexts_;  // request id -> its KV
  std::unordered_map<uint64_t, Block> blocks_;      // registered blocks by hash
};

}  // namespace tandem
