// Decode throughput of the colocated engine on one GPU, with a breakdown of the step time.
//
// For each (batch, context): B requests with random prompts are prefilled, then decoded until the context
// reaches `context`; decode tok/s = B × decode steps / decode time, over the (about --decode-tokens)
// steps that decode all B requests and carry no prefill tokens. The engine runs with phase timing on
// (CUDA events between the phases of every step), which splits the device time of a decode step into GEMMs
// (cuBLAS), attention, other kernels (norms, RoPE, SiLU, KV append, embedding, copies) and sampling; the rest
// of the wall time is host work and launch gaps. outside = 1 − (GEMM + attention) / step. The events
// themselves cost a little; tok/s is measured in the same run.
//
// The linear layers (linear = gemm + other: everything but attention and sampling) are compared
// with their floor, measured first in the same process: the same matrix products as bare cuBLAS
// calls in one CUDA graph (bench/linear_floor.h). `rows` is the decode rows per step actually run.
// --cuda-graphs both runs every (batch, context) with the layer graphs on and off
// (ComputeBackendOptions::cuda_graphs), a fresh engine each.
//
// Usage: engine_decode_bench --model llama3-8b [--batches 1,8,32,64,128,256] [--contexts 1024,4096]
//                            [--decode-tokens 32] [--cuda-graphs on|off|both] [--kv-tokens N]
//                            [--floor 1] [--profile 1] [--gemv 1] [--json PATH]
// --profile 0 turns the phase timing off (its events cost host and device time): then only rows,
// tok/s and step_ms are meaningful. --gemv 0 sends every GEMM to cuBLAS (the engine and the floor),
// to compare with tandem's one-row kernel (ComputeBackendOptions::gemv).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "colocated/engine.h"
#include "compute_node/weights.h"
#include "linear_floor.h"

namespace {

using tandem::ColocatedEngine;
using tandem::GenerationRequest;

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t v = 0;
    if (absl::SimpleAtoi(p, &v) && v > 0) out.push_back(v);
  }
  return out;
}

double PhaseMs(const std::vector<std::pair<std::string, double>>& totals, const std::string& name) {
  for (const auto& [n, ms] : totals)
    if (n == name) return ms;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b", json_path;
  std::vector<int64_t> batches = {1, 8, 32, 64, 128, 256}, contexts = {1024, 4096};
  int64_t decode_tokens = 32, kv_tokens = 0;
  std::string graphs = "off";
  bool floor = true, profile = true, gemv = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model")
      model = v;
    else if (k == "--batches")
      batches = ParseList(v);
    else if (k == "--contexts")
      contexts = ParseList(v);
    else if (k == "--decode-tokens")
      decode_tokens = std::max<int64_t>(2, std::stoll(v));
    else if (k == "--json")
      json_path = v;
    else if (k == "--kv-tokens")
      kv_tokens = std::stoll(v);
    else if (k == "--floor")
      floor = v != "0";
    else if (k == "--profile")
      profile = v != "0";
    else if (k == "--gemv")
      gemv = v != "0";
    else if (k == "--cuda-graphs" && (v == "on" || v == "off" || v == "both"))
      graphs = v;
    else {
      std::fprintf(stderr, "engine_decode_bench: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  auto source = tandem::OpenModel(model, 0);
  if (!source.ok()) {
    std::fprintf(stderr, "engine_decode_bench: %s\n", std::string(source.status().message()).c_str());
    return 1;
  }
  const int64_t max_b = *std::max_element(batches.begin(), batches.end());
  const tandem::ModelSpec spec = (*source)->spec();
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::vector<double> floors;
  if (floor) floors = tandem::bench::LinearFloorMs(spec, batches, 20, gemv);
  std::printf("model %s on %s, decode %lld tokens per request\n", model.c_str(), prop.name,
              static_cast<long long>(decode_tokens));
  std::ofstream json;
  if (!json_path.empty()) json.open(json_path), json << "[\n";
  bool first = true;
  for (const bool on : {true, false}) {
    if ((on && graphs == "off") || (!on && graphs == "on")) continue;
    tandem::EngineOptions opt;
    opt.device = "cuda";
    opt.max_batch_size = max_b;
    opt.max_tokens_per_step = std::max<int64_t>(8192, max_b);
    opt.profile = profile;
    opt.kv_capacity_tokens = kv_tokens;
    opt.cuda_graphs = on;
    opt.gemv = gemv;
    auto t0 = std::chrono::steady_clock::now();
    auto engine = ColocatedEngine::Create(**source, opt);
    if (!engine.ok()) {
      std::fprintf(stderr, "engine_decode_bench: %s\n", std::string(engine.status().message()).c_str());
      return 1;
    }
    std::fprintf(stderr, "loaded %s in %.1f s on %s; KV capacity %lld tokens; CUDA graphs %s\n",
                 model.c_str(), std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 (*engine)->device().c_str(), static_cast<long long>((*engine)->kv_capacity_tokens()),
                 on ? "on" : "off");
    std::printf("%-6s %-6s %-6s %-6s %-8s %-8s %-8s %-8s %-8s %-8s %-9s %-8s %-8s %-8s %-9s\n", "graphs",
                "batch", "ctx", "rows", "tok/s", "step_ms", "gemm_ms", "other_ms", "linear", "floor",
                "lin/floor", "attn_ms", "sample", "host_ms", "prefill_s");
    std::mt19937 rng(11);
    for (int64_t c : contexts) {
      for (size_t bi = 0; bi < batches.size(); ++bi) {
        const int64_t b = batches[bi];
        if (b * (c + decode_tokens) > (*engine)->kv_capacity_tokens()) {
          std::printf("%-6s %-6lld %-6lld does not fit in the KV cache\n", on ? "on" : "off",
                      static_cast<long long>(b), static_cast<long long>(c));
          continue;
        }
        // Chunked prefill admits about max_tokens_per_step / c requests a step and the early ones
        // decode meanwhile: each request generates `ramp` (the batch's prefill steps) tokens more,
        // from a prompt that much shorter, so that all b decode together and contexts end at c.
        const int64_t prompt = c - decode_tokens;
        const int64_t ramp =
            std::min(prompt / 2, (b * prompt + opt.max_tokens_per_step - 1) / opt.max_tokens_per_step + 1);
        std::vector<GenerationRequest> reqs(static_cast<size_t>(b));
        for (auto& r : reqs) {
          r.prompt.resize(static_cast<size_t>(prompt - ramp));
          for (auto& t : r.prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(spec.vocab_size));
          r.max_tokens = decode_tokens + ramp;
          r.ignore_eos = true;
        }
        bool refused = false;
        for (auto& r : reqs) {
          if (absl::StatusOr<int64_t> id = (*engine)->Submit(r); !id.ok()) {
            std::printf("%-6lld %-6lld refused: %s\n", static_cast<long long>(b), static_cast<long long>(c),
                        std::string(id.status().message()).c_str());
            refused = true;
            break;
          }
        }
        if (refused) {
          std::vector<std::pair<int64_t, tandem::GenerationResult>> drain;
          while (!(*engine)->Idle()) (void)(*engine)->Step(&drain);
          continue;
        }
        std::vector<std::pair<int64_t, tandem::GenerationResult>> done;
        double decode_s = 0, prefill_s = 0;
        int64_t decode_steps = 0, decode_rows = 0;
        double phase_ms[4] = {0, 0, 0, 0};
        const char* kPhases[4] = {"gemm", "attention", "other", "sampling"};
        while (!(*engine)->Idle()) {
          const int64_t before = (*engine)->stats().prefill_tokens;
          const int64_t decoded_before = (*engine)->stats().decode_tokens;
          const auto totals_before = (*engine)->PhaseTotalsMs();
          const auto s0 = std::chrono::steady_clock::now();
          if (absl::Status st = (*engine)->Step(&done); !st.ok()) {
            std::fprintf(stderr, "step failed: %s\n", std::string(st.message()).c_str());
            return 1;
          }
          const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count();
          // Decode steps of the whole batch only (the ramp's steps run fewer rows).
          if ((*engine)->stats().prefill_tokens == before &&
              (*engine)->stats().decode_tokens - decoded_before == b) {
            decode_s += dt;
            ++decode_steps;
            decode_rows += (*engine)->stats().decode_tokens - decoded_before;
            const auto totals_after = (*engine)->PhaseTotalsMs();
            for (int p = 0; p < 4; ++p)
              phase_ms[p] += PhaseMs(totals_after, kPhases[p]) - PhaseMs(totals_before, kPhases[p]);
          } else {
            prefill_s += dt;
          }
        }
        const double step_ms = decode_steps ? 1e3 * decode_s / static_cast<double>(decode_steps) : 0;
        const double tok_s = decode_s > 0 ? static_cast<double>(decode_rows) / decode_s : 0;
        const double n = decode_steps ? static_cast<double>(decode_steps) : 1.0;
        const double rows = static_cast<double>(decode_rows) / n;
        const double gemm_ms = phase_ms[0] / n, attn_ms = phase_ms[1] / n, other_ms = phase_ms[2] / n,
                     sample_ms = phase_ms[3] / n;
        const double linear_ms = gemm_ms + other_ms;
        const double floor_ms = bi < floors.size() ? floors[bi] : 0;
        const double host_ms = step_ms - (gemm_ms + attn_ms + other_ms + sample_ms);
        std::printf(
            "%-6s %-6lld %-6lld %-6.1f %-8.0f %-8.2f %-8.2f %-8.2f %-8.2f %-8s %-9s %-8.2f %-8.2f %-8.2f "
            "%-9.1f\n",
            on ? "on" : "off", static_cast<long long>(b), static_cast<long long>(c), rows, tok_s, step_ms,
            gemm_ms, other_ms, linear_ms, floor_ms > 0 ? absl::StrFormat("%.2f", floor_ms).c_str() : "-",
            floor_ms > 0 ? absl::StrFormat("%.2f", linear_ms / floor_ms).c_str() : "-", attn_ms, sample_ms,
            host_ms, prefill_s);
        std::fflush(stdout);
        if (json.is_open()) {
          json << (first ? "" : ",\n") << "{\"model\":\"" << model << "\",\"device\":\"" << prop.name
               << "\",\"cuda_graphs\":" << (on ? "true" : "false") << ",\"batch\":" << b
               << ",\"context\":" << c << ",\"rows_per_step\":" << rows << ",\"decode_tok_s\":" << tok_s
               << ",\"step_ms\":" << step_ms << ",\"gemm_ms\":" << gemm_ms << ",\"other_ms\":" << other_ms
               << ",\"linear_ms\":" << linear_ms << ",\"linear_floor_ms\":" << floor_ms
               << ",\"attn_ms\":" << attn_ms << ",\"sample_ms\":" << sample_ms << ",\"host_ms\":" << host_ms
               << "}";
          first = false;
        }
      }
    }
  }
  if (json.is_open()) json << "\n]\n";
  return 0;
}
