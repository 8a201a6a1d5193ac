// Where a deployment's ranks run (docs/architecture.md, "Deployments across hosts"): the compute
// and memory pools of the deployment YAML, resolved to one entry per rank.
//
//   compute:
//     hosts:                       # the compute pool (one compute rank today: one device in all)
//       - host: local              # `local` (this host, the default) or an ssh destination
//         address: 127.0.0.1       # interface name or address the rank binds on that host
//         devices: [cpu]           # one rank per device
//         device_type: epyc-9654   # free-form; carried and printed (a price table's key later)
//         tandem: /opt/tandem/bin/tandem   # the binary on that host (default: the launcher's)
//   memory:
//     hosts:                       # the memory pool
//       - {host: node-b, address: 10.0.0.2, devices: [cuda:0, cuda:1], device_type: l40s}
//
// Without `hosts`, the single-host keys are the shorthand for one local host: compute.device,
// memory.ranks / memory.devices and memory.host (the address the memory ranks bind). A pool and
// the shorthand keys of the same section are not mixed (an error names both).
//
// Errors name the YAML path of the offending value ("memory.hosts[1].devices[0]: expected cpu or
// cuda:N, got \"gpu\"").
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config.h"

namespace tandem {

struct RankPlacement {
  std::string name;         // "compute-0", "memory-1"
  std::string host;         // "local" or the ssh destination
  std::string bind;         // interface name or address on that host ("" for the compute rank: any)
  std::string device;       // as written ("cpu", "cuda:1", "auto"); the plan resolves it
  std::string device_type;  // free-form, "" when not given
  std::string tandem;       // the `tandem` binary on that host, "" for the launcher's own
  std::string path;         // the YAML path of its device, for errors ("memory.hosts[1].devices[0]")
  bool local() const { return host == "local"; }
};

struct Placement {
  RankPlacement compute;
  std::vector<RankPlacement> memory;
  bool from_pools = false;  // compute.hosts or memory.hosts was given
  // Every rank on one host (then the transport table may pick p2p or local).
  bool one_host() const;
};

// Adds compute.hosts and memory.hosts to a deployment schema.
void AddPoolKnobs(ConfigSchema* schema);
// The placement of `config`'s ranks (devices as written; not yet resolved).
absl::StatusOr<Placement> ResolvePlacement(const Config& config);

}  // namespace tandem
