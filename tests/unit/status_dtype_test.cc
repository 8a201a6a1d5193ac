#include <cerrno>
#include <cmath>
#include <limits>
#include <random>

#include "common/dtype.h"
#include "common/status.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(auto q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(Status, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckEven(2).ok());
  EXPECT_FALSE(CheckEven(3).ok());
}

TEST(Status, AnnotateAndErrno) {
  EXPECT_EQ(Annotate(absl::NotFoundError("x"), "loading y").message(), "loading y: x");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
  absl::Status s = ErrnoToStatus(ENOENT, "open(/nope)");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.message().find("open(/nope)"), std::string::npos);
  EXPECT_EQ(ErrnoToStatus(ETIMEDOUT, "x").code(), absl::StatusCode::kDeadlineExceeded);
}

TEST(StatusDeathTest, CheckAbortsWithLocation) {
  EXPECT_DEATH(TANDEM_CHECK_MSG(1 == 2, "value ", 7),
               "CHECK failed at .*status_dtype_test.cc.*1 == 2: value 7");
}

TEST(DType, NamesParse) {
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F16"), DType::kF16);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  EXPECT_FALSE(ParseDType("int8").has_value());
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
}

// Every 16-bit pattern converts to float and back unchanged (NaNs stay NaN).
TEST(DType, SixteenBitRoundTripsAreExact) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float b = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(b)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(b))));
    } else {
      EXPECT_EQ(FloatToBf16(b), h) << h;
    }
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(F16ToFloat(FloatToF16(f))));
    } else {
      EXPECT_EQ(FloatToF16(f), h) << h;
    }
  }
}

// Rounding is to nearest: the error is at most half a unit in the last place.
TEST(DType, RoundingIsToNearest) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1000.f, 1000.f);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng);
    const float b = Bf16ToFloat(FloatToBf16(x));
    EXPECT_LE(std::fabs(b - x), std::ldexp(std::fabs(x), -8) + 1e-30f) << x;
    const float h = F16ToFloat(FloatToF16(x));
    EXPECT_LE(std::fabs(h - x), std::ldexp(std::fabs(x), -11) + 1e-30f) << x;
  }
  EXPECT_EQ(F16ToFloat(FloatToF16(1e6f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(F16ToFloat(FloatToF16(65504.f)), 65504.f);
  EXPECT_EQ(F16ToFloat(FloatToF16(5.960464477539063e-08f)), 5.960464477539063e-08f);  // smallest subnormal
}

}  // namespace
}  // namespace tandem
