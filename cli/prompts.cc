#include "cli/prompts.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/json_depth.h"
#include "common/status.h"
#include "common/top_logprobs.h"
#include "nlohmann/json.hpp"

namespace tandem::cli {

absl::StatusOr<std::vector<int32_t>> ParseIdList(absl::string_view text) {
  std::vector<int32_t> ids;
  int index = 0;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    part = absl::StripAsciiWhitespace(part);
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("element ", index, " is \"", part, "\", expected a non-negative token id"));
    }
    ids.push_back(id);
    ++index;
  }
  return ids;
}

namespace {

using Json = nlohmann::json;

absl::Status KeyError(absl::string_view where, absl::string_view key, absl::string_view what,
                      const Json& got) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": key '", key, "': ", what, ", got ", got.dump()));
}

}  // namespace

absl::StatusOr<std::vector<PromptSpec>> ParsePromptsJsonl(absl::string_view text, absl::string_view source) {
  std::vector<PromptSpec> out;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    const std::string where = absl::StrCat(source, ":", line_no);
    if (absl::Status deep = CheckJsonDepth(std::string_view(line.data(), line.size())); !deep.ok())
      return Annotate(deep, where);
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON"));
    if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object"));
    PromptSpec p;
    int inputs = 0;
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& key = it.key();
      const Json& v = it.value();
      if (key == "prompt_ids") {
        if (!v.is_array() || v.empty())
          return KeyError(where, key, "expected a non-empty array of token ids", v);
        for (const Json& e : v) {
          if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX) {
            return KeyError(where, key, "expected non-negative integer token ids", e);
          }
          p.prompt_ids.push_back(static_cast<int32_t>(e.get<int64_t>()));
        }
        ++inputs;
      } else if (key == "prompt") {
        if (!v.is_string() || v.get<std::string>().empty())
          return KeyError(where, key, "expected non-empty text", v);
        p.prompt = v.get<std::string>();
        ++inputs;
      } else if (key == "messages") {
        if (!v.is_array() || v.empty())
          return KeyError(where, key, "expected a non-empty array of messages", v);
        for (const Json& m : v) {
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
              !m["content"].is_string() || m.size() != 2)
            return KeyError(where, key, "expected messages {\"role\": string, \"content\": string}", m);
          p.messages.emplace_back(m["role"].get<std::string>(), m["content"].get<std::string>());
        }
        ++inputs;
      } else if (key == "max_tokens" || key == "top_k") {
        if (!v.is_number_integer() || v.get<int64_t>() < (key == "max_tokens" ? 1 : 0)) {
          return KeyError(where, key,
                          key == "max_tokens" ? "expected an integer >= 1" : "expected an integer >= 0", v);
        }
        (key == "max_tokens" ? p.max_tokens : p.top_k) = v.get<int64_t>();
      } else if (key == "temperature" || key == "top_p") {
        if (!v.is_number()) return KeyError(where, key, "expected a number", v);
        (key == "temperature" ? p.temperature : p.top_p) = v.get<double>();
      } else if (key == "seed") {
        if (!v.is_number_unsigned()) return KeyError(where, key, "expected a non-negative integer", v);
        p.seed = v.get<uint64_t>();
      } else if (key == "top_logprobs") {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > kMaxTopLogprobs)
          return KeyError(where, key, absl::StrCat("expected an integer in [0, ", kMaxTopLogprobs, "]"), v);
        p.top_logprobs = v.get<int64_t>();
      } else if (key == "ignore_eos") {
        if (!v.is_boolean()) return KeyError(where, key, "expected true or false", v);
        p.ignore_eos = v.get<bool>();
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": unknown key '", key,
            "' (known: prompt_ids, prompt, messages, max_tokens, temperature, top_k, top_p, seed, "
            "ignore_eos, top_logprobs)"));
      }
    }
    if (inputs != 1)
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected exactly one of 'prompt_ids', 'prompt' or 'messages'"));
    out.push_back(std::move(p));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no prompts"));
  return out;
}

absl::StatusOr<std::vector<PromptSpec>> ReadPromptsFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno, absl::StrCat("open(", path, ")"));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ParsePromptsJsonl(ss.str(), path);
}

}  // namespace tandem::cli
