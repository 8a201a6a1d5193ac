// GGUF checkpoints (llama.cpp's single-file format), versions 2 and 3:
//   "GGUF" | u32 version | u64 tensor_count | u64 kv_count | kv_count metadata key/values |
//   tensor_count tensor infos | padding to `general.alignment` (default 32) | tensor data
// A string is u64 length + bytes; a value is u32 type + payload (arrays: u32 element type, u64
// count, elements; arrays of arrays allowed). A tensor info is its name, u32 n_dims, n_dims u64
// dims (ggml order: dims[0] is the contiguous one, so an (out, in) matrix is [in, out]), u32 ggml
// type and u64 offset from the start of the data section (a multiple of the alignment).
//
// Nothing in a file is trusted: every read is bounds-checked, and tensor types, dims, offsets
// (aligned, in range, no two tensors overlapping) and sizes are checked before any tensor is
// exposed. Errors name the file and, where one is at fault, the key or tensor.
//
// The llama architecture maps onto a WeightSource (compute_node/weights.h) whose tensors carry the
// Hugging Face names, dequantized to fp32, with llama.cpp's rotary row permutation of attn_q and
// attn_k undone, so a GGUF converted from an HF checkpoint reads back as that checkpoint (up to
// quantization).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "compute_node/mapped_file.h"
#include "compute_node/weights.h"

namespace tandem {

// Metadata value types, numbered as in the file.
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* GgufTypeName(GgufType type);  // "u32", "string", "array", ...

// One metadata value. Integers and bools are held in `i` (u64 values above INT64_MAX in `u`
// too), floats in `f`, strings in `s`, arrays in `array` (with `elem_type`).
struct GgufValue {
  GgufType type = GgufType::kU8;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0;
  std::string s;
  GgufType elem_type = GgufType::kU8;  // arrays only
  std::vector<GgufValue> array;

  bool is_integer() const;  // u8..i64 (not bool)
  bool is_float() const { return type == GgufType::kF32 || type == GgufType::kF64; }
  bool is_string() const { return type == GgufType::kString; }
  bool is_array() const { return type == GgufType::kArray; }
  // A short rendering for messages: 3, "text", [array of 49152 string].
  std::string DebugString() const;
};

// ggml tensor types, numbered as in the file. Loadable: F32, F16, BF16, Q8_0, Q4_0, Q4_1. Other
// known types are named in errors; any other number is an unknown type.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ8_0 = 8,
  kBF16 = 30,
};
// "F32", "Q4_1", "Q6_K", ... or "type 77" for a number ggml does not define.
std::string GgmlTypeName(uint32_t type);
bool IsLoadableGgmlType(uint32_t type);

struct GgufTensor {
  std::string name;
  uint32_t type = 0;              // a GgmlType for the loadable ones
  std::vector<int64_t> dims;      // as in the file (ggml order, innermost first)
  std::vector<int64_t> shape;     // dims reversed: row-major, outermost first, as HF writes it
  uint64_t offset = 0;            // from the start of the data section
  const uint8_t* data = nullptr;  // into the mapping; valid while the file object lives
  int64_t nbytes = 0;
  int64_t num_elements() const;
};

// Dequantizes `n` elements of ggml type `type` at `data` (n a multiple of the block size: 32 for
// Q8_0, Q4_0, Q4_1) into `out`:
//   Q8_0 blocks: f16 d, 32 × i8 q;        x = d·q
//   Q4_0 blocks: f16 d, 16 bytes;          x[j] = d·((b[j] & 15) - 8), x[j+16] = d·((b[j] >> 4) - 8)
//   Q4_1 blocks: f16 d, f16 m, 16 bytes;   x[j] = d·(b[j] & 15) + m,    x[j+16] = d·(b[j] >> 4) + m
// Unimplemented for a type that is not loadable, InvalidArgument when n is not whole blocks.
absl::Status DequantizeGgml(uint32_t type, const uint8_t* data, int64_t n, float* out);
// Bytes of `n` elements of a loadable type (n whole blocks); nullopt otherwise.
std::optional<int64_t> GgmlByteSize(uint32_t type, int64_t n);

// A GGUF file mapped read-only. Thread-safe for concurrent reads.
class GgufFile {
 public:
  // Errors name `path`: NotFound (no file), DataLoss (truncated: a read past the end, tensor data
  // past the end), InvalidArgument (bad magic, a version other than 2 or 3, bad value type, bad
  // alignment, a duplicate key or tensor, bad dims, a misaligned or overlapping offset),
  // Unimplemented (a tensor of a type that is not loadable, naming the tensor and the type).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* Find(const std::string& key) const;  // nullptr when absent
  const std::map<std::string, GgufTensor>& tensors() const { return tensors_; }

 private:
  GgufFile() = default;
  std::string path_;
  MappedFile map_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, GgufValue> metadata_;
  std::map<std::string, GgufTensor> tensors_;
};

// The ModelSpec of a llama-architecture GGUF: general.architecture "llama";
// llama.{embedding_length, block_count, feed_forward_length, attention.head_count} required;
// llama.attention.head_count_kv (default head_count), llama.rope.dimension_count or
// llama.attention.key_length (default embedding_length / head_count), llama.context_length
// (2048), llama.attention.layer_norm_rms_epsilon (1e-5), llama.rope.freq_base (10000),
// llama.vocab_size (else the length of tokenizer.ggml.tokens, else token_embd's rows);
// tokenizer.ggml.bos_token_id; eos ids = tokenizer.ggml.eos_token_id, eot_token_id and
// eom_token_id (those present). Tied when there is no `output.weight` tensor. RoPE scaling
// (llama.rope.scaling.type other than "none", or a rope_freqs tensor as llama.cpp writes for
// Llama 3.1) is Unimplemented naming the key or tensor. weight_dtype is F32 (what ReadF32 hands
// out after dequantization). The spec is named after the file and has passed Validate().
absl::StatusOr<ModelSpec> GgufModelSpec(const GgufFile& file);

// The GGUF tensor name of the HF tensor `hf_name` ("model.layers.3.self_attn.q_proj.weight" ->
// "blk.3.attn_q.weight"); empty for a name that has none.
std::string GgufTensorName(std::string_view hf_name);

// A WeightSource over a GGUF file. ReadF32 dequantizes and, for q_proj and k_proj, undoes the
// converter's permutation: within every head of D rows, GGUF row 2j + i holds HF row i·D/2 + j
// (i in {0, 1}, j < D/2), i.e. llama.cpp stores the rotary pairs interleaved.
class GgufWeightSource : public WeightSource {
 public:
  const ModelSpec& spec() const override { return spec_; }
  absl::Status ReadF32(const std::string& name, float* out) const override;
  // "path (GGUF v3, tensors: 210 Q4_1, 61 F32, 1 Q8_0)".
  std::string Describe() const override;

  const GgufFile& file() const { return *file_; }
  // Every metadata key/value of the file (tokenizer.ggml.tokens, .merges, .token_type, .scores,
  // .bos_token_id, .eos_token_id, tokenizer.chat_template, ...), for building a tokenizer.
  const std::map<std::string, GgufValue>& metadata() const { return file_->metadata(); }

 private:
  friend absl::StatusOr<std::unique_ptr<GgufWeightSource>> OpenGguf(const std::string& path);
  GgufWeightSource() = default;
  ModelSpec spec_;
  std::unique_ptr<GgufFile> file_;
  std::map<std::string, const GgufTensor*> tensors_;  // HF name -> tensor
};

// Opens and checks a llama GGUF: the file (GgufFile::Open), the spec (GgufModelSpec), then every
// expected tensor present once with the expected shape (dims reversed) and a loadable type, and
// no other tensor. Errors name the file and the tensor (GGUF name, with the HF name it maps to):
// NotFound (a missing tensor), InvalidArgument (shape mismatch, an unexpected tensor),
// Unimplemented, DataLoss. Nothing is dequantized until ReadF32.
absl::StatusOr<std::unique_ptr<GgufWeightSource>> OpenGguf(const std::string& path);

// ---- writing (tests and tools) ------------------------------------------------------------------

struct GgufWriteTensor {
  std::string name;
  uint32_t type = 0;
  std::vector<int64_t> shape;  // row-major (outermost first); written reversed as ggml dims
  std::vector<uint8_t> bytes;  // the encoded data
};
// Writes a GGUF file of `version` (2 or 3) with the metadata in map order and tensors in the given
// order, each at the next multiple of `alignment` (written as general.alignment when not 32).
absl::Status WriteGguf(const std::string& path, const std::map<std::string, GgufValue>& metadata,
                       const std::vector<GgufWriteTensor>& tensors, uint32_t version = 3,
                       uint32_t alignment = 32);
// Value helpers for WriteGguf.
GgufValue GgufU32(uint32_t v);
GgufValue GgufF32(float v);
GgufValue GgufString(std::string v);
GgufValue GgufArray(GgufType elem_type, std::vector<GgufValue> elems);

}  // namespace tandem
