// tokenizer.model (SentencePiece) behind the Tokenizer interface.
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "tokenizer/sp_bridge.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace tandem::tokenizer {
namespace {

class SpTokenizer final : public Tokenizer {
 public:
  explicit SpTokenizer(std::unique_ptr<internal::SpModel> m) : m_(std::move(m)) {
    if (m_->bos_id() >= 0) bos_id_ = m_->bos_id();
    if (m_->eos_id() >= 0) eos_id_ = m_->eos_id();
    for (int i = 0; i < m_->Size(); ++i) {
      if (m_->IsControl(i) && !m_->IdToPiece(i).empty()) control_.emplace_back(i, m_->IdToPiece(i));
    }
  }

  absl::StatusOr<std::vector<TokenId>> Encode(std::string_view text, bool add_special) const override {
    RETURN_IF_ERROR(ValidateUtf8(text));
    std::vector<TokenId> ids;
    if (add_special && bos_id_) ids.push_back(*bos_id_);
    // Control pieces (<s>, </s>) in the text are special tokens; the text between goes to the model.
    size_t seg = 0, i = 0;
    while (i < text.size()) {
      const std::pair<int, std::string>* best = nullptr;
      for (const auto& c : control_) {
        if (text.compare(i, c.second.size(), c.second) == 0 &&
            (!best || c.second.size() > best->second.size())) {
          best = &c;
        }
      }
      if (!best) {
        ++i;
        continue;
      }
      if (i > seg) Append(text.substr(seg, i - seg), &ids);
      ids.push_back(best->first);
      seg = i = i + best->second.size();
    }
    if (seg < text.size()) Append(text.substr(seg), &ids);
    return ids;
  }

  absl::StatusOr<std::string> Decode(std::span<const TokenId> ids, bool skip_special) const override {
    std::string out;
    std::vector<int> run;
    for (TokenId id : ids) {
      RETURN_IF_ERROR(Check(id));
      if (m_->IsControl(id)) {
        if (skip_special) continue;  // as sentencepiece: the text around it decodes as one
        out += m_->Decode(run);
        run.clear();
        out += m_->IdToPiece(id);
      } else {
        run.push_back(id);
      }
    }
    out += m_->Decode(run);
    return out;
  }

  absl::StatusOr<std::string> DecodeBytes(std::span<const TokenId> ids, bool skip_special) const override {
    std::string out;
    bool first = true;
    for (TokenId id : ids) {
      RETURN_IF_ERROR(Check(id));
      std::string piece = m_->IdToPiece(id);
      if (m_->IsControl(id)) {
        if (!skip_special) {
          out += piece;
          first = true;
        }
        continue;
      }
      if (m_->IsByte(id)) {
        out += static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16));
      } else if (m_->IsUnknown(id)) {
        out += " \xE2\x81\x87 ";  // what sentencepiece prints for unk
      } else {
        std::string text;
        for (size_t p = 0; p < piece.size();) {
          if (piece.compare(p, 3, "\xE2\x96\x81") == 0) {
            text += ' ';
            p += 3;
          } else {
            text += piece[p++];
          }
        }
        if (first && !text.empty() && text[0] == ' ') text.erase(0, 1);
        out += text;
      }
      first = false;
    }
    return out;
  }

  int32_t vocab_size() const override { return m_->Size(); }
  std::optional<TokenId> TokenToId(std::string_view token) const override {
    int id = m_->PieceToId(std::string(token));
    if (m_->IsUnknown(id) && m_->IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  std::optional<std::string> IdToToken(TokenId id) const override {
    if (id < 0 || id >= m_->Size()) return std::nullopt;
    return m_->IdToPiece(id);
  }
  bool IsSpecial(TokenId id) const override { return id >= 0 && id < m_->Size() && m_->IsControl(id); }

 private:
  absl::Status Check(TokenId id) const {
    if (id < 0 || id >= m_->Size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is not in the vocabulary (size ", m_->Size(), ")"));
    }
    return absl::OkStatus();
  }
  void Append(std::string_view text, std::vector<TokenId>* ids) const {
    std::vector<int> v = m_->Encode(std::string(text));
    ids->insert(ids->end(), v.begin(), v.end());
  }

  std::unique_ptr<internal::SpModel> m_;
  std::vector<std::pair<int, std::string>> control_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path) {
  std::string error;
  std::unique_ptr<internal::SpModel> m = internal::SpModel::Load(path, &error);
  if (!m) return absl::InvalidArgumentError(absl::StrCat(path, ": ", error));
  return std::unique_ptr<Tokenizer>(new SpTokenizer(std::move(m)));
}

}  // namespace tandem::tokenizer
