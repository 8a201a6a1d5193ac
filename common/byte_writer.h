// Appends little-endian values to a byte vector: the encoders of our fixed wire layouts (step
// plans and control frames in common/wire.cc, the verbs transport's frames) write with it.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace tandem {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void F32(float v) { U32(std::bit_cast<uint32_t>(v)); }
  void F64(double v) { U64(std::bit_cast<uint64_t>(v)); }
  void Zeros(size_t n) { out_->insert(out_->end(), n, 0); }
  void Bytes(absl::Span<const uint8_t> b) { out_->insert(out_->end(), b.begin(), b.end()); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_->push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t>* out_;
};

}  // namespace tandem
