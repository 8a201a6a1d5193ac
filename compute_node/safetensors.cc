#include "compute_node/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "nlohmann/json.hpp"

namespace tandem {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;

struct DTypeInfo {
  const char* name;
  int64_t size;
  std::optional<DType> dtype;
};
constexpr DTypeInfo kDTypes[] = {
    {"BF16", 2, DType::kBF16},    {"F16", 2, DType::kF16},      {"F32", 4, DType::kF32},
    {"F64", 8, std::nullopt},     {"I64", 8, std::nullopt},     {"I32", 4, std::nullopt},
    {"I16", 2, std::nullopt},     {"I8", 1, std::nullopt},      {"U64", 8, std::nullopt},
    {"U32", 4, std::nullopt},     {"U16", 2, std::nullopt},     {"U8", 1, std::nullopt},
    {"BOOL", 1, std::nullopt},    {"F8_E4M3", 1, std::nullopt}, {"F8_E5M2", 1, std::nullopt},
    {"F8_E8M0", 1, std::nullopt}, {"C64", 8, std::nullopt},
};

const DTypeInfo* FindDType(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (name == info.name) return &info;
  }
  return nullptr;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

// Product of `shape` times `elem_size`, or nullopt on int64 overflow.
std::optional<int64_t> ByteSize(const std::vector<int64_t>& shape, int64_t elem_size) {
  int64_t n = elem_size;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

std::optional<uint64_t> AsU64(const Json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

struct Range {
  uint64_t begin, end;
  const std::string* name;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto bad = [&path](auto&&... msg) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg...)); };
  auto lost = [&path](auto&&... msg) { return absl::DataLossError(absl::StrCat(path, ": ", msg...)); };
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  ASSIGN_OR_RETURN(file->map_, MappedFile::Open(path));
  const uint64_t file_size = file->map_.size();
  if (file_size < 8) {
    return lost("file of ", file_size,
                " bytes is too short for a safetensors file (the header length alone is 8 bytes)");
  }
  const uint8_t* bytes = file->map_.data();

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > file_size - 8) {
    return lost("header length ", header_len, " runs past the end of the file of size ", file_size);
  }
  if (header_len > kMaxHeaderBytes) {
    return bad("header length ", header_len, " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  }
  const uint8_t* data = bytes + 8 + header_len;
  const uint64_t data_size = file_size - 8 - header_len;

  Json header;
  try {
    header = Json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const Json::exception& e) {
    return bad("header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) return bad("header is not a JSON object");

  std::vector<Range> ranges;
  try {
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) return bad("__metadata__ is not an object of strings");
        for (const auto& [key, value] : entry.items()) {
          if (!value.is_string()) {
            return bad("__metadata__: value of '", key, "' is not a string");
          }
          file->metadata_[key] = value.get<std::string>();
        }
        continue;
      }
      auto where = [&name](auto&&... msg) { return absl::StrCat("tensor '", name, "': ", msg...); };
      if (!entry.is_object()) return bad(where("entry is not an object"));
      SafetensorsTensor t;
      t.name = name;
      auto dtype = entry.find("dtype");
      if (dtype == entry.end() || !dtype->is_string() || dtype->get<std::string>().empty()) {
        return bad(where("'dtype' is missing or not a string"));
      }
      t.dtype_name = dtype->get<std::string>();
      auto shape = entry.find("shape");
      if (shape == entry.end() || !shape->is_array()) {
        return bad(where("'shape' is missing or not an array"));
      }
      for (const Json& d : *shape) {
        std::optional<uint64_t> v = AsU64(d);
        if (!v.has_value() || *v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          return bad(where("shape ", shape->dump(),
                           " has a dimension that is not a non-negative "
                           "integer"));
        }
        t.shape.push_back(static_cast<int64_t>(*v));
      }
      auto offsets = entry.find("data_offsets");
      std::optional<uint64_t> begin, end;
      if (offsets != entry.end() && offsets->is_array() && offsets->size() == 2) {
        begin = AsU64((*offsets)[0]);
        end = AsU64((*offsets)[1]);
      }
      if (!begin.has_value() || !end.has_value()) {
        return bad(
            where("'data_offsets' is missing or not [begin, end] with non-negative "
                  "integers"));
      }
      if (*end < *begin) {
        return bad(where("data_offsets [", *begin, ", ", *end, "] end before they begin"));
      }
      if (*end > data_size) {
        return lost(where("data_offsets [", *begin, ", ", *end, "] run past the end of the data section (",
                          data_size, " bytes); the file is truncated or corrupt"));
      }
      t.nbytes = static_cast<int64_t>(*end - *begin);
      if (const DTypeInfo* info = FindDType(t.dtype_name)) {
        t.dtype = info->dtype;
        std::optional<int64_t> expected = ByteSize(t.shape, info->size);
        if (!expected.has_value()) {
          return bad(where("shape ", ShapeString(t.shape), " overflows 64-bit byte counts"));
        }
        if (*expected != t.nbytes) {
          return bad(where("data_offsets [", *begin, ", ", *end, "] hold ", t.nbytes, " bytes, but shape ",
                           ShapeString(t.shape), " of ", t.dtype_name, " needs ", *expected));
        }
      }
      t.data = data + *begin;
      auto [it, inserted] = file->tensors_.emplace(name, std::move(t));
      ranges.push_back({*begin, *end, &it->first});
    }
  } catch (const Json::exception& e) {
    return bad("malformed header: ", e.what());
  }

  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Empty ranges hold no bytes and cannot overlap anything.
  const Range* last = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (last != nullptr && r.begin < last->end) {
      return bad("tensors '", *last->name, "' [", last->begin, ", ", last->end, ") and '", *r.name, "' [",
                 r.begin, ", ", r.end, ") overlap");
    }
    if (last == nullptr || r.end > last->end) last = &r;
  }
  return file;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsWriteItem>& items,
                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const SafetensorsWriteItem& item : items) {
    auto bad = [&](auto&&... msg) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", item.name, "': ", msg...));
    };
    if (item.name == "__metadata__" || !names.insert(item.name).second) {
      return bad("name is reserved or used twice");
    }
    for (int64_t d : item.shape) {
      if (d < 0) return bad("negative dimension in shape ", ShapeString(item.shape));
    }
    if (const DTypeInfo* info = FindDType(item.dtype_name)) {
      std::optional<int64_t> expected = ByteSize(item.shape, info->size);
      if (!expected.has_value() || static_cast<uint64_t>(*expected) != item.bytes.size()) {
        return bad(item.bytes.size(), " bytes given, but shape ", ShapeString(item.shape), " of ",
                   item.dtype_name, " needs ", expected.value_or(-1));
      }
    } else if (item.dtype_name.empty()) {
      return bad("empty dtype name");
    }
    header[item.name] = {{"dtype", item.dtype_name},
                         {"shape", item.shape},
                         {"data_offsets", {offset, offset + item.bytes.size()}}};
    offset += item.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);

  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, absl::StrCat("open(", path, ")"));
  auto write_all = [&](const void* p, size_t n) -> absl::Status {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) return ErrnoToStatus(errno, absl::StrCat("write(", path, ")"));
      c += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  };
  absl::Status status = write_all(prefix.data(), prefix.size());
  if (status.ok()) status = write_all(text.data(), text.size());
  for (const SafetensorsWriteItem& item : items) {
    if (status.ok()) status = write_all(item.bytes.data(), item.bytes.size());
  }
  if (::close(fd) != 0 && status.ok()) {
    status = ErrnoToStatus(errno, absl::StrCat("close(", path, ")"));
  }
  return status;
}

}  // namespace tandem
