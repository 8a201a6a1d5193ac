// The chat-template interpreter against Python's jinja2: every case of
// tests/data/chat_templates/reference.json (written by tests/reference/make_chat_reference.py)
// renders to the same text, or fails where jinja2 fails (with raise_exception's message); and
// templates using what the interpreter does not support are refused at load, naming it.
#include "chat/chat_template.h"

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

using ::testing::HasSubstr;

std::string SourceDir() {
  const char* d = std::getenv("TANDEM_SOURCE_DIR");
  return d != nullptr ? d : ".";
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ChatTemplate, MatchesJinja2OnEveryReferenceCase) {
  const std::string dir = SourceDir() + "/tests/data/chat_templates/";
  const std::string text = ReadText(dir + "reference.json");
  ASSERT_FALSE(text.empty()) << dir << "reference.json";
  const nlohmann::json ref = nlohmann::json::parse(text);
  const ChatTemplate::LoadOptions options{ref["bos_token"].get<std::string>(),
                                          ref["eos_token"].get<std::string>(),
                                          ref["fixed_time"].get<int64_t>()};
  std::map<std::string, ChatTemplate> templates;
  int checked = 0;
  for (const auto& c : ref["cases"]) {
    const std::string name = c["template"].get<std::string>();
    auto it = templates.find(name);
    if (it == templates.end()) {
      absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(ReadText(dir + name), options);
      ASSERT_TRUE(t.ok()) << name << ": " << t.status();
      it = templates.emplace(name, std::move(*t)).first;
    }
    std::vector<ChatMessage> messages;
    for (const auto& m : c["messages"])
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    const bool gen = c["add_generation_prompt"].get<bool>();
    absl::StatusOr<std::string> out = it->second.Render(messages, gen);
    const std::string where =
        name + " on " + c["messages"].dump() + (gen ? " with" : " without") + " generation prompt";
    if (c.contains("output")) {
      ASSERT_TRUE(out.ok()) << where << ": " << out.status();
      EXPECT_EQ(*out, c["output"].get<std::string>()) << where;
    } else {
      ASSERT_FALSE(out.ok()) << where << " rendered:\n" << *out;
      if (c["error_kind"] == "raise") {
        EXPECT_EQ(out.status().message(), "chat template raised: " + c["error"].get<std::string>()) << where;
      }
    }
    ++checked;
  }
  EXPECT_GT(checked, 300);
  EXPECT_GE(templates.size(), 10u);
}

ChatTemplate MustLoad(const std::string& source) {
  absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(source, {"<s>", "</s>"});
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

TEST(ChatTemplate, RaiseExceptionMessage) {
  ChatTemplate t =
      MustLoad("{% if messages | length == 0 %}{{ raise_exception('no messages: ' ~ 0) }}{% endif %}ok");
  absl::StatusOr<std::string> out = t.Render({}, false);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "chat template raised: no messages: 0");
  EXPECT_EQ(*t.Render({{"user", "x"}}, false), "ok");
}

TEST(ChatTemplate, UnsupportedConstructsAreRefusedAtLoadWithPosition) {
  struct Case {
    std::string source, code_and_text;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"{% include 'other.jinja' %}", "line 1, column 4: unsupported tag 'include'",
       absl::StatusCode::kUnimplemented},
      {"a\n  {% extends 'base' %}", "line 2, column 6: unsupported tag 'extends'",
       absl::StatusCode::kUnimplemented},
      {"{% block x %}{% endblock %}", "unsupported tag 'block'", absl::StatusCode::kUnimplemented},
      {"{% filter upper %}x{% endfilter %}", "unsupported tag 'filter'", absl::StatusCode::kUnimplemented},
      {"{{ x | frobnicate }}", "line 1, column 8: unsupported filter 'frobnicate'",
       absl::StatusCode::kUnimplemented},
      {"{% if x is prime %}{% endif %}", "line 1, column 12: unsupported test 'prime'",
       absl::StatusCode::kUnimplemented},
      {"{{ messages.append(1) }}", "unsupported method 'append'", absl::StatusCode::kUnimplemented},
      {"{{ f(*args) }}", "unsupported: *args", absl::StatusCode::kUnimplemented},
      {"{% for x in y recursive %}{% endfor %}", "unsupported: recursive", absl::StatusCode::kUnimplemented},
      {"{% if x %}never closed", "unexpected end of template, expected one of: elif, else, endif",
       absl::StatusCode::kInvalidArgument},
      {"{{ 'open string }}", "line 1, column 4: string literal not closed",
       absl::StatusCode::kInvalidArgument},
      {"{{ x ", "'{{' not closed", absl::StatusCode::kInvalidArgument},
      {"{{ (1 + }}", "line 1, column 9: unexpected end of tag", absl::StatusCode::kInvalidArgument},
      {"{% endfor %}", "unexpected 'endfor'", absl::StatusCode::kInvalidArgument},
      {"{{ a ? b }}", "unexpected character '?'", absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    absl::StatusOr<ChatTemplate> t = ChatTemplate::Load(c.source, {});
    ASSERT_FALSE(t.ok()) << c.source;
    EXPECT_EQ(t.status().code(), c.code) << c.source << ": " << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(c.code_and_text)) << c.source;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr("chat template: ")) << c.source;
  }
}

TEST(ChatTemplate, RuntimeErrorsNameThePosition) {
  ChatTemplate t = MustLoad("x\n{{ messages[0].content + 1 }}");
  absl::StatusOr<std::string> out = t.Render({{"user", "hi"}}, false);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("line 2, column"));
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("unsupported operand types for +"));
  ChatTemplate u = MustLoad("{{ nothing.attr }}");
  out = u.Render({}, false);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("'nothing' is undefined"));
}

TEST(ChatTemplate, MacrosScopesAndLoopControls) {
  ChatTemplate t = MustLoad(
      "{% macro m(a, b=2) %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }} {{ m(1, b=3) }} "
      "{% set x = 'outer' %}{% for i in [1, 2] %}{% set x = 'inner' %}{% endfor %}{{ x }} "
      "{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif "
      "%}{{ i }}{% endfor %} "
      "{% for i in [] %}x{% else %}empty{% endfor %}");
  EXPECT_EQ(*t.Render({}, false), "1-2 1-3 outer 02 empty");
}

TEST(ChatTemplate, StrftimeNow) {
  absl::StatusOr<ChatTemplate> fixed =
      ChatTemplate::Load("{{ strftime_now('%Y-%m-%d %H:%M') }}", {"", "", 0});
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(*fixed->Render({}, false), "1970-01-01 00:00");
  ChatTemplate now = MustLoad("{{ strftime_now('%Y') | int > 2000 }}");
  EXPECT_EQ(*now.Render({}, false), "True");
}

}  // namespace
}  // namespace tandem
