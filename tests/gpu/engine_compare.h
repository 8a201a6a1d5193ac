// Comparing two engine runs of the same requests where rounding may differ (bf16 on the GPU): the
// tokens of each request agree up to its first difference, log-probabilities before it agree to
// within what the caller allows, and at the difference both runs' chosen tokens are near-ties
// (their log-probabilities within `tie_gap`), so the runs only went different ways at a coin toss.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "compute_node/controller.h"
#include "gtest/gtest.h"

namespace tandem::testing_gpu {

struct RunComparison {
  double max_diff = 0;     // max |logprob difference| before each request's first different token
  double max_tie_gap = 0;  // max |logprob difference| at a first different token
  int diverged = 0;        // requests whose tokens differ somewhere
};

inline RunComparison CompareUpToNearTies(const std::vector<GenerationResult>& a,
                                         const std::vector<GenerationResult>& b, double tie_gap) {
  RunComparison c;
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    EXPECT_EQ(a[i].token_ids.size(), b[i].token_ids.size()) << "request " << i;
    const size_t n = std::min(a[i].token_ids.size(), b[i].token_ids.size());
    size_t k = 0;
    while (k < n && a[i].token_ids[k] == b[i].token_ids[k]) ++k;
    for (size_t j = 0; j < k; ++j)
      c.max_diff = std::max(c.max_diff, std::fabs(static_cast<double>(a[i].logprobs[j] - b[i].logprobs[j])));
    if (k < n) {
      ++c.diverged;
      const double gap = std::fabs(static_cast<double>(a[i].logprobs[k] - b[i].logprobs[k]));
      c.max_tie_gap = std::max(c.max_tie_gap, gap);
      EXPECT_LT(gap, tie_gap) << "request " << i << " token " << k << ": " << a[i].token_ids[k]
                              << " (logprob " << a[i].logprobs[k] << ") vs " << b[i].token_ids[k]
                              << " (logprob " << b[i].logprobs[k] << ") is not a near-tie";
    }
  }
  return c;
}

}  // namespace tandem::testing_gpu
