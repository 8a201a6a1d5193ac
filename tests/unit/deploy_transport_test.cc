// transport.kind resolution against a deployment's devices (deploy/deployment.h ResolveTransport):
// what auto picks, and which layouts the GPU transports refuse, with errors naming the YAML key.
#include <string>
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

std::string Resolve(const std::string& kind, const DeployPlan& p) {
  absl::StatusOr<std::string> r = ResolveTransport(kind, p);
  return r.ok() ? *r : std::string(r.status().message());
}

TEST(ResolveTransport, AutoPicksP2pOnlyWhenEveryRankHasItsOwnGpu) {
  const std::string gpu_kind = TransportBuilt(TransportKind::kP2p) ? "p2p" : "ucx";
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1"})), gpu_kind);
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:2", "cuda:3"})), gpu_kind);
  // Memory ranks may share a GPU among themselves, just not the compute rank's.
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:1"})), gpu_kind);
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:0"})), "ucx");
  EXPECT_EQ(Resolve("auto", Plan("cuda:0", {"cuda:1", "cuda:0"})), "ucx");
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
    EXPECT_THAT(Resolve(kind, Plan("cuda:0", {"cuda:1", "cuda:0"})),
                HasSubstr("memory rank 1 is on cuda:0 too"));
  }
}

TEST(ResolveTransport, ErrorsNameTheKey) {
  for (const std::string kind : {"tcp", "", "P2P"}) {
    absl::StatusOr<std::string> r = ResolveTransport(kind, Plan("cuda:0", {"cuda:1"}));
    ASSERT_FALSE(r.ok()) << kind;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("transport.kind"));
  }
  absl::StatusOr<std::string> r = ResolveTransport("p2p", Plan("cuda:0", {"cuda:0"}));
  if (TransportBuilt(TransportKind::kP2p)) {
    ASSERT_FALSE(r.ok());
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("transport.kind: p2p"));
  }
}

}  // namespace
}  // namespace tandem
