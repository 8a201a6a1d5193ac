// Model weights: where they come from (a Hugging Face checkpoint directory or a preset's
// deterministic random values) and the fp32 host copy the CPU backend computes with.
//
// Tensor names follow Hugging Face Llama ("model.layers.3.self_attn.q_proj.weight", ...); matrix
// layouts stay (out, in).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"

namespace tandem {

// Names of the Hugging Face tensors of a Llama model.
struct HfNames {
  static std::string Embed() { return "model.embed_tokens.weight"; }
  static std::string FinalNorm() { return "model.norm.weight"; }
  static std::string LmHead() { return "lm_head.weight"; }
  // `leaf` e.g. "self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight".
  static std::string Layer(int64_t layer, std::string_view leaf);
};

// The tensors a model of `spec` must have, with their shapes, in a fixed order.
struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<ExpectedTensor> ExpectedTensors(const ModelSpec& spec);

// A source of named tensors, already checked against the spec when it was opened.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ModelSpec& spec() const = 0;
  // Converts tensor `name` to fp32 into `out` (product of its shape floats). Errors name the
  // tensor and, for checkpoints, the file.
  virtual absl::Status ReadF32(const std::string& name, float* out) const = 0;
  // A short description: the directory, or "preset llama3-8b (random weights, seed 0)".
  virtual std::string Describe() const = 0;
};

// Opens a checkpoint directory: config.json, then model.safetensors or the shards listed by
// model.safetensors.index.json (or every *.safetensors file when there is no index). Before it
// returns, every expected tensor is found once, with the expected shape and a float dtype;
// tensors not used by a Llama model are an error except the known-harmless
// "*.rotary_emb.inv_freq". Errors name the file and the tensor or key.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenCheckpoint(const std::string& dir);

// Deterministic random weights for `spec`: value i of tensor `name` depends only on
// (seed, name, i), so every backend and rank can produce the same weights on its own.
// Linear weights ~ U(-1/sqrt(in), 1/sqrt(in)); norm weights ~ 1 + U(-0.1, 0.1);
// embeddings ~ U(-1, 1).
std::unique_ptr<WeightSource> RandomWeights(const ModelSpec& spec, uint64_t seed);

// A preset name (see PresetNames()) or a checkpoint directory.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(const std::string& dir_or_preset,
                                                        uint64_t seed = 0);

// fp32 host weights for the CPU backend. Projections are fused for fewer, larger GEMMs:
// wqkv = [q_proj; k_proj; v_proj] (q_dim + 2·kv_dim, hidden), w_gate_up = [gate; up]
// (2·intermediate, hidden).
struct LayerWeightsF32 {
  std::vector<float> input_norm;  // (hidden)
  std::vector<float> wqkv;        // (q_dim + 2·kv_dim, hidden)
  std::vector<float> wo;          // (hidden, q_dim)
  std::vector<float> post_norm;   // (hidden)
  std::vector<float> w_gate_up;   // (2·intermediate, hidden)
  std::vector<float> w_down;      // (hidden, intermediate)
};
struct ModelWeightsF32 {
  ModelSpec spec;
  std::vector<float> embed;       // (vocab, hidden)
  std::vector<LayerWeightsF32> layers;
  std::vector<float> final_norm;  // (hidden)
  std::vector<float> lm_head;     // (vocab, hidden); empty when tied (use embed)
  const float* lm_head_ptr() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};
// Reads every tensor. Fails with ResourceExhausted (naming the bytes needed and available)
// before allocating if the fp32 copy would not fit in this host's memory. All or nothing.
absl::StatusOr<ModelWeightsF32> LoadWeightsF32(const WeightSource& source);

}  // namespace tandem
