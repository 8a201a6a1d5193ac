// Lexer and parser of the Jinja subset (chat/jinja.h).
#include <cctype>
#include <cstdlib>
#include <set>

#include "chat/jinja.h"

namespace tandem::jinja {
namespace {

[[noreturn]] void Fail(JinjaError::Kind kind, int64_t pos, std::string msg) {
  throw JinjaError{kind, std::move(msg), pos};
}

// ---- template level: text and tags ---------------------------------------------------------------

struct Piece {
  enum Kind { kText, kVar, kBlock } kind;
  std::string text;  // kText: the text; kVar/kBlock: the tag's inside
  int64_t pos;       // of the text, or of the inside of the tag
};

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// Finds the end marker `end` ("}}", "%}") of a tag starting at `from`, skipping string literals
// and, as jinja2's lexer, markers inside open brackets ("{{ {'a': {'b': 1}} }}").
size_t FindTagEnd(const std::string& src, size_t from, const char* end) {
  char quote = 0;
  int depth = 0;
  for (size_t k = from; k + 1 < src.size(); ++k) {
    const char c = src[k];
    if (quote != 0) {
      if (c == '\\') {
        ++k;
      } else if (c == quote) {
        quote = 0;
      }
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (depth == 0 && c == end[0] && src[k + 1] == end[1]) {
      return k;
    } else if (c == '(' || c == '[' || c == '{') {
      ++depth;
    } else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return std::string::npos;
}

std::vector<Piece> SplitTags(const std::string& src) {
  std::vector<Piece> out;
  size_t pos = 0;
  bool line_starting = true;
  for (;;) {
    size_t k = pos;
    while (k + 1 < src.size() &&
           !(src[k] == '{' && (src[k + 1] == '{' || src[k + 1] == '%' || src[k + 1] == '#'))) {
      ++k;
    }
    const bool tag = k + 1 < src.size();
    std::string text = src.substr(pos, (tag ? k : src.size()) - pos);
    if (tag) {
      const char type = src[k + 1];
      const char mark = k + 2 < src.size() ? src[k + 2] : 0;
      if (mark == '-') {
        while (!text.empty() && IsSpace(text.back())) text.pop_back();
      } else if (type != '{' && mark != '+') {  // lstrip_blocks
        const size_t l = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
        if ((l > 0 || line_starting) && text.find_first_not_of(" \t", l) == std::string::npos) text.resize(l);
      }
    }
    if (!text.empty()) out.push_back({Piece::kText, text, static_cast<int64_t>(pos)});
    if (!tag) break;
    const char type = src[k + 1];
    size_t inner = k + 2;
    if (inner < src.size() && (src[inner] == '-' || src[inner] == '+')) ++inner;
    size_t end;
    if (type == '#') {
      end = src.find("#}", inner);
    } else {
      end = FindTagEnd(src, inner, type == '{' ? "}}" : "%}");
      if (end == std::string::npos) end = src.find(type == '{' ? "}}" : "%}", inner);  // unbalanced brackets
    }
    if (end == std::string::npos) {
      Fail(JinjaError::kSyntax, static_cast<int64_t>(k),
           type == '#' ? "comment not closed" : (type == '{' ? "'{{' not closed" : "'{%' not closed"));
    }
    const bool strip_after = end > inner && src[end - 1] == '-';
    const size_t inner_end = strip_after ? end - 1 : end;
    if (type != '#') {
      out.push_back({type == '{' ? Piece::kVar : Piece::kBlock, src.substr(inner, inner_end - inner),
                     static_cast<int64_t>(inner)});
    }
    size_t after = end + 2;
    if (strip_after) {
      while (after < src.size() && IsSpace(src[after])) ++after;
    } else if (type != '{' && after < src.size() && src[after] == '\n') {  // trim_blocks
      ++after;
    }
    line_starting = after > 0 && src[after - 1] == '\n';
    pos = after;
  }
  return out;
}

// ---- expression tokens ---------------------------------------------------------------------------

struct Token {
  enum Kind { kName, kInt, kFloat, kString, kOp, kEnd } kind;
  std::string text;  // name, operator, or the decoded string
  int64_t i = 0;
  double f = 0;
  int64_t pos = 0;
};

std::vector<Token> Tokenize(const std::string& s, int64_t base) {
  static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                               ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};
  std::vector<Token> out;
  size_t k = 0;
  while (k < s.size()) {
    const char c = s[k];
    const int64_t pos = base + static_cast<int64_t>(k);
    if (IsSpace(c)) {
      ++k;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      out.push_back({Token::kName, s.substr(k, e - k), 0, 0, pos});
      k = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      bool is_float = false;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        is_float = true;
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      }
      if (e < s.size() && (s[e] == 'e' || s[e] == 'E')) {
        size_t x = e + 1;
        if (x < s.size() && (s[x] == '+' || s[x] == '-')) ++x;
        if (x < s.size() && std::isdigit(static_cast<unsigned char>(s[x]))) {
          is_float = true;
          e = x;
          while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        }
      }
      std::string num;
      for (size_t q = k; q < e; ++q) {
        if (s[q] != '_') num += s[q];
      }
      Token t{is_float ? Token::kFloat : Token::kInt, num, 0, 0, pos};
      if (is_float) {
        t.f = std::strtod(num.c_str(), nullptr);
      } else {
        t.i = std::strtoll(num.c_str(), nullptr, 10);
      }
      out.push_back(t);
      k = e;
    } else if (c == '\'' || c == '"') {
      std::string v;
      size_t e = k + 1;
      for (;; ++e) {
        if (e >= s.size()) Fail(JinjaError::kSyntax, pos, "string literal not closed");
        if (s[e] == c) break;
        if (s[e] != '\\' || e + 1 >= s.size()) {
          v += s[e];
          continue;
        }
        const char n = s[++e];
        switch (n) {
          case 'n':
            v += '\n';
            break;
          case 't':
            v += '\t';
            break;
          case 'r':
            v += '\r';
            break;
          case '\\':
          case '\'':
          case '"':
            v += n;
            break;
          case 'u':
          case 'x': {
            const size_t len = n == 'u' ? 4 : 2;
            if (e + len >= s.size()) Fail(JinjaError::kSyntax, pos, "bad escape in string literal");
            AppendUtf8(v, static_cast<uint32_t>(std::strtoul(s.substr(e + 1, len).c_str(), nullptr, 16)));
            e += len;
            break;
          }
          case '\n':
            break;
          default:  // Python keeps unknown escapes as written
            v += '\\';
            v += n;
        }
      }
      out.push_back({Token::kString, v, 0, 0, pos});
      k = e + 1;
    } else {
      bool found = false;
      for (const char* op : kOps) {
        const size_t n = std::char_traits<char>::length(op);
        if (s.compare(k, n, op) == 0) {
          out.push_back({Token::kOp, op, 0, 0, pos});
          k += n;
          found = true;
          break;
        }
      }
      if (!found) Fail(JinjaError::kSyntax, pos, std::string("unexpected character '") + c + "'");
    }
  }
  out.push_back({Token::kEnd, "", 0, 0, base + static_cast<int64_t>(s.size())});
  return out;
}

// ---- expressions ---------------------------------------------------------------------------------

class ExprParser {
 public:
  explicit ExprParser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  const Token& Peek(size_t ahead = 0) const { return t_[std::min(k_ + ahead, t_.size() - 1)]; }
  bool AtEnd() const { return Peek().kind == Token::kEnd; }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::kName && Peek(ahead).text == name;
  }
  Token Next() { return t_[std::min(k_++, t_.size() - 1)]; }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    ++k_;
    return true;
  }
  bool SkipName(const char* name) {
    if (!IsName(name)) return false;
    ++k_;
    return true;
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op))
      Fail(JinjaError::kSyntax, Peek().pos, std::string("expected '") + op + "', got " + Describe(Peek()));
  }
  std::string ExpectName() {
    if (Peek().kind != Token::kName)
      Fail(JinjaError::kSyntax, Peek().pos, "expected a name, got " + Describe(Peek()));
    return Next().text;
  }
  void ExpectEnd() {
    if (!AtEnd()) Fail(JinjaError::kSyntax, Peek().pos, "unexpected " + Describe(Peek()));
  }
  static std::string Describe(const Token& t) {
    if (t.kind == Token::kEnd) return "end of tag";
    return "'" + t.text + "'";
  }

  ExprPtr Parse() { return CondExpr(); }

  // A tuple without parentheses, as in `for a, b in` values or `set a, b = ...`.
  ExprPtr TupleOrExpr() {
    ExprPtr first = Parse();
    if (!IsOp(",")) return first;
    auto t = Make(Expr::kTuple, first->pos);
    t->kids.push_back(std::move(first));
    while (SkipOp(",")) {
      if (AtEnd()) break;
      t->kids.push_back(Parse());
    }
    return t;
  }

 private:
  static ExprPtr Make(Expr::Kind kind, int64_t pos) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = pos;
    return e;
  }

  ExprPtr CondExpr() {
    ExprPtr a = Or();
    while (IsName("if")) {
      const int64_t pos = Next().pos;
      auto c = Make(Expr::kCond, pos);
      c->kids.push_back(std::move(a));
      c->kids.push_back(Or());
      c->kids.push_back(SkipName("else") ? CondExpr() : nullptr);
      a = std::move(c);
    }
    return a;
  }
  ExprPtr Or() {
    ExprPtr a = And();
    while (IsName("or")) {
      auto o = Make(Expr::kOr, Next().pos);
      o->kids.push_back(std::move(a));
      o->kids.push_back(And());
      a = std::move(o);
    }
    return a;
  }
  ExprPtr And() {
    ExprPtr a = Not();
    while (IsName("and")) {
      auto o = Make(Expr::kAnd, Next().pos);
      o->kids.push_back(std::move(a));
      o->kids.push_back(Not());
      a = std::move(o);
    }
    return a;
  }
  ExprPtr Not() {
    if (IsName("not")) {
      auto n = Make(Expr::kNot, Next().pos);
      n->kids.push_back(Not());
      return n;
    }
    return Compare();
  }
  ExprPtr Compare() {
    ExprPtr a = Math1();
    ExprPtr cmp;
    for (;;) {
      std::string op;
      const Token& t = Peek();
      if (t.kind == Token::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" ||
                                   t.text == "<=" || t.text == ">=")) {
        op = t.text;
        ++k_;
      } else if (IsName("in")) {
        op = "in";
        ++k_;
      } else if (IsName("not") && IsName("in", 1)) {
        op = "not in";
        k_ += 2;
      } else {
        break;
      }
      if (cmp == nullptr) {
        cmp = Make(Expr::kCompare, t.pos);
        cmp->kids.push_back(std::move(a));
      }
      cmp->ops.push_back(op);
      cmp->kids.push_back(Math1());
    }
    return cmp != nullptr ? std::move(cmp) : std::move(a);
  }
  ExprPtr Binary(ExprPtr a, const std::string& op, int64_t pos, ExprPtr b) {
    auto e = Make(Expr::kBinary, pos);
    e->name = op;
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }
  ExprPtr Math1() {
    ExprPtr a = Concat();
    while (IsOp("+") || IsOp("-")) {
      const Token op = Next();
      a = Binary(std::move(a), op.text, op.pos, Concat());
    }
    return a;
  }
  ExprPtr Concat() {
    ExprPtr a = Math2();
    while (IsOp("~")) {
      const Token op = Next();
      a = Binary(std::move(a), op.text, op.pos, Math2());
    }
    return a;
  }
  ExprPtr Math2() {
    ExprPtr a = Pow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token op = Next();
      a = Binary(std::move(a), op.text, op.pos, Pow());
    }
    return a;
  }
  ExprPtr Pow() {
    ExprPtr a = Unary(true);
    while (IsOp("**")) {
      const Token op = Next();
      a = Binary(std::move(a), op.text, op.pos, Unary(true));
    }
    return a;
  }
  ExprPtr Unary(bool with_filter) {
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const Token op = Next();
      node = Make(op.text == "-" ? Expr::kNeg : Expr::kPos, op.pos);
      node->kids.push_back(Unary(false));
    } else {
      node = Primary();
    }
    node = Postfix(std::move(node));
    if (with_filter) node = FilterExpr(std::move(node));
    return node;
  }
  ExprPtr Primary() {
    const Token t = Next();
    switch (t.kind) {
      case Token::kName: {
        auto e = Make(Expr::kLiteral, t.pos);
        if (t.text == "true" || t.text == "True") {
          e->literal = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->literal = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->literal = Value::None();
        } else {
          e->kind = Expr::kName;
          e->name = t.text;
        }
        return e;
      }
      case Token::kString: {
        std::string s = t.text;
        while (Peek().kind == Token::kString) s += Next().text;  // adjacent literals concatenate
        auto e = Make(Expr::kLiteral, t.pos);
        e->literal = Value::Str(std::move(s));
        return e;
      }
      case Token::kInt: {
        auto e = Make(Expr::kLiteral, t.pos);
        e->literal = Value::Int(t.i);
        return e;
      }
      case Token::kFloat: {
        auto e = Make(Expr::kLiteral, t.pos);
        e->literal = Value::Float(t.f);
        return e;
      }
      case Token::kOp:
        if (t.text == "(") {
          if (SkipOp(")")) return Make(Expr::kTuple, t.pos);
          ExprPtr first = Parse();
          if (SkipOp(")")) return first;
          auto tup = Make(Expr::kTuple, t.pos);
          tup->kids.push_back(std::move(first));
          while (SkipOp(",")) {
            if (IsOp(")")) break;
            tup->kids.push_back(Parse());
          }
          ExpectOp(")");
          return tup;
        }
        if (t.text == "[") {
          auto list = Make(Expr::kList, t.pos);
          while (!SkipOp("]")) {
            if (!list->kids.empty()) {
              ExpectOp(",");
              if (SkipOp("]")) break;
            }
            list->kids.push_back(Parse());
          }
          return list;
        }
        if (t.text == "{") {
          auto dict = Make(Expr::kDict, t.pos);
          while (!SkipOp("}")) {
            if (!dict->kids.empty()) {
              ExpectOp(",");
              if (SkipOp("}")) break;
            }
            dict->kids.push_back(Parse());
            ExpectOp(":");
            dict->kids.push_back(Parse());
          }
          return dict;
        }
        break;
      default:
        break;
    }
    Fail(JinjaError::kSyntax, t.pos, "unexpected " + Describe(t));
  }
  void CallArgs(Expr* e) {  // after "("
    while (!SkipOp(")")) {
      if (!e->kids.empty() || !e->kwargs.empty()) {
        if (e->kind == Expr::kCall && e->kids.size() == 1 && e->kwargs.empty()) {
          // the callee is kids[0]; no separator before the first argument
        } else {
          ExpectOp(",");
          if (SkipOp(")")) break;
        }
      }
      if (IsOp("*") || IsOp("**"))
        Fail(JinjaError::kUnsupported, Peek().pos, "unsupported: *args / **kwargs in a call");
      if (Peek().kind == Token::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        ++k_;
        e->kwargs.emplace_back(std::move(key), Parse());
      } else {
        if (!e->kwargs.empty())
          Fail(JinjaError::kSyntax, Peek().pos, "positional argument after a keyword argument");
        e->kids.push_back(Parse());
      }
    }
  }
  ExprPtr Postfix(ExprPtr node) {
    for (;;) {
      if (IsOp(".")) {
        const int64_t pos = Next().pos;
        auto a = Make(Expr::kAttr, pos);
        if (Peek().kind == Token::kInt) {  // foo.0 is foo[0]
          a->kind = Expr::kSubscript;
          a->kids.push_back(std::move(node));
          auto idx = Make(Expr::kLiteral, pos);
          idx->literal = Value::Int(Next().i);
          a->kids.push_back(std::move(idx));
        } else {
          a->name = ExpectName();
          a->kids.push_back(std::move(node));
        }
        node = std::move(a);
      } else if (IsOp("[")) {
        const int64_t pos = Next().pos;
        ExprPtr parts[3];
        bool slice = false;
        for (int p = 0; p < 3; ++p) {
          if (!IsOp(":") && !IsOp("]")) parts[p] = Parse();
          if (p < 2 && SkipOp(":")) {
            slice = true;
            continue;
          }
          break;
        }
        ExpectOp("]");
        if (!slice) {
          if (parts[0] == nullptr) Fail(JinjaError::kSyntax, pos, "empty subscript");
          auto s = Make(Expr::kSubscript, pos);
          s->kids.push_back(std::move(node));
          s->kids.push_back(std::move(parts[0]));
          node = std::move(s);
        } else {
          auto s = Make(Expr::kSlice, pos);
          s->kids.push_back(std::move(node));
          for (auto& p : parts) s->kids.push_back(std::move(p));
          node = std::move(s);
        }
      } else if (IsOp("(")) {
        node = Call(std::move(node));
      } else {
        return node;
      }
    }
  }
  ExprPtr Call(ExprPtr callee) {
    const int64_t pos = Next().pos;
    if (callee->kind == Expr::kAttr && !KnownMethod(callee->name)) {
      Fail(JinjaError::kUnsupported, callee->pos, "unsupported method '" + callee->name + "'");
    }
    auto c = Make(Expr::kCall, pos);
    c->kids.push_back(std::move(callee));
    CallArgs(c.get());
    return c;
  }
  ExprPtr FilterExpr(ExprPtr node) {
    for (;;) {
      if (IsOp("|")) {
        ++k_;
        const Token name = Peek();
        auto f = Make(Expr::kFilter, name.pos);
        f->name = ExpectName();
        if (!KnownFilter(f->name))
          Fail(JinjaError::kUnsupported, name.pos, "unsupported filter '" + f->name + "'");
        f->kids.push_back(std::move(node));
        if (SkipOp("(")) CallArgsAfter(f.get());
        node = std::move(f);
      } else if (IsName("is")) {
        ++k_;
        auto t = Make(Expr::kTest, Peek().pos);
        t->negated = SkipName("not");
        const Token name = Peek();
        t->name = ExpectName();
        if (!KnownTest(t->name))
          Fail(JinjaError::kUnsupported, name.pos, "unsupported test '" + t->name + "'");
        t->kids.push_back(std::move(node));
        if (SkipOp("(")) {
          CallArgsAfter(t.get());
        } else {
          const Token& n = Peek();
          const bool arg = (n.kind == Token::kName || n.kind == Token::kString || n.kind == Token::kInt ||
                            n.kind == Token::kFloat || IsOp("[") || IsOp("{")) &&
                           !IsName("else") && !IsName("or") && !IsName("and");
          if (arg) t->kids.push_back(Postfix(Primary()));
        }
        node = std::move(t);
      } else if (IsOp("(")) {
        node = Call(std::move(node));
      } else {
        return node;
      }
    }
  }
  // Arguments after "(" for filters and tests, whose kids[0] is the input.
  void CallArgsAfter(Expr* e) {
    bool first = true;
    while (!SkipOp(")")) {
      if (!first) {
        ExpectOp(",");
        if (SkipOp(")")) break;
      }
      first = false;
      if (Peek().kind == Token::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        ++k_;
        e->kwargs.emplace_back(std::move(key), Parse());
      } else {
        e->kids.push_back(Parse());
      }
    }
  }

  std::vector<Token> t_;
  size_t k_ = 0;
};

// ---- statements ----------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::vector<Piece> pieces) : p_(std::move(pieces)) {}

  Body ParseAll() {
    std::string end;
    Body b = ParseBody({}, &end, nullptr);
    return b;
  }

 private:
  // Parses until a block tag whose first word is in `ends` (returned in *end with its parser).
  Body ParseBody(const std::set<std::string>& ends, std::string* end,
                 std::unique_ptr<ExprParser>* end_parser) {
    Body body;
    while (k_ < p_.size()) {
      const Piece& piece = p_[k_++];
      if (piece.kind == Piece::kText) {
        auto n = MakeNode(Node::kText, piece.pos);
        n->text = piece.text;
        body.push_back(std::move(n));
        continue;
      }
      auto ep = std::make_unique<ExprParser>(Tokenize(piece.text, piece.pos));
      if (piece.kind == Piece::kVar) {
        auto n = MakeNode(Node::kOutput, piece.pos);
        n->expr = ep->Parse();
        ep->ExpectEnd();
        body.push_back(std::move(n));
        continue;
      }
      const Token word = ep->Peek();
      if (word.kind != Token::kName) Fail(JinjaError::kSyntax, word.pos, "expected a statement name");
      if (ends.contains(word.text)) {
        ep->Next();
        *end = word.text;
        if (end_parser != nullptr) *end_parser = std::move(ep);
        return body;
      }
      ep->Next();
      body.push_back(Statement(word, *ep));
    }
    if (!ends.empty()) {
      Fail(JinjaError::kSyntax, p_.empty() ? 0 : p_.back().pos,
           "unexpected end of template, expected one of: " + Join(ends));
    }
    return body;
  }

  static std::string Join(const std::set<std::string>& s) {
    std::string out;
    for (const std::string& x : s) out += (out.empty() ? "" : ", ") + x;
    return out;
  }

  static std::unique_ptr<Node> MakeNode(Node::Kind kind, int64_t pos) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->pos = pos;
    return n;
  }

  std::unique_ptr<Node> Statement(const Token& word, ExprParser& ep) {
    const std::string& w = word.text;
    if (w == "if") {
      auto n = MakeNode(Node::kIf, word.pos);
      n->conds.push_back(ep.Parse());
      ep.ExpectEnd();
      for (;;) {
        std::string end;
        std::unique_ptr<ExprParser> next;
        n->bodies.push_back(ParseBody({"elif", "else", "endif"}, &end, &next));
        if (end == "elif") {
          n->conds.push_back(next->Parse());
          next->ExpectEnd();
        } else if (end == "else") {
          next->ExpectEnd();
          n->bodies.push_back(ParseBody({"endif"}, &end, &next));
          next->ExpectEnd();
          break;
        } else {
          next->ExpectEnd();
          break;
        }
      }
      return n;
    }
    if (w == "for") {
      auto n = MakeNode(Node::kFor, word.pos);
      do {
        n->targets.push_back(ep.ExpectName());
      } while (ep.SkipOp(","));
      if (!ep.SkipName("in")) Fail(JinjaError::kSyntax, ep.Peek().pos, "expected 'in' in a for loop");
      n->expr = ep.Parse();  // a condexpr without the "if" part is what jinja takes; see below
      if (n->expr->kind == Expr::kCond && n->expr->kids[2] == nullptr) {
        // `for x in xs if cond`: the loop filter, not a conditional expression.
        n->filter = std::move(n->expr->kids[1]);
        ExprPtr iter = std::move(n->expr->kids[0]);
        n->expr = std::move(iter);
      }
      if (ep.IsName("recursive"))
        Fail(JinjaError::kUnsupported, ep.Peek().pos, "unsupported: recursive for loops");
      ep.ExpectEnd();
      std::string end;
      std::unique_ptr<ExprParser> next;
      n->bodies.push_back(ParseBody({"else", "endfor"}, &end, &next));
      next->ExpectEnd();
      if (end == "else") {
        n->bodies.push_back(ParseBody({"endfor"}, &end, &next));
        next->ExpectEnd();
      }
      return n;
    }
    if (w == "set") {
      auto n = MakeNode(Node::kSet, word.pos);
      n->targets.push_back(ep.ExpectName());
      if (ep.SkipOp(".")) {
        n->attr = ep.ExpectName();
      } else {
        while (ep.SkipOp(",")) n->targets.push_back(ep.ExpectName());
      }
      if (ep.AtEnd() && n->attr.empty() && n->targets.size() == 1) {
        n->kind = Node::kSetBlock;
        std::string end;
        std::unique_ptr<ExprParser> next;
        n->bodies.push_back(ParseBody({"endset"}, &end, &next));
        next->ExpectEnd();
        return n;
      }
      ep.ExpectOp("=");
      n->expr = ep.TupleOrExpr();
      ep.ExpectEnd();
      return n;
    }
    if (w == "macro") {
      auto n = MakeNode(Node::kMacro, word.pos);
      n->text = ep.ExpectName();
      ep.ExpectOp("(");
      while (!ep.SkipOp(")")) {
        if (!n->params.empty()) ep.ExpectOp(",");
        n->params.push_back(ep.ExpectName());
        n->defaults.push_back(ep.SkipOp("=") ? ep.Parse() : nullptr);
      }
      ep.ExpectEnd();
      std::string end;
      std::unique_ptr<ExprParser> next;
      n->bodies.push_back(ParseBody({"endmacro"}, &end, &next));
      if (next->Peek().kind == Token::kName) next->Next();  // {% endmacro name %}
      next->ExpectEnd();
      return n;
    }
    if (w == "break" || w == "continue") {
      ep.ExpectEnd();
      return MakeNode(w == "break" ? Node::kBreak : Node::kContinue, word.pos);
    }
    if (w == "generation") {
      ep.ExpectEnd();
      auto n = MakeNode(Node::kBody, word.pos);
      std::string end;
      std::unique_ptr<ExprParser> next;
      n->bodies.push_back(ParseBody({"endgeneration"}, &end, &next));
      next->ExpectEnd();
      return n;
    }
    static const std::set<std::string> kEnds = {"endif", "endfor", "endset",       "endmacro",
                                                "elif",  "else",   "endgeneration"};
    if (kEnds.contains(w)) Fail(JinjaError::kSyntax, word.pos, "unexpected '" + w + "'");
    Fail(JinjaError::kUnsupported, word.pos, "unsupported tag '" + w + "'");
  }

  std::vector<Piece> p_;
  size_t k_ = 0;
};

}  // namespace

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

Body Parse(const std::string& raw) {
  // jinja2 reads the source line by line: \r\n and \r become \n, and (keep_trailing_newline off)
  // one trailing newline is dropped.
  std::string source;
  for (size_t k = 0; k < raw.size(); ++k) {
    if (raw[k] == '\r') {
      source += '\n';
      if (k + 1 < raw.size() && raw[k + 1] == '\n') ++k;
    } else {
      source += raw[k];
    }
  }
  if (!source.empty() && source.back() == '\n') source.pop_back();
  return Parser(SplitTags(source)).ParseAll();
}

std::pair<int, int> LineColumn(const std::string& source, int64_t pos) {
  int line = 1, col = 1;
  for (int64_t k = 0; k < pos && k < static_cast<int64_t>(source.size()); ++k) {
    if (source[k] == '\n') {
      ++line;
      col = 1;
    } else if ((static_cast<unsigned char>(source[k]) & 0xc0) != 0x80) {
      ++col;
    }
  }
  return {line, col};
}

}  // namespace tandem::jinja
