// Evaluator of the Jinja subset (chat/jinja.h): values behave as in Python's jinja2.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <set>

#include "chat/jinja.h"

namespace tandem::jinja {
namespace {

[[noreturn]] void Fail(int64_t pos, std::string msg) {
  throw JinjaError{JinjaError::kRuntime, std::move(msg), pos};
}

// ---- UTF-8 -------------------------------------------------------------------------------------

std::vector<uint32_t> Decode(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t k = 0; k < s.size();) {
    const auto c = static_cast<unsigned char>(s[k]);
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (k + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : (c & (0x7f >> n));
    for (int j = 1; j < n; ++j) cp = (cp << 6) | (static_cast<unsigned char>(s[k + j]) & 0x3f);
    out.push_back(cp);
    k += n;
  }
  return out;
}

std::string Encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t k = begin; k < end; ++k) AppendUtf8(out, cps[k]);
  return out;
}

// Python's str.isspace() code points.
bool IsPySpace(uint32_t c) {
  return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f ||
         c == 0x3000;
}

std::string Strip(const std::string& s, const Value* chars, bool left, bool right) {
  const std::vector<uint32_t> cps = Decode(s);
  std::vector<uint32_t> set;
  if (chars != nullptr && chars->kind == Value::kString) set = Decode(chars->s);
  const bool use_set = chars != nullptr && chars->kind == Value::kString;
  auto strip = [&](uint32_t c) {
    return use_set ? std::find(set.begin(), set.end(), c) != set.end() : IsPySpace(c);
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip(cps[e - 1])) --e;
  }
  return Encode(cps, b, e);
}

// Case mapping of the scripts chat content most often uses (ASCII, Latin-1, basic Greek and
// Cyrillic); other code points are uncased, as CJK, Arabic or emoji are in Python.
uint32_t UpperCp(uint32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 32;
  if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) return c - 32;
  if (c >= 0x430 && c <= 0x44f) return c - 32;
  if (c >= 0x450 && c <= 0x45f) return c - 80;
  return c;
}
uint32_t LowerCp(uint32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}
bool IsCased(uint32_t c) {
  return UpperCp(c) != c || LowerCp(c) != c || (c >= 0xc0 && c <= 0x24f && c != 0xd7 && c != 0xf7) ||
         (c >= 0x386 && c <= 0x3ff) || (c >= 0x400 && c <= 0x52f);
}
bool IsAlpha(uint32_t c) { return IsCased(c) || (c >= 0x4e00 && c <= 0x9fff); }

std::string MapCase(const std::string& s, uint32_t (*f)(uint32_t)) {
  std::vector<uint32_t> cps = Decode(s);
  for (uint32_t& c : cps) c = f(c);
  return Encode(cps, 0, cps.size());
}
std::string Upper(const std::string& s) { return MapCase(s, UpperCp); }
std::string Lower(const std::string& s) { return MapCase(s, LowerCp); }

// Python str.title(): a cased character after an uncased one is upper-cased, others lower-cased.
std::string Title(const std::string& s) {
  std::vector<uint32_t> cps = Decode(s);
  bool prev_cased = false;
  for (uint32_t& c : cps) {
    const bool cased = IsCased(c);
    c = prev_cased ? LowerCp(c) : UpperCp(c);
    prev_cased = cased;
  }
  return Encode(cps, 0, cps.size());
}
std::string Capitalize(const std::string& s) {
  std::vector<uint32_t> cps = Decode(s);
  for (size_t k = 0; k < cps.size(); ++k) cps[k] = k == 0 ? UpperCp(cps[k]) : LowerCp(cps[k]);
  return Encode(cps, 0, cps.size());
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to, int64_t count) {
  std::string out;
  if (from.empty()) {  // Python inserts `to` around every code point
    const std::vector<uint32_t> cps = Decode(s);
    int64_t n = 0;
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (k < cps.size()) out += Encode(cps, k, k + 1);
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  for (;;) {
    const size_t at = (count >= 0 && n >= count) ? std::string::npos : s.find(from, pos);
    if (at == std::string::npos) break;
    out.append(s, pos, at - pos);
    out += to;
    pos = at + from.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// ---- printing ------------------------------------------------------------------------------------

std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0) return std::signbit(f) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // d.ddde±XX
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::atoi(sci.c_str() + e + 1);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits += c;
  }
  std::string out;
  if (exp >= -5 + 1 && exp < 16) {  // Python repr: fixed notation for 1e-4 <= |f| < 1e16
    if (exp >= 0) {
      if (static_cast<int>(digits.size()) <= exp + 1) {
        out = digits + std::string(exp + 1 - digits.size(), '0') + ".0";
      } else {
        out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
      }
    } else {
      out = "0." + std::string(-exp - 1, '0') + digits;
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

std::string Repr(const Value& v);

std::string StrRepr(const std::string& s) {
  const char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') {
      out += '\\';
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else {
      out += c;
    }
  }
  return out + q;
}

std::string Repr(const Value& v) {
  switch (v.kind) {
    case Value::kString:
      return StrRepr(v.s);
    case Value::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + Repr((*v.list)[k]);
      return out + "]";
    }
    case Value::kDict: {
      if (v.is_namespace) return "<Namespace>";
      std::string out = "{";
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        out += (k ? ", " : "") + StrRepr(v.dict->items[k].first) + ": " + Repr(v.dict->items[k].second);
      }
      return out + "}";
    }
    default:
      return ToString(v);
  }
}

void JsonString(std::string& out, const std::string& s) {
  out += '"';
  for (char c : s) {
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
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", static_cast<unsigned char>(c));
          out += b;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void Json(std::string& out, const Value& v, int indent, int depth) {
  auto newline = [&](int d) {
    if (indent >= 0) {
      out += '\n';
      out += std::string(static_cast<size_t>(indent * d), ' ');
    }
  };
  const char* sep = indent >= 0 ? "," : ", ";
  switch (v.kind) {
    case Value::kNone:
      out += "null";
      return;
    case Value::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::kInt:
      out += std::to_string(v.i);
      return;
    case Value::kFloat:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : FloatRepr(v.f);
      return;
    case Value::kString:
      JsonString(out, v.s);
      return;
    case Value::kList:
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += sep;
        newline(depth + 1);
        Json(out, (*v.list)[k], indent, depth + 1);
      }
      newline(depth);
      out += ']';
      return;
    case Value::kDict:
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        if (k) out += sep;
        newline(depth + 1);
        JsonString(out, v.dict->items[k].first);
        out += ": ";
        Json(out, v.dict->items[k].second, indent, depth + 1);
      }
      newline(depth);
      out += '}';
      return;
    default:
      Fail(-1, "tojson: a value of this type is not JSON serializable");
  }
}

// ---- semantics -------------------------------------------------------------------------------------

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kString:
      return !v.s.empty();
    case Value::kList:
      return !v.list->empty();
    case Value::kDict:
      return v.is_namespace || !v.dict->items.empty();
    default:
      return true;
  }
}

bool IsNumber(const Value& v) {
  return v.kind == Value::kInt || v.kind == Value::kFloat || v.kind == Value::kBool;
}
double AsDouble(const Value& v) {
  return v.kind == Value::kFloat ? v.f : v.kind == Value::kBool ? (v.b ? 1 : 0) : static_cast<double>(v.i);
}
int64_t AsInt(const Value& v) { return v.kind == Value::kBool ? (v.b ? 1 : 0) : v.i; }
bool IsIntLike(const Value& v) { return v.kind == Value::kInt || v.kind == Value::kBool; }

bool Equal(const Value& a, const Value& b) {
  if (IsNumber(a) && IsNumber(b)) {
    if (IsIntLike(a) && IsIntLike(b)) return AsInt(a) == AsInt(b);
    return AsDouble(a) == AsDouble(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return true;
    case Value::kString:
      return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Value::kDict: {
      if (a.dict == b.dict) return true;
      if (a.is_namespace || b.is_namespace || a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->Find(k);
        if (o == nullptr || !Equal(v, *o)) return false;
      }
      return true;
    }
    case Value::kMacro:
      return a.macro == b.macro;
    case Value::kBuiltin:
      return a.s == b.s;
    default:
      return false;
  }
}

// -1, 0, 1 for <, ==, >; throws for values Python cannot order.
int Order(const Value& a, const Value& b, int64_t pos) {
  if (IsNumber(a) && IsNumber(b)) {
    if (IsIntLike(a) && IsIntLike(b)) return AsInt(a) < AsInt(b) ? -1 : AsInt(a) > AsInt(b);
    return AsDouble(a) < AsDouble(b) ? -1 : AsDouble(a) > AsDouble(b);
  }
  if (a.kind == Value::kString && b.kind == Value::kString) {
    const int c = a.s.compare(b.s);  // UTF-8 byte order is code point order
    return c < 0 ? -1 : c > 0;
  }
  if (a.kind == Value::kList && b.kind == Value::kList) {
    for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
      const int c = Order((*a.list)[k], (*b.list)[k], pos);
      if (c != 0) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  Fail(pos, "cannot compare these values with < or >");
}

int64_t Length(const Value& v, int64_t pos) {
  switch (v.kind) {
    case Value::kString:
      return static_cast<int64_t>(Decode(v.s).size());
    case Value::kList:
      return static_cast<int64_t>(v.list->size());
    case Value::kDict:
      return static_cast<int64_t>(v.dict->items.size());
    case Value::kUndefined:
      return 0;
    default:
      Fail(pos, "object has no length");
  }
}

// The items a for loop (or list()) sees.
List Iterate(const Value& v, int64_t pos) {
  switch (v.kind) {
    case Value::kList:
      return *v.list;
    case Value::kDict: {
      List keys;
      for (const auto& [k, x] : v.dict->items) keys.push_back(Value::Str(k));
      return keys;
    }
    case Value::kString: {
      List chars;
      const std::vector<uint32_t> cps = Decode(v.s);
      for (size_t k = 0; k < cps.size(); ++k) chars.push_back(Value::Str(Encode(cps, k, k + 1)));
      return chars;
    }
    case Value::kUndefined:
      return {};
    default:
      Fail(pos, "value is not iterable");
  }
}

bool Contains(const Value& hay, const Value& needle, int64_t pos) {
  switch (hay.kind) {
    case Value::kString:
      if (needle.kind != Value::kString) Fail(pos, "'in <string>' requires a string on the left");
      return hay.s.find(needle.s) != std::string::npos;
    case Value::kList:
      for (const Value& x : *hay.list) {
        if (Equal(x, needle)) return true;
      }
      return false;
    case Value::kDict:
      return needle.kind == Value::kString && hay.dict->Find(needle.s) != nullptr;
    case Value::kUndefined:
      return false;
    default:
      Fail(pos, "argument of 'in' is not a container");
  }
}

// Python slice indices for a sequence of length n.
std::vector<int64_t> SliceIndices(int64_t n, const Value& start, const Value& stop, const Value& step,
                                  int64_t pos) {
  auto given = [](const Value& v) { return v.kind != Value::kUndefined && v.kind != Value::kNone; };
  const int64_t st = given(step) ? AsInt(step) : 1;
  if (st == 0) Fail(pos, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t def) -> int64_t {
    if (!given(v)) return def;
    int64_t x = AsInt(v);
    if (x < 0) x += n;
    if (st > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t b = clamp(start, st > 0 ? 0 : n - 1), e = clamp(stop, st > 0 ? n : -1);
  std::vector<int64_t> idx;
  for (int64_t k = b; st > 0 ? k < e : k > e; k += st) idx.push_back(k);
  return idx;
}

}  // namespace

Value* Dict::Find(const std::string& key) {
  for (auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}
const Value* Dict::Find(const std::string& key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}
void Dict::Set(const std::string& key, Value v) {
  if (Value* x = Find(key)) {
    *x = std::move(v);
  } else {
    items.emplace_back(key, std::move(v));
  }
}

std::string ToString(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "";
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return FloatRepr(v.f);
    case Value::kString:
      return v.s;
    case Value::kList:
    case Value::kDict:
      return Repr(v);
    case Value::kMacro:
      return "<Macro>";
    case Value::kBuiltin:
      return "<built-in function " + v.s + ">";
  }
  return "";
}

std::string ToJson(const Value& v, int indent) {
  std::string out;
  Json(out, v, indent, 0);
  return out;
}

namespace {

const std::set<std::string> kFilters = {
    "trim",    "length", "count", "tojson",     "upper",      "lower",    "capitalize", "title",
    "default", "d",      "first", "last",       "join",       "replace",  "string",     "int",
    "float",   "abs",    "round", "items",      "list",       "reverse",  "sort",       "unique",
    "min",     "max",    "sum",   "selectattr", "rejectattr", "map",      "select",     "reject",
    "indent",  "safe",   "e",     "escape",     "wordcount",  "dictsort", "batch"};
const std::set<std::string> kTests = {
    "defined",  "undefined", "none", "string",   "number", "integer", "float",       "boolean", "mapping",
    "iterable", "sequence",  "true", "false",    "even",   "odd",     "divisibleby", "eq",      "equalto",
    "==",       "ne",        "!=",   "lt",       "<",      "gt",      ">",           "le",      "<=",
    "ge",       ">=",        "in",   "callable", "sameas", "lower",   "upper"};
const std::set<std::string> kMethods = {
    "strip",   "lstrip",     "rstrip",  "startswith", "endswith", "split", "rsplit", "upper",   "lower",
    "title",   "capitalize", "replace", "find",       "rfind",    "count", "join",   "isdigit", "isalpha",
    "isspace", "islower",    "isupper", "get",        "items",    "keys",  "values", "index"};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Positional `k`, else keyword `name`, else `def`.
  Value Get(size_t k, const char* name, Value def = Value()) const {
    if (k < pos.size()) return pos[k];
    for (const auto& [n, v] : kw) {
      if (n == name) return v;
    }
    return def;
  }
};

class Evaluator {
 public:
  explicit Evaluator(const std::map<std::string, Value>& globals) { scopes_.push_back(globals); }

  enum Flow { kNormal, kBreak, kContinue };

  Flow Exec(const Body& body, std::string& out) {
    for (const auto& n : body) {
      const Flow f = ExecNode(*n, out);
      if (f != kNormal) return f;
    }
    return kNormal;
  }

 private:
  Flow ExecNode(const Node& n, std::string& out) {
    switch (n.kind) {
      case Node::kText:
        out += n.text;
        return kNormal;
      case Node::kOutput:
        out += ToString(Eval(*n.expr));
        return kNormal;
      case Node::kIf:
        for (size_t k = 0; k < n.conds.size(); ++k) {
          if (Truthy(Eval(*n.conds[k]))) return Exec(n.bodies[k], out);
        }
        if (n.bodies.size() > n.conds.size()) return Exec(n.bodies.back(), out);
        return kNormal;
      case Node::kFor:
        return ExecFor(n, out);
      case Node::kSet: {
        Value v = Eval(*n.expr);
        if (!n.attr.empty()) {
          Value ns = Lookup(n.targets[0]);
          if (ns.kind != Value::kDict || !ns.is_namespace) {
            Fail(n.pos, "cannot assign attribute '" + n.attr + "' of '" + n.targets[0] +
                            "', which is not a namespace");
          }
          ns.dict->Set(n.attr, std::move(v));
        } else if (n.targets.size() == 1) {
          scopes_.back()[n.targets[0]] = std::move(v);
        } else {
          const List items = Iterate(v, n.pos);
          if (items.size() != n.targets.size()) Fail(n.pos, "wrong number of values to unpack");
          for (size_t k = 0; k < items.size(); ++k) scopes_.back()[n.targets[k]] = items[k];
        }
        return kNormal;
      }
      case Node::kSetBlock: {
        std::string s;
        Exec(n.bodies[0], s);
        scopes_.back()[n.targets[0]] = Value::Str(std::move(s));
        return kNormal;
      }
      case Node::kMacro: {
        Value m{Value::kMacro};
        m.macro = &n;
        scopes_.back()[n.text] = m;
        return kNormal;
      }
      case Node::kBreak:
        return kBreak;
      case Node::kContinue:
        return kContinue;
      case Node::kBody:
        return Exec(n.bodies[0], out);
    }
    return kNormal;
  }

  void Bind(const Node& n, const Value& item) {
    if (n.targets.size() == 1) {
      scopes_.back()[n.targets[0]] = item;
      return;
    }
    const List parts = Iterate(item, n.pos);
    if (parts.size() != n.targets.size()) Fail(n.pos, "wrong number of values to unpack in for loop");
    for (size_t k = 0; k < parts.size(); ++k) scopes_.back()[n.targets[k]] = parts[k];
  }

  Flow ExecFor(const Node& n, std::string& out) {
    List items = Iterate(Eval(*n.expr), n.expr->pos);
    scopes_.emplace_back();
    if (n.filter != nullptr) {
      List kept;
      for (const Value& item : items) {
        Bind(n, item);
        if (Truthy(Eval(*n.filter))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t len = static_cast<int64_t>(items.size());
    // As jinja2, the else block runs unless some iteration ran its body to the end (one that
    // ends in break or continue does not count).
    bool completed = false;
    for (int64_t k = 0; k < len; ++k) {
      Value loop = Value::MakeDict();
      loop.dict->Set("index", Value::Int(k + 1));
      loop.dict->Set("index0", Value::Int(k));
      loop.dict->Set("revindex", Value::Int(len - k));
      loop.dict->Set("revindex0", Value::Int(len - k - 1));
      loop.dict->Set("first", Value::Bool(k == 0));
      loop.dict->Set("last", Value::Bool(k == len - 1));
      loop.dict->Set("length", Value::Int(len));
      loop.dict->Set("previtem", k > 0 ? items[k - 1] : Value());
      loop.dict->Set("nextitem", k + 1 < len ? items[k + 1] : Value());
      scopes_.back()["loop"] = loop;
      Bind(n, items[k]);
      const Flow f = Exec(n.bodies[0], out);
      if (f == kNormal) completed = true;
      if (f == kBreak) break;
    }
    scopes_.pop_back();
    if (!completed && n.bodies.size() > 1) return Exec(n.bodies[1], out);
    return kNormal;
  }

  Value Lookup(const std::string& name) const {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value();
  }

  Value Eval(const Expr& e) {
    switch (e.kind) {
      case Expr::kLiteral:
        return e.literal;
      case Expr::kName:
        return Lookup(e.name);
      case Expr::kList:
      case Expr::kTuple: {
        Value v = Value::MakeList();
        for (const auto& k : e.kids) v.list->push_back(Eval(*k));
        return v;
      }
      case Expr::kDict: {
        Value v = Value::MakeDict();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          const Value key = Eval(*e.kids[k]);
          if (key.kind != Value::kString) Fail(e.kids[k]->pos, "dict keys must be strings here");
          v.dict->Set(key.s, Eval(*e.kids[k + 1]));
        }
        return v;
      }
      case Expr::kAttr: {
        const Value obj = Eval(*e.kids[0]);
        if (obj.kind == Value::kUndefined) Fail(e.pos, "'" + Describe(*e.kids[0]) + "' is undefined");
        if (obj.kind == Value::kDict) {
          const Value* v = obj.dict->Find(e.name);
          return v != nullptr ? *v : Value();
        }
        return Value();
      }
      case Expr::kSubscript:
        return Subscript(Eval(*e.kids[0]), Eval(*e.kids[1]), e);
      case Expr::kSlice: {
        const Value obj = Eval(*e.kids[0]);
        Value parts[3];
        for (int k = 0; k < 3; ++k) {
          if (e.kids[k + 1] != nullptr) parts[k] = Eval(*e.kids[k + 1]);
        }
        if (obj.kind == Value::kList) {
          Value out = Value::MakeList();
          for (int64_t k :
               SliceIndices(static_cast<int64_t>(obj.list->size()), parts[0], parts[1], parts[2], e.pos)) {
            out.list->push_back((*obj.list)[k]);
          }
          return out;
        }
        if (obj.kind == Value::kString) {
          const std::vector<uint32_t> cps = Decode(obj.s);
          std::vector<uint32_t> sel;
          for (int64_t k :
               SliceIndices(static_cast<int64_t>(cps.size()), parts[0], parts[1], parts[2], e.pos)) {
            sel.push_back(cps[k]);
          }
          return Value::Str(Encode(sel, 0, sel.size()));
        }
        if (obj.kind == Value::kUndefined) Fail(e.pos, "'" + Describe(*e.kids[0]) + "' is undefined");
        Fail(e.pos, "value cannot be sliced");
      }
      case Expr::kCall:
        return Call(e);
      case Expr::kFilter:
        return Filter(e);
      case Expr::kTest: {
        const bool r = Test(e);
        return Value::Bool(e.negated ? !r : r);
      }
      case Expr::kNot:
        return Value::Bool(!Truthy(Eval(*e.kids[0])));
      case Expr::kNeg:
      case Expr::kPos: {
        const Value v = Eval(*e.kids[0]);
        if (!IsNumber(v))
          Fail(e.pos, "bad operand type for unary " + std::string(e.kind == Expr::kNeg ? "-" : "+"));
        if (e.kind == Expr::kPos) return IsIntLike(v) ? Value::Int(AsInt(v)) : v;
        return IsIntLike(v) ? Value::Int(-AsInt(v)) : Value::Float(-v.f);
      }
      case Expr::kAnd: {
        Value a = Eval(*e.kids[0]);
        return Truthy(a) ? Eval(*e.kids[1]) : a;
      }
      case Expr::kOr: {
        Value a = Eval(*e.kids[0]);
        return Truthy(a) ? a : Eval(*e.kids[1]);
      }
      case Expr::kCond:
        if (Truthy(Eval(*e.kids[1]))) return Eval(*e.kids[0]);
        return e.kids[2] != nullptr ? Eval(*e.kids[2]) : Value();
      case Expr::kCompare: {
        Value a = Eval(*e.kids[0]);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value b = Eval(*e.kids[k + 1]);
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==") {
            r = Equal(a, b);
          } else if (op == "!=") {
            r = !Equal(a, b);
          } else if (op == "in") {
            r = Contains(b, a, e.pos);
          } else if (op == "not in") {
            r = !Contains(b, a, e.pos);
          } else {
            const int c = Order(a, b, e.pos);
            r = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
          }
          if (!r) return Value::Bool(false);
          a = std::move(b);
        }
        return Value::Bool(true);
      }
      case Expr::kBinary:
        return Binary(e.name, Eval(*e.kids[0]), Eval(*e.kids[1]), e.pos);
    }
    return Value();
  }

  static std::string Describe(const Expr& e) {
    if (e.kind == Expr::kName) return e.name;
    if (e.kind == Expr::kAttr) return Describe(*e.kids[0]) + "." + e.name;
    return "value";
  }

  Value Subscript(const Value& obj, const Value& key, const Expr& e) {
    switch (obj.kind) {
      case Value::kList:
        if (IsIntLike(key)) {
          int64_t k = AsInt(key);
          const int64_t n = static_cast<int64_t>(obj.list->size());
          if (k < 0) k += n;
          return k >= 0 && k < n ? (*obj.list)[k] : Value();
        }
        return Value();
      case Value::kDict:
        if (key.kind == Value::kString) {
          const Value* v = obj.dict->Find(key.s);
          return v != nullptr ? *v : Value();
        }
        return Value();
      case Value::kString:
        if (IsIntLike(key)) {
          const std::vector<uint32_t> cps = Decode(obj.s);
          int64_t k = AsInt(key);
          const int64_t n = static_cast<int64_t>(cps.size());
          if (k < 0) k += n;
          return k >= 0 && k < n ? Value::Str(Encode(cps, k, k + 1)) : Value();
        }
        return Value();
      case Value::kUndefined:
        Fail(e.pos, "'" + Describe(*e.kids[0]) + "' is undefined");
      default:
        return Value();
    }
  }

  Value Binary(const std::string& op, const Value& a, const Value& b, int64_t pos) {
    if (op == "~") return Value::Str(ToString(a) + ToString(b));
    if (op == "+") {
      if (a.kind == Value::kString && b.kind == Value::kString) return Value::Str(a.s + b.s);
      if (a.kind == Value::kList && b.kind == Value::kList) {
        Value v = Value::MakeList(*a.list);
        v.list->insert(v.list->end(), b.list->begin(), b.list->end());
        return v;
      }
    }
    if (op == "*") {
      const Value* seq = a.kind == Value::kString || a.kind == Value::kList ? &a : &b;
      const Value* n = seq == &a ? &b : &a;
      if ((seq->kind == Value::kString || seq->kind == Value::kList) && IsIntLike(*n)) {
        if (seq->kind == Value::kString) {
          std::string s;
          for (int64_t k = 0; k < AsInt(*n); ++k) s += seq->s;
          return Value::Str(s);
        }
        Value v = Value::MakeList();
        for (int64_t k = 0; k < AsInt(*n); ++k)
          v.list->insert(v.list->end(), seq->list->begin(), seq->list->end());
        return v;
      }
    }
    if (!IsNumber(a) || !IsNumber(b)) Fail(pos, "unsupported operand types for " + op);
    const bool ints = IsIntLike(a) && IsIntLike(b);
    const int64_t x = AsInt(a), y = AsInt(b);
    const double p = AsDouble(a), q = AsDouble(b);
    if (op == "+") return ints ? Value::Int(x + y) : Value::Float(p + q);
    if (op == "-") return ints ? Value::Int(x - y) : Value::Float(p - q);
    if (op == "*") return ints ? Value::Int(x * y) : Value::Float(p * q);
    if (op == "/") {
      if (q == 0) Fail(pos, "division by zero");
      return Value::Float(p / q);
    }
    if (op == "//" || op == "%") {
      if (q == 0) Fail(pos, "division by zero");
      if (ints) {
        int64_t d = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --d;
          m += y;
        }
        return Value::Int(op == "//" ? d : m);
      }
      const double d = std::floor(p / q);
      return Value::Float(op == "//" ? d : p - d * q);
    }
    if (op == "**") {
      if (ints && y >= 0) {
        int64_t r = 1;
        for (int64_t k = 0; k < y; ++k) r *= x;
        return Value::Int(r);
      }
      return Value::Float(std::pow(p, q));
    }
    Fail(pos, "unknown operator " + op);
  }

  Args EvalArgs(const Expr& e, size_t first) {
    Args a;
    for (size_t k = first; k < e.kids.size(); ++k) a.pos.push_back(Eval(*e.kids[k]));
    for (const auto& [name, x] : e.kwargs) a.kw.emplace_back(name, Eval(*x));
    return a;
  }

  Value Call(const Expr& e) {
    const Expr& callee = *e.kids[0];
    if (callee.kind == Expr::kAttr) {
      const Value obj = Eval(*callee.kids[0]);
      if (obj.kind == Value::kUndefined) Fail(callee.pos, "'" + Describe(*callee.kids[0]) + "' is undefined");
      if (obj.kind != Value::kDict || obj.dict->Find(callee.name) == nullptr || obj.is_namespace) {
        return Method(obj, callee.name, EvalArgs(e, 1), e.pos);
      }
    }
    const Value f = Eval(callee);
    Args args = EvalArgs(e, 1);
    if (f.kind == Value::kMacro) return CallMacro(*f.macro, args, e.pos);
    if (f.kind != Value::kBuiltin) Fail(e.pos, "'" + Describe(callee) + "' is not callable");
    if (f.s == "raise_exception") {
      throw JinjaError{JinjaError::kRaised, ToString(args.Get(0, "message")), e.pos};
    }
    if (f.s == "namespace" || f.s == "dict") {
      Value ns = Value::MakeDict();
      ns.is_namespace = f.s == "namespace";
      for (const Value& p : args.pos) {  // namespace({...}) / dict(other)
        if (p.kind == Value::kDict) {
          for (const auto& [k, v] : p.dict->items) ns.dict->Set(k, v);
        }
      }
      for (const auto& [k, v] : args.kw) ns.dict->Set(k, v);
      return ns;
    }
    if (f.s == "strftime_now") {
      const Value fixed = Lookup(kFixedTimeVariable);
      const std::time_t t =
          fixed.kind == Value::kInt ? static_cast<std::time_t>(fixed.i) : std::time(nullptr);
      std::tm tm{};
      if (fixed.kind == Value::kInt) {
        gmtime_r(&t, &tm);
      } else {
        localtime_r(&t, &tm);
      }
      const std::string fmt = ToString(args.Get(0, "format"));
      char buf[512];
      const size_t n = fmt.empty() ? 0 : std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
      return Value::Str(std::string(buf, n));
    }
    if (f.s == "range") {
      int64_t start = 0, stop, step = 1;
      if (args.pos.size() == 1) {
        stop = AsInt(args.pos[0]);
      } else if (args.pos.size() >= 2) {
        start = AsInt(args.pos[0]);
        stop = AsInt(args.pos[1]);
        if (args.pos.size() > 2) step = AsInt(args.pos[2]);
      } else {
        Fail(e.pos, "range expects 1 to 3 arguments");
      }
      if (step == 0) Fail(e.pos, "range() step must not be zero");
      Value v = Value::MakeList();
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        v.list->push_back(Value::Int(k));
        if (v.list->size() > 1000000) Fail(e.pos, "range too large");
      }
      return v;
    }
    Fail(e.pos, "unknown function " + f.s);
  }

  Value CallMacro(const Node& m, const Args& args, int64_t pos) {
    std::map<std::string, Value> frame;
    if (args.pos.size() > m.params.size())
      Fail(pos, "macro '" + m.text + "' takes " + std::to_string(m.params.size()) + " arguments");
    for (size_t k = 0; k < m.params.size(); ++k) {
      Value v = args.Get(k, m.params[k].c_str());
      if (v.kind == Value::kUndefined && m.defaults[k] != nullptr) v = Eval(*m.defaults[k]);
      frame[m.params[k]] = v;
    }
    std::vector<std::map<std::string, Value>> saved = std::move(scopes_);
    scopes_.clear();
    scopes_.push_back(saved.front());
    scopes_.push_back(std::move(frame));
    std::string out;
    Exec(m.bodies[0], out);
    scopes_ = std::move(saved);
    return Value::Str(out);
  }

  Value Method(const Value& obj, const std::string& name, const Args& a, int64_t pos) {
    if (obj.kind == Value::kString) {
      const std::string& s = obj.s;
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const Value chars = a.Get(0, "chars");
        return Value::Str(
            Strip(s, chars.kind == Value::kString ? &chars : nullptr, name != "rstrip", name != "lstrip"));
      }
      if (name == "startswith" || name == "endswith") {
        const Value p = a.Get(0, "prefix");
        std::vector<std::string> options;
        if (p.kind == Value::kString) options.push_back(p.s);
        if (p.kind == Value::kList) {
          for (const Value& x : *p.list) options.push_back(ToString(x));
        }
        for (const std::string& o : options) {
          if (name == "startswith"
                  ? s.compare(0, o.size(), o) == 0 && s.size() >= o.size()
                  : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0) {
            return Value::Bool(true);
          }
        }
        return Value::Bool(false);
      }
      if (name == "split" || name == "rsplit") {
        const Value sep = a.Get(0, "sep");
        const Value maxv = a.Get(1, "maxsplit");
        const int64_t maxsplit = maxv.kind == Value::kUndefined ? -1 : AsInt(maxv);
        Value out = Value::MakeList();
        if (sep.kind == Value::kString) {
          if (sep.s.empty()) Fail(pos, "empty separator");
          std::vector<std::string> parts;
          if (name == "split") {
            size_t p = 0;
            int64_t n = 0;
            for (;;) {
              const size_t at = (maxsplit >= 0 && n >= maxsplit) ? std::string::npos : s.find(sep.s, p);
              if (at == std::string::npos) break;
              parts.push_back(s.substr(p, at - p));
              p = at + sep.s.size();
              ++n;
            }
            parts.push_back(s.substr(p));
          } else {
            size_t e = s.size();
            int64_t n = 0;
            for (;;) {
              if (maxsplit >= 0 && n >= maxsplit) break;
              if (e < sep.s.size()) break;
              const size_t at = s.rfind(sep.s, e - sep.s.size());
              if (at == std::string::npos) break;
              parts.insert(parts.begin(), s.substr(at + sep.s.size(), e - at - sep.s.size()));
              e = at;
              ++n;
            }
            parts.insert(parts.begin(), s.substr(0, e));
          }
          for (auto& x : parts) out.list->push_back(Value::Str(x));
          return out;
        }
        // Whitespace split (left to right; rsplit with maxsplit is rare enough to treat alike).
        const std::vector<uint32_t> cps = Decode(s);
        size_t k = 0;
        int64_t n = 0;
        while (k < cps.size()) {
          while (k < cps.size() && IsPySpace(cps[k])) ++k;
          if (k >= cps.size()) break;
          if (maxsplit >= 0 && n >= maxsplit) {
            size_t e = cps.size();
            while (e > k && IsPySpace(cps[e - 1])) --e;
            out.list->push_back(Value::Str(Encode(cps, k, e)));
            break;
          }
          size_t e = k;
          while (e < cps.size() && !IsPySpace(cps[e])) ++e;
          out.list->push_back(Value::Str(Encode(cps, k, e)));
          ++n;
          k = e;
        }
        return out;
      }
      if (name == "upper") return Value::Str(Upper(s));
      if (name == "lower") return Value::Str(Lower(s));
      if (name == "title") return Value::Str(Title(s));
      if (name == "capitalize") return Value::Str(Capitalize(s));
      if (name == "replace") {
        const Value c = a.Get(2, "count");
        return Value::Str(Replace(s, ToString(a.Get(0, "old")), ToString(a.Get(1, "new")),
                                  c.kind == Value::kUndefined ? -1 : AsInt(c)));
      }
      if (name == "find" || name == "rfind" || name == "count" || name == "index") {
        const std::string sub = ToString(a.Get(0, "sub"));
        if (name == "count") {
          if (sub.empty()) return Value::Int(static_cast<int64_t>(Decode(s).size()) + 1);
          int64_t n = 0;
          for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
          return Value::Int(n);
        }
        const size_t at = name == "rfind" ? s.rfind(sub) : s.find(sub);
        if (at == std::string::npos) {
          if (name == "index") Fail(pos, "substring not found");
          return Value::Int(-1);
        }
        return Value::Int(static_cast<int64_t>(Decode(s.substr(0, at)).size()));
      }
      if (name == "join") {
        std::string out;
        const List items = Iterate(a.Get(0, "iterable"), pos);
        for (size_t k = 0; k < items.size(); ++k) out += (k ? s : "") + ToString(items[k]);
        return Value::Str(out);
      }
      if (name == "isdigit" || name == "isalpha" || name == "isspace" || name == "islower" ||
          name == "isupper") {
        const std::vector<uint32_t> cps = Decode(s);
        if (cps.empty()) return Value::Bool(false);
        bool cased = false;
        for (uint32_t c : cps) {
          if (name == "isdigit" && !(c >= '0' && c <= '9')) return Value::Bool(false);
          if (name == "isalpha" && !IsAlpha(c)) return Value::Bool(false);
          if (name == "isspace" && !IsPySpace(c)) return Value::Bool(false);
          if (name == "islower" && c >= 'A' && c <= 'Z') return Value::Bool(false);
          if (name == "isupper" && c >= 'a' && c <= 'z') return Value::Bool(false);
          if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) cased = true;
        }
        return Value::Bool(name == "islower" || name == "isupper" ? cased : true);
      }
    }
    if (obj.kind == Value::kDict && !obj.is_namespace) {
      if (name == "get") {
        const Value key = a.Get(0, "key");
        const Value* v = key.kind == Value::kString ? obj.dict->Find(key.s) : nullptr;
        return v != nullptr ? *v : a.Get(1, "default", Value::None());
      }
      if (name == "items" || name == "keys" || name == "values") {
        Value out = Value::MakeList();
        for (const auto& [k, v] : obj.dict->items) {
          if (name == "items") {
            out.list->push_back(Value::MakeList({Value::Str(k), v}));
          } else {
            out.list->push_back(name == "keys" ? Value::Str(k) : v);
          }
        }
        return out;
      }
    }
    if (obj.kind == Value::kList) {
      if (name == "index" || name == "count") {
        const Value x = a.Get(0, "value");
        int64_t n = 0;
        for (size_t k = 0; k < obj.list->size(); ++k) {
          if (Equal((*obj.list)[k], x)) {
            if (name == "index") return Value::Int(static_cast<int64_t>(k));
            ++n;
          }
        }
        if (name == "index") Fail(pos, "value is not in list");
        return Value::Int(n);
      }
    }
    Fail(pos, "this value has no method '" + name + "'");
  }

  Value Attribute(const Value& v, const std::string& attr) {
    Value cur = v;
    size_t p = 0;
    for (;;) {  // dotted attributes ("a.b")
      const size_t dot = attr.find('.', p);
      const std::string part = attr.substr(p, dot == std::string::npos ? std::string::npos : dot - p);
      if (cur.kind == Value::kDict) {
        const Value* x = cur.dict->Find(part);
        cur = x != nullptr ? *x : Value();
      } else if (cur.kind == Value::kList && !part.empty() &&
                 std::isdigit(static_cast<unsigned char>(part[0]))) {
        const size_t k = std::stoul(part);
        cur = k < cur.list->size() ? (*cur.list)[k] : Value();
      } else {
        cur = Value();
      }
      if (dot == std::string::npos) return cur;
      p = dot + 1;
    }
  }

  bool ApplyTest(const std::string& name, const Value& v, const std::vector<Value>& args, int64_t pos) {
    auto arg = [&](size_t k) -> const Value& {
      if (k >= args.size()) Fail(pos, "test '" + name + "' needs an argument");
      return args[k];
    };
    if (name == "defined") return v.kind != Value::kUndefined;
    if (name == "undefined") return v.kind == Value::kUndefined;
    if (name == "none") return v.kind == Value::kNone;
    if (name == "string") return v.kind == Value::kString;
    if (name == "number") return IsNumber(v);
    if (name == "integer") return v.kind == Value::kInt;
    if (name == "float") return v.kind == Value::kFloat;
    if (name == "boolean") return v.kind == Value::kBool;
    if (name == "true") return v.kind == Value::kBool && v.b;
    if (name == "false") return v.kind == Value::kBool && !v.b;
    if (name == "mapping") return v.kind == Value::kDict && !v.is_namespace;
    if (name == "iterable")
      return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kString ||
             v.kind == Value::kUndefined;
    if (name == "sequence")
      return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kString;
    if (name == "callable") return v.kind == Value::kMacro || v.kind == Value::kBuiltin;
    if (name == "even" || name == "odd") {
      if (!IsIntLike(v)) Fail(pos, "test '" + name + "' needs an integer");
      return (AsInt(v) % 2 == 0) == (name == "even");
    }
    if (name == "divisibleby") return AsInt(arg(0)) != 0 && AsInt(v) % AsInt(arg(0)) == 0;
    if (name == "eq" || name == "equalto" || name == "==") return Equal(v, arg(0));
    if (name == "ne" || name == "!=") return !Equal(v, arg(0));
    if (name == "sameas") return Equal(v, arg(0)) && v.kind == arg(0).kind;
    if (name == "lt" || name == "<") return Order(v, arg(0), pos) < 0;
    if (name == "le" || name == "<=") return Order(v, arg(0), pos) <= 0;
    if (name == "gt" || name == ">") return Order(v, arg(0), pos) > 0;
    if (name == "ge" || name == ">=") return Order(v, arg(0), pos) >= 0;
    if (name == "in") return Contains(arg(0), v, pos);
    if (name == "lower") return v.kind == Value::kString && Lower(v.s) == v.s;
    if (name == "upper") return v.kind == Value::kString && Upper(v.s) == v.s;
    Fail(pos, "unknown test '" + name + "'");
  }

  bool Test(const Expr& e) {
    const Value v = Eval(*e.kids[0]);
    std::vector<Value> args;
    for (size_t k = 1; k < e.kids.size(); ++k) args.push_back(Eval(*e.kids[k]));
    return ApplyTest(e.name, v, args, e.pos);
  }

  Value Filter(const Expr& e) {
    const Value v = Eval(*e.kids[0]);
    const Args a = EvalArgs(e, 1);
    return ApplyFilter(e.name, v, a, e.pos);
  }

  Value ApplyFilter(const std::string& f, const Value& v, const Args& a, int64_t pos) {
    if (f == "trim") {
      const Value chars = a.Get(0, "chars");
      return Value::Str(Strip(ToString(v), chars.kind == Value::kString ? &chars : nullptr, true, true));
    }
    if (f == "length" || f == "count") return Value::Int(Length(v, pos));
    if (f == "tojson") {
      const Value ind = a.Get(0, "indent");
      return Value::Str(ToJson(v, ind.kind == Value::kInt ? static_cast<int>(ind.i) : -1));
    }
    if (f == "upper") return Value::Str(Upper(ToString(v)));
    if (f == "lower") return Value::Str(Lower(ToString(v)));
    if (f == "capitalize") return Value::Str(Capitalize(ToString(v)));
    if (f == "title") {  // jinja's title: words begin after whitespace, - ( { [ <
      std::string out;
      bool begin = true;
      for (uint32_t c : Decode(ToString(v))) {
        std::string ch = Encode({c}, 0, 1);
        const bool sep = IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
        out += sep ? ch : (begin ? Upper(ch) : Lower(ch));
        begin = sep;
      }
      return Value::Str(out);
    }
    if (f == "default" || f == "d") {
      const bool boolean = Truthy(a.Get(1, "boolean", Value::Bool(false)));
      if (v.kind == Value::kUndefined || (boolean && !Truthy(v)))
        return a.Get(0, "default_value", Value::Str(""));
      return v;
    }
    if (f == "first" || f == "last") {
      const List items = Iterate(v, pos);
      if (items.empty()) return Value();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "join") {
      const std::string sep = ToString(a.Get(0, "d", Value::Str("")));
      const Value attr = a.Get(1, "attribute");
      std::string out;
      const List items = Iterate(v, pos);
      for (size_t k = 0; k < items.size(); ++k) {
        out += (k ? sep : "") +
               ToString(attr.kind == Value::kUndefined ? items[k] : Attribute(items[k], ToString(attr)));
      }
      return Value::Str(out);
    }
    if (f == "replace") {
      const Value c = a.Get(2, "count");
      return Value::Str(Replace(ToString(v), ToString(a.Get(0, "old")), ToString(a.Get(1, "new")),
                                c.kind == Value::kUndefined || c.kind == Value::kNone ? -1 : AsInt(c)));
    }
    if (f == "string" || f == "safe" || f == "e" || f == "escape") {
      if (f == "string" || f == "safe") return v.kind == Value::kString ? v : Value::Str(ToString(v));
      std::string out;
      for (char c : ToString(v)) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out += c;
        }
      }
      return Value::Str(out);
    }
    if (f == "int") {
      if (IsIntLike(v)) return Value::Int(AsInt(v));
      if (v.kind == Value::kFloat) return Value::Int(static_cast<int64_t>(v.f));
      if (v.kind == Value::kString) {
        const std::string s = Strip(v.s, nullptr, true, true);
        char* end = nullptr;
        const long long x = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && end != nullptr && *end == 0) return Value::Int(x);
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end != nullptr && *end == 0) return Value::Int(static_cast<int64_t>(d));
      }
      return a.Get(0, "default", Value::Int(0));
    }
    if (f == "float") {
      if (IsNumber(v)) return Value::Float(AsDouble(v));
      if (v.kind == Value::kString) {
        char* end = nullptr;
        const std::string s = Strip(v.s, nullptr, true, true);
        const double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && end != nullptr && *end == 0) return Value::Float(d);
      }
      return a.Get(0, "default", Value::Float(0));
    }
    if (f == "abs") {
      if (!IsNumber(v)) Fail(pos, "abs of a non-number");
      return IsIntLike(v) ? Value::Int(std::llabs(AsInt(v))) : Value::Float(std::fabs(v.f));
    }
    if (f == "round") {
      const int64_t prec = AsInt(a.Get(0, "precision", Value::Int(0)));
      const std::string method = ToString(a.Get(1, "method", Value::Str("common")));
      const double m = std::pow(10.0, static_cast<double>(prec));
      const double x = AsDouble(v) * m;
      const double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
      return Value::Float(r / m);
    }
    if (f == "items") {
      if (v.kind == Value::kUndefined) return Value::MakeList();
      if (v.kind != Value::kDict) Fail(pos, "items of a non-mapping");
      Value out = Value::MakeList();
      for (const auto& [k, x] : v.dict->items) out.list->push_back(Value::MakeList({Value::Str(k), x}));
      return out;
    }
    if (f == "dictsort") {
      Value out = ApplyFilter("items", v, {}, pos);
      std::stable_sort(out.list->begin(), out.list->end(), [&](const Value& x, const Value& y) {
        return Lower((*x.list)[0].s) < Lower((*y.list)[0].s);
      });
      return out;
    }
    if (f == "list") return Value::MakeList(Iterate(v, pos));
    if (f == "reverse") {
      if (v.kind == Value::kString) {
        std::vector<uint32_t> cps = Decode(v.s);
        std::reverse(cps.begin(), cps.end());
        return Value::Str(Encode(cps, 0, cps.size()));
      }
      List items = Iterate(v, pos);
      std::reverse(items.begin(), items.end());
      return Value::MakeList(std::move(items));
    }
    if (f == "sort" || f == "unique" || f == "min" || f == "max") {
      List items = Iterate(v, pos);
      const Value attr = a.Get(f == "sort" ? 2 : 1, "attribute");
      const bool reverse = f == "sort" && Truthy(a.Get(0, "reverse"));
      const bool cs = Truthy(a.Get(f == "sort" ? 1 : 0, "case_sensitive"));
      auto key = [&](const Value& x) {
        Value k = attr.kind == Value::kUndefined ? x : Attribute(x, ToString(attr));
        if (!cs && k.kind == Value::kString) k.s = Lower(k.s);
        return k;
      };
      if (f == "unique") {
        List out;
        List seen;
        for (const Value& x : items) {
          const Value k = key(x);
          if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return Equal(s, k); })) {
            seen.push_back(k);
            out.push_back(x);
          }
        }
        return Value::MakeList(std::move(out));
      }
      std::stable_sort(items.begin(), items.end(),
                       [&](const Value& x, const Value& y) { return Order(key(x), key(y), pos) < 0; });
      if (reverse) std::reverse(items.begin(), items.end());
      if (f == "min") return items.empty() ? Value() : items.front();
      if (f == "max") return items.empty() ? Value() : items.back();
      return Value::MakeList(std::move(items));
    }
    if (f == "sum") {
      Value total = a.Get(1, "start", Value::Int(0));
      const Value attr = a.Get(0, "attribute");
      for (const Value& x : Iterate(v, pos)) {
        total = Binary("+", total, attr.kind == Value::kUndefined ? x : Attribute(x, ToString(attr)), pos);
      }
      return total;
    }
    if (f == "selectattr" || f == "rejectattr" || f == "select" || f == "reject") {
      const bool attr_mode = f == "selectattr" || f == "rejectattr";
      const bool keep = f == "selectattr" || f == "select";
      const size_t test_at = attr_mode ? 1 : 0;
      const std::string attr = attr_mode ? ToString(a.Get(0, "attribute")) : "";
      const Value test = test_at < a.pos.size() ? a.pos[test_at] : Value();
      std::vector<Value> test_args(a.pos.begin() + std::min(a.pos.size(), test_at + 1), a.pos.end());
      if (test.kind != Value::kUndefined && !KnownTest(ToString(test))) {
        Fail(pos, "unsupported test '" + ToString(test) + "' in " + f);
      }
      Value out = Value::MakeList();
      for (const Value& x : Iterate(v, pos)) {
        const Value subject = attr_mode ? Attribute(x, attr) : x;
        const bool r = test.kind == Value::kUndefined ? Truthy(subject)
                                                      : ApplyTest(ToString(test), subject, test_args, pos);
        if (r == keep) out.list->push_back(x);
      }
      return out;
    }
    if (f == "map") {
      Value out = Value::MakeList();
      const Value attr = a.Get(99, "attribute");
      for (const Value& x : Iterate(v, pos)) {
        if (attr.kind != Value::kUndefined) {
          Value r = Attribute(x, ToString(attr));
          if (r.kind == Value::kUndefined) r = a.Get(99, "default");
          out.list->push_back(r);
        } else {
          if (a.pos.empty()) Fail(pos, "map needs a filter name or attribute=");
          const std::string name = ToString(a.pos[0]);
          if (!KnownFilter(name) || name == "map") Fail(pos, "unsupported filter '" + name + "' in map");
          Args rest;
          rest.pos.assign(a.pos.begin() + 1, a.pos.end());
          rest.kw = a.kw;
          out.list->push_back(ApplyFilter(name, x, rest, pos));
        }
      }
      return out;
    }
    if (f == "indent") {
      const Value w = a.Get(0, "width", Value::Int(4));
      const std::string pad =
          w.kind == Value::kString ? w.s : std::string(static_cast<size_t>(AsInt(w)), ' ');
      const bool first = Truthy(a.Get(1, "first"));
      const bool blank = Truthy(a.Get(2, "blank"));
      const std::string s = ToString(v);
      std::string out;
      size_t p = 0;
      bool is_first = true;
      for (;;) {
        const size_t nl = s.find('\n', p);
        const std::string line = s.substr(p, nl == std::string::npos ? std::string::npos : nl - p);
        if (!is_first) out += '\n';
        if ((is_first ? first : true) && (blank || !line.empty())) out += pad;
        out += line;
        is_first = false;
        if (nl == std::string::npos) break;
        p = nl + 1;
      }
      return Value::Str(out);
    }
    if (f == "wordcount") {
      int64_t n = 0;
      bool in_word = false;
      for (uint32_t c : Decode(ToString(v))) {
        const bool w = IsAlpha(c) || (c >= '0' && c <= '9') || c == '_';
        if (w && !in_word) ++n;
        in_word = w;
      }
      return Value::Int(n);
    }
    if (f == "batch") {
      const int64_t size = AsInt(a.Get(0, "linecount"));
      if (size <= 0) Fail(pos, "batch size must be positive");
      Value out = Value::MakeList();
      for (const Value& x : Iterate(v, pos)) {
        if (out.list->empty() || static_cast<int64_t>(out.list->back().list->size()) == size) {
          out.list->push_back(Value::MakeList());
        }
        out.list->back().list->push_back(x);
      }
      return out;
    }
    Fail(pos, "unknown filter '" + f + "'");
  }

  std::vector<std::map<std::string, Value>> scopes_;
};

}  // namespace

bool KnownFilter(const std::string& name) { return kFilters.contains(name); }
bool KnownTest(const std::string& name) { return kTests.contains(name); }
bool KnownMethod(const std::string& name) { return kMethods.contains(name); }

std::string Render(const Body& body, const std::map<std::string, Value>& globals) {
  Evaluator ev(globals);
  std::string out;
  ev.Exec(body, out);
  return out;
}

}  // namespace tandem::jinja
