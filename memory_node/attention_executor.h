// Attention on the device that owns the KV cache: the memory rank's half of the hot path
// (docs/architecture.md, "One layer of a decode step"), and the colocated engine's attention.
// Per layer it appends each row's K and V to the KV pool and computes the attention of each
// row's q over its request's context.
//
//   BeginStep(batch)                 // once per step: where rows go, what each request reads
//   for each layer: Layer(l, qkv, out)
//
// KV layout is the executor's business: token-granular slots (memory_node/kv_slot_allocator.h
// hands them out), one K and one V array per layer indexed by slot. The CPU executor keeps fp32
// in host memory; the CUDA executor bf16 on its device, with the decode kernel for single-row
// requests and the prefill kernel for chunks. Both can run a layer in two parts, attention over
// the context before the new rows' k,v arrive (LayerContext, LayerNew: pipeline.q_first).
//
// Thread safety: one thread drives an executor.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/backend_buffer.h"
#include "common/dtype.h"

namespace tandem {

// One step's rows as attention sees them. Requests are ordered with every single-row request
// (decode, or a one-token prefill chunk) first: requests [0, num_single) have one row each.
//
// Shared prefixes (cascade attention): a group's keys are read once for all of its rows, and each
// request reads only its own suffix; the partial states are merged by log-sum-exp. Group g reads
// group_kv_slots[group_kv_indptr[g] .. group_kv_indptr[g+1]) for the batch rows
// group_rows[group_row_indptr[g] .. group_row_indptr[g+1]) (ascending), and every one of those
// rows is at a position after all of those keys (no mask). Groups nest: group_parent[g] is -1 or
// an earlier group whose rows include g's, and g's keys continue where its parent's end.
// group_level[g] is 0 for a group without parent, else its parent's level + 1; a row belongs to at
// most one group per level. kv_indptr/kv_slots then hold, for each request, only the keys after its
// deepest group's (its suffix: at least its own new rows). Without groups, the whole context.
struct AttentionBatch {
  std::vector<int32_t> new_slots;  // (T) slot that row t's K and V are written to
  std::vector<int32_t> q_indptr;   // (R + 1) rows of request r: [q_indptr[r], q_indptr[r+1])
  std::vector<int32_t> kv_indptr;  // (R + 1) keys of request r: kv_slots[kv_indptr[r] ..)
  std::vector<int32_t> kv_slots;   // slots of each request's keys (context or suffix), in position order
  int64_t num_single = 0;
  int64_t max_kv_len = 0, max_q_len = 0;
  std::vector<int32_t> group_kv_indptr;   // (G + 1)
  std::vector<int32_t> group_kv_slots;    // each group's own prefix keys, in position order
  std::vector<int32_t> group_row_indptr;  // (G + 1)
  std::vector<int32_t> group_rows;        // batch rows of each group
  std::vector<int32_t> group_parent;      // (G)
  std::vector<int32_t> group_level;       // (G)
  int64_t max_group_rows = 0, max_group_kv = 0;

  int64_t num_tokens() const { return static_cast<int64_t>(new_slots.size()); }
  int64_t num_requests() const { return q_indptr.empty() ? 0 : static_cast<int64_t>(q_indptr.size()) - 1; }
  int64_t num_groups() const {
    return group_kv_indptr.empty() ? 0 : static_cast<int64_t>(group_kv_indptr.size()) - 1;
  }
  void Clear() {
    new_slots.clear();
    q_indptr.assign(1, 0);
    kv_indptr.assign(1, 0);
    kv_slots.clear();
    num_single = max_kv_len = max_q_len = 0;
    group_kv_indptr.assign(1, 0);
    group_kv_slots.clear();
    group_row_indptr.assign(1, 0);
    group_rows.clear();
    group_parent.clear();
    group_level.clear();
    max_group_rows = max_group_kv = 0;
  }
};

// The model dimensions attention needs, and the step limits that size scratch memory.
struct AttentionShape {
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t max_tokens = 0;    // rows per step at most
  int64_t max_requests = 0;  // requests per step at most
  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  // A qkv row: [q (q_dim) | k (kv_dim) | v (kv_dim)].
  int64_t qkv_width() const { return q_dim() + 2 * kv_dim(); }
  // KV bytes of one token over all layers.
  int64_t kv_bytes_per_token(int64_t elem) const { return 2 * num_layers * kv_dim() * elem; }
};

struct KvPoolOptions {
  int64_t capacity_tokens = 0;    // slots; 0: sized from free memory
  double memory_fraction = 0.9;   // share of free memory given to the KV pool when sized
  int64_t max_useful_tokens = 0;  // cap on automatic sizing (e.g. batch × context); 0: none
};

class AttentionExecutor {
 public:
  virtual ~AttentionExecutor() = default;
  virtual int64_t kv_capacity() const = 0;  // KV slots
  virtual std::string device() const = 0;   // "cpu", "cuda:0 (NVIDIA H200)"
  virtual DType dtype() const = 0;          // of qkv rows and outputs: f32 (cpu), bf16 (cuda)
  virtual const AttentionShape& shape() const = 0;

  // Takes the step's metadata (the CUDA executor uploads it once). InvalidArgument if the batch
  // exceeds the shape's limits or names a slot outside the pool.
  virtual absl::Status BeginStep(const AttentionBatch& batch) = 0;
  // Layer `layer` of the step: K and V of row t of qkv (T, qkv_width) go to slot new_slots[t];
  // out (T, q_dim) gets each row's attention output. Pointers are in the executor's memory (host
  // for cpu, device for cuda); the CUDA executor enqueues on its stream and does not synchronise.
  virtual absl::Status Layer(int64_t layer, const void* qkv, void* out) = 0;

  // q-first (pipeline.q_first; docs/architecture.md, "q-first overlap inside a layer"): layer
  // `layer` in two calls, the same result as Layer up to float rounding, so that attention over
  // the context starts while the new rows' keys are still on their way.
  //   LayerContext(layer, q): q (T, q_dim) rows. Each row's attention over the keys its request
  //     had before this step (the context before its new rows, and its groups' shared prefixes),
  //     kept as a partial state with its log-sum-exp. Reads the KV pool, writes nothing to it.
  //   LayerNew(layer, kv, out): kv (T, 2·kv_dim), [k | v] per row. Appends them to new_slots, runs
  //     each row's attention over its request's new keys (causal within the step), merges that
  //     with the context state by log-sum-exp and writes out (T, q_dim).
  // Both in the order written, once per layer, after BeginStep. A step where the split does not
  // hold (a request's keys do not end with its new rows' slots, or a context or shared-prefix key
  // is one of the step's new slots) runs whole in LayerNew: LayerContext then only keeps q.
  // The CUDA executor enqueues both on its stream like Layer: the context part's state (output
  // and log-sum-exp) stays on the device, and nothing synchronises between the two calls.
  // Unimplemented where SupportsSplitLayer() is false.
  virtual bool SupportsSplitLayer() const { return false; }
  // Says that this executor's steps from now on run as LayerContext + LayerNew (a memory rank
  // with pipeline.q_first), so that BeginStep prepares each step's split with the rest of the
  // step. The CUDA executor then sizes the split's scratch and uploads its metadata in BeginStep
  // (which may synchronise) rather than in the step's first LayerContext, which on the device
  // path is enqueued behind a device-side wait. Optional: without it the first LayerContext of a
  // step prepares the split. Lanes created afterwards inherit it.
  virtual void ExpectSplitLayers() {}
  virtual absl::Status LayerContext(int64_t layer, const void* q) {
    (void)layer;
    (void)q;
    return absl::UnimplementedError(absl::StrCat("pipeline.q_first: no split attention layer on ", device()));
  }
  virtual absl::Status LayerNew(int64_t layer, const void* kv, void* out) {
    (void)layer;
    (void)kv;
    (void)out;
    return absl::UnimplementedError(absl::StrCat("pipeline.q_first: no split attention layer on ", device()));
  }

  // Where qkv and out live, for staging to and from the network (a memory rank's buffers).
  virtual MemorySpace& memory() = 0;
  // The CUDA stream Layer enqueues on (cudaStream_t), so that a transport's device-side waits and
  // writes order with it; nullptr on the CPU.
  virtual void* stream() const { return nullptr; }

  // A lane: another executor over the same KV pool (and, on CUDA, the same stream), with step
  // metadata and scratch of its own, so that several micro-batches of a step can be begun and
  // then run layer by layer in turn (pipelining). Their requests are disjoint, and their layers run
  // in the order they are called. Layer timing is per lane. This executor must outlive its lanes.
  virtual absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateLane() = 0;

  // KV tiers (memory_node/kv_tiers.h): copies the K and V of `slots` over every layer to `out`, or
  // from `in`: per layer, the K rows of the slots in order, then their V rows (kv_dim elements of
  // dtype() each). The writes may read `in` asynchronously (the CUDA executor, from pinned memory):
  // keep it unchanged until memory().Synchronize().
  virtual absl::Status ReadSlots(std::span<const int32_t> slots, uint8_t* out) const {
    (void)slots;
    (void)out;
    return absl::UnimplementedError(absl::StrCat("KV tiers: no slot copy on ", device()));
  }
  virtual absl::Status WriteSlots(std::span<const int32_t> slots, const uint8_t* in) {
    (void)slots;
    (void)in;
    return absl::UnimplementedError(absl::StrCat("KV tiers: no slot copy on ", device()));
  }
  // A save that need not wait (KV tiers on a GPU): starts copying the K and V of `slots` into
  // `out` (ReadSlots' layout) and returns a ticket; FinishReadSlots(ticket), callable from another
  // thread, waits until `out` holds them. `out` must stay valid until then; work enqueued after
  // StartReadSlots returns may overwrite the slots. AsyncReads() says whether the copy can still be
  // running when StartReadSlots returns (else it copied at once, as here).
  virtual bool AsyncReads() const { return false; }
  virtual absl::StatusOr<int64_t> StartReadSlots(std::span<const int32_t> slots, uint8_t* out) {
    if (absl::Status st = ReadSlots(slots, out); !st.ok()) return st;
    return int64_t{0};
  }
  virtual absl::Status FinishReadSlots(int64_t ticket) {
    (void)ticket;
    return absl::OkStatus();
  }
  // One layer of WriteSlots (a layer-wise restore): `in` is the whole block in ReadSlots' layout,
  // and only layer `layer`'s K and V rows are copied into the pool.
  virtual absl::Status WriteSlotsLayer(std::span<const int32_t> slots, int64_t layer, const uint8_t* in) {
    (void)slots;
    (void)layer;
    (void)in;
    return absl::UnimplementedError(absl::StrCat("KV tiers: no slot copy on ", device()));
  }

  // kv.store_pre_rope (a shifted restore, memory_node/kv_tiers.h): turns the K rows of `slots`, in
  // every layer, from the rotary angle of from_positions[i] to that of to_positions[i]. Each pair
  // (k[j], k[j + d/2]) of every KV head turns by theta_j(to) - theta_j(from), theta_j(p) =
  // float(p) * inv_freq[j] in fp32 exactly as the RoPE kernels compute it (kernels/cpu/ops.h), so
  // keys written at one position become the keys of the same token at the other (up to rounding).
  // V rows are not touched; a row whose two positions are equal stays bit-identical. inv_freq holds
  // head_dim / 2 values; positions >= 0. InvalidArgument for mismatched lengths or a slot outside
  // the pool.
  virtual absl::Status RotateKeys(std::span<const int32_t> slots, std::span<const int32_t> from_positions,
                                  std::span<const int32_t> to_positions, std::span<const float> inv_freq) {
    (void)slots;
    (void)from_positions;
    (void)to_positions;
    (void)inv_freq;
    return absl::UnimplementedError(absl::StrCat("kv.store_pre_rope: no key rotation on ", device()));
  }

  // kv.store_pre_rope (a shifted restore): copies the K and V rows of slots src[i] to slots dst[i],
  // in every layer, inside the pool (no host copy; stream-ordered on a GPU). The dst slots must be
  // distinct and none of them a src slot. InvalidArgument for mismatched lengths or a slot outside
  // the pool.
  virtual absl::Status CopySlots(std::span<const int32_t> src, std::span<const int32_t> dst) {
    (void)src;
    (void)dst;
    return absl::UnimplementedError(absl::StrCat("kv.store_pre_rope: no slot copy on ", device()));
  }

  // Whether reading `prefix_tokens` shared keys once for `rows` rows (then merging) is faster here
  // than each row reading them itself: the measured crossover of kv.prefix_sharing: auto.
  virtual bool CascadePays(int64_t rows, int64_t prefix_tokens) const = 0;

  // Layer timing, a memory rank's share of the pipeline report: the caller brackets each Layer
  // call with MarkLayerStart / MarkLayerEnd, and TakeLayerTimeNs returns (and clears) the time
  // between the brackets since its last call. Host time here (the CPU executor's Layer runs on
  // the calling thread); the CUDA executor records events on its stream instead and returns device
  // time, so it must be called once the work enqueued so far has run.
  virtual absl::Status MarkLayerStart() {
    layer_start_ = std::chrono::steady_clock::now();
    return absl::OkStatus();
  }
  virtual absl::Status MarkLayerEnd() {
    layer_ns_ += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - layer_start_)
            .count());
    return absl::OkStatus();
  }
  virtual absl::StatusOr<uint64_t> TakeLayerTimeNs() {
    const uint64_t ns = layer_ns_;
    layer_ns_ = 0;
    return ns;
  }

 private:
  std::chrono::steady_clock::time_point layer_start_;
  uint64_t layer_ns_ = 0;
};

// Checks a batch against an executor's limits and pool (group arrays included): InvalidArgument
// naming what is wrong.
absl::Status CheckAttentionBatch(const AttentionBatch& batch, const AttentionShape& shape, int64_t num_slots);

// CopySlots' arguments: as many src as dst slots, each inside the pool, the dst slots distinct and
// none of them a src slot (InvalidArgument naming the slot otherwise).
absl::Status CheckSlotCopy(std::span<const int32_t> src, std::span<const int32_t> dst, int64_t num_slots);

// RotateKeys' arguments other than the slots' range: one from and one to position per slot, each
// >= 0, and head_dim / 2 inverse frequencies.
absl::Status CheckRotation(const AttentionShape& shape, std::span<const int32_t> slots,
                           std::span<const int32_t> from_positions, std::span<const int32_t> to_positions,
                           std::span<const float> inv_freq);

// fp32 KV in host memory; sized from MemAvailable when capacity_tokens is 0.
absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateCpuAttentionExecutor(const AttentionShape& shape,
                                                                              const KvPoolOptions& kv);
// bf16 KV on CUDA device `device` (made current), work on `stream` (a cudaStream_t; nullptr: the
// executor creates its own). Sized from cudaMemGetInfo's free memory when capacity_tokens is 0.
// Unavailable without the CUDA backend or the device; Unimplemented for a head_dim the kernels
// do not support (kernels::CudaAttentionUnsupported, kernels/cuda/device_choice.h).
absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateCudaAttentionExecutor(const AttentionShape& shape,
                                                                               const KvPoolOptions& kv,
                                                                               int device, void* stream);

}  // namespace tandem
