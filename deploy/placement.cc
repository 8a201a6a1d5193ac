#include "deploy/placement.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "yaml-cpp/yaml.h"

namespace tandem {
namespace {

constexpr const char* kHostKeys[] = {"host", "address", "devices", "device_type", "tandem"};

absl::StatusOr<std::string> Scalar(const YAML::Node& entry, const std::string& key,
                                   const std::string& where) {
  const YAML::Node v = entry[key];
  if (!v) return std::string();
  if (!v.IsScalar() || v.Scalar().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ".", key, ": expected a non-empty string"));
  }
  return v.Scalar();
}

// One pool: a list of host entries, one rank per device.
absl::StatusOr<std::vector<RankPlacement>> ParsePool(const std::string& text, const std::string& pool,
                                                     const std::string& rank_prefix) {
  std::vector<RankPlacement> ranks;
  YAML::Node list;
  try {
    list = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(pool, ": ", e.msg));
  }
  for (size_t h = 0; h < list.size(); ++h) {
    const std::string where = absl::StrCat(pool, "[", h, "]");
    const YAML::Node entry = list[h];
    if (!entry.IsMap())
      return absl::InvalidArgumentError(absl::StrCat(where, ": expected a mapping with host and devices"));
    for (const auto& kv : entry) {
      const std::string key = kv.first.as<std::string>("");
      bool known = false;
      for (const char* k : kHostKeys) known = known || key == k;
      if (!known) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": unknown key '", key, "' (a host has: host, address, devices, device_type, tandem)"));
      }
    }
    RankPlacement base;
    ASSIGN_OR_RETURN(base.host, Scalar(entry, "host", where));
    if (base.host.empty()) base.host = "local";
    if (base.host == "localhost") base.host = "local";
    ASSIGN_OR_RETURN(base.bind, Scalar(entry, "address", where));
    if (base.bind.empty()) base.bind = base.local() ? "127.0.0.1" : base.host;
    ASSIGN_OR_RETURN(base.device_type, Scalar(entry, "device_type", where));
    ASSIGN_OR_RETURN(base.tandem, Scalar(entry, "tandem", where));
    const YAML::Node devices = entry["devices"];
    if (!devices || !devices.IsSequence() || devices.size() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".devices: expected a non-empty list of devices (cpu, cuda:N), one rank each"));
    }
    for (size_t d = 0; d < devices.size(); ++d) {
      RankPlacement r = base;
      r.path = absl::StrCat(where, ".devices[", d, "]");
      if (!devices[d].IsScalar() || devices[d].Scalar().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(r.path, ": expected a device (cpu, cuda:N)"));
      }
      r.device = devices[d].Scalar();
      r.name = absl::StrCat(rank_prefix, ranks.size());
      ranks.push_back(std::move(r));
    }
  }
  return ranks;
}

}  // namespace

bool Placement::one_host() const {
  for (const RankPlacement& m : memory) {
    if (m.host != compute.host) return false;
  }
  return true;
}

void AddPoolKnobs(ConfigSchema* s) {
  s->List("compute.hosts",
          "the compute pool: a list of hosts, each {host: local or an ssh destination, address: interface "
          "or address to bind, devices: [cpu | cuda:N], device_type: free-form name, tandem: binary path on "
          "that host}; one compute rank today. Empty: compute.device on this host")
      .List("memory.hosts",
            "the memory pool: a list of hosts as compute.hosts, one memory rank per device. Empty: "
            "memory.ranks, memory.devices and memory.host on this host");
}

absl::StatusOr<Placement> ResolvePlacement(const Config& c) {
  Placement p;
  const std::string compute_hosts = c.GetList("compute.hosts"), memory_hosts = c.GetList("memory.hosts");
  if (compute_hosts != "[]") {
    if (c.SourceOf("compute.device") != "default") {
      return absl::InvalidArgumentError(
          "compute.device: set together with compute.hosts; give the device in compute.hosts[0].devices");
    }
    ASSIGN_OR_RETURN(std::vector<RankPlacement> ranks, ParsePool(compute_hosts, "compute.hosts", "compute-"));
    if (ranks.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("compute.hosts: ", ranks.size(),
                                                     " devices listed; one compute rank is supported today"));
    }
    p.compute = ranks[0];
    p.from_pools = true;
  } else {
    p.compute = {.name = "compute-0",
                 .host = "local",
                 .device = c.GetString("compute.device"),
                 .path = "compute.device"};
  }
  if (memory_hosts != "[]") {
    for (const char* key : {"memory.ranks", "memory.devices", "memory.host"}) {
      if (c.SourceOf(key) != "default") {
        return absl::InvalidArgumentError(absl::StrCat(
            key, ": set together with memory.hosts; the memory pool's hosts and devices give the ranks"));
      }
    }
    ASSIGN_OR_RETURN(p.memory, ParsePool(memory_hosts, "memory.hosts", "memory-"));
    if (p.memory.size() > 64) {
      return absl::InvalidArgumentError(
          absl::StrCat("memory.hosts: ", p.memory.size(), " devices; at most 64 memory ranks"));
    }
    p.from_pools = true;
  } else {
    const int64_t ranks = c.GetInt("memory.ranks");
    std::vector<std::string> devices = absl::StrSplit(c.GetString("memory.devices"), ',');
    if (devices.size() != 1 && static_cast<int64_t>(devices.size()) != ranks) {
      return absl::InvalidArgumentError(absl::StrCat("memory.devices: ", devices.size(),
                                                     " devices listed for ", ranks,
                                                     " ranks (give one for all, or one per rank)"));
    }
    for (int64_t i = 0; i < ranks; ++i) {
      RankPlacement r{
          .name = absl::StrCat("memory-", i), .host = "local", .bind = c.GetString("memory.host")};
      r.device =
          std::string(absl::StripAsciiWhitespace(devices[devices.size() == 1 ? 0 : static_cast<size_t>(i)]));
      r.path = "memory.devices";
      p.memory.push_back(std::move(r));
    }
  }
  // Without a compute pool, compute rank 0 uses the memory ranks' interface when they are all on
  // this host, else any (give compute.hosts[0].address to limit it).
  if (compute_hosts == "[]") {
    bool all_local = true;
    for (const RankPlacement& m : p.memory) all_local = all_local && m.local();
    p.compute.bind = all_local && !p.memory.empty() ? p.memory[0].bind : "";
  }
  return p;
}

}  // namespace tandem
