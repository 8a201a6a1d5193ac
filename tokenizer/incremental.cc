#include "common/status.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace tandem::tokenizer {

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

// Decodes the window ids_[prefix_, read_) (already emitted, kept for context: decoders treat the
// first token of a text specially) and ids_[prefix_, end); the new text is the difference. Bytes
// of a character not yet complete are held back until a later token completes it.
absl::StatusOr<std::string> IncrementalDecoder::Add(TokenId id) {
  ids_.push_back(id);
  std::span<const TokenId> all(ids_);
  ASSIGN_OR_RETURN(std::string before,
                   tokenizer_.DecodeBytes(all.subspan(prefix_, read_ - prefix_), skip_special_));
  absl::StatusOr<std::string> after = tokenizer_.DecodeBytes(all.subspan(prefix_), skip_special_);
  if (!after.ok()) {
    ids_.pop_back();
    return after.status();
  }
  size_t start = std::min(before.size() + held_emitted_, after->size());
  std::string_view fresh = std::string_view(*after).substr(start);
  size_t complete = internal::CompleteUtf8Prefix(fresh);
  std::string out = internal::Utf8Lossy(fresh.substr(0, complete));
  if (complete == fresh.size()) {
    // The next window starts at the last emitted token that decodes to text (a skipped special
    // token first in the window would let the decoder strip the next token's leading space).
    read_ = ids_.size();
    for (size_t p = read_; p-- > prefix_;) {
      if (!skip_special_ || !tokenizer_.IsSpecial(ids_[p])) {
        prefix_ = p;
        break;
      }
    }
    held_emitted_ = 0;
  } else {
    held_emitted_ += complete;
  }
  return out;
}

std::string IncrementalDecoder::Flush() {
  std::span<const TokenId> all(ids_);
  absl::StatusOr<std::string> before =
      tokenizer_.DecodeBytes(all.subspan(prefix_, read_ - prefix_), skip_special_);
  absl::StatusOr<std::string> after = tokenizer_.DecodeBytes(all.subspan(prefix_), skip_special_);
  std::string out;
  if (before.ok() && after.ok() && before->size() + held_emitted_ <= after->size()) {
    out = internal::Utf8Lossy(std::string_view(*after).substr(before->size() + held_emitted_));
  }
  prefix_ = read_ = ids_.size();
  held_emitted_ = 0;
  return out;
}

}  // namespace tandem::tokenizer
