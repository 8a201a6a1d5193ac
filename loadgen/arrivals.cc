#include "loadgen/arrivals.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::loadgen {

absl::StatusOr<ArrivalKind> ParseArrivalKind(const std::string& s) {
  if (s == "trace") return ArrivalKind::kTrace;
  if (s == "poisson") return ArrivalKind::kPoisson;
  if (s == "all") return ArrivalKind::kAllAtOnce;
  return absl::InvalidArgumentError(
      absl::StrCat("--arrival: expected trace, poisson or all, got \"", s, "\""));
}

absl::StatusOr<std::vector<double>> ArrivalTimes(const Workload& w, const ArrivalSpec& spec,
                                                 bool from_trace) {
  std::vector<double> t(w.requests.size(), kLater);
  switch (spec.kind) {
    case ArrivalKind::kAllAtOnce:
      for (size_t i = 0; i < t.size(); ++i)
        if (w.requests[i].turn == 0) t[i] = 0;
      return t;
    case ArrivalKind::kTrace: {
      if (!from_trace)
        return absl::InvalidArgumentError(
            "--arrival trace needs --trace (a synthetic workload has no times)");
      if (!(spec.time_scale > 0)) return absl::InvalidArgumentError("--time-scale must be positive");
      double scale = spec.time_scale;
      if (spec.rate > 0) {
        const double span = w.requests.empty() ? 0 : w.requests.back().trace_time_s;
        if (!(span > 0))
          return absl::InvalidArgumentError("--rate with trace arrivals needs rows at different times");
        const double trace_rate = static_cast<double>(w.requests.size() - 1) / span;
        scale = trace_rate / spec.rate;
      }
      for (size_t i = 0; i < t.size(); ++i) t[i] = w.requests[i].trace_time_s * scale;
      return t;
    }
    case ArrivalKind::kPoisson: {
      if (!(spec.rate > 0)) return absl::InvalidArgumentError("--arrival poisson needs --rate > 0");
      if (!(spec.burstiness > 0)) return absl::InvalidArgumentError("--burstiness must be positive");
      std::mt19937_64 rng(spec.seed ^ 0x5eed);
      std::gamma_distribution<double> gap(spec.burstiness, 1.0 / (spec.rate * spec.burstiness));
      double now = 0;
      bool first = true;
      for (size_t i = 0; i < t.size(); ++i) {
        if (w.requests[i].turn != 0) continue;
        if (!first) now += gap(rng);
        first = false;
        t[i] = now;
      }
      return t;
    }
  }
  return t;
}

std::string DescribeArrivals(const ArrivalSpec& spec) {
  switch (spec.kind) {
    case ArrivalKind::kAllAtOnce:
      return "all at once";
    case ArrivalKind::kTrace:
      return spec.rate > 0 ? absl::StrFormat("trace times rescaled to %g req/s", spec.rate)
                           : absl::StrFormat("trace times x%g", spec.time_scale);
    case ArrivalKind::kPoisson:
      return absl::StrFormat("poisson %g req/s, burstiness %g", spec.rate, spec.burstiness);
  }
  return "";
}

}  // namespace tandem::loadgen
