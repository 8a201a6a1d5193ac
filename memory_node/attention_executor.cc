// What both attention executors share: the batch check and the CUDA kernels' head_dim support.
#include "memory_node/attention_executor.h"

#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tandem {

absl::Status CheckAttentionBatch(const AttentionBatch& b, const AttentionShape& shape, int64_t num_slots) {
  const int64_t t = b.num_tokens(), r = b.num_requests();
  if (t > shape.max_tokens || r > shape.max_requests) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention batch of ", t, " rows and ", r, " requests exceeds the executor's limits (",
                     shape.max_tokens, " rows, ", shape.max_requests, " requests)"));
  }
  if (b.q_indptr.empty() || static_cast<int64_t>(b.kv_indptr.size()) != r + 1 || b.q_indptr.back() != t ||
      b.kv_indptr.back() != static_cast<int32_t>(b.kv_slots.size())) {
    return absl::InvalidArgumentError("attention batch: inconsistent indptr arrays");
  }
  for (int32_t s : b.new_slots) {
    if (s < 0 || s >= num_slots)
      return absl::InvalidArgumentError(absl::StrCat("attention batch: slot ", s, " outside the pool"));
  }
  for (int32_t s : b.kv_slots) {
    if (s < 0 || s >= num_slots)
      return absl::InvalidArgumentError(absl::StrCat("attention batch: slot ", s, " outside the pool"));
  }
  if (b.q_indptr.front() != 0 || b.kv_indptr.front() != 0) {
    return absl::InvalidArgumentError("attention batch: indptr arrays must start at 0");
  }
  for (int64_t r = 0; r < b.num_requests(); ++r) {
    const size_t i = static_cast<size_t>(r);
    if (b.q_indptr[i + 1] <= b.q_indptr[i]) {
      return absl::InvalidArgumentError(absl::StrCat("attention batch: request ", r, " has no rows"));
    }
    if (b.kv_indptr[i + 1] - b.kv_indptr[i] < b.q_indptr[i + 1] - b.q_indptr[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention batch: request ", r, " reads fewer keys than it has rows"));
    }
  }
  // Groups: consistent arrays, rows inside the batch and ascending, parents earlier, levels nested.
  const int64_t g = b.num_groups();
  if (static_cast<int64_t>(b.group_row_indptr.size()) != g + 1 ||
      static_cast<int64_t>(b.group_parent.size()) != g || static_cast<int64_t>(b.group_level.size()) != g ||
      b.group_kv_indptr.front() != 0 || b.group_row_indptr.front() != 0 ||
      b.group_kv_indptr.back() != static_cast<int32_t>(b.group_kv_slots.size()) ||
      b.group_row_indptr.back() != static_cast<int32_t>(b.group_rows.size())) {
    return absl::InvalidArgumentError("attention batch: inconsistent group arrays");
  }
  for (int64_t i = 0; i < g; ++i) {
    const size_t gi = static_cast<size_t>(i);
    const int32_t parent = b.group_parent[gi];
    if (parent < -1 || parent >= i ||
        b.group_level[gi] != (parent < 0 ? 0 : b.group_level[static_cast<size_t>(parent)] + 1) ||
        b.group_kv_indptr[gi + 1] <= b.group_kv_indptr[gi] ||
        b.group_row_indptr[gi + 1] <= b.group_row_indptr[gi]) {
      return absl::InvalidArgumentError(absl::StrCat("attention batch: group ", i, " is malformed"));
    }
  }
  // Rows (the indptrs are now known to be increasing and within the arrays): one group per level,
  // a child's rows within its parent's. owner[level][row]: the group of that level holding the row.
  std::vector<std::vector<int32_t>> owner;
  for (int64_t i = 0; i < g; ++i) {
    const size_t gi = static_cast<size_t>(i);
    const size_t level = static_cast<size_t>(b.group_level[gi]);
    if (owner.size() <= level) owner.resize(level + 1, std::vector<int32_t>(static_cast<size_t>(t), -1));
    for (int32_t k = b.group_row_indptr[gi]; k < b.group_row_indptr[gi + 1]; ++k) {
      const int32_t row = b.group_rows[static_cast<size_t>(k)];
      if (row < 0 || row >= t ||
          (k > b.group_row_indptr[gi] && row <= b.group_rows[static_cast<size_t>(k) - 1]) ||
          owner[level][static_cast<size_t>(row)] >= 0 ||
          (level > 0 && owner[level - 1][static_cast<size_t>(row)] != b.group_parent[gi])) {
        return absl::InvalidArgumentError(absl::StrCat("attention batch: group ", i, " has a bad row ", row));
      }
      owner[level][static_cast<size_t>(row)] = static_cast<int32_t>(i);
    }
  }
  for (int32_t s : b.group_kv_slots) {
    if (s < 0 || s >= num_slots)
      return absl::InvalidArgumentError(absl::StrCat("attention batch: group slot ", s, " outside the pool"));
  }
  return absl::OkStatus();
}

absl::Status CheckSlotCopy(std::span<const int32_t> src, std::span<const int32_t> dst, int64_t num_slots) {
  const auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("CopySlots: ", parts...));
  };
  if (src.size() != dst.size()) return bad(src.size(), " src and ", dst.size(), " dst slots");
  std::unordered_set<int32_t> sources(src.begin(), src.end()), targets;
  for (const auto& [what, slots] : {std::pair{"src", src}, std::pair{"dst", dst}}) {
    for (int32_t s : slots) {
      if (s < 0 || s >= num_slots) return bad(what, " slot ", s, " outside the pool of ", num_slots);
    }
  }
  for (int32_t s : dst) {
    if (sources.contains(s) || !targets.insert(s).second)
      return bad("dst slot ", s, " is a src slot or repeats");
  }
  return absl::OkStatus();
}

absl::Status CheckRotation(const AttentionShape& shape, std::span<const int32_t> slots,
                           std::span<const int32_t> from_positions, std::span<const int32_t> to_positions,
                           std::span<const float> inv_freq) {
  if (from_positions.size() != slots.size() || to_positions.size() != slots.size()) {
    return absl::InvalidArgumentError(absl::StrCat("RotateKeys: ", slots.size(), " slots but ",
                                                   from_positions.size(), " from and ", to_positions.size(),
                                                   " to positions"));
  }
  if (static_cast<int64_t>(inv_freq.size()) != shape.head_dim / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("RotateKeys: ", inv_freq.size(), " inverse frequencies for head_dim ", shape.head_dim));
  }
  for (size_t i = 0; i < slots.size(); ++i) {
    if (from_positions[i] < 0 || to_positions[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat("RotateKeys: slot ", slots[i], " turns from position ",
                                                     from_positions[i], " to ", to_positions[i]));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem
