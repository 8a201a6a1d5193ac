#include "common/dtype.h"

#include <cmath>
#include <string>

#include "absl/strings/ascii.h"

namespace tandem {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

std::optional<DType> ParseDType(std::string_view name) {
  std::string n = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (n == "f32" || n == "fp32" || n == "float32" || n == "float") return DType::kF32;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "half") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  return std::nullopt;
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t FloatToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. inf) after rounding
  if (abs < 0x38800000u) {                        // subnormal or zero in f16
    float a;
    std::memcpy(&a, &abs, 4);
    float scaled = a * 16777216.0f;                              // 2^24: units of the smallest subnormal
    uint32_t m = static_cast<uint32_t>(std::nearbyint(scaled));  // ties to even (default mode)
    return sign | static_cast<uint16_t>(m);
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | static_cast<uint16_t>(((rounded >> 13) - (112u << 10)) & 0x7fffu);
}

void ConvertToF32(DType src_type, const void* src, int64_t n, float* dst) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  switch (src_type) {
    case DType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = Bf16ToFloat(h);
      }
      return;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        dst[i] = F16ToFloat(h);
      }
      return;
  }
}

}  // namespace tandem
