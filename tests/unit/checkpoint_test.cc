// Checkpoint directories (config.json + safetensors) written into a temp dir with the tiny-gqa
// shapes, the random-weight source, and the fp32 host copy.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_spec.h"
#include "compute_node/safetensors.h"
#include "compute_node/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

// config.json for `s`, as transformers 4.x writes it.
std::string ConfigJson(const ModelSpec& s, const std::string& torch_dtype = "bfloat16") {
  std::string rope = "null";
  if (s.rope.type == RopeType::kLlama3) {
    rope = absl::StrCat(R"({"rope_type": "llama3", "factor": )", s.rope.factor, R"(, "low_freq_factor": )",
                        s.rope.low_freq_factor, R"(, "high_freq_factor": )", s.rope.high_freq_factor,
                        R"(, "original_max_position_embeddings": )", s.rope.original_max_position, "}");
  }
  return absl::StrCat(
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",)",
      R"( "vocab_size": )", s.vocab_size, R"(, "hidden_size": )", s.hidden_size, R"(, "intermediate_size": )",
      s.intermediate_size, R"(, "num_hidden_layers": )", s.num_layers, R"(, "num_attention_heads": )",
      s.num_heads, R"(, "num_key_value_heads": )", s.num_kv_heads, R"(, "head_dim": )", s.head_dim,
      R"(, "max_position_embeddings": )", s.max_position, R"(, "rms_norm_eps": )", s.rms_norm_eps,
      R"(, "rope_theta": )", s.rope.theta, R"(, "rope_scaling": )", rope, R"(, "tie_word_embeddings": )",
      s.tie_word_embeddings ? "true" : "false", R"(, "bos_token_id": )", s.bos_token_id,
      R"(, "eos_token_id": [)", absl::StrJoin(s.eos_token_ids, ", "), R"(], "torch_dtype": ")", torch_dtype,
      R"("})");
}

// Values in [-1, 1) encoded as `dtype_name` ("BF16", "F16", "F32").
std::vector<uint8_t> Encode(const std::vector<float>& values, const std::string& dtype_name) {
  std::vector<uint8_t> bytes;
  for (float v : values) {
    uint8_t b[4];
    if (dtype_name == "F32") {
      std::memcpy(b, &v, 4);
      bytes.insert(bytes.end(), b, b + 4);
    } else {
      const uint16_t h = dtype_name == "BF16" ? FloatToBf16(v) : FloatToF16(v);
      std::memcpy(b, &h, 2);
      bytes.insert(bytes.end(), b, b + 2);
    }
  }
  return bytes;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsWriteItem RandomItem(const std::string& name, const std::vector<int64_t>& shape,
                                const std::string& dtype_name, std::mt19937* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> values(Numel(shape));
  for (float& v : values) v = u(*rng);
  return {name, dtype_name, shape, Encode(values, dtype_name)};
}

std::vector<SafetensorsWriteItem> ModelItems(const ModelSpec& spec, const std::string& dtype_name = "BF16") {
  std::mt19937 rng(1234);
  std::vector<SafetensorsWriteItem> items;
  for (const ExpectedTensor& t : ExpectedTensors(spec)) {
    items.push_back(RandomItem(t.name, t.shape, dtype_name, &rng));
  }
  return items;
}

// The item's values as fp32.
std::vector<float> Decode(const SafetensorsWriteItem& item) {
  std::vector<float> out(Numel(item.shape));
  const DType t = item.dtype_name == "F32"   ? DType::kF32
                  : item.dtype_name == "F16" ? DType::kF16
                                             : DType::kBF16;
  ConvertToF32(t, item.bytes.data(), static_cast<int64_t>(out.size()), out.data());
  return out;
}

std::vector<float> Read(const WeightSource& source, const std::string& name,
                        const std::vector<int64_t>& shape) {
  std::vector<float> out(Numel(shape));
  absl::Status s = source.ReadF32(name, out.data());
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

void Erase(std::vector<SafetensorsWriteItem>* items, const std::string& name) {
  std::erase_if(*items, [&](const SafetensorsWriteItem& i) { return i.name == name; });
}
SafetensorsWriteItem* Find(std::vector<SafetensorsWriteItem>* items, const std::string& name) {
  for (SafetensorsWriteItem& i : *items) {
    if (i.name == name) return &i;
  }
  return nullptr;
}

const std::string kK0 = "model.layers.0.self_attn.k_proj.weight";
const std::string kUp2 = "model.layers.2.mlp.up_proj.weight";

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "checkpoint_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    spec_ = *PresetSpec("tiny-gqa");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  void WriteText(const std::string& name, const std::string& text) const {
    std::ofstream(Path(name)) << text;
  }
  void WriteConfig(const ModelSpec& spec) const { WriteText("config.json", ConfigJson(spec)); }
  void WriteFile(const std::string& name, const std::vector<SafetensorsWriteItem>& items) const {
    absl::Status s = WriteSafetensors(Path(name), items, {{"format", "pt"}});
    ASSERT_TRUE(s.ok()) << s;
  }
  // Splits `items` into two shards (first half, second half) and writes an index for them.
  void WriteSharded(const std::vector<SafetensorsWriteItem>& items) const {
    const size_t half = items.size() / 2;
    WriteFile("model-00001-of-00002.safetensors", {items.begin(), items.begin() + half});
    WriteFile("model-00002-of-00002.safetensors", {items.begin() + half, items.end()});
    std::map<std::string, std::string> map;
    for (size_t i = 0; i < items.size(); ++i) {
      map[items[i].name] = i < half ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    WriteIndex(map);
  }
  void WriteIndex(const std::map<std::string, std::string>& map) const {
    std::vector<std::string> entries;
    for (const auto& [name, shard] : map) entries.push_back(absl::StrCat("\"", name, "\": \"", shard, "\""));
    WriteText("model.safetensors.index.json",
              absl::StrCat(R"({"metadata": {"total_size": 0}, "weight_map": {)", absl::StrJoin(entries, ", "),
                           "}}"));
  }

  // Opens the directory expecting `code` and every one of `parts` in the message.
  void ExpectError(absl::StatusCode code, const std::vector<std::string>& parts) const {
    absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
    ASSERT_FALSE(source.ok());
    EXPECT_EQ(source.status().code(), code) << source.status();
    for (const std::string& part : parts) {
      EXPECT_THAT(Msg(source.status()), HasSubstr(part));
    }
  }

  std::string dir_;
  ModelSpec spec_;
};

TEST_F(CheckpointTest, SingleFile) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteFile("model.safetensors", items);
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
  ASSERT_TRUE(source.ok()) << source.status();
  const ModelSpec& s = (*source)->spec();
  EXPECT_EQ(s.name, dir_);
  EXPECT_EQ(s.Summary(), absl::StrCat(dir_, spec_.Summary().substr(spec_.name.size())));
  EXPECT_EQ(s.rope.type, RopeType::kLlama3);
  EXPECT_EQ(s.weight_dtype, DType::kBF16);
  EXPECT_THAT((*source)->Describe(), HasSubstr(dir_));
  for (const SafetensorsWriteItem& item : items) {
    EXPECT_EQ(Read(**source, item.name, item.shape), Decode(item)) << item.name;
  }
  std::vector<float> out(1);
  EXPECT_EQ((*source)->ReadF32("lm_head.weight", out.data()).code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, ShardedWithIndex) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteSharded(items);
  // A stray file that the index does not name is not read.
  WriteText("stray.safetensors", "garbage");
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(Read(**source, items.front().name, items.front().shape), Decode(items.front()));
  EXPECT_EQ(Read(**source, items.back().name, items.back().shape), Decode(items.back()));
  EXPECT_THAT((*source)->Describe(), HasSubstr("2 files"));
}

TEST_F(CheckpointTest, ShardsWithoutIndexAreAllRead) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteFile("b.safetensors", {items.begin(), items.begin() + 5});
  WriteFile("a.safetensors", {items.begin() + 5, items.end()});
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_EQ(Read(**source, items[0].name, items[0].shape), Decode(items[0]));
}

TEST_F(CheckpointTest, TiedWithMatchingLmHeadIsAccepted) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  std::mt19937 rng(7);
  items.push_back(RandomItem("lm_head.weight", {spec_.vocab_size, spec_.hidden_size}, "BF16", &rng));
  WriteFile("model.safetensors", items);
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<ModelWeightsF32> w = LoadWeightsF32(**source);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(w->lm_head.empty());  // tied: the embedding is the head
}

TEST_F(CheckpointTest, TiedWithWrongShapeLmHead) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  std::mt19937 rng(7);
  items.push_back(RandomItem("lm_head.weight", {spec_.vocab_size, 64}, "BF16", &rng));
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "'lm_head.weight'", "shape [512,64], expected [512,128]"});
}

TEST_F(CheckpointTest, UntiedNeedsLmHead) {
  ModelSpec untied = spec_;
  untied.tie_word_embeddings = false;
  WriteConfig(untied);
  std::vector<SafetensorsWriteItem> items = ModelItems(untied);
  WriteFile("model.safetensors", items);
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
  ASSERT_TRUE(source.ok()) << source.status();
  absl::StatusOr<ModelWeightsF32> w = LoadWeightsF32(**source);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->lm_head, Decode(items.back()));
  EXPECT_EQ(w->lm_head_ptr(), w->lm_head.data());

  Erase(&items, "lm_head.weight");
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kNotFound, {"model.safetensors", "'lm_head.weight'", "missing"});
}

TEST_F(CheckpointTest, F16AndF32Files) {
  for (const std::string dtype : {"F16", "F32"}) {
    SCOPED_TRACE(dtype);
    WriteText("config.json", ConfigJson(spec_, dtype == "F16" ? "float16" : "float32"));
    std::vector<SafetensorsWriteItem> items = ModelItems(spec_, dtype);
    WriteFile("model.safetensors", items);
    absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenCheckpoint(dir_);
    ASSERT_TRUE(source.ok()) << source.status();
    EXPECT_EQ((*source)->spec().weight_dtype, dtype == "F16" ? DType::kF16 : DType::kF32);
    const SafetensorsWriteItem& up = *Find(&items, kUp2);
    EXPECT_EQ(Read(**source, kUp2, up.shape), Decode(up));
  }
}

TEST_F(CheckpointTest, RotaryInvFreqIsIgnored) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  std::mt19937 rng(7);
  items.push_back(RandomItem("model.layers.0.self_attn.rotary_emb.inv_freq", {8}, "F32", &rng));
  WriteFile("model.safetensors", items);
  EXPECT_TRUE(OpenCheckpoint(dir_).ok());
}

TEST_F(CheckpointTest, MissingConfig) {
  WriteFile("model.safetensors", ModelItems(spec_));
  ExpectError(absl::StatusCode::kNotFound, {Path("config.json")});
}

TEST_F(CheckpointTest, MalformedConfig) {
  WriteText("config.json", R"({"model_type": "llama", "vocab_size": )");
  WriteFile("model.safetensors", ModelItems(spec_));
  ExpectError(absl::StatusCode::kInvalidArgument, {Path("config.json")});
  WriteText("config.json", R"({"model_type": "llama", "vocab_size": "many"})");
  ExpectError(absl::StatusCode::kInvalidArgument, {Path("config.json"), "'vocab_size'"});
}

TEST_F(CheckpointTest, NoWeightFiles) {
  WriteConfig(spec_);
  ExpectError(absl::StatusCode::kNotFound, {dir_, "model.safetensors"});
}

TEST_F(CheckpointTest, MissingTensor) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  Erase(&items, kUp2);
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kNotFound, {"model.safetensors", "'" + kUp2 + "'", "missing"});
}

TEST_F(CheckpointTest, WrongShape) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  std::mt19937 rng(7);
  *Find(&items, kK0) = RandomItem(kK0, {64, 128}, "BF16", &rng);
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kInvalidArgument,
              {Path("model.safetensors") + ": tensor '" + kK0 + "': shape [64,128], expected [32,128]"});
}

TEST_F(CheckpointTest, UnsupportedDtype) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  SafetensorsWriteItem* k = Find(&items, kK0);
  k->dtype_name = "I64";
  k->bytes.resize(k->bytes.size() * 4);
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kUnimplemented, {"model.safetensors", "'" + kK0 + "'", "I64"});
}

TEST_F(CheckpointTest, UnexpectedTensor) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  std::mt19937 rng(7);
  items.push_back(RandomItem("model.layers.1.self_attn.q_norm.weight", {16}, "BF16", &rng));
  WriteFile("model.safetensors", items);
  ExpectError(absl::StatusCode::kInvalidArgument,
              {"model.safetensors", "'model.layers.1.self_attn.q_norm.weight'", "unexpected"});
}

TEST_F(CheckpointTest, DuplicateTensorAcrossShards) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteFile("a.safetensors", items);
  WriteFile("b.safetensors", {items[3]});
  ExpectError(absl::StatusCode::kInvalidArgument,
              {"'" + items[3].name + "'", "a.safetensors", "b.safetensors"});
}

TEST_F(CheckpointTest, IndexNamesMissingShard) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteSharded(items);
  std::filesystem::remove(Path("model-00002-of-00002.safetensors"));
  ExpectError(absl::StatusCode::kNotFound,
              {"model.safetensors.index.json", "model-00002-of-00002.safetensors"});
}

TEST_F(CheckpointTest, IndexWithPathOutsideDirectory) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteFile("model.safetensors", items);
  std::map<std::string, std::string> map;
  for (const SafetensorsWriteItem& item : items) map[item.name] = "model.safetensors";
  map[kK0] = "../x.safetensors";
  WriteIndex(map);
  ExpectError(absl::StatusCode::kInvalidArgument,
              {"model.safetensors.index.json", "../x.safetensors", "'" + kK0 + "'"});
}

TEST_F(CheckpointTest, IndexDisagreesWithShard) {
  WriteConfig(spec_);
  const std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteSharded(items);
  std::map<std::string, std::string> map;
  for (const SafetensorsWriteItem& item : items) map[item.name] = "model-00001-of-00002.safetensors";
  map[items.front().name] = "model-00002-of-00002.safetensors";
  WriteIndex(map);
  ExpectError(absl::StatusCode::kInvalidArgument, {"'" + items.front().name + "'", "index"});
}

TEST_F(CheckpointTest, IndexListsTensorMissingFromShard) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteSharded(items);
  std::map<std::string, std::string> map;
  for (size_t i = 0; i < items.size(); ++i) {
    map[items[i].name] =
        i < items.size() / 2 ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  map["model.layers.7.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors";
  WriteIndex(map);
  ExpectError(absl::StatusCode::kNotFound,
              {"model-00002-of-00002.safetensors", "'model.layers.7.mlp.up_proj.weight'"});
}

TEST_F(CheckpointTest, TensorNotListedInIndex) {
  WriteConfig(spec_);
  std::vector<SafetensorsWriteItem> items = ModelItems(spec_);
  WriteFile("model.safetensors", items);
  std::map<std::string, std::string> map;
  for (const SafetensorsWriteItem& item : items) map[item.name] = "model.safetensors";
  map.erase(kUp2);
  WriteIndex(map);
  ExpectError(absl::StatusCode::kInvalidArgument, {"model.safetensors", "'" + kUp2 + "'", "nowhere"});
}

TEST_F(CheckpointTest, TruncatedFile) {
  WriteConfig(spec_);
  WriteFile("model.safetensors", ModelItems(spec_));
  const std::string path = Path("model.safetensors");
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 100);
  ExpectError(absl::StatusCode::kDataLoss, {path, "truncated"});
}

TEST_F(CheckpointTest, OpenModelTakesPresetOrDirectory) {
  absl::StatusOr<std::unique_ptr<WeightSource>> preset = OpenModel("tiny-mha", 3);
  ASSERT_TRUE(preset.ok()) << preset.status();
  EXPECT_EQ((*preset)->Describe(), "preset tiny-mha (random weights, seed 3)");

  WriteConfig(spec_);
  WriteFile("model.safetensors", ModelItems(spec_));
  absl::StatusOr<std::unique_ptr<WeightSource>> dir = OpenModel(dir_);
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ((*dir)->spec().name, dir_);

  absl::StatusOr<std::unique_ptr<WeightSource>> neither = OpenModel(Path("no-such-model"));
  ASSERT_FALSE(neither.ok());
  EXPECT_EQ(neither.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Msg(neither.status()), HasSubstr("no-such-model"));
  EXPECT_THAT(Msg(neither.status()), HasSubstr("tiny-gqa"));
}

TEST(RandomWeightsTest, DeterministicPerSeedAndBf16Exact) {
  const ModelSpec spec = *PresetSpec("tiny-gqa");
  auto a = RandomWeights(spec, 42), b = RandomWeights(spec, 42), c = RandomWeights(spec, 43);
  for (const ExpectedTensor& t : ExpectedTensors(spec)) {
    SCOPED_TRACE(t.name);
    const std::vector<float> va = Read(*a, t.name, t.shape);
    EXPECT_EQ(va, Read(*b, t.name, t.shape));
    EXPECT_NE(va, Read(*c, t.name, t.shape));
    float lo = va[0], hi = va[0];
    for (float v : va) {
      ASSERT_EQ(v, Bf16ToFloat(FloatToBf16(v)));
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    if (t.shape.size() == 1) {  // norm: 1 + U(-0.1, 0.1), to bf16's half step (2^-8) near 1
      EXPECT_GE(lo, 0.9f - 0.004f);
      EXPECT_LE(hi, 1.1f + 0.004f);
      EXPECT_LT(lo, 0.95f);
      EXPECT_GT(hi, 1.05f);
    } else if (t.name == HfNames::Embed()) {  // U(-1, 1)
      EXPECT_GE(lo, -1.0f);
      EXPECT_LE(hi, 1.0f);
      EXPECT_LT(lo, -0.9f);
      EXPECT_GT(hi, 0.9f);
    } else {  // U(-1/sqrt(in), 1/sqrt(in)), to bf16 rounding (relative 2^-9)
      const float bound = 1.0f / std::sqrt(static_cast<float>(t.shape[1]));
      EXPECT_GE(lo, -bound * 1.004f);
      EXPECT_LE(hi, bound * 1.004f);
      EXPECT_LT(lo, -0.8f * bound);
      EXPECT_GT(hi, 0.8f * bound);
    }
  }
  // Different tensors of the same shape differ.
  EXPECT_NE(Read(*a, "model.layers.0.mlp.gate_proj.weight", {344, 128}),
            Read(*a, "model.layers.0.mlp.up_proj.weight", {344, 128}));
  std::vector<float> out(1);
  EXPECT_EQ(a->ReadF32("lm_head.weight", out.data()).code(), absl::StatusCode::kNotFound);
}

TEST(LoadWeightsF32Test, FusedLayout) {
  const ModelSpec spec = *PresetSpec("tiny-gqa");
  auto source = RandomWeights(spec, 5);
  absl::StatusOr<ModelWeightsF32> w = LoadWeightsF32(*source);
  ASSERT_TRUE(w.ok()) << w.status();
  const int64_t h = spec.hidden_size, inter = spec.intermediate_size;
  ASSERT_EQ(w->layers.size(), 3u);
  EXPECT_EQ(w->embed, Read(*source, HfNames::Embed(), {spec.vocab_size, h}));
  EXPECT_EQ(w->final_norm, Read(*source, HfNames::FinalNorm(), {h}));
  EXPECT_TRUE(w->lm_head.empty());
  EXPECT_EQ(w->lm_head_ptr(), w->embed.data());
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    SCOPED_TRACE(l);
    const LayerWeightsF32& L = w->layers[l];
    auto read = [&](const char* leaf, std::vector<int64_t> shape) {
      return Read(*source, HfNames::Layer(l, leaf), shape);
    };
    const std::vector<float> q = read("self_attn.q_proj.weight", {spec.q_dim(), h});
    const std::vector<float> k = read("self_attn.k_proj.weight", {spec.kv_dim(), h});
    const std::vector<float> v = read("self_attn.v_proj.weight", {spec.kv_dim(), h});
    ASSERT_EQ(L.wqkv.size(), static_cast<size_t>((spec.q_dim() + 2 * spec.kv_dim()) * h));
    // Row q_dim of wqkv is row 0 of k_proj; row q_dim + kv_dim is row 0 of v_proj.
    EXPECT_TRUE(std::equal(k.begin(), k.begin() + h, L.wqkv.begin() + spec.q_dim() * h));
    std::vector<float> qkv = q;
    qkv.insert(qkv.end(), k.begin(), k.end());
    qkv.insert(qkv.end(), v.begin(), v.end());
    EXPECT_EQ(L.wqkv, qkv);
    std::vector<float> gate_up = read("mlp.gate_proj.weight", {inter, h});
    const std::vector<float> up = read("mlp.up_proj.weight", {inter, h});
    EXPECT_TRUE(std::equal(up.begin(), up.begin() + h, L.w_gate_up.begin() + inter * h));
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    EXPECT_EQ(L.w_gate_up, gate_up);
    EXPECT_EQ(L.wo, read("self_attn.o_proj.weight", {h, spec.q_dim()}));
    EXPECT_EQ(L.w_down, read("mlp.down_proj.weight", {h, inter}));
    EXPECT_EQ(L.input_norm, read("input_layernorm.weight", {h}));
    EXPECT_EQ(L.post_norm, read("post_attention_layernorm.weight", {h}));
  }
  // Same again: the parallel fill is deterministic.
  absl::StatusOr<ModelWeightsF32> again = LoadWeightsF32(*source);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->layers[2].wqkv, w->layers[2].wqkv);
  EXPECT_EQ(again->embed, w->embed);
}

// Host memory MemAvailable says is free, in bytes (0 if unknown).
int64_t MemAvailableBytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoll(line.substr(13)) * 1024;
  }
  return 0;
}

TEST(LoadWeightsF32Test, HugePresetIsResourceExhaustedWithoutAllocating) {
  const ModelSpec spec = *PresetSpec("llama3-70b");
  if (MemAvailableBytes() > spec.num_parameters() * 4) {
    GTEST_SKIP() << "this host could hold llama3-70b in fp32";
  }
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ModelWeightsF32> w = LoadWeightsF32(*RandomWeights(spec, 0));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Msg(w.status()), HasSubstr("262.8 GiB"));
  EXPECT_THAT(Msg(w.status()), HasSubstr("available"));
  EXPECT_THAT(Msg(w.status()), HasSubstr("cuda backend"));
  EXPECT_LT(seconds, 1.0);
}

}  // namespace
}  // namespace tandem
