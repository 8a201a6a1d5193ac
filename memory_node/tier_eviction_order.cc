#include "memory_node/tier_eviction_order.h"

#include "common/status.h"

namespace tandem {

void TierEvictionOrder::Place(uint64_t hash, const Entry& e) {
  if (e.next_use < 0) {
    unwanted_.emplace(e.tick, hash);
  } else {
    wanted_.emplace(-e.next_use, e.tick, hash);
  }
}

void TierEvictionOrder::Unplace(uint64_t hash, const Entry& e) {
  if (e.next_use < 0) {
    unwanted_.erase({e.tick, hash});
  } else {
    wanted_.erase({-e.next_use, e.tick, hash});
  }
}

void TierEvictionOrder::Insert(uint64_t hash, int32_t next_use) {
  const Entry e{.tick = ++tick_, .next_use = next_use < 0 ? -1 : next_use};
  const bool added = entries_.emplace(hash, e).second;
  TANDEM_CHECK(added);
  Place(hash, e);
}

void TierEvictionOrder::Touch(uint64_t hash) {
  auto it = entries_.find(hash);
  TANDEM_CHECK(it != entries_.end());
  Unplace(hash, it->second);
  it->second.tick = ++tick_;
  Place(hash, it->second);
}

void TierEvictionOrder::Erase(uint64_t hash) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  Unplace(hash, it->second);
  entries_.erase(it);
}

void TierEvictionOrder::SetNextUse(uint64_t hash, int32_t next_use) {
  auto it = entries_.find(hash);
  if (it == entries_.end()) return;
  next_use = next_use < 0 ? -1 : next_use;
  if (it->second.next_use == next_use) return;
  Unplace(hash, it->second);
  it->second.next_use = next_use;
  Place(hash, it->second);
}

uint64_t TierEvictionOrder::Victim() const {
  TANDEM_CHECK(!entries_.empty());
  return unwanted_.empty() ? std::get<2>(*wanted_.begin()) : unwanted_.begin()->second;
}

bool TierEvictionOrder::Keeps(int32_t next_use) const {
  if (!unwanted_.empty()) return true;  // the victim is unwanted and older than the new block
  if (wanted_.empty()) return true;
  // Every block held is wanted: a new unwanted block would be the victim itself, and so would a
  // wanted one needed later than the farthest held (equal: the held one is older and goes first).
  return next_use >= 0 && next_use <= -std::get<0>(*wanted_.begin());
}

}  // namespace tandem
