#include "chat/chat_template.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "chat/jinja.h"

namespace tandem {

struct ChatTemplate::Impl {
  std::string source;  // as parsed: newlines normalized
  jinja::Body body;
  LoadOptions options;
};

namespace {

std::string Where(const std::string& source, int64_t pos) {
  if (pos < 0) return "";
  const auto [line, col] = jinja::LineColumn(source, pos);
  return absl::StrCat("line ", line, ", column ", col, ": ");
}

std::string Normalize(const std::string& raw) {
  std::string s;
  for (size_t k = 0; k < raw.size(); ++k) {
    if (raw[k] == '\r') {
      s += '\n';
      if (k + 1 < raw.size() && raw[k + 1] == '\n') ++k;
    } else {
      s += raw[k];
    }
  }
  return s;
}

}  // namespace

ChatTemplate::ChatTemplate(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;
ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<ChatTemplate> ChatTemplate::Load(const std::string& source, const LoadOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->source = Normalize(source);
  impl->options = options;
  try {
    impl->body = jinja::Parse(impl->source);
  } catch (const jinja::JinjaError& e) {
    const std::string msg = absl::StrCat("chat template: ", Where(impl->source, e.pos), e.message);
    if (e.kind == jinja::JinjaError::kUnsupported) return absl::UnimplementedError(msg);
    return absl::InvalidArgumentError(msg);
  }
  return ChatTemplate(std::move(impl));
}

absl::StatusOr<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                                 bool add_generation_prompt) const {
  using jinja::Value;
  std::map<std::string, Value> globals;
  Value list = Value::MakeList();
  for (const ChatMessage& m : messages) {
    Value d = Value::MakeDict();
    d.dict->Set("role", Value::Str(m.role));
    d.dict->Set("content", Value::Str(m.content));
    list.list->push_back(std::move(d));
  }
  globals["messages"] = std::move(list);
  globals["add_generation_prompt"] = Value::Bool(add_generation_prompt);
  globals["bos_token"] = Value::Str(impl_->options.bos_token);
  globals["eos_token"] = Value::Str(impl_->options.eos_token);
  globals["tools"] = Value::None();
  globals["documents"] = Value::None();
  for (const char* f : {"raise_exception", "namespace", "range", "dict", "strftime_now"}) {
    globals[f] = Value::Builtin(f);
  }
  if (impl_->options.fixed_time >= 0)
    globals[std::string(jinja::kFixedTimeVariable)] = Value::Int(impl_->options.fixed_time);
  try {
    return jinja::Render(impl_->body, globals);
  } catch (const jinja::JinjaError& e) {
    if (e.kind == jinja::JinjaError::kRaised) {
      return absl::InvalidArgumentError(absl::StrCat("chat template raised: ", e.message));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("chat template: ", Where(impl_->source, e.pos), e.message));
  }
}

}  // namespace tandem
