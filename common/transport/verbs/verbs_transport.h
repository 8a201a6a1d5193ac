// The verbs transport (common/transport/verbs/verbs_transport.cc): one-sided RDMA WRITEs over
// reliable-connected queue pairs (libibverbs), into host memory or, in CUDA builds, straight into
// GPU memory (GPUDirect RDMA); control plane over UCX. Built everywhere (target
// tandem_transport_verbs); it needs an RDMA device at run time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

struct VerbsOptions {
  // Control plane (UCX), as UcxOptions::listen_address.
  std::string listen_address;
  // CUDA device whose memory buffers may live in (GPUDirect RDMA) and whose streams the device
  // data path serves; -1: host memory only. A build without CUDA is host memory only whatever
  // this says (capabilities() tells).
  int device = -1;
  std::string rdma_device;  // ibverbs device name ("mlx5_0"); empty: the first one found
  int port = 1;             // port of that device
  int gid_index = 0;        // GID table entry to address peers with (RoCE: the RoCE v2 entry)
};

// Unavailable with the reason when there is no RDMA device ("verbs transport: no RDMA device
// (ibv_get_device_list found 0)"), when the named one is missing (naming those present), when its
// port is not active, without UCX, or (device >= 0) without a CUDA device. InvalidArgument for a
// CUDA device that is not visible.
absl::StatusOr<std::unique_ptr<Transport>> CreateVerbsTransport(const VerbsOptions& options);

// The names of this host's RDMA devices, as ibv_get_device_list reports them (empty without any).
std::vector<std::string> RdmaDeviceNames();

}  // namespace tandem::transport
