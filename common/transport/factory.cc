#include "common/transport/factory.h"

#include <cstdlib>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/status.h"

#if TANDEM_TRANSPORT_P2P
#include "common/transport/p2p/p2p_transport.h"
#endif
#if TANDEM_TRANSPORT_NCCL
#include "common/transport/nccl/nccl_transport.h"
#endif
#include "common/transport/fault/fault_transport.h"
#include "common/transport/local/local_transport.h"
#include "common/transport/verbs/verbs_transport.h"

namespace tandem::transport {

namespace {

constexpr bool kCudaBuild = TANDEM_TRANSPORT_P2P != 0;  // p2p is built exactly in CUDA builds

// Rows in TransportKind order; see TransportInfo for the columns.
constexpr TransportInfo kTable[] = {
    {.kind = TransportKind::kUcx,
     .name = "ucx",
     .built = true,
     .needs_gpus = false,
     .same_host_only = false,
     .device_polling = false,
     .shares_compute_gpu = true,
     .chosen_by_auto = true,
     .one_process = false},
    {.kind = TransportKind::kP2p,
     .name = "p2p",
     .built = TANDEM_TRANSPORT_P2P != 0,
     .needs_gpus = true,
     .same_host_only = true,
     .device_polling = true,
     .shares_compute_gpu = true,  // on one GPU its waits are IPC events, not spinning kernels
     .chosen_by_auto = true,
     .one_process = false},
    {.kind = TransportKind::kNccl,
     .name = "nccl",
     .built = TANDEM_TRANSPORT_NCCL != 0,
     .needs_gpus = true,
     .same_host_only = false,
     .device_polling = true,
     .shares_compute_gpu = false,  // NCCL also refuses two ranks on one GPU
     .chosen_by_auto = false,
     .one_process = false},
    // Today's verbs rows run on any device and share the compute GPU (its waits are only on the
    // layers' doorbells); it fails at start where there is no RDMA device.
    {.kind = TransportKind::kVerbs,
     .name = "verbs",
     .built = true,
     .needs_gpus = false,
     .same_host_only = false,
     .device_polling = kCudaBuild,  // GPUDirect RDMA with device-side doorbell waits
     .shares_compute_gpu = true,
     .chosen_by_auto = false,
     .one_process = false},
    // Threads of one process: copies between their buffers, CUDA events between their streams.
    {.kind = TransportKind::kLocal,
     .name = "local",
     .built = true,
     .needs_gpus = false,
     .same_host_only = true,
     .device_polling = kCudaBuild,
     .shares_compute_gpu = true,
     .chosen_by_auto = true,
     .one_process = true},
};

std::string DeviceName(int device) { return device < 0 ? "cpu" : absl::StrCat("cuda:", device); }

}  // namespace

std::string TransportInfo::CannotConnect(const RankLayout& layout) const {
  if (!built) return absl::StrCat(name, " is not in this build (it needs the CUDA build)");
  bool gpus = layout.compute_device >= 0;
  std::string shared;  // a memory rank on the compute rank's GPU
  for (size_t i = 0; i < layout.memory_devices.size(); ++i) {
    gpus = gpus && layout.memory_devices[i] >= 0;
    if (layout.memory_devices[i] == layout.compute_device && shared.empty()) {
      shared = absl::StrCat("memory rank ", i);
    }
  }
  if (needs_gpus && !gpus) return absl::StrCat(name, " moves data between GPUs, but ranks run on the CPU");
  if (same_host_only && !layout.one_host) {
    return absl::StrCat(name, " connects processes of one host only, but the ranks are on several hosts");
  }
  const bool shares_gpu = shares_compute_gpu || (kind == TransportKind::kNccl && NcclSharesGpus());
  if (!shares_gpu && !shared.empty() && layout.compute_device >= 0) {
    return absl::StrCat(name, " needs every memory rank on a GPU other than the compute rank's, but ", shared,
                        " is on ", DeviceName(layout.compute_device), " too (use ucx or auto)");
  }
  for (size_t r = 0; r < layout.replica_devices.size() && !shares_gpu; ++r) {
    const int device = layout.replica_devices[r];
    if (device < 0) continue;
    std::string other;  // a rank it may connect to, on its GPU
    if (device == layout.compute_device) other = "compute rank 0";
    for (size_t i = 0; i < layout.memory_devices.size() && other.empty(); ++i) {
      if (layout.memory_devices[i] == device) other = absl::StrCat("memory rank ", i);
    }
    for (size_t q = 0; q < r && other.empty(); ++q) {
      if (layout.replica_devices[q] == device) other = absl::StrCat("compute rank ", q + 1);
    }
    if (!other.empty()) {
      return absl::StrCat(name, " needs every compute replica on a GPU of its own, but compute rank ", r + 1,
                          " is on ", DeviceName(device), " as is ", other, " (set compute.replica_devices)");
    }
  }
  return "";
}

bool NcclSharesGpus() {
  const char* v = std::getenv("TANDEM_NCCL_SHARE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

std::span<const TransportInfo> TransportTable() { return kTable; }

const TransportInfo& GetTransportInfo(TransportKind kind) {
  for (const TransportInfo& t : kTable) {
    if (t.kind == kind) return t;
  }
  TANDEM_CHECK_MSG(false, "transport kind ", static_cast<int>(kind), " missing from the table");
  return kTable[0];
}

TransportKind PickTransport(const RankLayout& layout) {
  bool one_gpu = layout.compute_device >= 0;
  for (int d : layout.memory_devices) one_gpu = one_gpu && d == layout.compute_device;
  const TransportInfo* pick = nullptr;
  for (const TransportInfo& t : kTable) {
    if (!t.chosen_by_auto || !t.CannotConnect(layout).empty()) continue;
    if (t.one_process) {
      if (one_gpu && t.device_polling) return t.kind;
      continue;
    }
    if (pick == nullptr || (t.device_polling && !pick->device_polling)) pick = &t;
  }
  TANDEM_CHECK_MSG(pick != nullptr, "no transport connects the layout (ucx connects every one)");
  return pick->kind;
}

absl::StatusOr<TransportKind> ParseTransportKind(std::string_view name) {
  for (const TransportInfo& t : kTable) {
    if (name == t.name) return t.kind;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport \"", std::string(name), "\"; expected ucx, p2p, nccl, verbs or local"));
}

const char* TransportKindName(TransportKind kind) { return GetTransportInfo(kind).name; }

bool TransportBuilt(TransportKind kind) { return GetTransportInfo(kind).built; }

namespace {

absl::StatusOr<std::unique_ptr<Transport>> CreateTransportOfKind(const TransportOptions& o) {
  if (!TransportBuilt(o.kind)) {
    return absl::UnavailableError(
        absl::StrCat(TransportKindName(o.kind), " transport: not built (this build has no CUDA)"));
  }
  switch (o.kind) {
    case TransportKind::kUcx:
      return CreateUcxTransport({.listen_address = o.listen_address, .send_timeout = o.send_timeout});
    case TransportKind::kP2p:
#if TANDEM_TRANSPORT_P2P
      return CreateP2pTransport({.listen_address = o.listen_address, .device = o.device});
#else
      break;
#endif
    case TransportKind::kNccl:
#if TANDEM_TRANSPORT_NCCL
      return CreateNcclTransport(
          {.listen_address = o.listen_address, .device = o.device, .share_gpu = NcclSharesGpus()});
#else
      break;
#endif
    case TransportKind::kVerbs:
      return CreateVerbsTransport({.listen_address = o.listen_address, .device = o.device});
    case TransportKind::kLocal:
      return CreateLocalTransport({.device = o.device});
  }
  return absl::InternalError("unreachable transport kind");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& o) {
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> t, CreateTransportOfKind(o));
  return WrapWithFaultsFromEnvironment(std::move(t));
}

}  // namespace tandem::transport
