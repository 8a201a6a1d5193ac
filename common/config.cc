#include "common/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <set>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "yaml-cpp/yaml.h"

namespace tandem {
namespace {

bool IsUtf8Bom(std::string_view text) { return text.substr(0, 3) == "\xEF\xBB\xBF"; }

// yaml-cpp 0.7 loops forever on a ',' token at the top of a document, outside every collection
// (",a", "'a' ,b", "!t ,a", "[1] ,b"): such text is refused before yaml-cpp sees it. The scan
// follows each document's first node up to where block content begins: node properties (tags,
// anchors, aliases), quoted scalars and flow collections, skipping blanks, comments, directives
// and document markers.
absl::Status CheckYamlTopLevelComma(std::string_view text, std::string_view source) {
  // A NUL byte makes yaml-cpp read the text as UTF-16 or UTF-32 (which a config never is); a
  // UTF-8 byte order mark is skipped like a blank.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(ToAbsl(source), ": a NUL byte at byte offset ", nul, " (YAML text must be UTF-8)"));
  }
  size_t p = 0;
  const size_t n = text.size();
  auto skip_blank = [&] {
    while (p < n) {
      const char c = text[p];
      if (c == ' ' || c == '\t' || c == '\r' || c == '\n' || (p < 3 && IsUtf8Bom(text))) {
        ++p;
      } else if (c == '#' || (c == '%' && (p == 0 || text[p - 1] == '\n'))) {
        while (p < n && text[p] != '\n') ++p;
      } else if (text.substr(p, 3) == "---" && (p == 0 || text[p - 1] == '\n')) {
        p += 3;
      } else {
        return;
      }
    }
  };
  auto skip_quoted = [&](char q) {
    for (++p; p < n; ++p) {
      if (q == '"' && text[p] == '\\') {
        ++p;
      } else if (text[p] == q) {
        if (q == '\'' && p + 1 < n && text[p + 1] == '\'') {
          ++p;
        } else {
          ++p;
          return;
        }
      }
    }
  };
  auto skip_flow = [&] {
    int depth = 0;
    while (p < n) {
      const char c = text[p];
      if (c == '\'' || c == '"') {
        skip_quoted(c);
        continue;
      }
      if (c == '[' || c == '{') ++depth;
      if (c == ']' || c == '}') --depth;
      ++p;
      if (depth <= 0) return;
    }
  };
  // A line that starts with ',' outside brackets: after a top-level plain scalar yaml-cpp reads it
  // as the same token (and a continuation line of a plain scalar that starts with ',' has no
  // use in a config).
  int depth = 0;
  char last = '\n';  // the line's last non-blank character so far ('\n' at its start)
  for (p = 0; p < n; ++p) {
    const char c = text[p];
    if (c == '\n') {
      last = '\n';
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r' || (p < 3 && IsUtf8Bom(text))) continue;
    const char before = p == 0 ? '\n' : text[p - 1];
    if (c == ',' && last == '\n' && depth == 0) {
      return absl::InvalidArgumentError(absl::StrCat(ToAbsl(source), ": YAML syntax error at byte offset ", p,
                                                     ": a line starts with ',' outside brackets"));
    }
    // A bracket opens a flow collection only where a node starts (not inside a plain scalar).
    const bool node_start = depth > 0 || absl::StrContains("\n:-?,[{", absl::string_view(&last, 1));
    last = c;
    if (c == '#' && (before == ' ' || before == '\t' || before == '\n')) {
      while (p + 1 < n && text[p + 1] != '\n') ++p;
    } else if ((c == '\'' || c == '"') && node_start) {
      skip_quoted(c);
      --p;
    } else if ((c == '[' || c == '{') && node_start) {
      ++depth;
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  // Each document: its start, then the start after every line that begins with "---".
  size_t doc = 0;
  while (doc <= n) {
    p = doc;
    while (true) {
      skip_blank();
      if (p >= n) break;
      const char c = text[p];
      if (c == ',') {
        return absl::InvalidArgumentError(absl::StrCat(ToAbsl(source), ": YAML syntax error at byte offset ",
                                                       p, ": ',' outside brackets at the top level"));
      }
      if (c == '!' || c == '&' || c == '*') {
        while (p < n && text[p] != ' ' && text[p] != '\t' && text[p] != '\n' && text[p] != ',') ++p;
      } else if (c == '\'' || c == '"') {
        skip_quoted(c);
      } else if (c == '[' || c == '{') {
        skip_flow();
      } else {
        break;  // block content: yaml-cpp opens a collection or reads a plain scalar
      }
    }
    const size_t next = text.find("\n---", doc);
    if (next == std::string_view::npos) break;
    doc = next + 4;
  }
  return absl::OkStatus();
}

constexpr char kDefaultSource[] = "default";
constexpr char kSetSource[] = "--set";
constexpr char kUnnamedYaml[] = "<yaml>";

// A knob's value once parsed; which field is used depends on the knob's type.
struct Parsed {
  int64_t i = 0;
  double d = 0;
  bool b = false;
  std::string s;
};

const char* TypeName(KnobType type) {
  switch (type) {
    case KnobType::kInt:
      return "int";
    case KnobType::kDouble:
      return "double";
    case KnobType::kBool:
      return "bool";
    case KnobType::kString:
      return "string";
    case KnobType::kEnum:
      return "enum";
    case KnobType::kList:
      return "list";
  }
  return "?";
}

// Shortest text that parses back to exactly `v`.
std::string FormatDouble(double v) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, result.ptr);
}

bool IsNullWord(std::string_view s) { return s == "~" || s == "null" || s == "Null" || s == "NULL"; }

// `s` as a YAML scalar: plain where that reads back as the same string, else double-quoted.
std::string YamlScalar(std::string_view s, bool force_quotes = false) {
  auto plain_char = [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '/' ||
           c == '+' || c == '-';
  };
  const bool plain = !force_quotes && !s.empty() && !IsNullWord(s) && s.front() != '-' && s.front() != '+' &&
                     std::all_of(s.begin(), s.end(), plain_char);
  if (plain) return std::string(s);
  std::string out = "\"";
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (u < 0x20 || u == 0x7f) {
          out += absl::StrFormat("\\x%02x", u);
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string Quoted(std::string_view s) { return YamlScalar(s, /*force_quotes=*/true); }

std::string FormatBound(const KnobSpec& spec, double bound) {
  if (spec.type == KnobType::kInt && std::trunc(bound) == bound && std::fabs(bound) < 9.2e18) {
    return absl::StrCat(static_cast<int64_t>(bound));
  }
  return FormatDouble(bound);
}

// "in [1, 65536]", ">= 0", "<= 8" or "".
std::string RangeText(const KnobSpec& spec) {
  if (spec.min && spec.max) {
    return absl::StrCat("in [", FormatBound(spec, *spec.min), ", ", FormatBound(spec, *spec.max), "]");
  }
  if (spec.min) return absl::StrCat(">= ", FormatBound(spec, *spec.min));
  if (spec.max) return absl::StrCat("<= ", FormatBound(spec, *spec.max));
  return "";
}

// What a value must look like, as in "expected <Expectation>".
std::string Expectation(const KnobSpec& spec) {
  const std::string range = RangeText(spec);
  const std::string range_suffix = range.empty() ? "" : absl::StrCat(" ", range);
  switch (spec.type) {
    case KnobType::kInt:
      return absl::StrCat("an integer", range_suffix);
    case KnobType::kDouble:
      return absl::StrCat("a number", range_suffix);
    case KnobType::kBool:
      return "true or false";
    case KnobType::kString:
      return "a string";
    case KnobType::kEnum:
      return absl::StrCat("one of [", absl::StrJoin(spec.choices, ", "), "]");
    case KnobType::kList:
      return "a list";
  }
  return "";
}

// The type column of the help table: "int in [1, 65536]", "enum [fp16, bf16]", ...
std::string TypeText(const KnobSpec& spec) {
  const std::string range = RangeText(spec);
  if (spec.type == KnobType::kEnum) {
    return absl::StrCat("enum [", absl::StrJoin(spec.choices, ", "), "]");
  }
  return range.empty() ? std::string(TypeName(spec.type)) : absl::StrCat(TypeName(spec.type), " ", range);
}

bool InBounds(const KnobSpec& spec, double v) {
  return (!spec.min || v >= *spec.min) && (!spec.max || v <= *spec.max);
}

// Decimal integer with an optional sign (YAML 1.2 core schema, without 0x/0o forms).
bool IsDecimalInt(std::string_view s) {
  if (!s.empty() && (s.front() == '+' || s.front() == '-')) s.remove_prefix(1);
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// YAML 1.2 core float without .inf/.nan: [-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?
bool ParseFiniteDouble(std::string_view s, double* out) {
  std::string_view body = s;
  if (!body.empty() && (body.front() == '+' || body.front() == '-')) body.remove_prefix(1);
  size_t pos = 0;
  auto digits = [&] {
    const size_t start = pos;
    while (pos < body.size() && body[pos] >= '0' && body[pos] <= '9') ++pos;
    return pos - start;
  };
  const size_t int_digits = digits();
  size_t frac_digits = 0;
  if (pos < body.size() && body[pos] == '.') {
    ++pos;
    frac_digits = digits();
  }
  if (int_digits + frac_digits == 0) return false;
  if (pos < body.size() && (body[pos] == 'e' || body[pos] == 'E')) {
    ++pos;
    if (pos < body.size() && (body[pos] == '+' || body[pos] == '-')) ++pos;
    if (digits() == 0) return false;
  }
  if (pos != body.size()) return false;
  // from_chars takes no '+'; the sign of a '-' is part of its grammar.
  std::string_view number = s.front() == '+' ? s.substr(1) : s;
  const auto result = std::from_chars(number.data(), number.data() + number.size(), *out);
  return result.ec == std::errc() && result.ptr == number.data() + number.size() && std::isfinite(*out);
}

// Parses the text of a YAML scalar for `spec`. `quoted` says the scalar was written in quotes
// (or tagged !!str): it is then a string, so numbers and booleans must be written plain. The error
// message is "expected ..., got ..." without the path or source (callers add those).
absl::StatusOr<Parsed> ParseScalar(const KnobSpec& spec, std::string_view text, bool quoted) {
  auto fail = [&] {
    return absl::InvalidArgumentError(absl::StrCat("expected ", Expectation(spec), ", got ",
                                                   quoted ? "the quoted string " : "", Quoted(text)));
  };
  Parsed p;
  switch (spec.type) {
    case KnobType::kInt:
      if (quoted || !IsDecimalInt(text) || !absl::SimpleAtoi(ToAbsl(text), &p.i) ||
          !InBounds(spec, static_cast<double>(p.i))) {
        return fail();
      }
      break;
    case KnobType::kDouble:
      if (quoted || !ParseFiniteDouble(text, &p.d) || !InBounds(spec, p.d)) return fail();
      break;
    case KnobType::kBool:
      // Strict: YAML 1.1's yes/no/on/off (which yaml-cpp's as<bool> takes) are refused.
      if (quoted || (text != "true" && text != "false")) return fail();
      p.b = text == "true";
      break;
    case KnobType::kString:
    case KnobType::kList:  // only its default ("[]") is parsed here
      p.s = std::string(text);
      break;
    case KnobType::kEnum:
      if (std::find(spec.choices.begin(), spec.choices.end(), text) == spec.choices.end()) {
        return fail();
      }
      p.s = std::string(text);
      break;
  }
  return p;
}

// The default of a validated spec (ConfigSchema::Add checked that it parses).
Parsed DefaultOf(const KnobSpec& spec) {
  if (spec.type == KnobType::kString || spec.type == KnobType::kList) {
    Parsed p;
    p.s = spec.default_value;
    return p;
  }
  absl::StatusOr<Parsed> p = ParseScalar(spec, spec.default_value, /*quoted=*/false);
  TANDEM_CHECK_MSG(p.ok(), "config knob '", spec.path, "': ", p.status().message());
  return *std::move(p);
}

// A value as YAML text. `V` is Config::Value (a private type; deduced, so not named here).
template <typename V>
std::string ValueText(const V& v) {
  switch (v.type) {
    case KnobType::kInt:
      return absl::StrCat(v.i);
    case KnobType::kDouble: {
      std::string s = FormatDouble(v.d);
      if (s.find_first_of(".e") == std::string::npos) s += ".0";
      return s;
    }
    case KnobType::kBool:
      return v.b ? "true" : "false";
    case KnobType::kString:
    case KnobType::kEnum:
      return YamlScalar(v.s);
    case KnobType::kList:
      return v.s;
  }
  return "";
}

std::string Describe(const YAML::Node& node) {
  if (node.IsMap()) return "a mapping";
  if (node.IsSequence()) return "a sequence";
  if (node.IsScalar()) return Quoted(node.Scalar());
  return "no value";
}

// "a.b.c" is a section of "a.b.c.d" (segment-wise prefix).
bool IsSectionOf(std::string_view section, std::string_view path) {
  return path.size() > section.size() && path.substr(0, section.size()) == section &&
         path[section.size()] == '.';
}

bool IsValidPath(std::string_view path) {
  if (path.empty()) return false;
  for (absl::string_view segment : absl::StrSplit(ToAbsl(path), '.')) {
    if (segment.empty() || segment.front() == '-') return false;
    for (const char c : segment) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
    }
  }
  return true;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string_view LastSegment(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

absl::Status ReadFile(const std::string& path, std::string* out) {
  auto unreadable = [&](int err) {
    return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "': ", std::strerror(err)));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return unreadable(errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || S_ISDIR(st.st_mode)) {
    const int err = S_ISDIR(st.st_mode) ? EISDIR : errno;
    ::close(fd);
    return unreadable(err);
  }
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      return unreadable(err);
    }
    out->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return absl::OkStatus();
}

}  // namespace

// ---- ConfigSchema ------------------------------------------------------------------------------

namespace {
// KnobSpec with the common fields set (designated initializers would warn about the rest).
KnobSpec MakeSpec(std::string path, KnobType type, std::string default_value, std::string help) {
  KnobSpec spec;
  spec.path = std::move(path);
  spec.type = type;
  spec.default_value = std::move(default_value);
  spec.help = std::move(help);
  return spec;
}
}  // namespace

ConfigSchema& ConfigSchema::Int(std::string path, int64_t def, std::string help, std::optional<double> min,
                                std::optional<double> max) {
  KnobSpec spec = MakeSpec(std::move(path), KnobType::kInt, absl::StrCat(def), std::move(help));
  spec.min = min;
  spec.max = max;
  return Add(std::move(spec));
}

ConfigSchema& ConfigSchema::Double(std::string path, double def, std::string help, std::optional<double> min,
                                   std::optional<double> max) {
  KnobSpec spec = MakeSpec(std::move(path), KnobType::kDouble, FormatDouble(def), std::move(help));
  spec.min = min;
  spec.max = max;
  return Add(std::move(spec));
}

ConfigSchema& ConfigSchema::Bool(std::string path, bool def, std::string help) {
  return Add(MakeSpec(std::move(path), KnobType::kBool, def ? "true" : "false", std::move(help)));
}

ConfigSchema& ConfigSchema::String(std::string path, std::string def, std::string help) {
  return Add(MakeSpec(std::move(path), KnobType::kString, std::move(def), std::move(help)));
}

ConfigSchema& ConfigSchema::Enum(std::string path, std::string def, std::vector<std::string> choices,
                                 std::string help) {
  KnobSpec spec = MakeSpec(std::move(path), KnobType::kEnum, std::move(def), std::move(help));
  spec.choices = std::move(choices);
  return Add(std::move(spec));
}

ConfigSchema& ConfigSchema::List(std::string path, std::string help) {
  return Add(MakeSpec(std::move(path), KnobType::kList, "[]", std::move(help)));
}

ConfigSchema& ConfigSchema::Add(KnobSpec spec) {
  const std::string& path = spec.path;
  TANDEM_CHECK_MSG(IsValidPath(path), "config knob path '", path,
                   "' must be '.'-separated names of letters, digits, '_' and '-'");
  for (const KnobSpec& other : knobs_) {
    TANDEM_CHECK_MSG(other.path != path, "config knob '", path, "' is registered twice");
    TANDEM_CHECK_MSG(!IsSectionOf(other.path, path) && !IsSectionOf(path, other.path), "config knob '", path,
                     "' and '", other.path, "': a path is either a section or a knob, not both");
  }
  const bool numeric = spec.type == KnobType::kInt || spec.type == KnobType::kDouble;
  TANDEM_CHECK_MSG(numeric || (!spec.min && !spec.max), "config knob '", path,
                   "': only int and double knobs have bounds");
  TANDEM_CHECK_MSG(!(spec.min && std::isnan(*spec.min)) && !(spec.max && std::isnan(*spec.max)),
                   "config knob '", path, "': a bound is NaN");
  TANDEM_CHECK_MSG(!spec.min || !spec.max || *spec.min <= *spec.max, "config knob '", path, "': min > max");
  if (spec.type == KnobType::kEnum) {
    TANDEM_CHECK_MSG(!spec.choices.empty(), "config knob '", path, "': an enum needs choices");
    std::set<std::string_view> seen;
    for (const std::string& choice : spec.choices) {
      TANDEM_CHECK_MSG(!choice.empty() && seen.insert(choice).second, "config knob '", path,
                       "': enum choices must be non-empty and distinct");
    }
  } else {
    TANDEM_CHECK_MSG(spec.choices.empty(), "config knob '", path, "': only enums have choices");
  }
  if (spec.type != KnobType::kString && spec.type != KnobType::kList) {
    const absl::StatusOr<Parsed> def = ParseScalar(spec, spec.default_value, /*quoted=*/false);
    TANDEM_CHECK_MSG(def.ok(), "config knob '", path, "': invalid default: ", def.status().message());
  }
  knobs_.push_back(std::move(spec));
  return *this;
}

const KnobSpec* ConfigSchema::Find(std::string_view path) const {
  for (const KnobSpec& knob : knobs_) {
    if (knob.path == path) return &knob;
  }
  return nullptr;
}

std::string ConfigSchema::HelpText() const {
  std::vector<std::vector<std::string>> rows = {{"KEY", "TYPE", "DEFAULT", "DESCRIPTION"}};
  for (const KnobSpec& knob : knobs_) {
    const std::string def = knob.type == KnobType::kString || knob.type == KnobType::kEnum
                                ? YamlScalar(knob.default_value)
                                : knob.default_value;
    rows.push_back({knob.path, TypeText(knob), def, knob.help});
  }
  size_t width[3] = {0, 0, 0};
  for (const auto& row : rows) {
    for (size_t c = 0; c < 3; ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < 3; ++c) {
      absl::StrAppend(&line, row[c], std::string(width[c] - row[c].size() + 2, ' '));
    }
    absl::StrAppend(&line, row[3]);
    absl::StrAppend(&out, absl::StripTrailingAsciiWhitespace(line), "\n");
  }
  return out;
}

// ---- Config ------------------------------------------------------------------------------------

const Config::Value& Config::At(std::string_view path, KnobType t) const {
  const auto it = values_.find(path);
  TANDEM_CHECK_MSG(it != values_.end(), "no config knob '", ToAbsl(path), "'");
  const KnobType actual = it->second.type;
  TANDEM_CHECK_MSG(actual == t || (t == KnobType::kString && actual == KnobType::kEnum), "config knob '",
                   ToAbsl(path), "' is ", TypeName(actual), ", read as ", TypeName(t));
  return it->second;
}

int64_t Config::GetInt(std::string_view path) const { return At(path, KnobType::kInt).i; }
double Config::GetDouble(std::string_view path) const { return At(path, KnobType::kDouble).d; }
bool Config::GetBool(std::string_view path) const { return At(path, KnobType::kBool).b; }
const std::string& Config::GetString(std::string_view path) const { return At(path, KnobType::kString).s; }
const std::string& Config::GetList(std::string_view path) const { return At(path, KnobType::kList).s; }

const std::string& Config::SourceOf(std::string_view path) const {
  const auto it = values_.find(path);
  TANDEM_CHECK_MSG(it != values_.end(), "no config knob '", ToAbsl(path), "'");
  return it->second.source;
}

std::string Config::DumpYaml() const {
  if (schema_ == nullptr || schema_->knobs().empty()) return "{}\n";
  const std::vector<KnobSpec>& knobs = schema_->knobs();
  // Group knobs by section, keeping each section (and knob) where it first appears in the schema:
  // sort by the first-appearance ranks of the path's prefixes.
  std::map<std::string, size_t, std::less<>> first_seen;
  std::vector<std::pair<std::vector<size_t>, const KnobSpec*>> order;
  for (const KnobSpec& knob : knobs) {
    std::vector<size_t> key;
    for (size_t dot = 0;; ++dot) {
      dot = knob.path.find('.', dot);
      const std::string prefix = knob.path.substr(0, dot);
      key.push_back(first_seen.try_emplace(prefix, first_seen.size()).first->second);
      if (dot == std::string::npos) break;
    }
    order.emplace_back(std::move(key), &knob);
  }
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });

  std::string out;
  std::vector<std::string> open;  // the sections of the previous knob
  for (const auto& [key, knob] : order) {
    std::vector<std::string> segments = absl::StrSplit(knob->path, '.');
    const size_t depth = segments.size() - 1;
    size_t common = 0;
    while (common < depth && common < open.size() && open[common] == segments[common]) ++common;
    for (size_t k = common; k < depth; ++k) {
      absl::StrAppend(&out, std::string(2 * k, ' '), segments[k], ":\n");
    }
    const Value& value = values_.at(knob->path);
    absl::StrAppend(&out, std::string(2 * depth, ' '), segments[depth], ": ", ValueText(value));
    if (!value.is_default) absl::StrAppend(&out, "  # from ", value.source);
    out += '\n';
    segments.pop_back();
    open = std::move(segments);
  }
  return out;
}

std::vector<std::string> Config::NonDefault() const {
  std::vector<std::string> lines;
  if (schema_ == nullptr) return lines;
  for (const KnobSpec& knob : schema_->knobs()) {
    const Value& value = values_.at(knob.path);
    if (!value.is_default) {
      lines.push_back(absl::StrCat(knob.path, " = ", ValueText(value), " (", value.source, ")"));
    }
  }
  return lines;
}

// ---- Loading -----------------------------------------------------------------------------------

// Applies the YAML text and the --set overrides to a Config of defaults. Errors are
// InvalidArgument "<where>: <message>", where <where> is "<yaml source>" (followed by the path
// where one is known) or "--set <override>".
class ConfigLoader {
 public:
  static absl::StatusOr<Config> Load(const ConfigSchema& schema, std::string_view yaml_text,
                                     std::string_view yaml_source,
                                     const std::vector<std::string>& overrides) {
    ConfigLoader loader(schema);
    if (!yaml_text.empty()) {
      const std::string source = yaml_source.empty() ? kUnnamedYaml : std::string(yaml_source);
      RETURN_IF_ERROR(loader.ApplyYaml(yaml_text, source));
    }
    for (const std::string& override_text : overrides) {
      RETURN_IF_ERROR(loader.ApplyOverride(override_text));
    }
    return std::move(loader.config_);
  }

 private:
  explicit ConfigLoader(const ConfigSchema& schema) : schema_(schema) {
    config_.schema_ = &schema;
    for (const KnobSpec& knob : schema.knobs()) {
      const Parsed def = DefaultOf(knob);
      Config::Value value;
      value.type = knob.type;
      value.i = def.i;
      value.d = def.d;
      value.b = def.b;
      value.s = def.s;
      value.source = kDefaultSource;
      config_.values_.emplace(knob.path, std::move(value));
      for (size_t dot = knob.path.find('.'); dot != std::string::npos; dot = knob.path.find('.', dot + 1)) {
        sections_.insert(knob.path.substr(0, dot));
      }
    }
  }

  absl::Status ApplyYaml(std::string_view text, const std::string& source) {
    RETURN_IF_ERROR(CheckYamlTopLevelComma(text, source));
    try {
      const std::vector<YAML::Node> documents = YAML::LoadAll(std::string(text));
      std::vector<const YAML::Node*> non_empty;
      for (const YAML::Node& doc : documents) {
        if (!doc.IsNull()) non_empty.push_back(&doc);
      }
      if (non_empty.empty()) return absl::OkStatus();  // empty, or only comments
      if (non_empty.size() > 1) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": expected one YAML document, found ",
                                                       non_empty.size(), " (separated by ---)"));
      }
      const YAML::Node& top = *non_empty.front();
      if (!top.IsMap()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": the top level must be a mapping of keys and sections, got ",
                         top.IsSequence() ? "a sequence" : absl::StrCat("the scalar ", Describe(top))));
      }
      std::map<std::string, int, std::less<>> leaf_lines;
      return WalkMap(top, "", source, leaf_lines);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": YAML syntax error at line ", e.mark.line + 1,
                                                     ", column ", e.mark.column + 1, ": ", e.msg));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": cannot parse YAML: ", e.what()));
    }
  }

  // Applies the keys of `map`, found at `prefix` ("" at the top). `leaf_lines` holds the line of
  // every knob set so far, to catch a knob set twice (also as "a.b: 1" next to "a: {b: 2}").
  absl::Status WalkMap(const YAML::Node& map, const std::string& prefix, const std::string& source,
                       std::map<std::string, int, std::less<>>& leaf_lines) {
    std::map<std::string, int, std::less<>> keys_here;
    for (const auto& entry : map) {
      const YAML::Node key = entry.first;
      const YAML::Node value = entry.second;
      const int line = key.Mark().line + 1;
      if (!key.IsScalar()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": ", prefix.empty() ? "" : absl::StrCat(prefix, ": "), "line ", line,
                         ": a key must be a name, got ", Describe(key)));
      }
      const std::string path = prefix.empty() ? key.Scalar() : absl::StrCat(prefix, ".", key.Scalar());
      if (auto [first, inserted] = keys_here.emplace(key.Scalar(), line); !inserted) {
        return Duplicate(source, path, first->second, line);
      }
      if (const KnobSpec* spec = schema_.Find(path)) {
        if (auto [first, inserted] = leaf_lines.emplace(path, line); !inserted) {
          return Duplicate(source, path, first->second, line);
        }
        RETURN_IF_ERROR(SetFromNode(*spec, value, source, absl::StrCat(source, ": ", path)));
      } else if (sections_.contains(path)) {
        if (value.IsNull()) continue;  // "section:" with every key commented out
        if (!value.IsMap()) {
          return absl::InvalidArgumentError(
              absl::StrCat(source, ": ", path, ": expected a section (a mapping with keys such as '",
                           Children(path).front(), "'), got ", Describe(value)));
        }
        RETURN_IF_ERROR(WalkMap(value, path, source, leaf_lines));
      } else {
        return absl::InvalidArgumentError(absl::StrCat(source, ": ", UnknownKey(path)));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ApplyOverride(const std::string& text) {
    const std::string where = absl::StrCat(kSetSource, " ", text);
    const size_t eq = text.find('=');
    if (eq == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected path=value, e.g. ", ExampleOverride()));
    }
    const std::string path(absl::StripAsciiWhitespace(absl::string_view(text).substr(0, eq)));
    if (path.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": the path before '=' is empty; expected path=value, e.g. ", ExampleOverride()));
    }
    const KnobSpec* spec = schema_.Find(path);
    if (spec == nullptr) {
      if (sections_.contains(path)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": '", path, "' is a section, not a setting; set one of its keys, e.g. '",
                         path, ".", Children(path).front(), "'"));
      }
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", UnknownKey(path)));
    }
    RETURN_IF_ERROR(CheckYamlTopLevelComma(std::string_view(text).substr(eq + 1), where));
    try {
      return SetFromNode(*spec, YAML::Load(std::string(text.substr(eq + 1))), kSetSource, where);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": the value is not a valid YAML scalar: ", e.msg));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": cannot parse the value: ", e.what()));
    }
  }

  // Sets `spec` from a YAML node; errors read "<where>: <message>".
  absl::Status SetFromNode(const KnobSpec& spec, const YAML::Node& node, const std::string& source,
                           const std::string& where) {
    if (node.IsNull()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected a value (", Expectation(spec), "), got none"));
    }
    if (spec.type == KnobType::kList) {
      if (!node.IsSequence()) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": expected a list, got ", Describe(node)));
      }
      YAML::Emitter out;
      out.SetSeqFormat(YAML::Flow);
      out.SetMapFormat(YAML::Flow);
      out << node;
      Config::Value& value = config_.values_.find(spec.path)->second;
      value.s = out.c_str();
      value.source = source;
      value.is_default = node.size() == 0;
      return absl::OkStatus();
    }
    if (!node.IsScalar()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": expected ", Expectation(spec), ", got ", Describe(node)));
    }
    const bool quoted = node.Tag() == "!" || node.Tag() == "tag:yaml.org,2002:str";
    absl::StatusOr<Parsed> parsed = ParseScalar(spec, node.Scalar(), quoted);
    if (!parsed.ok()) return Annotate(parsed.status(), where);
    Config::Value& value = config_.values_.find(spec.path)->second;
    const Parsed def = DefaultOf(spec);
    value.i = parsed->i;
    value.d = parsed->d;
    value.b = parsed->b;
    value.s = std::move(parsed->s);
    value.source = source;
    switch (spec.type) {
      case KnobType::kInt:
        value.is_default = value.i == def.i;
        break;
      case KnobType::kDouble:
        value.is_default = value.d == def.d;
        break;
      case KnobType::kBool:
        value.is_default = value.b == def.b;
        break;
      case KnobType::kString:
      case KnobType::kEnum:
      case KnobType::kList:
        value.is_default = value.s == def.s;
        break;
    }
    return absl::OkStatus();
  }

  static absl::Status Duplicate(const std::string& source, const std::string& path, int first_line,
                                int line) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": duplicate key '", path, "' (lines ", first_line, " and ", line, ")"));
  }

  // The next segments under `section` ("" for the top level), in schema order, each once.
  std::vector<std::string> Children(std::string_view section) const {
    std::vector<std::string> children;
    for (const KnobSpec& knob : schema_.knobs()) {
      std::string_view rest = knob.path;
      if (!section.empty()) {
        if (!IsSectionOf(section, rest)) continue;
        rest.remove_prefix(section.size() + 1);
      }
      std::string child(rest.substr(0, rest.find('.')));
      if (std::find(children.begin(), children.end(), child) == children.end()) {
        children.push_back(std::move(child));
      }
    }
    return children;
  }

  // "unknown key 'a.b'" with a "did you mean" suggestion: the closest knob or section path within
  // edit distance 2, else a knob of another section with the same last segment. Without one, the
  // known keys of the closest enclosing section are listed.
  std::string UnknownKey(const std::string& path) const {
    std::string best;
    size_t best_distance = 3;
    auto consider = [&](std::string_view candidate) {
      const size_t distance = EditDistance(path, candidate);
      if (distance < best_distance) {
        best_distance = distance;
        best = std::string(candidate);
      }
    };
    for (const KnobSpec& knob : schema_.knobs()) consider(knob.path);
    for (const std::string& section : sections_) consider(section);
    if (best.empty()) {
      for (const KnobSpec& knob : schema_.knobs()) {
        if (LastSegment(knob.path) == LastSegment(path)) {
          best = knob.path;
          break;
        }
      }
    }
    if (!best.empty()) return absl::StrCat("unknown key '", path, "' (did you mean '", best, "'?)");
    const size_t last_dot = path.rfind('.');
    std::string parent = path.substr(0, last_dot == std::string::npos ? 0 : last_dot);
    while (!parent.empty() && !sections_.contains(parent)) {
      const size_t dot = parent.rfind('.');
      parent.resize(dot == std::string::npos ? 0 : dot);
    }
    const std::vector<std::string> known = Children(parent);
    if (known.empty()) return absl::StrCat("unknown key '", path, "'");
    return absl::StrCat("unknown key '", path, "' (known keys ",
                        parent.empty() ? "at the top level" : absl::StrCat("of '", parent, "'"), ": ",
                        absl::StrJoin(known, ", "), ")");
  }

  std::string ExampleOverride() const {
    if (schema_.knobs().empty()) return "--set section.key=value";
    const KnobSpec& knob = schema_.knobs().front();
    return absl::StrCat(kSetSource, " ", knob.path, "=",
                        knob.type == KnobType::kString ? YamlScalar(knob.default_value) : knob.default_value);
  }

  const ConfigSchema& schema_;
  Config config_;
  std::set<std::string, std::less<>> sections_;
};

absl::StatusOr<Config> LoadConfig(const ConfigSchema& schema, std::string_view yaml_text,
                                  std::string_view yaml_source, const std::vector<std::string>& overrides) {
  return ConfigLoader::Load(schema, yaml_text, yaml_source, overrides);
}

absl::StatusOr<Config> LoadConfigFile(const ConfigSchema& schema, const std::string& path,
                                      const std::vector<std::string>& overrides) {
  std::string text;
  RETURN_IF_ERROR(ReadFile(path, &text));
  return ConfigLoader::Load(schema, text, path, overrides);
}

}  // namespace tandem
