// UTF-8 helpers of the tokenizers (internal).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tandem::tokenizer::internal {

// Length of the UTF-8 character starting with byte `lead` (1 for bytes that cannot start one).
size_t Utf8CharLen(unsigned char lead);
// Number of bytes at the start of `s` that form complete, valid characters, stopping before a
// trailing incomplete character; invalid bytes in the middle count (they become U+FFFD).
size_t CompleteUtf8Prefix(std::string_view s);
// Bytes -> valid UTF-8, each maximal invalid subsequence replaced by U+FFFD (as Rust's
// String::from_utf8_lossy, which HF tokenizers uses).
std::string Utf8Lossy(std::string_view s);
// Length of a valid UTF-8 sequence at s[0] (0 if invalid or truncated).
size_t ValidCharLen(std::string_view s);

}  // namespace tandem::tokenizer::internal
