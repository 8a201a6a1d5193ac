// BpeVocab (GGUF tokenizer.ggml.*) -> the same BPE pipeline HF tokenizer.json files describe.
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"

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
    if (t == BpeVocab::kControl || t == BpeVocab::kUserDefined) {
      c.added.push_back({i, v.tokens[i], t == BpeVocab::kControl, false, false, false});
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
      RETURN_IF_ERROR(AddSplit(kQwen2, &c));  // Qwen2's NFC normalizer is not applied
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
      return absl::UnimplementedError("tokenizer: SentencePiece vocabulary without merges is not supported");
    }
    c.byte_fallback = true;
    c.fuse_unk = true;
    const std::string sp = "\xE2\x96\x81";
    c.normalizer.push_back({NormalizerStep::kPrepend, sp, ""});
    c.normalizer.push_back({NormalizerStep::kReplace, " ", sp});
    c.decoder.push_back({DecoderStep::kReplace, sp, " "});
    c.decoder.push_back({DecoderStep::kByteFallback});
    c.decoder.push_back({DecoderStep::kFuse});
    DecoderStep strip{DecoderStep::kStrip, " ", ""};
    strip.start = 1;
    c.decoder.push_back(strip);
  } else {
    return absl::UnimplementedError(absl::StrCat("tokenizer: model \"", v.model, "\" is not supported"));
  }
  return internal::MakeBpe(std::move(c));
}

}  // namespace tandem::tokenizer
