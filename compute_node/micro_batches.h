// Micro-batches of a step, for pipelining (pipeline.mode: pingpong; docs/architecture.md, "The
// pipeline"): the controller plans one step, SplitStep cuts it into n micro-batches that the
// compute rank runs interleaved (the linear layers of one while the memory ranks run the
// attention of another), and MergeSampled puts their sampled tokens back in the step's order for
// Controller::Complete.
//
// Each micro-batch is a PlannedStep of its own: a subset of the step's requests in the step's
// order (so its plan still lists requests by memory rank, single-row ones first, and each memory
// rank's rows stay one contiguous range), their rows, sample rows and rank_rows, the prefix groups
// its requests use (with their ancestors, re-indexed), the publishes of its requests, and, in
// micro-batch 0 only, the step's evictions (a memory rank applies micro-batch 0 first). All share
// the step's id; plan.micro_batch / micro_batches say which one it is. Requests never move between
// memory ranks: a request's KV stays where the controller placed it.
//
// Balance: requests are dealt, heaviest first, to the micro-batch with the least cost so far, where
// a request's cost is its share of the step's rows (linear work) plus its share of the step's KV
// reads (attention work), so both halves of the pipeline get about 1/n each. A step with fewer
// requests than n gets one micro-batch per request.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "compute_node/controller.h"

namespace tandem {

struct MicroBatches {
  std::vector<PlannedStep> parts;
  // Sample row i of the step (in its order) is sample row samples[i].second of part samples[i].first.
  std::vector<std::pair<int32_t, int32_t>> samples;
};

// Splits `step` (non-empty) into min(n, requests) micro-batches; n in [1, kMaxMicroBatches].
MicroBatches SplitStep(const PlannedStep& step, int n);

// The step's sampled tokens, log-probabilities and alternatives in its own order, appended to
// `sampled`, from each part's (in that part's order). InternalError if a part returned the wrong
// number.
absl::Status MergeSampled(const MicroBatches& mb, std::span<const SampledTokens> parts,
                          SampledTokens* sampled);

}  // namespace tandem
