// The Mooncake trace replayed against the colocated engine with prefix caching off (recompute),
// with prefix caching in the KV pool only (prefix) and with prefix caching over KV tiers (tiers):
// time to first token and prefill throughput of multi-turn conversations whose histories outgrow
// the KV pool (docs/benchmarks.md, "KV tiers: the Mooncake trace"; issue targets: TTFT -80% and
// prefill throughput >= 5x against recompute).
//
// Prompts: the trace has lengths and `hash_ids` (each names a 512-token prefix block), never
// tokens. Each id becomes one token sequence of --block-tokens tokens (a pure function of the id
// and --seed), so requests whose id lists share a leading run share exactly that prompt prefix; the
// tokens past the last full block (the partial block) are the request's own. Lengths scale by
// --block-tokens / 512 (so the share of a prompt that is shared blocks stays the trace's), outputs
// by --output-scale; --max-prompt and the model's context cut prompts at their end, --max-output
// cuts outputs.
//
// Replay: one thread drives the engine through its public interface (compute_node/engine.h).
// Between steps, every request whose arrival time (trace time x --time-scale) has come is submitted;
// none is submitted before it arrives. A request arriving while a step runs is submitted when the
// step ends, as a server's engine thread takes its queue between steps; its TTFT still counts from
// its arrival. Each mode runs on a fresh engine after one warm-up request of its own tokens.
//
// Figures, per mode:
//   TTFT              end of the step that made a request's first token - its arrival (queueing,
//                     restores and prefill included); mean, p50, p99 over every request.
//   prefill time      the engine's step time spent on prompt work: each step's wall time x
//                     prefill rows / (prefill rows + decode rows) (rows of one step cost about the
//                     same in the linear layers, which dominate), and the whole of a step that only
//                     restores blocks; decode rows are requests that had their first token before
//                     the step.
//   prefill tok/s     every request's prompt tokens (computed or reused) / prefill time: the rate at
//                     which prompts become ready for decoding (AttentionStore's prefill throughput).
//   prefilled, reused prompt tokens computed, and reused from the KV pool or restored from a tier.
// Tokens are greedy and must be the same in every mode: the bench compares them and fails if not.
// Usage: mooncake_bench --help
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "colocated/engine.h"
#include "common/model_spec.h"
#include "compute_node/weights.h"
#include "loadgen/metrics.h"
#include "loadgen/workload.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// User + system CPU seconds of this process so far (every thread).
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

constexpr int64_t kTraceBlock = 512;  // tokens a hash_id stands for in the Mooncake traces

constexpr char kHelp[] = R"(mooncake_bench: replay a Mooncake trace against the colocated engine, with
prefix caching off (recompute), in the KV pool only (prefix), and over KV tiers (tiers).

  --trace FILE         Mooncake JSON lines (timestamp ms, input_length, output_length, hash_ids),
                       e.g. mooncake_conversation_trace.jsonl (required)
  --requests N         first N rows of the trace (300)
  --model NAME         preset, random weights (small)
  --device D           cpu, cuda, cuda:N (cpu)
  --modes LIST         comma list of recompute, prefix, tiers (recompute,prefix,tiers)
  --block-tokens B     tokens a hash_id stands for; prompt lengths scale by B/512 (512: the
                       trace's own; 2 replays a few hundred rows on the CPU small preset
                       in minutes)
  --max-prompt N       prompts keep their first N tokens (0: the model's context less the output)
  --output-scale X     outputs x X, at least 1 token (1)
  --max-output N       outputs at most N tokens (0: no cap)
  --time-scale X       arrival = trace time x X (1; 0.1 sends ten times as fast, 0 all at once)
  --kv-tokens N        KV pool in tokens (0: twice the longest request's context, so the pool
                       holds a few requests but not the conversations)
  --kv-block N         kv.prefix_block_tokens (0: gcd(B, 64))
  --max-batch N        scheduler.max_batch_size (0: the engine's)
  --step-tokens N      scheduler.max_tokens_per_step (2048)
  --host-bytes N       tiers: kv.tiers.host_bytes (0: the KV bytes of every distinct prompt token of
                       the replay, at most a quarter of the host's available memory)
  --disk-dir D         tiers: kv.tiers.disk_dir ("": no disk tier)
  --disk-bytes N       tiers: kv.tiers.disk_bytes (0 with --disk-dir: 4x the host tier)
  --prefetch N         tiers: kv.tiers.prefetch_lookahead (8)
  --eviction E         tiers: kv.tiers.eviction, next_use or lru (next_use)
  --seed S             token seed (1); weights use seed 1
  --json FILE          write every figure as JSON

Per mode: TTFT (first token - arrival) mean, p50, p99; prefill time (each step's wall time x its
prefill rows / all its rows, plus steps that only restore blocks); prefill throughput (all prompt
tokens, computed or reused, / prefill time); prompt tokens computed and reused (from the pool,
restored from a tier); wall time and the process's CPU time. Then tiers against recompute and prefix. Tokens must match
across modes (greedy) on the CPU, where the bench fails if they do not (on a GPU the requests that differ are counted:
bf16 KV reused and recomputed round differently), or if a mode could not run.
)";

struct Flags {
  std::string trace;
  int64_t requests = 300;
  std::string model = "small";
  std::string device = "cpu";
  std::vector<std::string> modes = {"recompute", "prefix", "tiers"};
  int64_t block_tokens = kTraceBlock;
  int64_t max_prompt = 0;
  double output_scale = 1;
  int64_t max_output = 0;
  double time_scale = 1;
  int64_t kv_tokens = 0;
  int64_t kv_block = 0;
  int64_t max_batch = 0;
  int64_t step_tokens = 2048;
  int64_t host_bytes = 0;
  std::string disk_dir;
  int64_t disk_bytes = 0;
  int64_t prefetch = 8;
  std::string eviction = "next_use";
  uint64_t seed = 1;
  std::string json;
};

absl::Status ParseFlags(int argc, char** argv, Flags* f) {
  auto int_flag = [](const std::string& flag, const std::string& v, int64_t min,
                     int64_t* out) -> absl::Status {
    if (!absl::SimpleAtoi(v, out) || *out < min)
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": expected an integer >= ", min, ", got \"", v, "\""));
    return absl::OkStatus();
  };
  auto real_flag = [](const std::string& flag, const std::string& v, double min,
                      double* out) -> absl::Status {
    if (!absl::SimpleAtod(v, out) || !(*out >= min))
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": expected a number >= ", min, ", got \"", v, "\""));
    return absl::OkStatus();
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") return absl::CancelledError("help");
    if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat(flag, ": needs a value"));
    const std::string v = argv[i + 1];
    absl::Status st;
    int64_t seed = 0;
    if (flag == "--trace") {
      f->trace = v;
    } else if (flag == "--requests") {
      st = int_flag(flag, v, 1, &f->requests);
    } else if (flag == "--model") {
      f->model = v;
    } else if (flag == "--device") {
      f->device = v;
    } else if (flag == "--modes") {
      f->modes = absl::StrSplit(v, ',', absl::SkipEmpty());
      std::set<std::string> seen;
      for (const std::string& m : f->modes) {
        if (m != "recompute" && m != "prefix" && m != "tiers")
          return absl::InvalidArgumentError(
              absl::StrCat("--modes: unknown mode \"", m, "\" (recompute, prefix, tiers)"));
        if (!seen.insert(m).second)
          return absl::InvalidArgumentError(absl::StrCat("--modes: \"", m, "\" given twice"));
      }
      if (f->modes.empty()) return absl::InvalidArgumentError("--modes: empty");
    } else if (flag == "--block-tokens") {
      st = int_flag(flag, v, 1, &f->block_tokens);
    } else if (flag == "--max-prompt") {
      st = int_flag(flag, v, 0, &f->max_prompt);
    } else if (flag == "--output-scale") {
      st = real_flag(flag, v, 0, &f->output_scale);
    } else if (flag == "--max-output") {
      st = int_flag(flag, v, 0, &f->max_output);
    } else if (flag == "--time-scale") {
      st = real_flag(flag, v, 0, &f->time_scale);
    } else if (flag == "--kv-tokens") {
      st = int_flag(flag, v, 0, &f->kv_tokens);
    } else if (flag == "--kv-block") {
      st = int_flag(flag, v, 0, &f->kv_block);
    } else if (flag == "--max-batch") {
      st = int_flag(flag, v, 0, &f->max_batch);
    } else if (flag == "--step-tokens") {
      st = int_flag(flag, v, 1, &f->step_tokens);
    } else if (flag == "--host-bytes") {
      st = int_flag(flag, v, 0, &f->host_bytes);
    } else if (flag == "--disk-dir") {
      f->disk_dir = v;
    } else if (flag == "--disk-bytes") {
      st = int_flag(flag, v, 0, &f->disk_bytes);
    } else if (flag == "--prefetch") {
      st = int_flag(flag, v, 0, &f->prefetch);
    } else if (flag == "--eviction") {
      if (v != "next_use" && v != "lru") {
        st = absl::InvalidArgumentError(absl::StrCat("--eviction: \"", v, "\" is neither next_use nor lru"));
      }
      f->eviction = v;
    } else if (flag == "--seed") {
      st = int_flag(flag, v, 0, &seed);
      f->seed = static_cast<uint64_t>(seed);
    } else if (flag == "--json") {
      f->json = v;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", flag, " (--help lists them)"));
    }
    if (!st.ok()) return st;
  }
  if (f->trace.empty()) return absl::InvalidArgumentError("--trace: required (a Mooncake JSON-lines file)");
  return absl::OkStatus();
}

// splitmix64's finaliser.
uint64_t Mix(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Token `pos` of sequence `key` in `domain` (shared blocks, a request's own tokens, the warm-up):
// ids in [3, vocab) that are not EOS.
int32_t TokenOf(const tandem::ModelSpec& spec, uint64_t seed, uint64_t domain, uint64_t key, uint64_t pos) {
  constexpr int64_t kFirst = 3;  // below: BOS, EOS, UNK in Llama vocabularies
  const uint64_t z = Mix(Mix(Mix(seed + 0x9E3779B97F4A7C15ull) ^ (domain << 56) ^ key) ^ pos);
  int32_t t = static_cast<int32_t>(kFirst +
                                   static_cast<int64_t>(z % static_cast<uint64_t>(spec.vocab_size - kFirst)));
  while (std::find(spec.eos_token_ids.begin(), spec.eos_token_ids.end(), t) != spec.eos_token_ids.end())
    t = static_cast<int32_t>(kFirst + (t + 1 - kFirst) % (spec.vocab_size - kFirst));
  return t;
}

struct Request {
  double arrival_s = 0;
  std::vector<int32_t> prompt;
  int64_t max_tokens = 1;
  int64_t reusable = 0;  // prompt tokens a perfect cache would reuse (shared blocks seen before)
};

struct Shape {
  int64_t requests = 0, prompt_tokens = 0, output_tokens = 0, reusable_tokens = 0;
  int64_t longest_context = 0, prompts_cut = 0, outputs_cut = 0;
  double span_s = 0;
};

// The replay's requests from the trace rows (see the top of the file), and the trace's shape.
std::vector<Request> MakeRequests(const std::vector<tandem::loadgen::TraceRow>& rows, const Flags& f,
                                  const tandem::ModelSpec& spec, Shape* shape) {
  std::vector<Request> out;
  std::unordered_set<uint64_t> seen;  // chains of full blocks some earlier prompt holds
  const int64_t b = f.block_tokens;
  for (size_t i = 0; i < rows.size(); ++i) {
    const tandem::loadgen::TraceRow& row = rows[i];
    Request r;
    r.arrival_s = row.time_s * f.time_scale;
    r.max_tokens =
        std::max<int64_t>(1, std::llround(static_cast<double>(row.output_tokens) * f.output_scale));
    if (f.max_output > 0 && r.max_tokens > f.max_output) {
      r.max_tokens = f.max_output;
      ++shape->outputs_cut;
    }
    r.max_tokens = std::min<int64_t>(r.max_tokens, spec.max_position - 1);
    const int64_t full =
        std::min<int64_t>(row.input_tokens / kTraceBlock, static_cast<int64_t>(row.hash_ids.size()));
    const int64_t rest = row.input_tokens - full * kTraceBlock;
    int64_t own = (rest * b + kTraceBlock - 1) / kTraceBlock;  // the partial block, scaled, rounded up
    if (full == 0) own = std::max<int64_t>(own, 1);
    int64_t cap = spec.max_position - r.max_tokens;
    if (f.max_prompt > 0) cap = std::min(cap, f.max_prompt);
    const int64_t length = full * b + own;
    if (length > cap) ++shape->prompts_cut;
    const int64_t keep = std::min(length, cap);
    r.prompt.reserve(static_cast<size_t>(keep));
    uint64_t chain = 0;
    bool hit = true;
    for (int64_t k = 0; k < full && static_cast<int64_t>(r.prompt.size()) < keep; ++k) {
      const uint64_t id = static_cast<uint64_t>(row.hash_ids[static_cast<size_t>(k)]);
      for (int64_t j = 0; j < b && static_cast<int64_t>(r.prompt.size()) < keep; ++j)
        r.prompt.push_back(TokenOf(spec, f.seed, 1, id, static_cast<uint64_t>(j)));
      chain = Mix(chain ^ (id + 0x9E3779B97F4A7C15ull));
      const bool whole = static_cast<int64_t>(r.prompt.size()) == (k + 1) * b;
      hit = hit && whole && seen.contains(chain);
      if (hit) r.reusable += b;
      if (whole) seen.insert(chain);
    }
    for (int64_t j = 0; static_cast<int64_t>(r.prompt.size()) < keep; ++j)
      r.prompt.push_back(TokenOf(spec, f.seed, 2, i, static_cast<uint64_t>(j)));
    // Even a perfect cache computes a prompt's last token (it makes the first output token).
    r.reusable = std::min<int64_t>(r.reusable, keep - 1);
    shape->prompt_tokens += keep;
    shape->output_tokens += r.max_tokens;
    shape->reusable_tokens += r.reusable;
    shape->longest_context = std::max(shape->longest_context, keep + r.max_tokens);
    shape->span_s = std::max(shape->span_s, r.arrival_s);
    out.push_back(std::move(r));
  }
  shape->requests = static_cast<int64_t>(out.size());
  return out;
}

struct ModeResult {
  std::string mode;
  std::string error;  // the engine refused the mode, or failed
  std::vector<std::vector<int32_t>> tokens;
  std::vector<double> ttft;
  double prefill_s = 0, wall_s = 0;
  // The process's CPU time during the replay, and the prefill share of it (apportioned as the wall
  // time is): on a shared host, other processes' load lengthens the wall times, not these.
  double cpu_s = 0, prefill_cpu_s = 0;
  int64_t prompt_tokens = 0, reused_tokens = 0;
  tandem::EngineStats stats;  // this run's (the warm-up's left out)
  int64_t kv_tokens = 0;
};

// The tokens of `after` less those of `before` (the warm-up's).
tandem::EngineStats Delta(const tandem::EngineStats& a, const tandem::EngineStats& b) {
  tandem::EngineStats d = a;
  d.steps -= b.steps;
  d.prefill_tokens -= b.prefill_tokens;
  d.decode_tokens -= b.decode_tokens;
  d.cached_tokens -= b.cached_tokens;
  d.restored_tokens -= b.restored_tokens;
  d.busy_seconds -= b.busy_seconds;
  tandem::KvTierCounters& t = d.tiers;
  const tandem::KvTierCounters& u = b.tiers;
  t.restored_blocks -= u.restored_blocks;
  t.demoted_blocks -= u.demoted_blocks;
  t.prefetched_blocks -= u.prefetched_blocks;
  t.prefetch_wasted_blocks -= u.prefetch_wasted_blocks;
  t.host_hits -= u.host_hits;
  t.disk_hits -= u.disk_hits;
  t.restore_seconds -= u.restore_seconds;
  t.restore_stall_seconds -= u.restore_stall_seconds;
  return d;
}

ModeResult RunMode(const std::string& mode, const tandem::WeightSource& weights,
                   const tandem::EngineOptions& base, const std::vector<Request>& reqs) {
  ModeResult res;
  res.mode = mode;
  tandem::EngineOptions o = base;
  o.prefix_cache = mode != "recompute";
  if (mode != "tiers") {
    o.tiers_host_bytes = 0;
    o.tiers_disk_bytes = 0;
    o.tiers_disk_dir.clear();
  }
  absl::StatusOr<std::unique_ptr<tandem::ColocatedEngine>> created =
      tandem::ColocatedEngine::Create(weights, o);
  if (!created.ok()) {
    res.error = absl::StrCat("the engine refused it: ", created.status().ToString());
    return res;
  }
  tandem::ColocatedEngine& e = **created;
  res.kv_tokens = e.kv_capacity_tokens();
  const tandem::ModelSpec& spec = e.spec();
  {  // Warm-up (first-step costs, lazily made buffers): tokens no trace request holds.
    tandem::GenerationRequest w;
    for (int64_t j = 0; j < 2 * o.prefix_block_tokens + 1; ++j)
      w.prompt.push_back(TokenOf(spec, 0, 3, 0, static_cast<uint64_t>(j)));
    w.max_tokens = 2;
    w.ignore_eos = true;
    absl::StatusOr<std::vector<tandem::GenerationResult>> r = e.GenerateAll({w});
    if (!r.ok()) {
      res.error = absl::StrCat("warm-up failed: ", r.status().ToString());
      return res;
    }
  }
  const tandem::EngineStats before = e.stats();
  const size_t n = reqs.size();
  res.tokens.assign(n, {});
  res.ttft.assign(n, -1);
  std::map<int64_t, size_t> live;  // engine id -> request
  size_t next = 0, done = 0;
  std::vector<std::pair<int64_t, tandem::GenerationResult>> finished;
  const Clock::time_point t0 = Clock::now();
  const double cpu0 = CpuSeconds();
  double last_progress = 0;
  while (done < n) {
    double now = Since(t0);
    for (; next < n && reqs[next].arrival_s <= now; ++next) {
      tandem::GenerationRequest g;
      g.prompt = reqs[next].prompt;
      g.max_tokens = reqs[next].max_tokens;
      g.ignore_eos = true;
      absl::StatusOr<int64_t> id = e.Submit(std::move(g));
      if (!id.ok()) {
        res.error = absl::StrCat("request ", next, " refused: ", id.status().ToString());
        return res;
      }
      live.emplace(*id, next);
    }
    if (e.Idle()) {
      if (next < n)
        std::this_thread::sleep_for(
            std::chrono::duration<double>(std::min(reqs[next].arrival_s - now, 0.05)));
      continue;
    }
    int64_t decode_rows = 0;
    for (const auto& [id, i] : live) {
      const tandem::GenerationResult* p = e.Progress(id);
      decode_rows += p != nullptr && !p->token_ids.empty();
    }
    const int64_t prefilled = e.stats().prefill_tokens;
    const double start = Since(t0), cpu_start = CpuSeconds();
    finished.clear();
    if (absl::Status st = e.Step(&finished); !st.ok()) {
      res.error = absl::StrCat("step failed: ", st.ToString());
      return res;
    }
    now = Since(t0);
    const int64_t prefill_rows = e.stats().prefill_tokens - prefilled;
    const double share =
        prefill_rows + decode_rows == 0  // restores only
            ? 1.0
            : static_cast<double>(prefill_rows) / static_cast<double>(prefill_rows + decode_rows);
    res.prefill_s += (now - start) * share;
    res.prefill_cpu_s += (CpuSeconds() - cpu_start) * share;
    for (auto& [id, r] : finished) {
      const auto it = live.find(id);
      if (it == live.end()) continue;
      const size_t i = it->second;
      if (res.ttft[i] < 0) res.ttft[i] = now - reqs[i].arrival_s;
      res.prompt_tokens += r.prompt_tokens;
      res.reused_tokens += r.cached_tokens;
      res.tokens[i] = std::move(r.token_ids);
      live.erase(it);
      ++done;
    }
    for (const auto& [id, i] : live) {
      const tandem::GenerationResult* p = e.Progress(id);
      if (res.ttft[i] < 0 && p != nullptr && !p->token_ids.empty()) res.ttft[i] = now - reqs[i].arrival_s;
    }
    if (now - last_progress >= 5) {
      last_progress = now;
      std::fprintf(stderr, "  %s: %zu/%zu finished, %lld running, %lld waiting, %.0f s\n", mode.c_str(), done,
                   n, static_cast<long long>(e.num_running()), static_cast<long long>(e.num_waiting()), now);
    }
  }
  res.wall_s = Since(t0);
  res.cpu_s = CpuSeconds() - cpu0;
  res.stats = Delta(e.stats(), before);
  return res;
}

std::string Bytes(int64_t b) {
  return b >= (int64_t{1} << 30) ? absl::StrFormat("%.2f GiB", static_cast<double>(b) / (1 << 30))
                                 : absl::StrFormat("%.1f MiB", static_cast<double>(b) / (1 << 20));
}

double Percent(double now, double base) { return base > 0 ? 100.0 * (now - base) / base : 0; }

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (absl::Status st = ParseFlags(argc, argv, &f); !st.ok()) {
    if (absl::IsCancelled(st)) {
      std::fputs(kHelp, stdout);
      return 0;
    }
    std::fprintf(stderr, "mooncake_bench: %s\n", std::string(st.message()).c_str());
    return 2;
  }
  absl::StatusOr<tandem::ModelSpec> spec = tandem::PresetSpec(f.model);
  if (!spec.ok()) {
    std::fprintf(stderr, "mooncake_bench: --model: %s\n", std::string(spec.status().message()).c_str());
    return 2;
  }
  tandem::loadgen::TraceFormat format;
  absl::StatusOr<std::vector<tandem::loadgen::TraceRow>> rows =
      tandem::loadgen::ReadTrace(f.trace, 0, f.requests, &format);
  if (!rows.ok() || format != tandem::loadgen::TraceFormat::kMooncake || rows->empty()) {
    std::fprintf(stderr, "mooncake_bench: --trace %s: %s\n", f.trace.c_str(),
                 !rows.ok()      ? std::string(rows.status().message()).c_str()
                 : rows->empty() ? "no rows"
                                 : "not a Mooncake trace (JSON lines with hash_ids)");
    return 2;
  }
  Shape shape;
  const std::vector<Request> reqs = MakeRequests(*rows, f, *spec, &shape);
  const int64_t kv_block = f.kv_block > 0 ? f.kv_block : std::gcd(f.block_tokens, int64_t{64});
  int64_t kv_tokens = f.kv_tokens;
  if (kv_tokens == 0) kv_tokens = (2 * shape.longest_context + kv_block - 1) / kv_block * kv_block;
  if (kv_tokens < shape.longest_context) {
    std::fprintf(stderr,
                 "mooncake_bench: --kv-tokens %lld is below the longest request's context (%lld tokens)\n",
                 static_cast<long long>(kv_tokens), static_cast<long long>(shape.longest_context));
    return 2;
  }
  // A token's KV bytes at fp32 (the CPU engine's; a bf16 pool needs half).
  const int64_t kv_bytes_per_token = 2 * spec->num_layers * spec->kv_dim() * 4;
  const int64_t distinct = shape.prompt_tokens - shape.reusable_tokens;
  int64_t host_bytes = f.host_bytes;
  if (host_bytes == 0) {
    int64_t available = 0;
    std::ifstream meminfo("/proc/meminfo");
    for (std::string key; meminfo >> key;) {
      int64_t kib = 0;
      meminfo >> kib;
      if (key == "MemAvailable:") available = kib * 1024;
      meminfo.ignore(64, '\n');
    }
    host_bytes = distinct * kv_bytes_per_token;
    if (available > 0) host_bytes = std::min(host_bytes, available / 4);
  }
  int64_t disk_bytes = f.disk_bytes;
  if (!f.disk_dir.empty() && disk_bytes == 0) disk_bytes = 4 * host_bytes;

  const double n = static_cast<double>(shape.requests);
  std::printf("trace %s: %lld requests over %.1f s (after --time-scale %g)\n", f.trace.c_str(),
              static_cast<long long>(shape.requests), shape.span_s, f.time_scale);
  std::printf(
      "scaled: hash_id = %lld tokens, mean prompt %.0f, mean output %.1f tokens; %lld prompts cut "
      "(--max-prompt %lld / model context %lld), %lld outputs cut\n",
      static_cast<long long>(f.block_tokens), static_cast<double>(shape.prompt_tokens) / n,
      static_cast<double>(shape.output_tokens) / n, static_cast<long long>(shape.prompts_cut),
      static_cast<long long>(f.max_prompt), static_cast<long long>(spec->max_position),
      static_cast<long long>(shape.outputs_cut));
  const double share = static_cast<double>(shape.reusable_tokens) / static_cast<double>(shape.prompt_tokens);
  std::printf(
      "a perfect cache reuses %.1f%% of the %lld prompt tokens (prefill work at most %.2fx less); "
      "%lld distinct prompt tokens\n",
      100 * share, static_cast<long long>(shape.prompt_tokens), 1 / (1 - share),
      static_cast<long long>(distinct));
  std::printf(
      "model %s on %s; KV pool %lld tokens (%.1f%% of the distinct prompt tokens), block %lld; "
      "tiers: host %s%s, eviction %s\n",
      f.model.c_str(), f.device.c_str(), static_cast<long long>(kv_tokens),
      100.0 * static_cast<double>(kv_tokens) / static_cast<double>(distinct),
      static_cast<long long>(kv_block), Bytes(host_bytes).c_str(),
      f.disk_dir.empty() ? "" : absl::StrCat(", disk ", Bytes(disk_bytes), " in ", f.disk_dir).c_str(),
      f.eviction.c_str());
  std::fflush(stdout);

  const std::unique_ptr<tandem::WeightSource> weights = tandem::RandomWeights(*spec, 1);
  tandem::EngineOptions base;
  base.device = f.device;
  base.max_batch_size = f.max_batch;
  base.max_tokens_per_step = f.step_tokens;
  base.kv_capacity_tokens = kv_tokens;
  base.prefix_block_tokens = kv_block;
  base.tiers_host_bytes = host_bytes;
  base.tiers_disk_dir = f.disk_dir;
  base.tiers_disk_bytes = f.disk_dir.empty() ? 0 : disk_bytes;
  base.tiers_prefetch_lookahead = f.prefetch;
  base.tiers_eviction = f.eviction;

  std::vector<ModeResult> results;
  bool failed = false;
  for (const std::string& mode : f.modes) {
    std::fprintf(stderr, "mode %s ...\n", mode.c_str());
    results.push_back(RunMode(mode, *weights, base, reqs));
    if (!results.back().error.empty()) {
      std::printf("%s: %s\n", mode.c_str(), results.back().error.c_str());
      failed = true;
    }
  }

  std::printf("\n%-10s %9s %9s %9s %10s %12s %11s %11s %11s %10s %8s %13s\n", "mode", "TTFT mean", "p50",
              "p99", "prefill s", "prefill t/s", "prefilled", "pool hits", "tier hits", "restored", "wall s",
              "prefill CPU s");
  nlohmann::json jmodes = nlohmann::json::object();
  std::map<std::string, const ModeResult*> by_mode;
  std::map<std::string, tandem::loadgen::Stats> ttft;
  for (const ModeResult& r : results) {
    if (!r.error.empty()) {
      jmodes[r.mode] = {{"error", r.error}};
      continue;
    }
    by_mode[r.mode] = &r;
    const tandem::loadgen::Stats s = tandem::loadgen::Summarize(r.ttft);
    ttft[r.mode] = s;
    const double rate = r.prefill_s > 0 ? static_cast<double>(r.prompt_tokens) / r.prefill_s : 0;
    // Restored blocks a request attached (prefetched ones evicted unused left out); the rest of the
    // reused tokens came from blocks still in the pool.
    const int64_t tier_hits =
        (r.stats.tiers.restored_blocks - r.stats.tiers.prefetch_wasted_blocks) * kv_block;
    const int64_t pool_hits = std::max<int64_t>(0, r.reused_tokens - tier_hits);
    std::printf("%-10s %9.3f %9.3f %9.3f %10.2f %12.0f %11lld %11lld %11lld %10lld %8.1f %13.2f\n",
                r.mode.c_str(), s.mean, s.median, s.p99, r.prefill_s, rate,
                static_cast<long long>(r.stats.prefill_tokens), static_cast<long long>(pool_hits),
                static_cast<long long>(tier_hits), static_cast<long long>(r.stats.tiers.restored_blocks),
                r.wall_s, r.prefill_cpu_s);
    jmodes[r.mode] = {{"ttft_s", {{"mean", s.mean}, {"p50", s.median}, {"p99", s.p99}, {"max", s.max}}},
                      {"prefill_seconds", r.prefill_s},
                      {"prefill_tokens_per_second", rate},
                      {"prompt_tokens", r.prompt_tokens},
                      {"prefilled_tokens", r.stats.prefill_tokens},
                      {"reused_tokens", r.reused_tokens},
                      {"pool_hit_tokens", pool_hits},
                      {"tier_hit_tokens", tier_hits},
                      {"decode_tokens", r.stats.decode_tokens},
                      {"steps", r.stats.steps},
                      {"busy_seconds", r.stats.busy_seconds},
                      {"wall_seconds", r.wall_s},
                      {"cpu_seconds", r.cpu_s},
                      {"prefill_cpu_seconds", r.prefill_cpu_s},
                      {"kv_pool_tokens", r.kv_tokens},
                      {"tiers",
                       {{"demoted_blocks", r.stats.tiers.demoted_blocks},
                        {"restored_blocks", r.stats.tiers.restored_blocks},
                        {"prefetched_blocks", r.stats.tiers.prefetched_blocks},
                        {"prefetch_wasted_blocks", r.stats.tiers.prefetch_wasted_blocks},
                        {"host_hits", r.stats.tiers.host_hits},
                        {"disk_hits", r.stats.tiers.disk_hits},
                        {"restore_seconds", r.stats.tiers.restore_seconds},
                        {"restore_stall_seconds", r.stats.tiers.restore_stall_seconds}}}};
  }
  nlohmann::json jratios = nlohmann::json::object();
  if (by_mode.contains("tiers")) {
    const ModeResult& t = *by_mode["tiers"];
    for (const std::string& base_mode : std::vector<std::string>{"recompute", "prefix"}) {
      if (!by_mode.contains(base_mode)) continue;
      const ModeResult& b = *by_mode[base_mode];
      const tandem::loadgen::Stats& st = ttft["tiers"];
      const tandem::loadgen::Stats& sb = ttft[base_mode];
      // Both modes replay the same prompts, so the throughput ratio is the prefill times' inverse.
      const double speedup = b.prefill_s / t.prefill_s, cpu_speedup = b.prefill_cpu_s / t.prefill_cpu_s;
      std::printf(
          "tiers vs %-9s: TTFT mean %+.1f%%, p50 %+.1f%%, p99 %+.1f%%; prefill throughput %.2fx (per prefill "
          "CPU "
          "second %.2fx)\n",
          base_mode.c_str(), Percent(st.mean, sb.mean), Percent(st.median, sb.median),
          Percent(st.p99, sb.p99), speedup, cpu_speedup);
      jratios[base_mode] = {{"ttft_mean_change", Percent(st.mean, sb.mean) / 100},
                            {"ttft_p50_change", Percent(st.median, sb.median) / 100},
                            {"ttft_p99_change", Percent(st.p99, sb.p99) / 100},
                            {"prefill_throughput_ratio", speedup},
                            {"prefill_cpu_throughput_ratio", cpu_speedup}};
    }
    std::printf("targets (issue 18): TTFT -80%%, prefill throughput >= 5x against recompute\n");
  }
  // Greedy tokens must not depend on the mode.
  // On the CPU every mode must give the same tokens. On a GPU, KV reused from the pool or a tier
  // holds the bf16 values of the pass that computed it, and a prompt prefilled in another batch
  // rounds differently, which can flip a near-tie: differences are counted there, not fatal.
  bool same = true;
  int64_t differing = 0;
  std::string diff;
  const ModeResult* first = nullptr;
  for (const ModeResult& r : results) {
    if (!r.error.empty()) continue;
    if (first == nullptr) {
      first = &r;
      continue;
    }
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (r.tokens[i] == first->tokens[i]) continue;
      if (same) diff = absl::StrCat("request ", i, ": ", r.mode, " differs from ", first->mode);
      same = false;
      ++differing;
    }
  }
  const bool on_cpu = f.device == "cpu";
  if (by_mode.size() > 1)
    std::printf("tokens: %s\n",
                same ? absl::StrCat("the same in every mode (", reqs.size(), " requests)").c_str()
                     : absl::StrCat(differing, " request(s) differ between modes (first: ", diff, ")",
                                    on_cpu ? "" : "; bf16 rounding of reused KV on a GPU")
                           .c_str());
  if (!f.json.empty()) {
    nlohmann::json j = {{"trace", f.trace},
                        {"model", f.model},
                        {"device", f.device},
                        {"flags",
                         {{"requests", f.requests},
                          {"block_tokens", f.block_tokens},
                          {"max_prompt", f.max_prompt},
                          {"output_scale", f.output_scale},
                          {"max_output", f.max_output},
                          {"time_scale", f.time_scale},
                          {"kv_tokens", kv_tokens},
                          {"kv_block", kv_block},
                          {"max_batch", f.max_batch},
                          {"step_tokens", f.step_tokens},
                          {"host_bytes", host_bytes},
                          {"disk_dir", f.disk_dir},
                          {"disk_bytes", f.disk_dir.empty() ? 0 : disk_bytes},
                          {"prefetch", f.prefetch},
                          {"eviction", f.eviction},
                          {"seed", f.seed}}},
                        {"shape",
                         {{"requests", shape.requests},
                          {"span_seconds", shape.span_s},
                          {"prompt_tokens", shape.prompt_tokens},
                          {"output_tokens", shape.output_tokens},
                          {"reusable_tokens", shape.reusable_tokens},
                          {"reusable_share", share},
                          {"prompts_cut", shape.prompts_cut},
                          {"outputs_cut", shape.outputs_cut},
                          {"longest_context", shape.longest_context}}},
                        {"modes", jmodes},
                        {"tiers_vs", jratios},
                        {"tokens_identical", same},
                        {"requests_differing", differing}};
    std::ofstream out(f.json);
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "mooncake_bench: --json %s: cannot write\n", f.json.c_str());
      return 1;
    }
  }
  if (!same && on_cpu) {
    std::fprintf(stderr, "mooncake_bench: tokens differ between modes: %s\n", diff.c_str());
    return 1;
  }
  return failed ? 1 : 0;
}
