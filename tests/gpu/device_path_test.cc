// The device path's payload checksums (common/transport/device): the write kernel's checksum of
// what it copied against the CPU reference (payload_checksum.h) on fresh random payloads of random
// sizes and alignments, the copy itself byte for byte, and the receiver's check: it passes on the
// bytes as written, and fails with DataLoss naming the wait for one flipped bit anywhere or for
// an entry that holds another seqno. Skips without a GPU. Label gpu.
#include "common/transport/device/device_path.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/transport/device/payload_checksum.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

constexpr size_t kMaxBytes = 3u << 20;  // a layer message of a few hundred rows

struct Device {
  void* p = nullptr;
  explicit Device(size_t bytes) { cudaMalloc(&p, bytes); }
  ~Device() { cudaFree(p); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

class DevicePathChecksum : public ::testing::Test {
 protected:
  void SetUp() override {
    TANDEM_SKIP_WITHOUT_GPU();
    CUDA_ASSERT_OK(cudaSetDevice(0));
    CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Writes `data` from `src + src_off` to `dst + dst_off` with doorbell `seqno` and its checksum
  // entry (entries[seqno % ring]), then checks the copy and the stored entry.
  void WriteAndCheck(DevicePath& path, const std::vector<uint8_t>& data, size_t src_off, size_t dst_off,
                     uint64_t seqno) {
    CUDA_ASSERT_OK(
        cudaMemcpy(src_.as<uint8_t>() + src_off, data.data(), data.size(), cudaMemcpyHostToDevice));
    // A copy from pageable memory may return before its DMA is done, and stream_ does not wait for
    // the legacy stream.
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ChecksumEntry* entry = entries_.as<ChecksumEntry>() + seqno % kChecksumRing;
    ASSERT_TRUE(path.EnqueueWriteWithDoorbell(dst_.as<uint8_t>() + dst_off, src_.as<uint8_t>() + src_off,
                                              data.size(), bell_.as<uint64_t>(), seqno, stream_, entry)
                    .ok());
    const absl::Status s = path.Sync(stream_, absl::Now() + absl::Seconds(10), nullptr);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<uint8_t> got(data.size());
    CUDA_ASSERT_OK(cudaMemcpy(got.data(), dst_.as<uint8_t>() + dst_off, got.size(), cudaMemcpyDeviceToHost));
    ASSERT_TRUE(got == data) << data.size() << " bytes, offsets " << src_off << " / " << dst_off;
    ChecksumEntry stored{};
    CUDA_ASSERT_OK(cudaMemcpy(&stored, entry, sizeof(stored), cudaMemcpyDeviceToHost));
    uint64_t bell = 0;
    CUDA_ASSERT_OK(cudaMemcpy(&bell, bell_.p, sizeof(bell), cudaMemcpyDeviceToHost));
    EXPECT_EQ(bell, seqno);
    EXPECT_EQ(stored.seqno, seqno);
    EXPECT_EQ(stored.checksum, PayloadChecksum(data.data(), data.size()))
        << data.size() << " bytes, offsets " << src_off << " / " << dst_off;
  }

  // The receiver's wait and check of the write of `seqno` (`bytes` at dst + dst_off).
  // `beside`: the check on the side stream (the default), or on the caller's stream.
  absl::Status WaitAndVerify(DevicePath& path, size_t dst_off, size_t bytes, uint64_t seqno,
                             uint64_t entry_seqno, bool beside = true) {
    const std::string label = absl::StrCat("test: payload of seqno ", seqno);
    absl::Status s = path.EnqueueWait(bell_.as<uint64_t>(), seqno, absl::Seconds(5), label, stream_);
    if (!s.ok()) return s;
    s = path.EnqueueVerify(dst_.as<uint8_t>() + dst_off, bytes,
                           entries_.as<ChecksumEntry>() + entry_seqno % kChecksumRing, seqno, label, stream_,
                           beside);
    if (!s.ok()) return s;
    return path.Sync(stream_, absl::Now() + absl::Seconds(10), nullptr);
  }

  cudaStream_t stream_ = nullptr;
  Device src_{kMaxBytes + 16}, dst_{kMaxBytes + 16}, bell_{8},
      entries_{kChecksumRing * sizeof(ChecksumEntry)};
};

std::vector<uint8_t> Random(std::mt19937_64& rng, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST_F(DevicePathChecksum, WriteKernelMatchesTheCpuReferenceAndTheCheckPasses) {
  auto path = DevicePath::Create(0);
  ASSERT_TRUE(path.ok()) << path.status();
  CUDA_ASSERT_OK(cudaMemset(bell_.p, 0, 8));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  std::mt19937_64 rng(20261129);
  // Edge sizes around words and vectors, then random sizes up to a few MiB; random alignments.
  std::vector<size_t> sizes = {0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4096, 8191, 8193, 65536 + 5};
  for (int i = 0; i < 24; ++i) sizes.push_back(rng() % kMaxBytes);
  uint64_t seqno = 0;
  for (size_t bytes : sizes) {
    for (int align = 0; align < 2; ++align) {
      const size_t src_off = align == 0 ? 0 : rng() % 16, dst_off = align == 0 ? 0 : rng() % 16;
      const std::vector<uint8_t> data = Random(rng, bytes);
      ++seqno;
      WriteAndCheck(**path, data, src_off, dst_off, seqno);
      if (HasFatalFailure()) return;
      const absl::Status s = WaitAndVerify(**path, dst_off, bytes, seqno, seqno, align == 0);
      ASSERT_TRUE(s.ok()) << bytes << " bytes: " << s;
    }
  }
}

TEST_F(DevicePathChecksum, OneFlippedBitAnywhereIsDataLossNamingTheWait) {
  std::mt19937_64 rng(7);
  uint64_t seqno = 0;
  for (int round = 0; round < 12; ++round) {
    auto path = DevicePath::Create(0);  // a failed path stays failed: a fresh one per round
    ASSERT_TRUE(path.ok()) << path.status();
    CUDA_ASSERT_OK(cudaMemset(bell_.p, 0, 8));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    seqno = 0;
    const size_t bytes = 1 + rng() % kMaxBytes;
    const size_t dst_off = rng() % 16;
    const std::vector<uint8_t> data = Random(rng, bytes);
    ++seqno;
    WriteAndCheck(**path, data, rng() % 16, dst_off, seqno);
    if (HasFatalFailure()) return;
    // One bit of one byte changes after the write, as a late or stray write would change it.
    const size_t at = rng() % bytes;
    const uint8_t flipped = data[at] ^ static_cast<uint8_t>(1u << (rng() % 8));
    CUDA_ASSERT_OK(cudaMemcpy(dst_.as<uint8_t>() + dst_off + at, &flipped, 1, cudaMemcpyHostToDevice));
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    // Even rounds check beside the caller's stream, odd ones on it.
    const absl::Status s = WaitAndVerify(**path, dst_off, bytes, seqno, seqno, round % 2 == 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << bytes << " bytes, byte " << at << ": " << s;
    EXPECT_NE(std::string(s.message()).find("test: payload of seqno 1"), std::string::npos) << s;
    EXPECT_NE(std::string(s.message()).find("checksum does not match"), std::string::npos) << s;
    // The path stays failed: later work says so at once.
    EXPECT_EQ(WaitAndVerify(**path, dst_off, bytes, seqno, seqno).code(),
              absl::StatusCode::kFailedPrecondition);
  }
}

TEST_F(DevicePathChecksum, AnEntryOfAnotherSeqnoIsDataLoss) {
  auto path = DevicePath::Create(0);
  ASSERT_TRUE(path.ok()) << path.status();
  CUDA_ASSERT_OK(cudaMemset(bell_.p, 0, 8));
  std::mt19937_64 rng(11);
  const std::vector<uint8_t> data = Random(rng, 65536);
  WriteAndCheck(**path, data, 0, 0, 3);
  if (HasFatalFailure()) return;
  // The write of seqno 3 + ring would use the same entry: checking seqno 3 + ring finds seqno 3's.
  CUDA_ASSERT_OK(cudaMemset(bell_.p, 0xff, 8));  // the wait passes at once
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const absl::Status s = WaitAndVerify(**path, 0, data.size(), 3 + kChecksumRing, 3 + kChecksumRing);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(std::string(s.message()).find("its entry holds seqno 3"), std::string::npos) << s;
}

TEST_F(DevicePathChecksum, NoCheckAfterAnExpiredWait) {
  auto path = DevicePath::Create(0);
  ASSERT_TRUE(path.ok()) << path.status();
  CUDA_ASSERT_OK(cudaMemset(bell_.p, 0, 8));
  CUDA_ASSERT_OK(cudaMemset(entries_.p, 0, kChecksumRing * sizeof(ChecksumEntry)));
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  // Nothing is written: the wait expires and the check after it is skipped, so the error is the
  // wait's, not a checksum's.
  const std::string label = "test: never written";
  ASSERT_TRUE((*path)->EnqueueWait(bell_.as<uint64_t>(), 1, absl::Milliseconds(100), label, stream_).ok());
  ASSERT_TRUE((*path)->EnqueueVerify(dst_.p, 4096, entries_.as<ChecksumEntry>() + 1, 1, label, stream_).ok());
  const absl::Status s = (*path)->Sync(stream_, absl::Now() + absl::Seconds(10), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(std::string(s.message()).find(label), std::string::npos) << s;
}

}  // namespace
}  // namespace tandem::transport
