// Decode step time of a disaggregated deployment on the GPUs of one host, split into compute,
// attention, exchange and idle, for each transport, beside the colocated engine on one GPU.
//
// Workload, as engine_decode_bench's: for each (batch B, context C), B requests with random prompts
// of C − decode-tokens tokens on a preset with random weights, prefilled in chunks and then decoded
// for --decode-tokens tokens (so every context ends at C). Only steps that carry no prefill tokens
// ("decode steps") are counted. The prefix cache is off on both sides (a deployment's default), and
// both sides use the same scheduler limits, so they run the same schedule.
//
// First the colocated CUDA engine on cuda:0 runs every (B, C) with phase timing on (CUDA events
// between the phases of each step: gemm, attention, other, sampling). Its attention phase per decode
// step is the "attention" figure: a memory rank runs the same kernels on the same kind of GPU. The
// engine is freed before any deployment starts. Then, per transport, one deployment runs every
// (B, C) in turn: --memory-ranks `tandem memory` processes on cuda:1.., compute rank 0 in this
// process on cuda:0, with phase timing on. Per decode step, averaged over the decode steps:
//   step       wall time of ComputeRank::Step
//   compute    gemm + other + sampling device time on the compute rank
//   attention  the colocated engine's attention phase for the same (B, C)
//   exchange   the compute rank's attention phase − attention. That phase runs from the q,k,v rows
//              being ready to the last memory rank's output being in place (both transfers, the
//              remote attention and any wait for it), so exchange is what disaggregation adds to
//              attention. Floored at 0, with a note, when the phase is shorter than the colocated
//              attention (the two run in different processes and can differ by noise);
//   idle       step − (compute + the attention phase): host work outside the device phases
//              (scheduling, the plan and release messages, launch gaps), when the compute GPU has
//              nothing queued;
//   eff        max(compute, attention, exchange) / step, the pipeline efficiency of
//              compute_node/pipeline_report.h;
// so step = compute + attention + exchange + idle. The colocated row has exchange 0 and idle = its
// host time. decode tok/s = tokens generated in decode steps / the wall time of those steps. The
// host-staged path (ucx) checksums its payloads, and p2p's and nccl's device waits check theirs, as
// a deployment does by default (--checksums).
//
// With --shared-gpu the memory ranks run on cuda:0 beside the compute rank (the one-GPU layout of
// the quick start; ucx stages through host memory, p2p signals with CUDA IPC events).
//
// KV: each memory rank is given room for its share (ceil(B / ranks) requests of C tokens; with
// --partition head, every request in tokens of its heads) of the
// largest (B, C) that fits in 90% of its GPU's memory less 2 GiB (shared GPU: the colocated
// engine's KV capacity, split among the memory ranks); larger ones are skipped with a note. A (B, C) that the
// colocated engine cannot hold still runs on the deployments, without attention and exchange ("-"). A
// transport is skipped, with the reason, when this build lacks it the host has fewer GPUs than the layout
// needs, or the transport cannot connect the layout (nccl refuses ranks that share a GPU, unless
// TANDEM_NCCL_SHARE_GPU=1 makes each process a host of its own to NCCL: transfers over sockets).
//
// Never hangs: every run has a wall limit (--run-timeout), checked between steps and enforced by a
// watchdog that ends the process (the memory ranks die with it) a minute after it; start-up has
// --startup-timeout. Errors are printed and make the exit status non-zero; a failed transport does
// not stop the others.
//
// Usage: deploy_step_bench --model llama3-8b [--transports ucx,p2p,nccl] [--batches 64,256]
//                          [--contexts 1024,4096] [--decode-tokens 16] [--memory-ranks 1]
//                          [--json PATH] [--tandem PATH] [--run-timeout 600] [--startup-timeout 600]
//                          [--checksums 1] [--shared-gpu 0|1] [--partition request|head]
//                          [--pipeline-batches 1,2]
// --compute-ranks C > 1 puts compute ranks on cuda:0 .. cuda:C-1 (replicas 1.. as `tandem compute
// --replica` processes; pipeline.mode fixed, or rotational with --slice-layers N > 0) and the
// memory ranks after them.
// --pipeline-batches runs every transport once per value: 1 runs steps whole, N > 1 with
// pipeline.mode pingpong over N micro-batches (the row's transport reads "p2p/pp2"). In a pingpong
// row the attention phase is only the compute rank's wait for attention (the rest overlaps its
// linear layers), so exchange reads 0 (floored) and eff shows how busy compute stays.
#include <cuda_runtime.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "colocated/engine.h"
#include "common/bootstrap/deployment_key.h"
#include "common/head_partition.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "compute_node/compute_rank.h"
#include "compute_node/controller.h"
#include "compute_node/weights.h"
#include "deploy/local_ranks.h"
#include "deploy/process_group.h"
#include "linear_floor.h"

#ifndef TANDEM_BINARY_DEFAULT
#define TANDEM_BINARY_DEFAULT "tandem"
#endif

namespace {

using tandem::ColocatedEngine;
using tandem::ComputeRank;
using tandem::GenerationRequest;
using tandem::GenerationResult;
namespace transport = tandem::transport;

constexpr const char* kUsage =
    "usage: deploy_step_bench --model NAME [--transports ucx,p2p,nccl] [--batches 64,256]\n"
    "                         [--contexts 1024,4096] [--decode-tokens 16] [--memory-ranks 1]\n"
    "                         [--json PATH] [--tandem PATH] [--run-timeout S] [--startup-timeout S]\n"
    "                         [--checksums 0|1] [--max-tokens-per-step N] [--cuda-graphs 0|1]\n"
    "                         [--shared-gpu 0|1] [--partition request|head] [--pipeline-batches 1,2]\n"
    "                         [--compute-ranks 1] [--slice-layers 0]\n"
    "Decode step time of a deployment (compute rank on cuda:0, memory ranks on cuda:1..) per\n"
    "transport, split into compute, attention, exchange and idle, beside the colocated engine.\n"
    "  --model            preset name (random weights, seed 0) or checkpoint directory\n"
    "  --transports       transports to measure, in order (ucx, p2p, nccl, verbs)\n"
    "  --batches          requests per run (comma-separated)\n"
    "  --contexts         context length each request reaches (comma-separated, > decode tokens)\n"
    "  --decode-tokens    tokens generated per request (>= 2)\n"
    "  --memory-ranks     memory rank processes, on cuda:1 .. cuda:N\n"
    "  --shared-gpu       1: the memory ranks on cuda:0 with the compute rank (one GPU); 0 (default)\n"
    "  --partition        memory.partition: request (default) or head (every rank a slice of KV heads)\n"
    "  --pipeline-batches micro-batches per step, each a run of every transport: 1 is pipeline.mode none,\n"
    "                     N > 1 pingpong with N micro-batches (rows \"TRANSPORT/ppN\"; default 1)\n"
    "  --compute-ranks    compute ranks (cuda:0 .. cuda:C-1; memory ranks after them): C > 1 runs\n"
    "                     pipeline.mode fixed with compute replicas, for --pipeline-batches values >= C\n"
    "                     (rows \"TRANSPORT/CcNb\"; default 1)\n"
    "  --slice-layers     with --compute-ranks > 1: N > 0 runs pipeline.mode rotational, slices of N layers\n"
    "                     moving round the compute ranks (rows \"TRANSPORT/CcNbrN\"); 0 (default) fixed\n"
    "  --json             also write the rows as a JSON array to PATH\n"
    "  --tandem           the tandem executable that runs the memory ranks\n"
    "  --run-timeout      wall limit of one (transport, batch, context) run, seconds (600)\n"
    "  --startup-timeout  limit for loading weights and starting a deployment, seconds (600)\n"
    "  --checksums        payload checksums, as a deployment's default (1): crc32c of the host-staged (ucx)\n"
    "                     payloads; p2p's and nccl's device waits check each payload's checksum\n"
    "  --max-tokens-per-step  rows per step (decode + prefill chunk), both sides (max(8192, batch))\n"
    "  --cuda-graphs      layer parts as CUDA graphs on both sides (1), or launched one by one (0, the "
    "default)\n"
    "Per decode step it also prints rows (decode rows actually run), linear (gemm + other, ms) and\n"
    "floor (the same matrix products as bare cuBLAS calls in one CUDA graph, measured first).\n";

absl::StatusOr<std::vector<int64_t>> ParseList(const std::string& flag, const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(p, &v) || v <= 0)
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", p, "' is not a positive integer"));
    out.push_back(v);
  }
  return out;
}

absl::StatusOr<double> ParseSeconds(const std::string& flag, const std::string& s) {
  double v = 0;
  if (!absl::SimpleAtod(s, &v) || !(v > 0))
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", s, "' is not a positive number of seconds"));
  return v;
}

double PhaseMs(const std::vector<std::pair<std::string, double>>& totals, const std::string& name) {
  for (const auto& [n, ms] : totals)
    if (n == name) return ms;
  return 0;
}

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Ends the process when an armed activity outlives its limit: the last resort behind the
// deadlines of every wait. The memory ranks die with this process (ProcessGroup sets their parent
// death signal).
class Watchdog {
 public:
  Watchdog() : thread_([this] { Loop(); }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Arm(const std::string& what, double seconds) {
    std::lock_guard<std::mutex> lock(mu_);
    what_ = what;
    limit_s_ = seconds;
    deadline_ =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(seconds));
    armed_ = true;
    cv_.notify_all();
  }
  void Disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (armed_ && std::chrono::steady_clock::now() >= deadline_) {
        std::fprintf(stderr, "deploy_step_bench: %s did not end within %.0f s; exiting\n", what_.c_str(),
                     limit_s_);
        std::fflush(stderr);
        std::fflush(stdout);
        std::_Exit(1);
      }
      cv_.wait_for(lock, std::chrono::milliseconds(500));
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, armed_ = false;
  std::string what_;
  double limit_s_ = 0;
  std::chrono::steady_clock::time_point deadline_;
  std::thread thread_;
};

struct Combo {
  int64_t batch = 0, context = 0;
};

// The requests of one (B, C): the same tokens for the engine and every transport. Chunked prefill
// admits about max_tokens / C requests per step, and requests prefilled early decode meanwhile;
// so that all B decode together, each request generates `ramp` (the prefill steps of the batch)
// tokens more than `decode_tokens`, from a prompt that much shorter: contexts still end at C.
int64_t RampTokens(const Combo& c, int64_t decode_tokens, int64_t max_tokens) {
  const int64_t prompt = c.context - decode_tokens;
  return std::min(prompt / 2, (c.batch * prompt + max_tokens - 1) / max_tokens + 1);
}

std::vector<GenerationRequest> MakeRequests(const Combo& c, int64_t decode_tokens, int64_t vocab,
                                            int64_t max_tokens) {
  std::mt19937 rng(static_cast<uint32_t>(11 + 7919 * c.batch + c.context));
  const int64_t ramp = RampTokens(c, decode_tokens, max_tokens);
  std::vector<GenerationRequest> reqs(static_cast<size_t>(c.batch));
  for (GenerationRequest& r : reqs) {
    r.prompt.resize(static_cast<size_t>(c.context - decode_tokens - ramp));
    for (int32_t& t : r.prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
    r.max_tokens = decode_tokens + ramp;
    r.ignore_eos = true;
  }
  return reqs;
}

// Totals over the decode steps of one run.
struct Figures {
  int64_t decode_steps = 0, decode_tokens = 0;
  int64_t max_rows = 0;  // most rows seen in a decode step (< the batch: capped)
  double decode_s = 0, prefill_s = 0;
  double phase_ms[4] = {0, 0, 0, 0};  // gemm, attention, other, sampling
};
constexpr const char* kPhases[4] = {"gemm", "attention", "other", "sampling"};

// Submits the requests and steps until `idle()`; the engine and a compute rank alike. Counts the
// decode steps that run every request (all of them when none does: see Figures::max_rows).
// Fails when a step fails, makes no progress, or the run passes `limit_s`.
template <typename Runner, typename IdleFn>
absl::StatusOr<Figures> RunWorkload(Runner& runner, IdleFn idle, std::vector<GenerationRequest> requests,
                                    double limit_s) {
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::StatusOr<int64_t> id = runner.Submit(std::move(requests[i]));
    if (!id.ok()) return tandem::Annotate(id.status(), absl::StrCat("submitting request ", i));
  }
  const int64_t batch = static_cast<int64_t>(requests.size());
  Figures f, partial;  // decode steps of the whole batch, and the others
  std::vector<std::pair<int64_t, GenerationResult>> done;
  int64_t steps = 0;
  while (!idle()) {
    if (Since(t0) > limit_s) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "the run did not finish within %.0f s (--run-timeout) after %d steps", limit_s, steps));
    }
    const int64_t prefill_before = runner.stats().prefill_tokens;
    const int64_t decode_before = runner.stats().decode_tokens;
    const auto totals_before = runner.PhaseTotalsMs();
    const auto s0 = std::chrono::steady_clock::now();
    done.clear();
    if (absl::Status st = runner.Step(&done); !st.ok())
      return tandem::Annotate(st, absl::StrCat("step ", steps));
    const double dt = Since(s0);
    ++steps;
    const int64_t prefilled = runner.stats().prefill_tokens - prefill_before;
    const int64_t decoded = runner.stats().decode_tokens - decode_before;
    if (prefilled == 0 && decoded == 0) {
      return absl::InternalError(
          absl::StrCat("step ", steps - 1, " made no progress (the requests are not all admitted?)"));
    }
    if (prefilled == 0) {
      Figures& into = decoded == batch ? f : partial;
      into.decode_s += dt;
      ++into.decode_steps;
      into.decode_tokens += decoded;
      f.max_rows = std::max(f.max_rows, decoded);
      const auto totals_after = runner.PhaseTotalsMs();
      for (int p = 0; p < 4; ++p)
        into.phase_ms[p] += PhaseMs(totals_after, kPhases[p]) - PhaseMs(totals_before, kPhases[p]);
    } else {
      f.prefill_s += dt;
    }
  }
  if (f.decode_steps == 0) {
    if (partial.decode_steps == 0) return absl::InternalError("the run had no decode steps");
    partial.prefill_s = f.prefill_s;
    partial.max_rows = f.max_rows;
    return partial;
  }
  return f;
}

// One row of the table (per decode step).
struct Row {
  std::string transport;
  int order = 0;  // of the transport: colocated first, then --transports
  Combo combo;
  int64_t decode_steps = 0;
  double rows_per_step = 0, step_ms = 0, compute_ms = 0, gemm_ms = 0, other_ms = 0, sample_ms = 0;
  double phase_ms = 0;                              // this side's attention phase
  std::optional<double> attention_ms, exchange_ms;  // none without a colocated baseline
  bool floored = false;                             // exchange < 0, shown as 0
  double idle_ms = 0, tok_s = 0, prefill_s = 0;
  std::string note;
};

Row MakeRow(const std::string& transport, int order, const Combo& c, const Figures& f) {
  Row r;
  r.transport = transport;
  r.order = order;
  r.combo = c;
  const double n = static_cast<double>(f.decode_steps);
  r.decode_steps = f.decode_steps;
  r.rows_per_step = static_cast<double>(f.decode_tokens) / n;
  r.step_ms = 1e3 * f.decode_s / n;
  r.gemm_ms = f.phase_ms[0] / n;
  r.phase_ms = f.phase_ms[1] / n;
  r.other_ms = f.phase_ms[2] / n;
  r.sample_ms = f.phase_ms[3] / n;
  r.compute_ms = r.gemm_ms + r.other_ms + r.sample_ms;
  r.idle_ms = r.step_ms - (r.compute_ms + r.phase_ms);
  r.tok_s = f.decode_s > 0 ? static_cast<double>(f.decode_tokens) / f.decode_s : 0;
  r.prefill_s = f.prefill_s;
  if (f.max_rows < c.batch)
    r.note = absl::StrFormat("capped at %d rows per step (KV cache or --max-tokens-per-step)", f.max_rows);
  return r;
}

std::string Fmt(const std::optional<double>& v) { return v ? absl::StrFormat("%.2f", *v) : "-"; }
std::string Json(const std::optional<double>& v) { return v ? absl::StrCat(*v) : "null"; }
std::string Quoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    if (static_cast<unsigned char>(ch) >= 0x20) out += ch;
  }
  return out + "\"";
}

absl::Status WriteJson(const std::string& path, const std::string& model, const std::string& device,
                       int memory_ranks, int64_t decode_tokens, const std::vector<Row>& rows) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  out << "[\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    out << (i ? ",\n" : "") << "{\"model\":" << Quoted(model) << ",\"device\":" << Quoted(device)
        << ",\"transport\":" << Quoted(r.transport)
        << ",\"memory_ranks\":" << (r.transport == "colocated" ? 0 : memory_ranks)
        << ",\"batch\":" << r.combo.batch << ",\"context\":" << r.combo.context
        << ",\"decode_tokens\":" << decode_tokens << ",\"decode_steps\":" << r.decode_steps
        << ",\"rows_per_step\":" << r.rows_per_step << ",\"step_ms\":" << r.step_ms
        << ",\"compute_ms\":" << r.compute_ms << ",\"attention_ms\":" << Json(r.attention_ms)
        << ",\"exchange_ms\":" << Json(r.exchange_ms)
        << ",\"exchange_floored\":" << (r.floored ? "true" : "false") << ",\"idle_ms\":" << r.idle_ms
        << ",\"decode_tok_s\":" << r.tok_s << ",\"attention_phase_ms\":" << r.phase_ms
        << ",\"gemm_ms\":" << r.gemm_ms << ",\"other_ms\":" << r.other_ms << ",\"sample_ms\":" << r.sample_ms
        << ",\"prefill_s\":" << r.prefill_s << ",\"note\":" << Quoted(r.note) << "}";
  }
  out << "\n]\n";
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("writing ", path, " failed"));
  return absl::OkStatus();
}

// Memory rank processes and compute rank 0 in this process.
struct Deployment {
  std::string dir;
  tandem::ProcessGroup group;
  std::vector<std::string> names;
  std::unique_ptr<tandem::LocalMemoryRanks> local;  // transport local: memory ranks as threads
  std::unique_ptr<ComputeRank> rank;                // destroyed first
};

struct Settings {
  std::string tandem;
  int memory_ranks = 1;
  int64_t max_batch = 0, max_tokens = 0, kv_tokens = 0;
  double startup_s = 600, step_timeout_s = 120;
  bool checksums = true;
  bool cuda_graphs = false;
  bool shared_gpu = false;  // memory ranks on cuda:0
  tandem::AttentionPartition partition = tandem::AttentionPartition::kRequest;
  int micro_batches = 1;  // pipeline.batches (1: pipeline.mode none)
  int compute_ranks = 1;  // compute.ranks: replicas 1.. as `tandem compute --replica` processes
  int slice_layers = 0;   // pipeline.slice_layers of pipeline.mode rotational; 0: fixed
  std::string model;      // what the replicas load (model.path, weight seed 0)
};

// Compute ranks on cuda:0 .. cuda:C-1, memory ranks after them (all on cuda:0 with --shared-gpu).
int MemoryDevice(const Settings& s, int m) { return s.shared_gpu ? 0 : s.compute_ranks + m; }
int ReplicaDevice(const Settings& s, int r) { return s.shared_gpu ? 0 : r; }

absl::Status StartDeployment(const tandem::WeightSource& source, transport::TransportKind kind,
                             const Settings& s, Deployment* d) {
  std::string tmpl = (std::filesystem::temp_directory_path() / "deploy-step-bench-XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) return tandem::ErrnoToStatus(errno, absl::StrCat("mkdtemp ", tmpl));
  d->dir = tmpl;
  const std::string yaml = d->dir + "/deploy.yaml";
  {
    std::ofstream(yaml) << "launch:\n  startup_timeout_s: " << s.startup_s
                        << "\n  step_timeout_s: " << s.step_timeout_s << "\n";
  }
  // The memory ranks inherit this run's secret (TANDEM_SECRET_FILE; common/bootstrap/deployment_key.h).
  RETURN_IF_ERROR(tandem::bootstrap::ShareNewKeyWithChildren(d->dir + "/secret"));
  const bool in_process = transport::GetTransportInfo(kind).one_process;
  if (in_process) {
    std::vector<std::string> devices;
    for (int m = 0; m < s.memory_ranks; ++m) devices.push_back(absl::StrCat("cuda:", MemoryDevice(s, m)));
    std::fprintf(stderr, "  starting %d memory rank(s) as threads of this process (local)\n", s.memory_ranks);
    absl::StatusOr<std::unique_ptr<tandem::LocalMemoryRanks>> local = tandem::LocalMemoryRanks::Start(
        devices, {.startup = absl::Seconds(s.startup_s), .step = absl::Seconds(s.step_timeout_s)});
    if (!local.ok()) return local.status();
    d->local = std::move(*local);
  }
  for (int m = 0; m < s.memory_ranks && !in_process; ++m) {
    const std::string name = absl::StrCat("memory-", m);
    std::fprintf(stderr, "  starting %s on cuda:%d (%s)\n", name.c_str(), MemoryDevice(s, m),
                 transport::TransportKindName(kind));
    if (absl::Status st = d->group.Start(
            name,
            {s.tandem, "memory", "--config", yaml, "--rank", std::to_string(m), "--listen", "127.0.0.1:0",
             "--device", absl::StrCat("cuda:", MemoryDevice(s, m)), "--transport",
             transport::TransportKindName(kind), "--ready-file", d->dir + "/" + name + ".ready"},
            d->dir + "/" + name + ".log");
        !st.ok())
      return st;
    d->names.push_back(name);
  }
  std::vector<std::string> addresses;
  if (d->local) addresses = d->local->addresses();
  for (const std::string& name : d->names) {
    absl::StatusOr<std::string> address =
        d->group.WaitReady(name, d->dir + "/" + name + ".ready", absl::Seconds(s.startup_s));
    if (!address.ok()) return address.status();
    while (!address->empty() && (address->back() == '\n' || address->back() == '\r')) address->pop_back();
    addresses.push_back(*address);
  }
  tandem::ComputeRankOptions o;
  o.device = 0;
  o.transport = kind;
  o.memory_addresses = addresses;
  // Compute replicas (pipeline.mode fixed): processes of their own, started once the memory ranks
  // listen, each loading the same weights on its GPU.
  if (s.compute_ranks > 1) {
    const std::string config = d->dir + "/replicas.yaml";
    std::ofstream(config) << "model:\n  path: " << s.model
                          << "\n  weight_seed: 0\ncompute:\n  ranks: " << s.compute_ranks
                          << "\n  cuda_graphs: " << (s.cuda_graphs ? "true" : "false")
                          << "\nmemory:\n  ranks: " << s.memory_ranks
                          << "\n  partition: " << tandem::AttentionPartitionName(s.partition)
                          << "\npipeline:\n  mode: " << (s.slice_layers > 0 ? "rotational" : "fixed")
                          << "\n  slice_layers: " << std::max(1, s.slice_layers)
                          << "\n  batches: " << s.micro_batches
                          << "\nscheduler:\n  max_batch_size: " << s.max_batch
                          << "\n  max_tokens_per_step: " << s.max_tokens
                          << "\ntransport:\n  checksums: " << (s.checksums ? "true" : "false")
                          << "\nlaunch:\n  startup_timeout_s: " << s.startup_s
                          << "\n  step_timeout_s: " << s.step_timeout_s << "\n";
    std::vector<std::string> names;
    for (int r = 1; r < s.compute_ranks; ++r) {
      const std::string name = absl::StrCat("compute-", r);
      std::fprintf(stderr, "  starting %s on cuda:%d (%s)\n", name.c_str(), ReplicaDevice(s, r),
                   transport::TransportKindName(kind));
      if (absl::Status st = d->group.Start(
              name,
              {s.tandem, "compute", "--replica", std::to_string(r), "--config", config, "--memory",
               absl::StrJoin(addresses, ","), "--listen", "127.0.0.1:0", "--device",
               absl::StrCat("cuda:", ReplicaDevice(s, r)), "--transport", transport::TransportKindName(kind),
               "--ready-file", d->dir + "/" + name + ".ready"},
              d->dir + "/" + name + ".log");
          !st.ok())
        return st;
      d->names.push_back(name);
      names.push_back(name);
    }
    for (const std::string& name : names) {
      absl::StatusOr<std::string> address =
          d->group.WaitReady(name, d->dir + "/" + name + ".ready", absl::Seconds(s.startup_s));
      if (!address.ok()) return address.status();
      o.replica_addresses.emplace_back(absl::StripAsciiWhitespace(*address));
    }
  }
  absl::StatusOr<tandem::ControllerOptions> sched =
      tandem::ResolveSchedulerOptions(s.max_batch, s.max_tokens);
  if (!sched.ok()) return sched.status();
  o.scheduler = *sched;
  o.kv_capacity_tokens = s.kv_tokens;
  o.checksums = s.checksums;
  o.profile = true;
  o.cuda_graphs = s.cuda_graphs;
  o.partition = s.partition;
  o.micro_batches = s.micro_batches;
  o.slice_layers = s.compute_ranks > 1 ? s.slice_layers : 0;
  o.startup_timeout = absl::Seconds(s.startup_s);
  o.step_timeout = absl::Seconds(s.step_timeout_s);
  std::fprintf(stderr, "  loading the weights on cuda:0 and connecting to %d memory rank(s)\n",
               s.memory_ranks);
  absl::StatusOr<std::unique_ptr<ComputeRank>> rank = ComputeRank::Create(source, o);
  if (!rank.ok()) return rank.status();
  d->rank = std::move(*rank);
  for (const std::string& line : d->rank->memory_ranks()) std::fprintf(stderr, "  %s\n", line.c_str());
  return absl::OkStatus();
}

// Says bye, gives the memory ranks 20 s to exit (none after a failure), stops what is left. With
// `failed`, prints their logs' last lines and keeps the directory; otherwise removes it.
void StopDeployment(Deployment* d, bool failed) {
  if (d->rank) {
    (void)d->rank->Shutdown();
    d->rank.reset();
  }
  if (d->local) {
    if (absl::Status st = d->local->Join(absl::Now() + absl::Seconds(failed ? 1 : 20)); !st.ok())
      std::fprintf(stderr, "  warning: %s\n", std::string(st.message()).c_str());
    d->local.reset();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (const std::string& name : d->names) {
    if (failed || !d->group.running(name)) continue;  // after a failure: stopped at once below
    const int fd = static_cast<int>(syscall(SYS_pidfd_open, d->group.pid(name), 0));
    if (fd < 0) continue;
    pollfd p{.fd = fd, .events = POLLIN, .revents = 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())
            .count();
    if (poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left))) == 1) {
      if (absl::Status st = d->group.WaitExit(name); !st.ok())
        std::fprintf(stderr, "  warning: %s\n", std::string(st.message()).c_str());
    }
    close(fd);
  }
  for (const std::string& name : d->group.StopAll(absl::Seconds(5)))
    std::fprintf(stderr, "  warning: %s needed SIGKILL\n", name.c_str());
  if (failed) {
    for (const std::string& name : d->names)
      std::fprintf(stderr, "--- last lines of %s's log (%s):\n%s\n", name.c_str(), d->dir.c_str(),
                   d->group.LogTail(name, 30).c_str());
  } else if (!d->dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(d->dir, ec);
  }
}

std::string Label(const std::string& transport, const Combo& c) {
  return absl::StrCat(transport, " batch ", c.batch, " context ", c.context);
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b", json_path, tandem_binary = TANDEM_BINARY_DEFAULT;
  std::string transports_flag = "ucx,p2p,nccl";
  std::vector<int64_t> batches = {64, 256}, contexts = {1024, 4096}, pipeline_batches = {1};
  int64_t decode_tokens = 16, memory_ranks = 1, max_tokens_flag = 0, compute_ranks = 1, slice_layers = 0;
  double run_timeout_s = 600, startup_s = 600;
  bool checksums = true, cuda_graphs = false, shared_gpu = false;
  tandem::AttentionPartition partition = tandem::AttentionPartition::kRequest;
  auto fail = [](const absl::Status& st) {
    std::fprintf(stderr, "deploy_step_bench: %s\n", std::string(st.message()).c_str());
    return 1;
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "deploy_step_bench: %s needs a value\n%s", k.c_str(), kUsage);
      return 2;
    }
    const std::string v = argv[i + 1];
    absl::Status st;
    if (k == "--model") {
      model = v;
    } else if (k == "--transports") {
      transports_flag = v;
    } else if (k == "--batches" || k == "--contexts") {
      absl::StatusOr<std::vector<int64_t>> list = ParseList(k, v);
      if (list.ok()) (k == "--batches" ? batches : contexts) = *list;
      st = list.status();
    } else if (k == "--pipeline-batches") {
      absl::StatusOr<std::vector<int64_t>> list = ParseList(k, v);
      if (list.ok()) pipeline_batches = *list;
      st = list.status();
      for (int64_t n : pipeline_batches) {
        if (st.ok() && (n < 1 || n > 8))
          st = absl::InvalidArgumentError(absl::StrCat(k, ": ", n, " is not in [1, 8]"));
      }
    } else if (k == "--decode-tokens") {
      if (!absl::SimpleAtoi(v, &decode_tokens) || decode_tokens < 2)
        st = absl::InvalidArgumentError(absl::StrCat(k, ": '", v, "' is not an integer >= 2"));
    } else if (k == "--slice-layers") {
      if (!absl::SimpleAtoi(v, &slice_layers) || slice_layers < 0 || slice_layers > 1 << 16)
        st = absl::InvalidArgumentError(absl::StrCat(k, ": '", v, "' is not an integer in [0, 65536]"));
    } else if (k == "--compute-ranks") {
      if (!absl::SimpleAtoi(v, &compute_ranks) || compute_ranks < 1 || compute_ranks > 8)
        st = absl::InvalidArgumentError(absl::StrCat(k, ": '", v, "' is not an integer in [1, 8]"));
    } else if (k == "--memory-ranks") {
      if (!absl::SimpleAtoi(v, &memory_ranks) || memory_ranks < 1 || memory_ranks > 63)
        st = absl::InvalidArgumentError(absl::StrCat(k, ": '", v, "' is not an integer in [1, 63]"));
    } else if (k == "--json") {
      json_path = v;
    } else if (k == "--tandem") {
      tandem_binary = v;
    } else if (k == "--run-timeout" || k == "--startup-timeout") {
      absl::StatusOr<double> s = ParseSeconds(k, v);
      if (s.ok()) (k == "--run-timeout" ? run_timeout_s : startup_s) = *s;
      st = s.status();
    } else if (k == "--checksums") {
      if (v != "0" && v != "1") st = absl::InvalidArgumentError("--checksums: 0 or 1");
      checksums = v == "1";
    } else if (k == "--partition") {
      absl::StatusOr<tandem::AttentionPartition> p = tandem::ParseAttentionPartition(v);
      if (p.ok()) partition = *p;
      st = p.status();
    } else if (k == "--shared-gpu") {
      if (v != "0" && v != "1") st = absl::InvalidArgumentError("--shared-gpu: 0 or 1");
      shared_gpu = v == "1";
    } else if (k == "--cuda-graphs") {
      if (v != "0" && v != "1") st = absl::InvalidArgumentError("--cuda-graphs: 0 or 1");
      cuda_graphs = v == "1";
    } else if (k == "--max-tokens-per-step") {
      if (!absl::SimpleAtoi(v, &max_tokens_flag) || max_tokens_flag < 1)
        st = absl::InvalidArgumentError(absl::StrCat(k, ": '", v, "' is not a positive integer"));
    } else {
      std::fprintf(stderr, "deploy_step_bench: unknown flag %s\n%s", k.c_str(), kUsage);
      return 2;
    }
    if (!st.ok()) {
      std::fprintf(stderr, "deploy_step_bench: %s\n", std::string(st.message()).c_str());
      return 2;
    }
  }
  std::vector<transport::TransportKind> kinds;
  for (absl::string_view name : absl::StrSplit(transports_flag, ',')) {
    absl::StatusOr<transport::TransportKind> kind = transport::ParseTransportKind(std::string(name));
    if (!kind.ok()) return fail(tandem::Annotate(kind.status(), "--transports"));
    kinds.push_back(*kind);
  }
  for (int64_t c : contexts) {
    if (c <= decode_tokens) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--contexts: ", c, " leaves no prompt before ", decode_tokens, " decode tokens")));
    }
  }
  if (access(tandem_binary.c_str(), X_OK) != 0) {
    return fail(absl::NotFoundError(
        absl::StrCat("--tandem: '", tandem_binary, "' is not an executable (build the tandem target)")));
  }
  if (!json_path.empty()) {  // valid (empty) from the start, rewritten after every row
    if (absl::Status st = WriteJson(json_path, model, "", 0, 0, {}); !st.ok())
      return fail(tandem::Annotate(st, "--json"));
  }

  absl::StatusOr<std::unique_ptr<tandem::WeightSource>> source = tandem::OpenModel(model, 0);
  if (!source.ok()) return fail(source.status());
  const tandem::ModelSpec spec = (*source)->spec();
  for (int64_t c : contexts) {
    if (c > spec.max_position) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--contexts: ", c, " exceeds the model's context of ", spec.max_position, " tokens")));
    }
  }
  int gpus = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&gpus); e != cudaSuccess || gpus < 1) {
    return fail(absl::UnavailableError(
        absl::StrCat("no CUDA device (", e == cudaSuccess ? "none found" : cudaGetErrorString(e),
                     "); this benchmark needs ", shared_gpu ? 1 : 1 + memory_ranks, " GPUs")));
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const std::string device_name = prop.name;

  Watchdog watchdog;
  std::vector<Combo> combos;
  for (int64_t c : contexts)
    for (int64_t b : batches) combos.push_back({b, c});
  const int64_t max_batch = *std::max_element(batches.begin(), batches.end());
  const int64_t max_tokens =
      max_tokens_flag > 0 ? std::max(max_tokens_flag, max_batch) : std::max<int64_t>(8192, max_batch);
  // The linear layers' floor for every batch (the rows of a decode step that runs all of them).
  std::vector<int64_t> batch_rows;
  for (const Combo& c : combos)
    if (std::find(batch_rows.begin(), batch_rows.end(), c.batch) == batch_rows.end())
      batch_rows.push_back(c.batch);
  std::fprintf(stderr, "measuring the linear layers' floor (cuBLAS in one CUDA graph) on cuda:0\n");
  const std::vector<double> floor_ms = tandem::bench::LinearFloorMs(spec, batch_rows);
  auto floor_of = [&](int64_t rows) -> std::optional<double> {
    for (size_t i = 0; i < floor_ms.size(); ++i)
      if (batch_rows[i] == rows) return floor_ms[i];
    return std::nullopt;
  };

  std::vector<Row> rows;
  std::vector<std::string> notes;  // skipped and failed runs, printed under the table
  bool failed = false;
  auto record = [&](Row row) {
    rows.push_back(std::move(row));
    if (json_path.empty()) return;
    if (absl::Status st =
            WriteJson(json_path, model, device_name, static_cast<int>(memory_ranks), decode_tokens, rows);
        !st.ok()) {
      std::fprintf(stderr, "deploy_step_bench: %s\n", std::string(st.message()).c_str());
      failed = true;
    }
  };
  auto progress = [](const Row& r) {
    std::fprintf(stderr,
                 "  %s: %lld decode steps, %.2f ms/step (compute %.2f, attention phase %.2f, idle %.2f), "
                 "%.0f tok/s, prefill %.1f s\n",
                 Label(r.transport, r.combo).c_str(), static_cast<long long>(r.decode_steps), r.step_ms,
                 r.compute_ms, r.phase_ms, r.idle_ms, r.tok_s, r.prefill_s);
  };

  // The colocated baseline: attention per decode step of every (B, C).
  std::vector<std::optional<double>> baseline(combos.size());
  int64_t colocated_kv = 0;  // the engine's KV capacity on cuda:0, beside the weights
  {
    tandem::EngineOptions eo;
    eo.device = "cuda:0";
    eo.max_batch_size = max_batch;
    eo.max_tokens_per_step = max_tokens;
    eo.prefix_cache = false;
    eo.prefix_sharing = "off";
    eo.profile = true;
    eo.cuda_graphs = cuda_graphs;
    std::fprintf(stderr, "loading %s into the colocated engine on cuda:0\n", model.c_str());
    watchdog.Arm("loading the colocated engine", startup_s);
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::unique_ptr<ColocatedEngine>> engine = ColocatedEngine::Create(**source, eo);
    watchdog.Disarm();
    if (!engine.ok()) return fail(tandem::Annotate(engine.status(), "colocated engine"));
    colocated_kv = (*engine)->kv_capacity_tokens();
    std::fprintf(stderr, "loaded in %.1f s; KV capacity %lld tokens\n", Since(t0),
                 static_cast<long long>(colocated_kv));
    for (size_t i = 0; i < combos.size(); ++i) {
      const Combo& c = combos[i];
      if (c.batch * c.context > (*engine)->kv_capacity_tokens()) {
        notes.push_back(absl::StrCat(Label("colocated", c), ": does not fit in the engine's KV cache (",
                                     (*engine)->kv_capacity_tokens(), " tokens); no attention baseline"));
        std::fprintf(stderr, "  %s\n", notes.back().c_str());
        continue;
      }
      std::fprintf(stderr, "  running %s\n", Label("colocated", c).c_str());
      watchdog.Arm(Label("colocated", c), run_timeout_s + 60);
      absl::StatusOr<Figures> f = RunWorkload(
          **engine, [&] { return (*engine)->Idle(); },
          MakeRequests(c, decode_tokens, spec.vocab_size, max_tokens), run_timeout_s);
      watchdog.Disarm();
      if (!f.ok()) return fail(tandem::Annotate(f.status(), Label("colocated", c)));
      Row r = MakeRow("colocated", 0, c, *f);
      r.attention_ms = r.phase_ms;
      r.exchange_ms = 0.0;
      baseline[i] = r.phase_ms;
      progress(r);
      record(std::move(r));
    }
  }  // the engine's weights and KV leave cuda:0 before any compute rank loads
  cudaDeviceSynchronize();

  // The deployments.
  // Head partition: every rank holds every request, a token of its slice costs its share of a
  // token: the largest slice's, ceil(Hkv / ranks) of the Hkv heads (the slices differ by one head
  // where the ranks do not divide them).
  const bool head = partition == tandem::AttentionPartition::kHead;
  const int64_t largest_slice = (spec.num_kv_heads + memory_ranks - 1) / memory_ranks;
  const int64_t per_token =
      head ? spec.kv_bytes_per_token(2) * largest_slice / spec.num_kv_heads : spec.kv_bytes_per_token(2);
  int64_t budget = INT64_MAX;  // KV tokens a memory rank can hold
  if (shared_gpu) budget = head ? colocated_kv : colocated_kv / memory_ranks;
  for (int m = 0; !shared_gpu && m < memory_ranks && compute_ranks + m < gpus; ++m) {
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, static_cast<int>(compute_ranks) + m) != cudaSuccess) continue;
    const double bytes = 0.9 * static_cast<double>(p.totalGlobalMem) - 2.0 * (1LL << 30);
    budget = std::min(budget, static_cast<int64_t>(std::max(0.0, bytes) / static_cast<double>(per_token)));
  }
  auto need = [&](const Combo& c) {
    return head ? c.batch * c.context : (c.batch + memory_ranks - 1) / memory_ranks * c.context;
  };
  std::vector<bool> fits(combos.size());
  int64_t kv_tokens = 0;
  for (size_t i = 0; i < combos.size(); ++i) {
    fits[i] = need(combos[i]) <= budget;
    if (fits[i]) kv_tokens = std::max(kv_tokens, need(combos[i]));
  }
  Settings settings{.tandem = tandem_binary,
                    .memory_ranks = static_cast<int>(memory_ranks),
                    .max_batch = max_batch,
                    .max_tokens = max_tokens,
                    .kv_tokens = kv_tokens + 256,
                    .startup_s = startup_s,
                    .step_timeout_s = std::min(120.0, run_timeout_s),
                    .checksums = checksums,
                    .cuda_graphs = cuda_graphs,
                    .shared_gpu = shared_gpu,
                    .partition = partition,
                    .micro_batches = 1,
                    .compute_ranks = static_cast<int>(compute_ranks),
                    .slice_layers = static_cast<int>(slice_layers),
                    .model = model};
  transport::RankLayout layout{.compute_device = 0};
  for (int m = 0; m < memory_ranks; ++m) layout.memory_devices.push_back(MemoryDevice(settings, m));
  // Every transport once per --pipeline-batches value.
  std::vector<std::pair<transport::TransportKind, int>> runs;
  for (int64_t n : pipeline_batches) {
    for (transport::TransportKind kind : kinds) runs.emplace_back(kind, static_cast<int>(n));
  }
  for (size_t k = 0; k < runs.size(); ++k) {
    const transport::TransportKind kind = runs[k].first;
    settings.micro_batches = runs[k].second;
    const std::string name =
        absl::StrCat(transport::TransportKindName(kind),
                     compute_ranks > 1 ? absl::StrCat("/", compute_ranks, "c", runs[k].second, "b",
                                                      slice_layers > 0 ? absl::StrCat("r", slice_layers) : "")
                                       : (runs[k].second > 1 ? absl::StrCat("/pp", runs[k].second) : ""));
    std::string skip;
    if (!transport::TransportBuilt(kind)) {
      skip = "not in this build";
    } else if (settings.compute_ranks > settings.micro_batches) {
      skip = absl::StrCat(settings.compute_ranks, " compute ranks need at least as many micro-batches");
    } else if (settings.compute_ranks > 1 && transport::GetTransportInfo(kind).one_process) {
      skip = "compute replicas are processes, which this transport cannot connect";
    } else if (!shared_gpu && gpus < compute_ranks + memory_ranks) {
      skip = absl::StrCat("needs ", compute_ranks + memory_ranks,
                          " GPUs (compute ranks from cuda:0, memory ranks after them), "
                          "this machine has ",
                          gpus);
    } else if (const std::string why = transport::GetTransportInfo(kind).CannotConnect(layout);
               !why.empty()) {
      skip = why;
    } else if (kv_tokens == 0) {
      skip = "no (batch, context) fits in a memory rank's KV cache";
    }
    if (!skip.empty()) {
      notes.push_back(absl::StrCat(name, ": skipped: ", skip));
      std::fprintf(stderr, "%s\n", notes.back().c_str());
      continue;
    }
    std::fprintf(stderr,
                 "starting the %s deployment: %lld compute + %lld memory rank(s), %lld KV tokens per rank\n",
                 name.c_str(), static_cast<long long>(compute_ranks), static_cast<long long>(memory_ranks),
                 static_cast<long long>(settings.kv_tokens));
    Deployment d;
    watchdog.Arm(absl::StrCat("starting the ", name, " deployment"), 2 * startup_s + 60);
    absl::Status st = StartDeployment(**source, kind, settings, &d);
    watchdog.Disarm();
    if (st.ok()) {
      for (size_t i = 0; i < combos.size(); ++i) {
        const Combo& c = combos[i];
        if (!fits[i]) {
          notes.push_back(absl::StrCat(Label(name, c), ": skipped: needs ", need(c),
                                       " KV tokens per memory rank, a rank holds about ", budget));
          std::fprintf(stderr, "  %s\n", notes.back().c_str());
          continue;
        }
        std::fprintf(stderr, "  running %s\n", Label(name, c).c_str());
        watchdog.Arm(Label(name, c), run_timeout_s + 60);
        absl::StatusOr<Figures> f = RunWorkload(
            *d.rank, [&] { return d.rank->controller().Idle(); },
            MakeRequests(c, decode_tokens, spec.vocab_size, max_tokens), run_timeout_s);
        watchdog.Disarm();
        if (!f.ok()) {
          st = tandem::Annotate(f.status(), Label(name, c));
          break;
        }
        Row r = MakeRow(name, static_cast<int>(k) + 1, c, *f);
        if (baseline[i]) {
          r.attention_ms = *baseline[i];
          const double exchange = r.phase_ms - *baseline[i];
          r.floored = exchange < 0;
          r.exchange_ms = std::max(0.0, exchange);
          if (r.floored)
            r.note =
                absl::StrCat(r.note, r.note.empty() ? "" : "; ",
                             absl::StrFormat("exchange floored at 0: attention phase %.2f < colocated %.2f",
                                             r.phase_ms, *baseline[i]));
        } else {
          r.note = absl::StrCat(r.note, r.note.empty() ? "" : "; ", "no colocated baseline");
        }
        progress(r);
        record(std::move(r));
      }
    }
    if (!st.ok()) {
      failed = true;
      notes.push_back(absl::StrCat(name, ": FAILED: ", st.message()));
      std::fprintf(stderr, "deploy_step_bench: %s\n", notes.back().c_str());
    }
    std::fprintf(stderr, "stopping the %s deployment\n", name.c_str());
    watchdog.Arm(absl::StrCat("stopping the ", name, " deployment"), 60);
    StopDeployment(&d, !st.ok());
    watchdog.Disarm();
  }

  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.combo.context != b.combo.context) return a.combo.context < b.combo.context;
    if (a.combo.batch != b.combo.batch) return a.combo.batch < b.combo.batch;
    return a.order < b.order;
  });
  std::printf(
      "model %s on %s: compute rank cuda:0, %lld memory rank(s) on %s; decode %lld tokens per "
      "request; per decode step, ms: step = compute + attention + exchange + idle\n",
      model.c_str(), device_name.c_str(), static_cast<long long>(memory_ranks),
      shared_gpu ? "cuda:0 (shared)" : "cuda:1..", static_cast<long long>(decode_tokens));
  std::printf("%-10s %-6s %-7s %-6s %-8s %-8s %-8s %-8s %-9s %-9s %-8s %-5s %-8s %s\n", "transport", "batch",
              "context", "rows", "step_ms", "compute", "linear", "floor", "attention", "exchange", "idle",
              "eff", "tok/s", "note");
  for (const Row& r : rows) {
    // Pipeline efficiency (compute_node/pipeline_report.h): the busiest resource's share of the step.
    std::optional<double> eff;
    if (r.attention_ms && r.step_ms > 0)
      eff = std::max({r.compute_ms, *r.attention_ms, r.exchange_ms.value_or(0.0)}) / r.step_ms;
    std::printf("%-10s %-6lld %-7lld %-6.1f %-8.2f %-8.2f %-8.2f %-8s %-9s %-9s %-8.2f %-5s %-8.0f %s\n",
                r.transport.c_str(), static_cast<long long>(r.combo.batch),
                static_cast<long long>(r.combo.context), r.rows_per_step, r.step_ms, r.compute_ms,
                r.gemm_ms + r.other_ms, Fmt(floor_of(static_cast<int64_t>(r.rows_per_step + 0.5))).c_str(),
                Fmt(r.attention_ms).c_str(), Fmt(r.exchange_ms).c_str(), r.idle_ms, Fmt(eff).c_str(), r.tok_s,
                r.note.c_str());
  }
  for (const std::string& n : notes) std::printf("%s\n", n.c_str());
  return failed ? 1 : 0;
}
