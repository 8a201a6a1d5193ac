// gtest names for parameterized tests over model names: "llama3-gqa-tied" -> "llama3_gqa_tied"
// (gtest allows only letters, digits and underscores in parameter names).
#pragma once

#include <string>

#include "gtest/gtest.h"

namespace tandem::testing_names {

inline std::string Identifier(std::string s) {
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

// For INSTANTIATE_TEST_SUITE_P over std::string (or const char*) model names.
struct ModelParamName {
  template <typename P>
  std::string operator()(const ::testing::TestParamInfo<P>& info) const {
    return Identifier(std::string(info.param));
  }
};

}  // namespace tandem::testing_names
