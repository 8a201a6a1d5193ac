#include "tokenizer/sp_bridge.h"

#include <sentencepiece_processor.h>

namespace tandem::tokenizer::internal {
namespace {

class SpModelImpl final : public SpModel {
 public:
  sentencepiece::SentencePieceProcessor sp;
  std::vector<int> Encode(const std::string& text) const override {
    std::vector<int> ids;
    if (!sp.Encode(text, &ids).ok()) ids.clear();
    return ids;
  }
  std::string Decode(const std::vector<int>& ids) const override {
    std::string out;
    if (!sp.Decode(ids, &out).ok()) out.clear();
    return out;
  }
  int Size() const override { return sp.GetPieceSize(); }
  std::string IdToPiece(int id) const override { return sp.IdToPiece(id); }
  int PieceToId(const std::string& piece) const override { return sp.PieceToId(piece); }
  bool IsControl(int id) const override { return sp.IsControl(id); }
  bool IsByte(int id) const override { return sp.IsByte(id); }
  bool IsUnknown(int id) const override { return sp.IsUnknown(id); }
  int bos_id() const override { return sp.bos_id(); }
  int eos_id() const override { return sp.eos_id(); }
};

}  // namespace

std::unique_ptr<SpModel> SpModel::Load(const std::string& path, std::string* error) {
  auto m = std::make_unique<SpModelImpl>();
  sentencepiece::util::Status st = m->sp.Load(path);
  if (!st.ok()) {
    *error = st.ToString();
    return nullptr;
  }
  return m;
}

}  // namespace tandem::tokenizer::internal
