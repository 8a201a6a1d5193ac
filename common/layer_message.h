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
