// libsentencepiece behind a plain interface (internal). Debian 12's sentencepiece_processor.h
// declares absl::string_view as std::string_view, which clashes with Debian's Abseil, so only
// sp_bridge.cc includes it and this header includes no Abseil.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace tandem::tokenizer::internal {

class SpModel {
 public:
  virtual ~SpModel() = default;
  // nullptr and *error set when the file cannot be loaded.
  static std::unique_ptr<SpModel> Load(const std::string& path, std::string* error);
  virtual std::vector<int> Encode(const std::string& text) const = 0;
  virtual std::string Decode(const std::vector<int>& ids) const = 0;
  virtual int Size() const = 0;
  virtual std::string IdToPiece(int id) const = 0;
  virtual int PieceToId(const std::string& piece) const = 0;  // unk id when absent
  virtual bool IsControl(int id) const = 0;
  virtual bool IsByte(int id) const = 0;
  virtual bool IsUnknown(int id) const = 0;
  virtual int bos_id() const = 0;  // -1 when the model has none
  virtual int eos_id() const = 0;
};

}  // namespace tandem::tokenizer::internal
