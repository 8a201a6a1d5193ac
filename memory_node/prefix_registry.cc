#include "memory_node/prefix_registry.h"

#include <algorithm>
#include <iterator>

#include "common/status.h"

namespace tandem {
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

PrefixRegistry::PrefixRegistry(KvSlotAllocator* allocator, int64_t block_tokens, BlockHashFn hash)
    : allocator_(allocator), block_tokens_(block_tokens), hash_(hash) {
  TANDEM_CHECK(allocator_ != nullptr && hash_ != nullptr);
  TANDEM_CHECK_MSG(block_tokens_ >= 1, "block_tokens ", block_tokens_);
}

PrefixRegistry::~PrefixRegistry() { Clear(); }

int32_t PrefixRegistry::Find(uint64_t hash, int32_t parent, std::span<const int32_t> tokens) const {
  auto it = buckets_.find(hash);
  if (it == buckets_.end()) return -1;
  for (int32_t id : it->second) {
    const Block& b = blocks_[static_cast<size_t>(id)];
    if (b.parent == parent && std::equal(b.tokens.begin(), b.tokens.end(), tokens.begin(), tokens.end())) {
      return id;
    }
  }
  return -1;
}

void PrefixRegistry::Touch(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  b.last_used = ++tick_;
  lru_.splice(lru_.end(), lru_, b.lru_it);
}

PrefixRegistry::MatchResult PrefixRegistry::Match(std::span<const int32_t> tokens) {
  MatchResult result;
  stats_.looked_up_tokens += static_cast<int64_t>(tokens.size());
  const size_t bt = static_cast<size_t>(block_tokens_);
  uint64_t hash = kSeed;
  int32_t parent = -1;
  for (size_t start = 0; start + bt <= tokens.size(); start += bt) {
    const std::span<const int32_t> block = tokens.subspan(start, bt);
    hash = hash_(hash, block);
    const int32_t id = Find(hash, parent, block);
    if (id < 0) break;
    Touch(id);
    const Block& b = blocks_[static_cast<size_t>(id)];
    result.slots.insert(result.slots.end(), b.slots.begin(), b.slots.end());
    parent = id;
  }
  result.num_tokens = static_cast<int64_t>(result.slots.size());
  allocator_->Retain(result.slots);
  stats_.matched_tokens += result.num_tokens;
  return result;
}

int64_t PrefixRegistry::Insert(std::span<const int32_t> tokens, std::span<const int32_t> slots) {
  const size_t bt = static_cast<size_t>(block_tokens_);
  const size_t full = tokens.size() / bt * bt;
  TANDEM_CHECK_MSG(slots.size() >= full, "Insert: ", slots.size(), " slots for ", full, " tokens");
  int64_t added = 0;
  uint64_t hash = kSeed;
  int32_t parent = -1;
  for (size_t start = 0; start < full; start += bt) {
    const std::span<const int32_t> block = tokens.subspan(start, bt);
    hash = hash_(hash, block);
    int32_t id = Find(hash, parent, block);
    if (id < 0) {
      const std::span<const int32_t> block_slots = slots.subspan(start, bt);
      allocator_->Retain(block_slots);  // checks that the slots are allocated
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
      b.live = true;
      b.tokens.assign(block.begin(), block.end());
      b.slots.assign(block_slots.begin(), block_slots.end());
      b.last_used = ++tick_;
      b.lru_it = lru_.insert(lru_.end(), id);
      buckets_[hash].push_back(id);
      if (parent >= 0) ++blocks_[static_cast<size_t>(parent)].num_children;
      ++stats_.blocks;
      stats_.tokens_held += block_tokens_;
      ++added;
    } else {
      Touch(id);
    }
    parent = id;
  }
  return added;
}

bool PrefixRegistry::Evictable(const Block& b) const {
  if (b.num_children != 0) return false;
  return std::all_of(b.slots.begin(), b.slots.end(),
                     [this](int32_t s) { return allocator_->refcount(s) == 1; });
}

void PrefixRegistry::Remove(int32_t id) {
  Block& b = blocks_[static_cast<size_t>(id)];
  auto bucket = buckets_.find(b.hash);
  TANDEM_CHECK(bucket != buckets_.end());
  std::erase(bucket->second, id);
  if (bucket->second.empty()) buckets_.erase(bucket);
  if (b.parent >= 0) --blocks_[static_cast<size_t>(b.parent)].num_children;
  lru_.erase(b.lru_it);
  allocator_->Release(b.slots);
  b.live = false;
  b.tokens.clear();
  b.slots.clear();
  free_ids_.push_back(id);
  --stats_.blocks;
  stats_.tokens_held -= block_tokens_;
}

int64_t PrefixRegistry::EvictUntilFree(int64_t need) {
  const int64_t free_before = allocator_->num_free();
  // One pass from least to most recently used. Blocks behind the cursor were not evictable and
  // stay so, except the parent of a block just evicted, which may have become a leaf: if it lies
  // behind the cursor (less recent), the scan resumes there.
  auto it = lru_.begin();
  while (allocator_->num_free() < need && it != lru_.end()) {
    const int32_t id = *it;
    const Block& b = blocks_[static_cast<size_t>(id)];
    if (!Evictable(b)) {
      ++it;
      continue;
    }
    const int32_t parent = b.parent;
    it = std::next(it);
    Remove(id);
    ++stats_.evictions;
    if (parent >= 0) {
      const Block& p = blocks_[static_cast<size_t>(parent)];
      if (p.num_children == 0 &&
          (it == lru_.end() || p.last_used < blocks_[static_cast<size_t>(*it)].last_used)) {
        it = p.lru_it;
      }
    }
  }
  return allocator_->num_free() - free_before;
}

std::vector<int32_t> PrefixRegistry::HeldSlots() const {
  std::vector<int32_t> held;
  for (const Block& b : blocks_) {
    if (b.live) held.insert(held.end(), b.slots.begin(), b.slots.end());
  }
  return held;
}

void PrefixRegistry::Clear() {
  for (Block& b : blocks_) {
    if (b.live) allocator_->Release(b.slots);
  }
  blocks_.clear();
  free_ids_.clear();
  buckets_.clear();
  lru_.clear();
  stats_.blocks = 0;
  stats_.tokens_held = 0;
}

}  // namespace tandem
