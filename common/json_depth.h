// A guard for JSON text from outside (API request bodies, prompts files): the nesting depth of
// arrays and objects, checked by one linear scan before a parser or a printer recurses into it.
// nlohmann's parser is iterative, but printing a value (dump) and walking it are recursive, so a
// request of 100,000 nested brackets would otherwise overflow the stack.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace tandem {

inline constexpr int kMaxJsonDepth = 64;

// InvalidArgument ("JSON nested deeper than 64 levels at byte 70") when arrays and objects nest
// deeper than `max_depth`; brackets inside strings (escapes included) do not count. Says nothing
// else about validity: the parser does that.
absl::Status CheckJsonDepth(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace tandem
