// The hardware-free half of the verbs transport (verbs_transport.cc): the frames it sends over its
// control channel, and the layout arithmetic (doorbell slots, write bounds, staging growth, which
// registered buffer holds a pointer, dma-buf page spans). Nothing here touches a device, so the
// unit tests reach all of it on any machine.
//
// Frames are written byte by byte, little-endian, at fixed offsets (no struct is copied to the
// wire). Each starts with an 8-byte header and ends with a CRC-32C of everything before it:
//
//   offset  size  field        notes
//   ------  ----  -----------  -------------------------------------------------------------------
//        0     4  magic        4 ASCII bytes: 'T','V','Q','P' QP info, 'T','V','B','D' buffer
//                              descriptor, 'T','V','R','Y' ready
//        4     2  version      u16, kVerbsWireVersion (1)
//        6     2  frame_bytes  u16, the whole frame including the CRC: 40, 48 or 16
//
//   QP info (40 bytes): how to reach the sender's queue pair for this connection.
//        8     4  qp_num       u32, 1 .. 2^24 - 1
//       12     4  psn          u32, < 2^24: the sender's first send PSN
//       16     2  lid          u16, 0 on RoCE
//       18     1  port         u8, >= 1
//       19     1  mtu          u8, enum ibv_mtu of the sender's port: 1 (256) .. 5 (4096)
//       20    16  gid          the sender's GID at its gid_index
//       36     4  crc32c
//
//   Buffer descriptor (48 bytes): a buffer the sender registered, and where its doorbell is.
//        8     4  buffer       u32, the id
//       12     4  rkey         u32
//       16     8  addr         u64, != 0; addr + bytes does not overflow
//       24     8  bytes        u64, >= 1
//       32     8  doorbell     u64, address of the buffer's 8-byte doorbell slot, != 0, 8-aligned
//       40     4  doorbell_rkey
//       44     4  crc32c
//
//   Ready (16 bytes): the sender's QP has reached RTR (it accepts writes from us) and RTS.
//        8     4  qp_num       u32, the sender's QP, as in its QP info
//       12     4  crc32c
//
// Decoding checks, in order: length >= 8 (DataLoss "length"), magic (InvalidArgument "magic"),
// version (InvalidArgument "version"), frame_bytes (DataLoss "frame_bytes"), the length again
// (DataLoss "length"), the CRC (DataLoss "crc32c"), then each field (InvalidArgument naming it).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tandem::transport::verbs {

inline constexpr uint16_t kVerbsWireVersion = 1;
inline constexpr uint32_t kQpInfoMagic = 0x50515654;      // 'T','V','Q','P'
inline constexpr uint32_t kDescriptorMagic = 0x44425654;  // 'T','V','B','D'
inline constexpr uint32_t kReadyMagic = 0x59525654;       // 'T','V','R','Y'
inline constexpr size_t kQpInfoFrameBytes = 40;
inline constexpr size_t kDescriptorFrameBytes = 48;
inline constexpr size_t kReadyFrameBytes = 16;

// One side of a reliable connection: what the other side needs for its RTR transition.
struct QpInfo {
  uint32_t qp_num = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t port = 1;
  uint8_t mtu = 0;  // enum ibv_mtu
  std::array<uint8_t, 16> gid{};
  bool operator==(const QpInfo&) const = default;
};

struct BufferDescriptor {
  uint32_t buffer = 0;
  uint32_t rkey = 0;
  uint64_t addr = 0;
  uint64_t bytes = 0;
  uint64_t doorbell = 0;  // address of the doorbell slot of this buffer
  uint32_t doorbell_rkey = 0;
  bool operator==(const BufferDescriptor&) const = default;
};

struct ReadyFrame {
  uint32_t qp_num = 0;
  bool operator==(const ReadyFrame&) const = default;
};

// Field checks (InvalidArgument naming the field); the decoders run them too.
absl::Status ValidateQpInfo(const QpInfo& info);
absl::Status ValidateDescriptor(const BufferDescriptor& d);

// The encoders write whatever they are given (so tests can build invalid frames).
std::vector<uint8_t> EncodeQpInfo(const QpInfo& info);
std::vector<uint8_t> EncodeDescriptor(const BufferDescriptor& d);
std::vector<uint8_t> EncodeReady(const ReadyFrame& r);

absl::StatusOr<QpInfo> DecodeQpInfo(absl::Span<const uint8_t> frame);
absl::StatusOr<BufferDescriptor> DecodeDescriptor(absl::Span<const uint8_t> frame);
absl::StatusOr<ReadyFrame> DecodeReady(absl::Span<const uint8_t> frame);

// The magic of a frame that is one of ours (any of the three), else nullopt: the caller's
// messages pass through untouched.
std::optional<uint32_t> OurMagic(absl::Span<const uint8_t> message);

// ---- Layout ----------------------------------------------------------------------------------

// One page of 64-bit doorbells per process; buffer `id` owns slot id % kDoorbellSlots.
inline constexpr uint32_t kDoorbellSlots = 512;
inline constexpr size_t kDoorbellPageBytes = kDoorbellSlots * sizeof(uint64_t);
inline constexpr uint32_t DoorbellSlot(uint32_t id) { return id % kDoorbellSlots; }
inline constexpr uint64_t DoorbellOffset(uint32_t id) {
  return uint64_t{DoorbellSlot(id)} * sizeof(uint64_t);
}

// Whether `id` may be registered next to `registered`: AlreadyExists for the same id,
// InvalidArgument naming the other buffer when both would share a doorbell slot.
absl::Status CheckDoorbellSlotFree(uint32_t id, absl::Span<const uint32_t> registered);

// [offset, offset + length) inside a buffer of `buffer_bytes`, without overflow; InvalidArgument
// naming offset, length and the buffer size otherwise.
absl::Status CheckWriteBounds(uint64_t offset, uint64_t length, uint64_t buffer_bytes);

// The staging capacity to hold `needed` bytes: `current` when it suffices, else the next power of
// two >= needed, at least kMinStagingBytes (needed itself past 2^62).
inline constexpr size_t kMinStagingBytes = size_t{1} << 20;
size_t StagingBytesFor(size_t current, size_t needed);

// RDMA WRITE work requests a payload of `bytes` takes when one request carries at most
// `max_chunk` bytes (the port's max_msg_sz): 0 for an empty payload.
uint64_t PayloadChunks(uint64_t bytes, uint64_t max_chunk);

// A registered local range; FindContaining returns the one holding all of [addr, addr + bytes)
// (bytes may be 0: the range must hold addr), or nullopt.
struct LocalRange {
  uint32_t id = 0;
  uint64_t base = 0;
  uint64_t bytes = 0;
};
std::optional<LocalRange> FindContaining(absl::Span<const LocalRange> ranges, uint64_t addr, uint64_t bytes);

// A dma-buf export must cover whole host pages of one allocation. For [base, base + bytes) inside
// the allocation [alloc_base, alloc_base + alloc_bytes): the page-aligned span to export and the
// offset of `base` inside it. InvalidArgument if the range leaves the allocation, FailedPrecondition
// if the page-aligned span does (then the caller falls back to another registration).
struct DmabufSpan {
  uint64_t base = 0;    // page-aligned
  uint64_t bytes = 0;   // multiple of the page
  uint64_t offset = 0;  // of the registered range inside the export
};
absl::StatusOr<DmabufSpan> DmabufSpanFor(uint64_t base, uint64_t bytes, uint64_t alloc_base,
                                         uint64_t alloc_bytes, uint64_t page);

}  // namespace tandem::transport::verbs
