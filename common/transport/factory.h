// The transport table and the factory: every transport kind this project knows, what each can
// connect, and creating one by kind (the deployment's `transport.kind`). In the spirit of NCCL's
// transport table: a deployment does not guess which data path fits its layout, it asks each
// transport (CannotConnect) and takes the first that says yes. A transport that is not compiled
// in says so; one that finds no hardware fails with Unavailable and the reason
// (docs/architecture.md, "Transports": it never pretends).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

enum class TransportKind : uint8_t { kUcx, kP2p, kNccl, kVerbs, kLocal };

// Where a deployment's ranks run, as a transport sees it. Devices: -1 for the CPU, N for cuda:N.
struct RankLayout {
  int compute_device = -1;          // compute rank 0
  std::vector<int> memory_devices;  // memory rank m's device
  // Compute ranks 1.. (compute.ranks > 1), on compute rank 0's host: each connects to compute rank
  // 0, to every memory rank and, in a rotational ring of 3 or more, to its neighbours.
  std::vector<int> replica_devices;
  bool one_host = true;  // every rank is a process of one host (all the launcher starts today)
};

// One row of the transport table. The flags describe the kind, not an instance: an instance's
// Capabilities may say less (verbs polls on the device only for ranks on a GPU).
struct TransportInfo {
  TransportKind kind;
  const char* name;         // "ucx", as in transport.kind and --transport
  bool built;               // compiled into this build (p2p and nccl need the CUDA build)
  bool needs_gpus;          // every rank on a CUDA device
  bool same_host_only;      // every rank on one host
  bool device_polling;      // CUDA ranks enqueue whole steps with device-side waits (no host per layer)
  bool shares_compute_gpu;  // a memory rank may run on the compute rank's GPU (a transport whose
                            // device waits spin would hold the GPU against the kernels awaited);
                            // if not, a compute replica needs a GPU of its own too (nccl: NCCL
                            // refuses two ranks of one communicator on one GPU)
  bool chosen_by_auto;      // transport.kind auto may pick it
  bool one_process;         // the memory ranks run as threads of compute rank 0's process (the
                            // launcher starts no memory rank processes); auto picks it first, but
                            // only when every memory rank is on the compute rank's GPU
  // Empty when this transport can connect `layout`, else why not, naming the kind ("p2p moves
  // data between GPUs, but ranks run on the CPU"). Checks, in order: built, needs_gpus,
  // same_host_only, shares_compute_gpu (the memory ranks, then the replicas).
  std::string CannotConnect(const RankLayout& layout) const;
};

// Whether NCCL ranks may share a GPU: the environment variable TANDEM_NCCL_SHARE_GPU=1, for running
// the nccl transport on a machine with one GPU (tests). Each process then gives NCCL a host id of its
// own (NCCL_HOSTID, unless set), so NCCL takes ranks on one GPU for ranks of different hosts and
// carries their transfers over its network transport (sockets; NCCL_SOCKET_IFNAME=lo keeps them on
// loopback) instead of NVLink: the same code paths of this project, at a network's speed.
bool NcclSharesGpus();

// Every kind, in TransportKind order (ucx, p2p, nccl, verbs, local).
std::span<const TransportInfo> TransportTable();
const TransportInfo& GetTransportInfo(TransportKind kind);
// transport.kind auto: local when every memory rank is on the compute rank's GPU (one process, one
// CUDA context); else among the kinds chosen by auto that can connect `layout`, one with device
// polling if there is one, else the first. ucx connects every layout, so there is always one:
// today local for one GPU, p2p when every rank has a GPU, else ucx.
// (nccl is never chosen: on one host p2p connects every layout it does; verbs is never chosen:
// it needs an RDMA device that a layout does not show.)
TransportKind PickTransport(const RankLayout& layout);

struct TransportOptions {
  TransportKind kind = TransportKind::kUcx;
  // "host:port" to listen on (port 0: any free port); empty: do not listen.
  std::string listen_address;
  // This process's CUDA device: where p2p and nccl buffers live (and verbs' GPU buffers); -1: none.
  int device = -1;
  // ucx: UcxOptions::send_timeout (a rank passes its step timeout).
  absl::Duration send_timeout = absl::InfiniteDuration();
};

// "ucx", "p2p", "nccl", "verbs", "local"; InvalidArgument naming the choices otherwise.
absl::StatusOr<TransportKind> ParseTransportKind(std::string_view name);
const char* TransportKindName(TransportKind kind);
// Whether this build contains the transport (GetTransportInfo(kind).built).
bool TransportBuilt(TransportKind kind);
// Unavailable for a transport this build lacks ("nccl: not built (this build has no CUDA)").
// When the environment variable TANDEM_FAULTS holds a fault spec, the transport comes wrapped in
// the fault-injecting transport (common/transport/fault/fault_transport.h: a testing aid);
// InvalidArgument naming TANDEM_FAULTS for a bad spec.
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

}  // namespace tandem::transport
