// Element types of tensors in checkpoints, on the wire and on devices, with exact conversions
// between the 16-bit float formats and fp32 (round to nearest even, NaN preserved).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace tandem {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Bytes per element.
constexpr int64_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
// Lower-case name: "f32", "f16", "bf16".
std::string_view DTypeName(DType t);
// Parses "f32"/"float32"/"fp32", "f16"/"float16"/"fp16", "bf16"/"bfloat16" (case-insensitive).
std::optional<DType> ParseDType(std::string_view name);

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);

// Converts `n` elements stored as `src_type` at `src` (unaligned allowed) to fp32.
void ConvertToF32(DType src_type, const void* src, int64_t n, float* dst);

}  // namespace tandem
