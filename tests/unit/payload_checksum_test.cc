// The device path's payload checksum (common/transport/device/payload_checksum.h), its CPU
// reference: what it promises to catch. Every single-bit flip of random payloads changes it, as do
// two words swapped, a byte appended (even a zero) or dropped, and the same words at another
// offset; equal payloads agree. The kernels are compared with this reference in
// tests/gpu/device_path_test.cc.
#include "common/transport/device/payload_checksum.h"

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::transport {
namespace {

std::vector<uint8_t> Random(std::mt19937_64& rng, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(PayloadChecksum, EverySingleBitFlipChangesIt) {
  std::mt19937_64 rng(1);
  for (size_t bytes : {1, 7, 8, 9, 24, 61}) {
    std::vector<uint8_t> v = Random(rng, bytes);
    const uint64_t base = PayloadChecksum(v.data(), v.size());
    EXPECT_EQ(base, PayloadChecksum(v.data(), v.size()));
    for (size_t bit = 0; bit < bytes * 8; ++bit) {
      v[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
      EXPECT_NE(PayloadChecksum(v.data(), v.size()), base) << bytes << " bytes, bit " << bit;
      v[bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    }
  }
}

TEST(PayloadChecksum, ChangedWordsOrderAndLengthChangeIt) {
  std::mt19937_64 rng(2);
  for (int round = 0; round < 200; ++round) {
    const size_t words = 2 + rng() % 64;
    std::vector<uint8_t> v = Random(rng, words * 8);
    const uint64_t base = PayloadChecksum(v.data(), v.size());
    // Two different words swapped.
    const size_t a = rng() % words, b = (a + 1 + rng() % (words - 1)) % words;
    std::vector<uint8_t> swapped = v;
    for (int i = 0; i < 8; ++i) std::swap(swapped[a * 8 + i], swapped[b * 8 + i]);
    if (swapped != v) {
      EXPECT_NE(PayloadChecksum(swapped.data(), swapped.size()), base);
    }
    // A zero byte appended, the last byte dropped.
    std::vector<uint8_t> longer = v;
    longer.push_back(0);
    EXPECT_NE(PayloadChecksum(longer.data(), longer.size()), base);
    EXPECT_NE(PayloadChecksum(v.data(), v.size() - 1), base);
    // The words moved by one word (a write at the wrong offset).
    std::vector<uint8_t> shifted(v.size(), 0);
    std::copy(v.begin(), v.end() - 8, shifted.begin() + 8);
    EXPECT_NE(PayloadChecksum(shifted.data(), shifted.size()), base);
    // Several random words changed.
    std::vector<uint8_t> changed = v;
    for (int k = 0; k < 3; ++k) changed[rng() % changed.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    if (changed != v) {
      EXPECT_NE(PayloadChecksum(changed.data(), changed.size()), base);
    }
  }
}

TEST(PayloadChecksum, EmptyPayloadHasAFixedChecksum) {
  EXPECT_EQ(PayloadChecksum(nullptr, 0), ChecksumFinish(0, 0));
  const uint8_t zero = 0;
  EXPECT_NE(PayloadChecksum(&zero, 1), PayloadChecksum(nullptr, 0));
}

}  // namespace
}  // namespace tandem::transport
