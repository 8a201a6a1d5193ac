// The NCCL transport (design: common/transport/nccl/nccl_internal.h): GPUs of one host or of several,
// payloads carried by NCCL point-to-point transfers between 2-rank communicators, control plane
// over UCX. Has the device data path of transport.h (EnqueueWrite / EnqueueWait / SyncStream).
// Part of the CUDA build only (target tandem_transport_nccl).
//
// NCCL matches sends and receives by order, not by address: every EnqueueWrite to a peer must be
// matched by exactly one EnqueueWait of that peer for the same number of bytes, in the same order
// (the receiver's offset decides where the bytes land). Host-path writes (Write) and device-path
// writes must not both be in flight on one peer in one direction.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

struct NcclOptions {
  std::string listen_address;  // as UcxOptions::listen_address
  int device = 0;              // this process's GPU: registered buffers live there
};

// Unavailable without a CUDA device, NCCL (2.18 or newer) or UCX; InvalidArgument for a device that
// is not visible.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options);

}  // namespace tandem::transport
