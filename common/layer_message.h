// A per-layer message in a receive buffer: the 64-byte layer message header frame
// (common/wire.h) at offset 0, then the payload (rows × row_bytes). Both ranks write messages
// with MakeLayerMessage and read them with ReadLayerMessage, which checks the header against
// what the step expects before the payload is used.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/wire.h"

namespace tandem {

inline constexpr size_t kLayerMessageHeaderFrameBytes = kFrameHeaderBytes + kLayerMessageBodyBytes;  // 64

// pipeline.q_first: where the k,v message of a layer starts in a receive buffer whose q message
// (header frame, then up to `max_rows` rows of `q_row_bytes`) starts at 0. Both sides compute it
// from the hello (max_tokens_per_step, the rank's q width); the buffer then needs
// QFirstKvOffset + kLayerMessageHeaderFrameBytes + max_rows × (k,v row bytes).
inline constexpr size_t QFirstKvOffset(size_t max_rows, size_t q_row_bytes) {
  return kLayerMessageHeaderFrameBytes + max_rows * q_row_bytes;
}

// What the receiver expects of the next message.
struct LayerMessageExpect {
  uint64_t step_id = 0;
  uint32_t layer = 0;
  LayerMessageKind kind = LayerMessageKind::kQkv;
  DType dtype = DType::kF32;
  uint32_t rows = 0;
  uint32_t row_bytes = 0;
  uint64_t seqno = 0;
  bool verify_checksum = true;  // check payload_crc32c
};

// The header frame for `payload` (crc computed when `checksum`, else 0).
std::vector<uint8_t> MakeLayerMessageHeader(const LayerMessageExpect& what, absl::Span<const uint8_t> payload,
                                            bool checksum);
// Decodes the header at the start of `buffer`, checks every field against `expect` and that the
// payload fits in the buffer, verifies the payload crc if asked, and returns the payload.
// DataLoss / InvalidArgument naming the field ("layer message: layer 3, expected 4").
absl::StatusOr<absl::Span<const uint8_t>> ReadLayerMessage(absl::Span<const uint8_t> buffer,
                                                           const LayerMessageExpect& expect);

}  // namespace tandem
