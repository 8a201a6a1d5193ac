// CheckJsonDepth: nesting counted outside strings only, the limit exact, deep input refused in
// linear time without recursion.
#include "common/json_depth.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

std::string Nested(int depth, char open = '[', char close = ']') {
  return std::string(static_cast<size_t>(depth), open) + std::string(static_cast<size_t>(depth), close);
}

TEST(JsonDepth, CountsArraysAndObjectsOutsideStrings) {
  EXPECT_TRUE(CheckJsonDepth(Nested(64)).ok());
  const absl::Status s = CheckJsonDepth(Nested(65));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("nested deeper than 64 levels at byte 64"));
  EXPECT_TRUE(CheckJsonDepth(R"({"a": [1, {"b": [2]}]})", 4).ok());
  EXPECT_FALSE(CheckJsonDepth(R"({"a": [1, {"b": [2]}]})", 3).ok());
  // Brackets in strings, escaped quotes included, do not count.
  EXPECT_TRUE(CheckJsonDepth(R"(["[[[[", "\"[[[[", "\\"])", 1).ok());
  EXPECT_FALSE(CheckJsonDepth(R"(["\\", [[]]])", 2).ok());
  // Closing brackets without openers never make the depth negative.
  EXPECT_TRUE(CheckJsonDepth("]]]]" + Nested(64)).ok());
  // 100,000 levels: refused quickly.
  EXPECT_FALSE(CheckJsonDepth(Nested(100000, '{', '}')).ok());
  EXPECT_TRUE(CheckJsonDepth("").ok());
}

}  // namespace
}  // namespace tandem
