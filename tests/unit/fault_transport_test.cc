// The fault-injecting transport (common/transport/fault/fault_transport.h) over the real UCX
// transport in one process: each fault is observed as the contract says (a corrupted control
// frame is refused by the wire decoder, a corrupted layer payload by its crc, a cut peer gives
// Unavailable naming it, a stalled peer DeadlineExceeded naming it), and every test is bounded in
// time (no wait here is longer than a few seconds).
#include "common/transport/fault/fault_transport.h"

#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/layer_message.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "common/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

using ::testing::HasSubstr;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::unique_ptr<Transport> Ucx(bool listen) {
  auto t = CreateUcxTransport({.listen_address = listen ? "127.0.0.1:0" : ""});
  TANDEM_CHECK_MSG(t.ok(), t.status().ToString());
  return std::move(t).value();
}

FaultSpec Spec(const std::string& text) {
  auto s = ParseFaultSpec(text, "test spec");
  TANDEM_CHECK_MSG(s.ok(), s.status().ToString());
  return *s;
}

// A connected pair: `a` connects to `b`; either may be wrapped. Each side's peer id of the other is
// 0. The connection is wired up (one message each way) before the test's operations.
struct Pair {
  std::unique_ptr<Transport> a, b;
  PeerId a_to_b = 0, b_to_a = 0;
};

Pair Connected(const std::string& a_faults, const std::string& b_faults) {
  Pair p;
  p.b = Ucx(true);
  p.a = Ucx(false);
  const std::string address = p.b->address();
  // The listener's side runs on its own thread: the handshake needs both sides to progress.
  std::jthread listener([&] {
    auto accepted = p.b->Accept(In(absl::Seconds(10)));
    TANDEM_CHECK_MSG(accepted.ok(), accepted.status().ToString());
    p.b_to_a = *accepted;
    PeerId from = 0;
    std::vector<uint8_t> m;
    TANDEM_CHECK(p.b->Receive(&from, &m, In(absl::Seconds(10))).ok());
    TANDEM_CHECK(p.b->Send(p.b_to_a, std::vector<uint8_t>{2}).ok());
  });
  auto peer = p.a->Connect(address);
  TANDEM_CHECK_MSG(peer.ok(), peer.status().ToString());
  p.a_to_b = *peer;
  TANDEM_CHECK(p.a->Send(p.a_to_b, std::vector<uint8_t>{1}).ok());
  PeerId from = 0;
  std::vector<uint8_t> m;
  TANDEM_CHECK(p.a->Receive(&from, &m, In(absl::Seconds(10))).ok());
  listener.join();
  if (!a_faults.empty()) p.a = WrapWithFaults(std::move(p.a), Spec(a_faults));
  if (!b_faults.empty()) p.b = WrapWithFaults(std::move(p.b), Spec(b_faults));
  return p;
}

std::vector<uint8_t> Bye(uint64_t steps) { return EncodeBye({.steps = steps}); }

// Receives one message on `t`. (The tests never Flush a side whose peer is not progressing:
// a UCX flush waits for the peer's acknowledgement.)
absl::Status ReceiveFor(Transport& t, std::vector<uint8_t>* m, absl::Duration d) {
  PeerId from = 0;
  return t.Receive(&from, m, In(d));
}

TEST(FaultSpec, ParsesEveryField) {
  auto s = ParseFaultSpec(
      " corrupt:write:peer=1:after=40 ; stall:peer=0:after=100:for=3s;seed=7;"
      "drop:send+recv:count=all:prob=0.25:on=memory:1;delay:for=20ms:at=2s;dup;cut:peer=2:at=500ms",
      "TANDEM_FAULTS");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->seed, 7u);
  ASSERT_EQ(s->rules.size(), 6u);
  EXPECT_EQ(s->rules[0].action, FaultAction::kCorrupt);
  EXPECT_EQ(s->rules[0].ops, kFaultWrite);
  EXPECT_EQ(s->rules[0].peer, 1u);
  EXPECT_EQ(s->rules[0].after, 40u);
  EXPECT_EQ(s->rules[1].action, FaultAction::kStall);
  EXPECT_EQ(s->rules[1].duration, absl::Seconds(3));
  EXPECT_EQ(s->rules[1].ops, kFaultAnyOp);
  EXPECT_EQ(s->rules[2].ops, kFaultSend | kFaultReceive);
  EXPECT_EQ(s->rules[2].count, kFaultCountAll);
  EXPECT_DOUBLE_EQ(s->rules[2].probability, 0.25);
  EXPECT_EQ(s->rules[2].process, "memory:1");
  EXPECT_EQ(s->rules[3].at, absl::Seconds(2));
  EXPECT_EQ(s->rules[4].action, FaultAction::kDuplicate);
  EXPECT_EQ(s->rules[5].at, absl::Milliseconds(500));

  FaultSpec here = FaultSpecForProcess(*s, "compute:0");
  EXPECT_EQ(here.rules.size(), 5u);
  EXPECT_EQ(FaultSpecForProcess(*s, "memory:1").rules.size(), 6u);
  EXPECT_TRUE(ParseFaultSpec("", "x")->rules.empty());
}

TEST(FaultSpec, ErrorsNameTheRuleAndWhatIsWrong) {
  struct Case {
    const char* spec;
    const char* message;
  };
  const Case cases[] = {
      {"explode", "rule 0 \"explode\": unknown action \"explode\""},
      {"drop;corrupt:wrte", "rule 1 \"corrupt:wrte\": unknown field \"wrte\""},
      {"stall:peer=0", "stall needs for=DURATION"},
      {"delay:peer=0", "delay needs for=DURATION"},
      {"drop:for=1s", "drop takes no for="},
      {"cut:after=3", "cut needs peer=N"},
      {"stall:for=1s", "stall needs peer=N"},
      {"drop:peer=x", "peer=x: expected a peer id"},
      {"drop:count=0", "count=0: expected a count >= 1 or all"},
      {"drop:prob=1.5", "prob=1.5: expected a probability in (0, 1]"},
      {"delay:for=-1s", "for=-1s: expected a duration"},
      {"drop:at=soon", "at=soon: expected a duration"},
      {"drop:when=1", "unknown key \"when\""},
      {"seed=x", "seed=x: expected an unsigned integer"},
  };
  for (const Case& c : cases) {
    auto s = ParseFaultSpec(c.spec, "TANDEM_FAULTS");
    ASSERT_FALSE(s.ok()) << c.spec;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    EXPECT_THAT(s.status().message(), HasSubstr("TANDEM_FAULTS: ")) << c.spec;
    EXPECT_THAT(s.status().message(), HasSubstr(c.message)) << c.spec;
  }
}

// Every corrupted control frame is refused by its decoder (crc, magic, version, header or
// length), never decoded as something else; frames before `after` arrive intact.
TEST(FaultTransport, CorruptedControlFramesAreRefusedByTheDecoder) {
  Pair p = Connected("corrupt:send:peer=0:after=2:count=all;seed=11", "");
  constexpr int kFrames = 60;
  std::jthread sender([&] {
    for (int i = 0; i < kFrames; ++i) ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(1000 + i)).ok());
  });
  std::set<std::string> errors;
  for (int i = 0; i < kFrames; ++i) {
    std::vector<uint8_t> m;
    ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok()) << "frame " << i;
    absl::StatusOr<ByeMessage> bye = DecodeBye(m);
    if (i < 2) {
      ASSERT_TRUE(bye.ok()) << bye.status();
      EXPECT_EQ(bye->steps, 1000u + i);
      continue;
    }
    ASSERT_FALSE(bye.ok()) << "corrupted frame " << i << " decoded as steps " << bye->steps;
    EXPECT_TRUE(absl::IsDataLoss(bye.status()) || absl::IsInvalidArgument(bye.status()) ||
                absl::IsUnimplemented(bye.status()))
        << bye.status();
    EXPECT_THAT(bye.status().message(), HasSubstr("bye: "));
    errors.insert(std::string(bye.status().message()).substr(0, 20));
  }
  EXPECT_GE(errors.size(), 2u) << "the flipped byte should land in different fields";
}

// A corrupted one-sided write of a host-staged layer message is refused by the payload crc (or
// the header's checks when the flipped byte is in the header).
TEST(FaultTransport, CorruptedLayerWriteIsRefusedByItsChecksum) {
  Pair p = Connected("corrupt:write:peer=0:after=1", "");
  constexpr uint32_t kBuffer = 5;
  std::vector<uint8_t> rx(1 << 16);
  ASSERT_TRUE(p.b->RegisterBuffer(kBuffer, rx.data(), rx.size()).ok());
  std::vector<uint8_t> payload(4096);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7 + 3);
  auto expect = [](uint64_t seqno) {
    return LayerMessageExpect{.step_id = seqno,
                              .layer = 0,
                              .kind = LayerMessageKind::kQkv,
                              .dtype = DType::kF32,
                              .rows = 8,
                              .row_bytes = 512,
                              .seqno = seqno,
                              .verify_checksum = true};
  };
  for (uint64_t seqno = 1; seqno <= 2; ++seqno) {
    std::vector<uint8_t> header = MakeLayerMessageHeader(expect(seqno), payload, /*checksum=*/true);
    std::jthread writer([&] {
      const absl::Span<const uint8_t> pieces[] = {header, payload};
      ASSERT_TRUE(p.a->Write(p.a_to_b, kBuffer, 0, pieces, seqno).ok());
    });
    ASSERT_TRUE(p.b->WaitDoorbell(kBuffer, seqno, In(absl::Seconds(10))).ok());
    writer.join();
    absl::StatusOr<absl::Span<const uint8_t>> read = ReadLayerMessage(rx, expect(seqno));
    if (seqno == 1) {
      ASSERT_TRUE(read.ok()) << read.status();
    } else {
      ASSERT_FALSE(read.ok()) << "a corrupted layer message was accepted";
      EXPECT_TRUE(absl::IsDataLoss(read.status()) || absl::IsInvalidArgument(read.status())) << read.status();
    }
  }
}

TEST(FaultTransport, DroppedMessageNeverArrivesAndTheReceiverTimesOut) {
  Pair p = Connected("drop:send:after=1", "");
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(1)).ok());
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(2)).ok());  // dropped: reported sent
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(3)).ok());
  std::vector<uint8_t> m;
  ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok());
  EXPECT_EQ(DecodeBye(m)->steps, 1u);
  ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok());
  EXPECT_EQ(DecodeBye(m)->steps, 3u);
  const absl::Time start = absl::Now();
  absl::Status s = ReceiveFor(*p.b, &m, absl::Milliseconds(200));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(FaultTransport, DroppedWriteLeavesTheDoorbellUnrung) {
  Pair p = Connected("drop:write:peer=0", "");
  constexpr uint32_t kBuffer = 2;
  std::vector<uint8_t> rx(64, 0);
  ASSERT_TRUE(p.b->RegisterBuffer(kBuffer, rx.data(), rx.size()).ok());
  const std::vector<uint8_t> data(64, 0x5a);
  const absl::Span<const uint8_t> pieces[] = {data};
  ASSERT_TRUE(p.a->Write(p.a_to_b, kBuffer, 0, pieces, 1).ok());
  absl::Status s = p.b->WaitDoorbell(kBuffer, 1, In(absl::Milliseconds(300)));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_EQ(rx[0], 0);
  ASSERT_TRUE(p.a->Write(p.a_to_b, kBuffer, 0, pieces, 2).ok());  // count=1: this one goes
  ASSERT_TRUE(p.b->WaitDoorbell(kBuffer, 2, In(absl::Seconds(10))).ok());
  EXPECT_EQ(rx[0], 0x5a);
}

TEST(FaultTransport, DuplicatedAndDelayedMessages) {
  Pair p = Connected("dup:send:peer=0;delay:send:after=1:for=300ms", "dup:recv:after=2");
  const absl::Time start = absl::Now();
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(1)).ok());  // sent twice
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(2)).ok());  // after 300 ms
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(290));
  std::vector<uint64_t> got;
  for (int i = 0; i < 4; ++i) {
    std::vector<uint8_t> m;
    ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok()) << i;
    got.push_back(DecodeBye(m)->steps);
  }
  // 1 twice (sender), then 2 delivered twice by the receiver's rule (its third receive).
  EXPECT_EQ(got, (std::vector<uint64_t>{1, 1, 2, 2}));
  std::vector<uint8_t> m;
  EXPECT_TRUE(absl::IsDeadlineExceeded(ReceiveFor(*p.b, &m, absl::Milliseconds(100))));
}

TEST(FaultTransport, CutPeerGivesUnavailableNamingIt) {
  Pair p = Connected("cut:peer=0:after=2", "");
  const std::string name = p.a->PeerName(p.a_to_b);
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(1)).ok());
  ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(2)).ok());
  absl::Status s = p.a->Send(p.a_to_b, Bye(3));
  ASSERT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(name));
  EXPECT_THAT(s.message(), HasSubstr("cut by fault injection"));
  const std::vector<uint8_t> data(8, 1);
  const absl::Span<const uint8_t> pieces[] = {data};
  s = p.a->Write(p.a_to_b, 1, 0, pieces, 1);
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  // The next Receive reports the cut once; messages from the cut peer are discarded after that.
  ASSERT_TRUE(p.b->Send(p.b_to_a, Bye(9)).ok());
  std::vector<uint8_t> m;
  s = ReceiveFor(*p.a, &m, absl::Seconds(10));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(name));
  s = ReceiveFor(*p.a, &m, absl::Milliseconds(300));
  EXPECT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  // The other side saw the messages before the cut and then silence.
  ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok());
  ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok());
  EXPECT_EQ(DecodeBye(m)->steps, 2u);
  EXPECT_TRUE(absl::IsDeadlineExceeded(ReceiveFor(*p.b, &m, absl::Milliseconds(200))));
}

TEST(FaultTransport, TimedCutFiresWithoutOperations) {
  Pair p = Connected("cut:peer=0:at=100ms", "");
  absl::SleepFor(absl::Milliseconds(150));
  std::vector<uint8_t> m;
  absl::Status s = ReceiveFor(*p.a, &m, absl::Seconds(5));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(p.a->PeerName(p.a_to_b)));
}

// The receiver stalls its sender: the message that fires the stall and the ones after it are
// held, a Receive that ends during the stall names the stalled peer, and everything arrives in
// order once the stall is over; the receiver's own sends to the peer are held likewise.
TEST(FaultTransport, StalledPeerGivesDeadlineExceededNamingItThenRecovers) {
  Pair p = Connected("", "stall:recv:peer=0:after=1:for=1s");
  const std::string name = p.b->PeerName(p.b_to_a);
  for (uint64_t i = 1; i <= 3; ++i) ASSERT_TRUE(p.a->Send(p.a_to_b, Bye(i)).ok());
  std::vector<uint8_t> m;
  ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok());
  EXPECT_EQ(DecodeBye(m)->steps, 1u);
  const absl::Time start = absl::Now();
  absl::Status s = ReceiveFor(*p.b, &m, absl::Milliseconds(300));
  ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr(name));
  EXPECT_THAT(s.message(), HasSubstr("stalled by fault injection"));
  ASSERT_TRUE(p.b->Send(p.b_to_a, Bye(7)).ok());  // held until the stall ends
  std::jthread other([&] {
    std::vector<uint8_t> reply;
    absl::Status r = ReceiveFor(*p.a, &reply, absl::Seconds(10));
    ASSERT_TRUE(r.ok()) << r;
    EXPECT_EQ(DecodeBye(reply)->steps, 7u);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(600));
  });
  for (uint64_t i = 2; i <= 3; ++i) {
    ASSERT_TRUE(ReceiveFor(*p.b, &m, absl::Seconds(10)).ok()) << i;
    EXPECT_EQ(DecodeBye(m)->steps, i);
  }
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(600));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// A transport that records what it is asked to send, to check that the random choices depend
// only on the seed.
class RecordingTransport final : public Transport {
 public:
  explicit RecordingTransport(std::vector<std::vector<uint8_t>>* sent) : sent_(sent) {}
  const Capabilities& capabilities() const override { return caps_; }
  std::string address() const override { return ""; }
  absl::StatusOr<PeerId> Connect(const std::string&) override { return 0; }
  absl::StatusOr<PeerId> Accept(absl::Time) override {
    return absl::FailedPreconditionError("not listening");
  }
  std::string PeerName(PeerId p) const override { return absl::StrCat("recorder ", p); }
  absl::Status Send(PeerId, absl::Span<const uint8_t> m) override {
    sent_->emplace_back(m.begin(), m.end());
    return absl::OkStatus();
  }
  absl::Status Receive(PeerId*, std::vector<uint8_t>*, absl::Time) override {
    return absl::DeadlineExceededError("nothing to receive");
  }
  absl::Status RegisterBuffer(uint32_t, void*, size_t) override { return absl::OkStatus(); }
  absl::Status Write(PeerId, uint32_t, uint64_t, absl::Span<const absl::Span<const uint8_t>>,
                     uint64_t) override {
    return absl::OkStatus();
  }
  absl::Status WaitDoorbell(uint32_t, uint64_t, absl::Time) override { return absl::OkStatus(); }
  uint64_t Doorbell(uint32_t) const override { return 0; }
  absl::Status Flush(absl::Time) override { return absl::OkStatus(); }
  void Close(PeerId) override {}

 private:
  Capabilities caps_{.name = "recorder"};
  std::vector<std::vector<uint8_t>>* sent_;
};

std::vector<std::vector<uint8_t>> SendThrough(const std::string& spec) {
  std::vector<std::vector<uint8_t>> sent;
  auto t = WrapWithFaults(std::make_unique<RecordingTransport>(&sent), Spec(spec));
  for (uint64_t i = 0; i < 200; ++i) TANDEM_CHECK(t->Send(0, Bye(i)).ok());
  return sent;
}

TEST(FaultTransport, RandomChoicesDependOnlyOnTheSeed) {
  const auto a =
      SendThrough("drop:prob=0.3:count=all;corrupt:prob=0.2:count=all;dup:prob=0.1:count=all;seed=5");
  const auto b =
      SendThrough("drop:prob=0.3:count=all;corrupt:prob=0.2:count=all;dup:prob=0.1:count=all;seed=5");
  const auto c =
      SendThrough("drop:prob=0.3:count=all;corrupt:prob=0.2:count=all;dup:prob=0.1:count=all;seed=6");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Roughly the probabilities asked for: 200 sends, ~30% dropped, ~10% of the rest doubled.
  EXPECT_GT(a.size(), 110u);
  EXPECT_LT(a.size(), 170u);
}

// Sends two frames from a transport the factory made under `spec` to a plain listener; returns
// how many arrived.
int DeliveredThroughFactory(const char* spec) {
  setenv(kFaultsEnvVar, spec, 1);
  auto made = CreateTransport({.kind = TransportKind::kUcx, .listen_address = ""});
  unsetenv(kFaultsEnvVar);
  TANDEM_CHECK_MSG(made.ok(), made.status().ToString());
  auto rx = Ucx(true);
  int delivered = 0;
  std::jthread listener([&] {
    TANDEM_CHECK(rx->Accept(In(absl::Seconds(10))).ok());
    std::vector<uint8_t> m;
    while (ReceiveFor(*rx, &m, absl::Milliseconds(500)).ok()) ++delivered;
  });
  auto peer = (*made)->Connect(rx->address());
  TANDEM_CHECK(peer.ok());
  TANDEM_CHECK((*made)->Send(*peer, Bye(1)).ok());
  TANDEM_CHECK((*made)->Send(*peer, Bye(2)).ok());
  listener.join();
  return delivered;
}

TEST(FaultTransport, FactoryWrapsWhenTheEnvironmentAsks) {
  EXPECT_EQ(DeliveredThroughFactory("drop:send:after=1"), 1);
  EXPECT_EQ(DeliveredThroughFactory("drop:send:after=1:on=memory:5"), 2) << "another process's rule";
  EXPECT_EQ(DeliveredThroughFactory(""), 2);
  setenv(kFaultsEnvVar, "stall:peer=0", 1);
  auto bad = CreateTransport({.kind = TransportKind::kUcx, .listen_address = ""});
  unsetenv(kFaultsEnvVar);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("TANDEM_FAULTS: rule 0"));
}

}  // namespace
}  // namespace tandem::transport
