#include "memory_node/kv_tiers.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "common/wire.h"

namespace tandem {

uint64_t KvBlockFingerprint(const AttentionShape& shape, DType dtype, int64_t block_tokens,
                            std::string_view model) {
  const std::string text = absl::StrCat(
      "layers=", shape.num_layers, ";kv_heads=", shape.num_kv_heads, ";head_dim=", shape.head_dim,
      ";dtype=", std::string(DTypeName(dtype)), ";block=", block_tokens, ";model=", std::string(model));
  const auto* bytes = reinterpret_cast<const uint8_t*>(text.data());
  const uint32_t lo = Crc32c({bytes, text.size()});
  const uint32_t hi = Crc32cExtend(lo ^ 0x5a5a5a5au, {bytes, text.size()});
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

absl::StatusOr<std::unique_ptr<KvTiers>> KvTiers::Create(const KvTierOptions& options,
                                                         AttentionExecutor* executor, int64_t block_tokens,
                                                         std::string_view model) {
  if (block_tokens < 1)
    return absl::InvalidArgumentError("kv.tiers.*: KV tiers need the prefix cache (kv.prefix_cache: true)");
  const AttentionShape& shape = executor->shape();
  const int64_t block_bytes =
      block_tokens * shape.kv_bytes_per_token(static_cast<int64_t>(DTypeSize(executor->dtype())));
  ASSIGN_OR_RETURN(
      std::unique_ptr<KvTierStore> store,
      KvTierStore::Create(options, KvBlockFingerprint(shape, executor->dtype(), block_tokens, model),
                          block_bytes));
  TANDEM_LOG_INFO("kv-tiers", "KV tiers: host ", options.host_bytes >> 20, " MiB, disk ",
                  options.disk_bytes > 0
                      ? absl::StrCat(options.disk_bytes >> 20, " MiB in ", options.disk_dir)
                      : std::string("off"),
                  "; ", block_bytes, " bytes per block of ", block_tokens, " tokens");
  auto tiers = std::unique_ptr<KvTiers>(new KvTiers(executor, std::move(store), block_tokens));
  ASSIGN_OR_RETURN(tiers->pinned_, executor->memory().Allocate(static_cast<size_t>(block_bytes), true));
  tiers->buffer_ = {static_cast<uint8_t*>(tiers->pinned_.get()), static_cast<size_t>(block_bytes)};
  if (executor->AsyncReads()) {
    // A ring of pinned buffers for the saves in flight: up to 16 blocks, at most 256 MiB.
    const int64_t buffers = std::clamp<int64_t>((int64_t{256} << 20) / block_bytes, 2, 16);
    ASSIGN_OR_RETURN(tiers->ring_,
                     executor->memory().Allocate(static_cast<size_t>(buffers * block_bytes), true));
    for (int64_t i = 0; i < buffers; ++i)
      tiers->free_buffers_.push_back(static_cast<uint8_t*>(tiers->ring_.get()) + i * block_bytes);
    KvTiers* t = tiers.get();
    tiers->saver_ = std::thread([t] { t->SaverLoop(); });
  }
  return tiers;
}

KvTiers::~KvTiers() {
  if (!saver_.joinable()) return;
  DrainSaves();
  {
    std::lock_guard<std::mutex> lock(save_mu_);
    stop_ = true;
  }
  save_cv_.notify_all();
  saver_.join();
}

void KvTiers::SaverLoop() {
  const size_t bytes = static_cast<size_t>(store_->block_bytes());
  while (true) {
    SaveJob job;
    {
      std::unique_lock<std::mutex> lock(save_mu_);
      save_cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const absl::Status st = executor_->FinishReadSlots(job.ticket);
    if (st.ok()) {
      store_->Save(job.block, {job.bytes, bytes});
    } else {  // not kept; a later restore of it fails and recomputes
      TANDEM_LOG_WARN("kv-tiers", "block ", absl::StrFormat("%016x", job.block.hash),
                      " not saved: ", st.message());
    }
    {
      std::lock_guard<std::mutex> lock(save_mu_);
      free_buffers_.push_back(job.bytes);
      --in_flight_;
    }
    save_cv_.notify_all();
  }
}

void KvTiers::DrainSaves() {
  if (!saver_.joinable()) return;
  std::unique_lock<std::mutex> lock(save_mu_);
  save_cv_.wait(lock, [this] { return in_flight_ == 0; });
}

std::vector<KvTierBlock> KvTiers::PersistedBlocks() const {
  std::vector<KvTierBlock> blocks;
  for (const KvTierBlock& b : store_->PersistedBlocks())
    if (static_cast<int64_t>(b.tokens.size()) == block_tokens_) blocks.push_back(b);
  return blocks;
}

void KvTiers::Demote(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots,
                     std::span<const int32_t> tokens) {
  if (!staged_.empty()) {  // a step left restores unfinished: their slots may be the ones read here
    if (const absl::Status done = FinishRestores(); !done.ok())
      TANDEM_LOG_WARN("kv-tiers", "finishing restores: ", done.message());
  }
  const auto t0 = std::chrono::steady_clock::now();
  KvTierBlock block{.hash = hash,
                    .parent_hash = parent_hash,
                    .depth = depth,
                    .tokens = std::vector<int32_t>(tokens.begin(), tokens.end())};
  if (saver_.joinable()) {  // asynchronous: start the copy into a free ring buffer, the saver does the rest
    uint8_t* bytes = nullptr;
    {
      std::unique_lock<std::mutex> lock(save_mu_);
      save_cv_.wait(lock, [this] { return !free_buffers_.empty(); });
      bytes = free_buffers_.back();
      free_buffers_.pop_back();
    }
    absl::StatusOr<int64_t> ticket = executor_->StartReadSlots(slots, bytes);
    {
      std::lock_guard<std::mutex> lock(save_mu_);
      if (ticket.ok()) {
        jobs_.push_back({.ticket = *ticket, .block = std::move(block), .bytes = bytes});
        ++in_flight_;
      } else {
        free_buffers_.push_back(bytes);
      }
    }
    save_cv_.notify_all();
    if (!ticket.ok())
      TANDEM_LOG_WARN("kv-tiers", "block ", absl::StrFormat("%016x", hash),
                      " not saved: ", ticket.status().message());
    save_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return;
  }
  const absl::Status st = executor_->ReadSlots(slots, buffer_.data());
  if (!st.ok()) {  // the block is then simply not kept; a later restore of it fails and recomputes
    TANDEM_LOG_WARN("kv-tiers", "block ", absl::StrFormat("%016x", hash), " not saved: ", st.message());
    return;
  }
  store_->Save(block, buffer_);
  save_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool KvTiers::Restore(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots) {
  if (layers_copied_ > 0) {  // an earlier step's layers ran but it was not finished
    if (const absl::Status done = FinishRestores(); !done.ok())
      TANDEM_LOG_WARN("kv-tiers", "finishing restores: ", done.message());
  }
  if (saver_.joinable() && !store_->Contains(hash)) {  // it may still be on its way to the store
    const auto w0 = std::chrono::steady_clock::now();
    DrainSaves();
    save_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
  }
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = Load(hash, parent_hash, depth, slots);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  restore_seconds_ += seconds;
  restore_stall_seconds_ += seconds;
  return ok;
}

absl::Status KvTiers::RestoreLayer(int64_t layer) {
  if (staged_.empty()) return absl::OkStatus();
  const auto t0 = std::chrono::steady_clock::now();
  for (; layers_copied_ <= layer && layers_copied_ < executor_->shape().num_layers; ++layers_copied_) {
    for (const Staged& s : staged_)
      RETURN_IF_ERROR(executor_->WriteSlotsLayer(s.slots, layers_copied_, s.bytes->data()));
  }
  restore_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status KvTiers::FinishRestores() {
  absl::Status st = RestoreLayer(executor_->shape().num_layers - 1);
  // A GPU executor's copies from the staged bytes are asynchronous: they must have run before the
  // store may hand those bytes to another block.
  if (st.ok() && !staged_.empty()) st = executor_->memory().Synchronize();
  staged_.clear();
  layers_copied_ = 0;
  return st;
}

bool KvTiers::Load(uint64_t hash, uint64_t parent_hash, int32_t depth, std::span<const int32_t> slots) {
  KvTierBlock block;
  std::shared_ptr<const std::vector<uint8_t>> bytes;
  absl::StatusOr<int> tier =
      layerwise_ ? store_->LoadShared(hash, &block, &bytes) : store_->Load(hash, &block, buffer_);
  if (!tier.ok()) {
    TANDEM_LOG_WARN("kv-tiers", "restore of block ", absl::StrFormat("%016x", hash), " failed (",
                    tier.status().message(), "); its tokens are recomputed");
    return false;
  }
  if (block.parent_hash != parent_hash || block.depth != depth) {
    TANDEM_LOG_WARN("kv-tiers", "restore of block ", absl::StrFormat("%016x", hash),
                    ": the saved copy has another parent or depth; its tokens are recomputed");
    return false;
  }
  if (layerwise_) {  // the pool copy happens layer by layer (RestoreLayer)
    staged_.push_back({.slots = std::vector<int32_t>(slots.begin(), slots.end()), .bytes = std::move(bytes)});
    return true;
  }
  absl::Status st = executor_->WriteSlots(slots, buffer_.data());
  if (st.ok()) st = executor_->memory().Synchronize();  // buffer_ is the next Demote's or Load's
  if (!st.ok()) {
    TANDEM_LOG_WARN("kv-tiers", "restore of block ", absl::StrFormat("%016x", hash), ": ", st.message());
    return false;
  }
  return true;
}

bool KvTiers::RestoreShifted(std::span<const KvShiftedSource> sources, std::span<const int32_t> slots,
                             int64_t first_position) {
  const auto fail = [&](const std::string& why) {
    TANDEM_LOG_WARN("kv-tiers", "shifted restore at position ", first_position, " failed (", why,
                    "); its tokens are recomputed");
    return false;
  };
  if (inv_freq_.empty()) return fail("no rotary frequencies");
  if (const absl::Status done = FinishRestores(); !done.ok()) return fail(std::string(done.message()));
  if (saver_.joinable()) {  // a store source may still be on its way to the store
    bool pending = false;
    for (const KvShiftedSource& src : sources)
      pending |= src.pool_slots.empty() && !store_->Contains(src.hash);
    if (pending) {
      const auto w0 = std::chrono::steady_clock::now();
      DrainSaves();
      save_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t bt = block_tokens_;
  const int64_t layers = executor_->shape().num_layers;
  const size_t row_bytes = static_cast<size_t>(executor_->shape().kv_dim()) * DTypeSize(executor_->dtype());
  TANDEM_CHECK(static_cast<int64_t>(slots.size()) == bt);
  // Rows of sources in the pool are copied inside it (AttentionExecutor::CopySlots: no host copy);
  // rows of sources only the tiers hold go through buffer_, each source's rows at their own offset
  // in WriteSlots' layout (the sources' rows add up to one block, so they fit).
  std::vector<int32_t> copy_src, copy_dst, from_positions, to_positions;
  size_t staged = 0;  // bytes of buffer_ the tier sources use
  int64_t at = 0;
  for (const KvShiftedSource& src : sources) {
    if (src.rows < 1 || src.row < 0 || src.row + src.rows > bt || at + src.rows > bt)
      return fail("bad segment");
    const std::span<const int32_t> dst =
        slots.subspan(static_cast<size_t>(at), static_cast<size_t>(src.rows));
    if (!src.pool_slots.empty()) {
      copy_src.insert(copy_src.end(), src.pool_slots.begin(), src.pool_slots.end());
      copy_dst.insert(copy_dst.end(), dst.begin(), dst.end());
    } else {
      KvTierBlock block;
      std::shared_ptr<const std::vector<uint8_t>> bytes;
      const absl::StatusOr<int> tier = store_->LoadShared(src.hash, &block, &bytes);
      if (!tier.ok())
        return fail(
            absl::StrCat("block ", absl::StrFormat("%016x", src.hash), ": ", tier.status().message()));
      if (block.depth != src.source_index + 1)
        return fail(absl::StrCat("block ", absl::StrFormat("%016x", src.hash), " has another depth"));
      uint8_t* out = buffer_.data() + staged;
      const size_t run = static_cast<size_t>(src.rows) * row_bytes;
      for (int64_t part = 0; part < layers * 2; ++part) {  // each layer's K, then its V
        std::memcpy(out + static_cast<size_t>(part) * run,
                    bytes->data() + static_cast<size_t>(part * bt + src.row) * row_bytes, run);
      }
      if (const absl::Status st = executor_->WriteSlots(dst, out); !st.ok())
        return fail(std::string(st.message()));
      staged += static_cast<size_t>(layers * 2) * run;
    }
    for (int32_t i = 0; i < src.rows; ++i) {
      from_positions.push_back(static_cast<int32_t>(src.source_index * bt + src.row + i));
      to_positions.push_back(static_cast<int32_t>(first_position + at + i));
    }
    at += src.rows;
  }
  if (at != bt) return fail("the segments do not fill the block");
  absl::Status st = executor_->CopySlots(copy_src, copy_dst);
  if (st.ok() && staged > 0) st = executor_->memory().Synchronize();  // buffer_ is the next restore's
  if (st.ok()) st = executor_->RotateKeys(slots, from_positions, to_positions, inv_freq_);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  restore_seconds_ += seconds;
  restore_stall_seconds_ += seconds;
  if (!st.ok()) return fail(std::string(st.message()));
  return true;
}

}  // namespace tandem
