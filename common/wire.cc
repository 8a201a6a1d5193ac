#include "common/wire.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"

namespace tandem {
namespace {

constexpr std::array<uint32_t, 256> MakeCrc32cTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = MakeCrc32cTable();

// Appends little-endian values to a byte vector.
class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void F32(float v) { U32(std::bit_cast<uint32_t>(v)); }
  void Zeros(size_t n) { out_->insert(out_->end(), n, 0); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_->push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t>* out_;
};

// Reads little-endian values; every read checks the remaining length first. `base` is the byte
// offset of data[0] in the frame, so errors name frame offsets.
class Reader {
 public:
  Reader(absl::Span<const uint8_t> data, size_t base, std::string_view what)
      : data_(data), base_(base), what_(what) {}

  size_t offset() const { return base_ + pos_; }
  size_t remaining() const { return data_.size() - pos_; }

  absl::StatusOr<uint64_t> Le(std::string_view field, int n) {
    if (remaining() < static_cast<size_t>(n)) {
      return absl::DataLossError(absl::StrCat(ToAbsl(what_), ": truncated: ", ToAbsl(field), " needs ", n,
                                              " bytes at byte offset ", offset(), " but ", remaining(),
                                              " remain"));
    }
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<uint64_t>(data_[pos_ + i]) << (8 * i);
    pos_ += n;
    return v;
  }
  absl::StatusOr<uint8_t> U8(std::string_view f) {
    ASSIGN_OR_RETURN(uint64_t v, Le(f, 1));
    return static_cast<uint8_t>(v);
  }
  absl::StatusOr<uint16_t> U16(std::string_view f) {
    ASSIGN_OR_RETURN(uint64_t v, Le(f, 2));
    return static_cast<uint16_t>(v);
  }
  absl::StatusOr<uint32_t> U32(std::string_view f) {
    ASSIGN_OR_RETURN(uint64_t v, Le(f, 4));
    return static_cast<uint32_t>(v);
  }
  absl::StatusOr<uint64_t> U64(std::string_view f) { return Le(f, 8); }
  absl::StatusOr<int32_t> I32(std::string_view f) {
    ASSIGN_OR_RETURN(uint32_t v, U32(f));
    return static_cast<int32_t>(v);
  }
  absl::StatusOr<float> F32(std::string_view f) {
    ASSIGN_OR_RETURN(uint32_t v, U32(f));
    return std::bit_cast<float>(v);
  }
  // Reads `n` reserved bytes; each must be 0.
  absl::Status Reserved(std::string_view field, int n) {
    for (int i = 0; i < n; ++i) {
      const size_t at = offset();
      ASSIGN_OR_RETURN(uint8_t b, U8(field));
      if (b != 0) {
        return absl::InvalidArgumentError(absl::StrCat(ToAbsl(what_), ": ", ToAbsl(field), " at byte offset ",
                                                       at, " is ", b, ", must be 0"));
      }
    }
    return absl::OkStatus();
  }

 private:
  absl::Span<const uint8_t> data_;
  size_t base_;
  size_t pos_ = 0;
  std::string_view what_;
};

std::string MagicText(uint32_t magic) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>(magic >> (8 * i));
    s += (c >= 0x20 && c < 0x7f) ? c : '.';
  }
  return s;
}

// Wraps `body` in a frame header.
std::vector<uint8_t> Frame(uint32_t magic, const std::vector<uint8_t>& body) {
  TANDEM_CHECK_MSG(body.size() <= std::numeric_limits<uint32_t>::max(), "wire frame body of ", body.size(),
                   " bytes does not fit in 32 bits");
  std::vector<uint8_t> out;
  out.reserve(kFrameHeaderBytes + body.size());
  Writer w(&out);
  w.U32(magic);
  w.U16(kWireVersion);
  w.U16(static_cast<uint16_t>(kFrameHeaderBytes));
  w.U32(static_cast<uint32_t>(body.size()));
  w.U32(Crc32c(body));
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

// Checks the frame header and the body crc; returns the body.
absl::StatusOr<absl::Span<const uint8_t>> Unframe(absl::Span<const uint8_t> frame, uint32_t want_magic,
                                                  std::string_view what) {
  Reader r(frame.subspan(0, std::min(frame.size(), kFrameHeaderBytes)), 0, what);
  ASSIGN_OR_RETURN(uint32_t magic, r.U32("magic"));
  if (magic != want_magic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: magic 0x%08x ('%s') at byte offset 0 is not 0x%08x ('%s')", ToAbsl(what), magic,
                        MagicText(magic), want_magic, MagicText(want_magic)));
  }
  ASSIGN_OR_RETURN(uint16_t version, r.U16("version"));
  if (version > kWireVersion) {
    return absl::UnimplementedError(absl::StrCat(ToAbsl(what), ": version ", version,
                                                 " is newer than the supported version ", kWireVersion));
  }
  if (version == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        ToAbsl(what), ": version 0 at byte offset 4 is invalid (supported: ", kWireVersion, ")"));
  }
  ASSIGN_OR_RETURN(uint16_t header_bytes, r.U16("header_bytes"));
  if (header_bytes != kFrameHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(what), ": header_bytes ", header_bytes,
                                                   " at byte offset 6 must be ", kFrameHeaderBytes,
                                                   " in version ", version));
  }
  ASSIGN_OR_RETURN(uint32_t body_bytes, r.U32("body_bytes"));
  ASSIGN_OR_RETURN(uint32_t body_crc, r.U32("body_crc32c"));
  const size_t have = frame.size() - kFrameHeaderBytes;
  if (have < body_bytes) {
    return absl::DataLossError(absl::StrCat(ToAbsl(what), ": truncated: body_bytes is ", body_bytes, " but ",
                                            have, " bytes follow the frame header"));
  }
  if (have > body_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(what), ": ", have - body_bytes,
                                                   " trailing bytes after the frame at byte offset ",
                                                   kFrameHeaderBytes + body_bytes));
  }
  absl::Span<const uint8_t> body = frame.subspan(kFrameHeaderBytes);
  const uint32_t crc = Crc32c(body);
  if (crc != body_crc) {
    return absl::DataLossError(absl::StrFormat("%s: body crc32c 0x%08x does not match body_crc32c 0x%08x",
                                               ToAbsl(what), crc, body_crc));
  }
  return body;
}

absl::Status ValidateRequest(const StepRequest& q, size_t i) {
  auto bad = [i](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: request ", i, ": ", parts...));
  };
  if (q.prefix_group < -1) return bad("prefix_group ", q.prefix_group, " must be -1 (none) or >= 0");
  if (q.position < 0) return bad("position ", q.position, " must be >= 0");
  if (q.q_len < 1) return bad("q_len ", q.q_len, " must be >= 1");
  if (q.kv_len < q.q_len) return bad("kv_len ", q.kv_len, " must be >= q_len ", q.q_len);
  if (static_cast<int64_t>(q.position) + q.q_len > q.kv_len) {
    return bad("position ", q.position, " + q_len ", q.q_len, " must be <= kv_len ", q.kv_len);
  }
  if (!std::isfinite(q.temperature) || !(q.temperature >= 0.0f)) {
    return bad("temperature ", q.temperature, " must be finite and >= 0");
  }
  if (q.top_k < 0) return bad("top_k ", q.top_k, " must be >= 0");
  if (!(q.top_p > 0.0f && q.top_p <= 1.0f)) return bad("top_p ", q.top_p, " must be in (0, 1]");
  return absl::OkStatus();
}

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data) {
  crc = ~crc;
  for (uint8_t b : data) crc = kCrc32cTable[(crc ^ b) & 0xffu] ^ (crc >> 8);
  return ~crc;
}

uint32_t Crc32c(absl::Span<const uint8_t> data) { return Crc32cExtend(0, data); }

absl::Status ValidateStepPlan(const StepPlan& plan) {
  for (size_t i = 0; i < plan.requests.size(); ++i) RETURN_IF_ERROR(ValidateRequest(plan.requests[i], i));
  return absl::OkStatus();
}

absl::Status ValidateLayerMessageHeader(const LayerMessageHeader& h) {
  const auto kind = static_cast<uint8_t>(h.kind);
  if (kind != static_cast<uint8_t>(LayerMessageKind::kQkv) &&
      kind != static_cast<uint8_t>(LayerMessageKind::kAttnOut)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer message header: kind ", kind, " must be 1 (qkv) or 2 (attn_out)"));
  }
  const auto dtype = static_cast<uint8_t>(h.dtype);
  if (dtype > static_cast<uint8_t>(DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer message header: dtype ", dtype, " must be 0 (f32), 1 (f16) or 2 (bf16)"));
  }
  if (h.row_bytes % DTypeSize(h.dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("layer message header: row_bytes ", h.row_bytes,
                                                   " must be a multiple of ", DTypeSize(h.dtype), " (",
                                                   ToAbsl(DTypeName(h.dtype)), ")"));
  }
  // Both factors are u32, so the product fits in u64.
  const uint64_t want = static_cast<uint64_t>(h.rows) * h.row_bytes;
  if (h.payload_bytes != want) {
    return absl::InvalidArgumentError(absl::StrCat("layer message header: payload_bytes ", h.payload_bytes,
                                                   " must equal rows ", h.rows, " * row_bytes ", h.row_bytes,
                                                   " = ", want));
  }
  return absl::OkStatus();
}

std::vector<uint8_t> EncodeStepPlan(const StepPlan& plan) {
  TANDEM_CHECK_MSG(plan.requests.size() <=
                       (std::numeric_limits<uint32_t>::max() - kStepPlanFixedBytes) / kStepRequestBytes,
                   "step plan of ", plan.requests.size(), " requests does not fit in one frame");
  std::vector<uint8_t> body;
  body.reserve(kStepPlanFixedBytes + kStepRequestBytes * plan.requests.size());
  Writer w(&body);
  w.U64(plan.step_id);
  w.U32(static_cast<uint32_t>(plan.requests.size()));
  w.Zeros(4);
  for (const StepRequest& q : plan.requests) {
    w.U64(q.request_id);
    w.U64(q.seed);
    w.U64(q.counter);
    w.I32(q.prefix_group);
    w.I32(q.position);
    w.I32(q.q_len);
    w.I32(q.kv_len);
    w.F32(q.temperature);
    w.I32(q.top_k);
    w.F32(q.top_p);
    w.U16(q.memory_rank);
    w.U8(q.sample ? 1 : 0);
    w.Zeros(1);
  }
  return Frame(kStepPlanMagic, body);
}

absl::StatusOr<StepPlan> DecodeStepPlan(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "step plan";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kStepPlanMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  StepPlan plan;
  ASSIGN_OR_RETURN(plan.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(uint32_t count, r.U32("request_count"));
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  // Bound the count by the bytes present before allocating anything for it.
  const uint64_t need = static_cast<uint64_t>(count) * kStepRequestBytes;
  if (need > r.remaining()) {
    return absl::DataLossError(absl::StrCat("step plan: truncated: request_count ", count, " needs ", need,
                                            " bytes of requests at byte offset ", r.offset(), " but ",
                                            r.remaining(), " remain"));
  }
  if (need < r.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: request_count ", count, " leaves ",
                                                   r.remaining() - need, " unused body bytes at byte offset ",
                                                   r.offset() + need));
  }
  plan.requests.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    StepRequest& q = plan.requests[i];
    ASSIGN_OR_RETURN(q.request_id, r.U64("request_id"));
    ASSIGN_OR_RETURN(q.seed, r.U64("seed"));
    ASSIGN_OR_RETURN(q.counter, r.U64("counter"));
    ASSIGN_OR_RETURN(q.prefix_group, r.I32("prefix_group"));
    ASSIGN_OR_RETURN(q.position, r.I32("position"));
    ASSIGN_OR_RETURN(q.q_len, r.I32("q_len"));
    ASSIGN_OR_RETURN(q.kv_len, r.I32("kv_len"));
    ASSIGN_OR_RETURN(q.temperature, r.F32("temperature"));
    ASSIGN_OR_RETURN(q.top_k, r.I32("top_k"));
    ASSIGN_OR_RETURN(q.top_p, r.F32("top_p"));
    ASSIGN_OR_RETURN(q.memory_rank, r.U16("memory_rank"));
    const size_t sample_at = r.offset();
    ASSIGN_OR_RETURN(uint8_t sample, r.U8("sample"));
    if (sample > 1) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: request ", i, ": sample ", sample,
                                                     " at byte offset ", sample_at, " must be 0 or 1"));
    }
    q.sample = sample == 1;
    RETURN_IF_ERROR(r.Reserved(absl::StrCat("request ", i, ": reserved"), 1));
    RETURN_IF_ERROR(ValidateRequest(q, i));
  }
  return plan;
}

std::vector<uint8_t> EncodeLayerMessageHeader(const LayerMessageHeader& h) {
  std::vector<uint8_t> body;
  body.reserve(kLayerMessageBodyBytes);
  Writer w(&body);
  w.U64(h.step_id);
  w.U64(h.seqno);
  w.U64(h.payload_bytes);
  w.U32(h.layer);
  w.U32(h.rows);
  w.U32(h.row_bytes);
  w.U32(h.payload_crc32c);
  w.U8(static_cast<uint8_t>(h.kind));
  w.U8(static_cast<uint8_t>(h.dtype));
  w.Zeros(6);
  return Frame(kLayerMessageMagic, body);
}

absl::StatusOr<LayerMessageHeader> DecodeLayerMessageHeader(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "layer message header";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kLayerMessageMagic, kWhat));
  if (body.size() != kLayerMessageBodyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("layer message header: body_bytes ", body.size(),
                                                   " at byte offset 8 must be ", kLayerMessageBodyBytes));
  }
  Reader r(body, kFrameHeaderBytes, kWhat);
  LayerMessageHeader h;
  ASSIGN_OR_RETURN(h.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(h.seqno, r.U64("seqno"));
  ASSIGN_OR_RETURN(h.payload_bytes, r.U64("payload_bytes"));
  ASSIGN_OR_RETURN(h.layer, r.U32("layer"));
  ASSIGN_OR_RETURN(h.rows, r.U32("rows"));
  ASSIGN_OR_RETURN(h.row_bytes, r.U32("row_bytes"));
  ASSIGN_OR_RETURN(h.payload_crc32c, r.U32("payload_crc32c"));
  ASSIGN_OR_RETURN(uint8_t kind, r.U8("kind"));
  ASSIGN_OR_RETURN(uint8_t dtype, r.U8("dtype"));
  RETURN_IF_ERROR(r.Reserved("reserved", 6));
  // Enum values are checked before any use of them as enums (DTypeSize, DTypeName).
  h.kind = static_cast<LayerMessageKind>(kind);
  h.dtype = static_cast<DType>(dtype);
  RETURN_IF_ERROR(ValidateLayerMessageHeader(h));
  return h;
}

}  // namespace tandem
