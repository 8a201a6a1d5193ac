// Chat templates: the Jinja template a checkpoint ships (tokenizer_config.json's chat_template, a
// GGUF's tokenizer.chat_template) turned into a prompt string, by an interpreter of our own for the
// subset of Jinja that chat templates use.
//
// Contract: Render(messages, add_generation_prompt) equals what Hugging Face transformers'
// apply_chat_template(tokenize=False) produces with Python's jinja2 for the same template and
// variables, i.e. jinja2's ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with
// the loopcontrols extension, autoescape off, keep_trailing_newline off, and the variables
//   messages               a list of {"role": ..., "content": ...} (strings)
//   add_generation_prompt  bool
//   bos_token, eos_token   strings (LoadOptions)
//   tools                  none (also documents)
//   raise_exception(msg)   a function that fails the render with `msg`
//   strftime_now(fmt)      the time formatted by strftime, as transformers' datetime.now()
//                          (local time), or LoadOptions::fixed_time (UTC) when set.
//
// Supported Jinja:
//   {{ expr }}, {% stmt %}, {# comment #}, whitespace control ({%- -%}, {{- -}}, {#- -#}, and {%+ to
//     keep lstrip_blocks off one tag);
//   statements: if/elif/else, for (tuple unpacking, an `if` filter, else, loop.index, index0,
//     revindex, revindex0, first, last, length, previtem, nextitem), break, continue, set (a name,
//     several names, ns.attr, and {% set x %}...{% endset %}), macro (positional and keyword
//     arguments with defaults) and calls of macros, generation/endgeneration (HF's assistant mask
//     marker: renders its body);
//   expressions: literals (strings, ints, floats, true/false/none in either case, lists, dicts,
//     tuples), names, attribute access, subscripts, slicing with steps, calls, filters with
//     arguments, tests (is [not] defined, undefined, none, string, number, integer, float, boolean,
//     mapping, iterable, sequence, callable, true, false, even, odd, divisibleby, eq/equalto/==,
//     ne, lt, le, gt, ge, in, sameas, lower, upper), not/and/or, in/not in, chained == != < <= > >=,
//     + - * / // % **, ~, unary - and +, a if c else b;
//   filters: trim, length/count, tojson (indent=; as transformers' override: no HTML escaping,
//     non-ASCII kept, keys in insertion order), upper, lower, capitalize, title, default/d (with
//     the boolean flag), first, last, join (attribute=), replace, string, int, float, abs, round,
//     items, dictsort, list, reverse, sort (reverse, case_sensitive, attribute), unique, min, max,
//     sum, selectattr/rejectattr (attribute and optional test), select/reject (a test), map
//     (attribute= or a filter name), indent, batch, wordcount, safe, e/escape;
//   methods: strings strip/lstrip/rstrip (chars), startswith, endswith (a string or a tuple),
//     split, rsplit (sep, maxsplit), upper, lower, title, capitalize, replace, find, rfind, index,
//     count, join, isdigit, isalpha, isspace, islower, isupper; dicts get, items, keys, values;
//     lists index, count;
//   globals: raise_exception, namespace(...), range(...), dict(...).
// Case mapping (upper, lower, title, capitalize) covers ASCII, Latin-1, Greek and Cyrillic; other
// scripts are left as they are.
// Anything else (another tag such as include/extends/block/call/filter/raw, an unknown filter,
// test or method, a syntax error) is refused at Load with the construct and its line and column.
// Strings are UTF-8; length, indexing and slicing count code points as Python does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem {

struct ChatMessage {
  std::string role;     // "system", "user", "assistant", ...
  std::string content;  // the message text
};

class ChatTemplate {
 public:
  struct LoadOptions {
    std::string bos_token;
    std::string eos_token;
    // Seconds since the epoch that strftime_now formats (as UTC); -1: the current local time.
    int64_t fixed_time = -1;
  };
  // Parses `source`. Errors are InvalidArgument ("chat template: line 3, column 12: ...") for a
  // syntax error and Unimplemented naming the unsupported construct and its position.
  static absl::StatusOr<ChatTemplate> Load(const std::string& source, const LoadOptions& options);

  // Renders the template (see the contract above). A template that calls raise_exception fails
  // with InvalidArgument "chat template raised: <message>"; a runtime error (a type error, an
  // unsupported operation on these values) is InvalidArgument naming its line and column.
  absl::StatusOr<std::string> Render(const std::vector<ChatMessage>& messages,
                                     bool add_generation_prompt) const;

  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  struct Impl;

 private:
  explicit ChatTemplate(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
