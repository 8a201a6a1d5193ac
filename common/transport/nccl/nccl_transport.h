// The NCCL transport (design: common/transport/nccl/nccl_internal.h): GPUs of one host or of several,
// payloads carried by NCCL point-to-point transfers between 2-rank communicators, control plane
// over UCX. Has the device data path of transport.h (EnqueueWrite / EnqueueWait / SyncStream).
// Part of the CUDA build only (target tandem_transport_nccl).
//
// NCCL matches sends and receives by order, not by address: every EnqueueWrite to a peer must be
// matched by exactly one EnqueueWait of that peer for the same number of bytes, in the same order
// (the receiver's offset decides where the bytes land), and the receives from one peer are
// enqueued on one stream between two SyncStreams of it. Host-path writes (Write) and device-path
// writes must not both be in flight on one peer in one direction.
//
// EnqueueWrite's send runs on a stream of the peer's own, after the caller's stream has reached
// the call, so that the caller's stream never waits for the peer to receive (pipelined steps
// depend on it). Its source is therefore read until the peer has received it, not only until the
// caller's stream has passed the call: rewrite it only after something the peer sent back in
// response has arrived, or after SyncStream (which waits for the stream's sends).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

struct NcclOptions {
  std::string listen_address;  // as UcxOptions::listen_address
  int device = 0;              // this process's GPU: registered buffers live there
  // Ranks of other processes may be on this GPU (factory.h, NcclSharesGpus): this process gives
  // NCCL a host id of its own (NCCL_HOSTID, unless set), so their transfers go over NCCL's network
  // transport. For running the transport on a machine with one GPU.
  bool share_gpu = false;
};

// Unavailable without a CUDA device, NCCL (2.18 or newer) or UCX; InvalidArgument for a device that
// is not visible.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options);

}  // namespace tandem::transport
