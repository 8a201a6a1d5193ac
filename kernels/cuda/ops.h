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

// Attention over token-granular KV for a ragged batch; same semantics as cpu::AttentionParams
// (request r: query rows [q_indptr[r], q_indptr[r+1]), keys kv_slots[kv_indptr[r] ..
// kv_indptr[r+1]) in position order, causal with the queries last; GQA head h reads KV head
// h / (num_heads / num_kv_heads)). head_dim 64 or 128.
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
// q_len >= 1, including a batch mixing chunks and single rows.
absl::Status PrefillAttention(const AttentionParams& p, cudaStream_t stream);

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
