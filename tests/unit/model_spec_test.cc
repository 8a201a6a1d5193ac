#include "common/model_spec.h"

#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

// Llama-3.1-8B's config.json as transformers 4.x writes it.
constexpr char kLlama31Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
})";

// A Llama-3.2-1B-like config as transformers 5.x writes it: `dtype`, `rope_parameters`.
constexpr char kTransformers5Config[] = R"({
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 128000,
  "dtype": "float16",
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "vocab_size": 128256
})";

TEST(ParseHfConfigTest, Transformers4Llama31) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(kLlama31Config, "config.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "config.json");
  EXPECT_EQ(spec->model_type, "llama");
  EXPECT_EQ(spec->vocab_size, 128256);
  EXPECT_EQ(spec->hidden_size, 4096);
  EXPECT_EQ(spec->intermediate_size, 14336);
  EXPECT_EQ(spec->num_layers, 32);
  EXPECT_EQ(spec->num_heads, 32);
  EXPECT_EQ(spec->num_kv_heads, 8);
  EXPECT_EQ(spec->head_dim, 128);
  EXPECT_EQ(spec->max_position, 131072);
  EXPECT_DOUBLE_EQ(spec->rms_norm_eps, 1e-5);
  EXPECT_EQ(spec->rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(spec->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(spec->rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(spec->rope.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(spec->rope.high_freq_factor, 4.0);
  EXPECT_EQ(spec->rope.original_max_position, 8192);
  EXPECT_FALSE(spec->tie_word_embeddings);
  EXPECT_EQ(spec->bos_token_id, 128000);
  EXPECT_EQ(spec->eos_token_ids, (std::vector<int32_t>{128001, 128008, 128009}));
  EXPECT_EQ(spec->weight_dtype, DType::kBF16);
  EXPECT_EQ(spec->num_parameters(), 8030261248);
}

TEST(ParseHfConfigTest, Transformers5RopeParameters) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(kTransformers5Config, "config.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->head_dim, 64);
  EXPECT_EQ(spec->q_dim(), 2048);
  EXPECT_EQ(spec->kv_dim(), 512);
  EXPECT_EQ(spec->rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(spec->rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(spec->rope.factor, 32.0);
  EXPECT_EQ(spec->rope.original_max_position, 8192);
  EXPECT_TRUE(spec->tie_word_embeddings);
  EXPECT_EQ(spec->eos_token_ids, std::vector<int32_t>{128001});
  EXPECT_EQ(spec->weight_dtype, DType::kF16);
}

// A config assembled from key -> raw JSON value, so each test changes one key.
std::string Config(const std::map<std::string, std::string>& changes) {
  std::map<std::string, std::string> keys = {
      {"model_type", "\"llama\""},  {"vocab_size", "512"},      {"hidden_size", "128"},
      {"intermediate_size", "344"}, {"num_hidden_layers", "2"}, {"num_attention_heads", "4"},
  };
  for (const auto& [key, value] : changes) {
    if (value.empty()) {
      keys.erase(key);
    } else {
      keys[key] = value;
    }
  }
  std::string text = "{";
  for (const auto& [key, value] : keys) {
    if (text.size() > 1) text += ", ";
    text += "\"" + key + "\": " + value;
  }
  return text + "}";
}

TEST(ParseHfConfigTest, Defaults) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(Config({}), "min.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->num_kv_heads, 4);
  EXPECT_EQ(spec->head_dim, 32);
  EXPECT_DOUBLE_EQ(spec->rms_norm_eps, 1e-6);
  EXPECT_EQ(spec->max_position, 2048);
  EXPECT_FALSE(spec->tie_word_embeddings);
  EXPECT_EQ(spec->bos_token_id, -1);
  EXPECT_TRUE(spec->eos_token_ids.empty());
  EXPECT_EQ(spec->weight_dtype, DType::kBF16);
  EXPECT_EQ(spec->rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(spec->rope.theta, 10000.0);
}

TEST(ParseHfConfigTest, NullsMeanDefaults) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(Config({{"head_dim", "null"},
                                                         {"num_key_value_heads", "null"},
                                                         {"bos_token_id", "null"},
                                                         {"eos_token_id", "null"},
                                                         {"rope_scaling", "null"},
                                                         {"sliding_window", "null"},
                                                         {"torch_dtype", "null"}}),
                                                 "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->head_dim, 32);
  EXPECT_EQ(spec->num_kv_heads, 4);
  EXPECT_EQ(spec->bos_token_id, -1);
  EXPECT_TRUE(spec->eos_token_ids.empty());
  EXPECT_EQ(spec->max_position, 2048);
}

TEST(ParseHfConfigTest, ExplicitHeadDimMayDifferFromHiddenOverHeads) {
  absl::StatusOr<ModelSpec> spec =
      ParseHfConfig(Config({{"head_dim", "64"}, {"num_key_value_heads", "2"}}), "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->head_dim, 64);
  EXPECT_EQ(spec->q_dim(), 256);
  EXPECT_EQ(spec->kv_dim(), 128);
}

TEST(ParseHfConfigTest, LegacyRopeScalingTypeKeyAndDefaultType) {
  absl::StatusOr<ModelSpec> spec =
      ParseHfConfig(Config({{"rope_scaling", R"({"type": "llama3", "factor": 8, "low_freq_factor": 1,
               "high_freq_factor": 4, "original_max_position_embeddings": 64})"},
                            {"rope_theta", "250000"}}),
                    "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rope.type, RopeType::kLlama3);
  EXPECT_DOUBLE_EQ(spec->rope.theta, 250000.0);
  EXPECT_EQ(spec->rope.original_max_position, 64);

  spec = ParseHfConfig(Config({{"rope_scaling", R"({"rope_type": "default"})"}}), "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rope.type, RopeType::kDefault);
}

TEST(ParseHfConfigTest, Transformers5DefaultRopeTakesThetaFromRopeParameters) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(
      Config({{"rope_parameters", R"({"rope_type": "default", "rope_theta": 1000000.0})"}}), "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(spec->rope.theta, 1e6);
}

TEST(ParseHfConfigTest, EosAsSingleIntAndList) {
  absl::StatusOr<ModelSpec> spec =
      ParseHfConfig(Config({{"eos_token_id", "2"}, {"bos_token_id", "1"}}), "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->eos_token_ids, std::vector<int32_t>{2});
  EXPECT_EQ(spec->bos_token_id, 1);
  spec = ParseHfConfig(Config({{"eos_token_id", "[3, 4]"}}), "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->eos_token_ids, (std::vector<int32_t>{3, 4}));
}

TEST(ParseHfConfigTest, MistralSlidingWindowCapsMaxPosition) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(
      Config(
          {{"model_type", "\"mistral\""}, {"max_position_embeddings", "32768"}, {"sliding_window", "4096"}}),
      "c.json");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->model_type, "mistral");
  EXPECT_EQ(spec->max_position, 4096);
}

struct BadConfig {
  std::string label;
  std::map<std::string, std::string> changes;
  absl::StatusCode code;
  std::string key;  // must appear in the message as 'key'
};

class ParseHfConfigErrorTest : public ::testing::TestWithParam<BadConfig> {};

TEST_P(ParseHfConfigErrorTest, NamesTheKey) {
  const BadConfig& c = GetParam();
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(Config(c.changes), "dir/config.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), c.code) << spec.status();
  EXPECT_THAT(spec.status().message(), HasSubstr("dir/config.json"));
  EXPECT_THAT(spec.status().message(), HasSubstr("'" + c.key + "'"));
}

const auto kInvalid = absl::StatusCode::kInvalidArgument;
const auto kUnimplemented = absl::StatusCode::kUnimplemented;
INSTANTIATE_TEST_SUITE_P(
    AllKeys, ParseHfConfigErrorTest,
    ::testing::Values(
        BadConfig{"ModelTypeMissing", {{"model_type", ""}}, kInvalid, "model_type"},
        BadConfig{"ModelTypeNotString", {{"model_type", "3"}}, kInvalid, "model_type"},
        BadConfig{"ModelTypeGpt2", {{"model_type", "\"gpt2\""}}, kUnimplemented, "model_type"},
        BadConfig{"VocabMissing", {{"vocab_size", ""}}, kInvalid, "vocab_size"},
        BadConfig{"HiddenZero", {{"hidden_size", "0"}}, kInvalid, "hidden_size"},
        BadConfig{"HiddenNegative", {{"hidden_size", "-128"}}, kInvalid, "hidden_size"},
        BadConfig{"HiddenFraction", {{"hidden_size", "128.5"}}, kInvalid, "hidden_size"},
        BadConfig{"HiddenNotDivisible", {{"hidden_size", "130"}}, kInvalid, "hidden_size"},
        BadConfig{"IntermediateString", {{"intermediate_size", "\"344\""}}, kInvalid, "intermediate_size"},
        BadConfig{"LayersBool", {{"num_hidden_layers", "true"}}, kInvalid, "num_hidden_layers"},
        BadConfig{"HeadsString", {{"num_attention_heads", "\"x\""}}, kInvalid, "num_attention_heads"},
        BadConfig{"KvHeadsNotDivisor", {{"num_key_value_heads", "3"}}, kInvalid, "num_key_value_heads"},
        BadConfig{"KvHeadsAboveHeads", {{"num_key_value_heads", "8"}}, kInvalid, "num_key_value_heads"},
        BadConfig{"HeadDimOdd", {{"head_dim", "31"}}, kInvalid, "head_dim"},
        BadConfig{"HeadDimZero", {{"head_dim", "0"}}, kInvalid, "head_dim"},
        BadConfig{"EpsNegative", {{"rms_norm_eps", "-1e-5"}}, kInvalid, "rms_norm_eps"},
        BadConfig{"EpsString", {{"rms_norm_eps", "\"a\""}}, kInvalid, "rms_norm_eps"},
        BadConfig{"MaxPosZero", {{"max_position_embeddings", "0"}}, kInvalid, "max_position_embeddings"},
        BadConfig{"TieNotBool", {{"tie_word_embeddings", "\"yes\""}}, kInvalid, "tie_word_embeddings"},
        BadConfig{"BosString", {{"bos_token_id", "\"1\""}}, kInvalid, "bos_token_id"},
        BadConfig{"BosOutsideVocab", {{"bos_token_id", "512"}}, kInvalid, "bos_token_id"},
        BadConfig{"EosListWithString", {{"eos_token_id", "[1, \"x\"]"}}, kInvalid, "eos_token_id"},
        BadConfig{"EosNegative", {{"eos_token_id", "-2"}}, kInvalid, "eos_token_id"},
        BadConfig{"TorchDtypeInt8", {{"torch_dtype", "\"int8\""}}, kUnimplemented, "torch_dtype"},
        BadConfig{"TorchDtypeNumber", {{"torch_dtype", "16"}}, kInvalid, "torch_dtype"},
        BadConfig{"DtypeUnknown", {{"dtype", "\"float8\""}}, kUnimplemented, "dtype"},
        BadConfig{"AttentionBias", {{"attention_bias", "true"}}, kUnimplemented, "attention_bias"},
        BadConfig{"MlpBias", {{"mlp_bias", "true"}}, kUnimplemented, "mlp_bias"},
        BadConfig{"HiddenActGelu", {{"hidden_act", "\"gelu\""}}, kUnimplemented, "hidden_act"},
        BadConfig{"RopeThetaZero", {{"rope_theta", "0"}}, kInvalid, "rope_theta"},
        BadConfig{"RopeScalingString", {{"rope_scaling", "\"llama3\""}}, kInvalid, "rope_scaling"},
        BadConfig{"RopeScalingYarn",
                  {{"rope_scaling", R"({"rope_type": "yarn", "factor": 4.0})"}},
                  kUnimplemented,
                  "rope_scaling.rope_type"},
        BadConfig{"RopeScalingLegacyLinear",
                  {{"rope_scaling", R"({"type": "linear", "factor": 2.0})"}},
                  kUnimplemented,
                  "rope_scaling.type"},
        BadConfig{"RopeParametersDynamic",
                  {{"rope_parameters", R"({"rope_type": "dynamic", "rope_theta": 1e4})"}},
                  kUnimplemented,
                  "rope_parameters.rope_type"},
        BadConfig{"RopeParametersPerLayerType",
                  {{"rope_parameters", R"({"full_attention": {"rope_type": "default"}})"}},
                  kUnimplemented,
                  "rope_parameters.full_attention"},
        BadConfig{"RopeParametersThetaString",
                  {{"rope_parameters", R"({"rope_type": "default", "rope_theta": "big"})"}},
                  kInvalid,
                  "rope_parameters.rope_theta"},
        BadConfig{"Llama3MissingFactor",
                  {{"rope_scaling", R"({"rope_type": "llama3", "low_freq_factor": 1,
                    "high_freq_factor": 4, "original_max_position_embeddings": 64})"}},
                  kInvalid,
                  "rope_scaling.factor"},
        BadConfig{"Llama3HighNotAboveLow",
                  {{"rope_scaling", R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                    "high_freq_factor": 4, "original_max_position_embeddings": 64})"}},
                  kInvalid,
                  "rope_scaling.high_freq_factor"},
        BadConfig{"Llama3OriginalMaxPosZero",
                  {{"rope_scaling", R"({"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                    "high_freq_factor": 4, "original_max_position_embeddings": 0})"}},
                  kInvalid,
                  "rope_scaling.original_max_position_embeddings"},
        BadConfig{"SlidingWindowString", {{"sliding_window", "\"4k\""}}, kInvalid, "sliding_window"}),
    [](const ::testing::TestParamInfo<BadConfig>& info) { return info.param.label; });

TEST(ParseHfConfigTest, ExactMessageForWrongType) {
  absl::StatusOr<ModelSpec> spec = ParseHfConfig(Config({{"num_attention_heads", "\"x\""}}), "config.json");
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().message(),
            "config.json: key 'num_attention_heads': expected a positive integer, got \"x\"");
}

TEST(ParseHfConfigTest, NotJsonOrNotAnObject) {
  for (const char* text : {"", "{\"model_type\": ", "not json", "[1, 2]", "42"}) {
    absl::StatusOr<ModelSpec> spec = ParseHfConfig(text, "m/config.json");
    ASSERT_FALSE(spec.ok()) << text;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(spec.status().message(), HasSubstr("m/config.json")) << text;
  }
}

TEST(PresetTest, AllPresetsValidateAndSummarize) {
  const std::vector<std::string> names = PresetNames();
  EXPECT_EQ(names, (std::vector<std::string>{"tiny-mha", "tiny-gqa", "tiny-mqa", "small", "llama-7b",
                                             "llama-13b", "llama-33b", "llama3-8b", "llama3-70b"}));
  for (const std::string& name : names) {
    absl::StatusOr<ModelSpec> spec = PresetSpec(name);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->name, name);
    EXPECT_TRUE(spec->Validate().ok()) << spec->Validate();
    EXPECT_THAT(spec->Summary(), HasSubstr(name + ": "));
    EXPECT_FALSE(spec->eos_token_ids.empty()) << name;
    EXPECT_GE(spec->bos_token_id, 0) << name;
    EXPECT_EQ(spec->weight_dtype, DType::kBF16) << name;
  }
}

TEST(PresetTest, PublishedShapes) {
  absl::StatusOr<ModelSpec> s = PresetSpec("llama3-8b");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->Summary(), "llama3-8b: 32 layers, hidden 4096, heads 32/8 x 128, ffn 14336, vocab 128256");
  EXPECT_EQ(s->num_parameters(), 8030261248);
  EXPECT_EQ(s->eos_token_ids, (std::vector<int32_t>{128001, 128009}));
  EXPECT_EQ(s->bos_token_id, 128000);
  EXPECT_EQ(s->max_position, 8192);
  EXPECT_DOUBLE_EQ(s->rope.theta, 500000.0);
  EXPECT_EQ(s->kv_bytes_per_token(2), 2 * 32 * 1024 * 2);

  s = PresetSpec("llama-7b");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->num_parameters(), 6738415616);
  EXPECT_EQ(s->max_position, 4096);  // Llama 2's context for the Llama 1/2 shape
  EXPECT_DOUBLE_EQ(s->rms_norm_eps, 1e-6);
  EXPECT_EQ(s->eos_token_ids, std::vector<int32_t>{2});

  s = PresetSpec("llama-33b");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->Summary(), "llama-33b: 60 layers, hidden 6656, heads 52/52 x 128, ffn 17920, vocab 32000");

  s = PresetSpec("llama3-70b");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->Summary(), "llama3-70b: 80 layers, hidden 8192, heads 64/8 x 128, ffn 28672, vocab 128256");

  s = PresetSpec("small");
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->tie_word_embeddings);
  EXPECT_EQ(s->num_parameters(), 124668672);  // ~125M: 100M + an untied 32000 x 768 LM head
}

TEST(PresetTest, TinyShapes) {
  absl::StatusOr<ModelSpec> mha = PresetSpec("tiny-mha");
  absl::StatusOr<ModelSpec> gqa = PresetSpec("tiny-gqa");
  absl::StatusOr<ModelSpec> mqa = PresetSpec("tiny-mqa");
  ASSERT_TRUE(mha.ok() && gqa.ok() && mqa.ok());
  EXPECT_EQ(mha->num_kv_heads, mha->num_heads);
  EXPECT_FALSE(mha->tie_word_embeddings);
  EXPECT_EQ(mha->rope.type, RopeType::kDefault);
  EXPECT_EQ(gqa->num_heads / gqa->num_kv_heads, 4);
  EXPECT_TRUE(gqa->tie_word_embeddings);
  EXPECT_EQ(gqa->rope.type, RopeType::kLlama3);
  EXPECT_EQ(gqa->rope.original_max_position, 64);
  EXPECT_GT(gqa->max_position, gqa->rope.original_max_position);
  EXPECT_EQ(mqa->num_kv_heads, 1);
  EXPECT_EQ(mqa->head_dim, 64);
}

TEST(PresetTest, UnknownPresetListsKnownOnes) {
  absl::StatusOr<ModelSpec> s = PresetSpec("llama-9000b");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.status().message(), HasSubstr("llama-9000b"));
  EXPECT_THAT(s.status().message(), HasSubstr("tiny-gqa"));
  EXPECT_THAT(s.status().message(), HasSubstr("llama3-70b"));
}

TEST(ValidateTest, NamesTheField) {
  const ModelSpec good = *PresetSpec("tiny-gqa");
  struct Case {
    std::string field;
    void (*mutate)(ModelSpec&);
  };
  const Case cases[] = {
      {"vocab_size", [](ModelSpec& s) { s.vocab_size = 0; }},
      {"hidden_size", [](ModelSpec& s) { s.hidden_size = -1; }},
      {"intermediate_size", [](ModelSpec& s) { s.intermediate_size = 0; }},
      {"num_layers", [](ModelSpec& s) { s.num_layers = 0; }},
      {"num_heads", [](ModelSpec& s) { s.num_heads = 0; }},
      {"num_kv_heads", [](ModelSpec& s) { s.num_kv_heads = 3; }},
      {"head_dim", [](ModelSpec& s) { s.head_dim = 15; }},
      {"max_position", [](ModelSpec& s) { s.max_position = 0; }},
      {"num_layers", [](ModelSpec& s) { s.num_layers = 1 << 29; }},  // 10^13+ parameters
      {"rms_norm_eps", [](ModelSpec& s) { s.rms_norm_eps = 0; }},
      {"rope.theta", [](ModelSpec& s) { s.rope.theta = -1; }},
      {"rope.factor", [](ModelSpec& s) { s.rope.factor = 0; }},
      {"rope.high_freq_factor", [](ModelSpec& s) { s.rope.high_freq_factor = 0.5; }},
      {"rope.original_max_position", [](ModelSpec& s) { s.rope.original_max_position = 0; }},
      {"bos_token_id", [](ModelSpec& s) { s.bos_token_id = 100000; }},
      {"eos_token_ids",
       [](ModelSpec& s) {
         s.eos_token_ids = {1, -5};
       }},
  };
  for (const Case& c : cases) {
    ModelSpec s = good;
    c.mutate(s);
    absl::Status status = s.Validate();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(status.message(), HasSubstr("'" + c.field + "'")) << status;
    EXPECT_THAT(status.message(), HasSubstr("tiny-gqa")) << status;
  }
}

}  // namespace
}  // namespace tandem
