// A first-order cost model of decode serving, and the planner built on it (`tandem plan`; the
// bench prints its prediction beside a measurement). docs/benchmarks.md, "Cost model and
// planner", compares it with the Lamina analysis and with measured runs.
//
// The model (one compute device; colocated data-parallel scales linearly, so its tokens per
// dollar are one device's). A decode step serves B running requests: each gets one token, and
// chunked prefill rides along at `prefill_rows_per_token` prompt rows per generated token, so the
// linear layers see R = B (1 + prefill_rows_per_token) rows:
//   linear(R)    = max(weight bytes / compute read bandwidth, 2 N R / compute FLOP/s)   (roofline)
//   attention(B) = B · context · kv bytes per token / (read bandwidth of the KV's devices)
//   exchange(R)  = R · layers · (2 q_dim + 2 kv_dim) · 2 bytes / link bandwidth
//                  + 2 · layers · link latency                            (disaggregated only)
// where N is the parameter count, context the mean tokens a decode row reads, and kv bytes per
// token 2 · layers · kv_dim · 2 (bf16). Step time:
//   colocated:                 linear + attention
//   disaggregated, sequential: linear + attention + exchange      (tandem's deployment today)
//   disaggregated, ping-pong:  max(2 · linear(R / 2), attention, exchange)  (two micro-batches,
//                              perfectly overlapped; each re-reads the weights)
// KV capacity: every running request holds `reserved_tokens` of KV (tandem reserves prompt +
// max_tokens at admission) in kv_memory_fraction of the memory left after the weights
// (colocated) or of every memory device (disaggregated). The batch is the largest B that fits
// the KV, keeps step time within the TPOT SLO, and stays within max_batch; output tokens/s =
// B / step. Not modelled: queueing (TTFT), prefill attention, kernel efficiency below the
// ceilings (use efficiency < 1), and the LM head's smaller row count.
//
// Thread safety: pure functions.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "planner/devices.h"

namespace tandem::planner {

// What the requests look like in steady state.
struct WorkloadShape {
  double context_tokens = 0;          // mean KV tokens a decode row reads
  double reserved_tokens = 0;         // KV tokens one running request holds
  double prefill_rows_per_token = 0;  // prompt rows computed per generated token (0: decode only)
  std::string description;

  // From mean prompt and output lengths: context P + O/2, reserved P + O, prefill P/O
  // (`cached_fraction` of the prompt is reused from the prefix cache and not recomputed).
  static WorkloadShape FromLengths(double prompt_tokens, double output_tokens, double cached_fraction = 0);
};

enum class PipelineMode { kColocated, kSequential, kPingPong };
const char* PipelineModeName(PipelineMode mode);

struct PlanOptions {
  double kv_memory_fraction = 0.9;  // share of the free memory the KV takes (kv.memory_fraction)
  double tpot_slo_s = 0;            // step time at most (0: none)
  int64_t max_batch = 4096;         // running requests at most
  double efficiency = 1.0;          // share of every ceiling (bandwidth, FLOP/s) actually reached
  double link_latency_s = 5e-6;     // one-way latency of one layer message
  double link_bandwidth = 0;        // bytes/s compute <-> memory (0: the smaller of the devices')
  int max_memory_per_compute = 8;   // memory devices per compute device to try
  double elem_bytes = 2;            // bf16 weights, KV and activations
};

// One layout priced and predicted.
struct Prediction {
  PipelineMode mode = PipelineMode::kColocated;
  std::string compute_device;
  std::string memory_device;  // empty when colocated
  int memory_count = 0;       // memory devices per compute device
  bool feasible = false;
  std::string infeasible;  // why not, when !feasible
  int64_t batch = 0;
  double rows = 0;  // rows per step (decode + prefill)
  double linear_s = 0, attention_s = 0, exchange_s = 0, step_s = 0;
  double tokens_per_s = 0;  // output tokens/s
  double usd_per_hour = 0;
  double usd_per_million = 0;
  double tokens_per_usd = 0;  // output tokens per dollar
  double kv_capacity_tokens = 0;
  std::string limit;  // what stops the batch growing: "KV capacity", "TPOT SLO", "max batch"
  std::string bound;  // the step's largest term: "compute", "weight reads", "KV bandwidth", "link"
};

// Predicts one layout: `memory` null and mode kColocated for colocated serving, else
// `memory_count` >= 1 memory devices per compute device. Prices are $/h per device.
Prediction Predict(const ModelSpec& model, const WorkloadShape& workload, const DeviceSpec& compute,
                   double compute_usd_per_hour, const DeviceSpec* memory, double memory_usd_per_hour,
                   int memory_count, PipelineMode mode, const PlanOptions& options);

// Predicts the colocated layout on `compute` and every disaggregated one (each memory device in
// `memory_devices`, 1..max_memory_per_compute of them, sequential and ping-pong); sorted best
// (most output tokens per dollar) first, infeasible layouts last.
std::vector<Prediction> Plan(const ModelSpec& model, const WorkloadShape& workload, const DeviceSpec& compute,
                             double compute_usd_per_hour,
                             const std::vector<std::pair<DeviceSpec, double>>& memory_devices,
                             const PlanOptions& options);

// Lamina section 4.2: the least compute <-> memory bandwidth that does not slow the compute
// device, in bytes/s: per step 4 e d B L bytes move (q, k, v out and the attention output back,
// MHA) while the linear layers take 2 N B / (MFU(B) · peak FLOP/s), so
//   min bandwidth = 2 e d L · MFU · peak / N.
// For GQA models the exchange is (2 q_dim + 2 kv_dim) per row per layer instead of 4 d.
double MinLinkBandwidth(const ModelSpec& model, double mfu, double peak_flops, double elem_bytes = 2);

// One line per prediction, for tables.
std::string FormatPrediction(const Prediction& p);

}  // namespace tandem::planner
