// The local transport (common/transport/local): transports of one process, each driven by its own
// thread, as compute rank 0 and its in-process memory ranks use it. Messages in order per peer,
// writes into registered buffers with doorbells (several pieces, at offsets, each byte checked),
// the errors a writer gets (unknown buffer, out of bounds: nothing written), deadlines, and a peer
// whose transport is destroyed (Unavailable instead of a hang, nothing written after it).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/transport/factory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

using ::testing::HasSubstr;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::unique_ptr<Transport> Local() {
  absl::StatusOr<std::unique_ptr<Transport>> t = CreateTransport({.kind = TransportKind::kLocal});
  TANDEM_CHECK_MSG(t.ok(), t.status().ToString());
  return std::move(t).value();
}

std::vector<uint8_t> Bytes(size_t n, uint32_t tag) {
  std::vector<uint8_t> v(n);
  uint32_t x = tag * 2654435761u + 1;
  for (uint8_t& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x);
  }
  return v;
}

TEST(LocalTransport, AddressesAreUniqueAndConnectFindsTheListener) {
  auto a = Local(), b = Local();
  EXPECT_NE(a->address(), b->address());
  EXPECT_THAT(a->address(), HasSubstr("local:"));
  EXPECT_EQ(a->capabilities().name, "local");
  absl::StatusOr<PeerId> p = a->Connect(b->address());
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<PeerId> q = b->Accept(In(absl::Seconds(1)));
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(a->PeerName(*p), b->address());
  EXPECT_EQ(b->PeerName(*q), a->address());
  EXPECT_EQ(b->Accept(In(absl::Milliseconds(20))).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(a->Connect("local:999999").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(a->Connect("127.0.0.1:5").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Connect(a->address()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalTransport, MessagesArriveInOrderAcrossThreads) {
  auto server = Local();
  const std::string address = server->address();
  constexpr int kMessages = 500;
  std::thread client([address] {
    auto c = Local();
    absl::StatusOr<PeerId> p = c->Connect(address);
    ASSERT_TRUE(p.ok()) << p.status();
    for (int i = 0; i < kMessages; ++i) {
      const std::vector<uint8_t> m = Bytes(1 + i % 97, i);
      ASSERT_TRUE(c->Send(*p, m).ok());
    }
    // Wait for the reply before going away, so that nothing is reported as a failure.
    PeerId from = 0;
    std::vector<uint8_t> reply;
    ASSERT_TRUE(c->Receive(&from, &reply, In(absl::Seconds(10))).ok());
    EXPECT_EQ(reply, std::vector<uint8_t>({42}));
    c->Close(*p);
  });
  absl::StatusOr<PeerId> q = server->Accept(In(absl::Seconds(10)));
  ASSERT_TRUE(q.ok()) << q.status();
  for (int i = 0; i < kMessages; ++i) {
    PeerId from = 99;
    std::vector<uint8_t> m;
    ASSERT_TRUE(server->Receive(&from, &m, In(absl::Seconds(10))).ok()) << i;
    EXPECT_EQ(from, *q);
    ASSERT_EQ(m, Bytes(1 + i % 97, i)) << "message " << i;
  }
  server->Close(*q);
  const std::vector<uint8_t> reply = {42};
  ASSERT_TRUE(server->Send(*q, reply).ok());
  client.join();
  PeerId from = 0;
  std::vector<uint8_t> m;
  EXPECT_EQ(server->Receive(&from, &m, In(absl::Milliseconds(20))).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(server->Send(*q, std::vector<uint8_t>{}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LocalTransport, WritesLandWithTheirDoorbellAndBadOnesWriteNothing) {
  auto reader = Local(), writer = Local();
  constexpr size_t kBytes = 1 << 16;
  std::vector<uint8_t> buffer(kBytes + 64, 0xEE);  // 64 guard bytes past the registered range
  ASSERT_TRUE(reader->RegisterBuffer(7, buffer.data(), kBytes).ok());
  EXPECT_EQ(reader->RegisterBuffer(7, buffer.data(), kBytes).code(), absl::StatusCode::kAlreadyExists);
  absl::StatusOr<PeerId> p = writer->Connect(reader->address());
  ASSERT_TRUE(p.ok());
  ASSERT_TRUE(reader->Accept(In(absl::Seconds(1))).ok());

  std::thread t([&] {
    for (uint64_t seq = 1; seq <= 20; ++seq) {
      const size_t offset = (seq * 977) % 4096, n = 1 + (seq * 7919) % (kBytes - 8192);
      const std::vector<uint8_t> head = Bytes(n / 3, seq), tail = Bytes(n - n / 3, seq + 1000);
      const absl::Span<const uint8_t> pieces[] = {head, tail};
      ASSERT_TRUE(writer->Write(*p, 7, offset, pieces, seq).ok());
      // Wait for the reader's ack so that the next write does not overwrite what it checks.
      PeerId from = 0;
      std::vector<uint8_t> ack;
      ASSERT_TRUE(writer->Receive(&from, &ack, In(absl::Seconds(10))).ok());
    }
  });
  for (uint64_t seq = 1; seq <= 20; ++seq) {
    ASSERT_TRUE(reader->WaitDoorbell(7, seq, In(absl::Seconds(10))).ok()) << seq;
    EXPECT_GE(reader->Doorbell(7), seq);
    const size_t offset = (seq * 977) % 4096, n = 1 + (seq * 7919) % (kBytes - 8192);
    const std::vector<uint8_t> head = Bytes(n / 3, seq), tail = Bytes(n - n / 3, seq + 1000);
    ASSERT_EQ(std::memcmp(buffer.data() + offset, head.data(), head.size()), 0) << seq;
    ASSERT_EQ(std::memcmp(buffer.data() + offset + head.size(), tail.data(), tail.size()), 0) << seq;
    std::memset(buffer.data(), 0xEE, kBytes);  // every write must put its bytes again
    ASSERT_TRUE(reader->Send(0, std::vector<uint8_t>{1}).ok());
  }
  t.join();

  // Refused before anything is copied: past the end, an unknown buffer.
  const std::vector<uint8_t> big = Bytes(kBytes, 5);
  const absl::Span<const uint8_t> one[] = {big};
  absl::Status st = writer->Write(*p, 7, 1, one, 21);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("outside buffer 7"));
  EXPECT_EQ(writer->Write(*p, 8, 0, one, 21).code(), absl::StatusCode::kNotFound);
  for (size_t i = 0; i < buffer.size(); ++i) ASSERT_EQ(buffer[i], 0xEE) << "byte " << i << " was written";
  EXPECT_EQ(reader->Doorbell(7), 20u);
  st = reader->WaitDoorbell(7, 21, In(absl::Milliseconds(30)));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(st.message()), HasSubstr("it is at 20"));
  EXPECT_EQ(reader->WaitDoorbell(9, 1, In(absl::Milliseconds(1))).code(), absl::StatusCode::kNotFound);
  // Without a CUDA device the device path is not there.
  if (!reader->capabilities().device_polling) {
    EXPECT_EQ(reader->SyncStream(nullptr, In(absl::Seconds(1))).code(), absl::StatusCode::kUnimplemented);
  }
}

TEST(LocalTransport, APeerThatGoesAwayIsReportedNotAwaited) {
  auto reader = Local();
  std::vector<uint8_t> buffer(64, 0);
  ASSERT_TRUE(reader->RegisterBuffer(1, buffer.data(), buffer.size()).ok());
  auto writer = Local();
  absl::StatusOr<PeerId> p = writer->Connect(reader->address());
  ASSERT_TRUE(p.ok());
  absl::StatusOr<PeerId> q = reader->Accept(In(absl::Seconds(1)));
  ASSERT_TRUE(q.ok());
  std::thread gone([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    writer.reset();
  });
  const absl::Time start = absl::Now();
  absl::Status st = reader->WaitDoorbell(1, 1, In(absl::Seconds(30)));
  gone.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("went away"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(reader->Send(*q, std::vector<uint8_t>{1}).code(), absl::StatusCode::kUnavailable);
  // Reported once; then a Receive just times out.
  PeerId from = 0;
  std::vector<uint8_t> m;
  EXPECT_EQ(reader->Receive(&from, &m, In(absl::Milliseconds(20))).code(),
            absl::StatusCode::kDeadlineExceeded);

  // A reader that went away: writes fail, nothing lands in its (now unowned) memory.
  auto writer2 = Local();
  std::vector<uint8_t> buffer2(64, 0);
  {
    auto reader2 = Local();
    ASSERT_TRUE(reader2->RegisterBuffer(1, buffer2.data(), buffer2.size()).ok());
    absl::StatusOr<PeerId> p2 = writer2->Connect(reader2->address());
    ASSERT_TRUE(p2.ok());
  }
  const std::vector<uint8_t> data(16, 9);
  const absl::Span<const uint8_t> one[] = {data};
  EXPECT_EQ(writer2->Write(0, 1, 0, one, 1).code(), absl::StatusCode::kUnavailable);
  for (uint8_t b : buffer2) ASSERT_EQ(b, 0);
  // A closed peer's going is expected: not reported.
  auto a = Local();
  {
    auto b = Local();
    absl::StatusOr<PeerId> ab = a->Connect(b->address());
    ASSERT_TRUE(ab.ok());
    a->Close(*ab);
  }
  EXPECT_EQ(a->Receive(&from, &m, In(absl::Milliseconds(20))).code(), absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace tandem::transport
