// The network interface a rank binds: a deployment names it by interface name ("eth0") or by an
// address of this host ("10.0.0.2", "127.0.0.2"), and a rank resolves it on its own host
// (the launcher's host may not have it). The rank's bootstrap socket binds the address, and UCX
// is limited to the interface (UCX_NET_DEVICES; LimitUcxToInterface), so that no process of a
// deployment listens on any other interface.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tandem::bootstrap {

struct Interface {
  std::string name;     // "lo", "eth0"
  std::string address;  // the IPv4 address to bind: the one given, or the interface's first
};

// Resolves an interface name or an IPv4 address of this host. NotFound naming `what` and this
// host's interfaces ("lo 127.0.0.1, veth1 10.9.0.2") if no interface matches.
absl::StatusOr<Interface> ResolveInterface(const std::string& what);

// Sets UCX_NET_DEVICES to the interface (UCX then opens tcp, and listens, on it alone; shared
// memory transports are unaffected) unless the environment sets it already: an explicit
// UCX_NET_DEVICES wins. Call before the first UCX context of the process.
void LimitUcxToInterface(const Interface& iface);

}  // namespace tandem::bootstrap
