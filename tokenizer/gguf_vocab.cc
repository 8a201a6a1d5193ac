// BpeVocab (GGUF tokenizer.ggml.*) -> the same BPE pipeline HF tokenizer.json files describe.
#include <algorithm>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace tandem::tokenizer {
namespace {

using internal::BpeConfig;
using internal::DecoderStep;
using internal::NormalizerStep;
using internal::PreTokenizerStep;
using internal::Regex;

constexpr const char* kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

absl::Status AddSplit(const char* pattern, BpeConfig* c) {
  PreTokenizerStep s{};
  s.kind = PreTokenizerStep::kSplit;
  s.behavior = PreTokenizerStep::kIsolated;
  ASSIGN_OR_RETURN(s.regex, Regex::Compile(pattern, false));
  c->pre_tokenizer.push_back(std::move(s));
  return absl::OkStatus();
}

// transformers' SentencePieceExtractor: for every piece (in id order) each split into two pieces
// of the vocabulary, ordered by the halves' ids; then all by the merged piece's score, highest
// first (stable).
std::vector<std::pair<std::string, std::string>> MergesFromScores(const std::vector<std::string>& tokens,
                                                                  const std::vector<float>& scores) {
  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < tokens.size(); ++i) ids.emplace(tokens[i], static_cast<int32_t>(i));
  struct M {
    int32_t l, r;
    float score;
  };
  std::vector<M> all;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& p = tokens[i];
    std::vector<M> local;
    for (size_t k = internal::Utf8CharLen(static_cast<unsigned char>(p[0])); k < p.size();
         k += internal::Utf8CharLen(static_cast<unsigned char>(p[k]))) {
      auto l = ids.find(p.substr(0, k)), r = ids.find(p.substr(k));
      if (l != ids.end() && r != ids.end()) local.push_back({l->second, r->second, scores[i]});
    }
    std::sort(local.begin(), local.end(),
              [](const M& a, const M& b) { return a.l != b.l ? a.l < b.l : a.r < b.r; });
    all.insert(all.end(), local.begin(), local.end());
  }
  std::stable_sort(all.begin(), all.end(), [](const M& a, const M& b) { return a.score > b.score; });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(all.size());
  for (const M& m : all) out.emplace_back(tokens[m.l], tokens[m.r]);
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeBpeTokenizer(const BpeVocab& v) {
  BpeConfig c;
  c.id_to_token = v.tokens;
  if (!v.token_types.empty() && v.token_types.size() != v.tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: ", v.token_types.size(), " token types for ", v.tokens.size(), " tokens"));
  }
  for (const std::string& m : v.merges) {
    size_t sp = m.find(' ', 1);
    if (sp == std::string::npos)
      return absl::InvalidArgumentError(absl::StrCat("tokenizer: bad merge \"", m, "\""));
    c.merges.emplace_back(m.substr(0, sp), m.substr(sp + 1));
  }
  const int32_t n = static_cast<int32_t>(v.tokens.size());
  for (auto id : {v.bos_id, v.eos_id, v.unk_id}) {
    if (id && (*id < 0 || *id >= n)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer: special token id ", *id, " is outside the vocabulary (", n, " tokens)"));
    }
  }
  // Control tokens are special added tokens; user-defined ones are added tokens (both matched in
  // the text before the model, as llama.cpp and HF do).
  for (int32_t i = 0; i < static_cast<int32_t>(v.token_types.size()); ++i) {
    int32_t t = v.token_types[i];
    if (t == BpeVocab::kControl || t == BpeVocab::kUserDefined || t == BpeVocab::kUnknown) {
      c.added.push_back({i, v.tokens[i], t != BpeVocab::kUserDefined, false, false, false});
    }
  }
  c.bos_id = v.bos_id;
  c.eos_id = v.eos_id;
  c.unk_id = v.unk_id;
  if (v.add_bos && v.bos_id) c.prefix_ids.push_back(*v.bos_id);
  if (v.model == "gpt2") {
    const std::string& p = v.pre;
    if (p == "llama-bpe" || p == "llama3" || p == "llama-v3") {
      RETURN_IF_ERROR(AddSplit(kLlama3, &c));
      c.ignore_merges = true;
    } else if (p == "smollm" || p == "starcoder" || p == "refact") {
      RETURN_IF_ERROR(AddSplit(R"(\p{N})", &c));
      RETURN_IF_ERROR(AddSplit(kGpt2, &c));
    } else if (p == "gpt2" || p == "default" || p.empty()) {
      RETURN_IF_ERROR(AddSplit(kGpt2, &c));
    } else if (p == "qwen2") {
      RETURN_IF_ERROR(AddSplit(kQwen2, &c));
      c.normalizer.push_back({NormalizerStep::kUnicode, "NFC", ""});  // as Qwen2's tokenizer.json
    } else {
      return absl::UnimplementedError(absl::StrCat("tokenizer: pre-tokenizer \"", p, "\" is not supported"));
    }
    PreTokenizerStep bl{};
    bl.kind = PreTokenizerStep::kByteLevel;
    bl.add_prefix_space = false;
    bl.use_regex = false;
    c.pre_tokenizer.push_back(std::move(bl));
    c.decoder.push_back({DecoderStep::kByteLevel});
  } else if (v.model == "llama") {
    if (v.merges.empty()) {
      if (v.scores.size() != v.tokens.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer: a \"llama\" vocabulary without merges needs one score per token (",
                         v.scores.size(), " scores for ", n, " tokens)"));
      }
      c.merges = MergesFromScores(v.tokens, v.scores);
    }
    c.byte_fallback = true;
    c.fuse_unk = true;
    const std::string sp = "\xE2\x96\x81";
    if (v.add_space_prefix) c.normalizer.push_back({NormalizerStep::kPrepend, sp, ""});
    c.normalizer.push_back({NormalizerStep::kReplace, " ", sp});
    c.decoder.push_back({DecoderStep::kReplace, sp, " "});
    c.decoder.push_back({DecoderStep::kByteFallback});
    c.decoder.push_back({DecoderStep::kFuse});
    if (v.add_space_prefix) {
      DecoderStep strip{DecoderStep::kStrip, " ", ""};
      strip.start = 1;
      c.decoder.push_back(strip);
    }
  } else {
    return absl::UnimplementedError(absl::StrCat("tokenizer: model \"", v.model, "\" is not supported"));
  }
  return internal::MakeBpe(std::move(c));
}

}  // namespace tandem::tokenizer
