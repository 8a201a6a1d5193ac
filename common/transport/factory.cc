#include "common/transport/factory.h"

#include "absl/strings/str_cat.h"

#if TANDEM_TRANSPORT_P2P
#include "common/transport/p2p/p2p_transport.h"
#endif
#if TANDEM_TRANSPORT_NCCL
#include "common/transport/nccl/nccl_transport.h"
#endif
#include "common/transport/verbs/verbs_transport.h"

namespace tandem::transport {

absl::StatusOr<TransportKind> ParseTransportKind(std::string_view name) {
  for (TransportKind k :
       {TransportKind::kUcx, TransportKind::kP2p, TransportKind::kNccl, TransportKind::kVerbs}) {
    if (name == TransportKindName(k)) return k;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown transport \"", std::string(name), "\"; expected ucx, p2p, nccl or verbs"));
}

const char* TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kUcx:
      return "ucx";
    case TransportKind::kP2p:
      return "p2p";
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kVerbs:
      return "verbs";
  }
  return "?";
}

bool TransportBuilt(TransportKind kind) {
  switch (kind) {
    case TransportKind::kUcx:
    case TransportKind::kVerbs:
      return true;
    case TransportKind::kP2p:
      return TANDEM_TRANSPORT_P2P != 0;
    case TransportKind::kNccl:
      return TANDEM_TRANSPORT_NCCL != 0;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& o) {
  if (!TransportBuilt(o.kind)) {
    return absl::UnavailableError(
        absl::StrCat(TransportKindName(o.kind), " transport: not built (this build has no CUDA)"));
  }
  switch (o.kind) {
    case TransportKind::kUcx:
      return CreateUcxTransport({.listen_address = o.listen_address});
    case TransportKind::kP2p:
#if TANDEM_TRANSPORT_P2P
      return CreateP2pTransport({.listen_address = o.listen_address, .device = o.device});
#else
      break;
#endif
    case TransportKind::kNccl:
#if TANDEM_TRANSPORT_NCCL
      return CreateNcclTransport({.listen_address = o.listen_address, .device = o.device});
#else
      break;
#endif
    case TransportKind::kVerbs:
      return CreateVerbsTransport({.listen_address = o.listen_address, .device = o.device});
  }
  return absl::InternalError("unreachable transport kind");
}

}  // namespace tandem::transport
