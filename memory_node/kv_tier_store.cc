#include "memory_node/kv_tier_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/status.h"
#include "common/wire.h"

namespace tandem {
namespace {

namespace fs = std::filesystem;

constexpr uint32_t kMagic = 0x564b4454;  // "TDKV"
constexpr const char* kSuffix = ".kvb";

void Put16(uint8_t* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t Get(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string Errno(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

// Reads exactly n bytes or fails (a short file is truncated).
bool ReadAll(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteAll(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::write(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

absl::StatusOr<KvTierEviction> ParseKvTierEviction(std::string_view name) {
  if (name == "next_use") return KvTierEviction::kNextUse;
  if (name == "lru") return KvTierEviction::kLru;
  return absl::InvalidArgumentError(
      absl::StrCat("kv.tiers.eviction: \"", std::string(name), "\" is neither \"next_use\" nor \"lru\""));
}

absl::Status CheckKvTierOptions(const KvTierOptions& o) {
  if (o.host_bytes < 0) return absl::InvalidArgumentError("kv.tiers.host_bytes must be >= 0");
  if (o.disk_bytes < 0) return absl::InvalidArgumentError("kv.tiers.disk_bytes must be >= 0");
  if (o.host_bytes > 0) {
    const int64_t avail = AvailableHostBytes();
    if (o.host_bytes > avail) {
      return absl::ResourceExhaustedError(absl::StrCat("kv.tiers.host_bytes: ", o.host_bytes,
                                                       " bytes asked for but ", avail,
                                                       " bytes of host memory are available"));
    }
  }
  if (o.disk_bytes > 0 && o.disk_dir.empty())
    return absl::InvalidArgumentError("kv.tiers.disk_bytes > 0 needs kv.tiers.disk_dir");
  if (o.disk_bytes == 0 && !o.disk_dir.empty())
    return absl::InvalidArgumentError("kv.tiers.disk_dir is set but kv.tiers.disk_bytes is 0 (tier off)");
  if (o.persist && o.disk_bytes == 0)
    return absl::InvalidArgumentError("kv.tiers.persist needs the disk tier (kv.tiers.disk_bytes > 0)");
  if (o.disk_bytes > 0) {
    std::error_code ec;
    fs::create_directories(o.disk_dir, ec);
    if (ec) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv.tiers.disk_dir: cannot create ", o.disk_dir, ": ", ec.message()));
    }
    struct statvfs sv;
    if (::statvfs(o.disk_dir.c_str(), &sv) != 0)
      return absl::InvalidArgumentError(absl::StrCat("kv.tiers.disk_dir: ", Errno("statvfs", o.disk_dir)));
    const int64_t free_bytes = static_cast<int64_t>(sv.f_bavail) * static_cast<int64_t>(sv.f_frsize);
    if (o.disk_bytes > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat("kv.tiers.disk_bytes: ", o.disk_bytes,
                                                       " bytes asked for but ", o.disk_dir, " has ",
                                                       free_bytes, " bytes free"));
    }
  }
  return absl::OkStatus();
}

KvTierStore::KvTierStore(const KvTierOptions& options, uint64_t fingerprint, int64_t block_bytes)
    : options_(options), fingerprint_(fingerprint), block_bytes_(block_bytes) {}

absl::StatusOr<std::unique_ptr<KvTierStore>> KvTierStore::Create(const KvTierOptions& options,
                                                                 uint64_t fingerprint, int64_t block_bytes) {
  TANDEM_CHECK(block_bytes >= 1);
  RETURN_IF_ERROR(CheckKvTierOptions(options));
  std::unique_ptr<KvTierStore> store(new KvTierStore(options, fingerprint, block_bytes));
  if (options.disk_bytes > 0) {
    RETURN_IF_ERROR(store->OpenDirectory());
    store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  }
  return store;
}

KvTierStore::~KvTierStore() {
  if (writer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }
  if (options_.disk_bytes > 0 && !options_.persist) {
    for (const auto& [hash, e] : disk_) ::unlink(FilePath(hash).c_str());
  }
}

std::string KvTierStore::FilePath(uint64_t hash) const {
  return absl::StrCat(options_.disk_dir, "/", absl::StrFormat("%016x", hash), kSuffix);
}

absl::Status KvTierStore::OpenDirectory() {
  std::error_code ec;
  std::vector<std::pair<fs::file_time_type, KvTierBlock>> found;
  int64_t refused[5] = {};  // by FileProblem
  for (const fs::directory_entry& entry : fs::directory_iterator(options_.disk_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const std::string path = entry.path().string();
    if (name.ends_with(".kvb.tmp")) {  // a write that never finished
      ::unlink(path.c_str());
      continue;
    }
    if (!name.ends_with(kSuffix)) continue;
    uint64_t hash = 0;
    if (name.size() != 16 + 4 || !absl::SimpleHexAtoi(name.substr(0, 16), &hash)) continue;
    if (!options_.persist) {
      ::unlink(path.c_str());
      continue;
    }
    KvTierBlock block;
    FileProblem problem = FileProblem::kNone;
    if (!ReadFile(path, hash, &block, {}, &problem).ok()) {
      ::unlink(path.c_str());
      ++refused[static_cast<int>(problem)];
      ++stats_.discarded;
      continue;
    }
    found.emplace_back(entry.last_write_time(ec), std::move(block));
  }
  if (ec)
    return absl::InvalidArgumentError(
        absl::StrCat("kv.tiers.disk_dir: ", options_.disk_dir, ": ", ec.message()));
  if (stats_.discarded > 0) {
    TANDEM_LOG_WARN("kv-tiers", "disk tier ", options_.disk_dir, ": discarded ", stats_.discarded,
                    " block files (", refused[static_cast<int>(FileProblem::kTruncated)], " truncated, ",
                    refused[static_cast<int>(FileProblem::kCorrupt)] + refused[0], " corrupt, ",
                    refused[static_cast<int>(FileProblem::kVersion)], " of another format version, ",
                    refused[static_cast<int>(FileProblem::kModel)], " of another model or KV shape)");
  }
  // Oldest first in the LRU; over the budget, the oldest go.
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  int64_t total = 0;
  for (const auto& [time, block] : found) total += FileBytes(block);
  size_t first = 0;
  for (; first < found.size() && total > options_.disk_bytes; ++first) {
    total -= FileBytes(found[first].second);
    ::unlink(FilePath(found[first].second.hash).c_str());
  }
  found.erase(found.begin(), found.begin() + static_cast<std::ptrdiff_t>(first));
  for (const auto& [time, block] : found) {
    DiskEntry& e = disk_[block.hash];
    e.file_bytes = FileBytes(block);
    disk_order_.Insert(block.hash, -1);
    disk_used_ += e.file_bytes;
  }
  for (auto& [time, block] : found) persisted_.push_back(std::move(block));
  std::stable_sort(persisted_.begin(), persisted_.end(),
                   [](const KvTierBlock& a, const KvTierBlock& b) { return a.depth < b.depth; });
  stats_.disk_blocks = static_cast<int64_t>(disk_.size());
  stats_.reindexed = static_cast<int64_t>(disk_.size());
  if (options_.persist) {
    TANDEM_LOG_INFO("kv-tiers", "disk tier ", options_.disk_dir, ": ", disk_.size(), " blocks re-indexed");
  }
  return absl::OkStatus();
}

void KvTierStore::Save(const KvTierBlock& block, std::span<const uint8_t> bytes) {
  TANDEM_CHECK(static_cast<int64_t>(bytes.size()) == block_bytes_);
  TANDEM_CHECK(static_cast<int64_t>(block.tokens.size()) <= kKvBlockMaxTokens);
  std::lock_guard<std::mutex> lock(mu_);
  ++stats_.saves;
  std::shared_ptr<const std::vector<uint8_t>> copy;
  auto it = host_.find(block.hash);
  if (it != host_.end()) {
    host_order_.Touch(block.hash);
    copy = it->second.bytes;
  } else if (block_bytes_ <= options_.host_bytes) {
    // An evicted copy that nothing else holds (no load in flight, no queued write) is reused for
    // the new block: a fresh allocation of a block's size page-faults on every page as it is
    // filled, which on a GPU pool costs more than the device-to-host copy itself.
    std::shared_ptr<std::vector<uint8_t>> reuse;
    const int32_t use = NextUseLocked(block.hash);
    bool keep = true;
    while (static_cast<int64_t>(host_.size() + 1) * block_bytes_ > options_.host_bytes) {
      ++stats_.host_evictions;
      if (!host_order_.Keeps(use)) {  // it would be the first to go: every block held is needed sooner
        keep = false;
        break;
      }
      const uint64_t victim = host_order_.Victim();
      host_order_.Erase(victim);
      auto gone = host_.find(victim);
      if (!reuse && gone->second.bytes.use_count() == 1)
        reuse = std::const_pointer_cast<std::vector<uint8_t>>(gone->second.bytes);
      host_.erase(gone);
    }
    if (keep && reuse) {
      std::copy(bytes.begin(), bytes.end(), reuse->begin());
      copy = std::move(reuse);
    } else if (keep) {
      copy = std::make_shared<std::vector<uint8_t>>(bytes.begin(), bytes.end());
    }
    if (keep) {
      HostEntry& e = host_[block.hash];
      e.block = block;
      e.bytes = copy;
      host_order_.Insert(block.hash, use);
      stats_.bytes_to_host += block_bytes_;
    }
  }
  stats_.host_blocks = static_cast<int64_t>(host_.size());
  if (options_.disk_bytes == 0) return;
  if (disk_.contains(block.hash)) {
    disk_order_.Touch(block.hash);
    return;
  }
  if (queued_.contains(block.hash)) return;
  if (FileBytes(block) > options_.disk_bytes) {
    // Refused now, not by the writer: a queued copy would serve loads (Load) that this tier can
    // never keep.
    NoteWriteErrorLocked(block.hash,
                         absl::ResourceExhaustedError("the block is larger than kv.tiers.disk_bytes"));
    return;
  }
  if (!copy) copy = std::make_shared<std::vector<uint8_t>>(bytes.begin(), bytes.end());
  queue_.push_back({block, std::move(copy)});
  queued_.emplace(block.hash, queue_.back());
  cv_.notify_all();
}

void KvTierStore::DropDiskLocked(uint64_t hash, bool count_eviction) {
  auto it = disk_.find(hash);
  if (it == disk_.end()) return;
  disk_order_.Erase(hash);
  disk_used_ -= it->second.file_bytes;
  disk_.erase(it);
  ::unlink(FilePath(hash).c_str());
  if (count_eviction) ++stats_.disk_evictions;
  stats_.disk_blocks = static_cast<int64_t>(disk_.size());
}

void KvTierStore::WriterLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    Write w = std::move(queue_.front());
    queue_.pop_front();
    const int64_t file_bytes = FileBytes(w.block);  // <= disk_bytes: Save refuses larger blocks
    const int32_t use = NextUseLocked(w.block.hash);
    bool keep = true;
    while (disk_used_ + file_bytes > options_.disk_bytes) {
      if (!disk_order_.Keeps(use)) {  // every file held is needed sooner: this block is not written
        ++stats_.disk_evictions;
        keep = false;
        break;
      }
      DropDiskLocked(disk_order_.Victim(), true);
    }
    if (!keep) {
      queued_.erase(w.block.hash);
      cv_.notify_all();
      continue;
    }
    writing_ = true;
    lock.unlock();
    absl::Status st = WriteFile(w);
    lock.lock();
    writing_ = false;
    queued_.erase(w.block.hash);
    if (st.ok()) {
      DiskEntry& e = disk_[w.block.hash];
      e.file_bytes = file_bytes;
      disk_order_.Insert(w.block.hash, NextUseLocked(w.block.hash));
      disk_used_ += file_bytes;
      stats_.bytes_to_disk += file_bytes;
      stats_.disk_blocks = static_cast<int64_t>(disk_.size());
    } else {
      NoteWriteErrorLocked(w.block.hash, st);
    }
    cv_.notify_all();
  }
}

void KvTierStore::NoteWriteErrorLocked(uint64_t hash, const absl::Status& why) {
  ++stats_.write_errors;
  if (!warned_write_) {
    TANDEM_LOG_WARN("kv-tiers", "disk tier: block ", absl::StrFormat("%016x", hash),
                    " not saved: ", why.message(), " (further write errors are counted, not logged)");
    warned_write_ = true;
  }
}

absl::Status KvTierStore::WriteFile(const Write& w) const {
  const std::string path = FilePath(w.block.hash);
  const std::string tmp = path + ".tmp";
  const std::vector<int32_t>& tokens = w.block.tokens;
  std::vector<uint8_t> head(kKvBlockHeaderBytes + 4 * tokens.size(), 0);
  uint8_t* h = head.data();
  for (size_t i = 0; i < tokens.size(); ++i)
    Put32(h + kKvBlockHeaderBytes + 4 * i, static_cast<uint32_t>(tokens[i]));
  Put32(h, kMagic);
  Put16(h + 4, kKvBlockFileVersion);
  Put16(h + 6, static_cast<uint16_t>(kKvBlockHeaderBytes));
  Put64(h + 8, fingerprint_);
  Put64(h + 16, w.block.hash);
  Put64(h + 24, w.block.parent_hash);
  Put32(h + 32, static_cast<uint32_t>(w.block.depth));
  Put32(h + 36, Crc32c(*w.bytes));
  Put64(h + 40, static_cast<uint64_t>(block_bytes_));
  Put32(h + 48, static_cast<uint32_t>(tokens.size()));
  Put32(h + 52, tokens.empty() ? 0 : Crc32c({h + kKvBlockHeaderBytes, 4 * tokens.size()}));
  Put32(h + 60, Crc32c({h, 60}));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::UnavailableError(Errno("cannot create", tmp));
  const bool ok = WriteAll(fd, head.data(), head.size()) && WriteAll(fd, w.bytes->data(), w.bytes->size());
  const std::string why = ok ? "" : Errno("cannot write", tmp);
  if (::close(fd) != 0 || !ok) {
    ::unlink(tmp.c_str());
    return absl::UnavailableError(ok ? Errno("cannot close", tmp) : why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string err = Errno("cannot rename", tmp);
    ::unlink(tmp.c_str());
    return absl::UnavailableError(err);
  }
  return absl::OkStatus();
}

absl::Status KvTierStore::ReadFile(const std::string& path, uint64_t expect_hash, KvTierBlock* block,
                                   std::span<uint8_t> out, FileProblem* problem) const {
  FileProblem unused;
  if (problem == nullptr) problem = &unused;
  *problem = FileProblem::kNone;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(Errno("cannot open", path));
  uint8_t h[kKvBlockHeaderBytes];
  absl::Status st;
  auto fail = [&](FileProblem p, const std::string& why) {
    *problem = p;
    st = absl::DataLossError(why);
  };
  struct stat sb;
  if (::fstat(fd, &sb) != 0) {
    fail(FileProblem::kCorrupt, Errno("cannot stat", path));
  } else if (!ReadAll(fd, h, sizeof(h))) {
    fail(FileProblem::kTruncated, "truncated header");
  } else if (Get(h, 4) != kMagic) {
    fail(FileProblem::kCorrupt, "not a KV block file (magic)");
  } else if (Get(h + 4, 2) != kKvBlockFileVersion || Get(h + 6, 2) != kKvBlockHeaderBytes) {
    fail(FileProblem::kVersion,
         absl::StrCat("format version ", Get(h + 4, 2), ", this build reads ", kKvBlockFileVersion));
  } else if (Get(h + 60, 4) != Crc32c({h, 60})) {
    fail(FileProblem::kCorrupt, "header checksum mismatch");
  } else if (Get(h + 8, 8) != fingerprint_) {
    fail(FileProblem::kModel, "written for another model or KV shape (fingerprint)");
  } else if (Get(h + 16, 8) != expect_hash) {
    fail(FileProblem::kCorrupt, "holds another block (hash)");
  } else if (Get(h + 40, 8) != static_cast<uint64_t>(block_bytes_) ||
             static_cast<int32_t>(Get(h + 32, 4)) < 1 ||
             Get(h + 48, 4) > static_cast<uint64_t>(kKvBlockMaxTokens)) {
    fail(FileProblem::kCorrupt, "bad payload size, depth or token count");
  } else {
    const size_t token_count = static_cast<size_t>(Get(h + 48, 4));
    const off_t want =
        static_cast<off_t>(kKvBlockHeaderBytes + 4 * token_count) + static_cast<off_t>(block_bytes_);
    std::vector<uint8_t> raw(4 * token_count);
    if (sb.st_size != want) {
      fail(sb.st_size < want ? FileProblem::kTruncated : FileProblem::kCorrupt,
           absl::StrCat("size ", sb.st_size, " bytes, expected ", want));
    } else if (!ReadAll(fd, raw.data(), raw.size())) {
      fail(FileProblem::kTruncated, "truncated tokens");
    } else if (!raw.empty() && Crc32c(raw) != static_cast<uint32_t>(Get(h + 52, 4))) {
      fail(FileProblem::kCorrupt, "token checksum mismatch");
    } else {
      block->hash = expect_hash;
      block->parent_hash = Get(h + 24, 8);
      block->depth = static_cast<int32_t>(Get(h + 32, 4));
      block->tokens.resize(token_count);
      for (size_t i = 0; i < token_count; ++i)
        block->tokens[i] = static_cast<int32_t>(static_cast<uint32_t>(Get(raw.data() + 4 * i, 4)));
      if (!out.empty()) {
        if (!ReadAll(fd, out.data(), out.size())) {
          fail(FileProblem::kTruncated, "truncated payload");
        } else if (Crc32c(out) != static_cast<uint32_t>(Get(h + 36, 4))) {
          fail(FileProblem::kCorrupt, "payload checksum mismatch");
        }
      }
    }
  }
  ::close(fd);
  return st;
}

absl::StatusOr<int> KvTierStore::Load(uint64_t hash, KvTierBlock* block, std::span<uint8_t> out) {
  TANDEM_CHECK(static_cast<int64_t>(out.size()) == block_bytes_);
  std::shared_ptr<const std::vector<uint8_t>> bytes;
  ASSIGN_OR_RETURN(const int tier, LoadShared(hash, block, &bytes));
  std::memcpy(out.data(), bytes->data(), out.size());
  return tier;
}

absl::StatusOr<int> KvTierStore::LoadShared(uint64_t hash, KvTierBlock* block,
                                            std::shared_ptr<const std::vector<uint8_t>>* out) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = host_.find(hash);
    if (it != host_.end()) {
      // Host copies were checked when made and never leave this process's memory.
      *out = it->second.bytes;
      *block = it->second.block;
      host_order_.Touch(hash);
      ++stats_.host_hits;
      stats_.bytes_from_host += block_bytes_;
      return 1;
    }
    if (auto q = queued_.find(hash); q != queued_.end()) {
      // On its way to disk: the queued copy is the one that will be written (checked when made).
      *out = q->second.bytes;
      *block = q->second.block;
      ++stats_.host_hits;
      stats_.bytes_from_host += block_bytes_;
      return 1;
    }
    auto d = disk_.find(hash);
    if (d == disk_.end()) {
      ++stats_.misses;
      return absl::NotFoundError(absl::StrFormat("block %016x is in no KV tier", hash));
    }
    disk_order_.Touch(hash);
  }
  const std::string path = FilePath(hash);
  auto read = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(block_bytes_));
  const absl::Status st = ReadFile(path, hash, block, *read);
  *out = std::move(read);
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    TANDEM_LOG_WARN("kv-tiers", "discarding ", path, ": ", st.message(), "; its tokens are recomputed");
    ++stats_.discarded;
    DropDiskLocked(hash, false);
    return absl::NotFoundError(absl::StrCat(path, ": ", st.message()));
  }
  ++stats_.disk_hits;
  stats_.bytes_from_disk += FileBytes(*block);
  return 2;
}

bool KvTierStore::Contains(uint64_t hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_.contains(hash) || queued_.contains(hash) || disk_.contains(hash);
}

void KvTierStore::SetNextUse(std::span<const KvTierNextUse> uses) {
  if (options_.eviction == KvTierEviction::kLru) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [hash, use] : next_use_) {
    host_order_.SetNextUse(hash, -1);
    disk_order_.SetNextUse(hash, -1);
  }
  next_use_.clear();
  for (const KvTierNextUse& u : uses) {
    if (u.next_use < 0) continue;
    auto [it, added] = next_use_.emplace(u.hash, u.next_use);
    if (!added) it->second = std::min(it->second, u.next_use);
  }
  for (const auto& [hash, use] : next_use_) {
    host_order_.SetNextUse(hash, use);
    disk_order_.SetNextUse(hash, use);
  }
}

int32_t KvTierStore::NextUseLocked(uint64_t hash) const {
  auto it = next_use_.find(hash);
  return it == next_use_.end() ? -1 : it->second;
}

bool KvTierStore::InHost(uint64_t hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  return host_.contains(hash);
}

bool KvTierStore::OnDisk(uint64_t hash) const {
  std::lock_guard<std::mutex> lock(mu_);
  return disk_.contains(hash);
}

KvTierStats KvTierStore::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void KvTierStore::Flush() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !writing_; });
}

}  // namespace tandem
