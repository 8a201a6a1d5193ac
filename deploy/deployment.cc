#include "deploy/deployment.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "compute_node/controller_settings.h"
#include "deploy/process_group.h"
#include "kernels/cuda/device_choice.h"
#include "server/api_server.h"

namespace tandem {

const ConfigSchema& DeploySchema() {
  static const ConfigSchema* schema = [] {
    auto* s = new ConfigSchema();
    s->String("model.path", "tiny-gqa", "checkpoint directory (Hugging Face layout) or preset name")
        .Int("model.weight_seed", 0, "seed of a preset's random weights", 0, 1LL << 62)
        .String("compute.device", "auto", "device of compute rank 0: cpu, cuda, cuda:N or auto")
        .Int("compute.ranks", 1,
             "compute ranks, each holding all the weights (compute rank 0 has the controller; the others are "
             "replicas it drives with per-step plans); more than 1 needs pipeline.mode fixed",
             1, 8)
        .String("compute.replica_devices", "auto",
                "device of every compute replica (ranks 1..; auto: compute.device), or one per replica "
                "separated by commas")
        .Bool("compute.cuda_graphs", false,
              "CUDA: run each layer's linear parts as CUDA graphs (pays where the host launches kernels "
              "slower than the GPU runs them; docs/benchmarks.md, \"Linear layers\")")
        .Bool("compute.profile", true,
              "CUDA: time compute rank 0's phases with CUDA events, for the pipeline report (compute, "
              "attention, exchange and idle time per step; the CPU backend is timed on the host either way)")
        .Int("memory.ranks", 1, "number of memory ranks (processes owning KV and running attention)", 1, 64)
        .String("memory.devices", "auto",
                "device of every memory rank (cpu, cuda, cuda:N; auto: the compute rank's), or one per rank "
                "separated by commas")
        .Enum("memory.partition", "request", {"request", "head"},
              "how attention is split over the memory ranks: request (each request's KV on one rank, "
              "placed by free KV) or head (every rank holds a slice of the KV heads of every request; "
              "needs num_key_value_heads divisible by memory.ranks)")
        .Enum("pipeline.mode", "none", {"none", "pingpong", "fixed"},
              "none: each step runs whole (linear layers, then attention, layer by layer); pingpong: each "
              "step is split into pipeline.batches micro-batches of balanced rows and KV, and compute rank 0 "
              "runs the linear layers of one while the memory ranks run the attention of another; fixed: the "
              "same over compute.ranks compute ranks, micro-batch j on compute rank j % compute.ranks (not "
              "over transport.kind nccl)")
        .Int("pipeline.batches", 2, "micro-batches per step with pipeline.mode pingpong", 2, 8)
        .String("memory.host", "127.0.0.1", "address the memory ranks listen on")
        .Int("memory.base_port", 0,
             "port of memory rank 0 (rank i listens on base_port + i); 0: any free port", 0, 65535)
        .Enum("transport.kind", "auto", {"auto", "ucx", "p2p", "nccl", "verbs", "local"},
              "how ranks exchange per-layer data: ucx (tcp / shared memory, staged through host memory), "
              "p2p (CUDA IPC peer writes between GPUs of this host), nccl (ncclSend/ncclRecv), verbs "
              "(RDMA WRITE into GPU memory), local (memory ranks as threads of compute rank 0's process: "
              "one CUDA context on a shared GPU); the GPU ones enqueue whole steps with device-side waits. "
              "auto: local when every memory rank is on the compute rank's GPU, p2p when every rank is on "
              "a CUDA device, else ucx")
        .Bool("transport.checksums", true,
              "crc32c of every per-layer payload of the host-staged path (ucx), verified by the receiver")
        .String("launch.run_dir", "tandem-run",
                "directory for the ranks' logs, ready files and effective config")
        .Double("launch.startup_timeout_s", 600, "seconds a rank may take to become ready", 1, 86400)
        .Double("launch.step_timeout_s", 120, "seconds a rank may wait for a peer within a step", 1, 86400);
    AddSchedulerKvKnobs(s);
    server::AddApiKnobs(s);  // compute rank 0 serves the API (cli/rank_cmds.cc)
    return s;
  }();
  return *schema;
}

absl::StatusOr<std::optional<transport::TransportKind>> ParseTransportSetting(std::string_view value) {
  if (value == "auto") return std::nullopt;
  absl::StatusOr<transport::TransportKind> kind = transport::ParseTransportKind(value);
  if (!kind.ok())
    return absl::InvalidArgumentError(absl::StrCat("transport.kind: ", kind.status().message()));
  return *kind;
}

namespace {

// "cpu" -> -1, "cuda:N" -> N (the plan's devices are resolved already).
int DeviceIndex(const std::string& device) {
  int index = -1;
  if (device.rfind("cuda:", 0) == 0 && !absl::SimpleAtoi(device.substr(5), &index)) index = -1;
  return index;
}

}  // namespace

absl::StatusOr<transport::TransportKind> ResolveTransport(std::optional<transport::TransportKind> requested,
                                                          const DeployPlan& p) {
  transport::RankLayout layout{.compute_device = DeviceIndex(p.compute_device)};
  for (const std::string& d : p.memory_devices) layout.memory_devices.push_back(DeviceIndex(d));
  if (!requested) return transport::PickTransport(layout);
  const std::string why = transport::GetTransportInfo(*requested).CannotConnect(layout);
  if (!why.empty()) return absl::InvalidArgumentError(absl::StrCat("transport.kind: ", why));
  return *requested;
}

absl::StatusOr<DeployPlan> ResolveDeployment(const Config& c, const ModelSpec& spec) {
  DeployPlan p;
  p.model = c.GetString("model.path");
  p.weight_seed = static_cast<uint64_t>(c.GetInt("model.weight_seed"));
  absl::StatusOr<int> compute = kernels::ResolveDevice(c.GetString("compute.device"), spec);
  if (!compute.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("compute.device: ", compute.status().message()));
  }
  p.compute_device = *compute < 0 ? "cpu" : absl::StrCat("cuda:", *compute);
  const int64_t ranks = c.GetInt("memory.ranks");
  std::vector<std::string> devices = absl::StrSplit(c.GetString("memory.devices"), ',');
  if (devices.size() != 1 && static_cast<int64_t>(devices.size()) != ranks) {
    return absl::InvalidArgumentError(absl::StrCat("memory.devices: ", devices.size(), " devices listed for ",
                                                   ranks, " ranks (give one for all, or one per rank)"));
  }
  for (int64_t i = 0; i < ranks; ++i) {
    std::string d(absl::StripAsciiWhitespace(devices[devices.size() == 1 ? 0 : static_cast<size_t>(i)]));
    if (d == "auto") d = p.compute_device;
    absl::StatusOr<int> idx = kernels::ResolveDevice(d, spec);
    if (!idx.ok() || d == "auto") {
      return absl::InvalidArgumentError(
          absl::StrCat("memory.devices: rank ", i, ": expected cpu, cuda, cuda:N or auto, got \"", d, "\""));
    }
    d = *idx < 0 ? "cpu" : absl::StrCat("cuda:", *idx);
    if ((d == "cpu") != (p.compute_device == "cpu")) {
      return absl::InvalidArgumentError(absl::StrCat("memory.devices: rank ", i, " on ", d,
                                                     " but compute.device is ", p.compute_device,
                                                     "; compute and memory ranks exchange activations in the "
                                                     "backend's dtype (fp32 on cpu, bf16 on cuda), "
                                                     "so put all ranks on the CPU or all on GPUs"));
    }
    p.memory_devices.push_back(d);
    const int64_t base = c.GetInt("memory.base_port");
    if (base != 0 && base + i > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory.base_port: ", base, " + rank ", i, " exceeds 65535"));
    }
    p.listen_addresses.push_back(absl::StrCat(c.GetString("memory.host"), ":", base == 0 ? 0 : base + i));
  }
  p.compute_host = c.GetString("memory.host");  // one host: the compute replicas listen where memory ranks do
  ASSIGN_OR_RETURN(p.partition, ParseAttentionPartition(c.GetString("memory.partition")));
  RETURN_IF_ERROR(CheckAttentionPartition(p.partition, spec.num_kv_heads, ranks));
  // Checked here so that a bad pair stops the launch before any rank starts.
  RETURN_IF_ERROR(ResolveControllerOptions(SchedulerKvSettingsFromConfig(c)).status());
  ASSIGN_OR_RETURN(const std::optional<transport::TransportKind> kind,
                   ParseTransportSetting(c.GetString("transport.kind")));
  ASSIGN_OR_RETURN(p.transport, ResolveTransport(kind, p));
  const std::string mode = c.GetString("pipeline.mode");
  p.micro_batches = mode == "none" ? 1 : static_cast<int>(c.GetInt("pipeline.batches"));
  p.compute_ranks = static_cast<int>(c.GetInt("compute.ranks"));
  if (p.micro_batches > 1 && p.transport == transport::TransportKind::kNccl) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline.mode: ", mode,
        " does not run over transport.kind nccl (NCCL orders a peer's transfers on one stream, so several "
        "micro-batches in flight would deadlock); use p2p, verbs, local or ucx"));
  }
  if (p.compute_ranks > 1) {
    if (mode != "fixed") {
      return absl::InvalidArgumentError(absl::StrCat(
          "compute.ranks: ", p.compute_ranks, " compute ranks need pipeline.mode fixed (it is ", mode, ")"));
    }
    if (p.micro_batches < p.compute_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline.batches: ", p.micro_batches,
                                                     " micro-batches for ", p.compute_ranks,
                                                     " compute ranks (each needs one at least)"));
    }
    if (transport::GetTransportInfo(p.transport).one_process) {
      return absl::InvalidArgumentError(
          "compute.ranks: compute replicas are processes of their own, which transport.kind local (one "
          "process) cannot connect; use ucx or p2p");
    }
    std::vector<std::string> devices = absl::StrSplit(c.GetString("compute.replica_devices"), ',');
    if (devices.size() != 1 && static_cast<int>(devices.size()) != p.compute_ranks - 1) {
      return absl::InvalidArgumentError(absl::StrCat("compute.replica_devices: ", devices.size(),
                                                     " devices listed for ", p.compute_ranks - 1,
                                                     " replicas (give one for all, or one per replica)"));
    }
    for (int r = 1; r < p.compute_ranks; ++r) {
      std::string d(
          absl::StripAsciiWhitespace(devices[devices.size() == 1 ? 0 : static_cast<size_t>(r - 1)]));
      if (d == "auto") d = p.compute_device;
      absl::StatusOr<int> idx = kernels::ResolveDevice(d, spec);
      if (!idx.ok() || d == "auto" || ((*idx < 0) != (p.compute_device == "cpu"))) {
        return absl::InvalidArgumentError(
            absl::StrCat("compute.replica_devices: replica ", r, ": expected ",
                         p.compute_device == "cpu" ? "cpu (compute rank 0 is on the CPU)" : "cuda or cuda:N",
                         ", got \"", d, "\""));
      }
      p.replica_devices.push_back(*idx < 0 ? "cpu" : absl::StrCat("cuda:", *idx));
    }
  } else if (mode == "fixed") {
    p.micro_batches = std::max(p.micro_batches, 1);  // one compute rank: fixed is pingpong
  }
  p.checksums = c.GetBool("transport.checksums");
  p.run_dir = c.GetString("launch.run_dir");
  p.startup_timeout = absl::Seconds(c.GetDouble("launch.startup_timeout_s"));
  p.step_timeout = absl::Seconds(c.GetDouble("launch.step_timeout_s"));
  return p;
}

namespace {

absl::Status LaunchIn(ProcessGroup& group, const Config& config, const DeployPlan& plan,
                      const LaunchOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(plan.run_dir, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("launch.run_dir: cannot create ", plan.run_dir, ": ", ec.message()));
  const std::string cfg = (fs::path(plan.run_dir) / "deploy.yaml").string();
  RETURN_IF_ERROR(WriteFileAtomic(cfg, config.DumpYaml()));
  auto path = [&](const std::string& name) { return (fs::path(plan.run_dir) / name).string(); };

  // transport.kind local: the memory ranks are threads of compute-0 (deploy/local_ranks.h).
  const bool in_process = transport::GetTransportInfo(plan.transport).one_process;
  std::vector<std::string> addresses;
  for (size_t i = 0; i < plan.memory_devices.size() && !in_process; ++i) {
    const std::string name = absl::StrCat("memory-", i), ready = path(name + ".ready");
    fs::remove(ready, ec);  // a stale file from an earlier run must not count as ready
    fs::remove(path(name + ".log"), ec);
    RETURN_IF_ERROR(group.Start(
        name,
        {o.tandem_binary, "memory", "--config", cfg, "--rank", std::to_string(i), "--listen",
         plan.listen_addresses[i], "--device", plan.memory_devices[i], "--kv-share",
         std::to_string(
             std::count(plan.memory_devices.begin(), plan.memory_devices.end(), plan.memory_devices[i])),
         "--transport", transport::TransportKindName(plan.transport), "--ready-file", ready, "--log-level",
         o.log_level},
        path(name + ".log")));
  }
  for (size_t i = 0; i < plan.memory_devices.size() && !in_process; ++i) {
    const std::string name = absl::StrCat("memory-", i);
    ASSIGN_OR_RETURN(std::string address, group.WaitReady(name, path(name + ".ready"), plan.startup_timeout));
    addresses.emplace_back(absl::StripAsciiWhitespace(address));
    std::fprintf(stderr, "tandem launch: %s listening on %s (%s)\n", name.c_str(), addresses.back().c_str(),
                 plan.memory_devices[i].c_str());
  }
  // Compute replicas (compute.ranks > 1): they connect to the memory ranks and listen for compute
  // rank 0.
  std::vector<std::string> replica_addresses;
  for (size_t r = 0; r < plan.replica_devices.size(); ++r) {
    const std::string name = absl::StrCat("compute-", r + 1), ready = path(name + ".ready");
    fs::remove(ready, ec);
    fs::remove(path(name + ".log"), ec);
    RETURN_IF_ERROR(group.Start(
        name,
        {o.tandem_binary, "compute", "--replica", std::to_string(r + 1), "--config", cfg, "--memory",
         absl::StrJoin(addresses, ","), "--listen", absl::StrCat(plan.compute_host, ":0"), "--device",
         plan.replica_devices[r], "--transport", transport::TransportKindName(plan.transport), "--ready-file",
         ready, "--log-level", o.log_level},
        path(name + ".log")));
  }
  for (size_t r = 0; r < plan.replica_devices.size(); ++r) {
    const std::string name = absl::StrCat("compute-", r + 1);
    ASSIGN_OR_RETURN(std::string address, group.WaitReady(name, path(name + ".ready"), plan.startup_timeout));
    replica_addresses.emplace_back(absl::StripAsciiWhitespace(address));
    std::fprintf(stderr, "tandem launch: %s listening on %s (%s)\n", name.c_str(),
                 replica_addresses.back().c_str(), plan.replica_devices[r].c_str());
  }
  const std::string ready = path("compute-0.ready");
  fs::remove(ready, ec);
  fs::remove(path("compute-0.log"), ec);
  std::vector<std::string> argv = {o.tandem_binary,
                                   "compute",
                                   "--config",
                                   cfg,
                                   in_process ? "--memory-devices" : "--memory",
                                   absl::StrJoin(in_process ? plan.memory_devices : addresses, ","),
                                   "--ready-file",
                                   ready,
                                   "--log-level",
                                   o.log_level,
                                   "--device",
                                   plan.compute_device,
                                   "--transport",
                                   transport::TransportKindName(plan.transport)};
  if (!o.requests_file.empty()) {
    argv.insert(argv.end(), {"--requests", o.requests_file, "--results", o.results_file});
  }
  if (!replica_addresses.empty())
    argv.insert(argv.end(), {"--replicas", absl::StrJoin(replica_addresses, ",")});
  RETURN_IF_ERROR(group.Start("compute-0", argv, path("compute-0.log")));
  ASSIGN_OR_RETURN(const std::string compute, group.WaitReady("compute-0", ready, plan.startup_timeout));
  std::fprintf(stderr, "tandem launch: compute-0 ready on %s; %zu memory rank(s)%s; logs in %s/\n",
               std::string(absl::StripAsciiWhitespace(compute)).c_str(), plan.memory_devices.size(),
               in_process ? " as threads of compute-0 (transport local)" : "", plan.run_dir.c_str());
  if (!o.requests_file.empty()) {
    // Compute rank 0 runs the requests, says bye to the memory ranks and exits; they follow.
    RETURN_IF_ERROR(group.WaitExit("compute-0"));
    for (size_t i = 0; i < addresses.size(); ++i) RETURN_IF_ERROR(group.WaitExit(absl::StrCat("memory-", i)));
    for (size_t r = 0; r < replica_addresses.size(); ++r) {
      RETURN_IF_ERROR(group.WaitExit(absl::StrCat("compute-", r + 1)));
    }
    return absl::OkStatus();
  }
  if (!o.api_ready_file.empty()) {
    const size_t at = compute.find("API ");
    if (at == std::string::npos) return absl::InternalError("compute-0 did not report its API address");
    std::ofstream(o.api_ready_file) << absl::StripAsciiWhitespace(compute.substr(at + 4)) << "\n";
  }
  std::fprintf(stderr, "tandem launch: serving the API; running until Ctrl-C or SIGTERM\n");
  return group.WaitAny();
}

}  // namespace

absl::Status Launch(const Config& config, const DeployPlan& plan, const LaunchOptions& options) {
  InstallTerminationSignals();
  ProcessGroup group;
  absl::Status st = LaunchIn(group, config, plan, options);
  const bool interrupted = absl::IsCancelled(st) && TerminationSignal() != 0;
  if (interrupted && options.requests_file.empty() && group.running("compute-0")) {
    // Compute rank 0 serves the API: it drains first (api.shutdown_grace_s), while the memory
    // ranks still hold the KV of the requests it finishes; then everything stops.
    const double grace = config.GetDouble("api.shutdown_grace_s");
    std::fprintf(stderr, "tandem launch: draining the API (up to %.0f s), then stopping the ranks\n", grace);
    (void)group.Stop("compute-0", absl::Seconds(grace + 10));
  }
  if (!st.ok() && !interrupted)
    std::fprintf(stderr, "tandem launch: stopping the deployment: %s\n", std::string(st.message()).c_str());
  const std::vector<std::string> killed = group.StopAll(absl::Seconds(10));
  if (!killed.empty()) {
    std::fprintf(stderr, "tandem launch: %s did not stop within 10 s of SIGTERM and was killed\n",
                 absl::StrJoin(killed, ", ").c_str());
  }
  if (interrupted) {
    std::fprintf(stderr, "tandem launch: stopped by signal %d; every rank has exited\n", TerminationSignal());
    return options.requests_file.empty() ? absl::OkStatus() : st;
  }
  return st;
}

}  // namespace tandem
