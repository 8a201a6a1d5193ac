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
};

struct ModelSpec {
  std::string name;         // preset name, or the checkpoint directory
  std::string model_type;   // "llama", "mistral"
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
  int32_t bos_token_id = -1;             // -1: none
  std::vector<int32_t> eos_token_ids;    // generation stops at any of these
  DType weight_dtype = DType::kBF16;     // dtype the checkpoint stores (presets: bf16)

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  // Parameters including embeddings and LM head (counted once when tied).
  int64_t num_parameters() const;
  // Bytes of K and V for one token over all layers at element size `elem_bytes`.
  int64_t kv_bytes_per_token(int64_t elem_bytes) const {
    return 2 * num_layers * kv_dim() * elem_bytes;
  }

  // Checks internal consistency (positive sizes, heads divide, even head_dim, ...). Errors are
  // InvalidArgument and name the offending field.
  absl::Status Validate() const;
  // One line: "llama3-8b: 32 layers, hidden 4096, heads 32/8 x 128, ffn 14336, vocab 128256".
  std::string Summary() const;
};

// Parses a Hugging Face `config.json` of a Llama-family model as written by transformers 4.x
// (`rope_theta`, `rope_scaling`) or 5.x (`rope_parameters`). `source` names the file in errors,
// which also name the offending key, e.g. "config.json: key 'num_attention_heads': expected a
// positive integer, got \"a\"". Unsupported features (another model_type, attention bias, an
// unknown rope type) are Unimplemented errors naming the key.
absl::StatusOr<ModelSpec> ParseHfConfig(std::string_view json_text, std::string_view source);

// Built-in shapes with deterministic random weights (see compute_node/weights.h):
// "tiny-mha", "tiny-gqa", "tiny-mqa" (tests, CPU), "small" (a few hundred MB, CPU demo-size),
// "llama-7b", "llama-13b", "llama-33b", "llama3-8b", "llama3-70b" (real shapes, benchmarks).
absl::StatusOr<ModelSpec> PresetSpec(std::string_view name);
std::vector<std::string> PresetNames();

}  // namespace tandem
