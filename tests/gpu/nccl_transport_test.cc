// The NCCL transport between two processes: this test (listening, cuda:0) and a child process
// (this binary again, in helper mode, on cuda:1). NCCL refuses two ranks on one GPU, so with one GPU
// both processes share cuda:0 as ranks of two hosts to NCCL (NcclOptions::share_gpu, each with a
// host id of its own; NCCL's transfers then go over sockets on loopback). The child writes payloads that say
// who wrote them and for which seqno, 16 B to 64 MiB, first through the host path (Write; the parent checks
// every byte) and then through the device path (EnqueueWrite; the parent's EnqueueWait and a copy
// behind it on the same stream, compared by hash). Then bounds errors, writes in the other
// direction, two device-path writes in flight each way interleaved with their echoes (the order of
// two pipelined micro-batches, which deadlocked while sends ran on the caller's stream), receives
// from one peer on a second stream (refused), payload checksums (a source rewritten after its
// write's checksum was taken, caught as DataLoss naming the wait; the path reset and used again; a
// sender that turns its checksums off, whose payloads then come without entries), and a device
// wait that expires. Also: registration
// errors, an invalid device, and the machine without a GPU (Unavailable). Prints one-way write times.
#include "common/transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "transport_test_util.h"

namespace tandem::transport {
namespace {

using testing_transport::Fnv1a;
using testing_transport::Payload;
using testing_transport::Text;

constexpr char kAddressEnv[] = "TANDEM_NCCL_TEST_CONNECT_TO";
constexpr size_t kBufferBytes = (64u << 20) + 8192;
const size_t kSizes[] = {16, 4096, 65536, 1u << 20, 16u << 20, 64u << 20};
constexpr int kReps = 5;
constexpr uint64_t kOddOffset = 4104;  // a device-path receive away from the buffer's start
constexpr size_t kBackBytes = 1u << 20;
// The pipelined exchange's two writes each way: large, so that a send cannot complete before its
// receive is posted (NCCL buffers a few MiB per channel ahead of the receiver).
constexpr size_t kPipeBytes = 32u << 20;
constexpr uint64_t kBackOrigin = 4242;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// The child's GPU: cuda:1, or cuda:0 shared with the parent on a one-GPU machine.
int ChildDevice() { return testing_gpu::GpuCount() >= 2 ? 1 : 0; }
NcclOptions Options(std::string listen, int device) {
  return {.listen_address = std::move(listen), .device = device, .share_gpu = ChildDevice() == 0};
}

// The checksum cases: a payload larger than what NCCL reads ahead of a receiver that has not
// posted its receive (a few MiB per channel), so the end of its source is still unread while the
// child rewrites it.
constexpr size_t kRewrittenBytes = 64u << 20;

struct DeviceMemory {
  void* p = nullptr;
  explicit DeviceMemory(size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
  }
  ~DeviceMemory() { cudaFree(p); }
  std::vector<uint8_t> Read(size_t bytes, size_t offset = 0) const {
    std::vector<uint8_t> v(bytes);
    cudaMemcpy(v.data(), static_cast<const uint8_t*>(p) + offset, bytes, cudaMemcpyDeviceToHost);
    return v;
  }
};

struct PinnedHost {
  uint8_t* p = nullptr;
  explicit PinnedHost(size_t bytes) {
    if (cudaMallocHost(&p, bytes) != cudaSuccess) p = nullptr;
  }
  ~PinnedHost() { cudaFreeHost(p); }
};

struct Stream {
  cudaStream_t s = nullptr;
  Stream() { cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); }
  ~Stream() { cudaStreamDestroy(s); }
};

void ExpectMessage(Transport& t, const std::string& want) {
  PeerId from;
  std::vector<uint8_t> m;
  const absl::Status s = t.Receive(&from, &m, In(absl::Seconds(120)));
  ASSERT_TRUE(s.ok()) << s << " (waiting for \"" << want << "\")";
  ASSERT_EQ(std::string(m.begin(), m.end()), want);
}

double MicrosSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// The child (cuda:1): connects; writes every size into the parent's buffer 1, host path (waiting
// for "ack <seq>" before the next) and then device path; checks bounds errors; receives the
// parent's writes into its buffer 2; waits for "bye" while the parent lets a wait expire.
TEST(NcclChildHelper, DISABLED_Peer) {
  const char* address = std::getenv(kAddressEnv);
  if (address == nullptr) GTEST_SKIP() << "helper for NcclTransport.TwoProcesses; run by it";
  const int device = ChildDevice();
  CUDA_ASSERT_OK(cudaSetDevice(device));
  auto t = CreateNcclTransport(Options("", device));
  ASSERT_TRUE(t.ok()) << t.status();
  Transport& tr = **t;
  DeviceMemory mine(kBufferBytes);
  ASSERT_NE(mine.p, nullptr);
  ASSERT_TRUE(tr.RegisterBuffer(2, mine.p, kBufferBytes).ok());
  auto peer = tr.Connect(address);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ASSERT_TRUE(tr.Send(*peer, Text(absl::StrCat("hello from cuda:", device))).ok());
  const uint64_t origin = static_cast<uint64_t>(getpid());
  DeviceMemory src(64u << 20);
  ASSERT_NE(src.p, nullptr);

  // Host path, from device memory.
  uint64_t seq = 0;
  for (size_t bytes : kSizes) {
    double best_us = 1e30;
    for (int rep = 0; rep < kReps; ++rep) {
      ++seq;
      const std::vector<uint8_t> data = Payload(origin, seq, bytes);
      CUDA_ASSERT_OK(cudaMemcpy(src.p, data.data(), bytes, cudaMemcpyHostToDevice));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
      const absl::Span<const uint8_t> piece(static_cast<const uint8_t*>(src.p), bytes);
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status s = tr.Write(*peer, 1, 0, {&piece, 1}, seq);
      best_us = std::min(best_us, MicrosSince(t0));
      ASSERT_TRUE(s.ok()) << s;
      ExpectMessage(tr, absl::StrCat("ack ", seq));
      if (HasFatalFailure()) return;
    }
    std::printf("nccl host-path write cuda:%d -> cuda:0, %zu bytes: %.1f us (best of %d), %.2f GB/s\n",
                device, bytes, best_us, kReps, bytes / best_us / 1e3);
  }
  // Gathered pieces from host memory, at an offset.
  ++seq;
  const std::vector<uint8_t> a = Payload(origin, 1000, 40), b = Payload(origin, 1001, 4096);
  const absl::Span<const uint8_t> pieces[] = {a, b};
  ASSERT_TRUE(tr.Write(*peer, 1, 64, pieces, seq).ok());
  ExpectMessage(tr, absl::StrCat("ack ", seq));
  if (HasFatalFailure()) return;

  // Bounds: refused before anything is sent (the device path below would be out of step otherwise).
  Stream stream;
  const std::vector<uint8_t> big(128);
  const absl::Span<const uint8_t> over(big);
  absl::Status s = tr.Write(*peer, 1, kBufferBytes - 64, {&over, 1}, seq + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = tr.EnqueueWrite(*peer, 1, kBufferBytes - 64, src.p, 128, seq + 1, stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = tr.EnqueueWrite(*peer, 1, 0, big.data(), big.size(), seq + 1, stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "host memory as the source: " << s;
  ASSERT_TRUE(tr.Send(*peer, Text("bounds checked")).ok());

  // Device path: every size, each write synchronised before the source is refilled.
  for (size_t bytes : kSizes) {
    double best_us = 1e30;
    for (int rep = 0; rep < kReps; ++rep) {
      ++seq;
      const std::vector<uint8_t> data = Payload(origin, seq, bytes);
      CUDA_ASSERT_OK(cudaMemcpy(src.p, data.data(), bytes, cudaMemcpyHostToDevice));
      CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
      const auto t0 = std::chrono::steady_clock::now();
      s = tr.EnqueueWrite(*peer, 1, 0, src.p, bytes, seq, stream.s);
      ASSERT_TRUE(s.ok()) << s;
      s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
      ASSERT_TRUE(s.ok()) << s;
      best_us = std::min(best_us, MicrosSince(t0));
    }
    std::printf("nccl device-path write+sync cuda:%d -> cuda:0, %zu bytes: %.1f us (best of %d), %.2f GB/s\n",
                device, bytes, best_us, kReps, bytes / best_us / 1e3);
  }
  ++seq;  // the parent receives this one at kOddOffset
  const std::vector<uint8_t> odd = Payload(origin, seq, 4096);
  CUDA_ASSERT_OK(cudaMemcpy(src.p, odd.data(), odd.size(), cudaMemcpyHostToDevice));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
  ASSERT_TRUE(tr.EnqueueWrite(*peer, 1, kOddOffset, src.p, odd.size(), seq, stream.s).ok());
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;

  // The other direction: the parent's host-path write (seqno 7), then its device-path write (8).
  s = tr.WaitDoorbell(2, 7, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(mine.Read(kBackBytes) == Payload(kBackOrigin, 7, kBackBytes))
      << "host-path write from the parent";
  PinnedHost back(kBackBytes);
  ASSERT_NE(back.p, nullptr);
  s = tr.EnqueueWait(*peer, 2, 0, kBackBytes, 8, absl::Seconds(30), "child: the parent's device write",
                     stream.s);
  ASSERT_TRUE(s.ok()) << s;
  CUDA_ASSERT_OK(cudaMemcpyAsync(back.p, mine.p, kBackBytes, cudaMemcpyDeviceToHost, stream.s));
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Fnv1a(back.p, kBackBytes), Fnv1a(Payload(kBackOrigin, 8, kBackBytes)))
      << "device-path write from the parent";
  EXPECT_EQ(tr.Doorbell(2), 8u);
  ASSERT_TRUE(tr.Send(*peer, Text("done")).ok());

  // Pipelined: writes A and B in flight, then the waits for the parent's echoes of A and B (at the
  // same offsets of our buffer 2, seqnos 9 and 10), one synchronisation.
  seq += 2;
  auto* pipe = static_cast<uint8_t*>(src.p);
  for (size_t k = 0; k < 2; ++k) {
    const std::vector<uint8_t> data = Payload(origin, seq - 1 + k, kPipeBytes);
    CUDA_ASSERT_OK(cudaMemcpy(pipe + k * kPipeBytes, data.data(), kPipeBytes, cudaMemcpyHostToDevice));
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
  for (size_t k = 0; k < 2; ++k) {
    s = tr.EnqueueWrite(*peer, 1, k * kPipeBytes, pipe + k * kPipeBytes, kPipeBytes, seq - 1 + k, stream.s);
    ASSERT_TRUE(s.ok()) << s;
  }
  for (size_t k = 0; k < 2; ++k) {
    s = tr.EnqueueWait(*peer, 2, k * kPipeBytes, kPipeBytes, 9 + k, absl::Seconds(30),
                       absl::StrCat("child: the parent's echo ", k), stream.s);
    ASSERT_TRUE(s.ok()) << s;
  }
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  for (size_t k = 0; k < 2; ++k) {
    EXPECT_TRUE(mine.Read(kPipeBytes, k * kPipeBytes) == Payload(origin, seq - 1 + k, kPipeBytes))
        << "the parent's echo " << k;
  }
  EXPECT_EQ(tr.Doorbell(2), 10u);
  ASSERT_TRUE(tr.Send(*peer, Text("echoes checked")).ok());

  // Payload checksums. A write whose source is rewritten after the checksum kernel ran and before
  // NCCL read that part of it (the bug of a caller that reuses a source too early): the parent
  // posts its receive only once told, so the end of the 64 MiB source is still unread here. The
  // checksum kernel runs on the send stream within microseconds of the call; a second is ample.
  ++seq;
  const std::vector<uint8_t> sent = Payload(origin, seq, kRewrittenBytes);
  CUDA_ASSERT_OK(cudaMemcpy(src.p, sent.data(), kRewrittenBytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  ASSERT_TRUE(tr.EnqueueWrite(*peer, 1, 0, src.p, kRewrittenBytes, seq, stream.s).ok());
  absl::SleepFor(absl::Seconds(1));
  const uint8_t flipped = sent.back() ^ 0x10;
  // The legacy stream's copy does not wait for the transport's non-blocking send stream.
  CUDA_ASSERT_OK(
      cudaMemcpy(static_cast<uint8_t*>(src.p) + kRewrittenBytes - 1, &flipped, 1, cudaMemcpyHostToDevice));
  ASSERT_TRUE(tr.Send(*peer, Text(absl::StrCat("rewritten ", seq))).ok());
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << "the sender's side of a rewritten source: " << s;
  // Then an intact one, with checksums, and one without (the parent receives no entry after it).
  for (const bool checked : {true, false}) {
    ExpectMessage(tr, "reset");
    if (HasFatalFailure()) return;
    tr.SetDeviceChecksums(checked);
    ++seq;
    const std::vector<uint8_t> data = Payload(origin, seq, kBackBytes);
    CUDA_ASSERT_OK(cudaMemcpy(src.p, data.data(), kBackBytes, cudaMemcpyHostToDevice));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(tr.Send(*peer, Text(absl::StrCat("intact ", seq, checked ? " with" : " without"))).ok());
    ASSERT_TRUE(tr.EnqueueWrite(*peer, 1, 0, src.p, kBackBytes, seq, stream.s).ok());
    s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
    ASSERT_TRUE(s.ok()) << s;
  }

  // The parent now lets a wait for a write of ours expire (and aborts its communicator from us),
  // which must not disturb us: nothing of ours is pending, so Flush succeeds. The parent keeps
  // its transport going until "closing", so that the flush can complete; then both tear down at
  // once (the transport's teardown is bounded either way).
  ExpectMessage(tr, "bye");
  if (HasFatalFailure()) return;
  s = tr.Flush(In(absl::Seconds(10)));
  EXPECT_TRUE(s.ok()) << "Flush after the parent's abort: " << s;
  ASSERT_TRUE(tr.Send(*peer, Text("closing")).ok());
}

// With `shared`, the child gets a host id of its own (it would inherit this process's).
pid_t StartChild(const std::string& address, bool shared) {
  std::vector<std::string> env = {absl::StrCat(kAddressEnv, "=", address)};
  if (shared) env.push_back(absl::StrCat("NCCL_HOSTID=tandem-nccl-test-child-", getpid()));
  return testing_transport::SpawnSelf("NcclChildHelper.DISABLED_Peer", env);
}

// Reaps the child: true if it exited with status 0 before `deadline`; past it, the child is killed
// (so that this binary never hangs on it).
bool Reap(pid_t child, absl::Time deadline) {
  int status = 0;
  while (true) {
    const pid_t r = waitpid(child, &status, WNOHANG);
    if (r == child) return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (r < 0) return false;
    if (absl::Now() >= deadline) {
      std::fprintf(stderr, "the child did not exit in time; killing it\n");
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return false;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// Kills and reaps the child when the test ends early (a failed assertion).
struct ChildGuard {
  pid_t pid = -1;
  ~ChildGuard() {
    if (pid > 0) (void)Reap(pid, absl::Now());
  }
};

TEST(NcclTransport, TwoProcesses) {
  TANDEM_SKIP_WITHOUT_GPU();
  CUDA_ASSERT_OK(cudaSetDevice(0));
  auto t = CreateNcclTransport(Options("127.0.0.1:0", 0));
  ASSERT_TRUE(t.ok()) << t.status();
  Transport& tr = **t;
  EXPECT_EQ(tr.capabilities().name, "nccl");
  EXPECT_TRUE(tr.capabilities().gpu_memory);
  EXPECT_TRUE(tr.capabilities().device_polling);
  EXPECT_FALSE(tr.capabilities().same_host_only);
  DeviceMemory buffer(kBufferBytes);
  ASSERT_NE(buffer.p, nullptr);
  ASSERT_TRUE(tr.RegisterBuffer(1, buffer.p, kBufferBytes).ok());
  const pid_t child = StartChild(tr.address(), ChildDevice() == 0);
  ASSERT_GT(child, 0);
  ChildGuard guard{child};
  auto peer = tr.Accept(In(absl::Seconds(60)));
  ASSERT_TRUE(peer.ok()) << peer.status();
  PeerId from;
  std::vector<uint8_t> m;
  ASSERT_TRUE(tr.Receive(&from, &m, In(absl::Seconds(60))).ok());
  std::printf("child says: %s\n", std::string(m.begin(), m.end()).c_str());
  const uint64_t origin = static_cast<uint64_t>(child);

  // Host path: every byte of every message.
  uint64_t seq = 0;
  for (size_t bytes : kSizes) {
    for (int rep = 0; rep < kReps; ++rep) {
      ++seq;
      const absl::Status s = tr.WaitDoorbell(1, seq, In(absl::Seconds(60)));
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(tr.Doorbell(1), seq);
      ASSERT_TRUE(buffer.Read(bytes) == Payload(origin, seq, bytes)) << bytes << " bytes, seqno " << seq;
      CUDA_ASSERT_OK(cudaMemset(buffer.p, 0xEE, bytes));  // the next message must rewrite it
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      ASSERT_TRUE(tr.Send(*peer, Text(absl::StrCat("ack ", seq))).ok());
    }
  }
  ++seq;
  ASSERT_TRUE(tr.WaitDoorbell(1, seq, In(absl::Seconds(60))).ok());
  std::vector<uint8_t> want = Payload(origin, 1000, 40);
  const std::vector<uint8_t> second = Payload(origin, 1001, 4096);
  want.insert(want.end(), second.begin(), second.end());
  EXPECT_TRUE(buffer.Read(want.size(), 64) == want) << "gathered pieces";
  ASSERT_TRUE(tr.Send(*peer, Text(absl::StrCat("ack ", seq))).ok());

  // Bounds: InvalidArgument (NotFound for an unknown buffer) before anything is enqueued or sent.
  Stream stream;
  DeviceMemory src(kBackBytes);
  ASSERT_NE(src.p, nullptr);
  absl::Status s =
      tr.EnqueueWait(*peer, 1, kBufferBytes - 64, 128, seq + 1, absl::Seconds(1), "bounds", stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = tr.EnqueueWait(*peer, 99, 0, 16, seq + 1, absl::Seconds(1), "unknown buffer", stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  const std::vector<uint8_t> big(128);
  const absl::Span<const uint8_t> over(big);
  s = tr.Write(*peer, 2, kBufferBytes - 64, {&over, 1}, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = tr.EnqueueWrite(*peer, 2, kBufferBytes, src.p, 1, 1, stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  ExpectMessage(tr, "bounds checked");
  if (HasFatalFailure()) return;

  // Device path: the wait, then a copy behind it on the same stream, one synchronisation.
  PinnedHost host(64u << 20);
  ASSERT_NE(host.p, nullptr);
  for (size_t bytes : kSizes) {
    for (int rep = 0; rep < kReps; ++rep) {
      ++seq;
      s = tr.EnqueueWait(*peer, 1, 0, bytes, seq, absl::Seconds(30), absl::StrCat("parent: message ", seq),
                         stream.s);
      ASSERT_TRUE(s.ok()) << s;
      CUDA_ASSERT_OK(cudaMemcpyAsync(host.p, buffer.p, bytes, cudaMemcpyDeviceToHost, stream.s));
      s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
      ASSERT_TRUE(s.ok()) << s;
      ASSERT_EQ(Fnv1a(host.p, bytes), Fnv1a(Payload(origin, seq, bytes))) << bytes << " bytes, seqno " << seq;
      EXPECT_EQ(tr.Doorbell(1), seq);
    }
  }
  ++seq;
  ASSERT_TRUE(
      tr.EnqueueWait(*peer, 1, kOddOffset, 4096, seq, absl::Seconds(30), "parent: odd offset", stream.s)
          .ok());
  CUDA_ASSERT_OK(cudaMemcpyAsync(host.p, static_cast<uint8_t*>(buffer.p) + kOddOffset, 4096,
                                 cudaMemcpyDeviceToHost, stream.s));
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Fnv1a(host.p, 4096), Fnv1a(Payload(origin, seq, 4096))) << "received at offset " << kOddOffset;

  // The other direction: host path (seqno 7), then device path (8), into the child's buffer 2.
  const std::vector<uint8_t> back7 = Payload(kBackOrigin, 7, kBackBytes);
  CUDA_ASSERT_OK(cudaMemcpy(src.p, back7.data(), kBackBytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
  const absl::Span<const uint8_t> piece(static_cast<const uint8_t*>(src.p), kBackBytes);
  s = tr.Write(*peer, 2, 0, {&piece, 1}, 7);
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<uint8_t> back8 = Payload(kBackOrigin, 8, kBackBytes);
  CUDA_ASSERT_OK(cudaMemcpy(src.p, back8.data(), kBackBytes, cudaMemcpyHostToDevice));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());  // a pageable upload may still be in flight
  ASSERT_TRUE(tr.EnqueueWrite(*peer, 2, 0, src.p, kBackBytes, 8, stream.s).ok());
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  ExpectMessage(tr, "done");
  if (HasFatalFailure()) return;

  // Pipelined, as two micro-batches: the child enqueues writes A and B and then the waits for
  // their echoes; this side the wait for A, the echo of A (sent from where A landed), the wait for
  // B, the echo of B. Were the child's write of B on its stream, it would hold up the wait for A's
  // echo until this side waits for B, which comes after the echo of A: a deadlock.
  seq += 2;
  for (size_t k = 0; k < 2; ++k) {
    s = tr.EnqueueWait(*peer, 1, k * kPipeBytes, kPipeBytes, seq - 1 + k, absl::Seconds(30),
                       absl::StrCat("parent: pipelined write ", k), stream.s);
    ASSERT_TRUE(s.ok()) << s;
    s = tr.EnqueueWrite(*peer, 2, k * kPipeBytes, static_cast<uint8_t*>(buffer.p) + k * kPipeBytes,
                        kPipeBytes, 9 + k, stream.s);
    ASSERT_TRUE(s.ok()) << s;
  }
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(tr.Doorbell(1), seq);
  ExpectMessage(tr, "echoes checked");
  if (HasFatalFailure()) return;

  // Payload checksums: the child rewrote the end of its source after the checksum was taken (see
  // the child), so the landed bytes differ from what the entry says.
  ++seq;
  ExpectMessage(tr, absl::StrCat("rewritten ", seq));
  if (HasFatalFailure()) return;
  const std::string rewritten = "parent: a write whose source changed";
  s = tr.EnqueueWait(*peer, 1, 0, kRewrittenBytes, seq, absl::Seconds(30), rewritten, stream.s);
  ASSERT_TRUE(s.ok()) << s;
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(std::string(s.message()).find(rewritten + ": the payload's checksum does not match"),
            std::string::npos)
      << s;
  s = tr.EnqueueWait(*peer, 1, 0, 16, seq + 1, absl::Seconds(1), "after the mismatch", stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "the failed path refuses until reset: " << s;
  ASSERT_TRUE(tr.ResetDevicePath(stream.s).ok());
  // Reset, the path takes the next payloads: one with its entry, one the child sends without (it
  // turned its checksums off, and its settings frame came before its message).
  for (const char* how : {" with", " without"}) {
    ASSERT_TRUE(tr.Send(*peer, Text("reset")).ok());
    ++seq;
    ExpectMessage(tr, absl::StrCat("intact ", seq, how));
    if (HasFatalFailure()) return;
    s = tr.EnqueueWait(*peer, 1, 0, kBackBytes, seq, absl::Seconds(30), absl::StrCat("parent: intact", how),
                       stream.s);
    ASSERT_TRUE(s.ok()) << s;
    CUDA_ASSERT_OK(cudaMemcpyAsync(host.p, buffer.p, kBackBytes, cudaMemcpyDeviceToHost, stream.s));
    s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
    ASSERT_TRUE(s.ok()) << how << ": " << s;
    EXPECT_EQ(Fnv1a(host.p, kBackBytes), Fnv1a(Payload(origin, seq, kBackBytes))) << how;
  }

  // Receives from the child on a second stream while the first has one enqueued: refused (NCCL
  // would match them in the order issued, whichever stream reached its own first).
  {
    Stream other;
    ++seq;
    ASSERT_TRUE(
        tr.EnqueueWait(*peer, 1, 0, 0, seq, absl::Seconds(1), "parent: an empty wait", stream.s).ok());
    s = tr.EnqueueWait(*peer, 1, 0, 16, seq + 1, absl::Seconds(1), "parent: another stream", other.s);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("another stream"), std::string::npos) << s;
    s = tr.SyncStream(stream.s, In(absl::Seconds(10)));
    ASSERT_TRUE(s.ok()) << s;
  }

  // A device wait for a write that never comes expires with its label; the device path then stays
  // failed, and the control plane still works.
  const std::string label = "parent: a write the child never sends";
  const absl::Time start = absl::Now();
  s = tr.EnqueueWait(*peer, 1, 0, 4096, seq + 1, absl::Milliseconds(300), label, stream.s);
  ASSERT_TRUE(s.ok()) << s;
  s = tr.SyncStream(stream.s, In(absl::Seconds(60)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(std::string(s.message()).find(label), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  s = tr.EnqueueWait(*peer, 1, 0, 4096, seq + 2, absl::Seconds(1), "after the failure", stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  s = tr.EnqueueWrite(*peer, 2, 0, src.p, 16, 9, stream.s);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  s = tr.SyncStream(stream.s, In(absl::Seconds(5)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  ASSERT_TRUE(tr.Send(*peer, Text("bye")).ok());
  // Pumping (for the child's Flush) until it is done with the control plane; then both tear down.
  ExpectMessage(tr, "closing");
  const absl::Time teardown = absl::Now();
  t->reset();
  EXPECT_LT(absl::Now() - teardown, absl::Seconds(10)) << "tearing down the transport";
  guard.pid = -1;
  EXPECT_TRUE(Reap(child, In(absl::Seconds(60)))) << "the child failed (its output is above)";
}

TEST(NcclTransport, RegistrationErrorsAndDeadlines) {
  TANDEM_SKIP_WITHOUT_GPU();
  CUDA_ASSERT_OK(cudaSetDevice(0));
  auto t = CreateNcclTransport({.listen_address = "127.0.0.1:0", .device = 0});
  ASSERT_TRUE(t.ok()) << t.status();
  Transport& tr = **t;
  DeviceMemory a(4096);
  ASSERT_NE(a.p, nullptr);
  ASSERT_TRUE(tr.RegisterBuffer(3, a.p, 4096).ok());
  EXPECT_EQ(tr.RegisterBuffer(3, a.p, 4096).code(), absl::StatusCode::kAlreadyExists);
  std::vector<uint8_t> host(4096);
  EXPECT_EQ(tr.RegisterBuffer(4, host.data(), host.size()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tr.WaitDoorbell(9, 1, In(absl::Milliseconds(10))).code(), absl::StatusCode::kNotFound);
  const absl::Time start = absl::Now();
  const absl::Status s = tr.WaitDoorbell(3, 1, In(absl::Milliseconds(200)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(std::string(s.message()).find("buffer 3"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  Stream stream;
  EXPECT_EQ(tr.EnqueueWait(7, 3, 0, 16, 1, absl::Seconds(1), "no such peer", stream.s).code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(tr.SyncStream(stream.s, In(absl::Seconds(5))).ok()) << "a stream with nothing enqueued";
}

TEST(NcclTransport, InvalidDevice) {
  TANDEM_SKIP_WITHOUT_GPU();
  EXPECT_EQ(CreateNcclTransport({.listen_address = "", .device = 1000}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateNcclTransport({.listen_address = "", .device = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Runs where there is no GPU (CI): the transport says it cannot work instead of pretending.
TEST(NcclTransport, UnavailableWithoutGpu) {
  if (testing_gpu::GpuCount() > 0)
    GTEST_SKIP() << "this machine has a CUDA device; the test is for machines without one";
  auto t = CreateNcclTransport({.listen_address = "", .device = 0});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable) << t.status();
}

}  // namespace
}  // namespace tandem::transport
