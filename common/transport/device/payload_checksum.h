// The 64-bit checksum of a device-path payload (docs/architecture.md, "Transports"): computed by
// the writer's copy kernel as it moves the bytes, stored beside the receiver's doorbell with the
// seqno it belongs to, and recomputed by the receiver over what landed before the stream goes on
// (device_path.h). Host and device code; this header is also the CPU reference of the kernels.
//
// The payload is read as 8-byte little-endian words (the last one zero-padded). Word i adds
// Mix(word + i * kChecksumStride) to a sum modulo 2^64, and the sum ends with Mix of the length.
// Mix (the SplitMix64 finaliser) is a bijection and the stride is odd, so for a fixed position
// the term is a bijection of the word: a payload that differs from the one sent in exactly one
// word always gets a different checksum; words moved to other positions, or several words
// changed, collide with probability about 2^-64. A sum, unlike a CRC, can be accumulated by
// thousands of threads in any order, so it costs the copy kernel one extra add per word and one
// atomic per block.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define TANDEM_CHECKSUM_FN __host__ __device__ __forceinline__
#else
#define TANDEM_CHECKSUM_FN inline
#endif

namespace tandem::transport {

constexpr uint64_t kChecksumStride = 0x9e3779b97f4a7c15ull;  // odd

TANDEM_CHECKSUM_FN uint64_t ChecksumMix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The term of word `index` (bytes [8 * index, 8 * index + 8) of the payload).
TANDEM_CHECKSUM_FN uint64_t ChecksumTerm(uint64_t index, uint64_t word) {
  return ChecksumMix(word + index * kChecksumStride);
}

// The checksum from the sum of every word's term.
TANDEM_CHECKSUM_FN uint64_t ChecksumFinish(uint64_t sum, uint64_t bytes) { return sum + ChecksumMix(~bytes); }

// The CPU reference: the checksum of `bytes` bytes at `data` (host memory).
inline uint64_t PayloadChecksum(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t sum = 0;
  for (size_t w = 0; w * 8 < bytes; ++w) {
    uint64_t word = 0;
    for (size_t b = 0; b < 8 && w * 8 + b < bytes; ++b)
      word |= static_cast<uint64_t>(p[w * 8 + b]) << (8 * b);
    sum += ChecksumTerm(w, word);
  }
  return ChecksumFinish(sum, bytes);
}

// Where a receiver finds a payload's checksum: per buffer, a ring of kChecksumRing entries
// indexed by seqno, each {seqno, checksum}. A writer may run ahead of the reader's check by at
// most kChecksumRing - 1 writes to one buffer (a layer's request-reply keeps it at one or two);
// further, the entry holds a later seqno and the check reports that instead of a mismatch.
constexpr uint64_t kChecksumRing = 8;
struct ChecksumEntry {
  uint64_t seqno;
  uint64_t checksum;
};

}  // namespace tandem::transport
