#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/bpe.h"

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <queue>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status.h"
#include "tokenizer/utf8.h"

namespace tandem::tokenizer::internal {

// ---- regex -------------------------------------------------------------------------------------
absl::StatusOr<std::shared_ptr<Regex>> Regex::Compile(const std::string& pattern, bool literal) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);  // UCP is refused with LITERAL
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options,
                                   &err, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return absl::InvalidArgumentError(
        absl::StrCat("regex \"", pattern, "\" at offset ", offset, ": ", reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort; falls back to the interpreter
  auto r = std::shared_ptr<Regex>(new Regex());
  r->code_ = code;
  return r;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

absl::StatusOr<std::vector<std::pair<size_t, size_t>>> Regex::FindAll(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  auto* code = static_cast<pcre2_code*>(code_);
  std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> holder(
      pcre2_match_data_create_from_pattern(code, nullptr), pcre2_match_data_free);
  pcre2_match_data* md = holder.get();
  size_t pos = 0;
  while (pos <= text.size()) {
    int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                         PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // the JIT's small stack: the interpreter uses the heap
      rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), pos,
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof(msg));
      return absl::ResourceExhaustedError(
          absl::StrCat("pre-tokenizer regex at byte ", pos, ": ", reinterpret_cast<const char*>(msg)));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: skip one character
      if (b >= text.size()) break;
      pos = b + Utf8CharLen(static_cast<unsigned char>(text[b]));
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
  return out;
}

const std::array<std::string, 256>& ByteToUnicode() {
  static const std::array<std::string, 256> table = [] {
    std::array<std::string, 256> t;
    auto encode = [](uint32_t cp) {
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      return s;
    };
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = encode(printable ? b : 256 + n++);
    }
    return t;
  }();
  return table;
}

absl::StatusOr<std::string> UnicodeNormalize(std::string_view text, std::string_view form) {
  int options = UTF8PROC_STABLE;
  if (form == "NFC") {
    options |= UTF8PROC_COMPOSE;
  } else if (form == "NFD") {
    options |= UTF8PROC_DECOMPOSE;
  } else if (form == "NFKC") {
    options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  } else if (form == "NFKD") {
    options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown normalization form ", ToAbsl(form)));
  }
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                   static_cast<utf8proc_ssize_t>(text.size()), &out, static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    return absl::InvalidArgumentError(absl::StrCat(ToAbsl(form), ": ", utf8proc_errmsg(n)));
  }
  std::string result(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

namespace {

struct Piece {
  std::string text;
  bool at_start;  // begins at offset 0 of the original text (Metaspace prepend_scheme "first")
};

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  return absl::StrReplaceAll(ToAbsl(s), {{ToAbsl(from), ToAbsl(to)}});
}

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(BpeConfig c) : c_(std::move(c)) {
    bos_id_ = c_.bos_id;
    eos_id_ = c_.eos_id;
    for (size_t i = 0; i < c_.id_to_token.size(); ++i) {
      if (!c_.id_to_token[i].empty()) vocab_.emplace(c_.id_to_token[i], static_cast<TokenId>(i));
    }
    // An added token whose text the model's vocabulary has takes the model's id (as HF does).
    for (AddedToken& a : c_.added) {
      if (auto it = vocab_.find(a.content); it != vocab_.end()) a.id = it->second;
    }
    vocab_size_ = static_cast<int32_t>(c_.id_to_token.size());
    for (const AddedToken& a : c_.added) vocab_size_ = std::max(vocab_size_, a.id + 1);
    added_by_id_.resize(vocab_size_, -1);
    for (size_t i = 0; i < c_.added.size(); ++i) {
      added_by_id_[c_.added[i].id] = static_cast<int>(i);
      added_vocab_[c_.added[i].content] = c_.added[i].id;
      if (!c_.added[i].content.empty()) {
        added_by_first_[static_cast<unsigned char>(c_.added[i].content[0])].push_back(static_cast<int>(i));
      }
    }
    for (size_t r = 0; r < c_.merges.size(); ++r) {
      auto l = vocab_.find(c_.merges[r].first), rr = vocab_.find(c_.merges[r].second);
      auto m = vocab_.find(c_.merges[r].first + c_.merges[r].second);
      if (l == vocab_.end() || rr == vocab_.end() || m == vocab_.end()) continue;
      uint64_t key = (static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(rr->second);
      merges_.emplace(key, std::make_pair(static_cast<int32_t>(r), m->second));
    }
    byte_ids_.fill(-1);
    if (c_.byte_fallback) {
      for (int b = 0; b < 256; ++b) {
        // HF spells them in upper case: <0x0A>.
        std::string name =
            absl::StrCat("<0x", absl::AsciiStrToUpper(absl::StrCat(absl::Hex(b, absl::kZeroPad2))), ">");
        auto it = vocab_.find(name);
        if (it != vocab_.end()) byte_ids_[b] = it->second;
      }
    }
    for (const DecoderStep& d : c_.decoder) {
      if (d.kind == DecoderStep::kByteLevel) {
        const auto& t = ByteToUnicode();
        for (int b = 0; b < 256; ++b) char_to_byte_[t[b]] = static_cast<char>(b);
      }
    }
  }

  absl::StatusOr<std::vector<TokenId>> Encode(std::string_view text, bool add_special) const override {
    RETURN_IF_ERROR(ValidateUtf8(text));
    std::vector<TokenId> ids;
    if (add_special) ids = c_.prefix_ids;
    // Added tokens first (leftmost, longest), the text between them through the pipeline.
    size_t seg_begin = 0, i = 0;
    while (i < text.size()) {
      size_t mb, me;
      const AddedToken* tok = MatchAdded(text, i, seg_begin, &mb, &me);
      if (tok == nullptr) {
        ++i;
        continue;
      }
      if (mb > seg_begin) {
        RETURN_IF_ERROR(EncodeSegment(text.substr(seg_begin, mb - seg_begin), seg_begin == 0, &ids));
      }
      ids.push_back(tok->id);
      seg_begin = i = me;
    }
    if (seg_begin < text.size()) RETURN_IF_ERROR(EncodeSegment(text.substr(seg_begin), seg_begin == 0, &ids));
    if (add_special) ids.insert(ids.end(), c_.suffix_ids.begin(), c_.suffix_ids.end());
    return ids;
  }

  absl::StatusOr<std::string> Decode(std::span<const TokenId> ids, bool skip_special) const override {
    return DecodeImpl(ids, skip_special, /*raw=*/false);
  }
  absl::StatusOr<std::string> DecodeBytes(std::span<const TokenId> ids, bool skip_special) const override {
    return DecodeImpl(ids, skip_special, /*raw=*/true);
  }

  int32_t vocab_size() const override { return vocab_size_; }
  std::optional<TokenId> TokenToId(std::string_view token) const override {
    std::string t(token);
    if (auto it = added_vocab_.find(t); it != added_vocab_.end()) return it->second;
    if (auto it = vocab_.find(t); it != vocab_.end()) return it->second;
    return std::nullopt;
  }
  std::optional<std::string> IdToToken(TokenId id) const override {
    if (id < 0 || id >= vocab_size_) return std::nullopt;
    if (added_by_id_[id] >= 0) return c_.added[added_by_id_[id]].content;
    if (id < static_cast<TokenId>(c_.id_to_token.size()) && !c_.id_to_token[id].empty())
      return c_.id_to_token[id];
    return std::nullopt;
  }
  bool IsSpecial(TokenId id) const override {
    return id >= 0 && id < vocab_size_ && added_by_id_[id] >= 0 && c_.added[added_by_id_[id]].special;
  }

 private:
  static bool IsSpace(char ch) {
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v';
  }
  static bool IsWordByte(char ch) {
    unsigned char u = static_cast<unsigned char>(ch);
    return u >= 0x80 || std::isalnum(u) || ch == '_';
  }

  // The added token matching at `i` (longest), with its span widened by lstrip/rstrip.
  const AddedToken* MatchAdded(std::string_view text, size_t i, size_t seg_begin, size_t* mb,
                               size_t* me) const {
    const AddedToken* best = nullptr;
    for (int k : added_by_first_[static_cast<unsigned char>(text[i])]) {
      const AddedToken& a = c_.added[k];
      if (text.compare(i, a.content.size(), a.content) != 0) continue;
      if (best != nullptr && best->content.size() >= a.content.size()) continue;
      size_t end = i + a.content.size();
      if (a.single_word &&
          ((i > 0 && IsWordByte(text[i - 1])) || (end < text.size() && IsWordByte(text[end])))) {
        continue;
      }
      best = &a;
    }
    if (best == nullptr) return nullptr;
    *mb = i;
    *me = i + best->content.size();
    if (best->lstrip) {
      while (*mb > seg_begin && IsSpace(text[*mb - 1])) --*mb;
    }
    if (best->rstrip) {
      while (*me < text.size() && IsSpace(text[*me])) ++*me;
    }
    return best;
  }

  absl::Status EncodeSegment(std::string_view segment, bool at_start, std::vector<TokenId>* ids) const {
    std::string s(segment);
    for (const NormalizerStep& n : c_.normalizer) {
      if (n.kind == NormalizerStep::kPrepend) {
        if (!s.empty()) s = n.a + s;
      } else if (n.kind == NormalizerStep::kReplace) {
        s = ReplaceAll(s, n.a, n.b);
      } else {
        ASSIGN_OR_RETURN(s, UnicodeNormalize(s, n.a));
      }
    }
    if (s.empty()) return absl::OkStatus();
    std::vector<Piece> pieces{{std::move(s), at_start}};
    for (const PreTokenizerStep& p : c_.pre_tokenizer) {
      ASSIGN_OR_RETURN(pieces, PreTokenize(p, std::move(pieces)));
    }
    for (const Piece& p : pieces) Model(p.text, ids);
    return absl::OkStatus();
  }

  static absl::StatusOr<std::vector<Piece>> SplitPieces(const Regex& re, PreTokenizerStep::Behavior behavior,
                                                        std::vector<Piece> in) {
    std::vector<Piece> out;
    for (Piece& p : in) {
      std::string_view t = p.text;
      ASSIGN_OR_RETURN(auto matches, re.FindAll(t));
      size_t prev = 0;
      std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;  // span, is_match
      for (auto [b, e] : matches) {
        if (b > prev) parts.push_back({{prev, b}, false});
        parts.push_back({{b, e}, true});
        prev = e;
      }
      if (prev < t.size()) parts.push_back({{prev, t.size()}, false});
      std::vector<std::pair<size_t, size_t>> spans;
      switch (behavior) {
        case PreTokenizerStep::kIsolated:
          for (auto& [sp, m] : parts) spans.push_back(sp);
          break;
        case PreTokenizerStep::kRemoved:
          for (auto& [sp, m] : parts) {
            if (!m) spans.push_back(sp);
          }
          break;
        // As HF: a delimiter joins its neighbour unless that neighbour is a delimiter too.
        case PreTokenizerStep::kMergedWithPrevious: {
          bool prev_match = false;
          for (auto& [sp, m] : parts) {
            if (m && !prev_match && !spans.empty()) {
              spans.back().second = sp.second;
            } else {
              spans.push_back(sp);
            }
            prev_match = m;
          }
          break;
        }
        case PreTokenizerStep::kMergedWithNext: {
          bool next_match = false;
          for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
            if (it->second && !next_match && !spans.empty()) {
              spans.back().first = it->first.first;
            } else {
              spans.push_back(it->first);
            }
            next_match = it->second;
          }
          std::reverse(spans.begin(), spans.end());
          break;
        }
      }
      for (auto [b, e] : spans) out.push_back({std::string(t.substr(b, e - b)), p.at_start && b == 0});
    }
    return out;
  }

  absl::StatusOr<std::vector<Piece>> PreTokenize(const PreTokenizerStep& p, std::vector<Piece> in) const {
    switch (p.kind) {
      case PreTokenizerStep::kSplit:
        return SplitPieces(*p.regex, p.behavior, std::move(in));
      case PreTokenizerStep::kByteLevel: {
        if (p.add_prefix_space) {
          for (Piece& x : in) {
            if (!x.text.empty() && x.text[0] != ' ') x.text = " " + x.text;
          }
        }
        if (p.use_regex) {
          ASSIGN_OR_RETURN(in, SplitPieces(*p.regex, PreTokenizerStep::kIsolated, std::move(in)));
        }
        const auto& table = ByteToUnicode();
        for (Piece& x : in) {
          std::string m;
          for (unsigned char ch : x.text) m += table[ch];
          x.text = std::move(m);
        }
        return in;
      }
      case PreTokenizerStep::kMetaspace: {
        for (Piece& x : in) {
          x.text = ReplaceAll(x.text, " ", p.replacement);
          bool prepend = p.prepend_scheme == PreTokenizerStep::kAlways ||
                         (p.prepend_scheme == PreTokenizerStep::kFirst && x.at_start);
          if (prepend && x.text.compare(0, p.replacement.size(), p.replacement) != 0)
            x.text = p.replacement + x.text;
        }
        if (p.split) {
          ASSIGN_OR_RETURN(in, SplitPieces(*p.regex, PreTokenizerStep::kMergedWithNext, std::move(in)));
        }
        return in;
      }
    }
    return in;
  }

  void Model(const std::string& word, std::vector<TokenId>* ids) const {
    if (word.empty()) return;
    if (c_.ignore_merges) {
      if (auto it = vocab_.find(word); it != vocab_.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    std::vector<TokenId> sym;
    bool prev_unk = false;
    for (size_t i = 0; i < word.size();) {
      size_t n = Utf8CharLen(static_cast<unsigned char>(word[i]));
      std::string ch = word.substr(i, n);
      i += n;
      if (auto it = vocab_.find(ch); it != vocab_.end()) {
        sym.push_back(it->second);
        prev_unk = false;
        continue;
      }
      if (c_.byte_fallback) {
        bool all = true;
        for (unsigned char b : ch) all = all && byte_ids_[b] >= 0;
        if (all) {
          for (unsigned char b : ch) sym.push_back(byte_ids_[b]);
          prev_unk = false;
          continue;
        }
      }
      if (c_.unk_id) {
        if (!(c_.fuse_unk && prev_unk)) sym.push_back(*c_.unk_id);
        prev_unk = true;
      }
    }
    // Merge the lowest-ranked adjacent pair first (leftmost on ties), as HF's BPE does.
    const size_t n = sym.size();
    std::vector<int> next(n), prev(n);
    std::vector<bool> alive(n, true);
    for (size_t i = 0; i < n; ++i) {
      next[i] = i + 1 < n ? static_cast<int>(i + 1) : -1;
      prev[i] = static_cast<int>(i) - 1;
    }
    struct Cand {
      int32_t rank;
      int pos;
      TokenId left, right, merged;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](int a) {
      if (a < 0 || next[a] < 0) return;
      uint64_t key = (static_cast<uint64_t>(sym[a]) << 32) | static_cast<uint32_t>(sym[next[a]]);
      if (auto it = merges_.find(key); it != merges_.end()) {
        heap.push({it->second.first, a, sym[a], sym[next[a]], it->second.second});
      }
    };
    for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int>(i));
    while (!heap.empty()) {
      Cand c = heap.top();
      heap.pop();
      if (!alive[c.pos] || sym[c.pos] != c.left || next[c.pos] < 0 || sym[next[c.pos]] != c.right) continue;
      int r = next[c.pos];
      sym[c.pos] = c.merged;
      alive[r] = false;
      next[c.pos] = next[r];
      if (next[r] >= 0) prev[next[r]] = c.pos;
      push(prev[c.pos]);
      push(c.pos);
    }
    for (size_t i = 0; i < n; ++i) {
      if (alive[i]) ids->push_back(sym[i]);
    }
  }

  absl::StatusOr<std::string> DecodeImpl(std::span<const TokenId> ids, bool skip_special, bool raw) const {
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (TokenId id : ids) {
      std::optional<std::string> t = IdToToken(id);
      if (!t)
        return absl::InvalidArgumentError(
            absl::StrCat("token id ", id, " is not in the vocabulary (size ", vocab_size_, ")"));
      if (skip_special && IsSpecial(id)) continue;
      toks.push_back(std::move(*t));
    }
    for (const DecoderStep& d : c_.decoder) toks = DecodeStep(d, std::move(toks), raw);
    std::string out;
    for (const std::string& t : toks) out += t;
    return raw ? out : Utf8Lossy(out);
  }

  std::vector<std::string> DecodeStep(const DecoderStep& d, std::vector<std::string> toks, bool raw) const {
    switch (d.kind) {
      case DecoderStep::kByteLevel: {
        std::string bytes;
        for (const std::string& t : toks) {
          std::string b;
          bool all = true;
          for (size_t i = 0; i < t.size() && all;) {
            size_t n = Utf8CharLen(static_cast<unsigned char>(t[i]));
            auto it = char_to_byte_.find(t.substr(i, n));
            if (it == char_to_byte_.end()) {
              all = false;
            } else {
              b += it->second;
            }
            i += n;
          }
          bytes += all ? b : t;
        }
        return {bytes};
      }
      case DecoderStep::kReplace:
        for (std::string& t : toks) t = ReplaceAll(t, d.a, d.b);
        return toks;
      case DecoderStep::kByteFallback: {
        std::vector<std::string> out;
        std::string run;
        size_t run_len = 0;
        auto flush = [&] {
          if (run_len == 0) return;
          if (raw || ValidateUtf8(run).ok()) {
            out.push_back(run);
          } else {
            std::string rep;
            for (size_t i = 0; i < run_len; ++i) rep += "\xEF\xBF\xBD";
            out.push_back(rep);
          }
          run.clear();
          run_len = 0;
        };
        for (std::string& t : toks) {
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            run += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
            ++run_len;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        return out;
      }
      case DecoderStep::kFuse: {
        std::string all;
        for (const std::string& t : toks) all += t;
        return {all};
      }
      case DecoderStep::kStrip:
        for (std::string& t : toks) {
          for (int k = 0; k < d.start && t.compare(0, d.a.size(), d.a) == 0; ++k) t.erase(0, d.a.size());
          for (int k = 0;
               k < d.stop && t.size() >= d.a.size() && t.compare(t.size() - d.a.size(), d.a.size(), d.a) == 0;
               ++k) {
            t.erase(t.size() - d.a.size());
          }
        }
        return toks;
      case DecoderStep::kMetaspace:
        for (size_t i = 0; i < toks.size(); ++i) {
          toks[i] = ReplaceAll(toks[i], d.a, " ");
          if (i == 0 && d.prepend && !toks[i].empty() && toks[i][0] == ' ') toks[i].erase(0, 1);
        }
        return toks;
    }
    return toks;
  }

  BpeConfig c_;
  int32_t vocab_size_ = 0;
  std::unordered_map<std::string, TokenId> vocab_, added_vocab_;
  std::vector<int> added_by_id_;                                      // id -> index in c_.added, or -1
  std::array<std::vector<int>, 256> added_by_first_;                  // first byte -> indices in c_.added
  std::unordered_map<uint64_t, std::pair<int32_t, TokenId>> merges_;  // (left, right) -> (rank, merged)
  std::array<TokenId, 256> byte_ids_;
  std::unordered_map<std::string, char> char_to_byte_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> MakeBpe(BpeConfig config) {
  for (const AddedToken& a : config.added) {
    if (a.id < 0)
      return absl::InvalidArgumentError(absl::StrCat("added token \"", a.content, "\" has id ", a.id));
  }
  return std::unique_ptr<Tokenizer>(new BpeTokenizer(std::move(config)));
}

}  // namespace tandem::tokenizer::internal
