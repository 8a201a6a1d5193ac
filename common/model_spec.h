// The shape of a Llama-family model: everything the runtime needs to size buffers, check a
// checkpoint and run the math, independent of where the weights come from.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem {

enum class RopeType : uint8_t {
  kDefault = 0,  // inv_freq[i] = theta^(-2i/d)
  kLlama3 = 1,   // Llama 3.1 frequency-dependent scaling of the default frequencies
};

struct RopeSpec {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  // kLlama3 only (names as in Hugging Face's rope_scaling / rope_parameters).
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position = 8192;

  friend bool operator==(const RopeSpec&, const RopeSpec&) = default;
};

struct ModelSpec {
  std::string name;        // preset name, or the checkpoint directory
  std::string model_type;  // "llama", "mistral"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // query heads
  int64_t num_kv_heads = 0;  // == num_heads: MHA; 1: MQA; otherwise GQA
  int64_t head_dim = 0;      // given by config.json or hidden_size / num_heads
  int64_t max_position = 0;  // longest supported context (tokens)
  double rms_norm_eps = 1e-5;
  RopeSpec rope;
  bool tie_word_embeddings = false;
  int32_t bos_token_id = -1;           // -1: none
  std::vector<int32_t> eos_token_ids;  // generation stops at any of these
  // dtype the checkpoint stores: config.json's torch_dtype / dtype, replaced by OpenCheckpoint
  // with the dtype of the tensors when they all agree (presets: bf16).
  DType weight_dtype = DType::kBF16;

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  // Parameters including embeddings and LM head (counted once when tied).
  int64_t num_parameters() const;
  // Bytes of K and V for one token over all layers at element size `elem_bytes`.
  int64_t kv_bytes_per_token(int64_t elem_bytes) const { return 2 * num_layers * kv_dim() * elem_bytes; }

  // Checks internal consistency: every size positive and at most 2^30, num_kv_heads divides
  // num_heads, head_dim even, at most 10^13 parameters, rms_norm_eps and rope.theta positive,
  // llama3 rope fields sane (high_freq_factor > low_freq_factor > 0, factor > 0), bos/eos ids
  // inside the vocabulary. Errors are InvalidArgument: "<name>: field 'num_kv_heads': ...".
  absl::Status Validate() const;
  // One line: "llama3-8b: 32 layers, hidden 4096, heads 32/8 x 128, ffn 14336, vocab 128256".
  std::string Summary() const;
};

// Parses a Hugging Face `config.json` of a Llama-family model as written by transformers 4.x
// (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`, which wins when both are present).
// `source` names the file in errors, which also name the offending key, e.g. "config.json: key
// 'num_attention_heads': expected a positive integer, got \"a\"" (nested keys as
// 'rope_scaling.factor'). Wrong types and values are InvalidArgument; unsupported features
// (another model_type, attention/MLP bias, hidden_act other than silu, a rope type other than
// default/llama3, a dtype other than bfloat16/float16/float32) are Unimplemented naming the key.
//
// Absent or null keys take these defaults: num_key_value_heads = num_attention_heads,
// head_dim = hidden_size / num_attention_heads (which must divide), rms_norm_eps 1e-6,
// max_position_embeddings 2048, rope_theta 10000, tie_word_embeddings false, no bos/eos, bf16.
// Mistral's `sliding_window`, when an integer, caps max_position at the window: tandem attends
// over the whole context, which equals sliding-window attention exactly while the context fits
// in the window, and would silently differ beyond it.
// The result has name = `source` and has passed Validate(). Never throws.
absl::StatusOr<ModelSpec> ParseHfConfig(std::string_view json_text, std::string_view source);

// Built-in shapes with deterministic random weights (see compute_node/weights.h), all bf16:
//   "tiny-mha"  vocab 512, hidden 128, heads 4/4 x 32, ffn 344, 2 layers, default rope, untied
//   "tiny-gqa"  vocab 512, hidden 128, heads 8/2 x 16, ffn 344, 3 layers, llama3 rope (theta
//               5e5, factor 8, low 1, high 4, original 64), tied
//   "tiny-mqa"  vocab 512, hidden 128, heads 2/1 x 64, ffn 344, 2 layers, default rope, untied
//               (tiny ones: max_position 1024, eps 1e-5, bos 0, eos {1}; random weights may
//               well emit token 1, so generation can stop early)
//   "small"     ~125M parameters (500 MB fp32): vocab 32000, hidden 768, heads 12/4 x 64,
//               ffn 2048, 12 layers, theta 5e5, untied, max_position 4096
//   "llama-7b", "llama-13b", "llama-33b": Llama 1/2 shapes (vocab 32000, eps 1e-6; max_position
//               4096 for 7b and 13b as in Llama 2, 2048 for 33b;
//               bos 1, eos {2}); "llama3-8b", "llama3-70b": Llama 3 (vocab 128256, theta 5e5,
//               max_position 8192, eps 1e-5, bos 128000, eos {128001, 128009}).
// Unknown names are NotFound listing the known ones.
absl::StatusOr<ModelSpec> PresetSpec(std::string_view name);
// The preset names, in the order above.
std::vector<std::string> PresetNames();

}  // namespace tandem
