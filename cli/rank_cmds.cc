// `tandem memory`, `tandem compute` and `tandem launch`: the roles of a deployment as processes,
// and the launcher that starts them from one YAML file (deploy/deployment.h).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/prompts.h"
#include "cli/run_files.h"
#include "common/bootstrap/deployment_key.h"
#include "common/bootstrap/interfaces.h"
#include "common/config.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/compute_rank.h"
#include "compute_node/controller_settings.h"
#include "compute_node/weights.h"
#include "deploy/deployment.h"
#include "deploy/local_ranks.h"
#include "deploy/process_group.h"
#include "deploy/slurm_launcher.h"
#include "deploy/ssh_launcher.h"
#include "kernels/cuda/device_choice.h"
#include "memory_node/memory_rank.h"
#include "server/api_server.h"
#include "server/engine_loop.h"
#include "server/metrics.h"

namespace tandem::cli {

namespace {

absl::Status StartLogging(const std::string& tag, const std::string& level) {
  const std::optional<LogLevel> l = ParseLogLevel(level);
  if (!l) return absl::InvalidArgumentError(absl::StrCat("--log-level: unknown level \"", level, "\""));
  InitLogging(tag, *l);
  return absl::OkStatus();
}

absl::StatusOr<Config> LoadDeployConfig(const std::string& file, const std::vector<std::string>& sets) {
  return LoadConfigFile(DeploySchema(), file, sets);
}

struct MemoryArgs {
  std::string config, ready_file, listen = "127.0.0.1:0", device = "cpu", log_level = "info",
                                  transport = "ucx", secret_file;
  bool stdin_bootstrap = false;
  int rank = 0;
  int kv_share = 1;
};

// --secret-file: this process's deployment key (common/bootstrap/deployment_key.h).
absl::Status UseSecretFile(const std::string& file) {
  if (file.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const bootstrap::DeploymentKey key, bootstrap::LoadKeyFile(file));
  bootstrap::SetProcessKey(key);
  return absl::OkStatus();
}

absl::StatusOr<Config> LoadRankConfig(const std::string& file, bool stdin_bootstrap) {
  if (!stdin_bootstrap) {
    if (file.empty())
      return absl::InvalidArgumentError("--config: the deployment's YAML is needed (or --stdin-bootstrap)");
    return LoadDeployConfig(file, {});
  }
  // Started over ssh (deploy/ssh_launcher.h): secret and config on stdin, which then stays open
  // until the launcher goes.
  ASSIGN_OR_RETURN(const std::string yaml, ReadStdinBootstrap(absl::Seconds(60)));
  WatchStdinForLauncher();
  return LoadConfig(DeploySchema(), yaml, "deploy.yaml (from the launcher)", {});
}

// host:port where host may be an interface name ("eth0"): its address on this host.
absl::StatusOr<std::string> ListenAddress(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat("--listen: expected host:port, got ", listen));
  const std::string host = listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host.find(':') != std::string::npos) return listen;
  absl::StatusOr<bootstrap::Interface> iface = bootstrap::ResolveInterface(host);
  if (!iface.ok()) return listen;  // a host name: the transport resolves it
  return absl::StrCat(iface->address, listen.substr(colon));
}

absl::Status RunMemory(const MemoryArgs& a) {
  RETURN_IF_ERROR(StartLogging(absl::StrCat("memory-", a.rank), a.log_level));
  InstallTerminationSignals();
  RETURN_IF_ERROR(UseSecretFile(a.secret_file));
  ASSIGN_OR_RETURN(const Config config, LoadRankConfig(a.config, a.stdin_bootstrap));
  MemoryRankOptions o;
  o.rank = a.rank;
  ASSIGN_OR_RETURN(o.listen_address, ListenAddress(a.listen));
  o.device = a.device;
  o.kv_share = a.kv_share;
  ASSIGN_OR_RETURN(o.transport, transport::ParseTransportKind(a.transport));
  o.startup_timeout = absl::Seconds(config.GetDouble("launch.startup_timeout_s"));
  o.step_timeout = absl::Seconds(config.GetDouble("launch.step_timeout_s"));
  const SchedulerKvSettings kv = SchedulerKvSettingsFromConfig(config);
  ASSIGN_OR_RETURN(const KvTierEviction eviction, ParseKvTierEviction(kv.tiers_eviction));
  o.tiers = {.host_bytes = kv.tiers_host_bytes,
             .disk_dir = kv.tiers_disk_dir,
             .disk_bytes = kv.tiers_disk_bytes,
             .persist = kv.tiers_persist,
             .eviction = eviction};
  o.model = absl::StrCat(config.GetString("model.path"), " seed ", config.GetInt("model.weight_seed"));
  o.on_listening = [&](const std::string& address) {
    if (a.ready_file == "-") {  // to the launcher through ssh (deploy/ssh_launcher.h)
      std::printf("%s %s\n", kReadyMarker, address.c_str());
      std::fflush(stdout);
      return absl::OkStatus();
    }
    return a.ready_file.empty() ? absl::OkStatus() : WriteFileAtomic(a.ready_file, address + "\n");
  };
  o.stop_requested = [] { return TerminationSignal() != 0; };
  return RunMemoryRank(o);
}

struct ComputeArgs {
  std::string config, memory, memory_devices, ready_file, requests, results, replicas,
      listen = "127.0.0.1:0", device = "cpu", log_level = "info", transport = "ucx", secret_file, bind;
  int replica = 0;  // 0: compute rank 0 (the controller); r > 0: compute replica r
};

absl::Status RunCompute(const ComputeArgs& a) {
  RETURN_IF_ERROR(StartLogging(absl::StrCat("compute-", a.replica), a.log_level));
  InstallTerminationSignals();
  RETURN_IF_ERROR(UseSecretFile(a.secret_file));
  if (!a.bind.empty() && a.bind != "0.0.0.0") {
    ASSIGN_OR_RETURN(const bootstrap::Interface iface, bootstrap::ResolveInterface(a.bind));
    bootstrap::LimitUcxToInterface(iface);
  }
  ASSIGN_OR_RETURN(const Config c, LoadDeployConfig(a.config, {}));
  ASSIGN_OR_RETURN(
      std::unique_ptr<WeightSource> source,
      OpenModel(c.GetString("model.path"), static_cast<uint64_t>(c.GetInt("model.weight_seed"))));
  TANDEM_LOG_INFO("compute", "loading ", source->Describe());
  ComputeRankOptions o;
  ASSIGN_OR_RETURN(o.device, kernels::ResolveDevice(a.device, source->spec()));
  ASSIGN_OR_RETURN(o.transport, transport::ParseTransportKind(a.transport));
  // transport.kind local: the memory ranks are threads of this process (deploy/local_ranks.h); they
  // outlive the compute rank (declared first), which says bye to them.
  std::unique_ptr<LocalMemoryRanks> local;
  const SchedulerKvSettings settings = SchedulerKvSettingsFromConfig(c);
  if (transport::GetTransportInfo(o.transport).one_process) {
    if (a.memory_devices.empty())
      return absl::InvalidArgumentError("--memory-devices: needed with --transport local");
    ASSIGN_OR_RETURN(const KvTierEviction eviction, ParseKvTierEviction(settings.tiers_eviction));
    ASSIGN_OR_RETURN(
        local, LocalMemoryRanks::Start(absl::StrSplit(a.memory_devices, ','),
                                       {.startup = absl::Seconds(c.GetDouble("launch.startup_timeout_s")),
                                        .step = absl::Seconds(c.GetDouble("launch.step_timeout_s")),
                                        .tiers = {.host_bytes = settings.tiers_host_bytes,
                                                  .disk_dir = settings.tiers_disk_dir,
                                                  .disk_bytes = settings.tiers_disk_bytes,
                                                  .persist = settings.tiers_persist,
                                                  .eviction = eviction},
                                        .model = absl::StrCat(c.GetString("model.path"), " seed ",
                                                              c.GetInt("model.weight_seed"))}));
    o.memory_addresses = local->addresses();
  } else {
    if (a.memory.empty())
      return absl::InvalidArgumentError("--memory: the memory ranks' addresses are needed");
    o.memory_addresses = absl::StrSplit(a.memory, ',');
  }
  // After the bye: the local memory ranks end on their own; a rank's error is the deployment's.
  auto join_local = [&local](absl::Status st) {
    if (local == nullptr) return st;
    const absl::Status joined = local->Join(absl::Now() + absl::Seconds(20));
    return st.ok() ? joined : st;
  };
  ASSIGN_OR_RETURN(o.partition, ParseAttentionPartition(c.GetString("memory.partition")));
  // The memory ranks compute in the compute rank's dtype, and keep KV in it: fp32 on CPU ranks, bf16
  // on CUDA ranks (the tiers' block size follows).
  ASSIGN_OR_RETURN(o.scheduler, ResolveControllerOptions(
                                    settings, source->spec().kv_bytes_per_token(o.device < 0 ? 4 : 2)));
  o.kv_capacity_tokens = settings.kv_capacity_tokens;
  o.kv_memory_fraction = settings.kv_memory_fraction;
  o.checksums = ChecksumsOn(c, o.transport);
  o.cuda_graphs = c.GetBool("compute.cuda_graphs");
  o.profile = c.GetBool("compute.profile");
  o.startup_timeout = absl::Seconds(c.GetDouble("launch.startup_timeout_s"));
  o.step_timeout = absl::Seconds(c.GetDouble("launch.step_timeout_s"));
  o.recover_memory_ranks = c.GetBool("launch.recover_memory_ranks");
  o.recover_compute_replicas = c.GetBool("launch.recover_compute_replicas");
  o.heartbeat = absl::Seconds(c.GetDouble("launch.heartbeat_s"));
  o.rejoin_probe = absl::Seconds(c.GetDouble("launch.rejoin_probe_s"));
  o.micro_batches = PipelineMicroBatches(c);
  o.slice_layers = PipelineSliceLayers(c);
  o.q_first = c.GetBool("pipeline.q_first");
  if (!a.replicas.empty()) o.replica_addresses = absl::StrSplit(a.replicas, ',');
  if (a.replica > 0) {
    // A compute replica: it runs the micro-batches compute rank 0 hands it, until bye.
    ComputeReplicaOptions r;
    r.compute_rank = a.replica;
    r.compute_ranks = static_cast<int>(c.GetInt("compute.ranks"));
    r.listen_address = a.listen;
    r.on_listening = [&](const std::string& address) {
      return a.ready_file.empty() ? absl::OkStatus() : WriteFileAtomic(a.ready_file, address + "\n");
    };
    r.stop_requested = [] { return TerminationSignal() != 0; };
    r.rank = o;
    return RunComputeReplica(*source, r);
  }
  if (a.requests.empty()) {
    // Serving: the OpenAI-compatible API (api.*) over this rank, until SIGTERM drains it. The socket
    // is bound before the weights load, so a port in use fails the deployment at once.
    const server::ApiOptions api = server::ApiOptionsFromConfig(c);
    ASSIGN_OR_RETURN(std::unique_ptr<server::ApiServer> http, server::ApiServer::Start(api));
    ASSIGN_OR_RETURN(std::unique_ptr<ComputeRank> rank, ComputeRank::Create(*source, o));
    std::unique_ptr<text::TextModel> text = LoadServeText(c.GetString("model.path"));
    http->SetText(text.get());
    server::ServerMetrics metrics;
    server::EngineLoop loop(
        rank.get(), server::LoopOptionsFromConfig(c),
        [&metrics](const GenerationResult& r, const server::RequestTimes& t) { metrics.Observe(r, t); });
    http->SetLoop(&loop, &metrics);
    const std::string url = absl::StrCat("http://", api.host, ":", http->port(), "/v1");
    if (!a.ready_file.empty())
      RETURN_IF_ERROR(WriteFileAtomic(a.ready_file, absl::StrCat(rank->device(), "; API ", url, "\n")));
    TANDEM_LOG_INFO("compute", "compute rank 0 ready on ", rank->device(), "; API at ", url);
    while (TerminationSignal() == 0 && loop.failure().ok()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (const absl::Status failed = loop.failure(); !failed.ok()) {
      // A rank lost that this deployment cannot do without (a failed step or heartbeat): the
      // requests were told; the memory ranks are told why (each stops naming the cause), and
      // compute rank 0 exits with it.
      // The API answers 503 with the cause (/health too) until the ranks are told, and for at
      // least kFailedLinger, so that a client polling /health learns why before the port closes.
      constexpr absl::Duration kFailedLinger = absl::Seconds(1);
      const absl::Time failed_at = absl::Now();
      TANDEM_LOG_ERROR("compute", "the deployment cannot go on: ", failed.message());
      http->Draining();
      loop.Shutdown(absl::ZeroDuration());
      rank->Abandon(failed);
      while (absl::Now() < failed_at + kFailedLinger && TerminationSignal() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      http->Stop();
      return join_local(failed);
    }
    TANDEM_LOG_INFO("compute", "draining the API (api.shutdown_grace_s ", api.shutdown_grace_s, ")");
    http->Draining();
    loop.Shutdown(absl::Seconds(api.shutdown_grace_s));
    http->Stop();
    return join_local(rank->Shutdown());
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ComputeRank> rank, ComputeRank::Create(*source, o));
  if (!a.ready_file.empty()) RETURN_IF_ERROR(WriteFileAtomic(a.ready_file, rank->device() + "\n"));
  TANDEM_LOG_INFO("compute", "compute rank 0 ready on ", rank->device());
  ASSIGN_OR_RETURN(const std::vector<PromptSpec> specs, ReadPromptsFile(a.requests));
  std::vector<GenerationRequest> requests = RequestsFromPrompts(specs, GenerationRequest{});
  RunStats stats;
  absl::StatusOr<std::vector<GenerationResult>> results = RunRequests(*rank, std::move(requests), &stats, [] {
    return TerminationSignal() != 0 ? absl::CancelledError("stopped by a signal") : absl::OkStatus();
  });
  if (!results.ok()) {
    if (absl::IsCancelled(results.status())) {  // stopped by a signal: the ranks are told bye
      (void)rank->Shutdown();
      return results.status();
    }
    // A rank lost that this deployment cannot do without: an error line per request (the steps'
    // tokens are not kept), the ranks told why (each stops naming the cause), and exit with it.
    TANDEM_LOG_ERROR("compute", "the deployment cannot go on: ", results.status().message());
    std::vector<GenerationResult> failed(specs.size());
    for (GenerationResult& r : failed) {
      r.finish_reason = "error";
      r.error = Annotate(results.status(), "the engine failed");
    }
    stats.device = rank->device();
    const absl::Status written = WriteResultsFile(a.results, failed, stats);
    if (!written.ok()) TANDEM_LOG_ERROR("compute", written.message());
    rank->Abandon(results.status());
    return join_local(results.status());
  }
  // Where the steps' time went (compute_node/pipeline_report.h); a memory rank that cannot say
  // fails the run, as it would fail a step.
  ASSIGN_OR_RETURN(const PipelineTotals totals, rank->Pipeline());
  stats.pipeline = MakePipelineReport(totals).ToString();
  TANDEM_LOG_INFO("compute", "pipeline: ", stats.pipeline);
  if (const EngineStats es = rank->stats(); es.memory_ranks_lost > 0 || es.compute_ranks_lost > 0) {
    if (es.memory_ranks_lost > 0) {
      stats.recovery =
          absl::StrCat(es.memory_ranks_lost, " memory rank(s) lost, ", es.memory_ranks_rejoined,
                       " rejoined, ", es.requests_recovered, " request(s) recovered by recomputation");
    }
    if (es.compute_ranks_lost > 0) {
      absl::StrAppend(&stats.recovery, stats.recovery.empty() ? "" : "; ", es.compute_ranks_lost,
                      " compute replica(s) lost, ", es.steps_rerun, " step(s) rerun on the survivors");
    } else if (es.steps_rerun > 0) {
      // A memory rank lost while replicas ran: the step rerun on the same compute ranks.
      absl::StrAppend(&stats.recovery, stats.recovery.empty() ? "" : "; ", es.steps_rerun,
                      " step(s) rerun without the lost memory rank");
    }
    if (es.compute_replicas_kept > 0) {
      absl::StrAppend(&stats.recovery, "; compute replicas kept ", es.compute_replicas_kept, ", ",
                      es.compute_ranks_live, " compute rank(s) running");
    }
    TANDEM_LOG_WARN("compute", "recovery: ", stats.recovery);
  }
  RETURN_IF_ERROR(WriteResultsFile(a.results, *results, stats));
  TANDEM_LOG_INFO("compute", results->size(), " requests done in ", stats.seconds, " s, ", stats.steps,
                  " steps");
  return join_local(rank->Shutdown());
}

}  // namespace

// The `tandem` executable itself, for the launcher to start ranks with.
std::string SelfPath() {
  std::error_code ec;
  const std::filesystem::path p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("tandem") : p.string();
}

absl::StatusOr<DeployPlan> PlanDeployment(const Config& config) {
  ASSIGN_OR_RETURN(
      std::unique_ptr<WeightSource> source,
      OpenModel(config.GetString("model.path"), static_cast<uint64_t>(config.GetInt("model.weight_seed"))));
  return ResolveDeployment(config, source->spec());
}

void AddRankCommands(CLI::App& app) {
  {
    auto a = std::make_shared<MemoryArgs>();
    CLI::App* cmd = app.add_subcommand(
        "memory",
        "Run one memory rank (KV cache and attention on one device); started by `tandem launch`, or by "
        "hand to bring back a lost rank with the command the launcher prints when it does not restart it.");
    cmd->add_option("--config", a->config, "the deployment's YAML file (or --stdin-bootstrap)")
        ->check(CLI::ExistingFile);
    cmd->add_flag("--stdin-bootstrap", a->stdin_bootstrap,
                  "read the deployment secret and config from stdin and stop when stdin closes (a rank "
                  "started over ssh; deploy/ssh_launcher.h)");
    cmd->add_option("--secret-file", a->secret_file,
                    "the deployment secret (mode 0600) every connection proves it holds")
        ->check(CLI::ExistingFile);
    cmd->add_option("--rank", a->rank, "this rank's index")->check(CLI::Range(0, 63));
    cmd->add_option("--listen", a->listen, "host:port to listen on (port 0: any free port)")
        ->capture_default_str();
    cmd->add_option("--device", a->device, "cpu, cuda or cuda:N")->capture_default_str();
    cmd->add_option("--kv-share", a->kv_share,
                    "memory ranks sizing their KV from this device's memory (kv.memory_fraction is split "
                    "among them)")
        ->check(CLI::Range(1, 64))
        ->capture_default_str();
    cmd->add_option("--transport", a->transport,
                    "ucx, p2p, nccl or verbs (the compute rank's too; local "
                    "memory ranks are threads of `tandem compute`)")
        ->capture_default_str();
    cmd->add_option(
        "--ready-file", a->ready_file,
        "file to write this rank's address to once it listens (-: a TANDEM-READY line on stdout)");
    cmd->add_option("--log-level", a->log_level, "debug, info, warn or error")->capture_default_str();
    cmd->callback([a] {
      absl::Status st = RunMemory(*a);
      if (!st.ok()) Fail("memory", st);
    });
  }
  {
    auto a = std::make_shared<ComputeArgs>();
    CLI::App* cmd = app.add_subcommand(
        "compute",
        "Run compute rank 0 with the controller, or (--replica r) a compute replica; started by "
        "`tandem launch`.");
    cmd->add_option("--config", a->config, "the deployment's YAML file")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--secret-file", a->secret_file,
                    "the deployment secret (mode 0600) every connection proves it holds")
        ->check(CLI::ExistingFile);
    cmd->add_option("--bind", a->bind,
                    "interface name or address of this host that UCX may use (UCX_NET_DEVICES); empty: any");
    cmd->add_option("--memory", a->memory,
                    "transport addresses of the memory ranks, comma-separated, rank order");
    cmd->add_option("--memory-devices", a->memory_devices,
                    "with --transport local: run the memory ranks as threads of this process on these "
                    "devices, comma-separated, rank order");
    cmd->add_option("--device", a->device, "cpu, cuda or cuda:N")->capture_default_str();
    cmd->add_option("--transport", a->transport, "ucx, p2p, nccl, verbs or local (the memory ranks' too)")
        ->capture_default_str();
    cmd->add_option(
        "--ready-file", a->ready_file,
        "file to write once every memory rank has replied (a replica: its address, once it listens)");
    cmd->add_option(
           "--replica", a->replica,
           "run compute replica r (1 <= r < compute.ranks) instead of compute rank 0: it listens on "
           "--listen, connects to the memory ranks and runs the micro-batches compute rank 0 hands it")
        ->check(CLI::Range(0, 7));
    cmd->add_option("--listen", a->listen, "a replica's host:port to listen on (port 0: any free port)")
        ->capture_default_str();
    cmd->add_option("--replicas", a->replicas,
                    "compute rank 0: the transport addresses of compute ranks 1.., comma-separated");
    auto* req = cmd->add_option("--requests", a->requests, "JSON lines of requests to run, then exit");
    cmd->add_option("--results", a->results, "where to write the results of --requests")->needs(req);
    req->needs(cmd->get_option("--results"));
    cmd->add_option("--log-level", a->log_level, "debug, info, warn or error")->capture_default_str();
    cmd->callback([a] {
      absl::Status st = RunCompute(*a);
      if (!st.ok()) Fail("compute", st);
    });
  }
  {
    struct LaunchArgs {
      std::string file;
      std::vector<std::string> sets;
      std::string log_level = "info";
      bool slurm = false;
    };
    auto a = std::make_shared<LaunchArgs>();
    CLI::App* cmd =
        app.add_subcommand("launch",
                           "Start a deployment from a YAML file: memory ranks (on this host, or "
                           "over ssh on the hosts of memory.hosts), then\n"
                           "compute rank 0 with the controller, each a process with its own log in "
                           "this run's directory under launch.run_dir.\n"
                           "Runs until Ctrl-C or SIGTERM, then stops every rank on every host.\n"
                           "Example: tandem launch deploy/examples/cpu.yaml");
    cmd->add_option("file", a->file, "deployment YAML (see `tandem config help --deploy`)")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--set", a->sets, "override a setting: --set memory.ranks=3 (repeatable)");
    cmd->add_option("--log-level", a->log_level, "debug, info, warn or error (for every rank)")
        ->capture_default_str();
    cmd->add_flag("--slurm", a->slurm,
                  "inside a Slurm job: the memory pool from the allocation (het group 1 of a heterogeneous "
                  "job), ranks started with srun (deploy/slurm/)");
    cmd->callback([a] {
      absl::Status st = [&]() -> absl::Status {
        std::vector<std::string> sets = a->sets;
        if (a->slurm) {
          ASSIGN_OR_RETURN(const Config first, LoadDeployConfig(a->file, a->sets));
          ASSIGN_OR_RETURN(const std::vector<std::string> slurm,
                           SlurmOverrides(first.GetString("launch.slurm_devices")));
          sets.insert(sets.end(), slurm.begin(), slurm.end());
        }
        ASSIGN_OR_RETURN(const Config config, LoadDeployConfig(a->file, sets));
        ASSIGN_OR_RETURN(const DeployPlan plan, PlanDeployment(config));
        return Launch(config, plan, {.tandem_binary = SelfPath(), .log_level = a->log_level});
      }();
      if (!st.ok()) Fail("launch", st);
    });
  }
}

}  // namespace tandem::cli
