#include "memory_node/kv_table.h"

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

absl::Status KvTable::Apply(const StepPlan& plan, uint16_t memory_rank, AttentionBatch* batch) {
  batch->Clear();
  // Check everything first: nothing may change if the step is refused.
  int64_t new_rows = 0;
  bool seen_multi = false;
  std::unordered_set<uint64_t> ids;
  std::vector<const StepRequest*> mine;
  for (size_t i = 0; i < plan.requests.size(); ++i) {
    const StepRequest& r = plan.requests[i];
    if (r.memory_rank != memory_rank) continue;
    const std::string where = absl::StrCat("step ", plan.step_id, ": request ", r.request_id, ": ");
    if (!ids.insert(r.request_id).second)
      return absl::InvalidArgumentError(absl::StrCat(where, "listed twice"));
    const int64_t have = context_length(r.request_id);
    if (r.position != have) {
      return absl::InvalidArgumentError(absl::StrCat(where, "position ", r.position, " but this rank holds ",
                                                     have, " tokens of its context"));
    }
    if (r.q_len < 1 || static_cast<int64_t>(r.kv_len) != static_cast<int64_t>(r.position) + r.q_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "kv_len ", r.kv_len, " != position ", r.position, " + q_len ", r.q_len));
    }
    if (r.q_len == 1 && seen_multi) {
      return absl::InvalidArgumentError(absl::StrCat(where, "single-row request after a multi-row one"));
    }
    seen_multi |= r.q_len > 1;
    new_rows += r.q_len;
    mine.push_back(&r);
  }
  if (new_rows > allocator_.num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("step ", plan.step_id, ": ", new_rows,
                                                     " new KV slots needed but ", allocator_.num_free(),
                                                     " of ", allocator_.num_slots(), " are free"));
  }
  for (const StepRequest* r : mine) {
    std::vector<int32_t>& slots = contexts_[r->request_id];
    const size_t start = slots.size();
    // Cannot fail: the total was checked against the free count above.
    TANDEM_CHECK(allocator_.Allocate(r->q_len, &slots).ok());
    batch->new_slots.insert(batch->new_slots.end(), slots.begin() + static_cast<std::ptrdiff_t>(start),
                            slots.end());
    batch->q_indptr.push_back(batch->q_indptr.back() + r->q_len);
    batch->kv_slots.insert(batch->kv_slots.end(), slots.begin(), slots.end());
    batch->kv_indptr.push_back(static_cast<int32_t>(batch->kv_slots.size()));
    if (r->q_len == 1) ++batch->num_single;
    batch->max_q_len = std::max<int64_t>(batch->max_q_len, r->q_len);
    batch->max_kv_len = std::max<int64_t>(batch->max_kv_len, static_cast<int64_t>(slots.size()));
  }
  return absl::OkStatus();
}

void KvTable::Release(std::span<const uint64_t> request_ids) {
  for (uint64_t id : request_ids) {
    auto it = contexts_.find(id);
    if (it == contexts_.end()) continue;
    allocator_.Release(it->second);
    contexts_.erase(it);
  }
}

int64_t KvTable::context_length(uint64_t request_id) const {
  auto it = contexts_.find(request_id);
  return it == contexts_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

}  // namespace tandem
