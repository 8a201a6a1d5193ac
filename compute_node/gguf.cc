#include "compute_node/gguf.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/dtype.h"
#include "common/status.h"

namespace tandem {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr int kMaxArrayDepth = 8;
constexpr uint32_t kMaxDims = 4;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ","), "]");
}

struct TypeInfo {
  uint32_t id;
  const char* name;
  int64_t block;  // elements per block
  int64_t bytes;  // bytes per block
};
// ggml's types (ggml.h), for names in errors; only the loadable ones are ever sized.
constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4},      {1, "F16", 1, 2},     {2, "Q4_0", 32, 18},   {3, "Q4_1", 32, 20},
    {6, "Q5_0", 32, 22},   {7, "Q5_1", 32, 24},  {8, "Q8_0", 32, 34},   {9, "Q8_1", 32, 36},
    {10, "Q2_K", 0, 0},    {11, "Q3_K", 0, 0},   {12, "Q4_K", 0, 0},    {13, "Q5_K", 0, 0},
    {14, "Q6_K", 0, 0},    {15, "Q8_K", 0, 0},   {16, "IQ2_XXS", 0, 0}, {17, "IQ2_XS", 0, 0},
    {18, "IQ3_XXS", 0, 0}, {19, "IQ1_S", 0, 0},  {20, "IQ4_NL", 0, 0},  {21, "IQ3_S", 0, 0},
    {22, "IQ2_S", 0, 0},   {23, "IQ4_XS", 0, 0}, {24, "I8", 0, 0},      {25, "I16", 0, 0},
    {26, "I32", 0, 0},     {27, "I64", 0, 0},    {28, "F64", 0, 0},     {29, "IQ1_M", 0, 0},
    {30, "BF16", 1, 2},    {34, "TQ1_0", 0, 0},  {35, "TQ2_0", 0, 0},   {39, "MXFP4", 0, 0},
};
const TypeInfo* FindType(uint32_t id) {
  for (const TypeInfo& t : kTypes) {
    if (t.id == id) return &t;
  }
  return nullptr;
}

float F16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToFloat(h);
}

// Bounds-checked little-endian reader over the mapping.
class Cursor {
 public:
  Cursor(const std::string& path, const uint8_t* data, size_t size) : path_(path), data_(data), size_(size) {}
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  absl::Status Need(uint64_t n, const std::string& what) const {
    if (n > remaining()) {
      return absl::DataLossError(absl::StrCat(path_, ": truncated: ", what, " needs ", n, " bytes at offset ",
                                              pos_, ", but the file has ", size_));
    }
    return absl::OkStatus();
  }
  template <typename T>
  absl::StatusOr<T> Read(const std::string& what) {
    RETURN_IF_ERROR(Need(sizeof(T), what));
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  absl::StatusOr<std::string> ReadString(const std::string& what) {
    ASSIGN_OR_RETURN(uint64_t n, Read<uint64_t>(what));
    RETURN_IF_ERROR(Need(n, what));
    std::string s(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const std::string& path_;
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

size_t ScalarSize(GgufType t) {
  switch (t) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
    case GgufType::kString:  // at least its length
    case GgufType::kArray:   // at least type + count... a lower bound is enough
      return 8;
  }
  return 1;
}

absl::Status lost_count(const std::string& path, const std::string& what, uint64_t n) {
  return absl::DataLossError(
      absl::StrCat(path, ": truncated: ", n, " ", what, " entries cannot fit in the file"));
}

bool ValidType(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::kF64); }

absl::StatusOr<GgufValue> ReadValue(Cursor& c, GgufType type, const std::string& path, const std::string& key,
                                    int depth) {
  GgufValue v;
  v.type = type;
  const std::string what = absl::StrCat("key '", key, "'");
  switch (type) {
    case GgufType::kU8: {
      ASSIGN_OR_RETURN(uint8_t x, c.Read<uint8_t>(what));
      v.i = x;
      v.u = x;
      break;
    }
    case GgufType::kI8: {
      ASSIGN_OR_RETURN(int8_t x, c.Read<int8_t>(what));
      v.i = x;
      v.u = static_cast<uint64_t>(x);
      break;
    }
    case GgufType::kU16: {
      ASSIGN_OR_RETURN(uint16_t x, c.Read<uint16_t>(what));
      v.i = x;
      v.u = x;
      break;
    }
    case GgufType::kI16: {
      ASSIGN_OR_RETURN(int16_t x, c.Read<int16_t>(what));
      v.i = x;
      v.u = static_cast<uint64_t>(x);
      break;
    }
    case GgufType::kU32: {
      ASSIGN_OR_RETURN(uint32_t x, c.Read<uint32_t>(what));
      v.i = x;
      v.u = x;
      break;
    }
    case GgufType::kI32: {
      ASSIGN_OR_RETURN(int32_t x, c.Read<int32_t>(what));
      v.i = x;
      v.u = static_cast<uint64_t>(x);
      break;
    }
    case GgufType::kU64: {
      ASSIGN_OR_RETURN(uint64_t x, c.Read<uint64_t>(what));
      v.u = x;
      v.i = static_cast<int64_t>(x);
      break;
    }
    case GgufType::kI64: {
      ASSIGN_OR_RETURN(int64_t x, c.Read<int64_t>(what));
      v.i = x;
      v.u = static_cast<uint64_t>(x);
      break;
    }
    case GgufType::kF32: {
      ASSIGN_OR_RETURN(float x, c.Read<float>(what));
      v.f = x;
      break;
    }
    case GgufType::kF64: {
      ASSIGN_OR_RETURN(double x, c.Read<double>(what));
      v.f = x;
      break;
    }
    case GgufType::kBool: {
      ASSIGN_OR_RETURN(uint8_t x, c.Read<uint8_t>(what));
      if (x > 1) return absl::InvalidArgumentError(absl::StrCat(path, ": ", what, ": bool value ", x));
      v.i = x;
      v.u = x;
      break;
    }
    case GgufType::kString: {
      ASSIGN_OR_RETURN(v.s, c.ReadString(what));
      break;
    }
    case GgufType::kArray: {
      if (depth >= kMaxArrayDepth) {
        return absl::InvalidArgumentError(
            absl::StrCat(path, ": ", what, ": arrays nested deeper than ", kMaxArrayDepth));
      }
      ASSIGN_OR_RETURN(uint32_t et, c.Read<uint32_t>(what));
      if (!ValidType(et)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": ", what, ": bad array element type ", et));
      }
      v.elem_type = static_cast<GgufType>(et);
      ASSIGN_OR_RETURN(uint64_t n, c.Read<uint64_t>(what));
      const size_t min_size = ScalarSize(v.elem_type);
      if (n > c.remaining() / min_size) {
        return absl::DataLossError(absl::StrCat(path, ": truncated: ", what, ": array of ", n, " ",
                                                GgufTypeName(v.elem_type), " does not fit in the ",
                                                c.remaining(), " bytes left"));
      }
      v.array.reserve(n);
      for (uint64_t k = 0; k < n; ++k) {
        ASSIGN_OR_RETURN(GgufValue e, ReadValue(c, v.elem_type, path, key, depth + 1));
        v.array.push_back(std::move(e));
      }
      break;
    }
  }
  return v;
}

// ---- writing ------------------------------------------------------------------------------------

template <typename T>
void Put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void PutString(std::string& out, std::string_view s) {
  Put<uint64_t>(out, s.size());
  out.append(s);
}
void PutValue(std::string& out, const GgufValue& v) {
  switch (v.type) {
    case GgufType::kU8:
    case GgufType::kBool:
      Put<uint8_t>(out, static_cast<uint8_t>(v.i));
      break;
    case GgufType::kI8:
      Put<int8_t>(out, static_cast<int8_t>(v.i));
      break;
    case GgufType::kU16:
      Put<uint16_t>(out, static_cast<uint16_t>(v.i));
      break;
    case GgufType::kI16:
      Put<int16_t>(out, static_cast<int16_t>(v.i));
      break;
    case GgufType::kU32:
      Put<uint32_t>(out, static_cast<uint32_t>(v.i));
      break;
    case GgufType::kI32:
      Put<int32_t>(out, static_cast<int32_t>(v.i));
      break;
    case GgufType::kU64:
      Put<uint64_t>(out, v.u != 0 ? v.u : static_cast<uint64_t>(v.i));
      break;
    case GgufType::kI64:
      Put<int64_t>(out, v.i);
      break;
    case GgufType::kF32:
      Put<float>(out, static_cast<float>(v.f));
      break;
    case GgufType::kF64:
      Put<double>(out, v.f);
      break;
    case GgufType::kString:
      PutString(out, v.s);
      break;
    case GgufType::kArray:
      Put<uint32_t>(out, static_cast<uint32_t>(v.elem_type));
      Put<uint64_t>(out, v.array.size());
      for (const GgufValue& e : v.array) PutValue(out, e);
      break;
  }
}

// ---- llama mapping ------------------------------------------------------------------------------

struct LayerLeaf {
  const char* gguf;
  const char* hf;
};
constexpr LayerLeaf kLayerLeaves[] = {
    {"attn_norm.weight", "input_layernorm.weight"},    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},      {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"}, {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},       {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};

absl::StatusOr<int64_t> GetInt(const GgufFile& f, const std::string& key, std::optional<int64_t> fallback) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) {
    if (fallback.has_value()) return *fallback;
    return absl::NotFoundError(absl::StrCat(f.path(), ": metadata key '", key, "' is missing"));
  }
  if (!v->is_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": metadata key '", key,
                                                   "': expected an integer, got ", GgufTypeName(v->type)));
  }
  if (v->type == GgufType::kU64 && v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": metadata key '", key, "': ", v->u, " is too large"));
  }
  return v->i;
}

absl::StatusOr<double> GetFloat(const GgufFile& f, const std::string& key, double fallback) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) return fallback;
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  return absl::InvalidArgumentError(
      absl::StrCat(f.path(), ": metadata key '", key, "': expected a number, got ", GgufTypeName(v->type)));
}

}  // namespace

const char* GgufTypeName(GgufType type) {
  static constexpr const char* kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                           "bool", "string", "array", "u64", "i64", "f64"};
  const auto i = static_cast<uint32_t>(type);
  return i < std::size(kNames) ? kNames[i] : "?";
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
      return true;
    default:
      return false;
  }
}

std::string GgufValue::DebugString() const {
  if (is_array()) return absl::StrCat("[array of ", array.size(), " ", GgufTypeName(elem_type), "]");
  if (is_string()) return absl::StrCat("\"", s.size() > 60 ? s.substr(0, 60) + "..." : s, "\"");
  if (is_float()) return absl::StrCat(f);
  if (type == GgufType::kBool) return i != 0 ? "true" : "false";
  if (type == GgufType::kU64) return absl::StrCat(u);
  return absl::StrCat(i);
}

std::string GgmlTypeName(uint32_t type) {
  const TypeInfo* t = FindType(type);
  return t != nullptr ? t->name : absl::StrCat("type ", type);
}

bool IsLoadableGgmlType(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
      return true;
  }
  return false;
}

std::optional<int64_t> GgmlByteSize(uint32_t type, int64_t n) {
  if (!IsLoadableGgmlType(type) || n < 0) return std::nullopt;
  const TypeInfo* t = FindType(type);
  if (n % t->block != 0) return std::nullopt;
  int64_t bytes;
  if (__builtin_mul_overflow(n / t->block, t->bytes, &bytes)) return std::nullopt;
  return bytes;
}

absl::Status DequantizeGgml(uint32_t type, const uint8_t* data, int64_t n, float* out) {
  if (!IsLoadableGgmlType(type)) {
    return absl::UnimplementedError(absl::StrCat("ggml type ", GgmlTypeName(type), " cannot be dequantized"));
  }
  const TypeInfo* t = FindType(type);
  if (n % t->block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(n, " elements of ", t->name, " are not whole blocks of ", t->block));
  }
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      ConvertToF32(DType::kF32, data, n, out);
      break;
    case GgmlType::kF16:
      ConvertToF32(DType::kF16, data, n, out);
      break;
    case GgmlType::kBF16:
      ConvertToF32(DType::kBF16, data, n, out);
      break;
    case GgmlType::kQ8_0:
      for (int64_t b = 0; b < n / 32; ++b, data += 34, out += 32) {
        const float d = F16At(data);
        for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(static_cast<int8_t>(data[2 + j]));
      }
      break;
    case GgmlType::kQ4_0:
      for (int64_t b = 0; b < n / 32; ++b, data += 18, out += 32) {
        const float d = F16At(data);
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>((data[2 + j] & 15) - 8);
          out[j + 16] = d * static_cast<float>((data[2 + j] >> 4) - 8);
        }
      }
      break;
    case GgmlType::kQ4_1:
      for (int64_t b = 0; b < n / 32; ++b, data += 20, out += 32) {
        const float d = F16At(data), m = F16At(data + 2);
        for (int j = 0; j < 16; ++j) {
          out[j] = d * static_cast<float>(data[4 + j] & 15) + m;
          out[j + 16] = d * static_cast<float>(data[4 + j] >> 4) + m;
        }
      }
      break;
  }
  return absl::OkStatus();
}

int64_t GgufTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  auto bad = [&path](auto&&... msg) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg...)); };
  std::unique_ptr<GgufFile> file(new GgufFile);
  file->path_ = path;
  ASSIGN_OR_RETURN(file->map_, MappedFile::Open(path));
  const uint8_t* base = file->map_.data();
  const size_t size = file->map_.size();
  Cursor c(file->path_, base, size);

  ASSIGN_OR_RETURN(uint32_t magic, c.Read<uint32_t>("the magic"));
  if (magic != kMagic) return bad("not a GGUF file (bad magic)");
  ASSIGN_OR_RETURN(file->version_, c.Read<uint32_t>("the version"));
  if (file->version_ != 2 && file->version_ != 3) {
    return absl::UnimplementedError(
        absl::StrCat(path, ": GGUF version ", file->version_, " is not supported (2 and 3 are)"));
  }
  ASSIGN_OR_RETURN(uint64_t n_tensors, c.Read<uint64_t>("the tensor count"));
  ASSIGN_OR_RETURN(uint64_t n_kv, c.Read<uint64_t>("the metadata count"));
  if (n_kv > c.remaining() / 12) return lost_count(path, "metadata", n_kv);
  for (uint64_t k = 0; k < n_kv; ++k) {
    ASSIGN_OR_RETURN(std::string key, c.ReadString(absl::StrCat("metadata key ", k)));
    ASSIGN_OR_RETURN(uint32_t type, c.Read<uint32_t>(absl::StrCat("key '", key, "'")));
    if (!ValidType(type)) return bad("key '", key, "': bad value type ", type);
    ASSIGN_OR_RETURN(GgufValue v, ReadValue(c, static_cast<GgufType>(type), path, key, 0));
    if (!file->metadata_.emplace(key, std::move(v)).second) return bad("key '", key, "' appears twice");
  }
  if (const GgufValue* a = file->Find("general.alignment"); a != nullptr) {
    if (a->type != GgufType::kU32 || a->i == 0 || (a->i & (a->i - 1)) != 0) {
      return bad("key 'general.alignment': expected a u32 power of two, got ", a->DebugString());
    }
    file->alignment_ = static_cast<uint64_t>(a->i);
  }

  if (n_tensors > c.remaining() / 24) return lost_count(path, "tensor", n_tensors);
  std::vector<GgufTensor> infos;
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor t;
    ASSIGN_OR_RETURN(t.name, c.ReadString(absl::StrCat("tensor info ", k)));
    const std::string what = absl::StrCat("tensor '", t.name, "'");
    ASSIGN_OR_RETURN(uint32_t n_dims, c.Read<uint32_t>(what));
    if (n_dims == 0 || n_dims > kMaxDims) return bad(what, ": ", n_dims, " dims (1 to 4 allowed)");
    for (uint32_t d = 0; d < n_dims; ++d) {
      ASSIGN_OR_RETURN(uint64_t dim, c.Read<uint64_t>(what));
      if (dim == 0 || dim > (1ull << 40)) return bad(what, ": bad dim ", dim);
      t.dims.push_back(static_cast<int64_t>(dim));
    }
    t.shape.assign(t.dims.rbegin(), t.dims.rend());
    ASSIGN_OR_RETURN(t.type, c.Read<uint32_t>(what));
    ASSIGN_OR_RETURN(t.offset, c.Read<uint64_t>(what));
    infos.push_back(std::move(t));
  }
  const uint64_t data_start = (c.pos() + file->alignment_ - 1) / file->alignment_ * file->alignment_;

  for (GgufTensor& t : infos) {
    const std::string what = absl::StrCat("tensor '", t.name, "'");
    if (!IsLoadableGgmlType(t.type)) {
      return absl::UnimplementedError(
          absl::StrCat(path, ": ", what, ": type ", GgmlTypeName(t.type),
                       " is not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1 are)"));
    }
    int64_t n = 1;
    for (int64_t d : t.dims) {
      if (__builtin_mul_overflow(n, d, &n)) return bad(what, ": dims ", ShapeString(t.dims), " overflow");
    }
    const TypeInfo* info = FindType(t.type);
    if (t.dims[0] % info->block != 0) {
      return bad(what, ": row length ", t.dims[0], " is not a multiple of the ", info->name, " block size ",
                 info->block);
    }
    std::optional<int64_t> bytes = GgmlByteSize(t.type, n);
    if (!bytes.has_value()) return bad(what, ": size of ", ShapeString(t.dims), " overflows");
    t.nbytes = *bytes;
    if (t.offset % file->alignment_ != 0) {
      return bad(what, ": offset ", t.offset, " is not a multiple of the alignment ", file->alignment_);
    }
    if (data_start > size || t.offset > size - data_start ||
        static_cast<uint64_t>(t.nbytes) > size - data_start - t.offset) {
      return absl::DataLossError(absl::StrCat(
          path, ": truncated: ", what, " (", info->name, " ", ShapeString(t.dims), ", ", t.nbytes,
          " bytes at data offset ", t.offset, ") ends past the end of the file (", size, " bytes)"));
    }
    t.data = base + data_start + t.offset;
  }
  std::vector<const GgufTensor*> by_offset;
  for (const GgufTensor& t : infos) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const GgufTensor& a = *by_offset[k - 1];
    const GgufTensor& b = *by_offset[k];
    if (a.offset + static_cast<uint64_t>(a.nbytes) > b.offset) {
      return bad("tensors '", a.name, "' and '", b.name, "' overlap (offsets ", a.offset, " + ", a.nbytes,
                 " > ", b.offset, ")");
    }
  }
  for (GgufTensor& t : infos) {
    std::string name = t.name;
    if (!file->tensors_.emplace(name, std::move(t)).second) return bad("tensor '", name, "' appears twice");
  }
  return file;
}

absl::StatusOr<ModelSpec> GgufModelSpec(const GgufFile& f) {
  const std::string& p = f.path();
  const GgufValue* arch = f.Find("general.architecture");
  if (arch == nullptr || !arch->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, ": metadata key 'general.architecture' is missing or not a string"));
  }
  if (arch->s != "llama") {
    return absl::UnimplementedError(absl::StrCat(p, ": metadata key 'general.architecture': \"", arch->s,
                                                 "\" is not supported (llama is)"));
  }
  if (const GgufValue* st = f.Find("llama.rope.scaling.type");
      st != nullptr && !(st->is_string() && st->s == "none")) {
    return absl::UnimplementedError(
        absl::StrCat(p, ": metadata key 'llama.rope.scaling.type': ", st->DebugString(),
                     " is not supported (only unscaled RoPE)"));
  }
  if (f.tensors().contains("rope_freqs.weight")) {
    return absl::UnimplementedError(
        absl::StrCat(p,
                     ": tensor 'rope_freqs.weight': RoPE frequency factors (Llama 3.1 rope scaling) are not "
                     "supported"));
  }
  ModelSpec s;
  s.name = p;
  s.model_type = "llama";
  ASSIGN_OR_RETURN(s.hidden_size, GetInt(f, "llama.embedding_length", std::nullopt));
  ASSIGN_OR_RETURN(s.num_layers, GetInt(f, "llama.block_count", std::nullopt));
  ASSIGN_OR_RETURN(s.intermediate_size, GetInt(f, "llama.feed_forward_length", std::nullopt));
  ASSIGN_OR_RETURN(s.num_heads, GetInt(f, "llama.attention.head_count", std::nullopt));
  if (s.num_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(p, ": metadata key 'llama.attention.head_count': ", s.num_heads));
  }
  ASSIGN_OR_RETURN(s.num_kv_heads, GetInt(f, "llama.attention.head_count_kv", s.num_heads));
  ASSIGN_OR_RETURN(int64_t key_length, GetInt(f, "llama.attention.key_length", s.hidden_size / s.num_heads));
  ASSIGN_OR_RETURN(s.head_dim, GetInt(f, "llama.rope.dimension_count", key_length));
  if (s.head_dim != key_length) {
    return absl::UnimplementedError(
        absl::StrCat(p, ": metadata key 'llama.rope.dimension_count': ", s.head_dim,
                     " differs from the head size ", key_length, " (partial rotary is not supported)"));
  }
  ASSIGN_OR_RETURN(s.max_position, GetInt(f, "llama.context_length", 2048));
  ASSIGN_OR_RETURN(s.rms_norm_eps, GetFloat(f, "llama.attention.layer_norm_rms_epsilon", 1e-5));
  ASSIGN_OR_RETURN(s.rope.theta, GetFloat(f, "llama.rope.freq_base", 10000.0));
  std::optional<int64_t> vocab;
  if (const GgufValue* tokens = f.Find("tokenizer.ggml.tokens"); tokens != nullptr && tokens->is_array()) {
    vocab = static_cast<int64_t>(tokens->array.size());
  } else if (auto it = f.tensors().find("token_embd.weight");
             it != f.tensors().end() && it->second.dims.size() == 2) {
    vocab = it->second.dims[1];
  }
  ASSIGN_OR_RETURN(s.vocab_size, GetInt(f, "llama.vocab_size", vocab));
  s.tie_word_embeddings = !f.tensors().contains("output.weight");
  if (f.Find("tokenizer.ggml.bos_token_id") != nullptr) {
    ASSIGN_OR_RETURN(int64_t bos, GetInt(f, "tokenizer.ggml.bos_token_id", std::nullopt));
    s.bos_token_id = static_cast<int32_t>(bos);
  }
  for (const char* key :
       {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    if (f.Find(key) == nullptr) continue;
    ASSIGN_OR_RETURN(int64_t id, GetInt(f, key, std::nullopt));
    if (std::find(s.eos_token_ids.begin(), s.eos_token_ids.end(), id) == s.eos_token_ids.end()) {
      s.eos_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  s.weight_dtype = DType::kF32;
  RETURN_IF_ERROR(s.Validate());
  return s;
}

std::string GgufTensorName(std::string_view hf) {
  if (hf == HfNames::Embed()) return "token_embd.weight";
  if (hf == HfNames::FinalNorm()) return "output_norm.weight";
  if (hf == HfNames::LmHead()) return "output.weight";
  constexpr std::string_view kPrefix = "model.layers.";
  if (hf.substr(0, kPrefix.size()) != kPrefix) return "";
  hf.remove_prefix(kPrefix.size());
  const size_t dot = hf.find('.');
  int64_t layer;
  if (dot == std::string_view::npos || !absl::SimpleAtoi(std::string(hf.substr(0, dot)), &layer)) return "";
  const std::string_view leaf = hf.substr(dot + 1);
  for (const LayerLeaf& l : kLayerLeaves) {
    if (leaf == l.hf) return absl::StrCat("blk.", layer, ".", l.gguf);
  }
  return "";
}

absl::StatusOr<std::unique_ptr<GgufWeightSource>> OpenGguf(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> file, GgufFile::Open(path));
  ASSIGN_OR_RETURN(ModelSpec spec, GgufModelSpec(*file));
  std::unique_ptr<GgufWeightSource> src(new GgufWeightSource);
  std::map<std::string, const GgufTensor*> unused;
  for (const auto& [name, t] : file->tensors()) unused.emplace(name, &t);
  for (const ExpectedTensor& e : ExpectedTensors(spec)) {
    const std::string g = GgufTensorName(e.name);
    auto it = unused.find(g);
    if (it == unused.end()) {
      return absl::NotFoundError(absl::StrCat(path, ": tensor '", g, "' (", e.name, ") is missing"));
    }
    const GgufTensor& t = *it->second;
    if (t.shape != e.shape) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", g, "' (", e.name, "): shape ",
                                                     ShapeString(t.shape), ", expected ",
                                                     ShapeString(e.shape)));
    }
    src->tensors_.emplace(e.name, &t);
    unused.erase(it);
  }
  if (!unused.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected tensor '", unused.begin()->first,
                                                   "' (not part of a llama model with this metadata)"));
  }
  src->spec_ = std::move(spec);
  src->file_ = std::move(file);
  return src;
}

absl::Status GgufWeightSource::ReadF32(const std::string& name, float* out) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(file_->path(), ": no tensor '", name, "' in this model"));
  }
  const GgufTensor& t = *it->second;
  const int64_t n = t.num_elements();
  int64_t heads = 0;
  if (absl::EndsWith(name, "self_attn.q_proj.weight")) heads = spec_.num_heads;
  if (absl::EndsWith(name, "self_attn.k_proj.weight")) heads = spec_.num_kv_heads;
  if (heads == 0) return DequantizeGgml(t.type, t.data, n, out);

  std::vector<float> tmp(n);
  RETURN_IF_ERROR(DequantizeGgml(t.type, t.data, n, tmp.data()));
  const int64_t cols = t.shape[1], d = t.shape[0] / heads, half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t j = 0; j < half; ++j) {
        const float* src = tmp.data() + (h * d + 2 * j + i) * cols;
        std::copy(src, src + cols, out + (h * d + i * half + j) * cols);
      }
    }
  }
  return absl::OkStatus();
}

std::string GgufWeightSource::Describe() const {
  std::map<std::string, int> counts;
  for (const auto& [name, t] : file_->tensors()) ++counts[GgmlTypeName(t.type)];
  std::vector<std::pair<int, std::string>> sorted;
  for (const auto& [type, n] : counts) sorted.emplace_back(-n, type);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::string> parts;
  for (const auto& [n, type] : sorted) parts.push_back(absl::StrCat(-n, " ", type));
  return absl::StrCat(file_->path(), " (GGUF v", file_->version(), ", tensors: ", absl::StrJoin(parts, ", "),
                      ")");
}

GgufValue GgufU32(uint32_t v) {
  GgufValue x;
  x.type = GgufType::kU32;
  x.i = v;
  x.u = v;
  return x;
}
GgufValue GgufF32(float v) {
  GgufValue x;
  x.type = GgufType::kF32;
  x.f = v;
  return x;
}
GgufValue GgufString(std::string v) {
  GgufValue x;
  x.type = GgufType::kString;
  x.s = std::move(v);
  return x;
}
GgufValue GgufArray(GgufType elem_type, std::vector<GgufValue> elems) {
  GgufValue x;
  x.type = GgufType::kArray;
  x.elem_type = elem_type;
  x.array = std::move(elems);
  return x;
}

absl::Status WriteGguf(const std::string& path, const std::map<std::string, GgufValue>& metadata,
                       const std::vector<GgufWriteTensor>& tensors, uint32_t version, uint32_t alignment) {
  std::string out;
  Put<uint32_t>(out, kMagic);
  Put<uint32_t>(out, version);
  Put<uint64_t>(out, tensors.size());
  std::map<std::string, GgufValue> md = metadata;
  if (alignment != 32) md["general.alignment"] = GgufU32(alignment);
  Put<uint64_t>(out, md.size());
  for (const auto& [key, v] : md) {
    PutString(out, key);
    Put<uint32_t>(out, static_cast<uint32_t>(v.type));
    PutValue(out, v);
  }
  uint64_t offset = 0;
  for (const GgufWriteTensor& t : tensors) {
    PutString(out, t.name);
    Put<uint32_t>(out, static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) Put<uint64_t>(out, static_cast<uint64_t>(*d));
    Put<uint32_t>(out, t.type);
    Put<uint64_t>(out, offset);
    offset += (t.bytes.size() + alignment - 1) / alignment * alignment;
  }
  out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
  for (const GgufWriteTensor& t : tensors) {
    out.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
    out.resize((out.size() + alignment - 1) / alignment * alignment, '\0');
  }
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  if (fp == nullptr) return ErrnoToStatus(errno, absl::StrCat("fopen(", path, ")"));
  const bool ok = std::fwrite(out.data(), 1, out.size(), fp) == out.size();
  if (std::fclose(fp) != 0 || !ok) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace tandem
