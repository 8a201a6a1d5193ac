// When each request of a workload is sent (loadgen/workload.h).
//
//   * trace: the trace's own offsets, times `time_scale` (0.5 sends twice as fast); with a rate
//     (requests/s) the offsets are scaled instead so that the mean rate is that rate;
//   * poisson: independent gaps drawn from a gamma distribution of shape `burstiness` and mean
//     1/rate (burstiness 1 is a Poisson process; below 1 burstier, above 1 more regular), as
//     common serving benchmarks do;
//   * all: every request at time 0 (maximum throughput; the engine's queue does the pacing).
// Later turns of a multi-turn session get no time here (kLater): the runner sends them
// `think_s` after the previous turn ends. Deterministic for a given seed.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "loadgen/workload.h"

namespace tandem::loadgen {

enum class ArrivalKind { kTrace, kPoisson, kAllAtOnce };

struct ArrivalSpec {
  ArrivalKind kind = ArrivalKind::kAllAtOnce;
  double rate = 0;        // requests/s (poisson: required; trace: 0 keeps the trace's rate)
  double time_scale = 1;  // trace only
  double burstiness = 1;  // poisson only: gamma shape
  uint64_t seed = 0;
};

inline constexpr double kLater = std::numeric_limits<double>::infinity();

// "trace" / "poisson" / "all" (the --arrival flag); InvalidArgument naming the flag otherwise.
absl::StatusOr<ArrivalKind> ParseArrivalKind(const std::string& s);
// Arrival time of every request (seconds from the start), kLater for later session turns.
// InvalidArgument for a poisson rate <= 0, burstiness <= 0, time_scale <= 0, or trace arrivals
// on a workload without trace times.
absl::StatusOr<std::vector<double>> ArrivalTimes(const Workload& w, const ArrivalSpec& spec, bool from_trace);
// "poisson 4 req/s, burstiness 1", "trace times x0.5", "all at once".
std::string DescribeArrivals(const ArrivalSpec& spec);

}  // namespace tandem::loadgen
