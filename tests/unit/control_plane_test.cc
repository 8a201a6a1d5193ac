// ControlPlaneTransport (common/transport/control_plane.h) over real UCX on loopback: every peer is
// greeted exactly once, whether Accept, Connect, Receive or Pump meets it first (or, with
// greet_when_connected_, the first Send), and a refused probe is never greeted. A peer whose first
// message arrived in a Receive before any Accept returned it was once never greeted (the GPU
// transports' hello lost, their buffers "never registered").
#include "common/transport/control_plane.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/transport.h"
#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

constexpr uint32_t kGreeting = 0x54455247;  // "GRET": this test transport's only frame

// A control-plane transport whose greeting is one frame; it counts greetings sent and received.
class GreetingTransport : public ControlPlaneTransport {
 public:
  GreetingTransport(std::unique_ptr<Transport> control, bool greet_when_connected)
      : ControlPlaneTransport(std::move(control)) {
    greet_when_connected_ = greet_when_connected;
  }
  int sent = 0, received = 0;
  std::vector<PeerId> greeted;

  const Capabilities& capabilities() const override { return control().capabilities(); }
  absl::Status RegisterBuffer(uint32_t, void*, size_t) override { return absl::UnimplementedError("test"); }
  absl::Status Write(PeerId, uint32_t, uint64_t, absl::Span<const absl::Span<const uint8_t>>,
                     uint64_t) override {
    return absl::UnimplementedError("test");
  }
  absl::Status WaitDoorbell(uint32_t, uint64_t, absl::Time) override {
    return absl::UnimplementedError("test");
  }
  uint64_t Doorbell(uint32_t) const override { return 0; }
  absl::Status Flush(absl::Time) override { return absl::OkStatus(); }
  absl::Status PeerStatus(PeerId peer) const override { return control().PeerStatus(peer); }
  absl::Status PumpFor(absl::Duration d) { return Pump(d); }

 protected:
  absl::Status OnNewPeer(PeerId peer) override {
    ++sent;
    greeted.push_back(peer);
    std::vector<uint8_t> frame(4);
    std::memcpy(frame.data(), &kGreeting, 4);
    return control().Send(peer, frame);
  }
  absl::StatusOr<bool> Consume(PeerId, const std::vector<uint8_t>& m) override {
    if (MagicOf(m) != kGreeting || m.size() != 4) return false;
    ++received;
    return true;
  }
};

std::unique_ptr<GreetingTransport> Make(bool listen, bool greet_when_connected = false) {
  auto t = CreateUcxTransport({.listen_address = listen ? "127.0.0.1:0" : ""});
  TANDEM_CHECK_MSG(t.ok(), t.status().ToString());
  return std::make_unique<GreetingTransport>(std::move(t).value(), greet_when_connected);
}

// The caller's message after `deadline`, skipping nothing (greetings are consumed inside).
std::vector<uint8_t> ReceiveOne(GreetingTransport& t, PeerId* from) {
  std::vector<uint8_t> m;
  const absl::Status st = t.Receive(from, &m, absl::Now() + absl::Seconds(10));
  EXPECT_TRUE(st.ok()) << st;
  return m;
}

TEST(ControlPlaneTransport, APeerMetFirstInReceiveIsGreetedOnceAndAcceptDoesNotGreetAgain) {
  auto server = Make(true);
  auto client = Make(false);
  std::thread c([&] {
    absl::StatusOr<PeerId> peer = client->Connect(server->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    const std::vector<uint8_t> hello = {1, 2, 3};
    ASSERT_TRUE(client->Send(*peer, hello).ok());
    // The server's greeting arrives before its answer.
    PeerId from = 0;
    EXPECT_EQ(ReceiveOne(*client, &from), std::vector<uint8_t>({9}));
    EXPECT_EQ(client->received, 1);
    EXPECT_EQ(client->sent, 1);
  });
  // No Accept: the client's message is met in Receive.
  PeerId from = 0;
  EXPECT_EQ(ReceiveOne(*server, &from), std::vector<uint8_t>({1, 2, 3}));
  EXPECT_EQ(server->sent, 1) << "a peer met in Receive is greeted before its message is handed on";
  ASSERT_TRUE(server->Send(from, std::vector<uint8_t>({9})).ok());
  // Accept now returns that connection without greeting it again.
  absl::StatusOr<PeerId> accepted = server->Accept(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(*accepted, from);
  EXPECT_EQ(server->sent, 1);
  c.join();
  // The client's greeting reached the server (consumed, never handed on).
  ASSERT_TRUE(server->PumpFor(absl::Milliseconds(20)).ok());
  EXPECT_EQ(server->received, 1);
}

TEST(ControlPlaneTransport, AcceptFirstGreetsOnceToo) {
  auto server = Make(true);
  auto client = Make(false);
  std::thread c([&] {
    absl::StatusOr<PeerId> peer = client->Connect(server->address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(client->Send(*peer, std::vector<uint8_t>({4})).ok());
    PeerId from = 0;
    EXPECT_EQ(ReceiveOne(*client, &from), std::vector<uint8_t>({5}));
    EXPECT_EQ(client->received, 1);
  });
  absl::StatusOr<PeerId> accepted = server->Accept(absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(server->sent, 1);
  PeerId from = 0;
  EXPECT_EQ(ReceiveOne(*server, &from), std::vector<uint8_t>({4}));
  EXPECT_EQ(from, *accepted);
  ASSERT_TRUE(server->Send(from, std::vector<uint8_t>({5})).ok());
  c.join();
  EXPECT_EQ(server->sent, 1);
  EXPECT_EQ(server->greeted, std::vector<PeerId>({*accepted}));
}

// greet_when_connected_ (p2p's choice): Connect returns at once and greets nothing while the
// connection is being made; the first Send greets the peer, once, before the caller's message. A
// probe to an address where nothing listens, Close()d at once, is never greeted and fails no wait
// of the other connections (greeting it in Connect once made the refusal fail the next waits).
TEST(ControlPlaneTransport, GreetWhenConnectedGreetsAtTheFirstSendAndARefusedProbeFailsNothing) {
  auto server = Make(true);
  auto client = Make(false, /*greet_when_connected=*/true);
  std::string nobody;  // an address whose listener is gone: connections are refused
  {
    auto gone = Make(true);
    nobody = gone->address();
  }
  absl::StatusOr<PeerId> probe = client->Connect(nobody);
  ASSERT_TRUE(probe.ok()) << probe.status();
  client->Close(*probe);
  EXPECT_EQ(client->sent, 0) << "nothing is sent to a connection still being made";
  std::thread s([&] {
    PeerId from = 0;
    EXPECT_EQ(ReceiveOne(*server, &from), std::vector<uint8_t>({7}));
    EXPECT_EQ(server->received, 1) << "the client's greeting comes before its first message";
    ASSERT_TRUE(server->Send(from, std::vector<uint8_t>({8})).ok());
  });
  absl::StatusOr<PeerId> peer = client->Connect(server->address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(client->Send(*peer, std::vector<uint8_t>({7})).ok());
  EXPECT_EQ(client->sent, 1);
  EXPECT_EQ(client->greeted, std::vector<PeerId>({*peer}));
  PeerId from = 0;
  EXPECT_EQ(ReceiveOne(*client, &from), std::vector<uint8_t>({8}));
  s.join();
  // The probe's refusal is known, and fails nothing: not the pump, not a receive.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (client->PeerStatus(*probe).ok() && absl::Now() < until) {
    ASSERT_TRUE(client->PumpFor(absl::Milliseconds(10)).ok());
  }
  EXPECT_FALSE(client->PeerStatus(*probe).ok()) << "the refused probe was never reported";
  ASSERT_TRUE(client->PumpFor(absl::Milliseconds(20)).ok()) << "a Close()d probe's refusal fails no wait";
  EXPECT_EQ(client->sent, 1) << "the probe was greeted";
}

}  // namespace
}  // namespace tandem::transport
