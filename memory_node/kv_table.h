// The requests whose KV lives on one memory rank (or in the colocated engine), and the slots of
// their contexts. Turns the requests of a step plan into the attention executor's batch:
// allocates slots for each request's new rows and lists every slot its attention reads.
//
// A step plan comes from the network, so Apply checks it against this table before changing
// anything: a new request starts at position 0, a known one continues where its context ends,
// kv_len = position + q_len, single-row requests come before multi-row ones. Any violation, or
// too few free slots, fails the whole step with nothing applied.
//
// Thread safety: not thread-safe; the owning rank serialises calls.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "common/wire.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_slot_allocator.h"

namespace tandem {

class KvTable {
 public:
  explicit KvTable(int64_t num_slots) : allocator_(num_slots) {}

  // Fills `batch` with the rows of the plan's requests owned by `memory_rank`, in plan order,
  // allocating their new slots. Errors (nothing changed): InvalidArgument naming the request and
  // the rule it breaks; ResourceExhausted when the pool lacks free slots.
  absl::Status Apply(const StepPlan& plan, uint16_t memory_rank, AttentionBatch* batch);
  // Frees the KV of requests that ended or were cancelled. Ids not in the table are ignored (a
  // request may end before its first step reached this rank).
  void Release(std::span<const uint64_t> request_ids);

  int64_t num_slots() const { return allocator_.num_slots(); }
  int64_t num_free() const { return allocator_.num_free(); }
  int64_t num_requests() const { return static_cast<int64_t>(contexts_.size()); }
  // Tokens of context held for a request (0 if unknown).
  int64_t context_length(uint64_t request_id) const;

 private:
  KvSlotAllocator allocator_;
  std::unordered_map<uint64_t, std::vector<int32_t>> contexts_;  // request id -> slots by position
};

}  // namespace tandem
