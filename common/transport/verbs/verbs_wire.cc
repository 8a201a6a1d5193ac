#include "common/transport/verbs/verbs_wire.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/byte_writer.h"
#include "common/status.h"
#include "common/wire.h"

namespace tandem::transport::verbs {
namespace {

constexpr size_t kHeaderBytes = 8;

using Writer = ByteWriter;

uint64_t Le(absl::Span<const uint8_t> b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{b[at + i]} << (8 * i);
  return v;
}
uint16_t U16(absl::Span<const uint8_t> b, size_t at) { return static_cast<uint16_t>(Le(b, at, 2)); }
uint32_t U32(absl::Span<const uint8_t> b, size_t at) { return static_cast<uint32_t>(Le(b, at, 4)); }
uint64_t U64(absl::Span<const uint8_t> b, size_t at) { return Le(b, at, 8); }

std::vector<uint8_t> Begin(uint32_t magic, size_t frame_bytes) {
  std::vector<uint8_t> out;
  out.reserve(frame_bytes);
  Writer w(&out);
  w.U32(magic);
  w.U16(kVerbsWireVersion);
  w.U16(static_cast<uint16_t>(frame_bytes));
  return out;
}

std::vector<uint8_t> Finish(std::vector<uint8_t> out) {
  const uint32_t crc = Crc32c(out);
  Writer(&out).U32(crc);
  return out;
}

// Header, length and CRC of a frame named `what` (e.g. "verbs QP info frame").
absl::Status CheckFrame(absl::Span<const uint8_t> f, const char* what, uint32_t magic, size_t frame_bytes) {
  if (f.size() < kHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat(what, ": length ", f.size(), " is shorter than the ", kHeaderBytes, "-byte header"));
  }
  if (U32(f, 0) != magic) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: magic 0x%08x, expected 0x%08x", what, U32(f, 0), magic));
  }
  if (U16(f, 4) != kVerbsWireVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": version ", U16(f, 4), ", this build speaks version ", kVerbsWireVersion));
  }
  if (U16(f, 6) != frame_bytes) {
    return absl::DataLossError(absl::StrCat(what, ": frame_bytes ", U16(f, 6), ", expected ", frame_bytes));
  }
  if (f.size() != frame_bytes) {
    return absl::DataLossError(absl::StrCat(what, ": length ", f.size(), ", expected ", frame_bytes));
  }
  const uint32_t want = U32(f, frame_bytes - 4);
  const uint32_t got = Crc32c(f.subspan(0, frame_bytes - 4));
  if (want != got) {
    return absl::DataLossError(
        absl::StrFormat("%s: crc32c 0x%08x does not match the bytes (0x%08x)", what, want, got));
  }
  return absl::OkStatus();
}

constexpr uint32_t kMax24 = (1u << 24) - 1;

}  // namespace

absl::Status ValidateQpInfo(const QpInfo& info) {
  if (info.qp_num == 0 || info.qp_num > kMax24) {
    return absl::InvalidArgumentError(
        absl::StrCat("verbs QP info: qp_num ", info.qp_num, " is not in [1, 2^24)"));
  }
  if (info.psn > kMax24) {
    return absl::InvalidArgumentError(absl::StrCat("verbs QP info: psn ", info.psn, " is not below 2^24"));
  }
  if (info.port == 0) return absl::InvalidArgumentError("verbs QP info: port 0 (ports count from 1)");
  if (info.mtu < 1 || info.mtu > 5) {
    return absl::InvalidArgumentError(
        absl::StrCat("verbs QP info: mtu ", info.mtu, " is not an ibv_mtu (1 = 256 .. 5 = 4096)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDescriptor(const BufferDescriptor& d) {
  const std::string what = absl::StrCat("verbs descriptor of buffer ", d.buffer);
  if (d.bytes == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": bytes 0"));
  if (d.addr == 0) return absl::InvalidArgumentError(absl::StrCat(what, ": addr 0"));
  if (d.addr > std::numeric_limits<uint64_t>::max() - d.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": addr ", d.addr, " + bytes ", d.bytes, " overflows"));
  }
  if (d.doorbell == 0 || d.doorbell % sizeof(uint64_t) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": doorbell address ", d.doorbell, " is not a non-null, 8-aligned address"));
  }
  return absl::OkStatus();
}

std::vector<uint8_t> EncodeQpInfo(const QpInfo& info) {
  std::vector<uint8_t> out = Begin(kQpInfoMagic, kQpInfoFrameBytes);
  Writer w(&out);
  w.U32(info.qp_num);
  w.U32(info.psn);
  w.U16(info.lid);
  w.U8(info.port);
  w.U8(info.mtu);
  w.Bytes(info.gid);
  return Finish(std::move(out));
}

std::vector<uint8_t> EncodeDescriptor(const BufferDescriptor& d) {
  std::vector<uint8_t> out = Begin(kDescriptorMagic, kDescriptorFrameBytes);
  Writer w(&out);
  w.U32(d.buffer);
  w.U32(d.rkey);
  w.U64(d.addr);
  w.U64(d.bytes);
  w.U64(d.doorbell);
  w.U32(d.doorbell_rkey);
  return Finish(std::move(out));
}

std::vector<uint8_t> EncodeReady(const ReadyFrame& r) {
  std::vector<uint8_t> out = Begin(kReadyMagic, kReadyFrameBytes);
  Writer(&out).U32(r.qp_num);
  return Finish(std::move(out));
}

absl::StatusOr<QpInfo> DecodeQpInfo(absl::Span<const uint8_t> f) {
  RETURN_IF_ERROR(CheckFrame(f, "verbs QP info frame", kQpInfoMagic, kQpInfoFrameBytes));
  QpInfo info;
  info.qp_num = U32(f, 8);
  info.psn = U32(f, 12);
  info.lid = U16(f, 16);
  info.port = f[18];
  info.mtu = f[19];
  std::memcpy(info.gid.data(), f.data() + 20, info.gid.size());
  RETURN_IF_ERROR(ValidateQpInfo(info));
  return info;
}

absl::StatusOr<BufferDescriptor> DecodeDescriptor(absl::Span<const uint8_t> f) {
  RETURN_IF_ERROR(CheckFrame(f, "verbs descriptor frame", kDescriptorMagic, kDescriptorFrameBytes));
  BufferDescriptor d;
  d.buffer = U32(f, 8);
  d.rkey = U32(f, 12);
  d.addr = U64(f, 16);
  d.bytes = U64(f, 24);
  d.doorbell = U64(f, 32);
  d.doorbell_rkey = U32(f, 40);
  RETURN_IF_ERROR(ValidateDescriptor(d));
  return d;
}

absl::StatusOr<ReadyFrame> DecodeReady(absl::Span<const uint8_t> f) {
  RETURN_IF_ERROR(CheckFrame(f, "verbs ready frame", kReadyMagic, kReadyFrameBytes));
  ReadyFrame r;
  r.qp_num = U32(f, 8);
  if (r.qp_num == 0 || r.qp_num > kMax24) {
    return absl::InvalidArgumentError(
        absl::StrCat("verbs ready frame: qp_num ", r.qp_num, " is not in [1, 2^24)"));
  }
  return r;
}

std::optional<uint32_t> OurMagic(absl::Span<const uint8_t> message) {
  if (message.size() < 4) return std::nullopt;
  const uint32_t magic = U32(message, 0);
  if (magic == kQpInfoMagic || magic == kDescriptorMagic || magic == kReadyMagic) return magic;
  return std::nullopt;
}

absl::Status CheckDoorbellSlotFree(uint32_t id, absl::Span<const uint32_t> registered) {
  for (uint32_t other : registered) {
    if (other == id) return absl::AlreadyExistsError(absl::StrCat("buffer ", id, " is registered"));
  }
  for (uint32_t other : registered) {
    if (DoorbellSlot(other) == DoorbellSlot(id)) {
      return absl::InvalidArgumentError(absl::StrCat("buffer ", id, " shares doorbell slot ",
                                                     DoorbellSlot(id), " with buffer ", other,
                                                     " (ids must differ modulo ", kDoorbellSlots, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckWriteBounds(uint64_t offset, uint64_t length, uint64_t buffer_bytes) {
  if (offset > buffer_bytes || length > buffer_bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat("write of length ", length, " at offset ", offset,
                                                   " is outside the buffer of ", buffer_bytes, " bytes"));
  }
  return absl::OkStatus();
}

size_t StagingBytesFor(size_t current, size_t needed) {
  if (needed <= current) return current;
  if (needed > (size_t{1} << 62)) return needed;
  return std::max(kMinStagingBytes, std::bit_ceil(needed));
}

uint64_t PayloadChunks(uint64_t bytes, uint64_t max_chunk) {
  if (bytes == 0) return 0;
  if (max_chunk == 0) max_chunk = 1;
  return bytes / max_chunk + (bytes % max_chunk != 0 ? 1 : 0);
}

std::optional<LocalRange> FindContaining(absl::Span<const LocalRange> ranges, uint64_t addr, uint64_t bytes) {
  for (const LocalRange& r : ranges) {
    if (addr < r.base) continue;
    const uint64_t at = addr - r.base;
    if (bytes == 0 ? at < r.bytes : (at < r.bytes && bytes <= r.bytes - at)) return r;
  }
  return std::nullopt;
}

absl::StatusOr<DmabufSpan> DmabufSpanFor(uint64_t base, uint64_t bytes, uint64_t alloc_base,
                                         uint64_t alloc_bytes, uint64_t page) {
  if (page == 0 || !std::has_single_bit(page)) {
    return absl::InvalidArgumentError(absl::StrCat("page size ", page, " is not a power of two"));
  }
  if (bytes == 0 || base < alloc_base || base - alloc_base > alloc_bytes ||
      bytes > alloc_bytes - (base - alloc_base)) {
    return absl::InvalidArgumentError(absl::StrCat("range of ", bytes, " bytes at ", base,
                                                   " is not inside its allocation of ", alloc_bytes,
                                                   " bytes at ", alloc_base));
  }
  const uint64_t end = base + bytes;  // no overflow: inside the allocation
  const uint64_t start = base & ~(page - 1);
  if (end > std::numeric_limits<uint64_t>::max() - (page - 1)) {
    return absl::FailedPreconditionError("range ends within a page of the top of the address space");
  }
  const uint64_t stop = (end + page - 1) & ~(page - 1);
  if (start < alloc_base || stop - alloc_base > alloc_bytes) {
    return absl::FailedPreconditionError(absl::StrCat("the page-aligned span [", start, ", ", stop,
                                                      ") of the range leaves its allocation [", alloc_base,
                                                      ", ", alloc_base + alloc_bytes, ")"));
  }
  return DmabufSpan{.base = start, .bytes = stop - start, .offset = base - start};
}

}  // namespace tandem::transport::verbs
