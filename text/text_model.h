// A model's text side: the tokenizer, chat template and special tokens that its checkpoint ships,
// loaded from the same path the weights come from, for the front ends (`tandem generate`,
// `tandem serve`, `tandem tokenize`). Below this, requests are token ids (docs/architecture.md).
//
//   *.gguf       tokenizer.ggml.* (tokenizer/tokenizer.h, MakeBpeTokenizer) and
//                tokenizer.chat_template
//   a directory  tokenizer.json (else tokenizer.model) and tokenizer_config.json's chat_template,
//                bos_token and eos_token
//   a preset     none: Load says NotFound, and callers stay with token ids
//
// Stop strings: StopMatcher watches one request's decoded text as it streams and says where the
// first stop string begins, holding back the text that could still turn into one.
//
// Thread safety: a TextModel is immutable after Load and may be shared; a StopMatcher is one
// stream's state.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "chat/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace tandem::text {

class TextModel {
 public:
  // NotFound for a path that ships no tokenizer (a preset name, a directory without
  // tokenizer.json or tokenizer.model); other errors name the file and what is wrong in it. A
  // chat template that the interpreter refuses is an error too (naming the construct), since a
  // chat request could not be served.
  static absl::StatusOr<std::unique_ptr<TextModel>> Load(const std::string& model_path);

  const tokenizer::Tokenizer& tokenizer() const { return *tokenizer_; }
  bool has_chat_template() const { return chat_ != nullptr; }
  // Where the tokenizer and template came from: "tokenizer.ggml.* of x.gguf", ...
  const std::string& source() const { return source_; }

  // A plain prompt: the text with the tokenizer's special tokens (BOS where the model wants it).
  absl::StatusOr<std::vector<int32_t>> EncodePrompt(std::string_view text) const;
  // A chat: the template rendered (with the generation prompt), then encoded without adding
  // special tokens (the template writes them), as transformers' apply_chat_template does.
  // FailedPrecondition when the model has no chat template.
  absl::StatusOr<std::vector<int32_t>> EncodeChat(const std::vector<ChatMessage>& messages) const;
  absl::StatusOr<std::string> RenderChat(const std::vector<ChatMessage>& messages) const;

 private:
  TextModel() = default;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  std::unique_ptr<ChatTemplate> chat_;
  std::string source_;
};

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds decoded text; returns the text that is now safe to emit (it cannot be the start of a
  // stop string any more). After a stop string was found, stopped() is true and nothing more is
  // emitted: the output ends just before it.
  std::string Add(std::string_view piece);
  // The end of the stream: whatever was held back (no stop string came).
  std::string Flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace tandem::text
