#include "compute_node/prefix_index.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

absl::StatusOr<PrefixOptions> ResolvePrefixOptions(bool prefix_cache, int64_t block_tokens,
                                                   std::string_view sharing) {
  if (block_tokens < 1 || block_tokens > 4096)
    return absl::InvalidArgumentError(
        absl::StrCat("kv.prefix_block_tokens must be in [1, 4096], got ", block_tokens));
  PrefixOptions options;
  options.block_tokens = prefix_cache ? block_tokens : 0;
  if (sharing == "off") {
    options.sharing = PrefixSharing::kOff;
  } else if (sharing == "on" || sharing == "auto") {
    if (!prefix_cache && sharing == "on")
      return absl::InvalidArgumentError("kv.prefix_sharing: on needs kv.prefix_cache: true");
    options.sharing = !prefix_cache     ? PrefixSharing::kOff
                      : sharing == "on" ? PrefixSharing::kOn
                                        : PrefixSharing::kAuto;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("kv.prefix_sharing: expected auto, on or off, got \"", ToAbsl(sharing), "\""));
  }
  return options;
}
namespace {

// splitmix64's finaliser: a bijection on 64 bits with full avalanche.
uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t DefaultBlockHash(uint64_t parent_hash, std::span<const int32_t> tokens) {
  // FNV-1a structure (xor the input in, then scramble), with Mix64 instead of the FNV multiply.
  uint64_t h = parent_hash;
  for (int32_t t : tokens) h = Mix64(h ^ static_cast<uint32_t>(t));
  return Mix64(h ^ (static_cast<uint64_t>(tokens.size()) << 32));
}

PrefixIndex::PrefixIndex(int64_t block_tokens, BlockHashFn hash, int64_t max_demoted)
    : block_tokens_(block_tokens), hash_(hash), max_demoted_(max_demoted) {
  TANDEM_CHECK(hash_ != nullptr);
  TANDEM_CHECK_MSG(block_tokens_ >= 1, "block_tokens ", block_tokens_);
}

int32_t PrefixIndex::FindHash(uint64_t hash) const {
  auto it = by_hash_.find(hash);
  return it == by_hash_.end() ? -1 : it->second;
}

void PrefixIndex::Touch(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  b.last_used = ++tick_;
  lru_.splice(lru_.end(), lru_, b.lru_it);
}

std::vector<int32_t> PrefixIndex::Match(std::span<const int32_t> tokens, int64_t max_blocks) const {
  std::vector<int32_t> ids;
  const size_t bt = static_cast<size_t>(block_tokens_);
  uint64_t hash = kSeed;
  int32_t parent = -1;
  for (size_t start = 0; start + bt <= tokens.size() && static_cast<int64_t>(ids.size()) < max_blocks;
       start += bt) {
    const std::span<const int32_t> block = tokens.subspan(start, bt);
    hash = hash_(hash, block);
    const int32_t id = FindHash(hash);
    if (id < 0) break;
    const Block& b = blocks_[static_cast<size_t>(id)];
    // The hash only picks the candidate: the prefix must really be equal.
    if (b.parent != parent || !std::equal(b.tokens.begin(), b.tokens.end(), block.begin(), block.end()))
      break;
    ids.push_back(id);
    parent = id;
  }
  return ids;
}

void PrefixIndex::Acquire(std::span<const int32_t> blocks) {
  for (int32_t id : blocks) {
    Block& b = blocks_[static_cast<size_t>(id)];
    TANDEM_CHECK(b.live);
    if (b.users++ == 0) --unused_blocks_;
    Touch(id);
  }
}

void PrefixIndex::Release(std::span<const int32_t> blocks) {
  for (int32_t id : blocks) {
    Block& b = blocks_[static_cast<size_t>(id)];
    TANDEM_CHECK_MSG(b.live && b.users > 0, "PrefixIndex::Release of block ", id, " without users");
    if (--b.users == 0) ++unused_blocks_;
  }
}

int32_t PrefixIndex::Insert(std::span<const int32_t> tokens, int64_t index, int32_t parent) {
  const size_t bt = static_cast<size_t>(block_tokens_);
  TANDEM_CHECK_MSG(tokens.size() >= (static_cast<size_t>(index) + 1) * bt, "Insert: block ", index, " of ",
                   tokens.size(), " tokens");
  TANDEM_CHECK((index == 0) == (parent < 0));
  TANDEM_CHECK(parent < 0 ||
               (static_cast<size_t>(parent) < blocks_.size() && blocks_[static_cast<size_t>(parent)].live));
  const uint64_t parent_hash = parent < 0 ? kSeed : blocks_[static_cast<size_t>(parent)].hash;
  const std::span<const int32_t> block = tokens.subspan(static_cast<size_t>(index) * bt, bt);
  const uint64_t hash = hash_(parent_hash, block);
  // Registered already (equal prefix), or a collision with a different prefix: either way the hash
  // is taken, and a second block under it would make the wire name ambiguous.
  // 0 is never a block's name: the plan uses attach_hash 0 for "attaches nothing".
  if (hash == 0) return -1;
  if (const int32_t found = FindHash(hash); found >= 0) {
    Block& d = blocks_[static_cast<size_t>(found)];
    // A demoted copy of the same prefix: the request's fresh KV makes it resident again.
    if (d.resident || d.parent != parent || d.users != 0 ||
        !std::equal(d.tokens.begin(), d.tokens.end(), block.begin(), block.end()))
      return -1;
    MarkRestored(found);
    Touch(found);
    return found;
  }
  const int32_t id = NewBlock(hash, parent, block, /*resident=*/true);
  if (parent >= 0) ++blocks_[static_cast<size_t>(parent)].resident_children;
  ++unused_blocks_;
  stats_.tokens_held += block_tokens_;
  return id;
}

int32_t PrefixIndex::NewBlock(uint64_t hash, int32_t parent, std::span<const int32_t> tokens, bool resident) {
  int32_t id;
  if (free_ids_.empty()) {
    id = static_cast<int32_t>(blocks_.size());
    blocks_.emplace_back();
  } else {
    id = free_ids_.back();
    free_ids_.pop_back();
  }
  Block& b = blocks_[static_cast<size_t>(id)];
  b.hash = hash;
  b.parent = parent;
  b.num_children = 0;
  b.resident_children = 0;
  b.users = 0;
  b.live = true;
  b.resident = resident;
  b.tokens.assign(tokens.begin(), tokens.end());
  b.last_used = ++tick_;
  b.lru_it = lru_.insert(lru_.end(), id);
  by_hash_.emplace(hash, id);
  if (content_lookup_) {
    by_anchor_.emplace(AnchorHash(b.tokens), id);
    by_parent_.emplace(parent, id);
  }
  if (parent >= 0) ++blocks_[static_cast<size_t>(parent)].num_children;
  ++stats_.blocks;
  return id;
}

void PrefixIndex::Remove(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  TANDEM_CHECK(b.users == 0 && b.num_children == 0);
  by_hash_.erase(b.hash);
  if (content_lookup_) {
    const auto erase = [id](auto& map, auto key) {
      auto [first, last] = map.equal_range(key);
      for (auto it = first; it != last; ++it) {
        if (it->second == id) {
          map.erase(it);
          return;
        }
      }
    };
    erase(by_anchor_, AnchorHash(b.tokens));
    erase(by_parent_, b.parent);
  }
  if (b.parent >= 0) {
    --blocks_[static_cast<size_t>(b.parent)].num_children;
    if (b.resident) --blocks_[static_cast<size_t>(b.parent)].resident_children;
  }
  lru_.erase(b.lru_it);
  b.live = false;
  b.tokens.clear();
  free_ids_.push_back(id);
  --stats_.blocks;
  if (b.resident) {
    --unused_blocks_;
    stats_.tokens_held -= block_tokens_;
  } else {
    --stats_.demoted;
  }
}

void PrefixIndex::MarkRestored(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  TANDEM_CHECK(b.live && !b.resident);
  TANDEM_CHECK(b.parent < 0 || blocks_[static_cast<size_t>(b.parent)].resident);
  b.resident = true;
  if (b.parent >= 0) ++blocks_[static_cast<size_t>(b.parent)].resident_children;
  if (b.users == 0) ++unused_blocks_;
  stats_.tokens_held += block_tokens_;
  --stats_.demoted;
}

void PrefixIndex::Forget(int32_t id) {
  // Children first (depth-first over the blocks whose parent is `id`).
  for (size_t c = 0; c < blocks_.size() && blocks_[static_cast<size_t>(id)].num_children > 0; ++c) {
    if (blocks_[c].live && blocks_[c].parent == id) Forget(static_cast<int32_t>(c));
  }
  Remove(id);
}

void PrefixIndex::TrimDemoted(const std::vector<char>& keep) {
  if (!keep.empty() && demoted_wanted_last_) TrimDemotedPass(keep);
  TrimDemotedPass({});
}

void PrefixIndex::TrimDemotedPass(const std::vector<char>& keep) {
  auto kept = [&](int32_t id) {
    return !keep.empty() && static_cast<size_t>(id) < keep.size() && keep[static_cast<size_t>(id)] != 0;
  };
  auto it = lru_.begin();
  while (stats_.demoted > max_demoted_ && it != lru_.end()) {
    const Block& b = blocks_[static_cast<size_t>(*it)];
    if (b.resident || b.num_children != 0 || b.users != 0 || kept(*it)) {
      ++it;
      continue;
    }
    const int32_t id = *it;
    const int32_t parent = b.parent;
    it = std::next(it);
    Remove(id);
    // Its parent may have become a demoted leaf: look at it again from the start.
    if (parent >= 0 && !blocks_[static_cast<size_t>(parent)].resident) it = lru_.begin();
  }
}

int32_t PrefixIndex::AddDemoted(uint64_t hash, uint64_t parent_hash, std::span<const int32_t> tokens) {
  if (max_demoted_ == 0 || hash == 0 || static_cast<int64_t>(tokens.size()) != block_tokens_ ||
      FindHash(hash) >= 0 || hash_(parent_hash, tokens) != hash)
    return -1;
  const int32_t parent = parent_hash == kSeed ? -1 : FindHash(parent_hash);
  if (parent_hash != kSeed && parent < 0) return -1;
  NewBlock(hash, parent, tokens, /*resident=*/false);
  ++stats_.demoted;
  TrimDemoted({});
  return FindHash(hash);
}

int64_t PrefixIndex::Evict(int64_t need, std::vector<uint64_t>* evicted,
                           std::vector<std::vector<int32_t>>* evicted_tokens,
                           std::span<const int32_t> wanted) {
  int64_t freed = 0;
  std::vector<char> keep;
  if (!wanted.empty()) {
    keep.assign(blocks_.size(), 0);
    for (const int32_t id : wanted) {
      if (id >= 0 && static_cast<size_t>(id) < keep.size()) keep[static_cast<size_t>(id)] = 1;
    }
    EvictPass(need, keep, &freed, evicted, evicted_tokens);
  }
  EvictPass(need, {}, &freed, evicted, evicted_tokens);
  if (max_demoted_ > 0) TrimDemoted(keep);
  return freed;
}

int64_t PrefixIndex::EvictExcept(int64_t need, std::span<const int32_t> keep, std::vector<uint64_t>* evicted,
                                 std::vector<std::vector<int32_t>>* evicted_tokens) {
  int64_t freed = 0;
  std::vector<char> kept(blocks_.size(), 0);
  for (const int32_t id : keep) {
    if (id >= 0 && static_cast<size_t>(id) < kept.size()) kept[static_cast<size_t>(id)] = 1;
  }
  EvictPass(need, kept, &freed, evicted, evicted_tokens);
  if (max_demoted_ > 0) TrimDemoted(kept);
  return freed;
}

void PrefixIndex::EvictPass(int64_t need, const std::vector<char>& keep, int64_t* freed_out,
                            std::vector<uint64_t>* evicted,
                            std::vector<std::vector<int32_t>>* evicted_tokens) {
  int64_t freed = *freed_out;
  // One pass from least to most recently used. Blocks behind the cursor were not evictable and
  // stay so, except the parent of a block just evicted, which may have become a leaf: the scan
  // resumes there if it lies behind the cursor (less recently used).
  auto kept = [&](int32_t id) { return !keep.empty() && keep[static_cast<size_t>(id)] != 0; };
  auto it = lru_.begin();
  while (freed < need && it != lru_.end()) {
    const int32_t id = *it;
    const Block& b = blocks_[static_cast<size_t>(id)];
    if (!b.resident || b.users != 0 || b.resident_children != 0 || kept(id)) {
      ++it;
      continue;
    }
    const int32_t parent = b.parent;
    it = std::next(it);
    evicted->push_back(b.hash);
    if (evicted_tokens != nullptr) evicted_tokens->push_back(b.tokens);
    if (max_demoted_ > 0) {
      Block& d = blocks_[static_cast<size_t>(id)];
      d.resident = false;
      if (parent >= 0) --blocks_[static_cast<size_t>(parent)].resident_children;
      --unused_blocks_;
      stats_.tokens_held -= block_tokens_;
      ++stats_.demoted;
    } else {
      Remove(id);
    }
    ++stats_.evictions;
    freed += block_tokens_;
    if (parent >= 0) {
      const Block& p = blocks_[static_cast<size_t>(parent)];
      if (p.resident && p.resident_children == 0 && p.users == 0 && !kept(parent) &&
          (it == lru_.end() || p.last_used < blocks_[static_cast<size_t>(*it)].last_used)) {
        it = p.lru_it;
      }
    }
  }
  *freed_out = freed;
}

void PrefixIndex::CountLookup(int64_t prompt_tokens, int64_t matched_tokens) {
  stats_.looked_up_tokens += prompt_tokens;
  stats_.matched_tokens += matched_tokens;
}

uint64_t PrefixIndex::AnchorHash(std::span<const int32_t> tokens) const {
  return DefaultBlockHash(kSeed, tokens.first(static_cast<size_t>(anchor_tokens())));
}

std::vector<int32_t> PrefixIndex::WithAnchor(std::span<const int32_t> tokens) const {
  std::vector<int32_t> ids;
  const size_t k = static_cast<size_t>(anchor_tokens());
  if (!content_lookup_ || tokens.size() < k) return ids;
  auto [first, last] = by_anchor_.equal_range(AnchorHash(tokens));
  for (auto it = first; it != last; ++it) {
    const std::vector<int32_t>& t = blocks_[static_cast<size_t>(it->second)].tokens;
    if (std::equal(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(k), tokens.begin()))
      ids.push_back(it->second);
  }
  std::sort(ids.begin(), ids.end());  // an order that does not depend on the hash table's
  return ids;
}

std::vector<int32_t> PrefixIndex::Children(int32_t id) const {
  std::vector<int32_t> ids;
  auto [first, last] = by_parent_.equal_range(id);
  for (auto it = first; it != last; ++it) ids.push_back(it->second);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace tandem
