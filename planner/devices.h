// Device specs and prices for the cost model (planner/cost_model.h) and for pricing a benchmark
// run (`tandem bench`, `tandem plan`).
//
// DeviceSpec: what the first-order model needs of an accelerator: memory capacity, the read
// bandwidth a decode kernel reaches, bf16 FLOP/s a large GEMM reaches, and the link to its peers.
// The built-in table (KnownDevices) holds the lent GPUs' measured ceilings (docs/benchmarks.md and
// the project's benchmark notes: H100 3.11 TB/s, ~795 TFLOP/s; H200 4.6 TB/s, ~790 TFLOP/s) and,
// for the others, the vendors' datasheet figures (marked as such in `source`); units are SI
// (bytes, bytes/s, FLOP/s).
//
// PriceTable: deploy/prices.yaml, a dated list of offers, each with its source. An offer is named
// "<device>" or "<device>@<offer>" ("h100", "h100@purchase"); the part before '@' names the
// DeviceSpec. Purchase prices become hourly by straight-line amortization over the table's
// `amortize_years` of continuous use (stated with every figure that uses one). DevicesCost() is
// the one seam that prices a set of devices by name: the bench's --compute-device /
// --memory-device flags call it today, and a deployment that names a device type per pool can
// call it with those names.
//
// Thread safety: values only; no shared state.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::planner {

struct DeviceSpec {
  std::string name;           // "h100", "rtx3090", ...
  double memory_bytes = 0;    // device memory
  double read_bandwidth = 0;  // bytes/s a decode kernel reads at (measured where we could)
  double bf16_flops = 0;      // dense bf16 FLOP/s (measured GEMM ceiling where we could)
  double link_bandwidth = 0;  // bytes/s one way to a peer device (0: unknown)
  std::string source;         // where the figures come from
};

// The built-in devices: h100, h200, a100-80g, h20, tpu-v6e, rtx3090, rx7900xtx, arc-a770.
const std::vector<DeviceSpec>& KnownDevices();
// A known device by name (the part of `name` before any '@'); NotFound listing the names.
absl::StatusOr<DeviceSpec> FindDevice(std::string_view name);

struct PriceOffer {
  std::string name;         // "h100" or "h100@purchase"
  double usd_per_hour = 0;  // hourly price, or 0 for a purchase price
  double usd_purchase = 0;  // purchase price, or 0 for an hourly one
  std::string source;       // who published it and when, or why it is an estimate
  bool estimate = false;    // not a price someone published for this device
};

struct PriceTable {
  std::string path;           // file it was read from
  std::string date;           // the table's date (YYYY-MM-DD)
  double amortize_years = 3;  // purchase price -> $/h over this many years of continuous use
  std::vector<PriceOffer> offers;

  // The offer named exactly `name`, or NotFound listing the names.
  absl::StatusOr<PriceOffer> Find(std::string_view name) const;
  // $/h of one device: the hourly price, or the purchase price amortized.
  absl::StatusOr<double> HourlyUsd(std::string_view name) const;
};

// Reads a price table (YAML: date, amortize_years, offers: [{name, usd_per_hour | usd_purchase,
// source, estimate?}]). Errors name the file and the offer (index and name): a missing date or
// source, both or neither price, a negative price, a duplicate name, an unknown key.
absl::StatusOr<PriceTable> LoadPriceTable(const std::string& path);
absl::StatusOr<PriceTable> ParsePriceTable(std::string_view yaml, const std::string& path);

// The devices a run used, priced.
struct DevicesCost {
  double usd_per_hour = 0;
  std::string description;  // "1 x h100 ($11.06/h) + 2 x h20 ($4.63/h, estimate)"
  std::string table_date;
  std::string table_path;
  bool any_estimate = false;
  bool any_amortized = false;  // a purchase price, amortized over table.amortize_years
};

// Prices `compute_count` devices `compute` and `memory_count` devices `memory` (memory may be
// empty with memory_count 0). InvalidArgument for counts < 0 or compute_count < 1; NotFound for
// an offer the table lacks (naming it and the table).
absl::StatusOr<DevicesCost> PriceDevices(const PriceTable& table, const std::string& compute,
                                         int compute_count, const std::string& memory, int memory_count);

// $ per million output tokens at `tokens_per_s` on devices costing `usd_per_hour` (0 when
// tokens_per_s is 0).
double UsdPerMillionTokens(double usd_per_hour, double tokens_per_s);

}  // namespace tandem::planner
