// Reader (memory-mapped) and writer of the safetensors format:
//   8 bytes little-endian u64 N | N bytes of JSON header | data
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end)} relative to
// the data section; "__metadata__" holds string pairs. Nothing in a file is trusted: the header
// length, JSON, dtypes, shapes and offsets are checked (in range, size = product(shape) · element
// size, no two tensors overlapping) before any tensor is exposed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace tandem {

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;        // as written in the file: "BF16", "F16", "F32", "I64", ...
  std::optional<DType> dtype;    // set for the float types tandem loads (BF16, F16, F32)
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr; // into the mapping; valid while the file object lives
  int64_t nbytes = 0;
};

// A safetensors file mapped read-only. Thread-safe for concurrent reads.
class SafetensorsFile {
 public:
  // Errors name `path` and, where one is at fault, the tensor: DataLoss for a truncated or
  // corrupt file, InvalidArgument for a malformed header, NotFound for a missing file.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: `bytes` holds product(shape) elements of `dtype_name`.
struct SafetensorsWriteItem {
  std::string name;
  std::string dtype_name;  // "BF16", "F16", "F32", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};
// Writes a well-formed file (used by tests and tools). Errors name the path.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace tandem
