// KV tiers behind a KV table (docs/architecture.md, "KV cache on a memory rank"): moves a block's
// KV between an attention executor's pool and a KvTierStore (memory_node/kv_tier_store.h). The
// colocated engine and a memory rank each own one when kv.tiers.* turns a tier on.
//
// A block's bytes are its K and V over every layer: for each layer, the K rows of its slots in
// position order, then their V rows (AttentionExecutor::ReadSlots). The store's fingerprint covers
// the model's identity (a string its owner gives: weights and their seed where it knows them), the
// executor's KV shape and dtype and the block size, so a file written for anything else is refused.
//
// Only executors whose pool is in host memory copy slots today (the CPU executor): Create refuses
// others with an error naming kv.tiers.
//
// Demote passes the block's tokens on to the store when its caller knows them (the colocated
// engine does, from its controller; a memory rank does not), so that a persisted file can be
// registered again after a restart: PersistedBlocks lists the blocks found on disk at start whose
// files hold a whole block of tokens.
//
// Thread safety: as the KV table's (one thread); the store's disk writer runs on its own thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_table.h"
#include "memory_node/kv_tier_store.h"

namespace tandem {

uint64_t KvBlockFingerprint(const AttentionShape& shape, DType dtype, int64_t block_tokens,
                            std::string_view model);

class KvTiers : public KvBlockTiers {
 public:
  // `executor` must outlive the tiers. block_tokens >= 1 (the prefix registry's block).
  static absl::StatusOr<std::unique_ptr<KvTiers>> Create(const KvTierOptions& options,
                                                         AttentionExecutor* executor, int64_t block_tokens,
                                                         std::string_view model);

  void Demote(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots,
              std::span<const int32_t> tokens) override;
  bool Restore(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots) override;

  // kv.tiers.persist: blocks found on disk at start with block_tokens tokens each, parents first.
  std::vector<KvTierBlock> PersistedBlocks() const;

  KvTierStore& store() { return *store_; }
  KvTierStats stats() const { return store_->stats(); }
  // Wall time spent in Restore (loads from the store, checks and the copy into the pool).
  double restore_seconds() const { return restore_seconds_; }

 private:
  KvTiers(AttentionExecutor* executor, std::unique_ptr<KvTierStore> store, int64_t block_tokens)
      : executor_(executor), store_(std::move(store)), block_tokens_(block_tokens) {}
  AttentionExecutor* executor_;
  std::unique_ptr<KvTierStore> store_;
  // Restore without the clock.
  bool Load(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots);

  int64_t block_tokens_;
  std::vector<uint8_t> buffer_;  // one block
  double restore_seconds_ = 0;
};

}  // namespace tandem
