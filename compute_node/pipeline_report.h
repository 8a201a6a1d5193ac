// The measured pipeline of a deployment (docs/architecture.md, "A measured pipeline"): where a
// step's time goes on compute rank 0 and on each memory rank, and how close the deployment comes
// to keeping its busiest resource busy all the time.
//
// Per step, on average over the steps between two snapshots of the totals:
//   step             wall time of ComputeRank::Step
//   compute          compute rank 0's time in embedding, the linear layers and sampling (device
//                    time of its phases on a GPU, with compute.profile; host time on the CPU)
//   attention phase  on compute rank 0, from the q,k,v rows being ready to the last memory rank's
//                    output being in place: both transfers, the remote attention and any wait
//   attention        the busiest memory rank's attention time (KV append and attention of every
//                    layer; device time on a GPU); the ranks work in parallel
//   exchange         attention phase − attention (floored at 0): what disaggregation adds
//   idle             step − compute − attention phase (floored at 0): host work outside the
//                    phases, when compute rank 0's device has nothing queued
//   efficiency       max(compute, attention, exchange) / step. In this sequential pipeline the three
//                    add up, so it is at most the largest one's share; an overlapping pipeline
//                    approaches 1 when its busiest resource never waits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tandem {

// Totals since a deployment started; MakePipelineReport turns the difference of two into
// per-step figures.
struct PipelineTotals {
  bool phases_timed = true;  // false: compute rank 0's phases were not timed (compute.profile off)
  int64_t steps = 0;
  double step_ms = 0, compute_ms = 0, attention_phase_ms = 0;
  std::vector<double> rank_attention_ms;  // per memory rank; -1: unknown (a rank given up)
};

struct PipelineReport {
  bool phases_timed = true;  // else compute, attention phase, exchange, idle and efficiency are 0
  int64_t steps = 0;
  double step_ms = 0, compute_ms = 0, attention_phase_ms = 0, attention_ms = 0, exchange_ms = 0, idle_ms = 0;
  std::vector<double> rank_attention_ms;  // per memory rank, per step; -1: unknown ("lost")
  double efficiency = 0;
  // "per step 10.19 ms: compute 7.35, attention 2.37 (ranks 2.37), exchange 0.36, idle 0.11;
  // efficiency 0.72 over 32 steps"; "no steps" when there were none; without phase timing, the
  // step and the memory ranks' attention and a note that the rest needs compute.profile.
  std::string ToString() const;
};

// Per-step figures of the steps between `before` and `now` (totals of one deployment; before may
// be the zero totals). Ranks missing from `before` count from zero.
PipelineReport MakePipelineReport(const PipelineTotals& now, const PipelineTotals& before = {});

}  // namespace tandem
