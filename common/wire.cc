#include "common/wire.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_writer.h"
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

using Writer = ByteWriter;

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
  absl::StatusOr<double> F64(std::string_view f) {
    ASSIGN_OR_RETURN(uint64_t v, U64(f));
    return std::bit_cast<double>(v);
  }
  // Returns the next `n` bytes.
  absl::StatusOr<absl::Span<const uint8_t>> Bytes(std::string_view field, size_t n) {
    if (remaining() < n) {
      return absl::DataLossError(absl::StrCat(ToAbsl(what_), ": truncated: ", ToAbsl(field), " needs ", n,
                                              " bytes at byte offset ", offset(), " but ", remaining(),
                                              " remain"));
    }
    absl::Span<const uint8_t> out = data_.subspan(pos_, n);
    pos_ += n;
    return out;
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
  if (version < kWireVersion) {
    // The ranks of a deployment run one build; an older peer's frames are refused, not guessed at.
    return absl::InvalidArgumentError(absl::StrCat(
        ToAbsl(what), ": version ", version, " at byte offset 4 is older than the supported version ",
        kWireVersion,
        " (versions 2 to 4 changed the hello, step plan and replica result layouts; 5 added the heartbeat; "
        "6 the rotational pipeline's hello field and messages; 7 the step discard; 8 the step plan's "
        "next-use records; 9 the evictions' tokens and the persisted blocks report; 10 the restores' "
        "segments and the hello's rope; 11 the step discard's lost memory ranks; 12 the hello's compute mask "
        "and the memory rejoin; 13 the head split and the step discard's drop)"));
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

// Checks that a fixed-size body has its size (the frame's body_bytes field is at byte offset 8).
absl::Status CheckBodySize(absl::Span<const uint8_t> body, size_t want, std::string_view what) {
  if (body.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(what), ": body_bytes ", body.size(), " at byte offset 8 must be ", want));
  }
  return absl::OkStatus();
}

// Checks that `needed` bytes of variable contents (named by `field` = `value`), which start at
// the reader's position, fill the rest of the body exactly. Called before anything is allocated
// for them.
absl::Status CheckRest(const Reader& r, uint64_t needed, std::string_view what, std::string_view field,
                       uint64_t value, std::string_view contents) {
  if (needed > r.remaining()) {
    return absl::DataLossError(absl::StrCat(
        ToAbsl(what), ": truncated: ", ToAbsl(field), " ", value, " needs ", needed, " bytes of ",
        ToAbsl(contents), " at byte offset ", r.offset(), " but ", r.remaining(), " remain"));
  }
  if (needed < r.remaining()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(what), ": ", ToAbsl(field), " ", value, " leaves ", r.remaining() - needed,
                     " unused body bytes at byte offset ", r.offset() + needed));
  }
  return absl::OkStatus();
}

absl::Status CheckDType(DType dtype, std::string_view what) {
  const auto v = static_cast<uint8_t>(dtype);
  if (v > static_cast<uint8_t>(DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(what), ": dtype ", v, " must be 0 (f32), 1 (f16) or 2 (bf16)"));
  }
  return absl::OkStatus();
}

// Reads a 0/1 byte.
absl::StatusOr<bool> ReadBool(Reader& r, std::string_view field, std::string_view what) {
  const size_t at = r.offset();
  ASSIGN_OR_RETURN(uint8_t v, r.U8(field));
  if (v > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(what), ": ", ToAbsl(field), " ", v, " at byte offset ", at, " must be 0 or 1"));
  }
  return v == 1;
}

absl::Status CheckNoNul(std::string_view s, std::string_view what, std::string_view field) {
  const size_t nul = s.find('\0');
  if (nul != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(what), ": ", ToAbsl(field), " has a NUL byte at index ", nul));
  }
  return absl::OkStatus();
}

constexpr uint32_t kMinStatusCode = 1;   // absl::StatusCode::kCancelled
constexpr uint32_t kMaxStatusCode = 16;  // absl::StatusCode::kUnauthenticated

// Reads the `n` reserved bytes of step plan record `index` (a `record`: "request", "group", ...);
// each must be 0. The field name is built only for an error.
absl::Status RecordReserved(Reader& r, std::string_view record, size_t index, int n) {
  const size_t at = r.offset();
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> bytes, r.Bytes("reserved", n));
  for (int k = 0; k < n; ++k) {
    if (bytes[k] != 0) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: ", ToAbsl(record), " ", index,
                                                     ": reserved at byte offset ", at + k, " is ", bytes[k],
                                                     ", must be 0"));
    }
  }
  return absl::OkStatus();
}

// A block hash as errors print it.
std::string Hash(uint64_t h) { return absl::StrFormat("0x%016x", h); }

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
  if (q.top_logprobs > kMaxTopLogprobs)
    return bad("top_logprobs ", int{q.top_logprobs}, " must be <= ", kMaxTopLogprobs);
  if (q.attach_hash != 0 && q.position < 1) {
    return bad("attach_hash ", Hash(q.attach_hash), " needs position > 0, not ", q.position,
               " (0: no attach)");
  }
  return absl::OkStatus();
}

// Checks group `i` of `groups` (its parent, an earlier group, already checked).
absl::Status ValidateGroup(absl::Span<const PrefixGroup> groups, size_t i) {
  const PrefixGroup& g = groups[i];
  auto bad = [i](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: group ", i, ": ", parts...));
  };
  if (g.prefix_tokens < 1) return bad("prefix_tokens ", g.prefix_tokens, " must be >= 1");
  if (g.parent < -1 || g.parent >= static_cast<int64_t>(i)) {
    return bad("parent ", g.parent, " must be -1 or < ", i);
  }
  if (g.parent >= 0) {
    const PrefixGroup& p = groups[g.parent];
    if (p.memory_rank != g.memory_rank) {
      return bad("memory_rank ", g.memory_rank, " must equal parent group ", g.parent, "'s memory_rank ",
                 p.memory_rank);
    }
    if (p.prefix_tokens >= g.prefix_tokens) {
      return bad("prefix_tokens ", g.prefix_tokens, " must be > parent group ", g.parent, "'s prefix_tokens ",
                 p.prefix_tokens);
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePublish(const PrefixPublish& p, size_t i) {
  auto bad = [i](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: publish ", i, ": ", parts...));
  };
  if (p.block_index < 0) return bad("block_index ", p.block_index, " must be >= 0");
  if (p.block_index == 0 && p.parent_hash != 0) {
    return bad("parent_hash ", Hash(p.parent_hash), " must be 0 when block_index is 0");
  }
  return absl::OkStatus();
}

// The first record (lowest index) whose (memory_rank, block_hash) an earlier record has:
// "<what> j: memory_rank r, block_hash h repeats <what> i". OK when there is none.
template <typename Record>
absl::Status CheckNoRepeatedBlocks(const std::vector<Record>& records, std::string_view what) {
  if (records.size() < 2) return absl::OkStatus();
  struct Key {
    uint16_t rank;
    uint64_t hash;
    size_t index;
  };
  std::vector<Key> keys(records.size());
  for (size_t i = 0; i < records.size(); ++i) keys[i] = {records[i].memory_rank, records[i].block_hash, i};
  auto less = [](const Key& a, const Key& b) {
    return std::tie(a.rank, a.hash, a.index) < std::tie(b.rank, b.hash, b.index);
  };
  std::sort(keys.begin(), keys.end(), less);
  // In each run of equal blocks, the second record repeats the first; report the earliest repeat.
  size_t first = 0, repeat = records.size();
  for (size_t k = 1; k < keys.size(); ++k) {
    if (keys[k].rank == keys[k - 1].rank && keys[k].hash == keys[k - 1].hash &&
        (k < 2 || keys[k - 2].rank != keys[k].rank || keys[k - 2].hash != keys[k].hash) &&
        keys[k].index < repeat) {
      first = keys[k - 1].index, repeat = keys[k].index;
    }
  }
  if (repeat == records.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("step plan: ", ToAbsl(what), " ", repeat, ": memory_rank ", records[repeat].memory_rank,
                   ", block_hash ", Hash(records[repeat].block_hash), " repeats ", ToAbsl(what), " ", first));
}

// The checks between records (each record's own fields already checked).
absl::Status ValidatePlanLinks(const StepPlan& plan) {
  for (size_t i = 0; i < plan.requests.size(); ++i) {
    const StepRequest& q = plan.requests[i];
    // Each rank's rows are one range of the step's rows, ranks in order: a GPU data path writes
    // rank m's outputs after the lower ranks' rows.
    if (i > 0 && q.memory_rank < plan.requests[i - 1].memory_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step plan: request ", i, ": memory_rank ", q.memory_rank, " after request ", i - 1,
          "'s memory_rank ", plan.requests[i - 1].memory_rank, " (requests go in memory rank order)"));
    }
    if (q.prefix_group == -1) continue;
    if (static_cast<uint64_t>(q.prefix_group) >= plan.groups.size()) {  // >= 0: ValidateRequest
      return absl::InvalidArgumentError(absl::StrCat("step plan: request ", i, ": prefix_group ",
                                                     q.prefix_group, " must be -1 (none) or < ",
                                                     plan.groups.size(), " (the group count)"));
    }
    const PrefixGroup& g = plan.groups[q.prefix_group];
    if (g.memory_rank != q.memory_rank) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: request ", i, ": memory_rank ",
                                                     q.memory_rank, " must equal group ", q.prefix_group,
                                                     "'s memory_rank ", g.memory_rank));
    }
  }
  if (!plan.publishes.empty()) {
    // (request_id, memory_rank) of every request, sorted, to look publishes up.
    std::vector<std::pair<uint64_t, uint16_t>> owners(plan.requests.size());
    for (size_t i = 0; i < plan.requests.size(); ++i) {
      owners[i] = {plan.requests[i].request_id, plan.requests[i].memory_rank};
    }
    std::sort(owners.begin(), owners.end());
    for (size_t i = 0; i < plan.publishes.size(); ++i) {
      const PrefixPublish& p = plan.publishes[i];
      const auto it = std::lower_bound(owners.begin(), owners.end(), std::pair(p.request_id, uint16_t{0}));
      if (it == owners.end() || it->first != p.request_id) {
        return absl::InvalidArgumentError(
            absl::StrCat("step plan: publish ", i, ": request ", p.request_id, " is not in the plan"));
      }
      if (!std::binary_search(owners.begin(), owners.end(), std::pair(p.request_id, p.memory_rank))) {
        return absl::InvalidArgumentError(absl::StrCat("step plan: publish ", i, ": memory_rank ",
                                                       p.memory_rank, " must equal request ", p.request_id,
                                                       "'s memory_rank ", it->second));
      }
    }
  }
  RETURN_IF_ERROR(CheckNoRepeatedBlocks(plan.publishes, "publish"));
  RETURN_IF_ERROR(CheckNoRepeatedBlocks(plan.evictions, "eviction"));
  for (size_t i = 0; i < plan.evictions.size(); ++i) {
    if (plan.evictions[i].tokens.size() > kMaxPrefixBlockTokens) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: eviction ", i, ": ",
                                                     plan.evictions[i].tokens.size(), " tokens, at most ",
                                                     kMaxPrefixBlockTokens));
    }
  }
  for (size_t i = 0; i < plan.restores.size(); ++i) {
    const PrefixRestore& e = plan.restores[i];
    if (e.block_hash == 0 || e.block_index < 0 || (e.block_index == 0) != (e.parent_hash == 0)) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: restore ", i, ": block_hash ", e.block_hash,
                                                     ", block_index ", e.block_index, ", parent_hash ",
                                                     e.parent_hash,
                                                     ": the hash must not be 0, block_index must be >= 0 and "
                                                     "parent_hash 0 exactly at block_index 0"));
    }
    if (e.segments.size() > kMaxPrefixSegments) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: restore ", i, ": ", e.segments.size(),
                                                     " segments, at most ", kMaxPrefixSegments));
    }
    for (size_t j = 0; j < e.segments.size(); ++j) {
      const PrefixSegment& g = e.segments[j];
      if (g.source_hash == 0 || g.source_index < 0 || g.rows < 1 ||
          g.source_row + g.rows > kMaxPrefixBlockTokens) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step plan: restore ", i, ": segment ", j, ": source_hash ", g.source_hash, ", source_index ",
            g.source_index, ", rows [", g.source_row, ", ", g.source_row + g.rows,
            "): the hash must not be 0, source_index must be >= 0 and the rows non-empty and below ",
            kMaxPrefixBlockTokens));
      }
    }
  }
  RETURN_IF_ERROR(CheckNoRepeatedBlocks(plan.restores, "restore"));
  if (plan.next_uses.size() > kMaxPrefixNextUses) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: ", plan.next_uses.size(),
                                                   " next-use records, at most ", kMaxPrefixNextUses));
  }
  if (!plan.next_uses.empty() && plan.micro_batch != 0) {
    return absl::InvalidArgumentError(absl::StrCat("step plan: micro_batch ", int{plan.micro_batch},
                                                   " carries next-use records (only micro-batch 0 may)"));
  }
  for (size_t i = 0; i < plan.next_uses.size(); ++i) {
    const PrefixNextUse& u = plan.next_uses[i];
    if (u.block_hash == 0 || u.next_use < 0) {
      return absl::InvalidArgumentError(absl::StrCat("step plan: next use ", i, ": block_hash ", u.block_hash,
                                                     ", next_use ", u.next_use,
                                                     ": the hash must not be 0 and next_use must be >= 0"));
    }
  }
  return CheckNoRepeatedBlocks(plan.next_uses, "next use");
}

}  // namespace

namespace {

uint32_t Crc32cSoftware(uint32_t crc, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) crc = kCrc32cTable[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// The SSE4.2 crc32 instruction computes CRC-32C (same polynomial, reflected): 8 bytes per
// instruction, ~10x the table loop. Chosen at run time, so the build needs no -msse4.2.
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
const bool kHaveSse42 = __builtin_cpu_supports("sse4.2");
#endif

}  // namespace

uint32_t Crc32cExtend(uint32_t crc, absl::Span<const uint8_t> data) {
  crc = ~crc;
#if defined(__x86_64__)
  if (kHaveSse42) return ~Crc32cSse42(crc, data.data(), data.size());
#endif
  return ~Crc32cSoftware(crc, data.data(), data.size());
}

uint32_t Crc32cPortableForTest(absl::Span<const uint8_t> data) {
  return ~Crc32cSoftware(~0u, data.data(), data.size());
}

uint32_t Crc32c(absl::Span<const uint8_t> data) { return Crc32cExtend(0, data); }

absl::Status ValidateStepPlan(const StepPlan& plan) {
  if (plan.micro_batches < 1 || plan.micro_batches > kMaxMicroBatches ||
      plan.micro_batch >= plan.micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step plan: micro_batch ", int{plan.micro_batch}, " of micro_batches ", int{plan.micro_batches},
        " must satisfy micro_batch < micro_batches <= ", kMaxMicroBatches));
  }
  for (size_t i = 0; i < plan.requests.size(); ++i) RETURN_IF_ERROR(ValidateRequest(plan.requests[i], i));
  for (size_t i = 0; i < plan.groups.size(); ++i) RETURN_IF_ERROR(ValidateGroup(plan.groups, i));
  for (size_t i = 0; i < plan.publishes.size(); ++i) RETURN_IF_ERROR(ValidatePublish(plan.publishes[i], i));
  return ValidatePlanLinks(plan);
}

absl::Status ValidateLayerMessageHeader(const LayerMessageHeader& h) {
  const auto kind = static_cast<uint8_t>(h.kind);
  if (kind != static_cast<uint8_t>(LayerMessageKind::kQkv) &&
      kind != static_cast<uint8_t>(LayerMessageKind::kAttnOut) &&
      kind != static_cast<uint8_t>(LayerMessageKind::kResidual) &&
      kind != static_cast<uint8_t>(LayerMessageKind::kQ) &&
      kind != static_cast<uint8_t>(LayerMessageKind::kKv)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer message header: kind ", kind,
                     " must be 1 (qkv), 2 (attn_out), 3 (residual), 4 (q) or 5 (kv)"));
  }
  RETURN_IF_ERROR(CheckDType(h.dtype, "layer message header"));
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
  // Each count is bounded before it is multiplied, so the sum cannot wrap.
  constexpr uint64_t kMaxBody = std::numeric_limits<uint32_t>::max();
  uint64_t body_bytes = kStepPlanFixedBytes;
  bool fits = true;
  for (const auto& [count, record_bytes] :
       {std::pair{plan.requests.size(), kStepRequestBytes}, std::pair{plan.groups.size(), kPrefixGroupBytes},
        std::pair{plan.publishes.size(), kPrefixPublishBytes},
        std::pair{plan.evictions.size(), kPrefixEvictBytes},
        std::pair{plan.restores.size(), kPrefixRestoreBytes},
        std::pair{plan.next_uses.size(), kPrefixNextUseBytes}}) {
    fits = fits && count <= (kMaxBody - body_bytes) / record_bytes;
    if (fits) body_bytes += count * record_bytes;
  }
  for (const PrefixEvict& e : plan.evictions) {
    TANDEM_CHECK_MSG(e.tokens.size() <= kMaxPrefixBlockTokens, "eviction of ", e.tokens.size(), " tokens");
    fits = fits && e.tokens.size() <= (kMaxBody - body_bytes) / 4;
    if (fits) body_bytes += 4 * e.tokens.size();
  }
  for (const PrefixRestore& e : plan.restores) {
    TANDEM_CHECK_MSG(e.segments.size() <= kMaxPrefixSegments, "restore of ", e.segments.size(), " segments");
    fits = fits && e.segments.size() <= (kMaxBody - body_bytes) / kPrefixSegmentBytes;
    if (fits) body_bytes += kPrefixSegmentBytes * e.segments.size();
  }
  TANDEM_CHECK_MSG(plan.next_uses.size() <= kMaxPrefixNextUses, "step plan of ", plan.next_uses.size(),
                   " next-use records");
  TANDEM_CHECK_MSG(fits, "step plan of ", plan.requests.size(), " requests, ", plan.groups.size(),
                   " groups, ", plan.publishes.size(), " publishes and ", plan.evictions.size(),
                   " evictions does not fit in one frame");
  std::vector<uint8_t> body;
  body.reserve(body_bytes);
  Writer w(&body);
  w.U64(plan.step_id);
  w.U32(static_cast<uint32_t>(plan.requests.size()));
  w.U32(static_cast<uint32_t>(plan.groups.size()));
  w.U32(static_cast<uint32_t>(plan.publishes.size()));
  w.U32(static_cast<uint32_t>(plan.evictions.size()));
  w.U8(plan.micro_batch);
  w.U8(plan.micro_batches);
  w.U16(static_cast<uint16_t>(plan.next_uses.size()));
  w.U32(static_cast<uint32_t>(plan.restores.size()));
  for (const StepRequest& q : plan.requests) {
    w.U64(q.request_id);
    w.U64(q.seed);
    w.U64(q.counter);
    w.U64(q.attach_hash);
    w.I32(q.prefix_group);
    w.I32(q.position);
    w.I32(q.q_len);
    w.I32(q.kv_len);
    w.F32(q.temperature);
    w.I32(q.top_k);
    w.F32(q.top_p);
    w.U16(q.memory_rank);
    w.U8(q.sample ? 1 : 0);
    w.U8(q.top_logprobs);
  }
  for (const PrefixGroup& g : plan.groups) {
    w.U64(g.block_hash);
    w.I32(g.prefix_tokens);
    w.I32(g.parent);
    w.U16(g.memory_rank);
    w.Zeros(6);
  }
  for (const PrefixPublish& p : plan.publishes) {
    w.U64(p.request_id);
    w.U64(p.block_hash);
    w.U64(p.parent_hash);
    w.I32(p.block_index);
    w.U16(p.memory_rank);
    w.Zeros(2);
  }
  for (const PrefixEvict& e : plan.evictions) {
    w.U64(e.block_hash);
    w.U16(e.memory_rank);
    w.U16(static_cast<uint16_t>(e.tokens.size()));
    w.Zeros(4);
  }
  for (const PrefixRestore& e : plan.restores) {
    w.U64(e.block_hash);
    w.U64(e.parent_hash);
    w.I32(e.block_index);
    w.U16(e.memory_rank);
    w.U16(static_cast<uint16_t>(e.segments.size()));
  }
  for (const PrefixNextUse& u : plan.next_uses) {
    w.U64(u.block_hash);
    w.I32(u.next_use);
    w.U16(u.memory_rank);
    w.Zeros(2);
  }
  for (const PrefixEvict& e : plan.evictions) {
    for (int32_t t : e.tokens) w.I32(t);
  }
  for (const PrefixRestore& e : plan.restores) {
    for (const PrefixSegment& g : e.segments) {
      w.U64(g.source_hash);
      w.I32(g.source_index);
      w.U16(g.source_row);
      w.U16(g.rows);
    }
  }
  return Frame(kStepPlanMagic, body);
}

absl::StatusOr<StepPlan> DecodeStepPlan(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "step plan";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kStepPlanMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  StepPlan plan;
  ASSIGN_OR_RETURN(plan.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(uint32_t request_count, r.U32("request_count"));
  ASSIGN_OR_RETURN(uint32_t group_count, r.U32("group_count"));
  ASSIGN_OR_RETURN(uint32_t publish_count, r.U32("publish_count"));
  ASSIGN_OR_RETURN(uint32_t evict_count, r.U32("evict_count"));
  ASSIGN_OR_RETURN(plan.micro_batch, r.U8("micro_batch"));
  ASSIGN_OR_RETURN(plan.micro_batches, r.U8("micro_batches"));
  const size_t next_use_at = r.offset();
  ASSIGN_OR_RETURN(uint16_t next_use_count, r.U16("next_use_count"));
  ASSIGN_OR_RETURN(uint32_t restore_count, r.U32("restore_count"));
  // Bound every count by the bytes present before allocating anything: each area, in order, must
  // fit in what the areas before it leave; with the evictions' tokens they must fill the body
  // exactly (checked once the evictions say how many tokens follow).
  struct Area {
    std::string_view field;
    uint32_t count;
    size_t record_bytes;
    std::string_view contents;
  };
  const Area areas[] = {{"request_count", request_count, kStepRequestBytes, "requests"},
                        {"group_count", group_count, kPrefixGroupBytes, "groups"},
                        {"publish_count", publish_count, kPrefixPublishBytes, "publishes"},
                        {"evict_count", evict_count, kPrefixEvictBytes, "evictions"},
                        {"restore_count", restore_count, kPrefixRestoreBytes, "restores"},
                        {"next_use_count", next_use_count, kPrefixNextUseBytes, "next uses"}};
  uint64_t used = 0;  // at most 6 * 2^32 * 64: cannot wrap
  for (const Area& a : areas) {
    const uint64_t needed = static_cast<uint64_t>(a.count) * a.record_bytes;
    if (needed > r.remaining() - used) {
      return absl::DataLossError(absl::StrCat(ToAbsl(kWhat), ": truncated: ", ToAbsl(a.field), " ", a.count,
                                              " needs ", needed, " bytes of ", ToAbsl(a.contents),
                                              " at byte offset ", r.offset() + used, " but ",
                                              r.remaining() - used, " remain"));
    }
    used += needed;
  }
  plan.requests.resize(request_count);
  for (uint32_t i = 0; i < request_count; ++i) {
    StepRequest& q = plan.requests[i];
    ASSIGN_OR_RETURN(q.request_id, r.U64("request_id"));
    ASSIGN_OR_RETURN(q.seed, r.U64("seed"));
    ASSIGN_OR_RETURN(q.counter, r.U64("counter"));
    ASSIGN_OR_RETURN(q.attach_hash, r.U64("attach_hash"));
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
    ASSIGN_OR_RETURN(q.top_logprobs, r.U8("top_logprobs"));
  }
  plan.groups.resize(group_count);
  for (uint32_t i = 0; i < group_count; ++i) {
    PrefixGroup& g = plan.groups[i];
    ASSIGN_OR_RETURN(g.block_hash, r.U64("block_hash"));
    ASSIGN_OR_RETURN(g.prefix_tokens, r.I32("prefix_tokens"));
    ASSIGN_OR_RETURN(g.parent, r.I32("parent"));
    ASSIGN_OR_RETURN(g.memory_rank, r.U16("memory_rank"));
    RETURN_IF_ERROR(RecordReserved(r, "group", i, 6));
  }
  plan.publishes.resize(publish_count);
  for (uint32_t i = 0; i < publish_count; ++i) {
    PrefixPublish& p = plan.publishes[i];
    ASSIGN_OR_RETURN(p.request_id, r.U64("request_id"));
    ASSIGN_OR_RETURN(p.block_hash, r.U64("block_hash"));
    ASSIGN_OR_RETURN(p.parent_hash, r.U64("parent_hash"));
    ASSIGN_OR_RETURN(p.block_index, r.I32("block_index"));
    ASSIGN_OR_RETURN(p.memory_rank, r.U16("memory_rank"));
    RETURN_IF_ERROR(RecordReserved(r, "publish", i, 2));
  }
  plan.evictions.resize(evict_count);
  std::vector<uint16_t> token_counts(evict_count);
  uint64_t token_total = 0;
  for (uint32_t i = 0; i < evict_count; ++i) {
    PrefixEvict& e = plan.evictions[i];
    ASSIGN_OR_RETURN(e.block_hash, r.U64("block_hash"));
    ASSIGN_OR_RETURN(e.memory_rank, r.U16("memory_rank"));
    const size_t count_at = r.offset();
    ASSIGN_OR_RETURN(token_counts[i], r.U16("token_count"));
    if (token_counts[i] > kMaxPrefixBlockTokens) {
      return absl::InvalidArgumentError(absl::StrCat(ToAbsl(kWhat), ": eviction ", i, ": token_count ",
                                                     token_counts[i], " at byte offset ", count_at,
                                                     " exceeds ", kMaxPrefixBlockTokens));
    }
    token_total += token_counts[i];
    RETURN_IF_ERROR(RecordReserved(r, "eviction", i, 4));
  }
  plan.restores.resize(restore_count);
  std::vector<uint16_t> segment_counts(restore_count);
  uint64_t segment_total = 0;
  for (uint32_t i = 0; i < restore_count; ++i) {
    PrefixRestore& e = plan.restores[i];
    ASSIGN_OR_RETURN(e.block_hash, r.U64("block_hash"));
    ASSIGN_OR_RETURN(e.parent_hash, r.U64("parent_hash"));
    ASSIGN_OR_RETURN(e.block_index, r.I32("block_index"));
    ASSIGN_OR_RETURN(e.memory_rank, r.U16("memory_rank"));
    const size_t count_at = r.offset();
    ASSIGN_OR_RETURN(segment_counts[i], r.U16("segment_count"));
    if (segment_counts[i] > kMaxPrefixSegments) {
      return absl::InvalidArgumentError(absl::StrCat(ToAbsl(kWhat), ": restore ", i, ": segment_count ",
                                                     segment_counts[i], " at byte offset ", count_at,
                                                     " exceeds ", kMaxPrefixSegments));
    }
    segment_total += segment_counts[i];
  }
  if (next_use_count > kMaxPrefixNextUses) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(kWhat), ": next_use_count ", next_use_count,
                                                   " at byte offset ", next_use_at, " exceeds ",
                                                   kMaxPrefixNextUses));
  }
  plan.next_uses.resize(next_use_count);
  for (uint32_t i = 0; i < next_use_count; ++i) {
    PrefixNextUse& u = plan.next_uses[i];
    ASSIGN_OR_RETURN(u.block_hash, r.U64("block_hash"));
    ASSIGN_OR_RETURN(u.next_use, r.I32("next_use"));
    ASSIGN_OR_RETURN(u.memory_rank, r.U16("memory_rank"));
    RETURN_IF_ERROR(RecordReserved(r, "next use", i, 2));
  }
  const uint64_t tail = 4 * token_total + kPrefixSegmentBytes * segment_total;  // small: cannot wrap
  if (tail > r.remaining()) {
    return absl::DataLossError(absl::StrCat(
        ToAbsl(kWhat), ": truncated: the evictions' ", token_total, " tokens",
        segment_total > 0 ? absl::StrCat(" and the restores' ", segment_total, " segments") : "", " need ",
        tail, " bytes at byte offset ", r.offset(), " but ", r.remaining(), " remain"));
  }
  if (tail < r.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat(
        ToAbsl(kWhat), ": request_count ", request_count, ", group_count ", group_count, ", publish_count ",
        publish_count, ", evict_count ", evict_count, ", restore_count ", restore_count,
        " and next_use_count ", next_use_count,
        token_total > 0 ? absl::StrCat(" (with ", token_total, " eviction tokens)") : "",
        segment_total > 0 ? absl::StrCat(" (with ", segment_total, " restore segments)") : "", " leave ",
        r.remaining() - tail, " unused body bytes at byte offset ", r.offset() + tail));
  }
  for (uint32_t i = 0; i < evict_count; ++i) {
    PrefixEvict& e = plan.evictions[i];
    e.tokens.resize(token_counts[i]);
    for (int32_t& t : e.tokens) {
      ASSIGN_OR_RETURN(t, r.I32("token"));
    }
  }
  for (uint32_t i = 0; i < restore_count; ++i) {
    PrefixRestore& e = plan.restores[i];
    e.segments.resize(segment_counts[i]);
    for (PrefixSegment& g : e.segments) {
      ASSIGN_OR_RETURN(g.source_hash, r.U64("source_hash"));
      ASSIGN_OR_RETURN(g.source_index, r.I32("source_index"));
      ASSIGN_OR_RETURN(g.source_row, r.U16("source_row"));
      ASSIGN_OR_RETURN(g.rows, r.U16("rows"));
    }
  }
  RETURN_IF_ERROR(ValidateStepPlan(plan));
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
  RETURN_IF_ERROR(CheckBodySize(body, kLayerMessageBodyBytes, kWhat));
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

// ---- Control messages ----------------------------------------------------------------------

absl::Status ValidateHello(const HelloMessage& h) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat("hello: ", parts...)); };
  if (h.num_memory_ranks < 1) return bad("num_memory_ranks 0 must be >= 1");
  if (h.memory_rank >= h.num_memory_ranks) {
    return bad("memory_rank ", h.memory_rank, " must be < num_memory_ranks ", h.num_memory_ranks);
  }
  if (h.num_layers < 1) return bad("num_layers 0 must be >= 1");
  if (h.num_heads < 1) return bad("num_heads 0 must be >= 1");
  if (h.num_kv_heads < 1) return bad("num_kv_heads 0 must be >= 1");
  if (h.num_heads % h.num_kv_heads != 0) {
    return bad("num_kv_heads ", h.num_kv_heads, " must divide num_heads ", h.num_heads);
  }
  if (h.head_dim < 1 || h.head_dim > kMaxHeadDim) {
    return bad("head_dim ", h.head_dim, " must be in [1, ", kMaxHeadDim, "]");
  }
  if (h.max_tokens_per_step < 1) return bad("max_tokens_per_step 0 must be >= 1");
  if (h.max_requests_per_step < 1 || h.max_requests_per_step > h.max_tokens_per_step) {
    return bad("max_requests_per_step ", h.max_requests_per_step, " must be in [1, max_tokens_per_step ",
               h.max_tokens_per_step, "]");
  }
  if (h.max_position < 1) return bad("max_position 0 must be >= 1");
  RETURN_IF_ERROR(CheckDType(h.dtype, "hello"));
  if (h.kv_capacity_tokens > kMaxKvCapacityTokens) {
    return bad("kv_capacity_tokens ", h.kv_capacity_tokens,
               " must be 0 (sized from memory) or <= ", kMaxKvCapacityTokens);
  }
  if (!(h.kv_memory_fraction > 0.0f && h.kv_memory_fraction <= 1.0f)) {
    return bad("kv_memory_fraction ", h.kv_memory_fraction, " must be in (0, 1]");
  }
  if (h.prefix_block_tokens > kMaxPrefixBlockTokens) {
    return bad("prefix_block_tokens ", h.prefix_block_tokens, " must be 0 (no prefix registry) or in [1, ",
               kMaxPrefixBlockTokens, "]");
  }
  if (h.prefix_sharing > static_cast<uint8_t>(PrefixSharing::kAuto)) {
    return bad("prefix_sharing ", h.prefix_sharing, " must be 0 (off), 1 (on) or 2 (auto)");
  }
  if (h.prefix_sharing != static_cast<uint8_t>(PrefixSharing::kOff) && h.prefix_block_tokens == 0) {
    return bad("prefix_sharing ", h.prefix_sharing, " needs prefix_block_tokens >= 1 (a prefix registry)");
  }
  if (h.lanes < 1 || h.lanes > kMaxMicroBatches)
    return bad("lanes ", int{h.lanes}, " must be in [1, ", kMaxMicroBatches, "]");
  if (h.compute_ranks < 1 || h.compute_ranks > h.lanes) {
    return bad("compute_ranks ", int{h.compute_ranks}, " must be in [1, lanes ", int{h.lanes}, "]");
  }
  if ((h.compute_mask & 1) == 0 || (h.compute_mask >> h.compute_ranks) != 0) {
    return bad("compute_mask 0x", absl::Hex(static_cast<unsigned>(h.compute_mask)),
               " must have bit 0 set and none at or above compute_ranks ", int{h.compute_ranks});
  }
  if (h.slice_layers > h.num_layers || (h.slice_layers > 0 && h.compute_ranks < 2)) {
    return bad("slice_layers ", h.slice_layers, " must be 0 or in [1, num_layers ", h.num_layers,
               "] with compute_ranks >= 2 (compute_ranks ", int{h.compute_ranks}, ")");
  }
  for (const auto& [name, value] :
       {std::pair{"rope_theta", h.rope.theta}, std::pair{"rope_factor", h.rope.factor},
        std::pair{"rope_low_freq_factor", h.rope.low_freq_factor},
        std::pair{"rope_high_freq_factor", h.rope.high_freq_factor}}) {
    if (!(std::isfinite(value) && value > 0)) return bad(name, " ", value, " must be finite and > 0");
  }
  const auto partition = static_cast<uint8_t>(h.partition);
  uint64_t begin = 0, end = h.num_kv_heads;  // the slice the partition gives this rank
  if (h.partition == AttentionPartition::kHead) {
    if (h.num_kv_heads < h.num_memory_ranks) {
      return bad("partition head needs num_kv_heads ", h.num_kv_heads, " >= num_memory_ranks ",
                 h.num_memory_ranks);
    }
    // Any non-empty range of the heads: a re-partition over the surviving ranks gives slices of
    // its own (HeadSlice of the survivors).
    if (h.kv_head_begin >= h.kv_head_end || h.kv_head_end > h.num_kv_heads) {
      return bad("KV heads [", h.kv_head_begin, ", ", h.kv_head_end,
                 ") must be a non-empty range within [0, ", h.num_kv_heads, ") for partition head");
    }
    return absl::OkStatus();
  } else if (h.partition != AttentionPartition::kRequest) {
    return bad("partition ", partition, " must be 0 (request) or 1 (head)");
  }
  if (h.kv_head_begin != begin || h.kv_head_end != end) {
    return bad("KV heads [", h.kv_head_begin, ", ", h.kv_head_end, ") must be [", begin, ", ", end,
               ") for partition ", AttentionPartitionName(h.partition), ", memory_rank ", h.memory_rank,
               " of ", h.num_memory_ranks, " and num_kv_heads ", h.num_kv_heads);
  }
  return absl::OkStatus();
}

absl::Status ValidateHelloReply(const HelloReplyMessage& h) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("hello reply: ", parts...));
  };
  RETURN_IF_ERROR(CheckDType(h.dtype, "hello reply"));
  if (h.kv_capacity_tokens < 1 || h.kv_capacity_tokens > kMaxKvCapacityTokens) {
    return bad("kv_capacity_tokens ", h.kv_capacity_tokens, " must be in [1, ", kMaxKvCapacityTokens, "]");
  }
  if (h.device.size() > kMaxDeviceBytes) {
    return bad("device of ", h.device.size(), " bytes exceeds ", kMaxDeviceBytes);
  }
  return CheckNoNul(h.device, "hello reply", "device");
}

absl::Status ValidateHelloReplyMatches(const HelloMessage& hello, const HelloReplyMessage& reply) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("hello reply: ", parts...));
  };
  if (reply.memory_rank != hello.memory_rank) {
    return bad("memory_rank ", reply.memory_rank, " must equal the hello's memory_rank ", hello.memory_rank);
  }
  if (reply.dtype != hello.dtype) {
    return bad("dtype ", static_cast<int>(reply.dtype), " must equal the hello's dtype ",
               static_cast<int>(hello.dtype));
  }
  if (hello.kv_capacity_tokens != 0 && reply.kv_capacity_tokens != hello.kv_capacity_tokens) {
    return bad("kv_capacity_tokens ", reply.kv_capacity_tokens, " must equal the hello's kv_capacity_tokens ",
               hello.kv_capacity_tokens);
  }
  return absl::OkStatus();
}

absl::Status ValidateRelease(const ReleaseMessage& m) {
  if (m.request_ids.size() < 2) return absl::OkStatus();
  std::vector<uint64_t> sorted = m.request_ids;
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  if (dup == sorted.end()) return absl::OkStatus();
  const uint64_t id = *dup;
  const auto first = std::find(m.request_ids.begin(), m.request_ids.end(), id);
  const auto second = std::find(first + 1, m.request_ids.end(), id);
  return absl::InvalidArgumentError(absl::StrCat("release: request_id ", id, " at index ",
                                                 second - m.request_ids.begin(), " repeats index ",
                                                 first - m.request_ids.begin()));
}

absl::Status ValidateError(const ErrorMessage& m) {
  if (m.code < kMinStatusCode || m.code > kMaxStatusCode) {
    return absl::InvalidArgumentError(absl::StrCat("error message: code ", m.code, " must be in [",
                                                   kMinStatusCode, ", ", kMaxStatusCode,
                                                   "] (an absl::StatusCode other than OK)"));
  }
  if (m.message.size() > kMaxErrorMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("error message: message of ", m.message.size(),
                                                   " bytes exceeds ", kMaxErrorMessageBytes));
  }
  return CheckNoNul(m.message, "error message", "message");
}

absl::Status ValidateBye(const ByeMessage&) { return absl::OkStatus(); }

std::vector<uint8_t> EncodeHello(const HelloMessage& h) {
  std::vector<uint8_t> body;
  body.reserve(kHelloBodyBytes);
  Writer w(&body);
  w.U64(h.kv_capacity_tokens);
  w.U32(h.num_layers);
  w.U32(h.num_heads);
  w.U32(h.num_kv_heads);
  w.U32(h.head_dim);
  w.U32(h.max_tokens_per_step);
  w.U32(h.max_requests_per_step);
  w.U32(h.max_position);
  w.F32(h.kv_memory_fraction);
  w.U32(h.attn_out_buffer);
  w.U16(h.memory_rank);
  w.U16(h.num_memory_ranks);
  w.U8(static_cast<uint8_t>(h.dtype));
  w.U8(h.checksums ? 1 : 0);
  w.U16(h.prefix_block_tokens);
  w.U8(h.prefix_sharing);
  w.U8(static_cast<uint8_t>(h.partition));
  w.U8(h.lanes);
  w.U8(h.compute_ranks);
  w.U32(h.kv_head_begin);
  w.U32(h.kv_head_end);
  w.U16(h.slice_layers);
  w.U8(h.q_first ? 1 : 0);
  w.U8(static_cast<uint8_t>(h.rope.type));
  w.U8(h.compute_mask);
  w.Zeros(3);
  w.F64(h.rope.theta);
  w.F64(h.rope.factor);
  w.F64(h.rope.low_freq_factor);
  w.F64(h.rope.high_freq_factor);
  w.U64(static_cast<uint64_t>(h.rope.original_max_position));
  return Frame(kHelloMagic, body);
}

absl::StatusOr<HelloMessage> DecodeHello(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "hello";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kHelloMagic, kWhat));
  RETURN_IF_ERROR(CheckBodySize(body, kHelloBodyBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  HelloMessage h;
  ASSIGN_OR_RETURN(h.kv_capacity_tokens, r.U64("kv_capacity_tokens"));
  ASSIGN_OR_RETURN(h.num_layers, r.U32("num_layers"));
  ASSIGN_OR_RETURN(h.num_heads, r.U32("num_heads"));
  ASSIGN_OR_RETURN(h.num_kv_heads, r.U32("num_kv_heads"));
  ASSIGN_OR_RETURN(h.head_dim, r.U32("head_dim"));
  ASSIGN_OR_RETURN(h.max_tokens_per_step, r.U32("max_tokens_per_step"));
  ASSIGN_OR_RETURN(h.max_requests_per_step, r.U32("max_requests_per_step"));
  ASSIGN_OR_RETURN(h.max_position, r.U32("max_position"));
  ASSIGN_OR_RETURN(h.kv_memory_fraction, r.F32("kv_memory_fraction"));
  ASSIGN_OR_RETURN(h.attn_out_buffer, r.U32("attn_out_buffer"));
  ASSIGN_OR_RETURN(h.memory_rank, r.U16("memory_rank"));
  ASSIGN_OR_RETURN(h.num_memory_ranks, r.U16("num_memory_ranks"));
  ASSIGN_OR_RETURN(uint8_t dtype, r.U8("dtype"));
  ASSIGN_OR_RETURN(h.checksums, ReadBool(r, "checksums", kWhat));
  ASSIGN_OR_RETURN(h.prefix_block_tokens, r.U16("prefix_block_tokens"));
  ASSIGN_OR_RETURN(h.prefix_sharing, r.U8("prefix_sharing"));
  ASSIGN_OR_RETURN(uint8_t partition, r.U8("partition"));
  ASSIGN_OR_RETURN(h.lanes, r.U8("lanes"));
  ASSIGN_OR_RETURN(h.compute_ranks, r.U8("compute_ranks"));
  ASSIGN_OR_RETURN(h.kv_head_begin, r.U32("kv_head_begin"));
  ASSIGN_OR_RETURN(h.kv_head_end, r.U32("kv_head_end"));
  ASSIGN_OR_RETURN(h.slice_layers, r.U16("slice_layers"));
  ASSIGN_OR_RETURN(h.q_first, ReadBool(r, "q_first", kWhat));
  ASSIGN_OR_RETURN(uint8_t rope_type, r.U8("rope_type"));
  ASSIGN_OR_RETURN(h.compute_mask, r.U8("compute_mask"));
  RETURN_IF_ERROR(r.Reserved("reserved", 3));
  ASSIGN_OR_RETURN(h.rope.theta, r.F64("rope_theta"));
  ASSIGN_OR_RETURN(h.rope.factor, r.F64("rope_factor"));
  ASSIGN_OR_RETURN(h.rope.low_freq_factor, r.F64("rope_low_freq_factor"));
  ASSIGN_OR_RETURN(h.rope.high_freq_factor, r.F64("rope_high_freq_factor"));
  ASSIGN_OR_RETURN(uint64_t original_max, r.U64("rope_original_max_position"));
  if (rope_type > static_cast<uint8_t>(RopeType::kLlama3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hello: rope_type ", rope_type, " must be 0 (default) or 1 (llama3)"));
  }
  if (original_max < 1 || original_max > kMaxKvCapacityTokens) {
    return absl::InvalidArgumentError(absl::StrCat("hello: rope_original_max_position ", original_max,
                                                   " must be in [1, ", kMaxKvCapacityTokens, "]"));
  }
  h.rope.type = static_cast<RopeType>(rope_type);
  h.rope.original_max_position = static_cast<int64_t>(original_max);
  // Enum values are checked by ValidateHello before any use as an enum.
  h.dtype = static_cast<DType>(dtype);
  h.partition = static_cast<AttentionPartition>(partition);
  RETURN_IF_ERROR(ValidateHello(h));
  return h;
}

std::vector<uint8_t> EncodeHelloReply(const HelloReplyMessage& h) {
  TANDEM_CHECK_MSG(h.device.size() <= std::numeric_limits<uint16_t>::max(), "hello reply device of ",
                   h.device.size(), " bytes does not fit in 16 bits");
  std::vector<uint8_t> body;
  body.reserve(kHelloReplyFixedBytes + h.device.size());
  Writer w(&body);
  w.U64(h.kv_capacity_tokens);
  w.U32(h.qkv_buffer);
  w.U16(h.memory_rank);
  w.U8(static_cast<uint8_t>(h.dtype));
  w.U8(h.persisted ? 1 : 0);
  w.U16(static_cast<uint16_t>(h.device.size()));
  body.insert(body.end(), h.device.begin(), h.device.end());
  return Frame(kHelloReplyMagic, body);
}

absl::StatusOr<HelloReplyMessage> DecodeHelloReply(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "hello reply";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kHelloReplyMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  HelloReplyMessage h;
  ASSIGN_OR_RETURN(h.kv_capacity_tokens, r.U64("kv_capacity_tokens"));
  ASSIGN_OR_RETURN(h.qkv_buffer, r.U32("qkv_buffer"));
  ASSIGN_OR_RETURN(h.memory_rank, r.U16("memory_rank"));
  ASSIGN_OR_RETURN(uint8_t dtype, r.U8("dtype"));
  ASSIGN_OR_RETURN(h.persisted, ReadBool(r, "persisted", kWhat));
  ASSIGN_OR_RETURN(uint16_t device_bytes, r.U16("device_bytes"));
  RETURN_IF_ERROR(CheckRest(r, device_bytes, kWhat, "device_bytes", device_bytes, "device"));
  if (device_bytes > kMaxDeviceBytes) {
    return absl::InvalidArgumentError(absl::StrCat("hello reply: device_bytes ", device_bytes,
                                                   " at byte offset 32 must be <= ", kMaxDeviceBytes));
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> device, r.Bytes("device", device_bytes));
  h.device.assign(device.begin(), device.end());
  h.dtype = static_cast<DType>(dtype);  // checked by ValidateHelloReply before any use as an enum
  RETURN_IF_ERROR(ValidateHelloReply(h));
  return h;
}

std::vector<uint8_t> EncodeRelease(const ReleaseMessage& m) {
  TANDEM_CHECK_MSG(m.request_ids.size() <= (std::numeric_limits<uint32_t>::max() - kReleaseFixedBytes) / 8,
                   "release of ", m.request_ids.size(), " request ids does not fit in one frame");
  std::vector<uint8_t> body;
  body.reserve(kReleaseFixedBytes + 8 * m.request_ids.size());
  Writer w(&body);
  w.U64(m.step_id);
  w.U32(static_cast<uint32_t>(m.request_ids.size()));
  w.Zeros(4);
  for (uint64_t id : m.request_ids) w.U64(id);
  return Frame(kReleaseMagic, body);
}

absl::StatusOr<ReleaseMessage> DecodeRelease(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "release";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kReleaseMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ReleaseMessage m;
  ASSIGN_OR_RETURN(m.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(uint32_t count, r.U32("request_count"));
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  // Bound the count by the bytes present before allocating anything for it.
  RETURN_IF_ERROR(
      CheckRest(r, static_cast<uint64_t>(count) * 8, kWhat, "request_count", count, "request ids"));
  m.request_ids.resize(count);
  for (uint64_t& id : m.request_ids) {
    ASSIGN_OR_RETURN(id, r.U64("request_id"));
  }
  RETURN_IF_ERROR(ValidateRelease(m));
  return m;
}

std::vector<uint8_t> EncodeError(const ErrorMessage& m) {
  TANDEM_CHECK_MSG(m.message.size() <= std::numeric_limits<uint32_t>::max() - kErrorFixedBytes,
                   "error message of ", m.message.size(), " bytes does not fit in one frame");
  std::vector<uint8_t> body;
  body.reserve(kErrorFixedBytes + m.message.size());
  Writer w(&body);
  w.U32(m.code);
  w.U32(static_cast<uint32_t>(m.message.size()));
  body.insert(body.end(), m.message.begin(), m.message.end());
  return Frame(kErrorMagic, body);
}

absl::StatusOr<ErrorMessage> DecodeError(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "error message";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kErrorMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ErrorMessage m;
  ASSIGN_OR_RETURN(m.code, r.U32("code"));
  ASSIGN_OR_RETURN(uint32_t message_bytes, r.U32("message_bytes"));
  RETURN_IF_ERROR(CheckRest(r, message_bytes, kWhat, "message_bytes", message_bytes, "message"));
  if (message_bytes > kMaxErrorMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("error message: message_bytes ", message_bytes,
                                                   " at byte offset 20 must be <= ", kMaxErrorMessageBytes));
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> message, r.Bytes("message", message_bytes));
  m.message.assign(message.begin(), message.end());
  RETURN_IF_ERROR(ValidateError(m));
  return m;
}

namespace {

// Frames whose body is one u64 (bye, stats request).
std::vector<uint8_t> EncodeU64Frame(uint32_t magic, uint64_t value) {
  std::vector<uint8_t> body;
  body.reserve(8);
  Writer w(&body);
  w.U64(value);
  return Frame(magic, body);
}

absl::StatusOr<uint64_t> DecodeU64Frame(absl::Span<const uint8_t> frame, uint32_t magic,
                                        std::string_view what, std::string_view field) {
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, magic, what));
  RETURN_IF_ERROR(CheckBodySize(body, 8, what));
  Reader r(body, kFrameHeaderBytes, what);
  return r.U64(field);
}

}  // namespace

std::vector<uint8_t> EncodeBye(const ByeMessage& m) { return EncodeU64Frame(kByeMagic, m.steps); }

absl::StatusOr<ByeMessage> DecodeBye(absl::Span<const uint8_t> frame) {
  ByeMessage m;
  ASSIGN_OR_RETURN(m.steps, DecodeU64Frame(frame, kByeMagic, "bye", "steps"));
  RETURN_IF_ERROR(ValidateBye(m));
  return m;
}

std::vector<uint8_t> EncodeStatsRequest(const StatsRequestMessage& m) {
  return EncodeU64Frame(kStatsRequestMagic, m.cookie);
}

absl::StatusOr<StatsRequestMessage> DecodeStatsRequest(absl::Span<const uint8_t> frame) {
  StatsRequestMessage m;
  ASSIGN_OR_RETURN(m.cookie, DecodeU64Frame(frame, kStatsRequestMagic, "stats request", "cookie"));
  return m;
}

std::vector<uint8_t> EncodeMemoryStats(const MemoryStatsMessage& m) {
  std::vector<uint8_t> body;
  body.reserve(kMemoryStatsBodyBytes);
  Writer w(&body);
  w.U64(m.cookie);
  w.U16(m.memory_rank);
  w.Zeros(6);
  w.U64(m.steps);
  w.U64(m.attention_ns);
  return Frame(kMemoryStatsMagic, body);
}

absl::StatusOr<MemoryStatsMessage> DecodeMemoryStats(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "memory stats";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kMemoryStatsMagic, kWhat));
  RETURN_IF_ERROR(CheckBodySize(body, kMemoryStatsBodyBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  MemoryStatsMessage m;
  ASSIGN_OR_RETURN(m.cookie, r.U64("cookie"));
  ASSIGN_OR_RETURN(m.memory_rank, r.U16("memory_rank"));
  RETURN_IF_ERROR(r.Reserved("reserved", 6));
  ASSIGN_OR_RETURN(m.steps, r.U64("steps"));
  ASSIGN_OR_RETURN(m.attention_ns, r.U64("attention_ns"));
  return m;
}

std::vector<uint8_t> EncodeHeartbeat(const HeartbeatMessage& m) {
  TANDEM_CHECK(m.silence_ms >= 1 && m.silence_ms <= kMaxHeartbeatSilenceMs);
  std::vector<uint8_t> body;
  body.reserve(kHeartbeatBodyBytes);
  Writer w(&body);
  w.U64(m.seq);
  w.U32(m.silence_ms);
  w.Zeros(4);
  return Frame(kHeartbeatMagic, body);
}

absl::StatusOr<HeartbeatMessage> DecodeHeartbeat(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "heartbeat";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kHeartbeatMagic, kWhat));
  RETURN_IF_ERROR(CheckBodySize(body, kHeartbeatBodyBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  HeartbeatMessage m;
  ASSIGN_OR_RETURN(m.seq, r.U64("seq"));
  ASSIGN_OR_RETURN(m.silence_ms, r.U32("silence_ms"));
  if (m.silence_ms < 1 || m.silence_ms > kMaxHeartbeatSilenceMs) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat: silence_ms ", m.silence_ms,
                                                   " at byte offset 24 must be in [1, ",
                                                   kMaxHeartbeatSilenceMs, "]"));
  }
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  return m;
}

std::vector<uint8_t> EncodeHeartbeatReply(const HeartbeatReplyMessage& m) {
  std::vector<uint8_t> body;
  body.reserve(kHeartbeatBodyBytes);
  Writer w(&body);
  w.U64(m.seq);
  w.U16(m.memory_rank);
  w.Zeros(6);
  return Frame(kHeartbeatReplyMagic, body);
}

absl::StatusOr<HeartbeatReplyMessage> DecodeHeartbeatReply(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "heartbeat reply";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kHeartbeatReplyMagic, kWhat));
  RETURN_IF_ERROR(CheckBodySize(body, kHeartbeatBodyBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  HeartbeatReplyMessage m;
  ASSIGN_OR_RETURN(m.seq, r.U64("seq"));
  ASSIGN_OR_RETURN(m.memory_rank, r.U16("memory_rank"));
  RETURN_IF_ERROR(r.Reserved("reserved", 6));
  return m;
}

std::vector<uint8_t> EncodeStepDiscard(const StepDiscardMessage& m) {
  TANDEM_CHECK(m.lost_memory_ranks.size() <= std::numeric_limits<uint16_t>::max());
  TANDEM_CHECK(std::adjacent_find(m.lost_memory_ranks.begin(), m.lost_memory_ranks.end(),
                                  [](uint16_t a, uint16_t b) { return a >= b; }) ==
               m.lost_memory_ranks.end());
  std::vector<uint8_t> body;
  body.reserve(kStepDiscardFixedBytes + 2 * m.lost_memory_ranks.size());
  Writer w(&body);
  w.U64(m.step_id);
  w.U64(m.seqno_base);
  w.U8(m.compute_mask);
  w.U8(m.drop ? 1 : 0);
  w.U16(static_cast<uint16_t>(m.lost_memory_ranks.size()));
  w.Zeros(4);
  for (uint16_t rank : m.lost_memory_ranks) w.U16(rank);
  return Frame(kStepDiscardMagic, body);
}

absl::StatusOr<StepDiscardMessage> DecodeStepDiscard(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "step discard";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kStepDiscardMagic, kWhat));
  if (body.size() < kStepDiscardFixedBytes)
    RETURN_IF_ERROR(CheckBodySize(body, kStepDiscardFixedBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  StepDiscardMessage m;
  ASSIGN_OR_RETURN(m.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(m.seqno_base, r.U64("seqno_base"));
  if (m.seqno_base == 0) {
    return absl::InvalidArgumentError("step discard: seqno_base 0 at byte offset 24 must be >= 1");
  }
  ASSIGN_OR_RETURN(m.compute_mask, r.U8("compute_mask"));
  if ((m.compute_mask & 1) == 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "step discard: compute_mask 0x%02x at byte offset 32 must have bit 0 (compute rank 0) set",
        m.compute_mask));
  }
  ASSIGN_OR_RETURN(m.drop, ReadBool(r, "drop", kWhat));
  ASSIGN_OR_RETURN(const uint16_t lost, r.U16("lost_count"));
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  if (static_cast<size_t>(lost) * 2 != r.remaining()) {
    return absl::InvalidArgumentError(
        absl::StrCat("step discard: lost_count ", lost, " at byte offset 34 needs a body of ",
                     kStepDiscardFixedBytes + 2 * static_cast<size_t>(lost), " bytes, not ", body.size()));
  }
  m.lost_memory_ranks.reserve(lost);
  for (uint16_t i = 0; i < lost; ++i) {
    ASSIGN_OR_RETURN(const uint16_t rank, r.U16("lost_memory"));
    if (!m.lost_memory_ranks.empty() && rank <= m.lost_memory_ranks.back()) {
      return absl::InvalidArgumentError(
          absl::StrCat("step discard: lost memory rank ", rank, " at byte offset ",
                       kFrameHeaderBytes + kStepDiscardFixedBytes + 2 * i,
                       " must be above the one before it (", m.lost_memory_ranks.back(), ")"));
    }
    m.lost_memory_ranks.push_back(rank);
  }
  return m;
}

namespace {

size_t PersistedBlockBytes(const PersistedBlock& b) {
  return kPersistedBlockFixedBytes + 4 * b.tokens.size();
}

}  // namespace

std::vector<uint8_t> EncodePersistedBlocks(const PersistedBlocksMessage& m) {
  size_t body_bytes = kPersistedBlocksFixedBytes;
  for (const PersistedBlock& b : m.blocks) body_bytes += PersistedBlockBytes(b);
  TANDEM_CHECK_MSG(body_bytes <= kMaxPersistedBlocksBodyBytes, "persisted blocks report of ", body_bytes,
                   " bytes exceeds ", kMaxPersistedBlocksBodyBytes);
  std::vector<uint8_t> body;
  body.reserve(body_bytes);
  Writer w(&body);
  w.U16(m.memory_rank);
  w.U8(m.last ? 1 : 0);
  w.Zeros(1);
  w.U32(static_cast<uint32_t>(m.blocks.size()));
  for (const PersistedBlock& b : m.blocks) {
    w.U64(b.hash);
    w.U64(b.parent_hash);
    w.I32(b.depth);
    w.U32(static_cast<uint32_t>(b.tokens.size()));
    for (int32_t t : b.tokens) w.I32(t);
  }
  return Frame(kPersistedBlocksMagic, body);
}

absl::StatusOr<PersistedBlocksMessage> DecodePersistedBlocks(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "persisted blocks";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kPersistedBlocksMagic, kWhat));
  if (body.size() > kMaxPersistedBlocksBodyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("persisted blocks: body_bytes ", body.size(), " exceeds ",
                                                   kMaxPersistedBlocksBodyBytes));
  }
  Reader r(body, kFrameHeaderBytes, kWhat);
  PersistedBlocksMessage m;
  ASSIGN_OR_RETURN(m.memory_rank, r.U16("memory_rank"));
  ASSIGN_OR_RETURN(m.last, ReadBool(r, "last", kWhat));
  RETURN_IF_ERROR(r.Reserved("reserved", 1));
  ASSIGN_OR_RETURN(const uint32_t count, r.U32("block_count"));
  // Each record takes at least kPersistedBlockFixedBytes: bound the count before allocating.
  if (static_cast<uint64_t>(count) * kPersistedBlockFixedBytes > r.remaining()) {
    return absl::DataLossError(absl::StrCat(
        "persisted blocks: truncated: block_count ", count, " needs at least ",
        static_cast<uint64_t>(count) * kPersistedBlockFixedBytes, " bytes but ", r.remaining(), " remain"));
  }
  m.blocks.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    PersistedBlock& b = m.blocks[i];
    const size_t at = r.offset();
    ASSIGN_OR_RETURN(b.hash, r.U64("hash"));
    ASSIGN_OR_RETURN(b.parent_hash, r.U64("parent_hash"));
    ASSIGN_OR_RETURN(b.depth, r.I32("depth"));
    ASSIGN_OR_RETURN(const uint32_t tokens, r.U32("token_count"));
    if (b.hash == 0 || b.depth < 1 || (b.depth == 1) != (b.parent_hash == 0) || tokens < 1 ||
        tokens > kMaxPrefixBlockTokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "persisted blocks: block ", i, " at byte offset ", at, ": hash ", b.hash, ", parent_hash ",
          b.parent_hash, ", depth ", b.depth, ", token_count ", tokens,
          ": the hash must not be 0, depth must be >= 1 with parent_hash 0 exactly at depth 1, and "
          "token_count in [1, ",
          kMaxPrefixBlockTokens, "]"));
    }
    if (uint64_t{tokens} * 4 > r.remaining()) {
      return absl::DataLossError(absl::StrCat("persisted blocks: truncated: block ", i, "'s ", tokens,
                                              " tokens need ", uint64_t{tokens} * 4, " bytes at byte offset ",
                                              r.offset(), " but ", r.remaining(), " remain"));
    }
    b.tokens.resize(tokens);
    for (int32_t& t : b.tokens) {
      ASSIGN_OR_RETURN(t, r.I32("token"));
    }
  }
  if (r.remaining() != 0) {
    return absl::InvalidArgumentError(absl::StrCat("persisted blocks: block_count ", count, " leaves ",
                                                   r.remaining(), " unused body bytes at byte offset ",
                                                   r.offset()));
  }
  return m;
}

std::vector<PersistedBlocksMessage> SplitPersistedBlocks(uint16_t memory_rank,
                                                         std::vector<PersistedBlock> blocks) {
  std::vector<PersistedBlocksMessage> reports(1);
  reports.back().memory_rank = memory_rank;
  size_t body_bytes = kPersistedBlocksFixedBytes;
  for (PersistedBlock& b : blocks) {
    TANDEM_CHECK(!b.tokens.empty() && b.tokens.size() <= kMaxPrefixBlockTokens);
    const size_t bytes = PersistedBlockBytes(b);
    if (body_bytes + bytes > kMaxPersistedBlocksBodyBytes) {
      reports.back().last = false;
      reports.emplace_back().memory_rank = memory_rank;
      body_bytes = kPersistedBlocksFixedBytes;
    }
    body_bytes += bytes;
    reports.back().blocks.push_back(std::move(b));
  }
  return reports;
}

std::vector<uint8_t> EncodeComputeHello(const ComputeHelloMessage& m) {
  std::vector<uint8_t> body;
  body.reserve(kComputeHelloBodyBytes);
  Writer w(&body);
  w.U16(m.compute_rank);
  w.U16(m.compute_ranks);
  w.Zeros(4);
  return Frame(kComputeHelloMagic, body);
}

std::vector<uint8_t> EncodeRestoreReply(const RestoreReplyMessage& m) {
  TANDEM_CHECK(m.failed.size() <= (std::numeric_limits<uint32_t>::max() - kRestoreReplyFixedBytes) / 8);
  std::vector<uint8_t> body;
  body.reserve(kRestoreReplyFixedBytes + 8 * m.failed.size());
  Writer w(&body);
  w.U64(m.step_id);
  w.U16(m.memory_rank);
  w.Zeros(2);
  w.U32(static_cast<uint32_t>(m.failed.size()));
  for (uint64_t h : m.failed) w.U64(h);
  return Frame(kRestoreReplyMagic, body);
}

absl::StatusOr<RestoreReplyMessage> DecodeRestoreReply(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "restore reply";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kRestoreReplyMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  RestoreReplyMessage m;
  ASSIGN_OR_RETURN(m.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(m.memory_rank, r.U16("memory_rank"));
  RETURN_IF_ERROR(r.Reserved("reserved", 2));
  ASSIGN_OR_RETURN(const uint32_t count, r.U32("failed_count"));
  if (static_cast<uint64_t>(count) * 8 != r.remaining()) {
    return absl::DataLossError(absl::StrCat("restore reply: failed_count ", count, " needs ",
                                            static_cast<uint64_t>(count) * 8, " bytes but ", r.remaining(),
                                            " remain"));
  }
  m.failed.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(m.failed[i], r.U64("failed"));
  }
  return m;
}

std::vector<uint8_t> EncodeReplicaRing(const ReplicaRingMessage& m) {
  TANDEM_CHECK_MSG(m.next_address.size() <= kMaxAddressBytes, "replica ring address of ",
                   m.next_address.size(), " bytes exceeds ", kMaxAddressBytes);
  std::vector<uint8_t> body;
  body.reserve(kReplicaRingFixedBytes + m.next_address.size());
  Writer w(&body);
  w.U16(static_cast<uint16_t>(m.next_address.size()));
  w.Zeros(6);
  body.insert(body.end(), m.next_address.begin(), m.next_address.end());
  return Frame(kReplicaRingMagic, body);
}

absl::StatusOr<ReplicaRingMessage> DecodeReplicaRing(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "replica ring";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kReplicaRingMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ASSIGN_OR_RETURN(const uint16_t bytes, r.U16("address_bytes"));
  RETURN_IF_ERROR(r.Reserved("reserved", 6));
  RETURN_IF_ERROR(CheckRest(r, bytes, kWhat, "address_bytes", bytes, "next_address"));
  if (bytes > kMaxAddressBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica ring: address_bytes ", bytes, " must be <= ", kMaxAddressBytes));
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> address, r.Bytes("next_address", bytes));
  ReplicaRingMessage m;
  m.next_address.assign(address.begin(), address.end());
  RETURN_IF_ERROR(CheckNoNul(m.next_address, "replica ring", "next_address"));
  return m;
}

std::vector<uint8_t> EncodeMemoryRejoin(const MemoryRejoinMessage& m) {
  TANDEM_CHECK_MSG(m.text.size() <= kMaxAddressBytes, "memory rejoin text of ", m.text.size(),
                   " bytes exceeds ", kMaxAddressBytes);
  std::vector<uint8_t> body;
  body.reserve(kMemoryRejoinFixedBytes + m.text.size());
  Writer w(&body);
  w.U16(m.memory_rank);
  w.U8(m.answer ? 1 : 0);
  w.Zeros(1);
  w.U32(m.attn_out_buffer);
  w.U16(static_cast<uint16_t>(m.text.size()));
  w.Zeros(6);
  body.insert(body.end(), m.text.begin(), m.text.end());
  return Frame(kMemoryRejoinMagic, body);
}

absl::StatusOr<MemoryRejoinMessage> DecodeMemoryRejoin(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "memory rejoin";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kMemoryRejoinMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  MemoryRejoinMessage m;
  ASSIGN_OR_RETURN(m.memory_rank, r.U16("memory_rank"));
  ASSIGN_OR_RETURN(m.answer, ReadBool(r, "answer", kWhat));
  RETURN_IF_ERROR(r.Reserved("reserved", 1));
  ASSIGN_OR_RETURN(m.attn_out_buffer, r.U32("attn_out_buffer"));
  ASSIGN_OR_RETURN(const uint16_t bytes, r.U16("text_bytes"));
  RETURN_IF_ERROR(r.Reserved("reserved", 6));
  RETURN_IF_ERROR(CheckRest(r, bytes, kWhat, "text_bytes", bytes, "text"));
  if (bytes > kMaxAddressBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory rejoin: text_bytes ", bytes, " must be <= ", kMaxAddressBytes));
  }
  if (bytes == 0 && !m.answer) {
    return absl::InvalidArgumentError("memory rejoin: a request needs the rank's address (text_bytes 0)");
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> text, r.Bytes("text", bytes));
  m.text.assign(text.begin(), text.end());
  RETURN_IF_ERROR(CheckNoNul(m.text, "memory rejoin", "text"));
  return m;
}

std::vector<uint8_t> EncodeHeadSplit(const HeadSplitMessage& m) {
  TANDEM_CHECK_MSG(m.text.size() <= kMaxAddressBytes, "head split text of ", m.text.size(), " bytes exceeds ",
                   kMaxAddressBytes);
  TANDEM_CHECK_MSG(m.ranks.size() <= 0xffff, "head split of ", m.ranks.size(), " ranks");
  std::vector<uint8_t> body;
  body.reserve(kHeadSplitFixedBytes + kHeadSplitRankBytes * m.ranks.size() + m.text.size());
  Writer w(&body);
  w.U64(m.split);
  w.U8(m.answer ? 1 : 0);
  w.Zeros(1);
  w.U16(static_cast<uint16_t>(m.ranks.size()));
  w.U16(static_cast<uint16_t>(m.text.size()));
  w.Zeros(2);
  for (const HeadSplitMessage::Rank& r : m.ranks) {
    w.U16(r.memory_rank);
    w.Zeros(2);
    w.U32(r.attn_out_buffer);
    w.U32(r.qkv_buffer);
  }
  body.insert(body.end(), m.text.begin(), m.text.end());
  return Frame(kHeadSplitMagic, body);
}

absl::StatusOr<HeadSplitMessage> DecodeHeadSplit(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "head split";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kHeadSplitMagic, kWhat));
  if (body.size() < kHeadSplitFixedBytes) RETURN_IF_ERROR(CheckBodySize(body, kHeadSplitFixedBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  HeadSplitMessage m;
  ASSIGN_OR_RETURN(m.split, r.U64("split"));
  if (m.split == 0) return absl::InvalidArgumentError("head split: split 0 at byte offset 16 must be >= 1");
  ASSIGN_OR_RETURN(m.answer, ReadBool(r, "answer", kWhat));
  RETURN_IF_ERROR(r.Reserved("reserved", 1));
  ASSIGN_OR_RETURN(const uint16_t count, r.U16("rank_count"));
  ASSIGN_OR_RETURN(const uint16_t bytes, r.U16("text_bytes"));
  RETURN_IF_ERROR(r.Reserved("reserved", 2));
  if (m.answer ? count != 0 : (count == 0 || bytes != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head split: ", m.answer ? "an answer" : "a request", " with rank_count ", count, " and text_bytes ",
        bytes, m.answer ? " (an answer names no ranks)" : " (a request names ranks and has no text)"));
  }
  if (bytes > kMaxAddressBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("head split: text_bytes ", bytes, " must be <= ", kMaxAddressBytes));
  }
  const size_t records = kHeadSplitRankBytes * count;
  if (records + bytes != r.remaining()) {
    return absl::InvalidArgumentError(
        absl::StrCat("head split: rank_count ", count, " and text_bytes ", bytes, " need a body of ",
                     kHeadSplitFixedBytes + records + bytes, " bytes, not ", body.size()));
  }
  m.ranks.reserve(count);
  for (uint16_t i = 0; i < count; ++i) {
    HeadSplitMessage::Rank rank;
    ASSIGN_OR_RETURN(rank.memory_rank, r.U16("memory_rank"));
    RETURN_IF_ERROR(r.Reserved("reserved", 2));
    ASSIGN_OR_RETURN(rank.attn_out_buffer, r.U32("attn_out_buffer"));
    ASSIGN_OR_RETURN(rank.qkv_buffer, r.U32("qkv_buffer"));
    if (!m.ranks.empty() && rank.memory_rank <= m.ranks.back().memory_rank) {
      return absl::InvalidArgumentError(absl::StrCat("head split: rank ", i, ": memory_rank ",
                                                     rank.memory_rank, " must be above the one before it (",
                                                     m.ranks.back().memory_rank, ")"));
    }
    m.ranks.push_back(rank);
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> text, r.Bytes("text", bytes));
  m.text.assign(text.begin(), text.end());
  RETURN_IF_ERROR(CheckNoNul(m.text, "head split", "text"));
  return m;
}

absl::StatusOr<ComputeHelloMessage> DecodeComputeHello(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "compute hello";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kComputeHelloMagic, kWhat));
  RETURN_IF_ERROR(CheckBodySize(body, kComputeHelloBodyBytes, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ComputeHelloMessage m;
  ASSIGN_OR_RETURN(m.compute_rank, r.U16("compute_rank"));
  ASSIGN_OR_RETURN(m.compute_ranks, r.U16("compute_ranks"));
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  if (m.compute_ranks < 2 || m.compute_ranks > kMaxMicroBatches || m.compute_rank < 1 ||
      m.compute_rank >= m.compute_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("compute hello: compute_rank ", m.compute_rank, " of compute_ranks ", m.compute_ranks,
                     " must satisfy 1 <= ", "compute_rank < compute_ranks <= ", kMaxMicroBatches));
  }
  return m;
}

std::vector<uint8_t> EncodeReplicaStep(const ReplicaStepMessage& m) {
  const std::vector<uint8_t> plan = EncodeStepPlan(m.plan);
  TANDEM_CHECK(m.tokens.size() <= std::numeric_limits<uint32_t>::max() / 8);
  std::vector<uint8_t> body;
  body.reserve(kReplicaStepFixedBytes + 4 * m.tokens.size() + plan.size());
  Writer w(&body);
  w.U32(static_cast<uint32_t>(m.tokens.size()));
  w.Zeros(4);
  for (int32_t t : m.tokens) w.I32(t);
  body.insert(body.end(), plan.begin(), plan.end());
  return Frame(kReplicaStepMagic, body);
}

absl::StatusOr<ReplicaStepMessage> DecodeReplicaStep(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "replica step";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kReplicaStepMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ASSIGN_OR_RETURN(uint32_t count, r.U32("token_count"));
  RETURN_IF_ERROR(r.Reserved("reserved", 4));
  if (static_cast<uint64_t>(count) * 4 > r.remaining()) {
    return absl::DataLossError(absl::StrCat("replica step: truncated: token_count ", count, " needs ",
                                            static_cast<uint64_t>(count) * 4, " bytes at byte offset ",
                                            r.offset(), " but ", r.remaining(), " remain"));
  }
  ReplicaStepMessage m;
  m.tokens.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(m.tokens[i], r.I32("token"));
  }
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> plan, r.Bytes("plan", r.remaining()));
  absl::StatusOr<StepPlan> decoded = DecodeStepPlan(plan);
  if (!decoded.ok()) return Annotate(decoded.status(), "replica step");
  m.plan = *std::move(decoded);
  uint64_t rows = 0;
  for (const StepRequest& q : m.plan.requests) rows += static_cast<uint64_t>(q.q_len);
  if (rows != count) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica step: token_count ", count, " but the plan has ", rows, " rows"));
  }
  return m;
}

std::vector<uint8_t> EncodeReplicaResult(const ReplicaResultMessage& m) {
  TANDEM_CHECK(m.tokens.size() == m.logprobs.size() && (m.top.empty() || m.top.size() == m.tokens.size()) &&
               m.tokens.size() <= std::numeric_limits<uint32_t>::max() / (9 + 8 * kMaxTopLogprobs));
  std::vector<uint8_t> body;
  body.reserve(kReplicaResultFixedBytes + 8 * m.tokens.size());
  Writer w(&body);
  w.U64(m.step_id);
  w.U8(m.micro_batch);
  w.U8(m.top.empty() ? 0 : 1);
  w.Zeros(2);
  w.U32(static_cast<uint32_t>(m.tokens.size()));
  for (int32_t t : m.tokens) w.I32(t);
  for (float f : m.logprobs) w.F32(f);
  for (const std::vector<TopLogprob>& alts : m.top) {
    TANDEM_CHECK(alts.size() <= static_cast<size_t>(kMaxTopLogprobs));
    w.U8(static_cast<uint8_t>(alts.size()));
  }
  for (const std::vector<TopLogprob>& alts : m.top) {
    for (const TopLogprob& a : alts) {
      w.I32(a.token);
      w.F32(a.logprob);
    }
  }
  return Frame(kReplicaResultMagic, body);
}

absl::StatusOr<ReplicaResultMessage> DecodeReplicaResult(absl::Span<const uint8_t> frame) {
  constexpr std::string_view kWhat = "replica result";
  ASSIGN_OR_RETURN(absl::Span<const uint8_t> body, Unframe(frame, kReplicaResultMagic, kWhat));
  Reader r(body, kFrameHeaderBytes, kWhat);
  ReplicaResultMessage m;
  ASSIGN_OR_RETURN(m.step_id, r.U64("step_id"));
  ASSIGN_OR_RETURN(m.micro_batch, r.U8("micro_batch"));
  const size_t has_top_at = r.offset();
  ASSIGN_OR_RETURN(uint8_t has_top, r.U8("has_top"));
  if (has_top > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica result: has_top ", has_top, " at byte offset ", has_top_at, " must be 0 or 1"));
  }
  RETURN_IF_ERROR(r.Reserved("reserved", 2));
  ASSIGN_OR_RETURN(uint32_t count, r.U32("count"));
  // Without alternatives the rest is exactly 8 bytes a token; with them at least 9.
  const uint64_t least = static_cast<uint64_t>(count) * (has_top ? 9 : 8);
  if (has_top ? least > r.remaining() : least != r.remaining()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica result: count ", count, " needs ", has_top ? "at least " : "", least,
                     " bytes at byte offset ", r.offset(), " but ", r.remaining(), " remain"));
  }
  m.tokens.resize(count);
  m.logprobs.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(m.tokens[i], r.I32("token"));
  }
  for (uint32_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(m.logprobs[i], r.F32("logprob"));
  }
  if (!has_top) return m;
  m.top.resize(count);
  uint64_t alternatives = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const size_t at = r.offset();
    ASSIGN_OR_RETURN(uint8_t n, r.U8("alternative count"));
    if (n > kMaxTopLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("replica result: token ", i, ": alternative count ", n,
                                                     " at byte offset ", at,
                                                     " must be <= ", kMaxTopLogprobs));
    }
    m.top[i].resize(n);
    alternatives += n;
  }
  if (alternatives * 8 != r.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat("replica result: ", alternatives, " alternatives need ",
                                                   alternatives * 8, " bytes at byte offset ", r.offset(),
                                                   " but ", r.remaining(), " remain"));
  }
  for (uint32_t i = 0; i < count; ++i) {
    for (size_t j = 0; j < m.top[i].size(); ++j) {
      const size_t at = r.offset();
      ASSIGN_OR_RETURN(m.top[i][j].token, r.I32("alternative token"));
      if (m.top[i][j].token < 0) {
        return absl::InvalidArgumentError(absl::StrCat("replica result: token ", i, ": alternative ", j,
                                                       " token ", m.top[i][j].token, " at byte offset ", at,
                                                       " must be >= 0"));
      }
      ASSIGN_OR_RETURN(m.top[i][j].logprob, r.F32("alternative logprob"));
    }
  }
  return m;
}

absl::StatusOr<uint32_t> PeekFrameMagic(absl::Span<const uint8_t> frame) {
  if (frame.size() < kFrameHeaderBytes) {
    return absl::DataLossError(absl::StrCat("frame: truncated: a frame header needs ", kFrameHeaderBytes,
                                            " bytes but ", frame.size(), " are present"));
  }
  Reader r(frame.subspan(0, 4), 0, "frame");
  ASSIGN_OR_RETURN(uint32_t magic, r.U32("magic"));
  switch (magic) {
    case kStepPlanMagic:
    case kLayerMessageMagic:
    case kHelloMagic:
    case kHelloReplyMagic:
    case kReleaseMagic:
    case kErrorMagic:
    case kByeMagic:
    case kStatsRequestMagic:
    case kMemoryStatsMagic:
    case kComputeHelloMagic:
    case kReplicaStepMagic:
    case kReplicaResultMagic:
    case kRestoreReplyMagic:
    case kHeartbeatMagic:
    case kHeartbeatReplyMagic:
    case kReplicaRingMagic:
    case kStepDiscardMagic:
    case kPersistedBlocksMagic:
    case kMemoryRejoinMagic:
    case kHeadSplitMagic:
      return magic;
    default:
      return absl::InvalidArgumentError(
          absl::StrFormat("unknown frame magic 0x%08x ('%s') at byte offset 0", magic, MagicText(magic)));
  }
}

ErrorMessage ErrorMessageFromStatus(const absl::Status& status) {
  ErrorMessage m;
  const auto code = static_cast<uint32_t>(status.code());
  if (status.ok()) {
    m.code = static_cast<uint32_t>(absl::StatusCode::kUnknown);
    m.message = "(an OK status sent as an error)";
    return m;
  }
  m.code = code >= kMinStatusCode && code <= kMaxStatusCode
               ? code
               : static_cast<uint32_t>(absl::StatusCode::kUnknown);
  m.message = std::string(status.message().substr(0, kMaxErrorMessageBytes));
  std::replace(m.message.begin(), m.message.end(), '\0', '?');
  return m;
}

absl::Status StatusFromErrorMessage(const ErrorMessage& error) {
  if (error.code < kMinStatusCode || error.code > kMaxStatusCode) {
    return absl::UnknownError(absl::StrCat("error code ", error.code, ": ", error.message));
  }
  return absl::Status(static_cast<absl::StatusCode>(error.code), error.message);
}

}  // namespace tandem
