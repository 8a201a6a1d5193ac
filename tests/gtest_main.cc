// The main of every gtest binary (tandem_add_test): gtest's, except that a run in which no test
// failed, none passed and at least one skipped (a GPU test on a machine without a GPU, a
// multi-GPU test with too few) exits with 77, which ctest reports as skipped (SKIP_RETURN_CODE).
// A binary whose tests all fail still fails, and one with a pass and a skip passes.
#include "gmock/gmock.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (rc == 0 && u.failed_test_count() == 0 && u.successful_test_count() == 0 && u.skipped_test_count() > 0) {
    return 77;
  }
  return rc;
}
