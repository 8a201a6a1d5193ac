// A whole regular file mapped read-only into memory, for the checkpoint loaders (safetensors,
// GGUF): tensors are read straight from the mapping. Errors name the path: NotFound (or the
// errno of open/fstat/mmap) for a file that cannot be mapped, InvalidArgument for a path that is
// not a regular file. An empty file maps to data() == nullptr, size() == 0.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace tandem {

class MappedFile {
 public:
  static absl::StatusOr<MappedFile> Open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }

 private:
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace tandem
