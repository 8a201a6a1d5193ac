#include "common/model_spec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

using Json = nlohmann::json;

// Sizes above this are certainly a corrupt config; keeps every product in int64 range.
constexpr int64_t kMaxDim = int64_t{1} << 30;
constexpr double kMaxParameters = 1e13;

// Where a key lives, for error messages: "<source>: key '<prefix><key>': ...".
struct Where {
  std::string source;
  std::string prefix;  // "" or "rope_scaling."
};

std::string Shown(const Json& v) {
  std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

absl::Status Bad(const Where& w, const std::string& key, absl::string_view expected, const Json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(w.source, ": key '", w.prefix, key, "': expected ", expected, ", got ", Shown(got)));
}
absl::Status Missing(const Where& w, const std::string& key, absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(w.source, ": key '", w.prefix, key, "': missing (expected ", expected, ")"));
}
absl::Status Unsupported(const Where& w, const std::string& key, absl::string_view what) {
  return absl::UnimplementedError(absl::StrCat(w.source, ": key '", w.prefix, key, "': ", what));
}

// The value of `key`, or null when it is absent (never inserts, unlike operator[]).
const Json& Get(const Json& obj, const std::string& key) {
  static const Json kNull;
  auto it = obj.find(key);
  return it == obj.end() ? kNull : *it;
}

// The value of `key`, or nullptr when it is absent or null.
const Json* Find(const Json& obj, const std::string& key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<int64_t> AsInt64(const Json& v) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  return std::nullopt;
}

// An integer >= `min` (1: "positive", 0: "non-negative"); `fallback` when absent or null.
absl::StatusOr<int64_t> GetInt(const Where& w, const Json& obj, const std::string& key, int64_t min,
                               std::optional<int64_t> fallback) {
  const char* expected = min > 0 ? "a positive integer" : "a non-negative integer";
  const Json* v = Find(obj, key);
  if (v == nullptr) {
    if (fallback.has_value()) return *fallback;
    return Missing(w, key, expected);
  }
  std::optional<int64_t> i = AsInt64(*v);
  if (!i.has_value() || *i < min) return Bad(w, key, expected, *v);
  return *i;
}

// A finite number > 0; `fallback` when absent or null (no fallback: required).
absl::StatusOr<double> GetPositiveNumber(const Where& w, const Json& obj, const std::string& key,
                                         std::optional<double> fallback) {
  const Json* v = Find(obj, key);
  if (v == nullptr) {
    if (fallback.has_value()) return *fallback;
    return Missing(w, key, "a positive number");
  }
  if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() <= 0) {
    return Bad(w, key, "a positive number", *v);
  }
  return v->get<double>();
}

absl::StatusOr<bool> GetBool(const Where& w, const Json& obj, const std::string& key, bool fallback) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) return Bad(w, key, "true or false", *v);
  return v->get<bool>();
}

absl::StatusOr<std::optional<std::string>> GetString(const Where& w, const Json& obj,
                                                     const std::string& key) {
  const Json* v = Find(obj, key);
  if (v == nullptr) return std::optional<std::string>();
  if (!v->is_string()) return Bad(w, key, "a string", *v);
  return std::optional<std::string>(v->get<std::string>());
}

absl::StatusOr<int32_t> TokenId(const Where& w, const std::string& key, const Json& v,
                                absl::string_view expected) {
  std::optional<int64_t> i = AsInt64(v);
  if (!i.has_value() || *i < 0 || *i > std::numeric_limits<int32_t>::max()) {
    return Bad(w, key, expected, v);
  }
  return static_cast<int32_t>(*i);
}

// transformers 4.x: `rope_theta` + `rope_scaling`; 5.x: `rope_parameters` (which wins).
absl::StatusOr<RopeSpec> ParseRope(const Json& cfg, const std::string& source) {
  const Where top{source, ""};
  RopeSpec rope;
  ASSIGN_OR_RETURN(rope.theta, GetPositiveNumber(top, cfg, "rope_theta", 10000.0));
  std::string block_key = "rope_parameters";
  const Json* block = Find(cfg, block_key);
  if (block == nullptr) {
    block_key = "rope_scaling";
    block = Find(cfg, block_key);
  }
  if (block == nullptr) return rope;
  if (!block->is_object()) return Bad(top, block_key, "an object or null", *block);
  const Where in{source, block_key + "."};
  for (const auto& [k, v] : block->items()) {
    if (v.is_object()) {
      return Unsupported(in, k, "per-layer-type rope parameters are not supported");
    }
  }
  if (block_key == "rope_parameters") {
    ASSIGN_OR_RETURN(rope.theta, GetPositiveNumber(in, *block, "rope_theta", rope.theta));
  }
  std::string type_key = block->contains("rope_type") ? "rope_type" : "type";
  ASSIGN_OR_RETURN(std::optional<std::string> type, GetString(in, *block, type_key));
  if (!type.has_value() || *type == "default") return rope;
  if (*type != "llama3") {
    return Unsupported(
        in, type_key,
        absl::StrCat("rope type \"", *type, "\" is not supported (supported: \"default\", \"llama3\")"));
  }
  rope.type = RopeType::kLlama3;
  ASSIGN_OR_RETURN(rope.factor, GetPositiveNumber(in, *block, "factor", std::nullopt));
  ASSIGN_OR_RETURN(rope.low_freq_factor, GetPositiveNumber(in, *block, "low_freq_factor", std::nullopt));
  ASSIGN_OR_RETURN(rope.high_freq_factor, GetPositiveNumber(in, *block, "high_freq_factor", std::nullopt));
  ASSIGN_OR_RETURN(rope.original_max_position,
                   GetInt(in, *block, "original_max_position_embeddings", 1, std::nullopt));
  if (rope.high_freq_factor <= rope.low_freq_factor) {
    return Bad(in, "high_freq_factor",
               absl::StrCat("a number above low_freq_factor (", rope.low_freq_factor, ")"),
               Get(*block, "high_freq_factor"));
  }
  return rope;
}

absl::StatusOr<ModelSpec> ParseConfigObject(const Json& cfg, const std::string& source) {
  const Where w{source, ""};
  if (!cfg.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": expected a JSON object at the top level, got ", Shown(cfg)));
  }
  ModelSpec s;
  s.name = source;
  ASSIGN_OR_RETURN(std::optional<std::string> model_type, GetString(w, cfg, "model_type"));
  if (!model_type.has_value()) return Missing(w, "model_type", "\"llama\" or \"mistral\"");
  if (*model_type != "llama" && *model_type != "mistral") {
    return Unsupported(
        w, "model_type",
        absl::StrCat("\"", *model_type, "\" is not supported (supported: \"llama\", \"mistral\")"));
  }
  s.model_type = *model_type;

  ASSIGN_OR_RETURN(s.vocab_size, GetInt(w, cfg, "vocab_size", 1, std::nullopt));
  ASSIGN_OR_RETURN(s.hidden_size, GetInt(w, cfg, "hidden_size", 1, std::nullopt));
  ASSIGN_OR_RETURN(s.intermediate_size, GetInt(w, cfg, "intermediate_size", 1, std::nullopt));
  ASSIGN_OR_RETURN(s.num_layers, GetInt(w, cfg, "num_hidden_layers", 1, std::nullopt));
  ASSIGN_OR_RETURN(s.num_heads, GetInt(w, cfg, "num_attention_heads", 1, std::nullopt));
  ASSIGN_OR_RETURN(s.num_kv_heads, GetInt(w, cfg, "num_key_value_heads", 1, s.num_heads));
  if (s.num_kv_heads > s.num_heads || s.num_heads % s.num_kv_heads != 0) {
    return Bad(w, "num_key_value_heads", absl::StrCat("a divisor of num_attention_heads (", s.num_heads, ")"),
               Get(cfg, "num_key_value_heads"));
  }
  if (Find(cfg, "head_dim") != nullptr) {
    ASSIGN_OR_RETURN(s.head_dim, GetInt(w, cfg, "head_dim", 1, std::nullopt));
  } else if (s.hidden_size % s.num_heads != 0) {
    return Bad(
        w, "hidden_size",
        absl::StrCat("a multiple of num_attention_heads (", s.num_heads, ") since head_dim is not given"),
        Get(cfg, "hidden_size"));
  } else {
    s.head_dim = s.hidden_size / s.num_heads;
  }
  if (s.head_dim % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": key 'head_dim': ", s.head_dim,
                                                   " is odd; rotary embeddings need an even head_dim"));
  }
  ASSIGN_OR_RETURN(s.rms_norm_eps, GetPositiveNumber(w, cfg, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(s.max_position, GetInt(w, cfg, "max_position_embeddings", 1, 2048));
  ASSIGN_OR_RETURN(s.tie_word_embeddings, GetBool(w, cfg, "tie_word_embeddings", false));

  if (const Json* bos = Find(cfg, "bos_token_id")) {
    ASSIGN_OR_RETURN(s.bos_token_id,
                     TokenId(w, "bos_token_id", *bos, "a token id (non-negative integer) or null"));
  }
  if (const Json* eos = Find(cfg, "eos_token_id")) {
    constexpr absl::string_view kEos = "a token id (non-negative integer), a list of them, or null";
    if (eos->is_array()) {
      for (const Json& e : *eos) {
        ASSIGN_OR_RETURN(int32_t id, TokenId(w, "eos_token_id", e, kEos));
        s.eos_token_ids.push_back(id);
      }
    } else {
      ASSIGN_OR_RETURN(int32_t id, TokenId(w, "eos_token_id", *eos, kEos));
      s.eos_token_ids.push_back(id);
    }
  }

  const char* dtype_key = Find(cfg, "dtype") != nullptr ? "dtype" : "torch_dtype";
  ASSIGN_OR_RETURN(std::optional<std::string> dtype, GetString(w, cfg, dtype_key));
  if (dtype.has_value()) {
    std::optional<DType> t = ParseDType(*dtype);
    if (!t.has_value()) {
      return Unsupported(
          w, dtype_key,
          absl::StrCat("dtype \"", *dtype, "\" is not supported (supported: bfloat16, float16, float32)"));
    }
    s.weight_dtype = *t;
  }

  for (const char* key : {"attention_bias", "mlp_bias"}) {
    ASSIGN_OR_RETURN(bool bias, GetBool(w, cfg, key, false));
    if (bias) return Unsupported(w, key, "biases in linear layers are not supported");
  }
  ASSIGN_OR_RETURN(std::optional<std::string> act, GetString(w, cfg, "hidden_act"));
  if (act.has_value() && *act != "silu") {
    return Unsupported(w, "hidden_act",
                       absl::StrCat("activation \"", *act, "\" is not supported (supported: silu)"));
  }

  ASSIGN_OR_RETURN(s.rope, ParseRope(cfg, source));

  if (Find(cfg, "sliding_window") != nullptr) {
    ASSIGN_OR_RETURN(int64_t window, GetInt(w, cfg, "sliding_window", 1, std::nullopt));
    s.max_position = std::min(s.max_position, window);
  }
  RETURN_IF_ERROR(s.Validate());
  return s;
}

ModelSpec Preset(std::string name, int64_t vocab, int64_t hidden, int64_t inter, int64_t layers,
                 int64_t heads, int64_t kv_heads, int64_t head_dim) {
  ModelSpec s;
  s.name = std::move(name);
  s.model_type = "llama";
  s.vocab_size = vocab;
  s.hidden_size = hidden;
  s.intermediate_size = inter;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.weight_dtype = DType::kBF16;
  return s;
}

std::vector<ModelSpec> AllPresets() {
  std::vector<ModelSpec> all;
  auto tiny = [&](ModelSpec s) {
    s.max_position = 1024;
    s.rms_norm_eps = 1e-5;
    s.bos_token_id = 0;
    s.eos_token_ids = {1};
    all.push_back(std::move(s));
  };
  tiny(Preset("tiny-mha", 512, 128, 344, 2, 4, 4, 32));
  {
    ModelSpec s = Preset("tiny-gqa", 512, 128, 344, 3, 8, 2, 16);
    s.rope = {.type = RopeType::kLlama3,
              .theta = 500000.0,
              .factor = 8.0,
              .low_freq_factor = 1.0,
              .high_freq_factor = 4.0,
              .original_max_position = 64};
    s.tie_word_embeddings = true;
    tiny(std::move(s));
  }
  tiny(Preset("tiny-mqa", 512, 128, 344, 2, 2, 1, 64));

  auto llama1 = [&](ModelSpec s) {
    s.max_position = 2048;
    s.rms_norm_eps = 1e-6;
    s.bos_token_id = 1;
    s.eos_token_ids = {2};
    return s;
  };
  {
    ModelSpec s = llama1(Preset("small", 32000, 768, 2048, 12, 12, 4, 64));
    s.rope.theta = 500000.0;
    s.max_position = 4096;
    s.rms_norm_eps = 1e-5;
    // Untied: with random weights a tied LM head scores the current token's own embedding
    // highest, and the demo would repeat its last prompt token forever.
    s.tie_word_embeddings = false;
    all.push_back(std::move(s));
  }
  // Llama 2 7B/13B have Llama 1's shapes with a 4096-token context; the presets take the longer
  // one so that benchmarks can run 4K contexts.
  auto llama2 = [&](ModelSpec s) {
    s = llama1(std::move(s));
    s.max_position = 4096;
    return s;
  };
  all.push_back(llama2(Preset("llama-7b", 32000, 4096, 11008, 32, 32, 32, 128)));
  all.push_back(llama2(Preset("llama-13b", 32000, 5120, 13824, 40, 40, 40, 128)));
  all.push_back(llama1(Preset("llama-33b", 32000, 6656, 17920, 60, 52, 52, 128)));

  auto llama3 = [&](ModelSpec s) {
    s.rope.theta = 500000.0;
    s.max_position = 8192;
    s.rms_norm_eps = 1e-5;
    s.bos_token_id = 128000;
    s.eos_token_ids = {128001, 128009};
    all.push_back(std::move(s));
  };
  llama3(Preset("llama3-8b", 128256, 4096, 14336, 32, 32, 8, 128));
  llama3(Preset("llama3-70b", 128256, 8192, 28672, 80, 64, 8, 128));
  return all;
}

}  // namespace

int64_t ModelSpec::num_parameters() const {
  const int64_t per_layer = 2 * hidden_size                         // two RMSNorm weights
                            + 2 * hidden_size * q_dim()             // q_proj, o_proj
                            + 2 * hidden_size * kv_dim()            // k_proj, v_proj
                            + 3 * hidden_size * intermediate_size;  // gate, up, down
  const int64_t embed = vocab_size * hidden_size;
  return embed + num_layers * per_layer + hidden_size + (tie_word_embeddings ? 0 : embed);
}

absl::Status ModelSpec::Validate() const {
  auto bad = [&](absl::string_view field, auto&&... why) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": field '", field, "': ", why...));
  };
  const std::pair<const char*, int64_t> sizes[] = {
      {"vocab_size", vocab_size}, {"hidden_size", hidden_size},  {"intermediate_size", intermediate_size},
      {"num_layers", num_layers}, {"num_heads", num_heads},      {"num_kv_heads", num_kv_heads},
      {"head_dim", head_dim},     {"max_position", max_position}};
  for (const auto& [field, value] : sizes) {
    if (value <= 0) return bad(field, value, " is not positive");
    if (value > kMaxDim) return bad(field, value, " is implausibly large (limit ", kMaxDim, ")");
  }
  if (num_heads % num_kv_heads != 0) {
    return bad("num_kv_heads", num_kv_heads, " does not divide num_heads ", num_heads);
  }
  if (head_dim % 2 != 0) return bad("head_dim", head_dim, " is odd; RoPE needs an even head_dim");
  const double layer_params =
      2.0 * hidden_size * (q_dim() + kv_dim()) + 3.0 * hidden_size * intermediate_size;
  const double params = 2.0 * vocab_size * hidden_size + num_layers * layer_params;
  if (params > kMaxParameters) {
    return bad("num_layers", num_layers, ": the model would have ", params,
               " parameters, beyond the supported ", kMaxParameters);
  }
  if (!std::isfinite(rms_norm_eps) || rms_norm_eps <= 0) {
    return bad("rms_norm_eps", rms_norm_eps, " is not a positive number");
  }
  if (!std::isfinite(rope.theta) || rope.theta <= 0) {
    return bad("rope.theta", rope.theta, " is not a positive number");
  }
  if (rope.type == RopeType::kLlama3) {
    if (!std::isfinite(rope.factor) || rope.factor <= 0) {
      return bad("rope.factor", rope.factor, " is not a positive number");
    }
    if (!std::isfinite(rope.low_freq_factor) || rope.low_freq_factor <= 0) {
      return bad("rope.low_freq_factor", rope.low_freq_factor, " is not a positive number");
    }
    if (!std::isfinite(rope.high_freq_factor) || rope.high_freq_factor <= rope.low_freq_factor) {
      return bad("rope.high_freq_factor", rope.high_freq_factor, " must be a number above low_freq_factor ",
                 rope.low_freq_factor);
    }
    if (rope.original_max_position <= 0) {
      return bad("rope.original_max_position", rope.original_max_position, " is not positive");
    }
  } else if (rope.type != RopeType::kDefault) {
    return bad("rope.type", static_cast<int>(rope.type), " is not a known rope type");
  }
  if (bos_token_id < -1 || bos_token_id >= vocab_size) {
    return bad("bos_token_id", bos_token_id, " is outside the vocabulary [0, ", vocab_size, ")");
  }
  for (int32_t eos : eos_token_ids) {
    if (eos < 0 || eos >= vocab_size) {
      return bad("eos_token_ids", eos, " is outside the vocabulary [0, ", vocab_size, ")");
    }
  }
  return absl::OkStatus();
}

std::string ModelSpec::Summary() const {
  return absl::StrCat(name, ": ", num_layers, " layers, hidden ", hidden_size, ", heads ", num_heads, "/",
                      num_kv_heads, " x ", head_dim, ", ffn ", intermediate_size, ", vocab ", vocab_size);
}

absl::StatusOr<ModelSpec> ParseHfConfig(std::string_view json_text, std::string_view source_view) {
  const std::string source(source_view);
  try {
    Json cfg;
    try {
      cfg = Json::parse(json_text);
    } catch (const Json::parse_error& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
    }
    return ParseConfigObject(cfg, source);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
}

absl::StatusOr<ModelSpec> PresetSpec(std::string_view name) {
  for (ModelSpec& s : AllPresets()) {
    if (s.name == name) return std::move(s);
  }
  return absl::NotFoundError(absl::StrCat("unknown preset '", std::string(name),
                                          "' (known: ", absl::StrJoin(PresetNames(), ", "), ")"));
}

std::vector<std::string> PresetNames() {
  std::vector<std::string> names;
  for (const ModelSpec& s : AllPresets()) names.push_back(s.name);
  return names;
}

}  // namespace tandem
