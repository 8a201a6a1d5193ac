// The main of every gtest binary (tandem_add_test): gtest's, except that a run in which no test
// failed, none passed and at least one skipped (a GPU test on a machine without a GPU, a
// multi-GPU test with too few) exits with 77, which ctest reports as skipped (SKIP_RETURN_CODE).
// A binary whose tests all fail still fails, and one with a pass and a skip passes.
//
// Every test process runs as one deployment: unless TANDEM_SECRET_FILE is set already, a fresh
// deployment secret (common/bootstrap/deployment_key.h) is written to a private temporary
// directory and exported, so that the processes a test starts (helpers, `tandem memory`) and its
// own transports authenticate each other; both are removed at exit.
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "common/bootstrap/deployment_key.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

std::string g_secret_dir;
pid_t g_secret_owner = 0;  // a forked child that exits must not remove it

void RemoveSecret() {
  if (g_secret_dir.empty() || getpid() != g_secret_owner) return;
  unlink((g_secret_dir + "/secret").c_str());
  rmdir(g_secret_dir.c_str());
}

void ShareOneDeploymentSecret() {
  const char* set = getenv("TANDEM_SECRET_FILE");
  if (set != nullptr && *set != '\0') return;
  char dir[] = "/tmp/tandem-test-secret.XXXXXX";
  if (mkdtemp(dir) == nullptr) {
    std::perror("mkdtemp for the test deployment secret");
    std::exit(1);
  }
  g_secret_dir = dir;
  g_secret_owner = getpid();
  const std::string file = g_secret_dir + "/secret";
  const absl::StatusOr<tandem::bootstrap::DeploymentKey> key = tandem::bootstrap::CreateKeyFile(file);
  if (!key.ok()) {
    std::fprintf(stderr, "%s\n", key.status().ToString().c_str());
    std::exit(1);
  }
  setenv("TANDEM_SECRET_FILE", file.c_str(), 1);
  std::atexit(RemoveSecret);
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleMock(&argc, argv);
  ShareOneDeploymentSecret();
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& u = *::testing::UnitTest::GetInstance();
  if (rc == 0 && u.failed_test_count() == 0 && u.successful_test_count() == 0 && u.skipped_test_count() > 0) {
    return 77;
  }
  return rc;
}
