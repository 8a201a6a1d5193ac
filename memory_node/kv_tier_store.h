// The lower KV tiers of one memory rank (docs/architecture.md, "KV cache on a memory rank"): host
// DRAM and files in a directory, below the rank's KV pool. A registered prefix block that the
// controller evicts from the pool is saved here (demoted) and can be loaded back into pool slots
// (restored) when a later request's prompt starts with it.
//
// A block is a fixed number of bytes (block_bytes: its KV over every layer) named by its chained
// hash (compute_node/prefix_index.h), with its parent's hash, its depth in the chain and, when its
// owner knows them, its token ids (what a restarted owner needs to register the block again: its
// registry compares tokens, not only hashes).
//
//   Save(block, bytes)  copies the bytes into the host tier (evicted blocks make room, in the order
//                       below; a block larger than the tier, or a tier of 0 bytes, is not kept there)
//                       and, when the disk tier is on and the block is not on disk yet, queues it for
//                       the writer thread: a block is written once per tier. Save never waits for
//                       the disk.
//   SetNextUse(uses)    the blocks that waiting requests will reuse, each with the queue position
//                       of the first request that will (the owner's controller computes them each
//                       step: the step plan's next-use records of this rank); replaces the last
//                       call's list. Costs the size of the two lists, not of the tiers.
//   Load(hash, out)     the host copy if there is one, else the copy queued for its file (a block
//                       on its way to disk; counted as a host hit), else the file (read on the
//                       calling thread).
//                       Every copy is checked: header, fingerprint, hash, length and CRC-32C of the
//                       tokens and of the bytes. A copy that fails is discarded with a warning naming
//                       the file and what was wrong, and Load returns NotFound (the caller
//                       recomputes); it never returns bytes that fail the check.
//
// Disk tier: one file per block, `<hash as 16 hex digits>.kvb`: a 64-byte header, the block's
// tokens (token_count little-endian i32), then the KV bytes:
//
//   offset  size  field           notes
//        0     4  magic           "TDKV"
//        4     2  version         kKvBlockFileVersion (2; version 1 files had no tokens)
//        6     2  header_bytes    64
//        8     8  fingerprint     the store's (model, KV shape, dtype, block size): a file written
//                                 for another model or shape is refused
//       16     8  hash            the block's chained hash (== the file name's)
//       24     8  parent_hash     0 for depth 1
//       32     4  depth           >= 1
//       36     4  payload_crc32c  Crc32c of the KV bytes
//       40     8  payload_bytes   == block_bytes
//       48     4  token_count     0 (tokens unknown to the writer) or the block's tokens, at most
//                                 kKvBlockMaxTokens
//       52     4  tokens_crc32c   Crc32c of the token bytes (0 when token_count is 0)
//       56     4  reserved        0
//       60     4  header_crc32c   Crc32c of bytes [0, 60)
//
// The writer writes `<name>.tmp`, then renames it, so a crash mid-write leaves no file with a good
// name (leftover .tmp files are removed when a store opens the directory; a file renamed before
// its bytes reached the disk fails its checksums). Files are evicted when disk_bytes would be
// exceeded.
//
// Eviction (kv.tiers.eviction; memory_node/tier_eviction_order.h): with kNextUse (the default) each
// tier evicts first the blocks no waiting request of the controller's look-ahead window will reuse
// (least recently used first), then, only when every block it holds is wanted, the one whose next
// use is farthest in the queue; a block that would itself be evicted first (it is not wanted while
// every block held is, or it is wanted later than all of them) is not taken into a full tier
// (counted as an eviction of that tier). With kLru the next uses are ignored: least recently used. A write
// that fails (disk full, directory gone) is logged once per store, counted, and the block stays in the host
// tier only.
//
// persist: false: the directory is this store's scratch space: block files (and leftover .tmp
// files) found there at start are removed, and so are the store's files when it is destroyed;
// other files are left alone. persist: true: files are kept, and at start the store re-indexes
// the directory: each file's header and tokens are checked (the KV bytes are checked when a Load
// reads them, so that a start reads headers, not the whole tier); files that are truncated,
// corrupt, of another format version or of another model or KV shape are removed, with one
// warning line counting them. PersistedBlocks() lists the rest so that the owner can tell its
// registry; the most recently written are kept when the files exceed disk_bytes.
//
// Thread safety: Save, Load, Contains, SetNextUse, stats and Flush may be called from any thread; one writer
// thread of the store's own does the disk writes.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "memory_node/tier_eviction_order.h"

namespace tandem {

inline constexpr uint16_t kKvBlockFileVersion = 2;
inline constexpr size_t kKvBlockHeaderBytes = 64;
// Tokens a block file holds at most (kv.prefix_block_tokens is at most 4096).
inline constexpr int64_t kKvBlockMaxTokens = 4096;

// kv.tiers.eviction: "next_use" or "lru".
enum class KvTierEviction : uint8_t { kNextUse = 0, kLru = 1 };
// "next_use" -> kNextUse, "lru" -> kLru; InvalidArgument naming kv.tiers.eviction otherwise.
absl::StatusOr<KvTierEviction> ParseKvTierEviction(std::string_view name);

// A block that a waiting request will reuse: `next_use` is the queue position (0: the head) of the
// first waiting request that will.
struct KvTierNextUse {
  uint64_t hash = 0;
  int32_t next_use = 0;
};

// kv.tiers.* as a memory rank (or the colocated engine) takes them.
struct KvTierOptions {
  int64_t host_bytes = 0;  // host DRAM tier; 0: off
  std::string disk_dir;    // directory of the disk tier; "" with disk_bytes 0: off
  int64_t disk_bytes = 0;  // 0: disk tier off
  bool persist = false;    // keep files across restarts and re-index them at start
  // kv.tiers.eviction: by next use in the waiting queue (SetNextUse), or least recently used.
  KvTierEviction eviction = KvTierEviction::kNextUse;
  bool enabled() const { return host_bytes > 0 || disk_bytes > 0; }
};

// Checks the settings against this machine: host_bytes against available host memory, disk_bytes
// against the free space of disk_dir (created if missing), disk_dir given iff disk_bytes > 0.
// InvalidArgument / ResourceExhausted naming the kv.tiers setting otherwise.
absl::Status CheckKvTierOptions(const KvTierOptions& options);

struct KvTierBlock {
  uint64_t hash = 0;
  uint64_t parent_hash = 0;  // 0 at depth 1
  int32_t depth = 1;
  std::vector<int32_t> tokens;  // the block's token ids; empty when its owner does not know them
};

struct KvTierStats {
  int64_t saves = 0;            // blocks handed to Save (demotions)
  int64_t host_hits = 0;        // loads served from host memory
  int64_t disk_hits = 0;        // loads served from a file
  int64_t misses = 0;           // loads of blocks in no tier
  int64_t discarded = 0;        // copies that failed their check (corrupt, truncated, foreign)
  int64_t reindexed = 0;        // persist: files found good when the store opened the directory
  int64_t bytes_to_host = 0;    // pool -> host
  int64_t bytes_from_host = 0;  // host -> pool
  int64_t bytes_to_disk = 0;    // written to files (whole files: header, tokens and KV)
  int64_t bytes_from_disk = 0;  // read from files for the pool (whole files)
  int64_t host_evictions = 0;   // blocks evicted, and blocks a full tier did not take (next-use)
  int64_t disk_evictions = 0;
  int64_t write_errors = 0;  // disk writes that failed
  int64_t host_blocks = 0;   // now
  int64_t disk_blocks = 0;   // now
};

class KvTierStore {
 public:
  // `fingerprint` identifies the model, KV shape and dtype whose blocks this store holds;
  // block_bytes >= 1. With a disk tier, rank_dir is disk_dir itself (each memory rank gets its own
  // subdirectory from its owner). Errors name the kv.tiers setting.
  static absl::StatusOr<std::unique_ptr<KvTierStore>> Create(const KvTierOptions& options,
                                                             uint64_t fingerprint, int64_t block_bytes);
  ~KvTierStore();
  KvTierStore(const KvTierStore&) = delete;
  KvTierStore& operator=(const KvTierStore&) = delete;

  // bytes.size() == block_bytes; block.tokens.size() <= kKvBlockMaxTokens.
  void Save(const KvTierBlock& block, std::span<const uint8_t> bytes);
  // Fills `out` (block_bytes) and `block`; returns the tier it came from (1 host, 2 disk). NotFound
  // when no good copy exists (a bad one is discarded first, with a warning).
  absl::StatusOr<int> Load(uint64_t hash, KvTierBlock* block, std::span<uint8_t> out);
  // As Load, but hands out the bytes without copying them where it can: the host tier's (or the
  // queued) copy itself, which stays valid while `out` holds it, else a fresh buffer read from
  // the file. Counted as Load counts.
  absl::StatusOr<int> LoadShared(uint64_t hash, KvTierBlock* block,
                                 std::shared_ptr<const std::vector<uint8_t>>* out);
  bool Contains(uint64_t hash) const;
  // The blocks waiting requests will reuse (see the top); a hash listed twice keeps its nearest
  // use. Ignored with KvTierEviction::kLru.
  void SetNextUse(std::span<const KvTierNextUse> uses);
  // Whether the host / disk tier holds the block now (tests; a block queued for its file is not on
  // disk yet).
  bool InHost(uint64_t hash) const;
  bool OnDisk(uint64_t hash) const;
  // Blocks found on disk (with their tokens, as written) when the store opened the directory with
  // persist, parents before children (by depth). A block whose parent is missing is listed too: the
  // owner keeps whole chains only.
  const std::vector<KvTierBlock>& PersistedBlocks() const { return persisted_; }
  KvTierStats stats() const;
  // Waits until every queued disk write has been done (tests, shutdown).
  void Flush();
  int64_t block_bytes() const { return block_bytes_; }
  // The file of a block (tests corrupt it).
  std::string FilePath(uint64_t hash) const;

 private:
  KvTierStore(const KvTierOptions& options, uint64_t fingerprint, int64_t block_bytes);
  struct HostEntry {
    KvTierBlock block;
    std::shared_ptr<const std::vector<uint8_t>> bytes;
  };
  struct DiskEntry {
    int64_t file_bytes = 0;
  };
  // Why a file was refused (counted when a store opens its directory).
  enum class FileProblem { kNone, kTruncated, kCorrupt, kVersion, kModel };
  struct Write {
    KvTierBlock block;
    std::shared_ptr<const std::vector<uint8_t>> bytes;
  };
  absl::Status OpenDirectory();
  void WriterLoop();
  // Writes one block's file (temp name, then rename). Called without mu_.
  absl::Status WriteFile(const Write& w) const;
  // Reads and checks a file's header and tokens (and, with `out`, its KV bytes); `problem` (may
  // be nullptr) says why a file was refused. Called without mu_.
  absl::Status ReadFile(const std::string& path, uint64_t expect_hash, KvTierBlock* block,
                        std::span<uint8_t> out, FileProblem* problem = nullptr) const;
  int64_t FileBytes(const KvTierBlock& block) const {
    return static_cast<int64_t>(kKvBlockHeaderBytes) + 4 * static_cast<int64_t>(block.tokens.size()) +
           block_bytes_;
  }
  void DropDiskLocked(uint64_t hash, bool count_eviction);
  // The block's next use (-1: none, or the lru policy). Called with mu_ held.
  int32_t NextUseLocked(uint64_t hash) const;
  // Counts a block the disk tier did not keep (the first one is logged). Called with mu_ held.
  void NoteWriteErrorLocked(uint64_t hash, const absl::Status& why);

  KvTierOptions options_;
  uint64_t fingerprint_;
  int64_t block_bytes_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint64_t, HostEntry> host_;
  TierEvictionOrder host_order_;
  std::unordered_map<uint64_t, DiskEntry> disk_;
  TierEvictionOrder disk_order_;
  std::unordered_map<uint64_t, int32_t> next_use_;  // SetNextUse's list
  int64_t disk_used_ = 0;                           // bytes of the files in disk_
  std::deque<Write> queue_;
  std::unordered_map<uint64_t, Write> queued_;  // blocks queued or being written, by hash
  bool writing_ = false;
  bool stop_ = false;
  bool warned_write_ = false;
  KvTierStats stats_;
  std::vector<KvTierBlock> persisted_;
  std::thread writer_;
};

}  // namespace tandem
