#include "common/layer_message.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

std::vector<uint8_t> MakeLayerMessageHeader(const LayerMessageExpect& what, absl::Span<const uint8_t> payload,
                                            bool checksum) {
  LayerMessageHeader h;
  h.step_id = what.step_id;
  h.layer = what.layer;
  h.kind = what.kind;
  h.dtype = what.dtype;
  h.rows = what.rows;
  h.row_bytes = what.row_bytes;
  h.seqno = what.seqno;
  h.payload_bytes = payload.size();
  h.payload_crc32c = checksum ? Crc32c(payload) : 0;
  return EncodeLayerMessageHeader(h);
}

absl::StatusOr<absl::Span<const uint8_t>> ReadLayerMessage(absl::Span<const uint8_t> buffer,
                                                           const LayerMessageExpect& e) {
  if (buffer.size() < kLayerMessageHeaderFrameBytes) {
    return absl::InternalError("layer message: receive buffer smaller than a header");
  }
  ASSIGN_OR_RETURN(const LayerMessageHeader h,
                   DecodeLayerMessageHeader(buffer.subspan(0, kLayerMessageHeaderFrameBytes)));
  auto mismatch = [](const char* field, uint64_t got, uint64_t want) {
    return absl::InvalidArgumentError(absl::StrCat("layer message: ", field, " ", got, ", expected ", want));
  };
  if (h.step_id != e.step_id) return mismatch("step_id", h.step_id, e.step_id);
  if (h.layer != e.layer) return mismatch("layer", h.layer, e.layer);
  if (h.kind != e.kind) return mismatch("kind", static_cast<uint64_t>(h.kind), static_cast<uint64_t>(e.kind));
  if (h.dtype != e.dtype)
    return mismatch("dtype", static_cast<uint64_t>(h.dtype), static_cast<uint64_t>(e.dtype));
  if (h.rows != e.rows) return mismatch("rows", h.rows, e.rows);
  if (h.row_bytes != e.row_bytes) return mismatch("row_bytes", h.row_bytes, e.row_bytes);
  if (h.seqno != e.seqno) return mismatch("seqno", h.seqno, e.seqno);
  if (h.payload_bytes > buffer.size() - kLayerMessageHeaderFrameBytes) {
    return absl::DataLossError(absl::StrCat("layer message: payload of ", h.payload_bytes,
                                            " bytes does not fit the receive buffer"));
  }
  const absl::Span<const uint8_t> payload = buffer.subspan(kLayerMessageHeaderFrameBytes, h.payload_bytes);
  if (e.verify_checksum && Crc32c(payload) != h.payload_crc32c) {
    return absl::DataLossError(absl::StrCat("layer message: payload crc32c mismatch (step ", h.step_id,
                                            ", layer ", h.layer, ", ", h.payload_bytes, " bytes)"));
  }
  return payload;
}

}  // namespace tandem
