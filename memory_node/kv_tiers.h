// KV tiers behind a KV table (docs/architecture.md, "KV cache on a memory rank"): moves a block's
// KV between an attention executor's pool and a KvTierStore (memory_node/kv_tier_store.h). The
// colocated engine and a memory rank each own one when kv.tiers.* turns a tier on.
//
// A block's bytes are its K and V over every layer: for each layer, the K rows of its slots in
// position order, then their V rows (AttentionExecutor::ReadSlots). The store's fingerprint covers
// the model's identity (a string its owner gives: weights and their seed where it knows them), the
// executor's KV shape and dtype and the block size, so a file written for anything else is refused.
//
// The CPU executor copies slots with memcpy; the CUDA executor gathers and scatters them on its
// stream through a device staging buffer (bf16 KV: a block is half the bytes of the CPU's).
//
// Demote passes the block's tokens on to the store when its caller knows them (with
// kv.tiers.persist the controller puts them in the plan's evictions, for the colocated engine and
// for a memory rank alike), so that a persisted file can be registered again after a restart: PersistedBlocks
// lists the blocks found on disk at start whose files hold a whole block of tokens.
//
// Layer-wise restore (the default): Restore loads and checks the block at once (a host copy is
// shared, not copied; a file is read and checked) but writes none of its KV into the pool; the
// owner calls RestoreLayer(l) just before layer l's attention of the step, which copies layer l of
// every block restored since the last FinishRestores into its slots, and FinishRestores once the
// step's layers have run (or at once for a plan without rows), which copies what is left. So a
// restore's pool copy is spread over the step's layers instead of delaying its first one: on a
// memory rank, each layer's copy runs while compute rank 0 computes that layer's q, k, v. A later
// Demote or Restore first finishes what an earlier step left. set_layerwise(false) copies every
// layer inside Restore.
//
// Asynchronous saves (executors whose AsyncReads(): the CUDA executor): Demote only starts the
// block's copy out of the pool (AttentionExecutor::StartReadSlots, into one of a ring of pinned
// buffers) and returns; a saver thread of the tiers waits for each copy and hands the bytes to the
// store. A Demote waits only when every ring buffer is still in use. A Restore of a block the store
// does not hold yet, store() and the destructor first wait for the saves in flight, so a block
// demoted in one step can be restored in the next.
//
// Thread safety: as the KV table's (one thread); the store's disk writer and the saver run on
// threads of their own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
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
  void SetNextUse(std::span<const KvTierNextUse> uses) override { store_->SetNextUse(uses); }

  // Shifted restore (kv.store_pre_rope; PrefixRestore::segments): fills `slots` (block_tokens of
  // them, positions first_position, first_position + 1, ...) with the sources' rows in order (their
  // rows add up to block_tokens; rows of a source in the pool are copied inside it,
  // AttentionExecutor::CopySlots, and only a tier source's go through host memory) and turns their keys from
  // the sources' positions (source_index * block_tokens + row + i) to the new ones
  // (AttentionExecutor::RotateKeys). All layers at once: restores staged earlier are finished first, since
  // they may be the sources. False (with a warning; the caller recomputes the block) when a source has no
  // good copy, set_rotary was not called, or the executor fails.
  bool RestoreShifted(std::span<const KvShiftedSource> sources, std::span<const int32_t> slots,
                      int64_t first_position) override;

  // Layer-wise restore (see the top): copies layers up to `layer` of the blocks restored since
  // the last FinishRestores (layers already copied are skipped, so several lanes may call it).
  absl::Status RestoreLayer(int64_t layer);
  // Copies every layer not yet copied of those blocks and forgets them.
  absl::Status FinishRestores();
  void set_layerwise(bool on) { layerwise_ = on; }
  // kv.store_pre_rope: the model's inverse rotary frequencies (kernels::cpu::RopeInvFreq of its
  // RopeSpec and head_dim), with which a shifted restore turns keys to their new positions. Empty
  // (the default): shifted restores fail, and their blocks are recomputed.
  void set_rotary(std::vector<float> inv_freq) { inv_freq_ = std::move(inv_freq); }
  bool layerwise() const { return layerwise_; }

  // kv.tiers.persist: blocks found on disk at start with block_tokens tokens each, parents first.
  std::vector<KvTierBlock> PersistedBlocks() const;

  // Waits for the saves in flight first (the store then holds every demoted block).
  KvTierStore& store() {
    DrainSaves();
    return *store_;
  }
  ~KvTiers();
  KvTierStats stats() const { return store_->stats(); }
  // Wall time spent restoring: loads from the store, checks and the copies into the pool, wherever
  // they ran (Restore, RestoreLayer, FinishRestores).
  double restore_seconds() const { return restore_seconds_; }
  // The part of restore_seconds spent inside Restore, before the step's layers start: what a
  // restore delays the step by (with layer-wise restore, the loads and checks only).
  double restore_stall_seconds() const { return restore_stall_seconds_; }
  // Wall time the step's thread spent saving: in Demote, the copy out of the pool and the hand-over
  // to the store (its host copy; disk writes run on the store's thread), or with asynchronous saves
  // starting the copy and any wait for a free ring buffer; and waits for saves in flight before a
  // restore. It delays the step whose admission evicted the blocks.
  double save_seconds() const { return save_seconds_; }

 private:
  KvTiers(AttentionExecutor* executor, std::unique_ptr<KvTierStore> store, int64_t block_tokens)
      : executor_(executor), store_(std::move(store)), block_tokens_(block_tokens) {}
  AttentionExecutor* executor_;
  std::unique_ptr<KvTierStore> store_;
  // Asynchronous saves: the saver thread's loop, and the wait until no save is in flight.
  void SaverLoop();
  void DrainSaves();
  struct SaveJob {
    int64_t ticket = 0;
    KvTierBlock block;
    uint8_t* bytes = nullptr;  // a ring buffer
  };
  // Restore without the clock.
  bool Load(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots);
  // A block loaded by a layer-wise Restore, its layers not all in the pool yet.
  struct Staged {
    std::vector<int32_t> slots;
    std::shared_ptr<const std::vector<uint8_t>> bytes;
  };

  int64_t block_tokens_;
  // One block, in memory the executor copies to and from fastest (pinned host memory on a GPU:
  // a device-to-host copy into pageable memory measured several times slower).
  BackendBuffer pinned_{nullptr, nullptr};
  std::span<uint8_t> buffer_;
  bool layerwise_ = true;
  std::vector<float> inv_freq_;  // set_rotary
  std::vector<Staged> staged_;
  int64_t layers_copied_ = 0;  // of staged_: layers [0, layers_copied_) are in the pool
  double restore_seconds_ = 0;
  double restore_stall_seconds_ = 0;
  double save_seconds_ = 0;
  // Asynchronous saves (see the top): the pinned ring and its free buffers, the jobs for the saver.
  BackendBuffer ring_{nullptr, nullptr};
  std::mutex save_mu_;
  std::condition_variable save_cv_;
  std::vector<uint8_t*> free_buffers_;  // guarded by save_mu_
  std::deque<SaveJob> jobs_;            // guarded by save_mu_
  int64_t in_flight_ = 0;               // jobs queued or being saved; guarded by save_mu_
  bool stop_ = false;                   // guarded by save_mu_
  std::thread saver_;
};

}  // namespace tandem
