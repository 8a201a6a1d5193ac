// The local transport's device path on one GPU: two threads of this process, each with its own
// transport and CUDA stream, as compute rank 0 and an in-process memory rank use it. A ping-pong
// of layer-like exchanges where each side's stream work depends on the other's write (the reader
// copies what it got into its own buffer and writes that back), checked value by value on fresh
// random data every round, so a copy that ran before its write landed shows stale values; then a
// wait whose write never comes, which SyncStream reports with its label and seqno within seconds.
// Skips without a GPU. Label gpu.
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/transport/factory.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

constexpr uint32_t kIn = 1, kOut = 2;
constexpr size_t kFloats = 1 << 18;  // 1 MiB per message
constexpr int kRounds = 64;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

TEST(LocalTransportGpu, PingPongOfDependentWritesThenAnExpiredWait) {
  TANDEM_SKIP_WITHOUT_GPU();
  CUDA_ASSERT_OK(cudaSetDevice(0));
  absl::StatusOr<std::unique_ptr<Transport>> a =
      CreateTransport({.kind = TransportKind::kLocal, .device = 0});
  absl::StatusOr<std::unique_ptr<Transport>> b =
      CreateTransport({.kind = TransportKind::kLocal, .device = 0});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->capabilities().device_polling);
  float *a_send = nullptr, *a_recv = nullptr, *b_recv = nullptr, *b_send = nullptr;
  for (float** p : {&a_send, &a_recv, &b_recv, &b_send})
    CUDA_ASSERT_OK(cudaMalloc(p, kFloats * sizeof(float)));
  ASSERT_TRUE((*a)->RegisterBuffer(kOut, a_recv, kFloats * sizeof(float)).ok());
  ASSERT_TRUE((*b)->RegisterBuffer(kIn, b_recv, kFloats * sizeof(float)).ok());
  absl::StatusOr<PeerId> to_b = (*a)->Connect((*b)->address());
  ASSERT_TRUE(to_b.ok());
  absl::StatusOr<PeerId> to_a = (*b)->Accept(In(absl::Seconds(1)));
  ASSERT_TRUE(to_a.ok());

  // Thread b: per round, wait for a's rows, compute, write back (the memory rank's loop).
  std::thread echo([&] {
    CUDA_ASSERT_OK(cudaSetDevice(0));
    cudaStream_t s = nullptr;
    CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (uint64_t seq = 1; seq <= kRounds; ++seq) {
      ASSERT_TRUE(
          (*b)->EnqueueWait(*to_a, kIn, 0, kFloats * 4, seq, absl::Seconds(30), "echo: rows", s).ok());
      CUDA_ASSERT_OK(cudaMemcpyAsync(b_send, b_recv, kFloats * 4, cudaMemcpyDeviceToDevice, s));
      ASSERT_TRUE((*b)->EnqueueWrite(*to_a, kOut, 0, b_send, kFloats * 4, seq, s).ok());
    }
    const absl::Status st = (*b)->SyncStream(s, In(absl::Seconds(60)));
    EXPECT_TRUE(st.ok()) << st;
    cudaStreamDestroy(s);
  });

  cudaStream_t s = nullptr;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::mt19937 rng(20261125);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> x(kFloats), got(kFloats);
  int wrong = 0;
  for (uint64_t seq = 1; seq <= kRounds; ++seq) {
    for (float& v : x) v = dist(rng);
    CUDA_ASSERT_OK(cudaMemcpyAsync(a_send, x.data(), kFloats * 4, cudaMemcpyHostToDevice, s));
    ASSERT_TRUE((*a)->EnqueueWrite(*to_b, kIn, 0, a_send, kFloats * 4, seq, s).ok());
    ASSERT_TRUE((*a)->EnqueueWait(*to_b, kOut, 0, kFloats * 4, seq, absl::Seconds(30), "test: echo", s).ok());
    CUDA_ASSERT_OK(cudaMemcpyAsync(got.data(), a_recv, kFloats * 4, cudaMemcpyDeviceToHost, s));
    const absl::Status st = (*a)->SyncStream(s, In(absl::Seconds(60)));
    ASSERT_TRUE(st.ok()) << st;
    for (size_t i = 0; i < kFloats; ++i) wrong += got[i] != x[i] ? 1 : 0;
  }
  echo.join();
  EXPECT_EQ(wrong, 0) << "values that are not the round's rows";

  // A write that never comes: the wait gives up after its timeout, SyncStream says which.
  const absl::Time start = absl::Now();
  ASSERT_TRUE(
      (*a)->EnqueueWait(*to_b, kOut, 0, 16, 1000, absl::Milliseconds(200), "test: never written", s).ok());
  absl::Status st = (*a)->SyncStream(s, In(absl::Seconds(30)));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(std::string(st.message()).find("test: never written"), std::string::npos) << st;
  EXPECT_NE(std::string(st.message()).find("1000"), std::string::npos) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ((*a)->SyncStream(s, In(absl::Seconds(1))).code(), absl::StatusCode::kFailedPrecondition);
  // Out of bounds: refused before anything is enqueued.
  EXPECT_EQ((*b)->EnqueueWrite(*to_a, kOut, 8, b_send, kFloats * 4, 1001, s).code(),
            absl::StatusCode::kInvalidArgument);
  cudaStreamSynchronize(s);
  cudaStreamDestroy(s);
  a->reset();
  b->reset();
  for (float* p : {a_send, a_recv, b_recv, b_send}) cudaFree(p);
}

}  // namespace
}  // namespace tandem::transport
