// Token-granular KV slots: one slot holds one token's K and V (for every layer, each layer in its
// own array indexed by slot). Slots are handed out from a LIFO free list, so recently freed (and
// likely cache-warm) slots are reused first, and carry reference counts so that several requests
// can share the slots of a common prefix or of a forked conversation.
//
// Thread safety: not thread-safe; the owner (one memory rank's executor) serialises calls.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"

namespace tandem {

class KvSlotAllocator {
 public:
  explicit KvSlotAllocator(int64_t num_slots);

  // Appends `n` free slots, each with reference count 1, to `out`. All or nothing: if fewer than
  // `n` slots are free, returns ResourceExhausted and leaves `out` and the pool unchanged.
  absl::Status Allocate(int64_t n, std::vector<int32_t>* out);
  // Adds a reference to each slot (all must be allocated).
  void Retain(std::span<const int32_t> slots);
  // Drops a reference from each slot; a slot whose count reaches zero returns to the free list.
  // Releasing a free slot is a programmer error and aborts.
  void Release(std::span<const int32_t> slots);

  int64_t num_slots() const { return static_cast<int64_t>(refcount_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int32_t refcount(int32_t slot) const { return refcount_.at(static_cast<size_t>(slot)); }

 private:
  std::vector<int32_t> free_;      // LIFO: back() is handed out next
  std::vector<int32_t> refcount_;  // 0 = free
};

}  // namespace tandem
