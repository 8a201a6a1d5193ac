// The UCX transport on loopback: real UCX, real sockets. Each Transport is driven by one thread;
// peer death is tested with a child process (this binary re-executed in a helper mode).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/bootstrap/deployment_key.h"
#include "common/bootstrap/handshake.h"
#include "common/status.h"
#include "common/transport/transport.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "transport_test_util.h"

extern char** environ;

namespace tandem::transport {
namespace {

using ::testing::HasSubstr;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::unique_ptr<Transport> Listening() {
  auto t = CreateUcxTransport({.listen_address = "127.0.0.1:0"});
  TANDEM_CHECK_MSG(t.ok(), t.status().ToString());
  return std::move(t).value();
}

std::unique_ptr<Transport> ConnectOnly() {
  auto t = CreateUcxTransport({});
  TANDEM_CHECK_MSG(t.ok(), t.status().ToString());
  return std::move(t).value();
}

// Bytes that name their origin: word j of a payload is a hash of (origin, size, tag, j), so a
// misplaced or stale block does not match.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
std::vector<uint8_t> Payload(uint64_t origin, size_t size, uint64_t tag) {
  std::vector<uint8_t> out(size);
  uint64_t seed = Mix(origin * 1000003 + tag) ^ Mix(size);
  size_t words = size / 8;
  for (size_t j = 0; j < words; ++j) {
    uint64_t w = Mix(seed + j);
    std::memcpy(out.data() + 8 * j, &w, 8);
  }
  for (size_t i = 8 * words; i < size; ++i) out[i] = static_cast<uint8_t>(Mix(seed + i));
  return out;
}

std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string Text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// A registered receive region with guard bytes on both sides.
struct GuardedBuffer {
  static constexpr size_t kGuard = 256;
  static constexpr uint8_t kGuardByte = 0xA5;
  explicit GuardedBuffer(size_t bytes) : storage(bytes + 2 * kGuard, 0), size(bytes) {
    std::memset(storage.data(), kGuardByte, kGuard);
    std::memset(storage.data() + kGuard + bytes, kGuardByte, kGuard);
  }
  uint8_t* data() { return storage.data() + kGuard; }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (storage[i] != kGuardByte || storage[kGuard + size + i] != kGuardByte) return false;
    }
    return true;
  }
  std::vector<uint8_t> storage;
  size_t size;
};

// Receives one message and checks it is `expected` text from `peer`.
void ExpectMessage(Transport& t, PeerId peer, const std::string& expected) {
  PeerId from = 0;
  std::vector<uint8_t> message;
  absl::Status s = t.Receive(&from, &message, In(absl::Seconds(30)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(from, peer);
  EXPECT_EQ(Text(message), expected);
}

TEST(UcxTransport, AddressHasTheChosenPort) {
  auto t = Listening();
  std::string a = t->address();
  ASSERT_TRUE(absl::StartsWith(a, "127.0.0.1:")) << a;
  int port = std::atoi(a.substr(10).c_str());
  EXPECT_GT(port, 0);
  EXPECT_EQ(t->capabilities().name, "ucx");
  EXPECT_FALSE(t->capabilities().gpu_memory);

  auto c = ConnectOnly();
  EXPECT_EQ(c->address(), "");
  EXPECT_EQ(c->Accept(In(absl::Milliseconds(10))).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->Connect("no-port").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Connect("127.0.0.1:99999").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UcxTransport, ListenOnABusyPortIsUnavailable) {
  auto t = Listening();
  auto again = CreateUcxTransport({.listen_address = t->address()});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  EXPECT_THAT(again.status().message(), HasSubstr(t->address()));
}

TEST(UcxTransport, RegisterBufferAndDoorbellBasics) {
  auto t = ConnectOnly();
  std::vector<uint8_t> mem(64);
  ASSERT_TRUE(t->RegisterBuffer(3, mem.data(), mem.size()).ok());
  absl::Status dup = t->RegisterBuffer(3, mem.data(), mem.size());
  EXPECT_EQ(dup.code(), absl::StatusCode::kAlreadyExists) << dup;
  EXPECT_EQ(t->Doorbell(3), 0u);
  EXPECT_EQ(t->Doorbell(4), 0u);
  EXPECT_EQ(t->WaitDoorbell(4, 1, In(absl::Milliseconds(10))).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(t->WaitDoorbell(3, 0, In(absl::Milliseconds(10))).ok());
}

TEST(UcxTransport, AcceptAndReceiveDeadlines) {
  auto t = Listening();
  absl::Time start = absl::Now();
  auto peer = t->Accept(In(absl::Milliseconds(200)));
  EXPECT_EQ(peer.status().code(), absl::StatusCode::kDeadlineExceeded) << peer.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));

  start = absl::Now();
  PeerId from;
  std::vector<uint8_t> message;
  absl::Status s = t->Receive(&from, &message, In(absl::Milliseconds(200)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST(UcxTransport, ConnectToNothingIsUnavailableNotAHang) {
  // A bound socket that does not listen: connecting to it is refused.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
  socklen_t len = sizeof(sa);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len), 0);
  std::string address = absl::StrCat("127.0.0.1:", ntohs(sa.sin_port));

  auto t = ConnectOnly();
  auto peer = t->Connect(address);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ(t->PeerName(*peer), address);
  absl::Time start = absl::Now();
  absl::Status s = t->Send(*peer, Bytes("hello"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(address));
  PeerId from;
  std::vector<uint8_t> message;
  s = t->Receive(&from, &message, In(absl::Seconds(30)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));

  // A second connection, probed by Receive first.
  auto t2 = ConnectOnly();
  ASSERT_TRUE(t2->Connect(address).ok());
  start = absl::Now();
  s = t2->Receive(&from, &message, In(absl::Seconds(30)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(address));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  close(fd);
}

const std::vector<size_t> kMessageSizes = {1, 7, 100, 4096, 65536, 1 << 20, 8 << 20};

TEST(UcxTransport, ControlMessagesFromTwoPeersInOrder) {
  auto receiver = Listening();
  const std::string address = receiver->address();
  auto sender_main = [&](int index) {
    auto t = ConnectOnly();
    auto peer = t->Connect(address);
    ASSERT_TRUE(peer.ok()) << peer.status();
    ASSERT_TRUE(t->Send(*peer, Bytes(absl::StrCat("hello ", index))).ok());
    for (size_t i = 0; i < kMessageSizes.size(); ++i) {
      absl::Status s = t->Send(*peer, Payload(index, kMessageSizes[i], i));
      ASSERT_TRUE(s.ok()) << s;
    }
    ExpectMessage(*t, *peer, "done");  // stay connected until everything arrived
  };
  std::jthread s0(sender_main, 0), s1(sender_main, 1);

  std::map<PeerId, int> index_of;  // learned from the hello messages
  std::map<int, size_t> next;      // next message index per sender
  std::vector<PeerId> accepted;
  for (int i = 0; i < 2; ++i) {
    auto p = receiver->Accept(In(absl::Seconds(30)));
    ASSERT_TRUE(p.ok()) << p.status();
    accepted.push_back(*p);
  }
  EXPECT_NE(accepted[0], accepted[1]);
  for (size_t n = 0; n < 2 * (kMessageSizes.size() + 1); ++n) {
    PeerId from = 99;
    std::vector<uint8_t> message;
    absl::Status s = receiver->Receive(&from, &message, In(absl::Seconds(30)));
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_TRUE(from == accepted[0] || from == accepted[1]) << from;
    if (index_of.count(from) == 0) {
      std::string hello = Text(message);
      ASSERT_TRUE(hello == "hello 0" || hello == "hello 1") << hello.substr(0, 20);
      index_of[from] = hello.back() - '0';
      continue;
    }
    int index = index_of[from];
    size_t i = next[index]++;
    ASSERT_LT(i, kMessageSizes.size());
    ASSERT_EQ(message.size(), kMessageSizes[i]) << "sender " << index << " message " << i;
    EXPECT_TRUE(message == Payload(index, kMessageSizes[i], i)) << "sender " << index << " message " << i;
  }
  ASSERT_EQ(index_of.size(), 2u);
  EXPECT_NE(index_of.begin()->second, index_of.rbegin()->second);
  for (PeerId p : accepted) ASSERT_TRUE(receiver->Send(p, Bytes("done")).ok());
  s0.join();
  s1.join();
}

// One writer, one receiver with a 64 MB buffer; the writer waits for an "ack" after each write.
class UcxWriteTest : public ::testing::Test {
 protected:
  static constexpr size_t kBufferBytes = 64 << 20;
  static constexpr uint32_t kBufferId = 1;

  // Runs `writer(transport, peer)` on its own thread against a receiver driven by `receiver`.
  void Run(const std::function<void(Transport&, PeerId)>& writer,
           const std::function<void(Transport&, PeerId, GuardedBuffer&)>& receiver) {
    auto rx = Listening();
    GuardedBuffer buffer(kBufferBytes);
    ASSERT_TRUE(rx->RegisterBuffer(kBufferId, buffer.data(), buffer.size).ok());
    std::string address = rx->address();
    std::jthread w([&] {
      auto tx = ConnectOnly();
      auto peer = tx->Connect(address);
      ASSERT_TRUE(peer.ok()) << peer.status();
      writer(*tx, *peer);
      ExpectMessage(*tx, *peer, "done");
    });
    auto peer = rx->Accept(In(absl::Seconds(30)));
    if (peer.ok()) {
      receiver(*rx, *peer, buffer);
      EXPECT_TRUE(buffer.GuardsIntact());
      EXPECT_TRUE(rx->Send(*peer, Bytes("done")).ok());
    } else {
      ADD_FAILURE() << peer.status();
    }
    w.join();
  }
};

struct WriteCase {
  size_t offset, size;
  int pieces;
};
const std::vector<WriteCase> kWrites = {
    {0, 16, 1},
    {4096, 4096, 1},
    {7, 65536, 1},
    {0, 1 << 20, 1},
    {3, 1000003, 3},
    {100, 65536, 4},
    {0, 64 << 20, 1},
    {0, 64 << 20, 5},
    {(64 << 20) - 16, 16, 2},
    {12345, 16, 1},
    {(64 << 20) - 4096, 4096, 1},
};

// Splits `data` into `n` uneven pieces (the second one empty when n > 2).
std::vector<absl::Span<const uint8_t>> Split(const std::vector<uint8_t>& data, int n) {
  std::vector<absl::Span<const uint8_t>> pieces;
  size_t at = 0;
  for (int i = 0; i < n; ++i) {
    size_t len = i + 1 == n ? data.size() - at : (i == 1 ? 0 : (data.size() - at) / 3);
    pieces.emplace_back(data.data() + at, len);
    at += len;
  }
  return pieces;
}

TEST_F(UcxWriteTest, WritesWithDoorbellsSizesAndPieces) {
  Run(
      [](Transport& tx, PeerId peer) {
        for (size_t i = 0; i < kWrites.size(); ++i) {
          const WriteCase& c = kWrites[i];
          std::vector<uint8_t> data = Payload(peer + 1000, c.size, i);
          auto pieces = Split(data, c.pieces);
          absl::Status s = tx.Write(peer, kBufferId, c.offset, pieces, /*seqno=*/10 * (i + 1));
          ASSERT_TRUE(s.ok()) << s;
          ExpectMessage(tx, peer, "ack");
        }
      },
      [](Transport& rx, PeerId peer, GuardedBuffer& buffer) {
        for (size_t i = 0; i < kWrites.size(); ++i) {
          const WriteCase& c = kWrites[i];
          uint64_t seqno = 10 * (i + 1);
          absl::Status s = rx.WaitDoorbell(kBufferId, seqno, In(absl::Seconds(30)));
          ASSERT_TRUE(s.ok()) << s;
          EXPECT_EQ(rx.Doorbell(kBufferId), seqno);
          // The writer's transport numbers the receiver as its peer 0 too.
          std::vector<uint8_t> expected = Payload(0 + 1000, c.size, i);
          EXPECT_EQ(std::memcmp(buffer.data() + c.offset, expected.data(), c.size), 0)
              << "write " << i << " of " << c.size << " bytes at " << c.offset;
          ASSERT_TRUE(rx.Send(peer, Bytes("ack")).ok());
        }
      });
}

TEST_F(UcxWriteTest, BackToBackWritesSetTheDoorbellAfterTheData) {
  // No acks: a burst of writes into distinct regions, then one wait for the last seqno.
  constexpr int kCount = 32;
  constexpr size_t kSize = 1 << 20;
  Run(
      [](Transport& tx, PeerId peer) {
        for (int i = 0; i < kCount; ++i) {
          std::vector<uint8_t> data = Payload(7, kSize, i);
          absl::Span<const uint8_t> piece(data);
          ASSERT_TRUE(tx.Write(peer, kBufferId, i * kSize, {&piece, 1}, i + 1).ok());
        }
      },
      [](Transport& rx, PeerId peer, GuardedBuffer& buffer) {
        ASSERT_TRUE(rx.WaitDoorbell(kBufferId, kCount, In(absl::Seconds(30))).ok());
        for (int i = 0; i < kCount; ++i) {
          std::vector<uint8_t> expected = Payload(7, kSize, i);
          EXPECT_EQ(std::memcmp(buffer.data() + i * kSize, expected.data(), kSize), 0) << "write " << i;
        }
      });
}

TEST_F(UcxWriteTest, BadWritesAreDataLossAndDropped) {
  struct Bad {
    uint32_t buffer;
    uint64_t offset;
    size_t size;
  };
  const std::vector<Bad> bad = {
      {kBufferId, kBufferBytes - 8, 16},          // eager, past the end
      {kBufferId, kBufferBytes - 4096, 1 << 20},  // rendezvous, past the end
      {99, 0, 16},                                // unknown buffer, eager
      {98, 0, 1 << 20},                           // unknown buffer, rendezvous
      {kBufferId, ~uint64_t{0} - 4, 16},          // offset + length overflows
  };
  Run(
      [&](Transport& tx, PeerId peer) {
        for (size_t i = 0; i < bad.size(); ++i) {
          std::vector<uint8_t> data(bad[i].size, 0x5A);
          absl::Span<const uint8_t> piece(data);
          absl::Status s = tx.Write(peer, bad[i].buffer, bad[i].offset, {&piece, 1}, i + 1);
          EXPECT_TRUE(s.ok()) << s;  // the sender does not learn of it
          ExpectMessage(tx, peer, "ack");
        }
        std::vector<uint8_t> good = Payload(1, 4096, 0);
        absl::Span<const uint8_t> piece(good);
        ASSERT_TRUE(tx.Write(peer, kBufferId, 0, {&piece, 1}, 100).ok());
      },
      [&](Transport& rx, PeerId peer, GuardedBuffer& buffer) {
        for (size_t i = 0; i < bad.size(); ++i) {
          absl::Status s = rx.WaitDoorbell(kBufferId, 1, In(absl::Seconds(30)));
          EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
          EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("buffer ", bad[i].buffer)));
          EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("offset ", bad[i].offset)));
          EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("length ", bad[i].size)));
          EXPECT_THAT(s.message(), HasSubstr(rx.PeerName(peer)));
          EXPECT_EQ(rx.Doorbell(kBufferId), 0u);
          ASSERT_TRUE(rx.Send(peer, Bytes("ack")).ok());
        }
        ASSERT_TRUE(rx.WaitDoorbell(kBufferId, 100, In(absl::Seconds(30))).ok());
        // Nothing of the bad writes landed: past the good write the buffer is still zero.
        std::vector<uint8_t> expected = Payload(1, 4096, 0);
        EXPECT_EQ(std::memcmp(buffer.data(), expected.data(), 4096), 0);
        bool zero = true;
        for (size_t i = 4096; i < buffer.size; ++i) zero = zero && buffer.data()[i] == 0;
        EXPECT_TRUE(zero);
      });
}

TEST_F(UcxWriteTest, DoorbellDeadlineNamesBufferSeqnoAndValueSeen) {
  Run(
      [](Transport& tx, PeerId peer) {
        std::vector<uint8_t> data(64, 1);
        absl::Span<const uint8_t> piece(data);
        ASSERT_TRUE(tx.Write(peer, kBufferId, 0, {&piece, 1}, 1).ok());
      },
      [](Transport& rx, PeerId peer, GuardedBuffer&) {
        ASSERT_TRUE(rx.WaitDoorbell(kBufferId, 1, In(absl::Seconds(30))).ok());
        absl::Time start = absl::Now();
        absl::Status s = rx.WaitDoorbell(kBufferId, 2, In(absl::Milliseconds(200)));
        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_THAT(s.message(), HasSubstr("buffer 1"));
        EXPECT_THAT(s.message(), HasSubstr("seqno 2"));
        EXPECT_THAT(s.message(), HasSubstr("seen 1"));
        EXPECT_GE(absl::Now() - start, absl::Milliseconds(190));
        EXPECT_LT(absl::Now() - start, absl::Seconds(3));
        EXPECT_TRUE(rx.Flush(In(absl::Seconds(10))).ok());
      });
}

TEST(UcxTransport, BothSidesWrite64MbAtOnce) {
  constexpr size_t kBytes = 64 << 20;
  auto a = Listening();
  std::string address = a->address();
  std::vector<uint8_t> buf_a(kBytes), buf_b(kBytes);
  auto side = [&](Transport& t, PeerId peer, int me, std::vector<uint8_t>& mine) {
    ASSERT_TRUE(t.RegisterBuffer(2, mine.data(), mine.size()).ok());
    ExpectMessage(t, peer, "registered");  // both sides registered before any write
    for (uint64_t round = 1; round <= 2; ++round) {
      std::vector<uint8_t> data = Payload(me, kBytes, round);
      absl::Span<const uint8_t> piece(data);
      absl::Status s = t.Write(peer, 2, 0, {&piece, 1}, round);
      ASSERT_TRUE(s.ok()) << s;
      s = t.WaitDoorbell(2, round, In(absl::Seconds(60)));
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_TRUE(mine == Payload(1 - me, kBytes, round)) << "side " << me << " round " << round;
      ASSERT_TRUE(t.Send(peer, Bytes("read")).ok());
      ExpectMessage(t, peer, "read");  // the peer may overwrite only after it read
    }
    // A flush may need the peer's progress: both flush, then each waits for the other's word.
    absl::Status flushed = t.Flush(In(absl::Seconds(10)));
    ASSERT_TRUE(flushed.ok()) << "side " << me << ": " << flushed;
    ASSERT_TRUE(t.Send(peer, Bytes("flushed")).ok());
    ExpectMessage(t, peer, "flushed");
  };
  std::jthread tb([&] {
    auto b = ConnectOnly();
    auto peer = b->Connect(address);
    ASSERT_TRUE(peer.ok());
    ASSERT_TRUE(b->Send(*peer, Bytes("registered")).ok());
    side(*b, *peer, 1, buf_b);
    ExpectMessage(*b, *peer, "done");
  });
  auto peer = a->Accept(In(absl::Seconds(30)));
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(a->Send(*peer, Bytes("registered")).ok());
  side(*a, *peer, 0, buf_a);
  ASSERT_TRUE(a->Send(*peer, Bytes("done")).ok());
  tb.join();
}

// Small messages back and forth: each side blocks in Receive between messages, so a wakeup
// that the worker's event fd does not signal would show as ~kMaxBlock (20 ms) per hop.
TEST(UcxTransport, PingPongWakesUpPromptly) {
  constexpr int kRounds = 200;
  auto a = Listening();
  std::string address = a->address();
  std::jthread tb([&] {
    auto b = ConnectOnly();
    auto peer = b->Connect(address);
    ASSERT_TRUE(peer.ok());
    for (int i = 0; i < kRounds; ++i) {
      ASSERT_TRUE(b->Send(*peer, Bytes(absl::StrCat("ping ", i))).ok());
      ExpectMessage(*b, *peer, absl::StrCat("pong ", i));
    }
    ExpectMessage(*b, *peer, "done");
  });
  auto peer = a->Accept(In(absl::Seconds(30)));
  ASSERT_TRUE(peer.ok()) << peer.status();
  absl::Time start = absl::Now();
  for (int i = 0; i < kRounds; ++i) {
    ExpectMessage(*a, *peer, absl::StrCat("ping ", i));
    ASSERT_TRUE(a->Send(*peer, Bytes(absl::StrCat("pong ", i))).ok());
  }
  absl::Duration rtt = (absl::Now() - start) / kRounds;
  std::printf("mean round trip: %s\n", absl::FormatDuration(rtt).c_str());
  EXPECT_LT(rtt, absl::Milliseconds(10));  // generous for a loaded 2-core machine
  ASSERT_TRUE(a->Send(*peer, Bytes("done")).ok());
}

// Peer death: a child process (this binary in helper mode) connects, says hello, and waits; the
// parent kills it and must see Unavailable naming the peer long before its deadline.
constexpr char kChildEnv[] = "TANDEM_UCX_TEST_CONNECT_TO";
constexpr size_t kChildWriteBytes = 4 << 20;
constexpr size_t kChildMessageBytes = 8 << 20;

TEST(UcxChildHelper, DISABLED_ConnectSayHelloAndWait) {
  const char* address = std::getenv(kChildEnv);
  if (address == nullptr) GTEST_SKIP() << "helper for PeerDeath; run by it";
  auto t = ConnectOnly();
  auto peer = t->Connect(address);
  ASSERT_TRUE(peer.ok());
  ASSERT_TRUE(t->Send(*peer, Bytes("hello from child")).ok());
  // Across processes, large transfers take the rendezvous path (cma or tcp here).
  std::vector<uint8_t> data = Payload(42, kChildWriteBytes, 1);
  absl::Span<const uint8_t> piece(data);
  ASSERT_TRUE(t->Write(*peer, 1, 0, {&piece, 1}, 1).ok());
  ASSERT_TRUE(t->Send(*peer, Payload(43, kChildMessageBytes, 2)).ok());
  PeerId from;
  std::vector<uint8_t> message;
  (void)t->Receive(&from, &message, In(absl::Seconds(60)));  // killed while waiting here
}

pid_t SpawnChild(const std::string& address) {
  std::string exe(4096, '\0');
  ssize_t n = readlink("/proc/self/exe", exe.data(), exe.size() - 1);
  TANDEM_CHECK(n > 0);
  exe.resize(n);
  std::string env_var = absl::StrCat(kChildEnv, "=", address);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  envp.push_back(env_var.data());
  envp.push_back(nullptr);
  std::string filter = "--gtest_filter=UcxChildHelper.DISABLED_ConnectSayHelloAndWait";
  std::string disabled = "--gtest_also_run_disabled_tests";
  std::vector<char*> argv = {exe.data(), filter.data(), disabled.data(), nullptr};
  pid_t pid = fork();
  TANDEM_CHECK(pid >= 0);
  if (pid == 0) {
    execve(exe.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  return pid;
}

// Spawns the helper child, accepts it into `t` (buffer 1 registered over `mem`) and takes what it
// sends: its hello, its write and its message. The child then waits in a Receive.
void StartChild(Transport& t, std::vector<uint8_t>& mem, pid_t* child, PeerId* peer) {
  ASSERT_TRUE(t.RegisterBuffer(1, mem.data(), mem.size()).ok());
  *child = SpawnChild(t.address());
  auto accepted = t.Accept(In(absl::Seconds(30)));
  if (!accepted.ok()) {
    kill(*child, SIGKILL);
    waitpid(*child, nullptr, 0);
    FAIL() << accepted.status();
  }
  *peer = *accepted;
  ExpectMessage(t, *peer, "hello from child");
  absl::Status s = t.WaitDoorbell(1, 1, In(absl::Seconds(30)));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(mem == Payload(42, kChildWriteBytes, 1));
  PeerId from;
  std::vector<uint8_t> message;
  s = t.Receive(&from, &message, In(absl::Seconds(30)));
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(from, *peer);
  EXPECT_TRUE(message == Payload(43, kChildMessageBytes, 2));
}

TEST(UcxTransport, PeerDeathStopsWaitsWithUnavailable) {
  auto t = Listening();
  std::vector<uint8_t> mem(kChildWriteBytes);
  pid_t child = -1;
  PeerId peer = 0;
  ASSERT_NO_FATAL_FAILURE(StartChild(*t, mem, &child, &peer));
  ASSERT_EQ(kill(child, SIGKILL), 0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);

  absl::Time start = absl::Now();
  absl::Status s = t->WaitDoorbell(1, 2, In(absl::Seconds(60)));
  PeerId from;
  std::vector<uint8_t> message;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(t->PeerName(peer)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  s = t->Receive(&from, &message, In(absl::Seconds(60)));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  s = t->Send(peer, Bytes("anyone?"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr(t->PeerName(peer)));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

// A stopped peer (SIGSTOP: alive, never progressing) ends a send at the send timeout: the peer is
// marked failed and its ep force-closed, which hands the request back at once. (Cancelling the
// request alone did not end it; the wait for it cost kCloseTimeout, 3 s, more, and in a deployment
// that was long enough for the healthy memory ranks' deadlines to expire too.)
TEST(UcxTransport, AStoppedPeerEndsASendAtTheSendTimeout) {
  auto made = CreateUcxTransport({.listen_address = "127.0.0.1:0", .send_timeout = absl::Seconds(1)});
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Transport> t = std::move(made).value();
  std::vector<uint8_t> mem(kChildWriteBytes);
  pid_t child = -1;
  PeerId peer = 0;
  ASSERT_NO_FATAL_FAILURE(StartChild(*t, mem, &child, &peer));
  absl::Cleanup reap = [child] {  // a stopped child never ends by itself
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
  };
  ASSERT_EQ(kill(child, SIGSTOP), 0);

  // A rendezvous-size message completes only once the peer fetches it; eager ones until the
  // socket or FIFO fills.
  const std::vector<uint8_t> big = Payload(7, kChildMessageBytes, 3);
  absl::Time start = absl::Now();
  absl::Status s;
  for (int i = 0; i < 64 && s.ok(); ++i) s = t->Send(peer, big);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("did not complete within 1s"));
  EXPECT_THAT(s.message(), HasSubstr(t->PeerName(peer)));
  EXPECT_LT(took, absl::Seconds(2.5)) << "the send timeout is 1 s";
  EXPECT_EQ(t->PeerStatus(peer).code(), absl::StatusCode::kUnavailable);
  start = absl::Now();
  s = t->Send(peer, Bytes("anyone?"));
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

}  // namespace
}  // namespace tandem::transport

namespace tandem::transport {
namespace {

// ---- The bootstrap handshake against strangers ----------------------------------------------
// A listening transport is attacked over raw sockets while its thread accepts; every bad
// connection must be closed by it without becoming a peer, and a member of the deployment must
// still connect and talk afterwards.

int ConnectRaw(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(std::atoi(address.substr(colon + 1).c_str())));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &sa.sin_addr);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  TANDEM_CHECK(fd >= 0);
  timeval tv{.tv_sec = 20, .tv_usec = 0};  // every read below has a deadline
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  TANDEM_CHECK_MSG(connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0, std::strerror(errno));
  return fd;
}

std::vector<uint8_t> ReadExactly(int fd, size_t n) {
  std::vector<uint8_t> v(n);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = recv(fd, v.data() + got, n - got, 0);
    if (r <= 0) return {};
    got += static_cast<size_t>(r);
  }
  return v;
}

void SendAll(int fd, const std::vector<uint8_t>& bytes) {
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
}

// True when the listener closed the connection (EOF or reset) after what it had sent (its hello);
// false if it kept it open for the socket's 20 s receive timeout.
bool ClosedByListener(int fd) {
  uint8_t buf[256];
  for (;;) {
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
    if (r < 0) return false;
  }
}

// A man in the middle on loopback: relays one connection to `target` and records what the
// client sent (its handshake proof: the listener speaks first).
class RecordingProxy {
 public:
  explicit RecordingProxy(const std::string& target) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    TANDEM_CHECK(bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0);
    TANDEM_CHECK(listen(listen_fd_, 1) == 0);
    socklen_t len = sizeof(sa);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    address_ = absl::StrCat("127.0.0.1:", ntohs(sa.sin_port));
    thread_ = std::jthread([this, target] { Relay(target); });
  }
  ~RecordingProxy() {
    if (thread_.joinable()) thread_.join();
    close(listen_fd_);
  }
  const std::string& address() const { return address_; }
  // What the client sent, once the relay has ended (both sides closed).
  std::vector<uint8_t> Recorded() {
    if (thread_.joinable()) thread_.join();
    return recorded_;
  }

 private:
  void Relay(const std::string& target) {
    pollfd l{listen_fd_, POLLIN, 0};
    if (poll(&l, 1, 30000) != 1) return;
    const int client = accept(listen_fd_, nullptr, nullptr);
    const int server = ConnectRaw(target);
    uint8_t buf[65536];
    const absl::Time deadline = In(absl::Seconds(30));
    bool open = true;
    while (open && absl::Now() < deadline) {
      pollfd fds[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (poll(fds, 2, 100) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = recv(fds[i].fd, buf, sizeof(buf), 0);
        if (n <= 0) {
          open = false;
          break;
        }
        if (i == 0) recorded_.insert(recorded_.end(), buf, buf + n);
        send(i == 0 ? server : client, buf, static_cast<size_t>(n), MSG_NOSIGNAL);
      }
    }
    close(client);
    close(server);
  }
  int listen_fd_ = -1;
  std::string address_;
  std::vector<uint8_t> recorded_;
  std::jthread thread_;
};

// Runs the client side of a handshake with `key` over `fd`; returns the bytes it sent after the
// hello (its proof) and whether the listener accepted it.
struct ClientRun {
  std::vector<uint8_t> proof;
  bool accepted = false;
};
ClientRun RunClient(int fd, const bootstrap::DeploymentKey& key, std::vector<uint8_t> payload) {
  ClientRun run;
  bootstrap::Handshake hs(bootstrap::Handshake::Role::kClient, key, std::move(payload));
  std::vector<uint8_t> hello = ReadExactly(fd, hs.Wanted());
  if (hello.empty() || !hs.Feed(hello).ok()) return run;
  run.proof = hs.TakeOutput();
  if (send(fd, run.proof.data(), run.proof.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(run.proof.size())) {
    return run;
  }
  // The server's proof: its fixed part, then its payload.
  std::vector<uint8_t> fixed = ReadExactly(fd, hs.Wanted());
  if (fixed.empty() || !hs.Feed(fixed).ok()) return run;
  std::vector<uint8_t> rest = ReadExactly(fd, hs.Wanted());
  run.accepted = !rest.empty() && hs.Feed(rest).ok() && hs.done();
  return run;
}

TEST(UcxBootstrap, StrangersAreDroppedAndTheDeploymentGoesOn) {
  auto server = Listening();
  const std::string address = server->address();
  absl::StatusOr<bootstrap::DeploymentKey> key = bootstrap::ProcessKey();
  ASSERT_TRUE(key.ok()) << key.status();

  std::atomic<int> attacks_done{0};
  std::jthread attacker([&] {
    // 1. A port scanner's probe: 16 bytes of garbage.
    {
      const int fd = ConnectRaw(address);
      SendAll(fd, std::vector<uint8_t>(16, 0x5a));
      EXPECT_TRUE(ClosedByListener(fd)) << "garbage probe";
      close(fd);
    }
    // 2. No secret: the deployment id copied from the server's hello, a made-up proof.
    {
      const int fd = ConnectRaw(address);
      std::vector<uint8_t> hello = ReadExactly(fd, 48);
      ASSERT_EQ(hello.size(), 48u);
      std::vector<uint8_t> proof(hello.begin(), hello.begin() + 16);
      proof[6] = 2;  // client proof
      proof.resize(84 + 4, 0x11);
      proof[48] = 4, proof[49] = 0, proof[50] = 0, proof[51] = 0;  // payload length 4
      SendAll(fd, proof);
      EXPECT_TRUE(ClosedByListener(fd)) << "no secret";
      close(fd);
    }
    // 3. The right deployment id with a wrong secret: a wrong HMAC.
    {
      bootstrap::DeploymentKey wrong = *bootstrap::RandomKey();
      wrong.id = key->id;
      const int fd = ConnectRaw(address);
      EXPECT_FALSE(RunClient(fd, wrong, Bytes("x")).accepted) << "wrong HMAC";
      close(fd);
    }
    // 4. A peer of another deployment: its own id and a proof made with its own secret.
    {
      const bootstrap::DeploymentKey other = *bootstrap::RandomKey();
      const int fd = ConnectRaw(address);
      std::vector<uint8_t> hello = ReadExactly(fd, 48);
      ASSERT_EQ(hello.size(), 48u);
      std::copy(other.id.begin(), other.id.end(), hello.begin() + 8);  // as if it were its own
      bootstrap::Handshake hs(bootstrap::Handshake::Role::kClient, other, Bytes("x"));
      ASSERT_TRUE(hs.Feed(hello).ok());
      SendAll(fd, hs.TakeOutput());
      EXPECT_TRUE(ClosedByListener(fd)) << "other deployment";
      close(fd);
    }
    attacks_done = 1;
  });
  // The listener keeps progressing while it is attacked; nothing of the attacker becomes a peer.
  const absl::Time deadline = In(absl::Seconds(60));
  while (attacks_done.load() == 0 && absl::Now() < deadline) {
    auto p = server->Accept(In(absl::Milliseconds(50)));
    EXPECT_FALSE(p.ok()) << "an attacker became peer " << *p;
  }
  attacker.join();

  // A member connects through a recording man in the middle and talks; then its recorded proof
  // is replayed on a new connection.
  RecordingProxy proxy(address);
  std::atomic<bool> member_done{false};
  std::jthread member([&] {
    auto t = ConnectOnly();
    auto peer = t->Connect(proxy.address());
    ASSERT_TRUE(peer.ok());
    ASSERT_TRUE(t->Send(*peer, Bytes("member")).ok());
    ExpectMessage(*t, *peer, "welcome");
    while (!member_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  absl::StatusOr<PeerId> p = server->Accept(In(absl::Seconds(30)));
  ASSERT_TRUE(p.ok()) << p.status();
  PeerId from = 0;
  std::vector<uint8_t> message;
  absl::Status s = server->Receive(&from, &message, In(absl::Seconds(30)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(from, *p);
  EXPECT_EQ(Text(message), "member");
  ASSERT_TRUE(server->Send(*p, Bytes("welcome")).ok());

  const std::vector<uint8_t> proof = proxy.Recorded();
  ASSERT_GT(proof.size(), 84u);
  std::jthread replayer([&] {
    const int fd = ConnectRaw(address);
    EXPECT_EQ(ReadExactly(fd, 48).size(), 48u);
    SendAll(fd, proof);
    EXPECT_TRUE(ClosedByListener(fd)) << "replay";
    close(fd);
    attacks_done = 2;
  });
  while (attacks_done.load() != 2 && absl::Now() < deadline) {
    auto q = server->Accept(In(absl::Milliseconds(50)));
    EXPECT_FALSE(q.ok()) << "the replay became peer " << *q;
  }
  replayer.join();
  // The member is still connected.
  ASSERT_TRUE(server->Send(*p, Bytes("still here")).ok());
  member_done = true;
}

TEST(UcxBootstrap, AClientOfAnotherDeploymentFailsWithTheReason) {
  auto server = Listening();
  // A child process with its own secret file: another deployment.
  char dir[] = "/tmp/tandem-other-deployment.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string file = std::string(dir) + "/secret";
  ASSERT_TRUE(bootstrap::CreateKeyFile(file).ok());
  // The child's environment names the other secret (this process's key is fixed already).
  ASSERT_TRUE(bootstrap::ProcessKey().ok());
  const std::string ours = std::getenv("TANDEM_SECRET_FILE");
  setenv("TANDEM_SECRET_FILE", file.c_str(), 1);
  const pid_t child = testing_transport::SpawnSelf("UcxChildHelper.DISABLED_ConnectSayHelloAndWait",
                                                   {absl::StrCat(kChildEnv, "=", server->address())});
  setenv("TANDEM_SECRET_FILE", ours.c_str(), 1);
  ASSERT_GT(child, 0);
  EXPECT_EQ(server->Accept(In(absl::Seconds(3))).status().code(), absl::StatusCode::kDeadlineExceeded);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child connected to another deployment";
  unlink(file.c_str());
  rmdir(dir);
}

TEST(DeploymentKey, FilesArePrivateAndCheckedOnLoad) {
  char dir[] = "/tmp/tandem-key-test.XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string file = std::string(dir) + "/secret";
  absl::StatusOr<bootstrap::DeploymentKey> made = bootstrap::CreateKeyFile(file);
  ASSERT_TRUE(made.ok()) << made.status();
  struct stat st {};
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(bootstrap::CreateKeyFile(file).status().code(), absl::StatusCode::kAlreadyExists);
  absl::StatusOr<bootstrap::DeploymentKey> loaded = bootstrap::LoadKeyFile(file);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->secret, made->secret);
  EXPECT_EQ(loaded->id, made->id);
  ASSERT_EQ(chmod(file.c_str(), 0644), 0);
  absl::StatusOr<bootstrap::DeploymentKey> open = bootstrap::LoadKeyFile(file);
  EXPECT_EQ(open.status().code(), absl::StatusCode::kPermissionDenied) << open.status();
  EXPECT_THAT(open.status().message(), HasSubstr("0644"));
  EXPECT_FALSE(bootstrap::ParseKey("abc", "x").ok());
  unlink(file.c_str());
  rmdir(dir);
}

}  // namespace
}  // namespace tandem::transport
