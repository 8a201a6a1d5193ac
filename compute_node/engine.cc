#include "compute_node/engine.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

absl::StatusOr<std::vector<GenerationResult>> Engine::GenerateAll(
    std::vector<GenerationRequest> requests, const std::function<absl::Status()>& before_step) {
  if (!Idle()) return absl::FailedPreconditionError("GenerateAll needs an idle engine");
  // Nothing half-applied: every request is checked before any is queued.
  for (size_t i = 0; i < requests.size(); ++i) {
    RETURN_IF_ERROR(Annotate(Check(requests[i]), absl::StrCat("request ", i)));
  }
  std::vector<int64_t> ids;
  for (GenerationRequest& r : requests) {
    ASSIGN_OR_RETURN(const int64_t id, Submit(std::move(r)));
    ids.push_back(id);
  }
  std::vector<GenerationResult> results(requests.size());
  if (ids.empty()) return results;
  std::vector<std::pair<int64_t, GenerationResult>> done;
  while (!Idle()) {
    if (before_step) RETURN_IF_ERROR(before_step());
    RETURN_IF_ERROR(Step(&done));
  }
  for (auto& [id, result] : done) results[static_cast<size_t>(id - ids.front())] = std::move(result);
  return results;
}

std::vector<KvUsage> KvUsageOf(const Controller& controller) {
  std::vector<KvUsage> out;
  for (int m = 0; m < controller.num_memory_ranks(); ++m) {
    const PrefixIndex* index = controller.prefix_index(m);
    out.push_back({.capacity = controller.kv_capacity(m),
                   .reserved = controller.kv_reserved(m),
                   .cached = index ? index->unused_tokens() : 0});
  }
  return out;
}

}  // namespace tandem
