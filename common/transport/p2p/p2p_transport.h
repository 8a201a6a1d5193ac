// The p2p transport (common/transport/p2p/p2p_transport.cc): GPUs of one host, payload and
// doorbell copied straight into the receiver's device memory through CUDA IPC, control plane over
// UCX. Part of the CUDA build only (target tandem_transport_p2p).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

struct P2pOptions {
  std::string listen_address;  // as UcxOptions::listen_address
  int device = 0;              // this process's GPU: registered buffers live there
  bool checksums = true;       // device waits check each payload's checksum (see the .cc's comment)
};

// Unavailable without a CUDA device (or UCX); InvalidArgument for a device that is not visible.
absl::StatusOr<std::unique_ptr<Transport>> CreateP2pTransport(const P2pOptions& options);

}  // namespace tandem::transport
