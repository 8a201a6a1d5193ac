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

// A source of named tensors, already checked against the spec when it was opened. Thread-safe:
// ReadF32 may be called concurrently (LoadWeightsF32 does).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ModelSpec& spec() const = 0;
  // Converts tensor `name` (one of ExpectedTensors(spec())) to fp32 into `out` (product of its
  // shape floats). NotFound for any other name, including lm_head.weight of a tied model.
  virtual absl::Status ReadF32(const std::string& name, float* out) const = 0;
  // A short description: the directory, or "preset llama3-8b (random weights, seed 0)".
  virtual std::string Describe() const = 0;
};

// Opens a checkpoint directory: config.json (see ParseHfConfig), then the shards listed by
// model.safetensors.index.json's "weight_map" if that file exists (shard names must be plain
// file names in `dir`; other files are not read), else model.safetensors, else every
// *.safetensors file in `dir`. Before it returns, every expected tensor is found exactly once
// (a duplicate names both files), in the shard the index names, with the expected shape and a
// float dtype (BF16/F16/F32; others Unimplemented); any other tensor is an error except
// "*rotary_emb.inv_freq" and, for tied models, an lm_head.weight of the embedding's shape (both
// ignored). Nothing is read beyond the headers; the files stay mapped while the source lives.
// The spec is named `dir`. Errors name the file and the tensor or key: NotFound (config.json,
// a shard, a tensor missing), InvalidArgument, DataLoss (corrupt file), Unimplemented.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenCheckpoint(const std::string& dir);

// Deterministic random weights for `spec`: value i of tensor `name` depends only on
// (seed, name, i), so every backend and rank can produce the same weights on its own, whatever
// the thread count. Linear weights ~ U(-1/sqrt(in), 1/sqrt(in)); norm weights ~ 1 + U(-0.1, 0.1);
// embeddings ~ U(-1, 1); each value then rounded to bf16 (so the bounds hold up to bf16
// rounding, and a bf16 device copy equals the fp32 host copy exactly). The generator:
// stream = splitmix64(seed ^ splitmix64(fnv1a64(name))), bits_i = splitmix64(stream + i·φ64)
// (φ64 = 0x9e3779b97f4a7c15), u_i = ((bits_i >> 40) - 2^23) / 2^23 in [-1, 1).
std::unique_ptr<WeightSource> RandomWeights(const ModelSpec& spec, uint64_t seed);

// A preset name (see PresetNames(); a preset wins over a directory of the same name), a
// checkpoint directory, or a GGUF file whose name ends in .gguf (OpenGguf, compute_node/gguf.h);
// anything else is NotFound listing the presets.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenModel(const std::string& dir_or_preset, uint64_t seed = 0);

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
  std::vector<float> embed;  // (vocab, hidden)
  std::vector<LayerWeightsF32> layers;
  std::vector<float> final_norm;  // (hidden)
  std::vector<float> lm_head;     // (vocab, hidden); empty when tied (use embed)
  const float* lm_head_ptr() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
};
// Reads every tensor, in parallel over tensors (the result does not depend on the thread count).
// Fails with ResourceExhausted (GiB needed and available, with a hint) before allocating if the
// fp32 copy would not fit: available is MemAvailable from /proc/meminfo (else physical memory),
// capped by a cgroup v2 memory.max. All or nothing.
absl::StatusOr<ModelWeightsF32> LoadWeightsF32(const WeightSource& source);

}  // namespace tandem
