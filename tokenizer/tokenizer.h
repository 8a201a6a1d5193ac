// Tokenizers: text <-> token ids, as the checkpoints' own tokenizers do it.
//
// Contract:
//   - Encode(text) returns exactly the ids Hugging Face `tokenizers` returns for the same file
//     (tests/tokenizer/ checks this on a corpus of many scripts). Added tokens (special or not)
//     are matched in the raw text first, longest match leftmost, as HF does; the text between them
//     goes through normalizer -> pre-tokenizer -> model. `add_special` adds what the file's post
//     processor adds (usually BOS), never EOS unless the file says so.
//   - Text must be valid UTF-8: anything else is InvalidArgument naming the byte offset of the
//     first bad byte ("invalid UTF-8 at byte 7"). Nothing is replaced silently on the way in.
//   - Decode(ids) equals HF's decode (bytes that do not form UTF-8 become U+FFFD as HF does);
//     an id outside the vocabulary is InvalidArgument naming it.
//   - IncrementalDecoder turns a stream of ids into text pieces whose concatenation is the decode
//     of the whole stream; a piece never ends inside a UTF-8 character (byte-fallback tokens and
//     byte-level tokens are held until their character is complete).
//   - Loading refuses what it does not implement with one line naming it, e.g.
//     `tokenizer.json: model.type "WordPiece" is not supported`; nothing is half supported.
//   - A Tokenizer is immutable after loading and safe to use from several threads at once
//     (an IncrementalDecoder is one stream's state: one thread at a time).
//   - Known differences from HF, none met by the files tested: added tokens marked "normalized"
//     are matched in the raw text, not the normalized one; "single_word" treats ASCII letters,
//     digits, '_' and every non-ASCII character as word characters; added tokens keep the ids the
//     file gives them (HF renumbers those absent from the model vocabulary after it). A stream
//     that contains an invalid byte sequence gets one U+FFFD per maximal invalid subsequence
//     where HF's ByteFallback decoder writes one per byte (Decode itself writes what HF does).
//   - SentencePiece (tokenizer.model): control pieces (<s>, </s>, [INST], ...) in the text are
//     special tokens, matched as above (sentencepiece alone would split them into pieces); the
//     text between them is encoded by libsentencepiece.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::tokenizer {

using TokenId = int32_t;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // text -> ids. add_special: add BOS (and whatever the file's post-processor adds).
  virtual absl::StatusOr<std::vector<TokenId>> Encode(std::string_view text,
                                                      bool add_special = true) const = 0;
  // ids -> text. skip_special: leave special tokens (BOS, EOS, control tokens) out.
  virtual absl::StatusOr<std::string> Decode(std::span<const TokenId> ids,
                                             bool skip_special = false) const = 0;

  virtual int32_t vocab_size() const = 0;  // model vocabulary + added tokens (largest id + 1)
  virtual std::optional<TokenId> TokenToId(std::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(TokenId id) const = 0;  // the token as stored
  virtual bool IsSpecial(TokenId id) const = 0;
  std::optional<TokenId> bos_id() const { return bos_id_; }
  std::optional<TokenId> eos_id() const { return eos_id_; }

  // Decoding for the incremental decoder: like Decode but bytes that are not (yet) UTF-8 stay
  // raw, so a stream can hold back a partial character. Decode == lossy UTF-8 of this for
  // byte-level tokenizers.
  virtual absl::StatusOr<std::string> DecodeBytes(std::span<const TokenId> ids, bool skip_special) const = 0;

 protected:
  std::optional<TokenId> bos_id_, eos_id_;
};

// Streaming detokenization of one sequence (see the contract above).
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special = true);
  // Adds one generated id; returns the text it completes (often empty).
  absl::StatusOr<std::string> Add(TokenId id);
  // End of the stream: what is still held (an incomplete character becomes U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<TokenId> ids_;
  size_t prefix_ = 0;  // ids_[prefix_, read_) were emitted; decoded again for context
  size_t read_ = 0;
  size_t held_emitted_ = 0;  // bytes past decode(ids_[prefix_, read_)) already emitted
};

// Hugging Face tokenizer.json (BPE model: byte-level, or SentencePiece-style with byte fallback).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path);
absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizerJson(std::string_view json);

// What a GGUF file carries (tokenizer.ggml.*), for building a BPE tokenizer without tokenizer.json.
struct BpeVocab {
  // GGUF token types (llama.cpp's llama_token_type).
  enum TokenType : int32_t {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };
  std::vector<std::string> tokens;   // tokenizer.ggml.tokens, index = id
  std::vector<std::string> merges;   // tokenizer.ggml.merges, "left right", highest priority first
  std::vector<int32_t> token_types;  // tokenizer.ggml.token_type (empty: all normal)
  // tokenizer.ggml.scores: for "llama" vocabularies without merges, the merges are derived from
  // them as transformers does (every split of a piece into two pieces, by the piece's score).
  std::vector<float> scores;
  std::optional<TokenId> bos_id, eos_id, unk_id;
  bool add_bos = false;  // tokenizer.ggml.add_bos_token
  // tokenizer.ggml.add_space_prefix ("llama" only): prepend "▁" to the text, as SentencePiece.
  bool add_space_prefix = true;
  // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE with byte
  // fallback and the metaspace, as Llama 2 / Mistral tokenizer.json; merges or scores).
  // Control, user-defined and unknown tokens are matched in the text before the model (special
  // when control or unknown), as llama.cpp and HF do.
  std::string model = "gpt2";
  // tokenizer.ggml.pre for byte-level BPE: "llama-bpe" (Llama 3), "smollm", "gpt2", "qwen2",
  // "default"; others are refused naming them.
  std::string pre = "default";
};
absl::StatusOr<std::unique_ptr<Tokenizer>> MakeBpeTokenizer(const BpeVocab& vocab);

// SentencePiece model file (tokenizer.model) through libsentencepiece. Control pieces (<s>, </s>)
// are special tokens, matched in the text like HF's added tokens; add_special adds BOS.
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path);

// Checks UTF-8; InvalidArgument "invalid UTF-8 at byte N" for the first bad byte.
absl::Status ValidateUtf8(std::string_view text);

}  // namespace tandem::tokenizer
