#include "memory_node/kv_slot_allocator.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

KvSlotAllocator::KvSlotAllocator(int64_t num_slots) {
  TANDEM_CHECK_MSG(num_slots >= 0 && num_slots <= INT32_MAX, "num_slots ", num_slots);
  refcount_.assign(static_cast<size_t>(num_slots), 0);
  free_.reserve(static_cast<size_t>(num_slots));
  // Pushed in reverse so that a fresh pool hands out 0, 1, 2, ... (contiguous, easy to read).
  for (int64_t s = num_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
}

absl::Status KvSlotAllocator::Allocate(int64_t n, std::vector<int32_t>* out) {
  TANDEM_CHECK(n >= 0 && out != nullptr);
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV pool: ", n, " slots requested, ", num_free(), " of ", num_slots(), " free"));
  }
  out->reserve(out->size() + static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = free_.back();
    free_.pop_back();
    refcount_[static_cast<size_t>(s)] = 1;
    out->push_back(s);
  }
  return absl::OkStatus();
}

void KvSlotAllocator::Retain(std::span<const int32_t> slots) {
  for (int32_t s : slots) {
    TANDEM_CHECK_MSG(s >= 0 && s < num_slots() && refcount_[static_cast<size_t>(s)] > 0,
                     "retain of free or invalid slot ", s);
    ++refcount_[static_cast<size_t>(s)];
  }
}

void KvSlotAllocator::Release(std::span<const int32_t> slots) {
  for (int32_t s : slots) {
    TANDEM_CHECK_MSG(s >= 0 && s < num_slots() && refcount_[static_cast<size_t>(s)] > 0,
                     "release of free or invalid slot ", s);
    if (--refcount_[static_cast<size_t>(s)] == 0) free_.push_back(s);
  }
}

}  // namespace tandem
