// Reader (memory-mapped) and writer of the safetensors format:
//   8 bytes little-endian u64 N | N bytes of JSON header | data
// The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end)} relative to
// the data section; "__metadata__" holds string pairs. Nothing in a file is trusted: the header
// length, JSON, dtypes, shapes and offsets are checked (in range, size = product(shape) · element
// size, no two tensors overlapping) before any tensor is exposed.
//
// Known dtypes (sizes checked): BF16, F16, F32 (loadable), F64, I64, I32, I16, I8, U64, U32, U16,
// U8, BOOL, F8_E4M3, F8_E5M2, F8_E8M0, C64. Another dtype name is accepted with its byte range
// checked but not its size (dtype = nullopt); whoever uses the tensor rejects it. Unlike the
// reference reader, gaps between tensors and trailing bytes are tolerated.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "compute_node/mapped_file.h"

namespace tandem {

struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;      // as written in the file: "BF16", "F16", "F32", "I64", ...
  std::optional<DType> dtype;  // set for the float types tandem loads (BF16, F16, F32)
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; valid while the file object lives; may be
                                  // unaligned for its dtype (offsets need not be multiples)
  int64_t nbytes = 0;
};

// A safetensors file mapped read-only. Thread-safe for concurrent reads.
class SafetensorsFile {
 public:
  // Errors name `path` and, where one is at fault, the tensor: DataLoss for a truncated or
  // corrupt file (under 8 bytes, header length past the end, data_offsets past the end),
  // InvalidArgument for a malformed header (length over 100 MB, not a JSON object, bad dtype,
  // shape, data_offsets or __metadata__, size not matching the shape, overlapping tensors),
  // NotFound for a missing file.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  MappedFile map_;
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
// Writes a well-formed file (used by tests and tools): tensors in the given order, contiguous,
// the JSON header padded with spaces to a multiple of 8 bytes as the reference writer does.
// Items whose bytes do not match shape and (known) dtype, or repeated names, are InvalidArgument
// before anything is written. Errors name the path.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace tandem
