// The transport table (common/transport/factory.h) and transport.kind resolution against a
// deployment's devices (deploy/deployment.h ParseTransportSetting, ResolveTransport): what each
// kind states, what auto picks, and which layouts the GPU transports refuse, with errors naming
// the YAML key.
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/transport/factory.h"
#include "deploy/deployment.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;
using transport::TransportBuilt;
using transport::TransportKind;

DeployPlan Plan(const std::string& compute, std::vector<std::string> memory) {
  DeployPlan p;
  p.compute_device = compute;
  p.memory_devices = std::move(memory);
  return p;
}

// transport.kind's value resolved against the plan: the kind's name, or the error message.
std::string Resolve(const std::string& kind, const DeployPlan& p) {
  absl::StatusOr<std::optional<TransportKind>> parsed = ParseTransportSetting(kind);
  if (!parsed.ok()) return std::string(parsed.status().message());
  absl::StatusOr<TransportKind> r = ResolveTransport(*parsed, p);
  return r.ok() ? transport::TransportKindName(*r) : std::string(r.status().message());
}

TEST(TransportTable, EveryKindOnceInKindOrderWithItsName) {
  const std::vector<std::string> names = {"ucx", "p2p", "nccl", "verbs", "local"};
  ASSERT_EQ(transport::TransportTable().size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    const transport::TransportInfo& t = transport::TransportTable()[i];
    EXPECT_EQ(static_cast<size_t>(t.kind), i);
    EXPECT_EQ(t.name, names[i]);
    EXPECT_EQ(&transport::GetTransportInfo(t.kind), &t);
    absl::StatusOr<TransportKind> parsed = transport::ParseTransportKind(names[i]);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, t.kind);
    EXPECT_EQ(TransportBuilt(t.kind), t.built);
  }
  // What each kind states about itself.
  const transport::TransportInfo& ucx = transport::GetTransportInfo(TransportKind::kUcx);
  EXPECT_TRUE(ucx.built);
  EXPECT_FALSE(ucx.needs_gpus || ucx.same_host_only || ucx.device_polling);
  const transport::TransportInfo& p2p = transport::GetTransportInfo(TransportKind::kP2p);
  EXPECT_TRUE(p2p.needs_gpus && p2p.same_host_only && p2p.device_polling);
  const transport::TransportInfo& nccl = transport::GetTransportInfo(TransportKind::kNccl);
  EXPECT_TRUE(nccl.needs_gpus && nccl.device_polling);
  EXPECT_FALSE(nccl.same_host_only);
  EXPECT_TRUE(transport::GetTransportInfo(TransportKind::kVerbs).built);
  EXPECT_EQ(p2p.built, nccl.built);  // both come with the CUDA build
}

TEST(TransportTable, CannotConnectSaysWhy) {
  const transport::TransportInfo& p2p = transport::GetTransportInfo(TransportKind::kP2p);
  const transport::TransportInfo& ucx = transport::GetTransportInfo(TransportKind::kUcx);
  const transport::RankLayout gpus{.compute_device = 0, .memory_devices = {1, 2}};
  const transport::RankLayout cpus{.compute_device = -1, .memory_devices = {-1}};
  const transport::RankLayout shared{.compute_device = 0, .memory_devices = {1, 0}};
  const transport::RankLayout hosts{.compute_device = 0, .memory_devices = {1}, .one_host = false};
  for (const transport::RankLayout& l : {gpus, cpus, shared, hosts}) EXPECT_EQ(ucx.CannotConnect(l), "");
  if (!p2p.built) {
    EXPECT_THAT(p2p.CannotConnect(gpus), HasSubstr("p2p is not in this build"));
    return;
  }
  EXPECT_EQ(p2p.CannotConnect(gpus), "");
  EXPECT_THAT(p2p.CannotConnect(cpus), HasSubstr("ranks run on the CPU"));
  EXPECT_EQ(p2p.CannotConnect(shared), "");  // same-GPU peers wait on IPC events
  EXPECT_THAT(p2p.CannotConnect(hosts), HasSubstr("one host only"));
  const transport::TransportInfo& nccl = transport::GetTransportInfo(TransportKind::kNccl);
  EXPECT_EQ(nccl.CannotConnect(hosts), "");
  if (nccl.built) {
    EXPECT_THAT(nccl.CannotConnect(shared), HasSubstr("memory rank 1 is on cuda:0 too"));
  }
  EXPECT_EQ(transport::PickTransport(gpus), TransportKind::kP2p);
  EXPECT_EQ(transport::PickTransport(hosts), TransportKind::kUcx);  // nccl is never chosen by auto
}

TEST(ResolveTransport, AutoPicksLocalForOneGpuP2pForSeveralElseUcx) {
  const std::string gpu_kind = TransportBuilt(TransportKind::kP2p) ? "p2p" : "ucx";
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1"})), gpu_kind);
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:2", "cuda:3"})), gpu_kind);
  // Ranks may share GPUs: p2p signals same-GPU peers with IPC events.
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:1"})), gpu_kind);
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:0"})), gpu_kind);
  // Every memory rank on the compute rank's GPU: threads of one process (one CUDA context).
  const bool local_device = transport::GetTransportInfo(TransportKind::kLocal).device_polling;
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:0"})), local_device ? "local" : "ucx");
  EXPECT_EQ(Resolve("auto", Plan("cuda:1", {"cuda:1", "cuda:1"})), local_device ? "local" : "ucx");
  EXPECT_EQ(Resolve("local", Plan("cpu", {"cpu", "cpu"})), "local");  // explicit: threads on the CPU
  EXPECT_EQ(Resolve("auto", Plan("cpu", {"cpu", "cpu"})), "ucx");
}

TEST(ResolveTransport, ExplicitKinds) {
  EXPECT_EQ(Resolve("ucx", Plan("cuda:0", {"cuda:0"})), "ucx");
  EXPECT_EQ(Resolve("ucx", Plan("cpu", {"cpu"})), "ucx");
  EXPECT_EQ(Resolve("verbs", Plan("cuda:0", {"cuda:1"})), "verbs");  // fails at start without a NIC
  for (const std::string kind : {"p2p", "nccl"}) {
    SCOPED_TRACE(kind);
    const bool built = TransportBuilt(kind == "p2p" ? TransportKind::kP2p : TransportKind::kNccl);
    if (!built) {
      EXPECT_THAT(Resolve(kind, Plan("cuda:0", {"cuda:1"})), HasSubstr("is not in this build"));
      continue;
    }
    EXPECT_EQ(Resolve(kind, Plan("cuda:0", {"cuda:1", "cuda:2"})), kind);
    EXPECT_THAT(Resolve(kind, Plan("cpu", {"cpu"})), HasSubstr("ranks run on the CPU"));
    if (kind == "nccl") {
      EXPECT_THAT(Resolve(kind, Plan("cuda:0", {"cuda:1", "cuda:0"})),
                  HasSubstr("memory rank 1 is on cuda:0 too"));
    } else {
      EXPECT_EQ(Resolve(kind, Plan("cuda:0", {"cuda:1", "cuda:0"})), kind);
    }
  }
}

// Compute replicas connect to compute rank 0 and to every memory rank (and, in a rotational ring,
// to each other): nccl needs each on a GPU of its own (NCCL refuses two ranks of one communicator
// on one GPU); p2p does not.
TEST(ResolveTransport, NcclNeedsAGpuOfItsOwnPerComputeReplica) {
  DeployPlan p = Plan("cuda:0", {"cuda:1", "cuda:2"});
  p.replica_devices = {"cuda:3", "cuda:4"};
  for (const std::string kind : {"p2p", "nccl"}) {
    if (TransportBuilt(kind == "p2p" ? TransportKind::kP2p : TransportKind::kNccl)) {
      EXPECT_EQ(Resolve(kind, p), kind);
    }
  }
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"cuda:0"}, "compute rank 1 is on cuda:0 as is compute rank 0"},
      {{"cuda:3", "cuda:2"}, "compute rank 2 is on cuda:2 as is memory rank 1"},
      {{"cuda:3", "cuda:3"}, "compute rank 2 is on cuda:3 as is compute rank 1"}};
  for (const auto& [replicas, want] : cases) {
    SCOPED_TRACE(want);
    p.replica_devices = replicas;
    if (TransportBuilt(TransportKind::kP2p)) {
      EXPECT_EQ(Resolve("p2p", p), "p2p");
    }
    if (!TransportBuilt(TransportKind::kNccl)) continue;
    const std::string why = Resolve("nccl", p);
    EXPECT_THAT(why, HasSubstr("nccl needs every compute replica on a GPU of its own"));
    EXPECT_THAT(why, HasSubstr(want));
    EXPECT_THAT(why, HasSubstr("compute.replica_devices"));
  }
}

// TANDEM_NCCL_SHARE_GPU=1 lets nccl ranks share a GPU (each process a host of its own to NCCL);
// anything else leaves the refusal.
TEST(ResolveTransport, NcclSharesAGpuOnlyWhenTheEnvironmentSaysSo) {
  const transport::TransportInfo& nccl = transport::GetTransportInfo(TransportKind::kNccl);
  const transport::RankLayout shared{.compute_device = 0, .memory_devices = {1, 0}, .replica_devices = {0}};
  const char* before = std::getenv("TANDEM_NCCL_SHARE_GPU");
  const std::optional<std::string> saved = before ? std::optional<std::string>(before) : std::nullopt;
  for (const char* value : {"", "0", "yes", "1"}) {
    SCOPED_TRACE(value);
    setenv("TANDEM_NCCL_SHARE_GPU", value, 1);
    const bool shares = std::string(value) == "1";
    EXPECT_EQ(transport::NcclSharesGpus(), shares);
    if (!nccl.built) continue;
    if (shares) {
      EXPECT_EQ(nccl.CannotConnect(shared), "");
    } else {
      EXPECT_THAT(nccl.CannotConnect(shared), HasSubstr("memory rank 1 is on cuda:0 too"));
    }
  }
  unsetenv("TANDEM_NCCL_SHARE_GPU");
  EXPECT_FALSE(transport::NcclSharesGpus());
  if (saved) setenv("TANDEM_NCCL_SHARE_GPU", saved->c_str(), 1);
}

TEST(ResolveTransport, ErrorsNameTheKey) {
  for (const std::string kind : {"tcp", "", "P2P"}) {
    absl::StatusOr<std::optional<TransportKind>> r = ParseTransportSetting(kind);
    ASSERT_FALSE(r.ok()) << kind;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("transport.kind"));
  }
  absl::StatusOr<std::optional<TransportKind>> automatic = ParseTransportSetting("auto");
  ASSERT_TRUE(automatic.ok());
  EXPECT_FALSE(automatic->has_value());
  absl::StatusOr<TransportKind> r = ResolveTransport(TransportKind::kNccl, Plan("cuda:0", {"cuda:0"}));
  if (TransportBuilt(TransportKind::kNccl)) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("transport.kind: nccl"));
  }
}

}  // namespace
}  // namespace tandem
