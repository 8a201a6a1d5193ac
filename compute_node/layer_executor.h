// The non-attention half of a Llama decoder on the CPU backend (fp32): embedding, norms,
// projections, RoPE, SwiGLU FFN and the LM head. Attention is the caller's (a memory rank, or the
// colocated engine), which is the split of docs/architecture.md, "One layer of a decode step":
//
//   x = Embed(tokens)
//   for each layer:  qkv = PreAttention(layer, x, positions)     // norm, QKV GEMM, RoPE
//                    o   = attention(q, KV)                       // elsewhere
//                    PostAttention(layer, x, o)                   // x += o·Woᵀ; x += FFN(norm(x))
//   logits = Logits(x, rows)                                      // final norm, LM head
//
// Rows are the tokens of one step in any order (prefill chunks and decode tokens mixed).
// Thread safety: one executor per thread; it owns scratch buffers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "compute_node/weights.h"

namespace tandem {

class CpuLayerExecutor {
 public:
  // `weights` must outlive the executor.
  explicit CpuLayerExecutor(const ModelWeightsF32* weights);

  const ModelSpec& spec() const { return weights_->spec; }
  // Width of a PreAttention output row: q_dim + 2·kv_dim, laid out [q | k | v].
  int64_t qkv_width() const { return spec().q_dim() + 2 * spec().kv_dim(); }

  // x(T, hidden) = embedding rows of `tokens`. Fails on an id outside the vocabulary.
  absl::Status Embed(std::span<const int32_t> tokens, float* x);
  // qkv(T, qkv_width) for layer `layer` from the residual stream x(T, hidden); RoPE applied to
  // q and k at `positions`.
  absl::Status PreAttention(int64_t layer, const float* x, std::span<const int32_t> positions, float* qkv);
  // x(T, hidden) += attn_out(T, q_dim)·Woᵀ, then x += FFN(RMSNorm(x)).
  absl::Status PostAttention(int64_t layer, float* x, const float* attn_out, int64_t num_tokens);
  // logits(rows.size(), vocab) for the given rows of x(T, hidden).
  absl::Status Logits(const float* x, std::span<const int32_t> rows, float* logits);

 private:
  const ModelWeightsF32* weights_;
  std::vector<float> inv_freq_;
  std::vector<float> normed_;   // (T, hidden)
  std::vector<float> gate_up_;  // (T, 2·intermediate)
  std::vector<float> act_;      // (T, intermediate)
};

}  // namespace tandem
