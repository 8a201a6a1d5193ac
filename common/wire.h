// Wire formats of the disaggregated runtime (DESIGN.md, "Per-step control, per-layer data"):
// the step plan the controller sends once per step to every rank, and the header that precedes
// each per-layer payload between compute and memory ranks.
//
// Every value is written byte by byte, little-endian, at a fixed offset: no struct is copied to
// the wire, so the layout depends on neither padding nor host byte order. Floats travel as their
// IEEE-754 binary32 bit pattern. Booleans are one byte, 0 or 1. Reserved bytes are written as 0
// and must read as 0.
//
// Frame (both formats): a 16-byte frame header, then the body.
//
//   offset  size  field         notes
//   ------  ----  ------------  ----------------------------------------------------------------
//        0     4  magic         bytes 'T','D','S','P' (step plan) or 'T','D','L','M' (layer
//                               message header), in this order: u32 LE 0x50534454 / 0x4d4c4454
//        4     2  version       u16, kWireVersion (1); a newer one decodes as Unimplemented
//        6     2  header_bytes  u16, size of this frame header: 16 in version 1
//        8     4  body_bytes    u32, bytes that follow the frame header; the frame ends there
//       12     4  body_crc32c   u32, Crc32c() of the body bytes
//
// Step plan body (body_bytes = 16 + 56 * request_count):
//
//   offset  size  field          notes
//   ------  ----  -------------  ---------------------------------------------------------------
//        0     8  step_id        u64
//        8     4  request_count  u32
//       12     4  reserved       must be 0
//       16  56*n  requests[n]    StepRequest records, each laid out as below (offsets relative)
//
//   StepRequest record (56 bytes):
//        0     8  request_id     u64
//        8     8  seed           u64  sampling seed
//       16     8  counter        u64  sampling counter: index of the token this step draws
//       24     4  prefix_group   i32  -1: none, else >= 0
//       28     4  position       i32  >= 0, first position of this step's rows
//       32     4  q_len          i32  >= 1, rows of this request in this step
//       36     4  kv_len         i32  >= q_len, context length after this step;
//                                     position + q_len <= kv_len
//       40     4  temperature    f32  finite, >= 0 (0: greedy)
//       44     4  top_k          i32  >= 0 (0: no top-k cut)
//       48     4  top_p          f32  in (0, 1]
//       52     2  memory_rank    u16  rank that owns the request's KV cache
//       54     1  sample         u8   0 or 1: the request's last row produces a token
//       55     1  reserved       must be 0
//
// Layer message header body (48 bytes; a whole frame is 64 bytes):
//
//   offset  size  field           notes
//   ------  ----  --------------  --------------------------------------------------------------
//        0     8  step_id         u64
//        8     8  seqno           u64  doorbell sequence number of this message
//       16     8  payload_bytes   u64  == rows * row_bytes (computed in 64 bits: cannot overflow)
//       24     4  layer           u32
//       28     4  rows            u32
//       32     4  row_bytes       u32  a multiple of DTypeSize(dtype)
//       36     4  payload_crc32c  u32  Crc32c() of the payload that follows the frame
//       40     1  kind            u8   LayerMessageKind: 1 (kQkv) or 2 (kAttnOut)
//       41     1  dtype           u8   tandem::DType: 0 (f32), 1 (f16), 2 (bf16)
//       42     6  reserved        must be 0
//
// Decoders trust nothing: they never read past the span, check every length before reading,
// bound the request count by the body length before allocating, and check every field's range.
// Errors (messages start with "step plan: " or "layer message header: " and name the field with
// its request index or byte offset):
//   DataLoss         the span is shorter than the frame or the body shorter than its contents
//                    claim (truncation), or a crc mismatch
//   InvalidArgument  wrong magic, version 0, wrong header_bytes, a field out of range, a reserved
//                    byte not 0, or bytes after the frame (the span must hold exactly one frame)
//   Unimplemented    a version newer than kWireVersion
//
// Thread safety: all functions are pure and may be called concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace tandem {

inline constexpr uint16_t kWireVersion = 1;
inline constexpr uint32_t kStepPlanMagic = 0x50534454;      // "TDSP" on the wire
inline constexpr uint32_t kLayerMessageMagic = 0x4d4c4454;  // "TDLM" on the wire
inline constexpr size_t kFrameHeaderBytes = 16;
inline constexpr size_t kStepPlanFixedBytes = 16;     // step plan body before the requests
inline constexpr size_t kStepRequestBytes = 56;       // one StepRequest record
inline constexpr size_t kLayerMessageBodyBytes = 48;  // layer message header body

// One request's share of a step.
struct StepRequest {
  uint64_t request_id = 0;
  uint16_t memory_rank = 0;   // rank that owns the request's KV cache
  int32_t prefix_group = -1;  // -1: none
  int32_t position = 0;       // first position of this step's rows, >= 0
  int32_t q_len = 1;          // rows in this step, >= 1
  int32_t kv_len = 1;         // context length after this step, >= position + q_len
  bool sample = false;        // the last row produces a token
  // Sampling parameters (meaningful when `sample`, validated always).
  float temperature = 0.0f;  // finite, >= 0; 0 is greedy
  int32_t top_k = 0;         // >= 0; 0 is no top-k cut
  float top_p = 1.0f;        // in (0, 1]
  uint64_t seed = 0;
  uint64_t counter = 0;

  friend bool operator==(const StepRequest&, const StepRequest&) = default;
};

// Sent once per step by the controller to every rank.
struct StepPlan {
  uint64_t step_id = 0;
  std::vector<StepRequest> requests;

  friend bool operator==(const StepPlan&, const StepPlan&) = default;
};

enum class LayerMessageKind : uint8_t { kQkv = 1, kAttnOut = 2 };

// Precedes each per-layer payload between compute and memory ranks.
struct LayerMessageHeader {
  uint64_t step_id = 0;
  uint32_t layer = 0;
  LayerMessageKind kind = LayerMessageKind::kQkv;
  DType dtype = DType::kF32;
  uint32_t rows = 0;
  uint32_t row_bytes = 0;  // a multiple of DTypeSize(dtype)
  uint64_t seqno = 0;
  uint64_t payload_bytes = 0;  // == rows * row_bytes
  uint32_t payload_crc32c = 0;

  friend bool operator==(const LayerMessageHeader&, const LayerMessageHeader&) = default;
};

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final xor 0xFFFFFFFF), in
// software. Crc32c("123456789") == 0xE3069283.
uint32_t Crc32c(absl::Span<const uint8_t> data);
// Continues a CRC-32C: Crc32cExtend(Crc32c(a), b) == Crc32c(a followed by b); Crc32cExtend(0, a)
// == Crc32c(a).
uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data);

// Checks every field range listed in the table above; the error is InvalidArgument and names the
// request index and field, e.g. "step plan: request 3: q_len 0 must be >= 1".
absl::Status ValidateStepPlan(const StepPlan& plan);
absl::Status ValidateLayerMessageHeader(const LayerMessageHeader& header);

// Encoders write any value as given (they do not validate; a plan that ValidateStepPlan rejects
// encodes to a frame that DecodeStepPlan rejects). EncodeStepPlan aborts if the body would not
// fit in body_bytes' 32 bits (more than ~76 million requests): a programmer error.
std::vector<uint8_t> EncodeStepPlan(const StepPlan& plan);
std::vector<uint8_t> EncodeLayerMessageHeader(const LayerMessageHeader& header);

// `frame` must hold exactly one frame (no trailing bytes). An OK result re-encodes to `frame`.
absl::StatusOr<StepPlan> DecodeStepPlan(absl::Span<const uint8_t> frame);
absl::StatusOr<LayerMessageHeader> DecodeLayerMessageHeader(absl::Span<const uint8_t> frame);

}  // namespace tandem
