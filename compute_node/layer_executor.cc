#include "compute_node/layer_executor.h"

#include <cstring>

#include "common/status.h"
#include "kernels/cpu/ops.h"

namespace tandem {

namespace cpu = kernels::cpu;

CpuLayerExecutor::CpuLayerExecutor(const ModelWeightsF32* weights)
    : weights_(weights), inv_freq_(cpu::RopeInvFreq(weights->spec.rope, weights->spec.head_dim)) {}

absl::Status CpuLayerExecutor::Embed(std::span<const int32_t> tokens, float* x) {
  const ModelSpec& s = spec();
  return cpu::Embedding({.ids = tokens.data(),
                         .table = weights_->embed.data(),
                         .out = x,
                         .n = static_cast<int64_t>(tokens.size()),
                         .vocab = s.vocab_size,
                         .hidden = s.hidden_size});
}

absl::Status CpuLayerExecutor::PreAttention(int64_t layer, const float* x, std::span<const int32_t> positions,
                                            float* qkv) {
  const ModelSpec& s = spec();
  const LayerWeightsF32& w = weights_->layers.at(static_cast<size_t>(layer));
  const int64_t t = static_cast<int64_t>(positions.size());
  normed_.resize(static_cast<size_t>(t * s.hidden_size));
  RETURN_IF_ERROR(cpu::RmsNorm({.x = x,
                                .weight = w.input_norm.data(),
                                .out = normed_.data(),
                                .n = t,
                                .d = s.hidden_size,
                                .eps = static_cast<float>(s.rms_norm_eps)}));
  RETURN_IF_ERROR(cpu::Matmul(
      {.x = normed_.data(), .w = w.wqkv.data(), .y = qkv, .m = t, .n = qkv_width(), .k = s.hidden_size}));
  return cpu::Rope({.q = qkv,
                    .k = qkv + s.q_dim(),
                    .positions = positions.data(),
                    .inv_freq = inv_freq_.data(),
                    .n = t,
                    .num_heads = s.num_heads,
                    .num_kv_heads = s.num_kv_heads,
                    .head_dim = s.head_dim,
                    .q_stride = qkv_width(),
                    .k_stride = qkv_width()});
}

absl::Status CpuLayerExecutor::PostAttention(int64_t layer, float* x, const float* attn_out,
                                             int64_t num_tokens) {
  const ModelSpec& s = spec();
  const LayerWeightsF32& w = weights_->layers.at(static_cast<size_t>(layer));
  const int64_t t = num_tokens;
  const int64_t inter = s.intermediate_size;
  RETURN_IF_ERROR(cpu::Matmul({.x = attn_out,
                               .w = w.wo.data(),
                               .y = x,
                               .m = t,
                               .n = s.hidden_size,
                               .k = s.q_dim(),
                               .accumulate = true}));
  normed_.resize(static_cast<size_t>(t * s.hidden_size));
  gate_up_.resize(static_cast<size_t>(t * 2 * inter));
  act_.resize(static_cast<size_t>(t * inter));
  RETURN_IF_ERROR(cpu::RmsNorm({.x = x,
                                .weight = w.post_norm.data(),
                                .out = normed_.data(),
                                .n = t,
                                .d = s.hidden_size,
                                .eps = static_cast<float>(s.rms_norm_eps)}));
  RETURN_IF_ERROR(cpu::Matmul({.x = normed_.data(),
                               .w = w.w_gate_up.data(),
                               .y = gate_up_.data(),
                               .m = t,
                               .n = 2 * inter,
                               .k = s.hidden_size}));
  RETURN_IF_ERROR(cpu::SiluMul({.gate_up = gate_up_.data(), .out = act_.data(), .n = t, .inter = inter}));
  return cpu::Matmul({.x = act_.data(),
                      .w = w.w_down.data(),
                      .y = x,
                      .m = t,
                      .n = s.hidden_size,
                      .k = inter,
                      .accumulate = true});
}

absl::Status CpuLayerExecutor::Logits(const float* x, std::span<const int32_t> rows, float* logits) {
  const ModelSpec& s = spec();
  const int64_t r = static_cast<int64_t>(rows.size());
  const int64_t h = s.hidden_size;
  normed_.resize(static_cast<size_t>(r * h));
  for (int64_t i = 0; i < r; ++i) {
    std::memcpy(normed_.data() + i * h, x + static_cast<int64_t>(rows[static_cast<size_t>(i)]) * h,
                static_cast<size_t>(h) * sizeof(float));
  }
  RETURN_IF_ERROR(cpu::RmsNorm({.x = normed_.data(),
                                .weight = weights_->final_norm.data(),
                                .out = normed_.data(),
                                .n = r,
                                .d = h,
                                .eps = static_cast<float>(s.rms_norm_eps)}));
  return cpu::Matmul(
      {.x = normed_.data(), .w = weights_->lm_head_ptr(), .y = logits, .m = r, .n = s.vocab_size, .k = h});
}

}  // namespace tandem
