// How attention is split over the memory ranks of a deployment (memory.partition; docs/architecture.md,
// "Attention partition"), and the column slices the head partition moves.
//
//   request  every request lives on one memory rank, which holds all KV heads of it; each rank
//            gets one contiguous range of the step's rows (the default);
//   head     every memory rank holds a slice of the KV heads of every request: rank m of M holds
//            KV heads [m·Hkv/M, (m+1)·Hkv/M) and the query heads of those GQA groups (G = H/Hkv
//            query heads per KV head), rounded down: the slices are equal when M divides Hkv and
//            otherwise differ by one KV head (8 KV heads over 3 ranks: 2, 3 and 3). Needs
//            Hkv >= M. After a memory rank is lost the k survivors split the heads again as
//            slices i of k (HeadSlice with num_ranks k). Every rank gets every row, but only its
//            columns.
//
// Column layout (elements). A q,k,v row is [q (H·d) | k (Hkv·d) | v (Hkv·d)] and an attention
// output row is H·d, heads in order. A slice of KV heads [b, e) packs its q,k,v row as [its q heads
// | its k heads | its v heads] ((e-b)·(G+2)·d elements), which is exactly the q,k,v row of a model
// with (e-b)·G query and e-b KV heads, so the attention executors run the slice unchanged with a
// smaller shape; its output row ((e-b)·G·d) is the query heads [b·G, e·G) of the full output row.
//
// Thread safety: all functions are pure (the copies run in the given MemorySpace's order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/backend_buffer.h"

namespace tandem {

// memory.partition. The values travel in the hello (common/wire.h).
enum class AttentionPartition : uint8_t { kRequest = 0, kHead = 1 };

// "request" or "head".
const char* AttentionPartitionName(AttentionPartition partition);
// The setting's value: "request" or "head"; anything else is InvalidArgument naming
// memory.partition and the choices.
absl::StatusOr<AttentionPartition> ParseAttentionPartition(std::string_view value);
// OK for the request partition; for the head partition InvalidArgument unless every memory rank
// gets a KV head: "memory.partition: head needs a KV head per memory rank: num_key_value_heads (2)
// < memory.ranks (3)".
absl::Status CheckAttentionPartition(AttentionPartition partition, int64_t num_kv_heads,
                                     int64_t num_memory_ranks);

// One memory rank's slice of a model's attention heads under the head partition (or, with
// num_ranks = 1, the whole model: the request partition's shape): slice `rank` of `num_ranks`
// slices of the KV heads, which are equal when num_ranks divides num_kv_heads and otherwise differ
// by one KV head (a re-partition over the ranks that survive a loss).
struct HeadSlice {
  int64_t num_heads = 1;     // H of the model
  int64_t num_kv_heads = 1;  // Hkv of the model; at least num_ranks
  int64_t head_dim = 1;      // d
  int64_t num_ranks = 1;     // M
  int64_t rank = 0;          // m in [0, M)

  int64_t kv_head_begin() const { return rank * num_kv_heads / num_ranks; }
  int64_t kv_head_end() const { return (rank + 1) * num_kv_heads / num_ranks; }
  int64_t group() const { return num_heads / num_kv_heads; }                       // G
  int64_t slice_kv_heads() const { return kv_head_end() - kv_head_begin(); }       // KV heads of the slice
  int64_t slice_heads() const { return slice_kv_heads() * group(); }               // query heads of the slice
  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }  // full row
  int64_t q_dim() const { return num_heads * head_dim; }                           // full output row
  int64_t slice_qkv_width() const { return (slice_heads() + 2 * slice_kv_heads()) * head_dim; }  // packed row
  int64_t slice_q_dim() const { return slice_heads() * head_dim; }  // packed output row
};

// Copies slice `slice.rank`'s columns of `rows` q,k,v rows into `packed`: three strided copies
// (its q, k and v heads), each of width slice_heads·d or slice_kv_heads·d elements of
// `elem_bytes` bytes. `qkv` holds rows of qkv_width() elements, `packed` receives rows of
// slice_qkv_width() elements. Both are in `memory` (its memory or its pinned host buffers);
// the copies run in its order. Errors are the MemorySpace's.
absl::Status PackHeadSlice(MemorySpace& memory, const HeadSlice& slice, int64_t rows, size_t elem_bytes,
                           const void* qkv, void* packed);
// The reverse for the attention output: `rows` rows of slice_q_dim() elements from `packed` go to
// the columns of its query heads, [kv_head_begin()·G·d, kv_head_end()·G·d), of `attn` (rows of
// q_dim() elements).
absl::Status UnpackHeadSlice(MemorySpace& memory, const HeadSlice& slice, int64_t rows, size_t elem_bytes,
                             const void* packed, void* attn);

}  // namespace tandem
