// The pipeline schedule (common/pipeline_schedule.h), over random shapes: every layer of every
// micro-batch has exactly one compute rank; the rank that sends a layer's q,k,v is the one that
// got the layer before; a hand-off happens only at a slice boundary and only to the next rank of
// the ring (the only connection a rank has for it); Touches and FinisherOf agree with OwnerOf; and
// the rotational layout spreads each micro-batch's layers evenly over the ranks.
#include "common/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

namespace tandem {
namespace {

TEST(PipelineSchedule, FixedKeepsEachMicroBatchOnOneRank) {
  const PipelineSchedule s{.compute_ranks = 3, .slice_layers = 0};
  EXPECT_FALSE(s.rotational());
  for (int j = 0; j < 8; ++j) {
    for (int l = 0; l < 5; ++l) {
      EXPECT_EQ(s.OwnerOf(j, l), j % 3);
      EXPECT_FALSE(s.HandsOff(j, l));
    }
    for (int c = 0; c < 3; ++c) EXPECT_EQ(s.Touches(c, j, 5), c == j % 3);
  }
}

TEST(PipelineSchedule, RotationalLayoutOfThePaper) {
  // 3 micro-batches on 2 compute ranks, one layer per slice: micro-batch j's layer l on (j + l) % 2.
  const PipelineSchedule s{.compute_ranks = 2, .slice_layers = 1};
  EXPECT_TRUE(s.rotational());
  EXPECT_EQ(s.OwnerOf(0, 0), 0);
  EXPECT_EQ(s.OwnerOf(0, 1), 1);
  EXPECT_EQ(s.OwnerOf(2, 1), 1);
  EXPECT_EQ(s.OwnerOf(1, 3), 0);
  EXPECT_EQ(s.SenderOf(1, 3), 1);
  EXPECT_TRUE(s.HandsOff(1, 3));
  EXPECT_FALSE(s.HandsOff(1, 0));
  EXPECT_EQ(s.FinisherOf(1, 4), 0);
  // One rank only: nothing rotates.
  EXPECT_FALSE((PipelineSchedule{.compute_ranks = 1, .slice_layers = 1}).rotational());
}

TEST(PipelineSchedule, RandomShapesKeepTheInvariants) {
  std::mt19937 rng(20261125);
  for (int iter = 0; iter < 2000; ++iter) {
    const int ranks = 1 + static_cast<int>(rng() % 8);
    const int layers = 1 + static_cast<int>(rng() % 80);
    const int slice = rng() % 4 == 0 ? 0 : 1 + static_cast<int>(rng() % static_cast<uint32_t>(layers));
    const int batches = ranks + static_cast<int>(rng() % 3);
    const PipelineSchedule s{.compute_ranks = ranks, .slice_layers = slice};
    for (int j = 0; j < batches; ++j) {
      std::vector<int> per_rank(static_cast<size_t>(ranks), 0);
      for (int l = 0; l < layers; ++l) {
        const int owner = s.OwnerOf(j, l);
        ASSERT_GE(owner, 0);
        ASSERT_LT(owner, ranks);
        ++per_rank[static_cast<size_t>(owner)];
        ASSERT_TRUE(s.Touches(owner, j, layers)) << "rank " << owner << " owns layer " << l;
        ASSERT_EQ(s.SenderOf(j, l), l == 0 ? owner : s.OwnerOf(j, l - 1));
        if (s.HandsOff(j, l)) {
          ASSERT_TRUE(s.rotational());
          ASSERT_GT(l, 0);
          ASSERT_EQ(l % slice, 0) << "a hand-off inside a slice";
          ASSERT_EQ(owner, (s.SenderOf(j, l) + 1) % ranks) << "a hand-off that skips a rank of the ring";
        } else if (l > 0 && s.rotational() && l % slice == 0 && ranks > 1) {
          FAIL() << "no hand-off at a slice boundary (layer " << l << ", slice " << slice << ")";
        }
      }
      ASSERT_EQ(s.FinisherOf(j, layers), s.OwnerOf(j, layers - 1));
      for (int c = 0; c < ranks; ++c) {
        ASSERT_EQ(s.Touches(c, j, layers), per_rank[static_cast<size_t>(c)] > 0) << "rank " << c;
      }
      if (s.rotational()) {
        // Whole slices go round the ring: the ranks' shares differ by at most one slice.
        const auto [lo, hi] = std::minmax_element(per_rank.begin(), per_rank.end());
        ASSERT_LE(*hi - *lo, slice);
      } else {
        ASSERT_EQ(per_rank[static_cast<size_t>(j % ranks)], layers);
      }
    }
  }
}

}  // namespace
}  // namespace tandem
