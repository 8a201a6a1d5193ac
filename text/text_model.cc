#include "text/text_model.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "compute_node/gguf.h"
#include "nlohmann/json.hpp"

namespace tandem::text {

namespace fs = std::filesystem;

namespace {

using tokenizer::BpeVocab;

absl::StatusOr<std::vector<std::string>> Strings(const std::map<std::string, GgufValue>& md,
                                                 const std::string& key, bool required) {
  std::vector<std::string> out;
  auto it = md.find(key);
  if (it == md.end()) {
    if (required) return absl::NotFoundError(absl::StrCat(key, " is missing"));
    return out;
  }
  if (!it->second.is_array() || it->second.elem_type != GgufType::kString)
    return absl::InvalidArgumentError(absl::StrCat(key, " is not an array of strings"));
  for (const GgufValue& v : it->second.array) out.push_back(v.s);
  return out;
}

std::optional<int32_t> Id(const std::map<std::string, GgufValue>& md, const std::string& key) {
  auto it = md.find(key);
  if (it == md.end() || !it->second.is_integer()) return std::nullopt;
  return static_cast<int32_t>(it->second.i);
}

absl::StatusOr<BpeVocab> VocabFromGguf(const std::map<std::string, GgufValue>& md) {
  BpeVocab v;
  if (auto it = md.find("tokenizer.ggml.model"); it != md.end() && it->second.is_string())
    v.model = it->second.s;
  if (auto it = md.find("tokenizer.ggml.pre"); it != md.end() && it->second.is_string()) v.pre = it->second.s;
  ASSIGN_OR_RETURN(v.tokens, Strings(md, "tokenizer.ggml.tokens", true));
  ASSIGN_OR_RETURN(v.merges, Strings(md, "tokenizer.ggml.merges", false));
  if (auto it = md.find("tokenizer.ggml.token_type"); it != md.end() && it->second.is_array()) {
    for (const GgufValue& t : it->second.array) v.token_types.push_back(static_cast<int32_t>(t.i));
  }
  if (auto it = md.find("tokenizer.ggml.scores"); it != md.end() && it->second.is_array()) {
    for (const GgufValue& t : it->second.array) v.scores.push_back(static_cast<float>(t.f));
  }
  v.bos_id = Id(md, "tokenizer.ggml.bos_token_id");
  v.eos_id = Id(md, "tokenizer.ggml.eos_token_id");
  v.unk_id = Id(md, "tokenizer.ggml.unknown_token_id");
  if (auto it = md.find("tokenizer.ggml.add_bos_token"); it != md.end()) v.add_bos = it->second.i != 0;
  return v;
}

std::string TokenText(const tokenizer::Tokenizer& t, std::optional<int32_t> id) {
  if (!id) return "";
  return t.IdToToken(*id).value_or("");
}

absl::StatusOr<std::string> ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(p.string(), ": cannot read"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// tokenizer_config.json: "bos_token"/"eos_token" as strings or {"content": ...}; "chat_template" as
// a string or a list of {"name", "template"} (the "default" one).
std::string SpecialText(const nlohmann::json& j, const char* key) {
  if (!j.contains(key)) return "";
  const nlohmann::json& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string())
    return v["content"].get<std::string>();
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<TextModel>> TextModel::Load(const std::string& model_path) {
  std::unique_ptr<TextModel> m(new TextModel());
  std::string chat_source, bos_text, eos_text;
  const fs::path path(model_path);
  std::error_code ec;
  if (fs::is_regular_file(path, ec) && absl::EndsWith(model_path, ".gguf")) {
    ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(model_path));
    absl::StatusOr<BpeVocab> vocab = VocabFromGguf(file->metadata());
    if (!vocab.ok()) return Annotate(vocab.status(), model_path);
    absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> t = tokenizer::MakeBpeTokenizer(*vocab);
    if (!t.ok()) return Annotate(t.status(), absl::StrCat(model_path, ": tokenizer.ggml.*"));
    m->tokenizer_ = *std::move(t);
    m->source_ = absl::StrCat("tokenizer.ggml.* of ", model_path);
    if (const GgufValue* tpl = file->Find("tokenizer.chat_template"); tpl != nullptr && tpl->is_string())
      chat_source = tpl->s;
    bos_text = TokenText(*m->tokenizer_, vocab->bos_id);
    eos_text = TokenText(*m->tokenizer_, vocab->eos_id);
  } else if (fs::is_directory(path, ec)) {
    if (fs::exists(path / "tokenizer.json")) {
      ASSIGN_OR_RETURN(m->tokenizer_, tokenizer::LoadHfTokenizer((path / "tokenizer.json").string()));
      m->source_ = (path / "tokenizer.json").string();
    } else if (fs::exists(path / "tokenizer.model")) {
      ASSIGN_OR_RETURN(m->tokenizer_,
                       tokenizer::LoadSentencePieceTokenizer((path / "tokenizer.model").string()));
      m->source_ = (path / "tokenizer.model").string();
    } else {
      return absl::NotFoundError(absl::StrCat(model_path, " has no tokenizer.json or tokenizer.model"));
    }
    bos_text = TokenText(*m->tokenizer_, m->tokenizer_->bos_id());
    eos_text = TokenText(*m->tokenizer_, m->tokenizer_->eos_id());
    if (fs::exists(path / "tokenizer_config.json")) {
      ASSIGN_OR_RETURN(const std::string raw, ReadFile(path / "tokenizer_config.json"));
      const nlohmann::json j = nlohmann::json::parse(raw, nullptr, false);
      if (j.is_discarded() || !j.is_object())
        return absl::InvalidArgumentError(
            absl::StrCat((path / "tokenizer_config.json").string(), ": not a JSON object"));
      if (std::string b = SpecialText(j, "bos_token"); !b.empty()) bos_text = b;
      if (std::string e = SpecialText(j, "eos_token"); !e.empty()) eos_text = e;
      if (j.contains("chat_template")) {
        const nlohmann::json& ct = j["chat_template"];
        if (ct.is_string()) {
          chat_source = ct.get<std::string>();
        } else if (ct.is_array()) {
          for (const nlohmann::json& e : ct)
            if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
                e["template"].is_string())
              chat_source = e["template"].get<std::string>();
        }
      }
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat("\"", model_path, "\" ships no tokenizer (a preset: token ids only)"));
  }
  if (!chat_source.empty()) {
    absl::StatusOr<ChatTemplate> tpl =
        ChatTemplate::Load(chat_source, {.bos_token = bos_text, .eos_token = eos_text});
    if (!tpl.ok()) return Annotate(tpl.status(), absl::StrCat(model_path, ": chat template"));
    m->chat_ = std::make_unique<ChatTemplate>(*std::move(tpl));
  }
  return m;
}

absl::StatusOr<std::vector<int32_t>> TextModel::EncodePrompt(std::string_view text) const {
  return tokenizer_->Encode(text, /*add_special=*/true);
}

absl::StatusOr<std::string> TextModel::RenderChat(const std::vector<ChatMessage>& messages) const {
  if (!chat_) return absl::FailedPreconditionError("this model ships no chat template");
  return chat_->Render(messages, /*add_generation_prompt=*/true);
}

absl::StatusOr<std::vector<int32_t>> TextModel::EncodeChat(const std::vector<ChatMessage>& messages) const {
  ASSIGN_OR_RETURN(const std::string prompt, RenderChat(messages));
  return tokenizer_->Encode(prompt, /*add_special=*/false);
}

std::string StopMatcher::Add(std::string_view piece) {
  if (stopped_) return "";
  held_.append(piece);
  size_t first = std::string::npos;
  for (const std::string& s : stops_) {
    if (s.empty()) continue;
    const size_t at = held_.find(s);
    if (at != std::string::npos && at < first) first = at;
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const std::string& s : stops_) {
    for (size_t n = std::min(s.size() - (s.empty() ? 0 : 1), held_.size()); n > keep; --n) {
      if (held_.compare(held_.size() - n, n, s, 0, n) == 0) {
        keep = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopMatcher::Flush() {
  std::string out;
  if (!stopped_) out.swap(held_);
  return out;
}

}  // namespace tandem::text
