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
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "compute_node/controller_settings.h"
#include "deploy/process_group.h"
#include "deploy/slurm_launcher.h"
#include "deploy/ssh_launcher.h"
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
              "needs num_key_value_heads >= memory.ranks; slices differ by one KV head where "
              "memory.ranks does not divide them)")
        .Enum("pipeline.mode", "none", {"none", "pingpong", "fixed", "rotational"},
              "none: each step runs whole (linear layers, then attention, layer by layer); pingpong: each "
              "step is split into pipeline.batches micro-batches of balanced rows and KV, and compute rank 0 "
              "runs the linear layers of one while the memory ranks run the attention of another; fixed: the "
              "same over compute.ranks compute ranks, micro-batch j on compute rank j % compute.ranks; "
              "rotational: over compute.ranks compute ranks, slice k (pipeline.slice_layers layers) of "
              "micro-batch j on compute rank (j + k) % compute.ranks, the residual stream handed on while "
              "the next layer's attention runs")
        .Int("pipeline.batches", 2, "micro-batches per step with pipeline.mode pingpong, fixed or rotational",
             2, 8)
        .Int("pipeline.slice_layers", 1,
             "pipeline.mode rotational: layers each compute rank runs of a micro-batch before handing it to "
             "the next (at most the model's layers)",
             1, 1 << 16)
        .Bool("pipeline.q_first", false,
              "per layer, send each memory rank its rows' q first and their k, v after: it runs attention "
              "over the context it holds while k, v are in flight, then over the new rows, and merges the "
              "two by log-sum-exp (any pipeline.mode, device and transport)")
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
        .Enum(
            "transport.checksums", "auto", {"auto", "true", "false"},
            "per-layer payload checksums, verified by the receiver: crc32c on the host-staged path (ucx), "
            "a checksum that the writer sums and a kernel of the receiver checks on the device paths of p2p "
            "and nccl. auto: on, except on nccl (over 2% of a decode step there)")
        .String("launch.run_dir", "tandem-run",
                "directory under which every run gets its own directory (run-<time>-<pid>, and the link "
                "latest): the ranks' logs, ready files, effective config and deployment secret")
        .Enum("launch.remote", "ssh", {"ssh", "srun"},
              "how ranks on other hosts are started: ssh (launch.ssh), or srun inside a Slurm job (set by "
              "tandem launch --slurm; deploy/slurm/)")
        .Enum("launch.slurm_devices", "cpu", {"cpu", "gpu"},
              "tandem launch --slurm: the memory ranks' devices, cpu, or gpu (a node's ranks on cuda:0, "
              "cuda:1, ...: the GPUs Slurm gives each task)")
        .String("launch.ssh", "ssh -o BatchMode=yes",
                "the OpenSSH client command line that starts ranks on other hosts (the host and the rank's "
                "command are appended), e.g. \"ssh -p 2222 -i key -o BatchMode=yes\"")
        .Double("launch.startup_timeout_s", 600, "seconds a rank may take to become ready", 1, 86400)
        .Double("launch.step_timeout_s", 120, "seconds a rank may wait for a peer within a step", 1, 86400)
        .Double("launch.heartbeat_s", 2,
                "while idle, compute rank 0 sends every memory rank a heartbeat this often; a rank that does "
                "not answer within launch.step_timeout_s is lost as in a step, and a memory rank that hears "
                "nothing from compute rank 0 for launch.heartbeat_s + launch.step_timeout_s stops; 0: off",
                0, 3600)
        .Bool("launch.recover_memory_ranks", true,
              "a memory rank that dies, disconnects or stays silent past launch.step_timeout_s is given "
              "up and its requests are recomputed on the others (ucx, p2p or nccl transport, "
              "memory.partition request; with compute replicas, and on p2p and nccl, the step in flight runs "
              "again without it on the same compute ranks; memory.partition head: the others split the KV "
              "heads again and every request in flight is recomputed); false: the deployment stops")
        .Bool(
            "launch.recover_compute_replicas", true,
            "a compute replica that dies, disconnects or stays silent past launch.step_timeout_s is "
            "given up and the step in flight runs again on the compute ranks left, which share the "
            "micro-batches from then on (pipeline.mode fixed or rotational: the ring closes over the "
            "lost rank; ucx or p2p transport, or nccl with pipeline.mode fixed); false: the deployment stops")
        .Int("launch.restart_memory_ranks", 3,
             "with launch.recover_memory_ranks, tandem launch restarts a memory rank process that died (not "
             "one that exited cleanly) on the address it listened on, up to this many times per rank, and "
             "compute rank 0 takes it back; past the limit it stays lost; 0: never restart",
             0, 1000)
        .Double(
            "launch.rejoin_probe_s", 1,
            "with launch.recover_memory_ranks, compute rank 0 tries a lost memory rank's address this often "
            "(between steps, never blocking one; the wait doubles, up to 30 s, while nothing answers) and "
            "takes back a new process of the rank that answers there (restarted by tandem launch or by "
            "hand); 0: a lost rank stays lost",
            0, 3600);
    AddPoolKnobs(s);
    AddSchedulerKvKnobs(s);
    server::AddApiKnobs(s);  // compute rank 0 serves the API (cli/rank_cmds.cc)
    return s;
  }();
  return *schema;
}

std::string DescribePlacement(const DeployPlan& p) {
  const bool in_process = transport::GetTransportInfo(p.transport).one_process;
  auto line = [](const RankPlacement& r, const std::string& role, const std::string& how) {
    return absl::StrCat("#   ", r.name, ": ", r.device, " on ", r.local() ? "this host" : r.host,
                        ", device type ", r.device_type.empty() ? "-" : r.device_type, ", interface ",
                        r.bind.empty() ? "any" : r.bind, " (", role, how, ")\n");
  };
  std::string out = absl::StrCat("# placement", p.placement.one_host() ? " (one host)" : "", ":\n");
  absl::StrAppend(&out, line(p.placement.compute, absl::StrCat("controller, model ", p.model), ""));
  for (size_t i = 0; i < p.placement.memory.size(); ++i) {
    const RankPlacement& r = p.placement.memory[i];
    const std::string how = in_process  ? ", a thread of compute-0"
                            : r.local() ? ", a process of this host"
                            : p.srun    ? absl::StrCat(", started with srun on node ", r.host)
                                        : absl::StrCat(", started over ssh: ", p.ssh, " ", r.host);
    absl::StrAppend(&out, line(r, absl::StrCat("listening on ", p.listen_addresses[i]), how));
  }
  for (size_t r = 0; r < p.replica_devices.size(); ++r) {
    absl::StrAppend(&out, "#   compute-", r + 1, ": ", p.replica_devices[r],
                    " on compute-0's host (replica, listening on ", p.compute_host, ":0)\n");
  }
  if (p.micro_batches > 1) {
    absl::StrAppend(&out, "# pipeline: ", p.micro_batches, " micro-batches per step on ", p.compute_ranks,
                    " compute rank(s)",
                    p.slice_layers > 0 ? absl::StrCat(", rotating every ", p.slice_layers, " layer(s)") : "",
                    p.q_first ? ", q first" : "", "\n");
  } else if (p.q_first) {
    absl::StrAppend(&out, "# pipeline: q first (attention over the context while k, v are in flight)\n");
  }
  absl::StrAppend(&out, "# transport (per-layer data; control messages over UCX, authenticated):\n");
  for (const RankPlacement& r : p.placement.memory) {
    absl::StrAppend(&out, "#   compute-0 <-> ", r.name, ": ", transport::TransportKindName(p.transport), " (",
                    p.placement.compute.local() ? "this host" : p.placement.compute.host, " <-> ",
                    r.local() ? "this host" : r.host, ")\n");
  }
  return out;
}

int PipelineMicroBatches(const Config& c) {
  return c.GetString("pipeline.mode") == "none" ? 1 : static_cast<int>(c.GetInt("pipeline.batches"));
}

int PipelineSliceLayers(const Config& c) {
  return c.GetString("pipeline.mode") == "rotational" ? static_cast<int>(c.GetInt("pipeline.slice_layers"))
                                                      : 0;
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

bool ChecksumsOn(const Config& config, transport::TransportKind kind) {
  const std::string setting = config.GetString("transport.checksums");
  return setting == "auto" ? kind != transport::TransportKind::kNccl : setting == "true";
}

absl::StatusOr<transport::TransportKind> ResolveTransport(std::optional<transport::TransportKind> requested,
                                                          const DeployPlan& p) {
  transport::RankLayout layout{.compute_device = DeviceIndex(p.compute_device),
                               .one_host = p.placement.one_host()};
  for (const std::string& d : p.memory_devices) layout.memory_devices.push_back(DeviceIndex(d));
  for (const std::string& d : p.replica_devices) layout.replica_devices.push_back(DeviceIndex(d));
  if (!requested) return transport::PickTransport(layout);
  const std::string why = transport::GetTransportInfo(*requested).CannotConnect(layout);
  if (!why.empty()) return absl::InvalidArgumentError(absl::StrCat("transport.kind: ", why));
  return *requested;
}

namespace {

// A rank's device: on this host resolved against the visible devices; on another host only its
// form is checked (cpu or cuda:N), since the launcher cannot see that host's devices.
absl::StatusOr<std::string> ResolveRankDevice(const RankPlacement& r, const std::string& value,
                                              const ModelSpec& spec) {
  if (!r.local()) {
    int index = -1;
    if (value == "cpu" ||
        (value.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(value.substr(5), &index) && index >= 0)) {
      return value;
    }
    return absl::InvalidArgumentError(absl::StrCat(r.path, ": expected cpu or cuda:N for host ", r.host,
                                                   " (devices of another host are not guessed), got \"",
                                                   value, "\""));
  }
  absl::StatusOr<int> idx = kernels::ResolveDevice(value, spec);
  if (!idx.ok()) return absl::InvalidArgumentError(absl::StrCat(r.path, ": ", idx.status().message()));
  return *idx < 0 ? std::string("cpu") : absl::StrCat("cuda:", *idx);
}

std::string RunDirName() {
  const absl::Time now = absl::Now();
  return absl::StrCat("run-", absl::FormatTime("%Y%m%d-%H%M%S", now, absl::UTCTimeZone()), "-", getpid());
}

}  // namespace

absl::StatusOr<DeployPlan> ResolveDeployment(const Config& c, const ModelSpec& spec) {
  DeployPlan p;
  p.model = c.GetString("model.path");
  p.weight_seed = static_cast<uint64_t>(c.GetInt("model.weight_seed"));
  ASSIGN_OR_RETURN(p.placement, ResolvePlacement(c));
  ASSIGN_OR_RETURN(p.compute_device,
                   ResolveRankDevice(p.placement.compute, p.placement.compute.device, spec));
  p.placement.compute.device = p.compute_device;
  const int64_t ranks = static_cast<int64_t>(p.placement.memory.size());
  const int64_t base = c.GetInt("memory.base_port");
  for (int64_t i = 0; i < ranks; ++i) {
    RankPlacement& r = p.placement.memory[static_cast<size_t>(i)];
    std::string d = r.device == "auto" ? p.compute_device : r.device;
    absl::StatusOr<std::string> resolved = ResolveRankDevice(r, d, spec);
    if (!resolved.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(r.path, ": rank ", i, ": expected cpu, cuda, cuda:N or auto, got \"", r.device, "\""));
    }
    d = *resolved;
    if ((d == "cpu") != (p.compute_device == "cpu")) {
      return absl::InvalidArgumentError(absl::StrCat(r.path, ": rank ", i, " on ", d,
                                                     " but compute rank 0 is on ", p.compute_device,
                                                     "; compute and memory ranks exchange activations in the "
                                                     "backend's dtype (fp32 on cpu, bf16 on cuda), "
                                                     "so put all ranks on the CPU or all on GPUs"));
    }
    r.device = d;
    p.memory_devices.push_back(d);
    if (base != 0 && base + i > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory.base_port: ", base, " + rank ", i, " exceeds 65535"));
    }
    p.listen_addresses.push_back(absl::StrCat(r.bind, ":", base == 0 ? 0 : base + i));
  }
  // The compute replicas run on compute rank 0's host and listen on its interface.
  p.compute_host = p.placement.compute.bind.empty() ? c.GetString("memory.host") : p.placement.compute.bind;
  ASSIGN_OR_RETURN(p.partition, ParseAttentionPartition(c.GetString("memory.partition")));
  RETURN_IF_ERROR(CheckAttentionPartition(p.partition, spec.num_kv_heads, ranks));
  // Checked here so that a bad pair stops the launch before any rank starts.
  RETURN_IF_ERROR(ResolveControllerOptions(SchedulerKvSettingsFromConfig(c)).status());
  ASSIGN_OR_RETURN(const std::optional<transport::TransportKind> kind,
                   ParseTransportSetting(c.GetString("transport.kind")));
  ASSIGN_OR_RETURN(p.transport, ResolveTransport(kind, p));
  const std::string mode = c.GetString("pipeline.mode");
  p.micro_batches = PipelineMicroBatches(c);
  p.compute_ranks = static_cast<int>(c.GetInt("compute.ranks"));
  p.slice_layers = PipelineSliceLayers(c);
  if (mode == "rotational" && p.compute_ranks < 2) {
    return absl::InvalidArgumentError(
        "pipeline.mode: rotational needs compute.ranks of 2 or more (the micro-batches move between compute "
        "ranks)");
  }
  if (p.slice_layers > spec.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline.slice_layers: ", p.slice_layers,
                                                   " exceeds the model's ", spec.num_layers, " layers"));
  }
  if (p.compute_ranks > 1) {
    if (mode != "fixed" && mode != "rotational") {
      return absl::InvalidArgumentError(
          absl::StrCat("compute.ranks: ", p.compute_ranks,
                       " compute ranks need pipeline.mode fixed or rotational (it is ", mode, ")"));
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
    // The replicas connect to compute rank 0 and to every memory rank: the transport must connect
    // them too (nccl: each on a GPU of its own).
    RETURN_IF_ERROR(ResolveTransport(p.transport, p).status());
  }
  p.q_first = c.GetBool("pipeline.q_first");
  p.checksums = ChecksumsOn(c, p.transport);
  p.run_dir = (std::filesystem::path(c.GetString("launch.run_dir")) / RunDirName()).string();
  p.ssh = c.GetString("launch.ssh");
  p.srun = c.GetString("launch.remote") == "srun";
  p.startup_timeout = absl::Seconds(c.GetDouble("launch.startup_timeout_s"));
  p.step_timeout = absl::Seconds(c.GetDouble("launch.step_timeout_s"));
  // Compute rank 0 recovers on the host-staged path (ucx) and on the device paths of p2p and nccl,
  // which can be reset after a failed step (ComputeRank::DeviceRecovery); under the head partition
  // the survivors split the heads again (ComputeRank::RepartitionHeads). On nccl a memory rank's
  // loss and rejoin, and a compute replica's loss under pipeline.mode fixed: a rotational ring made
  // anew needs a communicator between ranks that had none, set up while the other ranks' steps
  // wait, which has not been run (ComputeRank::CanRecoverReplica).
  const bool ucx_or_p2p =
      p.transport == transport::TransportKind::kUcx || p.transport == transport::TransportKind::kP2p;
  const bool nccl = p.transport == transport::TransportKind::kNccl;
  p.recover_memory_ranks = c.GetBool("launch.recover_memory_ranks") && (ucx_or_p2p || nccl);
  p.recover_compute_replicas = c.GetBool("launch.recover_compute_replicas") && p.compute_ranks >= 2 &&
                               (ucx_or_p2p || (nccl && mode == "fixed"));
  // A restarted rank is of use only where compute rank 0 takes it back: wherever it recovers, with
  // probes on (ComputeRank::AdvanceRejoins; on nccl the new process's communicators are set up
  // between steps before it is taken).
  p.memory_rank_rejoins = p.recover_memory_ranks && c.GetDouble("launch.rejoin_probe_s") > 0;
  p.restart_memory_ranks =
      p.memory_rank_rejoins ? static_cast<int>(c.GetInt("launch.restart_memory_ranks")) : 0;
  return p;
}

namespace {

// The run's own directory, its `latest` link and its deployment secret (0600).
absl::StatusOr<bootstrap::DeploymentKey> PrepareRunDir(const DeployPlan& plan) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(plan.run_dir, ec);
  if (ec)
    return absl::InternalError(
        absl::StrCat("launch.run_dir: cannot create ", plan.run_dir, ": ", ec.message()));
  fs::permissions(plan.run_dir, fs::perms::owner_all, ec);  // logs and ready files: this user's
  const fs::path latest = fs::path(plan.run_dir).parent_path() / "latest";
  const fs::path tmp = fs::path(plan.run_dir).parent_path() / absl::StrCat(".latest.", getpid());
  fs::remove(tmp, ec);
  fs::create_directory_symlink(fs::path(plan.run_dir).filename(), tmp, ec);
  if (!ec) fs::rename(tmp, latest, ec);  // atomic: two launches never see a half-made link
  return bootstrap::CreateKeyFile((fs::path(plan.run_dir) / "secret").string());
}

// The number of memory ranks on rank m's device and host (they split its KV memory).
int KvShare(const DeployPlan& plan, size_t m) {
  int n = 0;
  for (const RankPlacement& r : plan.placement.memory) {
    n += r.host == plan.placement.memory[m].host && r.device == plan.placement.memory[m].device ? 1 : 0;
  }
  return n;
}

absl::Status LaunchIn(ProcessGroup& group, const Config& config, const DeployPlan& plan,
                      const LaunchOptions& o) {
  namespace fs = std::filesystem;
  std::error_code ec;
  ASSIGN_OR_RETURN(const bootstrap::DeploymentKey key, PrepareRunDir(plan));
  const std::string cfg = (fs::path(plan.run_dir) / "deploy.yaml").string();
  const std::string yaml = config.DumpYaml();
  RETURN_IF_ERROR(WriteFileAtomic(cfg, yaml));
  auto path = [&](const std::string& name) { return (fs::path(plan.run_dir) / name).string(); };
  const std::string secret = path("secret");
  std::fprintf(stderr, "tandem launch: run directory %s (deployment %s)\n", plan.run_dir.c_str(),
               key.IdHex().c_str());

  // transport.kind local: the memory ranks are threads of compute-0 (deploy/local_ranks.h).
  const bool in_process = transport::GetTransportInfo(plan.transport).one_process;
  std::vector<std::string> addresses;
  // Memory rank i's command line, listening on `listen` (a restart listens where the rank did).
  auto memory_command = [&](size_t i, const std::string& listen) {
    const RankPlacement& r = plan.placement.memory[i];
    std::vector<std::string> argv = {r.tandem.empty() ? o.tandem_binary : r.tandem,
                                     "memory",
                                     "--rank",
                                     std::to_string(i),
                                     "--listen",
                                     listen,
                                     "--device",
                                     plan.memory_devices[i],
                                     "--kv-share",
                                     std::to_string(KvShare(plan, i)),
                                     "--transport",
                                     transport::TransportKindName(plan.transport),
                                     "--log-level",
                                     o.log_level};
    if (r.local()) {
      argv.insert(argv.end(),
                  {"--config", cfg, "--secret-file", secret, "--ready-file", path(r.name + ".ready")});
      return argv;
    }
    argv.insert(argv.end(), {"--stdin-bootstrap", "--ready-file", "-"});
    return plan.srun ? SrunArgv(r.host, argv) : SshArgv(plan.ssh, r.host, argv);
  };
  for (size_t i = 0; i < plan.memory_devices.size() && !in_process; ++i) {
    const RankPlacement& r = plan.placement.memory[i];
    const std::vector<std::string> argv = memory_command(i, plan.listen_addresses[i]);
    if (r.local()) {
      RETURN_IF_ERROR(group.Start(r.name, argv, path(r.name + ".log")));
    } else {
      RETURN_IF_ERROR(group.StartWithStdin(r.name, argv, path(r.name + ".log"), StdinBootstrap(key, yaml)));
    }
  }
  for (size_t i = 0; i < plan.memory_devices.size() && !in_process; ++i) {
    const RankPlacement& r = plan.placement.memory[i];
    absl::StatusOr<std::string> address =
        r.local() ? group.WaitReady(r.name, path(r.name + ".ready"), plan.startup_timeout)
                  : group.WaitReadyLine(r.name, kReadyMarker, plan.startup_timeout);
    if (!address.ok()) return address.status();
    addresses.emplace_back(absl::StripAsciiWhitespace(*address));
    std::fprintf(
        stderr, "tandem launch: %s listening on %s (%s%s)\n", r.name.c_str(), addresses.back().c_str(),
        plan.memory_devices[i].c_str(),
        r.local() ? "" : absl::StrCat(" on ", r.host, plan.srun ? " with srun" : " over ssh").c_str());
  }
  // Compute replicas (compute.ranks > 1): they connect to the memory ranks and listen for compute
  // rank 0.
  std::vector<std::string> replica_addresses;
  for (size_t r = 0; r < plan.replica_devices.size(); ++r) {
    const std::string name = absl::StrCat("compute-", r + 1), ready = path(name + ".ready");
    fs::remove(ready, ec);
    fs::remove(path(name + ".log"), ec);
    RETURN_IF_ERROR(group.Start(name, {o.tandem_binary, "compute",
                                       "--replica",     std::to_string(r + 1),
                                       "--config",      cfg,
                                       "--secret-file", secret,
                                       "--memory",      absl::StrJoin(addresses, ","),
                                       "--listen",      absl::StrCat(plan.compute_host, ":0"),
                                       "--device",      plan.replica_devices[r],
                                       "--transport",   transport::TransportKindName(plan.transport),
                                       "--ready-file",  ready,
                                       "--log-level",   o.log_level},
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
  if (!plan.placement.compute.local()) {
    return absl::UnimplementedError(absl::StrCat(
        "compute.hosts[0].host: ", plan.placement.compute.host,
        ": compute rank 0 runs on the launcher's host today (host: local); memory ranks may be anywhere"));
  }
  std::vector<std::string> argv = {o.tandem_binary,
                                   "compute",
                                   "--config",
                                   cfg,
                                   "--secret-file",
                                   secret,
                                   "--bind",
                                   plan.placement.compute.bind,
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
  if (plan.recover_memory_ranks) {
    // Running: compute-0 recovers the requests of a memory rank that fails (launch.recover_memory_ranks),
    // and takes back a new process of it that listens where it did (launch.restart_memory_ranks).
    for (size_t i = 0; i < addresses.size(); ++i) {
      const RankPlacement& r = plan.placement.memory[i];
      std::vector<std::string> restart = memory_command(i, addresses[i]);
      // A rank not restarted (none allowed, or past the limit) can still be started by hand where
      // compute rank 0 probes: the command for a rank of this host (a remote one's needs the
      // secret on its stdin).
      const std::string hint =
          plan.memory_rank_rejoins && r.local()
              ? absl::StrCat("compute-0 takes back a new process of it started by hand: ",
                             ShellCommandLine(restart))
              : "";
      group.Tolerate(r.name, plan.restart_memory_ranks, std::move(restart), "compute-0", hint);
    }
  }
  if (plan.recover_compute_replicas || plan.recover_memory_ranks) {
    // Running: compute-0 goes on without a replica that fails (launch.recover_compute_replicas), with
    // the others; a replica that a step discard releases exits 0.
    for (size_t r = 0; r < replica_addresses.size(); ++r) {
      group.Tolerate(absl::StrCat("compute-", r + 1), 0, {}, "compute-0");
    }
  }
  std::fprintf(stderr, "tandem launch: compute-0 ready on %s; %zu memory rank(s)%s; logs in %s/\n",
               std::string(absl::StripAsciiWhitespace(compute)).c_str(), plan.memory_devices.size(),
               in_process ? " as threads of compute-0 (transport local)" : "", plan.run_dir.c_str());
  if (!o.requests_file.empty()) {
    // Compute rank 0 runs the requests, says bye to the memory ranks and exits; they follow.
    RETURN_IF_ERROR(group.WaitExit("compute-0"));
    if (plan.recover_memory_ranks) {
      // Nobody would take a restarted rank back now.
      for (size_t i = 0; i < addresses.size(); ++i) group.Tolerate(plan.placement.memory[i].name, 0);
    }
    for (size_t i = 0; i < addresses.size(); ++i) {
      // A memory rank compute-0 gave up (recovery) may never exit by itself (a stopped process):
      // after a while it is left to the final StopAll.
      const std::string name = absl::StrCat("memory-", i);
      const absl::Status exited =
          group.WaitExit(name, plan.recover_memory_ranks ? absl::Seconds(10) : absl::InfiniteDuration());
      if (absl::IsDeadlineExceeded(exited)) {
        std::fprintf(stderr, "tandem launch: %s did not exit after compute-0 finished; stopping it\n",
                     name.c_str());
        continue;
      }
      RETURN_IF_ERROR(exited);
    }
    for (size_t r = 0; r < replica_addresses.size(); ++r) {
      // A replica compute-0 gave up may never exit by itself (a stopped process): after a while it
      // is left to the final StopAll.
      const std::string name = absl::StrCat("compute-", r + 1);
      const absl::Status exited = group.WaitExit(
          name, plan.recover_compute_replicas || plan.recover_memory_ranks ? absl::Seconds(10)
                                                                           : absl::InfiniteDuration());
      if (absl::IsDeadlineExceeded(exited)) {
        std::fprintf(stderr, "tandem launch: %s did not exit after compute-0 finished; stopping it\n",
                     name.c_str());
        continue;
      }
      RETURN_IF_ERROR(exited);
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

// How long compute-0 may take, after another rank failed, to end its requests and exit by itself.
constexpr absl::Duration kComputeZeroFailureGrace = absl::Seconds(3);

absl::Status Launch(const Config& config, const DeployPlan& plan, const LaunchOptions& options) {
  InstallTerminationSignals();
  ProcessGroup group;
  absl::Status st = LaunchIn(group, config, plan, options);
  const bool interrupted = absl::IsCancelled(st) && TerminationSignal() != 0;
  if (!st.ok() && !interrupted && group.running("compute-0") && !group.stopped("compute-0")) {
    // A rank failed and compute-0 is still up: it most likely saw the failure too. It is given a
    // moment to end the requests in flight (503, or an error line each in the results file) and to
    // tell the other ranks why, before everything is stopped.
    const absl::Time until = absl::Now() + kComputeZeroFailureGrace;
    while (group.running("compute-0") && absl::Now() < until) {
      const absl::Status exited = group.WaitExit("compute-0", until - absl::Now());
      if (exited.ok() || absl::IsDeadlineExceeded(exited) || absl::IsCancelled(exited)) break;
    }
  }
  if (!st.ok() && !interrupted && group.stopped("compute-0")) {
    // The ranks leave on their own once compute rank 0 has been silent past its heartbeats: the
    // first to go is not the cause.
    st = Annotate(st,
                  absl::StrCat("compute-0 (pid ", group.pid("compute-0"),
                               ") is stopped (SIGSTOP, or a debugger), and the ranks it drives gave it up"));
  }
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
  // Every rank has exited: the run's secret is of no further use (the logs stay).
  std::error_code ec;
  std::filesystem::remove(std::filesystem::path(plan.run_dir) / "secret", ec);
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
