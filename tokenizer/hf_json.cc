// Hugging Face tokenizer.json -> BpeConfig.
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "tokenizer/bpe.h"
#include "tokenizer/tokenizer.h"

namespace tandem::tokenizer {
namespace {

using internal::BpeConfig;
using internal::DecoderStep;
using internal::NormalizerStep;
using internal::PreTokenizerStep;
using internal::Regex;
using json = nlohmann::json;

absl::Status Unsupported(std::string_view where, std::string_view what) {
  return absl::UnimplementedError(
      absl::StrCat("tokenizer.json: ", ToAbsl(where), " \"", ToAbsl(what), "\" is not supported"));
}

std::string Type(const json& j) {
  return j.is_object() && j.contains("type") ? j["type"].get<std::string>() : "";
}

// {"String": s} or {"Regex": r}; literal strings are returned as such (is_regex false).
absl::Status Pattern(const json& p, std::string_view where, std::string* out, bool* is_regex) {
  if (p.contains("String")) {
    *out = p["String"].get<std::string>();
    *is_regex = false;
  } else if (p.contains("Regex")) {
    *out = p["Regex"].get<std::string>();
    *is_regex = true;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.json: ", ToAbsl(where), ": pattern without String or Regex"));
  }
  return absl::OkStatus();
}

absl::Status Normalizer(const json& n, BpeConfig* c) {
  if (n.is_null()) return absl::OkStatus();
  std::string t = Type(n);
  if (t == "Sequence") {
    for (const json& x : n["normalizers"]) RETURN_IF_ERROR(Normalizer(x, c));
  } else if (t == "NFC" || t == "NFD" || t == "NFKC" || t == "NFKD") {
    c->normalizer.push_back({NormalizerStep::kUnicode, t, ""});
  } else if (t == "Prepend") {
    c->normalizer.push_back({NormalizerStep::kPrepend, n["prepend"].get<std::string>(), ""});
  } else if (t == "Replace") {
    std::string pat;
    bool is_regex;
    RETURN_IF_ERROR(Pattern(n["pattern"], "normalizer Replace", &pat, &is_regex));
    if (is_regex) return Unsupported("normalizer Replace pattern", "Regex");
    c->normalizer.push_back({NormalizerStep::kReplace, pat, n["content"].get<std::string>()});
  } else {
    return Unsupported("normalizer.type", t);
  }
  return absl::OkStatus();
}

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

absl::Status PreTokenizer(const json& p, BpeConfig* c) {
  if (p.is_null()) return absl::OkStatus();
  std::string t = Type(p);
  PreTokenizerStep s{};
  if (t == "Sequence") {
    for (const json& x : p["pretokenizers"]) RETURN_IF_ERROR(PreTokenizer(x, c));
    return absl::OkStatus();
  } else if (t == "Split") {
    std::string pat;
    bool is_regex;
    RETURN_IF_ERROR(Pattern(p["pattern"], "pre_tokenizer Split", &pat, &is_regex));
    if (p.value("invert", false)) return Unsupported("pre_tokenizer Split invert", "true");
    std::string b = p.value("behavior", "Isolated");
    if (b == "Isolated") {
      s.behavior = PreTokenizerStep::kIsolated;
    } else if (b == "Removed") {
      s.behavior = PreTokenizerStep::kRemoved;
    } else if (b == "MergedWithPrevious") {
      s.behavior = PreTokenizerStep::kMergedWithPrevious;
    } else if (b == "MergedWithNext") {
      s.behavior = PreTokenizerStep::kMergedWithNext;
    } else {
      return Unsupported("pre_tokenizer Split behavior", b);
    }
    s.kind = PreTokenizerStep::kSplit;
    ASSIGN_OR_RETURN(s.regex, Regex::Compile(pat, !is_regex));
  } else if (t == "Digits") {
    s.kind = PreTokenizerStep::kSplit;
    ASSIGN_OR_RETURN(s.regex,
                     Regex::Compile(p.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)", false));
  } else if (t == "ByteLevel") {
    s.kind = PreTokenizerStep::kByteLevel;
    s.add_prefix_space = p.value("add_prefix_space", true);
    s.use_regex = p.value("use_regex", true);
    ASSIGN_OR_RETURN(s.regex, Regex::Compile(kGpt2Regex, false));
  } else if (t == "Metaspace") {
    s.kind = PreTokenizerStep::kMetaspace;
    s.replacement = p.value("replacement", "\xE2\x96\x81");
    std::string scheme = p.value("prepend_scheme", p.value("add_prefix_space", true) ? "always" : "never");
    if (scheme == "always") {
      s.prepend_scheme = PreTokenizerStep::kAlways;
    } else if (scheme == "first") {
      s.prepend_scheme = PreTokenizerStep::kFirst;
    } else if (scheme == "never") {
      s.prepend_scheme = PreTokenizerStep::kNever;
    } else {
      return Unsupported("pre_tokenizer Metaspace prepend_scheme", scheme);
    }
    s.split = p.value("split", true);
    ASSIGN_OR_RETURN(s.regex, Regex::Compile(s.replacement, true));
  } else {
    return Unsupported("pre_tokenizer.type", t);
  }
  c->pre_tokenizer.push_back(std::move(s));
  return absl::OkStatus();
}

absl::Status Decoder(const json& d, BpeConfig* c) {
  if (d.is_null()) return absl::OkStatus();
  std::string t = Type(d);
  DecoderStep s{};
  if (t == "Sequence") {
    for (const json& x : d["decoders"]) RETURN_IF_ERROR(Decoder(x, c));
    return absl::OkStatus();
  } else if (t == "ByteLevel") {
    s.kind = DecoderStep::kByteLevel;
  } else if (t == "Replace") {
    bool is_regex;
    RETURN_IF_ERROR(Pattern(d["pattern"], "decoder Replace", &s.a, &is_regex));
    if (is_regex) return Unsupported("decoder Replace pattern", "Regex");
    s.kind = DecoderStep::kReplace;
    s.b = d["content"].get<std::string>();
  } else if (t == "ByteFallback") {
    s.kind = DecoderStep::kByteFallback;
  } else if (t == "Fuse") {
    s.kind = DecoderStep::kFuse;
  } else if (t == "Strip") {
    s.kind = DecoderStep::kStrip;
    s.a = d["content"].get<std::string>();
    s.start = d.value("start", 0);
    s.stop = d.value("stop", 0);
  } else if (t == "Metaspace") {
    s.kind = DecoderStep::kMetaspace;
    s.a = d.value("replacement", "\xE2\x96\x81");
    std::string scheme = d.value("prepend_scheme", d.value("add_prefix_space", true) ? "always" : "never");
    s.prepend = scheme != "never";
  } else {
    return Unsupported("decoder.type", t);
  }
  c->decoder.push_back(std::move(s));
  return absl::OkStatus();
}

absl::Status PostProcessor(const json& p, BpeConfig* c) {
  if (p.is_null()) return absl::OkStatus();
  std::string t = Type(p);
  if (t == "Sequence") {
    for (const json& x : p["processors"]) RETURN_IF_ERROR(PostProcessor(x, c));
  } else if (t == "ByteLevel") {
    // Offsets only; ids unchanged.
  } else if (t == "TemplateProcessing") {
    bool seen_a = false;
    for (const json& piece : p["single"]) {
      if (piece.contains("Sequence")) {
        seen_a = true;
      } else if (piece.contains("SpecialToken")) {
        std::string name = piece["SpecialToken"]["id"].get<std::string>();
        const json& st = p["special_tokens"];
        if (!st.contains(name)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tokenizer.json: post_processor names special token \"", name, "\" it does not define"));
        }
        for (const json& id : st[name]["ids"])
          (seen_a ? c->suffix_ids : c->prefix_ids).push_back(id.get<TokenId>());
      }
    }
  } else {
    return Unsupported("post_processor.type", t);
  }
  return absl::OkStatus();
}

absl::StatusOr<BpeConfig> ParseConfig(const json& j) {
  BpeConfig c;
  const json& m = j.at("model");
  std::string type = m.value("type", "BPE");
  if (type != "BPE") return Unsupported("model.type", type);
  if (m.contains("continuing_subword_prefix") && !m["continuing_subword_prefix"].is_null() &&
      !m["continuing_subword_prefix"].get<std::string>().empty()) {
    return Unsupported("model.continuing_subword_prefix", m["continuing_subword_prefix"].get<std::string>());
  }
  if (m.contains("end_of_word_suffix") && !m["end_of_word_suffix"].is_null() &&
      !m["end_of_word_suffix"].get<std::string>().empty()) {
    return Unsupported("model.end_of_word_suffix", m["end_of_word_suffix"].get<std::string>());
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0) {
    return Unsupported("model.dropout", "> 0");
  }
  for (const auto& [tok, id] : m.at("vocab").items()) {
    TokenId i = id.get<TokenId>();
    if (i < 0)
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: vocab id ", i, " is negative"));
    if (static_cast<size_t>(i) >= c.id_to_token.size()) c.id_to_token.resize(i + 1);
    c.id_to_token[i] = tok;
  }
  for (const json& mg : m.at("merges")) {
    if (mg.is_string()) {
      std::string s = mg.get<std::string>();
      size_t sp = s.find(' ', 1);
      if (sp == std::string::npos)
        return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: bad merge \"", s, "\""));
      c.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else {
      c.merges.emplace_back(mg.at(0).get<std::string>(), mg.at(1).get<std::string>());
    }
  }
  c.byte_fallback = m.value("byte_fallback", false);
  c.fuse_unk = m.value("fuse_unk", false);
  c.ignore_merges = m.value("ignore_merges", false);
  for (const json& a : j.value("added_tokens", json::array())) {
    c.added.push_back({a.at("id").get<TokenId>(), a.at("content").get<std::string>(),
                       a.value("special", false), a.value("lstrip", false), a.value("rstrip", false),
                       a.value("single_word", false)});
  }
  auto find = [&](const std::string& tok) -> std::optional<TokenId> {
    for (const auto& a : c.added) {
      if (a.content == tok) return a.id;
    }
    for (size_t i = 0; i < c.id_to_token.size(); ++i) {
      if (c.id_to_token[i] == tok) return static_cast<TokenId>(i);
    }
    return std::nullopt;
  };
  if (m.contains("unk_token") && m["unk_token"].is_string())
    c.unk_id = find(m["unk_token"].get<std::string>());
  RETURN_IF_ERROR(Normalizer(j.value("normalizer", json()), &c));
  RETURN_IF_ERROR(PreTokenizer(j.value("pre_tokenizer", json()), &c));
  RETURN_IF_ERROR(Decoder(j.value("decoder", json()), &c));
  RETURN_IF_ERROR(PostProcessor(j.value("post_processor", json()), &c));
  // BOS: what the post-processor puts first; EOS: the usual names (tokenizer_config.json, when
  // next to the file, overrides both).
  if (!c.prefix_ids.empty()) c.bos_id = c.prefix_ids.front();
  for (const char* name : {"</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"}) {
    if (!c.eos_id) c.eos_id = find(name);
  }
  return c;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizerJson(std::string_view text) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError("tokenizer.json: not a JSON object");
  try {
    ASSIGN_OR_RETURN(BpeConfig c, ParseConfig(j));
    return internal::MakeBpe(std::move(c));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  std::string text = ss.str();
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  try {
    absl::StatusOr<BpeConfig> c = ParseConfig(j);
    if (!c.ok()) return c.status();
    // tokenizer_config.json beside it names BOS and EOS.
    std::string dir =
        path.substr(0, path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
    std::ifstream cf(dir + "tokenizer_config.json");
    if (cf) {
      json cj = json::parse(cf, nullptr, false);
      auto name = [&](const char* key) -> std::optional<std::string> {
        if (!cj.is_object() || !cj.contains(key)) return std::nullopt;
        const json& v = cj[key];
        if (v.is_string()) return v.get<std::string>();
        if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
        return std::nullopt;
      };
      auto id_of = [&](const std::string& tok) -> std::optional<TokenId> {
        for (const auto& a : c->added) {
          if (a.content == tok) return a.id;
        }
        return std::nullopt;
      };
      if (auto b = name("bos_token")) c->bos_id = id_of(*b);
      if (auto e = name("eos_token")) c->eos_id = id_of(*e);
    }
    return internal::MakeBpe(*std::move(c));
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
}

}  // namespace tandem::tokenizer
