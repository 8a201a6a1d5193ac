#include "tokenizer/utf8.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tokenizer/tokenizer.h"

namespace tandem::tokenizer {
namespace internal {

size_t Utf8CharLen(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

// Length of the longest prefix of s[0..] that is a valid start of a character (maximal subpart),
// and whether it is a whole character.
static size_t ValidPrefix(std::string_view s, bool* complete) {
  auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  *complete = false;
  if (s.empty()) return 0;
  unsigned char c = b(0);
  if (c < 0x80) {
    *complete = true;
    return 1;
  }
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    need = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  size_t i = 1;
  for (; i < need && i < s.size(); ++i) {
    unsigned char x = b(i);
    unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (x < l || x > h) return i;
  }
  *complete = i == need;
  return i;
}

size_t ValidCharLen(std::string_view s) {
  bool complete;
  size_t n = ValidPrefix(s, &complete);
  return complete ? n : 0;
}

size_t CompleteUtf8Prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    bool complete;
    size_t n = ValidPrefix(s.substr(i), &complete);
    if (complete) {
      i += n;
    } else if (i + n == s.size()) {
      return i;  // a truncated character at the end: hold it
    } else {
      i += n == 0 ? 1 : n;  // invalid: becomes U+FFFD
    }
  }
  return i;
}

std::string Utf8Lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    bool complete;
    size_t n = ValidPrefix(s.substr(i), &complete);
    if (complete) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += n == 0 ? 1 : n;
    }
  }
  return out;
}

}  // namespace internal

absl::Status ValidateUtf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    size_t n = internal::ValidCharLen(text.substr(i));
    if (n == 0) {
      return absl::InvalidArgumentError(absl::StrCat("invalid UTF-8 at byte ", i, " (0x",
                                                     absl::Hex(static_cast<unsigned char>(text[i])), ")"));
    }
    i += n;
  }
  return absl::OkStatus();
}

}  // namespace tandem::tokenizer
