// `tandem plan`: the cost model of planner/cost_model.h over colocated and disaggregated layouts
// for one model, workload, set of devices and SLO; prints the best plan and why it binds.
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "common/status.h"
#include "compute_node/weights.h"
#include "loadgen/metrics.h"
#include "loadgen/workload.h"
#include "nlohmann/json.hpp"
#include "planner/cost_model.h"
#include "planner/devices.h"

namespace tandem::cli {

namespace {

struct PlanArgs {
  std::string model, trace, prices = "deploy/prices.yaml", compute_device = "h100", memory_devices, slo;
  int64_t num_requests = 0, trace_skip = 0, max_input = 0, max_output = 0;
  double input_len = 0, output_len = 0, context = 0, cached = 0;
  double efficiency = 1, link_gbs = 0, kv_fraction = 0.9, latency_us = 5;
  int max_memory = 8, top = 15;
  bool json = false;
};

absl::Status RunPlan(const PlanArgs& a) {
  ASSIGN_OR_RETURN(std::unique_ptr<WeightSource> source, OpenModel(a.model, 0));
  const ModelSpec& spec = source->spec();
  absl::StatusOr<planner::PriceTable> loaded = planner::LoadPriceTable(a.prices);
  if (!loaded.ok()) return Annotate(loaded.status(), "--prices");
  const planner::PriceTable& prices = *loaded;
  // The workload's shape.
  planner::WorkloadShape w;
  const int given = (a.trace.empty() ? 0 : 1) + (a.context > 0 ? 1 : 0) + (a.input_len > 0 ? 1 : 0);
  if (given != 1)
    return absl::InvalidArgumentError(
        "give one workload: --trace FILE, --input-len P --output-len O, or --context C");
  if (!a.trace.empty()) {
    ASSIGN_OR_RETURN(const std::vector<loadgen::TraceRow> rows,
                     loadgen::ReadTrace(a.trace, a.trace_skip, a.num_requests));
    double in = 0, out = 0;
    for (const loadgen::TraceRow& r : rows) {
      int64_t i = a.max_input > 0 ? std::min(r.input_tokens, a.max_input) : r.input_tokens;
      int64_t o =
          std::max<int64_t>(1, a.max_output > 0 ? std::min(r.output_tokens, a.max_output) : r.output_tokens);
      if (i + o > spec.max_position) i = std::max<int64_t>(1, spec.max_position - o);
      in += static_cast<double>(i);
      out += static_cast<double>(o);
    }
    const double n = static_cast<double>(rows.size());
    w = planner::WorkloadShape::FromLengths(in / n, out / n, a.cached);
    w.description = absl::StrCat(w.description, " over ", rows.size(), " rows of ",
                                 std::filesystem::path(a.trace).filename().string());
  } else if (a.context > 0) {
    w.context_tokens = a.context;
    w.reserved_tokens = a.context;
    w.description = absl::StrFormat("decode only at context %.0f", a.context);
  } else {
    if (!(a.output_len > 0)) return absl::InvalidArgumentError("--input-len needs --output-len");
    w = planner::WorkloadShape::FromLengths(a.input_len, a.output_len, a.cached);
  }
  planner::PlanOptions o;
  o.kv_memory_fraction = a.kv_fraction;
  o.efficiency = a.efficiency;
  o.link_bandwidth = a.link_gbs * 1e9;
  o.link_latency_s = a.latency_us * 1e-6;
  o.max_memory_per_compute = a.max_memory;
  if (!a.slo.empty()) {
    ASSIGN_OR_RETURN(const loadgen::Slo slo, loadgen::ParseSlo(a.slo));
    if (slo.ttft_s > 0 || slo.e2e_s > 0)
      std::fprintf(stderr,
                   "tandem plan: only the TPOT SLO bounds the step time (TTFT and E2E are not modelled)\n");
    o.tpot_slo_s = slo.tpot_s;
  }
  absl::StatusOr<planner::DeviceSpec> found = planner::FindDevice(a.compute_device);
  if (!found.ok()) return Annotate(found.status(), "--compute-device");
  const planner::DeviceSpec& compute = *found;
  ASSIGN_OR_RETURN(const double compute_price, prices.HourlyUsd(a.compute_device));
  std::vector<std::string> mem_names;
  if (a.memory_devices.empty()) {
    // Every offer priced on the same basis as the compute device's (hourly, or purchase).
    ASSIGN_OR_RETURN(const planner::PriceOffer compute_offer, prices.Find(a.compute_device));
    for (const planner::PriceOffer& p : prices.offers)
      if ((p.usd_purchase > 0) == (compute_offer.usd_purchase > 0)) mem_names.push_back(p.name);
  } else {
    mem_names = absl::StrSplit(a.memory_devices, ',', absl::SkipEmpty());
  }
  std::vector<std::pair<planner::DeviceSpec, double>> mems;
  for (const std::string& n : mem_names) {
    absl::StatusOr<planner::DeviceSpec> d = planner::FindDevice(n);
    if (!d.ok()) return Annotate(d.status(), "--memory-devices");
    absl::StatusOr<double> price = prices.HourlyUsd(n);
    if (!price.ok()) return Annotate(price.status(), "--memory-devices");
    d->name = n;  // keep the offer ("rtx3090@purchase")
    mems.emplace_back(*d, *price);
  }
  planner::DeviceSpec named_compute = compute;
  named_compute.name = a.compute_device;
  const std::vector<planner::Prediction> plans =
      planner::Plan(spec, w, named_compute, compute_price, mems, o);
  const planner::Prediction* colocated = nullptr;
  for (const planner::Prediction& p : plans)
    if (p.mode == planner::PipelineMode::kColocated) colocated = &p;
  const planner::Prediction& best = plans.front();
  const double vs = colocated != nullptr && colocated->feasible && colocated->tokens_per_usd > 0
                        ? best.tokens_per_usd / colocated->tokens_per_usd
                        : 0;
  const double best_mfu = best.feasible ? 2.0 * static_cast<double>(spec.num_parameters()) * best.rows /
                                              best.step_s / compute.bf16_flops
                                        : 0;
  const double min_link = planner::MinLinkBandwidth(spec, std::min(1.0, best_mfu), compute.bf16_flops);
  if (a.json) {
    nlohmann::json j;
    j["model"] = spec.Summary();
    j["workload"] = w.description;
    j["price_table"] = prices.path;
    j["price_table_date"] = prices.date;
    nlohmann::json rows = nlohmann::json::array();
    for (const planner::Prediction& p : plans) {
      rows.push_back({{"mode", planner::PipelineModeName(p.mode)},
                      {"compute_device", p.compute_device},
                      {"memory_device", p.memory_device},
                      {"memory_count", p.memory_count},
                      {"feasible", p.feasible},
                      {"infeasible", p.infeasible},
                      {"batch", p.batch},
                      {"step_s", p.step_s},
                      {"linear_s", p.linear_s},
                      {"attention_s", p.attention_s},
                      {"exchange_s", p.exchange_s},
                      {"tokens_per_s", p.tokens_per_s},
                      {"usd_per_hour", p.usd_per_hour},
                      {"usd_per_million_output_tokens", p.usd_per_million},
                      {"limit", p.limit},
                      {"bound", p.bound}});
    }
    j["plans"] = rows;
    j["best_vs_colocated"] = vs;
    j["min_link_bandwidth_bytes_per_s"] = min_link;
    std::cout << j.dump(1) << "\n";
    return absl::OkStatus();
  }
  std::printf("model     %s\nworkload  %s\n", spec.Summary().c_str(), w.description.c_str());
  std::printf("devices   compute %s ($%.3f/h; %s)\n", a.compute_device.c_str(), compute_price,
              compute.source.c_str());
  std::printf("prices    %s, dated %s (purchase prices amortized over %g years)\n", prices.path.c_str(),
              prices.date.c_str(), prices.amortize_years);
  if (o.tpot_slo_s > 0) std::printf("SLO       step (TPOT) <= %.1f ms\n", o.tpot_slo_s * 1e3);
  std::printf("\n%-44s %7s %-48s %9s %8s %9s %-11s %s\n", "layout (per compute device)", "batch",
              "step ms (linear, attention, exchange)", "tok/s", "$/h", "$/M tok", "limit", "bound");
  int shown = 0;
  for (const planner::Prediction& p : plans) {
    if (shown++ >= a.top && &p != colocated) continue;
    std::printf("%s\n", planner::FormatPrediction(p).c_str());
  }
  if (!best.feasible) return absl::FailedPreconditionError("no layout is feasible: " + best.infeasible);
  std::printf("\nbest: %s\n", planner::FormatPrediction(best).c_str());
  std::printf(
      "      %.2fx the colocated layout's tokens per dollar; the batch stops at the %s, the step is bound by "
      "%s\n",
      vs, best.limit.c_str(), best.bound.c_str());
  if (best.mode != planner::PipelineMode::kColocated)
    std::printf(
        "      least link bandwidth that keeps the compute device busy (Lamina 4.2, MFU %.2f): %.1f GB/s\n",
        std::min(1.0, best_mfu), min_link / 1e9);
  return absl::OkStatus();
}

}  // namespace

void AddPlanCommand(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Predict step time, batch, tokens/s and $ per million output tokens of colocated and disaggregated\n"
      "layouts (1 compute device + 1..N memory devices, sequential or ping-pong pipelines) with a\n"
      "first-order cost model (planner/cost_model.h), and print the best plan and what binds it.\n"
      "Known devices: h100, h200 (measured ceilings), a100-80g, h20, tpu-v6e, rtx3090, rx7900xtx, arc-a770;\n"
      "offers (prices) from --prices, e.g. h100, h100@market, rtx3090@purchase.\n"
      "Examples:\n"
      "  tandem plan --model llama-13b --context 512 --compute-device a100-80g@purchase \\\n"
      "      --memory-devices a100-80g@purchase,rtx3090@purchase\n"
      "  tandem plan --model llama3-8b --trace azure_llm_conv_2023.csv --compute-device h100 --slo "
      "tpot=50ms");
  cmd->option_defaults()->always_capture_default();
  cmd->add_option("--model", a->model, "checkpoint directory, GGUF file or preset (its shape)")->required();
  cmd->add_option("--trace", a->trace, "workload: mean lengths of a trace (Azure CSV or Mooncake JSON lines)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--num-requests", a->num_requests, "trace rows to read (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--trace-skip", a->trace_skip, "trace rows to skip first")->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-input", a->max_input, "cap trace prompts (0: none)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-output", a->max_output, "cap trace outputs (0: none)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--input-len", a->input_len, "workload: mean prompt tokens")->check(CLI::NonNegativeNumber);
  cmd->add_option("--output-len", a->output_len, "workload: mean output tokens")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--context", a->context,
                  "workload: decode only at this context (the Lamina analysis' setting)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--cached", a->cached, "share of prompt tokens served by the prefix cache (not recomputed)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--prices", a->prices, "the price table (YAML)");
  cmd->add_option("--compute-device", a->compute_device, "the compute device's offer");
  cmd->add_option(
      "--memory-devices", a->memory_devices,
      "memory device offers to try, comma-separated (default: every offer priced like the compute device's, "
      "hourly or purchase)");
  cmd->add_option("--max-memory", a->max_memory, "memory devices per compute device to try")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--slo", a->slo, "tpot=50ms bounds the step time");
  cmd->add_option("--efficiency", a->efficiency, "share of every bandwidth and FLOP/s ceiling reached")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--link-gbs", a->link_gbs, "compute <-> memory bandwidth in GB/s (0: the devices' own)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--latency-us", a->latency_us, "one-way latency of a layer message")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--kv-fraction", a->kv_fraction, "share of free memory the KV takes (kv.memory_fraction)")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--top", a->top, "layouts to print")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", a->json, "every layout as JSON on stdout");
  cmd->callback([a] {
    absl::Status st = RunPlan(*a);
    if (!st.ok()) Fail("plan", st);
  });
}

}  // namespace tandem::cli
