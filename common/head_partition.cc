#include "common/head_partition.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

const char* AttentionPartitionName(AttentionPartition partition) {
  return partition == AttentionPartition::kHead ? "head" : "request";
}

absl::StatusOr<AttentionPartition> ParseAttentionPartition(std::string_view value) {
  if (value == "request") return AttentionPartition::kRequest;
  if (value == "head") return AttentionPartition::kHead;
  return absl::InvalidArgumentError(
      absl::StrCat("memory.partition: expected request or head, got \"", ToAbsl(value), "\""));
}

absl::Status CheckAttentionPartition(AttentionPartition partition, int64_t num_kv_heads,
                                     int64_t num_memory_ranks) {
  if (partition != AttentionPartition::kHead) return absl::OkStatus();
  if (num_memory_ranks < 1 || num_kv_heads < num_memory_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory.partition: head needs a KV head per memory rank: "
                     "num_key_value_heads (",
                     num_kv_heads, ") < memory.ranks (", num_memory_ranks, ")"));
  }
  return absl::OkStatus();
}

absl::Status PackHeadSlice(MemorySpace& memory, const HeadSlice& s, int64_t rows, size_t elem_bytes,
                           const void* qkv, void* packed) {
  const size_t d = static_cast<size_t>(s.head_dim) * elem_bytes;
  const size_t src_pitch = static_cast<size_t>(s.qkv_width()) * elem_bytes;
  const size_t dst_pitch = static_cast<size_t>(s.slice_qkv_width()) * elem_bytes;
  const size_t q_width = static_cast<size_t>(s.slice_heads()) * d;
  const size_t kv_width = static_cast<size_t>(s.slice_kv_heads()) * d;
  const size_t q_all = static_cast<size_t>(s.num_heads) * d, kv_all = static_cast<size_t>(s.num_kv_heads) * d;
  const auto* src = static_cast<const uint8_t*>(qkv);
  auto* dst = static_cast<uint8_t*>(packed);
  const size_t n = static_cast<size_t>(rows);
  // Where its q heads and its k (v) heads start in a full row.
  const size_t q_at = static_cast<size_t>(s.kv_head_begin() * s.group()) * d;
  const size_t kv_at = static_cast<size_t>(s.kv_head_begin()) * d;
  // q heads, then k heads, then v heads of the slice.
  RETURN_IF_ERROR(memory.CopyStrided(dst, dst_pitch, src + q_at, src_pitch, q_width, n));
  RETURN_IF_ERROR(memory.CopyStrided(dst + q_width, dst_pitch, src + q_all + kv_at, src_pitch, kv_width, n));
  return memory.CopyStrided(dst + q_width + kv_width, dst_pitch, src + q_all + kv_all + kv_at, src_pitch,
                            kv_width, n);
}

absl::Status UnpackHeadSlice(MemorySpace& memory, const HeadSlice& s, int64_t rows, size_t elem_bytes,
                             const void* packed, void* attn) {
  const size_t width = static_cast<size_t>(s.slice_q_dim()) * elem_bytes;
  const size_t dst_pitch = static_cast<size_t>(s.q_dim()) * elem_bytes;
  const size_t at = static_cast<size_t>(s.kv_head_begin() * s.group() * s.head_dim) * elem_bytes;
  return memory.CopyStrided(static_cast<uint8_t*>(attn) + at, dst_pitch, packed, width, width,
                            static_cast<size_t>(rows));
}

}  // namespace tandem
