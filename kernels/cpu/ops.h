// CPU backend (fp32): the reference every CUDA op is compared with.
//
// Conventions (shared with the CUDA kernels):
//   * Kernels take raw pointers and a params struct; shapes are written as (rows, cols) in
//     row-major order with the last dimension contiguous.
//   * Weight matrices keep the Hugging Face layout W(out, in): y = x · Wᵀ.
//   * RoPE uses the "rotate half" pairing of Hugging Face Llama: element i pairs with i + d/2.
//   * Log-sum-exp values are natural logarithms of Σ exp(score), with score = scale · q·k.
//   * Functions validate their params (null pointers, non-positive sizes, ids out of range) and
//     return InvalidArgument naming the field; they allocate only for scratch.
// Thread safety: functions are reentrant; they may use several threads internally.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "common/top_logprobs.h"

namespace tandem::kernels::cpu {

// out(n, hidden) = table(ids[i], :). Fails if an id is outside [0, vocab).
struct EmbeddingParams {
  const int32_t* ids = nullptr;  // (n)
  const float* table = nullptr;  // (vocab, hidden)
  float* out = nullptr;          // (n, hidden)
  int64_t n = 0, vocab = 0, hidden = 0;
};
absl::Status Embedding(const EmbeddingParams& p);

// If residual != nullptr: residual += x (in place) and the norm input is the updated residual;
// else the norm input is x. out = input / sqrt(mean(input²) + eps) * weight. out may alias x.
struct RmsNormParams {
  const float* x = nullptr;       // (n, d)
  float* residual = nullptr;      // (n, d) or nullptr
  const float* weight = nullptr;  // (d)
  float* out = nullptr;           // (n, d)
  int64_t n = 0, d = 0;
  float eps = 1e-5f;
};
absl::Status RmsNorm(const RmsNormParams& p);

// Inverse frequencies (head_dim/2 values) for `spec`, as transformers computes them for the
// "default" and "llama3" rope types: every step in fp32 like its torch ops (arange cast to fp32,
// fp32 division; pow evaluated in double and rounded once, within an ulp of torch's fp32 pow).
// Empty for head_dim <= 0.
std::vector<float> RopeInvFreq(const RopeSpec& spec, int64_t head_dim);

// Rotates q(n, heads, d) and k(n, kv_heads, d) in place by position[i] · inv_freq.
// Angles are computed in fp32 as float(position) * inv_freq (like transformers), then cos/sin
// (evaluated in double, rounded to fp32). k may be nullptr to rotate q only. Positions must be
// >= 0 and head_dim even.
struct RopeParams {
  float* q = nullptr;                  // (n, num_heads, head_dim); row stride q_stride floats
  float* k = nullptr;                  // (n, num_kv_heads, head_dim); row stride k_stride floats
  const int32_t* positions = nullptr;  // (n)
  const float* inv_freq = nullptr;     // (head_dim / 2)
  int64_t n = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t q_stride = 0, k_stride = 0;  // 0: packed (num_heads*head_dim, num_kv_heads*head_dim)
};
absl::Status Rope(const RopeParams& p);

// Turns keys already rotated by Rope from one position to another (kv.store_pre_rope: KV reused at
// new positions): row `rows[i]` of k (every KV head) turns by theta_j(to[i]) - theta_j(from[i]),
// theta_j(p) = float(p) * inv_freq[j] in fp32 as Rope forms it; the difference is taken in double
// and its cos/sin evaluated in double, rounded once to fp32. The result equals Rope applied at
// to[i] to the unrotated row up to rounding; a row with to[i] == from[i] is left bit-identical.
// Positions >= 0; rows[i] in [0, num_rows).
struct RopeShiftParams {
  float* k = nullptr;                       // (num_rows, num_kv_heads, head_dim); row stride k_stride
  const int32_t* rows = nullptr;            // (n) rows of k to turn
  const int32_t* from_positions = nullptr;  // (n)
  const int32_t* to_positions = nullptr;    // (n)
  const float* inv_freq = nullptr;          // (head_dim / 2)
  int64_t n = 0, num_rows = 0, num_kv_heads = 0, head_dim = 0;
  int64_t k_stride = 0;  // 0: packed (num_kv_heads * head_dim)
};
absl::Status RopeShift(const RopeShiftParams& p);

// Rows copied inside a cache of `planes` planes (plane q at cache + q * plane_stride, rows of
// `width` floats): row dst[i] = row src[i] of every plane, i in [0, n). Every src and dst in
// [0, num_rows); the dst rows distinct and none of them a src row (InvalidArgument otherwise).
struct CopyRowsParams {
  float* cache = nullptr;
  const int32_t* src = nullptr;  // (n)
  const int32_t* dst = nullptr;  // (n)
  int64_t n = 0, width = 0, num_rows = 0;
  int64_t planes = 1, plane_stride = 0;  // plane_stride >= num_rows * width when planes > 1
};
absl::Status CopyRows(const CopyRowsParams& p);

// cos and sin (fp32) of theta_j(to) - theta_j(from) for j < half, as RopeShift turns a row by
// (the CUDA kernel forms the same values).
void RopeShiftAngles(int32_t from, int32_t to, const float* inv_freq, int64_t half, float* cos_out,
                     float* sin_out);

// y(m, n) = x(m, k) · w(n, k)ᵀ  (+ y if accumulate). Row strides are in elements (0: packed).
struct MatmulParams {
  const float* x = nullptr;
  const float* w = nullptr;
  float* y = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t x_stride = 0, y_stride = 0;
  bool accumulate = false;
};
absl::Status Matmul(const MatmulParams& p);

// out(n, inter) = silu(gate_up(:, :inter)) * gate_up(:, inter:), gate_up is (n, 2·inter).
struct SiluMulParams {
  const float* gate_up = nullptr;
  float* out = nullptr;
  int64_t n = 0, inter = 0;
};
absl::Status SiluMul(const SiluMulParams& p);

// Attention over a token-granular KV cache for a ragged batch: prefill chunks and decode alike.
// Request r owns query rows [q_indptr[r], q_indptr[r+1]) and KV entries
// kv_slots[kv_indptr[r] .. kv_indptr[r+1]) in position order (its whole context, the chunk's own
// keys included, last). Query row i of a request with q_len rows and kv_len keys is at context
// position kv_len - q_len + i and attends causally to keys 0 .. kv_len - q_len + i.
// GQA: query head h reads KV head h / (num_heads / num_kv_heads).
// q_indptr and kv_indptr start at 0 and never decrease; a request may have 0 query rows. Every
// slot of kv_slots[0 .. kv_indptr[num_requests]) must lie in [0, num_slots). scale must be > 0.
// Math (as Hugging Face's eager attention, all fp32): s = (q·k) * scale, p = softmax(s) with
// the row max subtracted, out = Σ p_j v_j; lse = max + log Σ exp(s - max).
struct AttentionParams {
  const float* q = nullptr;            // (total_q, num_heads, head_dim)
  const float* k_cache = nullptr;      // (num_slots, num_kv_heads, head_dim)
  const float* v_cache = nullptr;      // (num_slots, num_kv_heads, head_dim)
  float* out = nullptr;                // (total_q, num_heads, head_dim)
  float* lse = nullptr;                // (total_q, num_heads), natural log; optional
  const int32_t* q_indptr = nullptr;   // (num_requests + 1)
  const int32_t* kv_indptr = nullptr;  // (num_requests + 1)
  const int32_t* kv_slots = nullptr;   // (kv_indptr[num_requests])
  int64_t num_requests = 0, num_slots = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;  // usually 1/sqrt(head_dim)
};
absl::Status Attention(const AttentionParams& p);

// Shared-prefix ("cascade") attention, part 1: every query row attends to the same KV range
// prefix_slots[0 .. prefix_len), unmasked (each row is at a position after the whole prefix).
// Same conventions as Attention (GQA mapping, scale, s = (q·k) * scale, softmax with the max
// subtracted, natural-log lse). The result is a partial state: out is normalised over the prefix
// keys only and lse = max + log Σ exp(s - max) over them; MergeAttentionStates combines it with
// the state of the request's own (suffix) keys from Attention. For a prefix fully visible to a
// row the result equals Attention over those keys bit for bit (same dot, sum and weight order).
// Each K/V row of the prefix is read once per block of rows and per KV head, for all query heads
// of that KV head (a (rows·group) × prefix_len product), not once per row.
// prefix_len == 0 is allowed (prefix_slots may then be null): out = 0 and lse = -infinity for
// every row and head, the empty state that MergeAttentionStates treats as contributing nothing.
// rows == 0 is a no-op. Sizes other than rows and prefix_len must be positive; scale > 0.
struct PrefixAttentionParams {
  const float* q = nullptr;               // (rows, num_heads, head_dim)
  const float* k_cache = nullptr;         // (num_slots, num_kv_heads, head_dim)
  const float* v_cache = nullptr;         // (num_slots, num_kv_heads, head_dim)
  const int32_t* prefix_slots = nullptr;  // (prefix_len), each in [0, num_slots)
  float* out = nullptr;                   // (rows, num_heads, head_dim)
  float* lse = nullptr;                   // (rows, num_heads), natural log; required
  int64_t rows = 0, prefix_len = 0, num_slots = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0;
  float scale = 0.0f;
};
absl::Status PrefixAttention(const PrefixAttentionParams& p);

// Merges two partial attention states over disjoint key sets of the same query rows/heads:
//   out = (e^{lse_a}·out_a + e^{lse_b}·out_b) / (e^{lse_a} + e^{lse_b}),
//   lse = log(e^{lse_a} + e^{lse_b}),
// computed with the larger lse subtracted (no overflow for any finite lse). A state with
// lse = -inf is empty and contributes nothing: the other state is copied exactly (its out values
// are not even read); both empty gives out = 0, lse = -inf. NaN lse propagates.
// Gathering: row i of state a (and of the output) pairs with row rows_b[i] of state b, so one
// group's prefix state (num_rows_b rows) can be merged into the rows of many requests without a
// copy; rows_b == nullptr means rows_b[i] = i (state b then has `rows` rows, num_rows_b ignored).
// Aliasing: out may equal out_a and lse may equal lse_a (in place). out/lse may equal out_b/lse_b
// only when rows_b is null (rejected otherwise); no other overlap is allowed. lse may be null
// (not written). rows == 0 is a no-op; num_heads and head_dim must be positive.
struct MergeAttentionStatesParams {
  const float* out_a = nullptr;     // (rows, num_heads, head_dim)
  const float* lse_a = nullptr;     // (rows, num_heads)
  const float* out_b = nullptr;     // (num_rows_b or rows, num_heads, head_dim)
  const float* lse_b = nullptr;     // (num_rows_b or rows, num_heads)
  const int32_t* rows_b = nullptr;  // (rows), each in [0, num_rows_b); optional
  float* out = nullptr;             // (rows, num_heads, head_dim)
  float* lse = nullptr;             // (rows, num_heads); optional
  int64_t rows = 0, num_rows_b = 0, num_heads = 0, head_dim = 0;
};
absl::Status MergeAttentionStates(const MergeAttentionStatesParams& p);

// Sampling of one token from one row of logits.
struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off; keeps the smallest prefix of sorted probs with mass >= top_p
  uint64_t seed = 0;
};
// A uniform float in [0, 1) from a counter-based generator: the same (seed, counter) always
// gives the same value, whatever else runs in the batch. Exactly (all uint64 arithmetic mod 2^64,
// so a CUDA kernel can reproduce it bit for bit):
//   mix(z) = z ^= z >> 30, z *= 0xBF58476D1CE4E5B9, z ^= z >> 27, z *= 0x94D049BB133111EB,
//            z ^ (z >> 31)                                       (splitmix64's finaliser)
//   z = mix(mix(seed + 0x9E3779B97F4A7C15) ^ (counter * 0xD1B54A32D192ED03))
//   result = float(z >> 40) * 2^-24                              (24 bits; never 1.0)
float CounterUniform(uint64_t seed, uint64_t counter);
// Samples with `params` using CounterUniform(params.seed, counter) as the only randomness.
// temperature <= 0 (or NaN): argmax. Otherwise, in double: p ∝ exp((logit - max) / T); top-k
// keeps the k most probable (ties: lower id); top-p then keeps the smallest prefix of those,
// sorted descending (ties: lower id), whose mass renormalised over the top-k survivors is
// >= top_p (at least one token); finally u = CounterUniform(seed, counter) picks the first kept
// token, in ascending id, whose cumulative kept mass exceeds u · (total kept mass). top_k <= 0 or
// >= vocab and top_p >= 1 are off. NaN logits count as -inf. Aborts on null logits, vocab <= 0.
int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params, uint64_t counter);
// log_softmax(logits)[token] in natural log, computed stably in double. Unaffected by
// temperature, top-k and top-p. NaN if any logit is NaN or +inf, or all are -inf; aborts when
// token is outside [0, vocab).
float TokenLogprob(const float* logits, int64_t vocab, int32_t token);
// The k most probable tokens of one row and their log-probabilities (common/top_logprobs.h):
// most probable first, equal logits by lower id, NaN logits counted as -inf (as SampleToken does);
// each logprob computed exactly as TokenLogprob computes it (NaN for every entry
// when TokenLogprob would be NaN). k is clamped to [0, min(vocab, kMaxTopLogprobs)]; `out` is
// replaced. One pass over the row for the selection (a sorted k-entry window) and one for the
// log-sum-exp. Aborts on null logits, vocab <= 0.
void TopLogprobs(const float* logits, int64_t vocab, int32_t k, std::vector<TopLogprob>* out);

}  // namespace tandem::kernels::cpu
