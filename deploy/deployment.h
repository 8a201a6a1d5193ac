// A deployment from one YAML file (docs/architecture.md, "Configuration", "Deployments across
// hosts"): the settings every rank reads, and the launcher that starts compute rank 0 (with the
// controller) and the memory ranks as separate processes (on this host, or over ssh on others),
// one log per rank, and brings them all down together.
//
//   model.path, model.weight_seed      checkpoint directory or preset, and a preset's weight seed
//   compute.device                     cpu, cuda, cuda:N or auto
//   memory.ranks, memory.devices       how many memory ranks, and their devices: one value for
//                                      all ("auto": the compute rank's device) or a comma list
//   memory.partition                   request (each request's KV on one rank) or head (every rank
//                                      holds a slice of every request's KV heads; needs
//                                      num_key_value_heads >= memory.ranks)
//   memory.host, memory.base_port      where memory ranks listen (port 0: any free port)
//   compute.hosts, memory.hosts        the pools: hosts, devices, device types and addresses to
//                                      bind (deploy/placement.h); without them, the keys above on
//                                      this host
//   transport.kind                     auto, ucx, p2p, nccl or verbs (one kind for the deployment;
//                                      auto: a lookup over the transport table, see ResolveTransport)
//   transport.checksums                per-layer payload checksums (auto: on, except on nccl's
//                                      device path; ChecksumsOn)
//   scheduler.*, kv.*                  as for the colocated engine (kv.* applies to each rank)
//   launch.*                           run directory, time limits, the ssh client
//
// Every run gets its own directory, <launch.run_dir>/run-<UTC time>-<pid> (and the link
// <launch.run_dir>/latest to it): its logs, ready files, effective config, the deployment secret
// (mode 0600, removed when the run ends; common/bootstrap/deployment_key.h) and generate's
// requests and results, so two
// deployments sharing a run_dir never read each other's files. Ranks on other hosts are started
// over ssh (deploy/ssh_launcher.h).
//
// Launch order: memory ranks first (each writes its transport address to a ready file once it
// listens), then compute rank 0 with those addresses; it loads the weights, sends every memory
// rank a hello, and is ready when all have replied with their KV capacity. Any rank that exits
// early brings the deployment down with a message naming it; Ctrl-C or SIGTERM stops every rank
// and leaves no process behind.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/head_partition.h"
#include "common/model_spec.h"
#include "common/transport/factory.h"
#include "deploy/placement.h"

namespace tandem {

// The deployment schema (the scheduler and kv knobs included).
const ConfigSchema& DeploySchema();
// Micro-batches per step a deployment config asks for: pipeline.batches with pipeline.mode
// pingpong, fixed or rotational, 1 with none.
int PipelineMicroBatches(const Config& config);
// Layers per slice of the rotational pipeline: pipeline.slice_layers with pipeline.mode
// rotational, else 0 (ComputeRankOptions::slice_layers).
int PipelineSliceLayers(const Config& config);

// A deployment's settings, resolved against the model and the visible devices.
struct DeployPlan {
  std::string model;
  uint64_t weight_seed = 0;
  std::string compute_device;                                   // "cpu" or "cuda:N"
  std::vector<std::string> memory_devices;                      // per memory rank
  std::vector<std::string> listen_addresses;                    // per memory rank, host:port
  AttentionPartition partition = AttentionPartition::kRequest;  // memory.partition
  int micro_batches = 1;                     // pipeline.batches with pipeline.mode other than none, else 1
  int slice_layers = 0;                      // PipelineSliceLayers
  int compute_ranks = 1;                     // compute.ranks
  bool q_first = false;                      // pipeline.q_first
  std::vector<std::string> replica_devices;  // of compute ranks 1.. ("cpu", "cuda:N")
  std::string compute_host;                  // where the compute replicas listen
  transport::TransportKind transport = transport::TransportKind::kUcx;  // resolved transport.kind
  bool checksums = true;                                                // ChecksumsOn
  // launch.recover_memory_ranks, where compute rank 0 can recover (ucx, p2p or nccl; either
  // partition): the launcher then lets a memory rank fail without stopping the deployment, and,
  // with compute replicas, tolerates their exit.
  bool recover_memory_ranks = false;
  // launch.recover_compute_replicas, where compute rank 0 can recover (ucx or p2p, or nccl with
  // pipeline.mode fixed; compute.ranks 2 or more): the launcher tolerates a replica's exit (compute rank 0
  // goes on without it, with the others; a replica that compute rank 0 releases exits 0).
  bool recover_compute_replicas = false;
  // launch.restart_memory_ranks where it applies (recovery, and compute rank 0 probing lost ranks:
  // launch.rejoin_probe_s > 0), else 0: how often the launcher restarts a memory rank that died.
  int restart_memory_ranks = 0;
  // Compute rank 0 probes a lost memory rank's address and takes back a new process there, started
  // by the launcher or by hand (recovery on ucx, p2p or nccl, launch.rejoin_probe_s > 0).
  bool memory_rank_rejoins = false;
  Placement placement;  // per rank: host, address to bind, device (resolved), device type
  std::string run_dir;  // this run's own directory (<launch.run_dir>/run-<time>-<pid>; made by Launch)
  std::string ssh;      // launch.ssh: the ssh client command line for ranks on other hosts
  bool srun = false;    // launch.remote srun: ranks on other hosts are Slurm steps (deploy/slurm_launcher.h)
  absl::Duration startup_timeout, step_timeout;
};

// The resolved placement as text, one line per rank and per connection: host, device, device
// type, interface, and the transport between compute-0 and each memory rank (for `config check`).
std::string DescribePlacement(const DeployPlan& plan);
// Errors name the YAML path ("memory.devices: 3 devices listed for 2 ranks", "memory.partition:
// head needs a KV head per memory rank: num_key_value_heads (2) < memory.ranks (3)").
absl::StatusOr<DeployPlan> ResolveDeployment(const Config& config, const ModelSpec& spec);
// The value of transport.kind: nullopt for "auto", else the kind. InvalidArgument naming
// transport.kind for anything else. Parsed once, when the deployment is resolved.
absl::StatusOr<std::optional<transport::TransportKind>> ParseTransportSetting(std::string_view value);
// The kind to run, from the transport table (common/transport/factory.h) and the plan's compute,
// memory and replica devices: `requested`, if it can connect them, or for auto (nullopt) what
// transport::PickTransport chooses (p2p when every rank is on a CUDA device and no memory rank
// shares the compute rank's GPU, else ucx). A kind that cannot connect them (p2p and nccl refuse
// CPU ranks; nccl a memory rank on the compute GPU and a compute replica on a GPU another rank
// uses; a kind this build lacks) is InvalidArgument naming transport.kind and the reason.
absl::StatusOr<transport::TransportKind> ResolveTransport(std::optional<transport::TransportKind> requested,
                                                          const DeployPlan& plan);

// transport.checksums for a deployment over `kind`: true or false as set; auto is on where the
// checks cost under 2% of a decode step (the host-staged path's crc32c, p2p's device path) and off
// on nccl, whose sender sums each payload in a kernel of its own before the send (docs/benchmarks.md,
// "Payload checksums on the device path" and "Payload checksums on `nccl`").
bool ChecksumsOn(const Config& config, transport::TransportKind kind);

struct LaunchOptions {
  std::string tandem_binary;  // the `tandem` executable the ranks run
  std::string log_level = "info";
  std::string requests_file;   // JSON lines for compute rank 0 to run; empty: serve until stopped
  std::string results_file;    // where compute rank 0 writes the results
  std::string api_ready_file;  // serving: the API's base URL is written here once it is ready
};

// Starts the deployment, runs it (until the requests are done, or until a signal) and stops it.
// Progress goes to stderr. Writes the effective configuration to <run_dir>/deploy.yaml, which
// the ranks read.
absl::Status Launch(const Config& config, const DeployPlan& plan, const LaunchOptions& options);

}  // namespace tandem
