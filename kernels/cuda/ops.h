// CUDA backend ops (bf16 storage, fp32 math and accumulation), each the counterpart of a CPU
// reference in kernels/cpu/ops.h and compared with it by tests/gpu/*_test.cc.
//
// Conventions (as on the CPU):
//   * Raw pointers to device memory + a params struct + a stream. Shapes (rows, cols), row-major.
//   * Launchers validate their params (null pointers, non-positive sizes, unsupported head_dim)
//     and return InvalidArgument naming the field; launch errors become a Status with the call
//     site (kernels/cuda/cuda_check.h). They never synchronise the stream and never allocate:
//     scratch comes from the caller (sizes from the *WorkspaceBytes functions), so a step can be
//     captured in a CUDA graph.
//   * The residual stream is fp32 (it accumulates every layer's updates); GEMM inputs, the KV
//     cache and attention inputs/outputs are bf16; logits are fp32.
//   * Log-sum-exp values are natural logs of Σ exp(score), score = scale · q·k.
// This header is C++17 (it is included from .cu files).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels::cuda {

using bf16 = __nv_bfloat16;

// out(n, hidden) fp32 = table(ids[i], :). Ids outside [0, vocab) give a zero row: the caller
// validates ids on the host (the engine does, at submission).
struct EmbeddingParams {
  const int32_t* ids = nullptr;  // (n)
  const bf16* table = nullptr;   // (vocab, hidden)
  float* out = nullptr;          // (n, hidden)
  int64_t n = 0, vocab = 0, hidden = 0;
};
absl::Status Embedding(const EmbeddingParams& p, cudaStream_t stream);

// If delta != nullptr: residual += delta (fp32 math), in place. Then
// out = bf16(residual / sqrt(mean(residual²) + eps) * weight). Row sums in fp32.
// `out_rows`: when not null, only these rows (n_out of them) are normalised, into out(n_out, d)
// (used before the LM head, which needs only the rows that sample); the add covers all n rows.
struct AddRmsNormParams {
  float* residual = nullptr;     // (n, d)
  const bf16* delta = nullptr;   // (n, d) or nullptr
  const bf16* weight = nullptr;  // (d)
  bf16* out = nullptr;           // (n, d), or (n_out, d) with out_rows
  const int32_t* out_rows = nullptr;
  int64_t n = 0, d = 0, n_out = 0;
  float eps = 1e-5f;
};
absl::Status AddRmsNorm(const AddRmsNormParams& p, cudaStream_t stream);

// In-place rotate-half RoPE on bf16 q(n, heads, d) and k(n, kv_heads, d) with fp32 math:
// angle = float(position) * inv_freq[i] (fp32, like transformers), then cos/sin.
struct RopeParams {
  bf16* q = nullptr;
  bf16* k = nullptr;                   // may be null (rotate q only)
  const int32_t* positions = nullptr;  // (n)
  const float* inv_freq = nullptr;     // (head_dim / 2), from cpu::RopeInvFreq
  int64_t n = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t q_stride = 0, k_stride = 0;  // elements between rows; 0: packed
};
absl::Status Rope(const RopeParams& p, cudaStream_t stream);

// cpu::RopeShift on bf16 key caches (kv.store_pre_rope): rows[i] of k (every KV head) in each of
// `layers` layers (layer l's cache at k + l * layer_stride) turns from from_positions[i] to
// to_positions[i], fp32 math (cos/sin as cpu::RopeShiftAngles, products without FMA contraction),
// one bf16 rounding. Rows whose two positions are equal are not touched. Device pointers.
struct RopeShiftParams {
  bf16* k = nullptr;                        // (num_rows, num_kv_heads * head_dim) per layer
  const int32_t* rows = nullptr;            // (n), each in [0, num_rows): not checked on the device
  const int32_t* from_positions = nullptr;  // (n), >= 0
  const int32_t* to_positions = nullptr;    // (n), >= 0
  const float* inv_freq = nullptr;          // (head_dim / 2)
  int64_t n = 0, num_kv_heads = 0, head_dim = 0;
  int64_t layers = 1, layer_stride = 0;  // elements between layers' caches
};
absl::Status RopeShift(const RopeShiftParams& p, cudaStream_t stream);

// out(n, inter) = bf16(silu(gate) * up), gate_up(n, 2·inter) = [gate | up].
struct SiluMulParams {
  const bf16* gate_up = nullptr;
  bf16* out = nullptr;
  int64_t n = 0, inter = 0;
};
absl::Status SiluMul(const SiluMulParams& p, cudaStream_t stream);

// Copies the rows of k and v (each (n, kv_dim), row strides in elements) into the token-granular
// cache: k_cache(slots[i], :) = k(i, :), v_cache likewise. Caches are (num_slots, kv_dim).
struct KvAppendParams {
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;  // 0: packed (kv_dim)
  const int32_t* slots = nullptr;      // (n), each in [0, num_slots)
  bf16* k_cache = nullptr;
  bf16* v_cache = nullptr;
  int64_t n = 0, kv_dim = 0, num_slots = 0;
};
absl::Status KvAppend(const KvAppendParams& p, cudaStream_t stream);

// Rows copied inside a cache of `planes` planes (plane q at cache + q * plane_stride, rows of
// `width` elements): row dst[i] = row src[i] of every plane, i in [0, n) (a KV pool's layers' K and
// V planes: kv.store_pre_rope's rows reused at new positions). The dst rows must be distinct and
// none of them a src row (not checked on the device; rows outside [0, num_rows) are skipped).
// 16-byte copies where width and the pointers allow. The semantics of cpu::CopyRows.
struct CopyRowsParams {
  bf16* cache = nullptr;
  const int32_t* src = nullptr;  // device (n)
  const int32_t* dst = nullptr;  // device (n)
  int64_t n = 0, width = 0, num_rows = 0;
  int64_t planes = 1, plane_stride = 0;  // plane_stride >= num_rows * width when planes > 1
};
absl::Status CopyRows(const CopyRowsParams& p, cudaStream_t stream);

// Attention over token-granular KV for a ragged batch; same semantics as cpu::AttentionParams
// (request r: query rows [q_indptr[r], q_indptr[r+1]), keys kv_slots[kv_indptr[r] ..
// kv_indptr[r+1]) in position order, causal with the queries last; GQA head h reads KV head
// h / (num_heads / num_kv_heads)). head_dim 64 or 128. With causal == false (PrefillAttention
// only) every row sees all keys of its request: the semantics of cpu::PrefixAttention per request.
struct AttentionParams {
  const bf16* q = nullptr;             // (total_q, num_heads, head_dim)
  const bf16* k_cache = nullptr;       // (num_slots, num_kv_heads, head_dim)
  const bf16* v_cache = nullptr;       // (num_slots, num_kv_heads, head_dim)
  bf16* out = nullptr;                 // (total_q, num_heads, head_dim)
  float* lse = nullptr;                // (total_q, num_heads), optional
  const int32_t* q_indptr = nullptr;   // device (num_requests + 1)
  const int32_t* kv_indptr = nullptr;  // device (num_requests + 1)
  const int32_t* kv_slots = nullptr;   // device
  int64_t num_requests = 0, num_slots = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;
  int64_t max_kv_len = 0;  // host-known upper bound of any request's kv length (for planning)
  int64_t max_q_len = 0;   // host-known upper bound of any request's query rows
  // true: causal with the queries last (row i of a request with q_len rows and kv_len keys sees
  // keys 0 .. kv_len - q_len + i). false: no mask, every query row of a request sees all kv_len
  // keys and q_len may exceed kv_len. That is the shared-prefix part of cascade attention: a
  // "request" is a prefix group, its query rows are the gathered rows of the group's members
  // (GatherRows) and its keys are the prefix slots; the result (with lse) is then merged into the
  // members' own-suffix results by MergeStates. Read by PrefillAttention only: DecodeAttention
  // ignores it (a decode row is the last of its request and sees all of its keys either way).
  bool causal = true;
};

// Decode attention: every request has exactly one query row (q_indptr may be null: row r is
// request r). Long contexts are split across thread blocks (split-KV) and merged by log-sum-exp
// so that small batches still fill the GPU. `workspace` holds the partial results.
struct DecodePlan {
  int num_splits = 1;           // KV chunks per (request, kv head)
  int64_t workspace_bytes = 0;  // needed by DecodeAttention
};
DecodePlan PlanDecodeAttention(int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t max_kv_len, int num_sms);
absl::Status DecodeAttention(const AttentionParams& p, const DecodePlan& plan, void* workspace,
                             cudaStream_t stream);

// Prefill-chunk attention (many query rows per request, causal) on tensor cores. Works for any
// q_len >= 1, including a batch mixing chunks and single rows. With p.causal == false it is the
// prefix part of cascade attention (see AttentionParams::causal): any q_len and kv_len; a request
// with kv_len == 0 gets out = 0 and lse = -inf (the empty state), as cpu::PrefixAttention does.
// One CTA per (tile of 64 or 128 rows, head) of a request runs over the request's whole key range
// (no split-KV): a long prefix with few rows uses few SMs (64 rows, 32 heads: 32 CTAs). The caller
// may then split the prefix into several requests, each with its own copy of the rows
// (GatherRows), and merge their states with MergeStates (bench/prefix_attention_bench.cc: "split").
//
// Two kernels: `kMmaSync` (mma.sync, any GPU the build targets) and `kWgmma` (Hopper's warpgroup
// MMA: an sm_90 device and head_dim 128, for chunks of more than 64 rows). `kAuto` takes kWgmma
// where it can run and kMmaSync otherwise; asking for kWgmma where it cannot run is
// FailedPrecondition. Both give the same results up to fp32 summation order.
enum class PrefillKernel { kAuto, kMmaSync, kWgmma };
absl::Status PrefillAttention(const AttentionParams& p, cudaStream_t stream,
                              PrefillKernel kernel = PrefillKernel::kAuto);

// Cascade attention, the merge: in place, for i in [0, n): a = rows_a[i], b = rows_b[i],
//   (out[a], lse[a]) = merge((out[a], lse[a]), (out_b[b], lse_b[b]))   for every head,
// where merge is cpu::MergeAttentionStates' math: over disjoint key sets,
//   out = (e^{lse_a}·out_a + e^{lse_b}·out_b) / (e^{lse_a} + e^{lse_b}),
//   lse = log(e^{lse_a} + e^{lse_b}),
// in fp32 with the larger lse subtracted (weights e^{l - max}), then out rounded to bf16. An
// empty state (lse = -inf) contributes nothing and its out is not read: the other state is
// copied exactly (bits); both empty gives out = 0 and lse = -inf; a NaN lse propagates.
// Typical use: state a = each member row's attention over its own (suffix) keys, from
// DecodeAttention / PrefillAttention with lse; state b = its group's prefix state, from
// PrefillAttention with causal == false over the gathered rows (rows_b[i] = the row's index in
// the gathered batch). Preconditions (device data, not checked): the entries of rows_a are
// distinct (the merge is in place) and index rows of out/lse, those of rows_b rows of
// out_b/lse_b; a negative entry in either skips pair i. rows_a or rows_b may be null: identity
// (rows_a[i] = i, rows_b[i] = i). No row of out_b/lse_b that is read may be a row of out/lse
// that is written (out_b may point into out's buffer, e.g. to merge the upper half of a set of
// partial states into the lower half; out == out_b is rejected unless both row lists are given). Rows are
// (num_heads, head_dim) packed; lse rows (num_heads). n == 0 is a no-op (nothing else is checked then).
// 16-byte accesses where head_dim % 8 == 0 and out, out_b are 16-byte aligned, else 2-byte.
struct MergeStatesParams {
  bf16* out = nullptr;              // (rows of a, num_heads, head_dim), merged in place
  float* lse = nullptr;             // (rows of a, num_heads), natural log, in place
  const bf16* out_b = nullptr;      // (rows of b, num_heads, head_dim)
  const float* lse_b = nullptr;     // (rows of b, num_heads), natural log
  const int32_t* rows_a = nullptr;  // device (n), distinct; null: identity
  const int32_t* rows_b = nullptr;  // device (n); null: identity
  int64_t n = 0, num_heads = 0, head_dim = 0;
  // > 1: state b comes from a GQA-packed prefix launch (GatherRowsParams::pack): its row holds
  // the heads j-major, head g·b_pack + j (g < num_heads / b_pack, j < b_pack) stored at position
  // j·(num_heads / b_pack) + g. Must divide num_heads.
  int64_t b_pack = 1;
};
absl::Status MergeStates(const MergeStatesParams& p, cudaStream_t stream);

// dst(i, :) = src(rows[i], :) for i in [0, n); src rows are src_stride elements apart (0: packed,
// i.e. width), dst is packed (n, width). Used to collect the query rows of a prefix group's
// members (all heads of a row: width = num_heads · head_dim) into one "request" for
// PrefillAttention with causal == false. rows[i] must index a row of src (device data, not
// checked); a negative entry zero-fills dst row i. dst must not overlap src. n == 0 is a no-op.
// 16-byte accesses where width and src_stride are multiples of 8 and src, dst are 16-byte
// aligned, else 2-byte.
// pack > 1 (GQA packing for the shared-prefix launch): a row holds H = width / head_dim heads, and
// dst stores them j-major: dst head j·(H/pack) + g = src head g·pack + j. Seen as (n·pack, H/pack,
// head_dim), dst row i·pack + j, head g is query head g·pack + j of row i: the pack query heads
// that share KV head g (GQA) become rows of one KV head, so PrefillAttention with num_heads =
// num_kv_heads = H/pack reads each K/V tile once for all of them.
struct GatherRowsParams {
  const bf16* src = nullptr;
  bf16* dst = nullptr;
  const int32_t* rows = nullptr;  // device (n)
  int64_t n = 0, width = 0, src_stride = 0;
  int64_t pack = 1, head_dim = 0;  // head_dim: needed when pack > 1
};
absl::Status GatherRows(const GatherRowsParams& p, cudaStream_t stream);

// Per-row sampling over fp32 logits(rows, vocab): the semantics of cpu::SampleToken (greedy when
// temperature <= 0; top-k, then top-p, then inverse-CDF with cpu::CounterUniform(seed, counter))
// and cpu::TokenLogprob (log-softmax of the raw logits at the chosen token).
struct SampleParams {
  const float* logits = nullptr;       // (rows, vocab)
  const float* temperature = nullptr;  // (rows)
  const int32_t* top_k = nullptr;      // (rows)
  const float* top_p = nullptr;        // (rows)
  const uint64_t* seed = nullptr;      // (rows)
  const uint64_t* counter = nullptr;   // (rows)
  int32_t* out_tokens = nullptr;       // (rows)
  float* out_logprobs = nullptr;       // (rows)
  int64_t rows = 0, vocab = 0;
};
int64_t SampleWorkspaceBytes(int64_t rows, int64_t vocab);
absl::Status SampleTokens(const SampleParams& p, void* workspace, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
