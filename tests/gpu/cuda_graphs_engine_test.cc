// The CUDA engine with its layer parts replayed as CUDA graphs (ComputeBackendOptions::cuda_graphs,
// rows padded up to a bucket) gives the same greedy tokens as with every kernel launched one by
// one, on the reference checkpoints, for a mixed batch whose step sizes cross many buckets; and
// the phase timer still sees the graphs' GEMMs. Skips without a GPU.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "colocated/engine.h"
#include "engine_compare.h"
#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "param_names.h"

namespace tandem {
namespace {

std::string ModelDir(const std::string& model) {
  const char* src = std::getenv("TANDEM_SOURCE_DIR");  // set by ctest
  return std::string(src ? src : ".") + "/tests/data/reference/" + model;
}

// 40 requests with prompts of 1-97 tokens and 3-17 new tokens: with 24 requests a step and 128
// rows, steps run 1..128 rows, prefill chunks beside decodes.
std::vector<GenerationRequest> MixedRequests(int64_t vocab) {
  uint32_t x = 977;
  std::vector<GenerationRequest> out;
  for (int i = 0; i < 40; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 1 + (i * 29) % 97; ++j) {
      x = x * 1664525u + 1013904223u;
      r.prompt.push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2)));
    }
    r.max_tokens = 3 + (i * 7) % 15;
    r.ignore_eos = true;
    out.push_back(r);
  }
  return out;
}

struct EngineRun {
  std::vector<GenerationResult> results;
  std::vector<std::pair<std::string, double>> phases;
};

EngineRun Generate(const std::string& model, bool graphs) {
  absl::StatusOr<std::unique_ptr<WeightSource>> source = OpenModel(ModelDir(model), 0);
  EXPECT_TRUE(source.ok()) << source.status();
  if (!source.ok()) return {};
  EngineOptions o;
  o.device = "cuda";
  o.max_batch_size = 24;
  o.max_tokens_per_step = 128;
  o.kv_capacity_tokens = 16384;
  o.prefix_cache = false;
  o.profile = true;
  o.cuda_graphs = graphs;
  absl::StatusOr<std::unique_ptr<ColocatedEngine>> engine = ColocatedEngine::Create(**source, o);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  absl::StatusOr<std::vector<GenerationResult>> res =
      (*engine)->GenerateAll(MixedRequests((*source)->spec().vocab_size));
  EXPECT_TRUE(res.ok()) << res.status();
  if (!res.ok()) return {};
  return {*res, (*engine)->PhaseTotalsMs()};
}

class CudaGraphsEngine : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaGraphsEngine, SameTokensAsEagerLaunches) {
  TANDEM_SKIP_WITHOUT_GPU();
  const EngineRun eager = Generate(GetParam(), false);
  const EngineRun graphs = Generate(GetParam(), true);
  ASSERT_EQ(eager.results.size(), 40u);
  ASSERT_EQ(graphs.results.size(), 40u);
  // A padded step runs its GEMMs with more rows, for which cuBLAS may pick another kernel (another
  // summation order): logprobs may move by fp32/bf16 rounding, and a rounding may flip a near-tie.
  const testing_gpu::RunComparison cmp =
      testing_gpu::CompareUpToNearTies(eager.results, graphs.results, 0.05);
  const int diverged = cmp.diverged;
  const double max_diff = cmp.max_diff;
  std::printf("%s: %d/40 requests differ (at near-ties), max |logprob difference| before that %.3g\n",
              GetParam().c_str(), diverged, max_diff);
  EXPECT_LT(max_diff, 0.05);
  EXPECT_LE(diverged, 4);
  double gemm = 0, attention = 0;
  for (const auto& [name, ms] : graphs.phases) {
    if (name == "gemm") gemm = ms;
    if (name == "attention") attention = ms;
  }
  EXPECT_GT(gemm, 0) << "the graphs' GEMMs are not timed";
  EXPECT_GT(attention, 0);
}

INSTANTIATE_TEST_SUITE_P(Reference, CudaGraphsEngine,
                         ::testing::Values("llama3-gqa-tied", "llama2-mha", "mqa-headdim"),
                         testing_names::ModelParamName());

}  // namespace
}  // namespace tandem
