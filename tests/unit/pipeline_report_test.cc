// MakePipelineReport: per-step figures from two snapshots of a deployment's totals.
#include "compute_node/pipeline_report.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(PipelineReport, PerStepFiguresOfTheStepsBetweenTwoSnapshots) {
  const PipelineTotals before{
      .steps = 10, .step_ms = 100, .compute_ms = 50, .attention_phase_ms = 40, .rank_attention_ms = {10, 20}};
  const PipelineTotals now{
      .steps = 14, .step_ms = 140, .compute_ms = 70, .attention_phase_ms = 64, .rank_attention_ms = {18, 36}};
  const PipelineReport r = MakePipelineReport(now, before);
  EXPECT_EQ(r.steps, 4);
  EXPECT_DOUBLE_EQ(r.step_ms, 10);
  EXPECT_DOUBLE_EQ(r.compute_ms, 5);
  EXPECT_DOUBLE_EQ(r.attention_phase_ms, 6);
  EXPECT_THAT(r.rank_attention_ms, ::testing::ElementsAre(2, 4));
  EXPECT_DOUBLE_EQ(r.attention_ms, 4);  // the busiest rank
  EXPECT_DOUBLE_EQ(r.exchange_ms, 2);
  EXPECT_DOUBLE_EQ(r.idle_ms, 0);  // 10 - 5 - 6 < 0: floored
  EXPECT_DOUBLE_EQ(r.efficiency, 0.5);
  EXPECT_THAT(r.ToString(), ::testing::HasSubstr("efficiency 0.50 over 4 steps"));
  EXPECT_THAT(r.ToString(), ::testing::HasSubstr("memory ranks 2.00, 4.00"));
}

TEST(PipelineReport, FloorsAndEmptyWindows) {
  // Attention longer than its phase (two clocks): exchange 0, never negative; efficiency <= 1.
  const PipelineTotals now{
      .steps = 2, .step_ms = 4, .compute_ms = 1, .attention_phase_ms = 2, .rank_attention_ms = {6}};
  const PipelineReport r = MakePipelineReport(now);
  EXPECT_DOUBLE_EQ(r.exchange_ms, 0);
  EXPECT_DOUBLE_EQ(r.idle_ms, 0.5);
  EXPECT_DOUBLE_EQ(r.efficiency, 1.0);
  EXPECT_EQ(MakePipelineReport(now, now).steps, 0);
  EXPECT_EQ(MakePipelineReport(now, now).ToString(), "no steps");
  // A GPU compute rank without phase timing: step and the ranks' attention, and why not the rest.
  PipelineTotals untimed = now;
  untimed.phases_timed = false;
  const PipelineReport u = MakePipelineReport(untimed);
  EXPECT_DOUBLE_EQ(u.step_ms, 2);
  EXPECT_DOUBLE_EQ(u.attention_ms, 3);
  EXPECT_DOUBLE_EQ(u.compute_ms, 0);
  EXPECT_DOUBLE_EQ(u.efficiency, 0);
  EXPECT_THAT(u.ToString(), ::testing::HasSubstr("need compute.profile: true"));
}

}  // namespace
}  // namespace tandem
