// Parsing of the prompts `tandem generate` takes: a comma-separated id list (--prompt-ids) or a
// JSON-lines file (--prompts-file). Errors name the argument, the line and the key at fault.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::cli {

// "1,2, 3" -> {1, 2, 3}. Every element must be a non-negative 32-bit integer.
absl::StatusOr<std::vector<int32_t>> ParseIdList(absl::string_view text);

// One line of a prompts file: exactly one of {"prompt_ids": [..]}, {"prompt": "text"} or
// {"messages": [{"role": r, "content": c}, ...]} (a chat, through the model's template), and
// "max_tokens"?: n, "temperature"?: t, "top_k"?: k, "top_p"?: p, "seed"?: s, "ignore_eos"?: b,
// "top_logprobs"?: k (alternatives per generated token, in [0, 20]).
// Absent fields take the command line's values. Text needs a model that ships a tokenizer.
struct PromptSpec {
  std::vector<int32_t> prompt_ids;
  std::optional<std::string> prompt;                          // text
  std::vector<std::pair<std::string, std::string>> messages;  // (role, content)
  std::optional<int64_t> max_tokens;
  std::optional<double> temperature;
  std::optional<int64_t> top_k;
  std::optional<double> top_p;
  std::optional<uint64_t> seed;
  std::optional<bool> ignore_eos;
  std::optional<int64_t> top_logprobs;
};
// Blank lines are skipped; any other key is an error (a misspelt "max_token" must not be
// silently ignored).
absl::StatusOr<std::vector<PromptSpec>> ParsePromptsJsonl(absl::string_view text, absl::string_view source);
absl::StatusOr<std::vector<PromptSpec>> ReadPromptsFile(const std::string& path);

}  // namespace tandem::cli

namespace tandem {
struct GenerationRequest;
}  // namespace tandem

namespace tandem::cli {

// The requests of prompt specs: a field a spec leaves out takes its value from `defaults`.
std::vector<GenerationRequest> RequestsFromPrompts(const std::vector<PromptSpec>& specs,
                                                   const GenerationRequest& defaults);

}  // namespace tandem::cli
