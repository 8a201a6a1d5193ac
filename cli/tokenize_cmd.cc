// `tandem tokenize` and `tandem detokenize`: the model's own tokenizer (text::TextModel) from the
// command line, for debugging prompts: text -> ids (with each id's token), ids -> text.
#include <iostream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "cli/prompts.h"
#include "common/status.h"
#include "nlohmann/json.hpp"
#include "text/text_model.h"

namespace tandem::cli {

namespace {

struct TokenizeArgs {
  std::string model, text, chat, ids;
  bool no_special = false, json = false;
};

absl::Status RunTokenize(const TokenizeArgs& a) {
  ASSIGN_OR_RETURN(std::unique_ptr<text::TextModel> tm, text::TextModel::Load(a.model));
  std::string input = a.text;
  if (input.empty() && a.chat.empty()) input.assign(std::istreambuf_iterator<char>(std::cin), {});
  std::vector<int32_t> ids;
  if (!a.chat.empty()) {
    ASSIGN_OR_RETURN(const std::string rendered, tm->RenderChat({{"user", a.chat}}));
    if (!a.json) std::cout << "rendered chat:\n" << rendered << "\n";
    ASSIGN_OR_RETURN(ids, tm->tokenizer().Encode(rendered, /*add_special=*/false));
  } else {
    ASSIGN_OR_RETURN(ids, tm->tokenizer().Encode(input, /*add_special=*/!a.no_special));
  }
  if (a.json) {
    nlohmann::json tokens = nlohmann::json::array();
    for (int32_t id : ids) tokens.push_back(tm->tokenizer().IdToToken(id).value_or(""));
    std::cout << nlohmann::json{{"ids", ids}, {"tokens", tokens}}.dump() << "\n";
    return absl::OkStatus();
  }
  std::cout << ids.size() << " tokens: " << absl::StrJoin(ids, ",") << "\n";
  for (int32_t id : ids) {
    std::cout << "  " << id << "\t" << nlohmann::json(tm->tokenizer().IdToToken(id).value_or("")).dump()
              << (tm->tokenizer().IsSpecial(id) ? "\t(special)" : "") << "\n";
  }
  return absl::OkStatus();
}

absl::Status RunDetokenize(const TokenizeArgs& a) {
  ASSIGN_OR_RETURN(std::unique_ptr<text::TextModel> tm, text::TextModel::Load(a.model));
  absl::StatusOr<std::vector<int32_t>> ids = ParseIdList(a.ids);
  if (!ids.ok()) return Annotate(ids.status(), "--ids");
  ASSIGN_OR_RETURN(const std::string text, tm->tokenizer().Decode(*ids, /*skip_special=*/a.no_special));
  std::cout << text << "\n";
  return absl::OkStatus();
}

}  // namespace

void AddTokenizeCommands(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* t = app.add_subcommand(
      "tokenize",
      "Encode text with the model's tokenizer (a GGUF file or a checkpoint directory) and list the ids\n"
      "and tokens. Example: tandem tokenize --model SmolLM2-135M-Instruct.Q4_1.gguf --text 'Hello, world'");
  t->add_option("--model", a->model, "GGUF file or checkpoint directory that ships a tokenizer")->required();
  auto* text = t->add_option("--text", a->text, "the text (default: standard input)");
  t->add_option("--chat", a->chat, "a user message: render the chat template, then encode it")
      ->excludes(text);
  t->add_flag("--no-special", a->no_special, "do not add BOS or other special tokens");
  t->add_flag("--json", a->json, "print {\"ids\": [...], \"tokens\": [...]}");
  t->callback([a] {
    if (absl::Status st = RunTokenize(*a); !st.ok()) Fail("tokenize", st);
  });
  auto b = std::make_shared<TokenizeArgs>();
  CLI::App* d = app.add_subcommand("detokenize", "Decode token ids with the model's tokenizer");
  d->add_option("--model", b->model, "GGUF file or checkpoint directory that ships a tokenizer")->required();
  d->add_option("--ids", b->ids, "comma-separated token ids")->required();
  d->add_flag("--no-special", b->no_special, "leave special tokens out");
  d->callback([b] {
    if (absl::Status st = RunDetokenize(*b); !st.ok()) Fail("detokenize", st);
  });
}

}  // namespace tandem::cli
