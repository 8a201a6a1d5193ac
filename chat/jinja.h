// Internals of the chat-template interpreter (chat/chat_template.h): values, the syntax tree, the
// lexer and parser (jinja_parse.cc) and the evaluator (jinja_eval.cc). Errors inside are thrown as
// JinjaError and turned into absl::Status at the ChatTemplate boundary.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tandem::jinja {

// A failure at `pos` (a byte offset into the template source; -1 when none).
struct JinjaError {
  enum Kind { kSyntax, kUnsupported, kRuntime, kRaised } kind;
  std::string message;
  int64_t pos = -1;
};

struct Node;
struct Value;
using List = std::vector<Value>;
struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python dicts
  Value* Find(const std::string& key);
  const Value* Find(const std::string& key) const;
  void Set(const std::string& key, Value v);
};

struct Value {
  enum Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kMacro,
    kBuiltin
  } kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;               // strings; the name of a builtin
  std::shared_ptr<List> list;  // lists and tuples (shared: Jinja values are references)
  std::shared_ptr<Dict> dict;  // dicts and namespaces
  bool is_namespace = false;
  const Node* macro = nullptr;  // kMacro

  static Value None() { return Value{kNone}; }
  static Value Bool(bool v) {
    Value x{kBool};
    x.b = v;
    return x;
  }
  static Value Int(int64_t v) {
    Value x{kInt};
    x.i = v;
    return x;
  }
  static Value Float(double v) {
    Value x{kFloat};
    x.f = v;
    return x;
  }
  static Value Str(std::string v) {
    Value x{kString};
    x.s = std::move(v);
    return x;
  }
  static Value MakeList(List v = {}) {
    Value x{kList};
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value MakeDict() {
    Value x{kDict};
    x.dict = std::make_shared<Dict>();
    return x;
  }
  static Value Builtin(std::string name) {
    Value x{kBuiltin};
    x.s = std::move(name);
    return x;
  }
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
struct Expr {
  enum Kind {
    kLiteral,
    kName,
    kList,
    kTuple,
    kDict,
    kAttr,
    kSubscript,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kPos,
    kBinary,
    kAnd,
    kOr,
    kCompare,
    kCond,
  } kind;
  int64_t pos = 0;
  Value literal;
  std::string name;  // name, attribute, filter, test, binary operator
  std::vector<ExprPtr> kids;
  std::vector<std::string> ops;  // kCompare: one per pair
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  bool negated = false;  // kTest: "is not"
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;
struct Node {
  enum Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kBody } kind;
  int64_t pos = 0;
  std::string text;                  // kText; kMacro: its name
  ExprPtr expr;                      // kOutput, kSet value, kFor iterable
  ExprPtr filter;                    // kFor: "if" filter
  std::vector<ExprPtr> conds;        // kIf: one per branch
  std::vector<Body> bodies;          // kIf: one per branch (+ else); kFor: body (+ else); others: [0]
  std::vector<std::string> targets;  // kFor, kSet: names; kSet "ns.attr": targets = {ns}, attr
  std::string attr;
  std::vector<std::string> params;  // kMacro
  std::vector<ExprPtr> defaults;    // kMacro: one per param (null: none)
};

// A global no template can name (not an identifier): strftime_now's fixed time, when set.
inline constexpr const char* kFixedTimeVariable = " fixed_time";

// Parses a template (after jinja2's trim_blocks / lstrip_blocks / whitespace control).
Body Parse(const std::string& source);

// Renders `body` with the global variables `globals`.
std::string Render(const Body& body, const std::map<std::string, Value>& globals);

// Python str() of a value (what {{ }} prints) and its JSON (HF's tojson: ensure_ascii off,
// keys in insertion order).
std::string ToString(const Value& v);
std::string ToJson(const Value& v, int indent);

// What the evaluator implements; the parser refuses anything else at load.
bool KnownFilter(const std::string& name);
bool KnownTest(const std::string& name);
bool KnownMethod(const std::string& name);

// 1-based line and column of byte `pos` in `source`.
std::pair<int, int> LineColumn(const std::string& source, int64_t pos);

// Appends code point `cp` to `out` as UTF-8 (the lexer and the evaluator both build strings).
void AppendUtf8(std::string& out, uint32_t cp);

}  // namespace tandem::jinja
