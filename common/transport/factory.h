// Choosing a transport by name (the deployment's `transport.kind`): which ones this build has,
// and creating one. A transport that is not compiled in says so; one that finds no hardware
// fails with Unavailable and the reason (DESIGN.md: it never pretends).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/transport/transport.h"

namespace tandem::transport {

enum class TransportKind : uint8_t { kUcx, kP2p, kNccl, kVerbs };

struct TransportOptions {
  TransportKind kind = TransportKind::kUcx;
  // "host:port" to listen on (port 0: any free port); empty: do not listen.
  std::string listen_address;
  // This process's CUDA device: where p2p and nccl buffers live (and verbs' GPU buffers); -1: none.
  int device = -1;
};

// "ucx", "p2p", "nccl", "verbs"; InvalidArgument naming the choices otherwise.
absl::StatusOr<TransportKind> ParseTransportKind(std::string_view name);
const char* TransportKindName(TransportKind kind);
// Whether this build contains the transport (p2p and nccl need the CUDA build).
bool TransportBuilt(TransportKind kind);
// Unavailable for a transport this build lacks ("nccl: not built (this build has no CUDA)").
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options);

}  // namespace tandem::transport
