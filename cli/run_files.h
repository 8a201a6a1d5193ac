// The files `tandem generate --deploy` and compute rank 0 (`tandem compute --requests --results`)
// exchange. Requests: one prompts-file line (cli/prompts.h) per request with every field given.
// Results: one line per request, in order, {"token_ids", "logprobs", "top_logprobs" (when the
// request asked: TopLogprobsJson), "finish_reason", "prompt_tokens", "cached_tokens"}, then {"stats":
// {"seconds", "steps", "device"}}. The results file appears whole (written to a temporary name, then
// renamed).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/top_logprobs.h"
#include "compute_node/engine.h"
#include "nlohmann/json.hpp"

namespace tandem {
struct GenerationRequest;
struct GenerationResult;
}  // namespace tandem

namespace tandem::cli {

// How a run went: wall time, the engine's steps and its device.
struct RunStats {
  double seconds = 0;
  int64_t steps = 0;
  std::string device;
  std::string pipeline;  // a deployment's PipelineReport::ToString(); empty for the colocated engine
  std::string tiers;     // KV tiers' figures (TierSummary); empty when no block moved between tiers
  // A deployment's recoveries ("1 memory rank(s) lost, 4 request(s) recovered by recomputation");
  // empty when there were none.
  std::string recovery;
};
// "demoted D tokens ..., restored R, failed F (recomputed); bytes out of and into the KV pool" from
// an engine's stats, then, where the engine owns its tiers (KvTierCounters::per_tier), hits, bytes
// and evictions per tier and the restore time; "" when no token moved between tiers.
std::string TierSummary(const EngineStats& stats);
// Per generated token, its alternatives: [[{"token": id, "logprob": x}, ...], ...] (as `tandem
// generate --json` prints them).
nlohmann::json TopLogprobsJson(const std::vector<std::vector<TopLogprob>>& top);
absl::Status WriteRequestsFile(const std::string& path, const std::vector<GenerationRequest>& requests);
absl::Status WriteResultsFile(const std::string& path, const std::vector<GenerationResult>& results,
                              const RunStats& stats);
// DataLoss naming the file and line for a malformed line or a missing stats line.
absl::Status ReadResultsFile(const std::string& path, std::vector<GenerationResult>* results,
                             RunStats* stats);

}  // namespace tandem::cli
