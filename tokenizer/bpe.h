// The BPE tokenizer behind tokenizer.json and GGUF vocabularies (internal): a pipeline of
// normalizer, pre-tokenizer, model and decoder steps, each one HF tokenizers component.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "tokenizer/tokenizer.h"

namespace tandem::tokenizer::internal {

// A compiled PCRE2 pattern (UTF + Unicode properties).
class Regex {
 public:
  static absl::StatusOr<std::shared_ptr<Regex>> Compile(const std::string& pattern, bool literal);
  ~Regex();
  // Non-overlapping matches [begin, end) in `text` (valid UTF-8), left to right. Fails only where
  // PCRE2 runs out of its match limits (a pathological pattern on a huge input).
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> FindAll(std::string_view text) const;

 private:
  void* code_ = nullptr;
};

struct NormalizerStep {
  enum Kind { kPrepend, kReplace, kUnicode } kind;
  std::string a, b;  // prepend: a; replace: a -> b; unicode: a = "NFC", "NFD", "NFKC" or "NFKD"
};

struct PreTokenizerStep {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  // kSplit
  std::shared_ptr<Regex> regex;
  enum Behavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext } behavior = kIsolated;
  // kByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // kMetaspace
  std::string replacement = "\xE2\x96\x81";
  enum Prepend { kAlways, kFirst, kNever } prepend_scheme = kAlways;
  bool split = true;
};

struct DecoderStep {
  enum Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;  // replace: a -> b; strip: a (content); metaspace: a (replacement)
  int start = 0, stop = 0;
  bool prepend = true;  // metaspace: strip the first token's leading space
};

struct AddedToken {
  TokenId id;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, single_word = false;
};

struct BpeConfig {
  std::vector<std::string> id_to_token;                     // model vocabulary; "" for holes
  std::vector<std::pair<std::string, std::string>> merges;  // by priority
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::optional<TokenId> unk_id;
  std::vector<AddedToken> added;
  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  std::vector<TokenId> prefix_ids, suffix_ids;  // post-processor (single sequence)
  std::optional<TokenId> bos_id, eos_id;
};

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeBpe(BpeConfig config);

// Unicode normalization ("NFC", "NFD", "NFKC", "NFKD") through utf8proc.
absl::StatusOr<std::string> UnicodeNormalize(std::string_view text, std::string_view form);

// GPT-2's byte <-> printable character map (ByteLevel pre-tokenizer and decoder).
const std::array<std::string, 256>& ByteToUnicode();

}  // namespace tandem::tokenizer::internal
