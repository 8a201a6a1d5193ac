// What both attention executors share: the batch check and the CUDA kernels' head_dim support.
#include "memory_node/attention_executor.h"

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
  return absl::OkStatus();
}

std::string CudaAttentionUnsupported(int64_t head_dim) {
  if (head_dim != 64 && head_dim != 128) {
    return absl::StrCat("head_dim ", head_dim, " is not supported by the CUDA attention kernels (64 or 128)");
  }
  return "";
}

}  // namespace tandem
