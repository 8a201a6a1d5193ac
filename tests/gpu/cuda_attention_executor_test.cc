// The CUDA attention executor against the CPU one on the same step plans, with shared-prefix
// groups (cascade: gather, non-causal prefix attention with splits, suffix decode/prefill with
// lse, merges per level) and without. Inputs are bf16-representable random values, so both
// executors see identical numbers; outputs agree to bf16 rounding. Skips without a GPU.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_table.h"

namespace tandem {
namespace {

struct Shape {
  int64_t heads, kv_heads, head_dim;
};

StepRequest Req(uint64_t id, int32_t position, int32_t q_len, uint64_t attach = 0, int32_t group = -1) {
  StepRequest r;
  r.request_id = id;
  r.position = position;
  r.q_len = q_len;
  r.kv_len = position + q_len;
  r.attach_hash = attach;
  r.prefix_group = group;
  return r;
}

class CudaExecutorCascade : public ::testing::TestWithParam<std::tuple<Shape, int64_t>> {};

TEST_P(CudaExecutorCascade, MatchesCpuExecutorWithAndWithoutGroups) {
  TANDEM_SKIP_WITHOUT_GPU();
  const auto [sh, block] = GetParam();
  const AttentionShape shape{.num_layers = 2,
                             .num_heads = sh.heads,
                             .num_kv_heads = sh.kv_heads,
                             .head_dim = sh.head_dim,
                             .max_tokens = 4096,
                             .max_requests = 256};
  const KvPoolOptions kv{.capacity_tokens = 60000};
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> cpu = CreateCpuAttentionExecutor(shape, kv);
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> gpu = CreateCudaAttentionExecutor(shape, kv, 0, nullptr);
  absl::StatusOr<std::unique_ptr<AttentionExecutor>> gpu_plain =
      CreateCudaAttentionExecutor(shape, kv, 0, nullptr);
  ASSERT_TRUE(cpu.ok() && gpu.ok() && gpu_plain.ok());
  KvTable t_cpu(60000, block), t_gpu(60000, block), t_plain(60000, block);
  t_cpu.SetPrefixSharing(PrefixSharing::kOn);
  t_gpu.SetPrefixSharing(PrefixSharing::kOn);
  t_plain.SetPrefixSharing(PrefixSharing::kOff);

  // Step 0: leader 0 prefills 3 * 512 + 5 tokens and publishes its 3 * 512 / block blocks; leader
  // 1 prefills a different prompt of 2 blocks.
  const int32_t big = static_cast<int32_t>(3 * 512 / block) * static_cast<int32_t>(block);
  std::vector<StepPlan> plans;
  {
    StepPlan p;
    p.step_id = 0;
    p.requests = {Req(0, 0, big + 5), Req(1, 0, static_cast<int32_t>(2 * block) + 3)};
    for (int32_t i = 0; i < big / block; ++i)
      p.publishes.push_back({.request_id = 0,
                             .block_hash = 1000u + static_cast<uint64_t>(i),
                             .parent_hash = i == 0 ? 0 : 999u + static_cast<uint64_t>(i),
                             .block_index = i});
    for (int32_t i = 0; i < 2; ++i)
      p.publishes.push_back({.request_id = 1,
                             .block_hash = 5000u + static_cast<uint64_t>(i),
                             .parent_hash = i == 0 ? 0 : 4999u + static_cast<uint64_t>(i),
                             .block_index = i});
    plans.push_back(p);
  }
  // Step 1: groups. G0: leader 0's first block (level 0); G1: its whole chain (nested, level 1);
  // G2: leader 1's 2 blocks. Members attach (single rows and chunks) or decode.
  const int32_t nblocks = big / static_cast<int32_t>(block);
  {
    StepPlan p;
    p.step_id = 1;
    p.groups = {{.block_hash = 1000, .prefix_tokens = static_cast<int32_t>(block), .parent = -1},
                {.block_hash = 1000u + static_cast<uint64_t>(nblocks - 1), .prefix_tokens = big, .parent = 0},
                {.block_hash = 5001, .prefix_tokens = static_cast<int32_t>(2 * block), .parent = -1}};
    p.requests.push_back(Req(0, big + 5, 1, 0, 1));                              // leader 0 decodes
    p.requests.push_back(Req(1, static_cast<int32_t>(2 * block) + 3, 1, 0, 2));  // leader 1 decodes
    for (uint64_t id = 10; id < 40; ++id) p.requests.push_back(Req(id, big, 1, 1000u + nblocks - 1, 1));
    for (uint64_t id = 40; id < 60; ++id)
      p.requests.push_back(Req(id, static_cast<int32_t>(block), 1, 1000, 0));
    for (uint64_t id = 60; id < 70; ++id)
      p.requests.push_back(Req(id, static_cast<int32_t>(2 * block), 1, 5001, 2));
    p.requests.push_back(Req(70, 0, 1));  // ungrouped
    // Chunks (multi-row) last.
    p.requests.push_back(Req(80, big, 37, 1000u + nblocks - 1, 1));
    p.requests.push_back(Req(81, static_cast<int32_t>(block), 9, 1000, 0));
    p.requests.push_back(Req(82, static_cast<int32_t>(2 * block), 70, 5001, 2));
    p.requests.push_back(Req(83, 0, 12));
    plans.push_back(p);
  }
  // Step 2: everyone decodes one more row, same groups.
  {
    StepPlan p = plans[1];
    p.step_id = 2;
    for (StepRequest& r : p.requests) {
      r.position = r.kv_len;
      r.q_len = 1;
      r.kv_len = r.position + 1;
      r.attach_hash = 0;
    }
    plans.push_back(p);
  }

  std::mt19937 rng(7);
  const int64_t width = shape.qkv_width(), qd = shape.q_dim();
  for (const StepPlan& plan : plans) {
    SCOPED_TRACE(testing::Message() << "step " << plan.step_id);
    AttentionBatch b_cpu, b_gpu, b_plain;
    ASSERT_TRUE(t_cpu.Apply(plan, 0, &b_cpu).ok());
    const absl::Status sg = t_gpu.Apply(plan, 0, &b_gpu);
    ASSERT_TRUE(sg.ok()) << sg;
    ASSERT_TRUE(t_plain.Apply(plan, 0, &b_plain).ok());
    if (plan.step_id > 0) {
      ASSERT_EQ(b_gpu.num_groups(), 3);
      ASSERT_EQ(b_plain.num_groups(), 0);
    }
    ASSERT_TRUE((*cpu)->BeginStep(b_cpu).ok());
    ASSERT_TRUE((*gpu)->BeginStep(b_gpu).ok());
    ASSERT_TRUE((*gpu_plain)->BeginStep(b_plain).ok());
    const int64_t t = b_cpu.num_tokens();
    for (int64_t layer = 0; layer < shape.num_layers; ++layer) {
      std::vector<__nv_bfloat16> qkv_bf16;
      std::vector<float> qkv;
      testing_gpu::RandomBf16(rng, t * width, -2.0f, 2.0f, &qkv_bf16, &qkv);
      std::vector<float> out_cpu(static_cast<size_t>(t * qd));
      ASSERT_TRUE((*cpu)->Layer(layer, qkv.data(), out_cpu.data()).ok());
      testing_gpu::GuardedBuffer<__nv_bfloat16> d_qkv(t * width), d_out(t * qd), d_out_plain(t * qd);
      d_qkv.Upload(qkv_bf16);
      ASSERT_TRUE((*gpu)->Layer(layer, d_qkv.get(), d_out.get()).ok());
      ASSERT_TRUE((*gpu_plain)->Layer(layer, d_qkv.get(), d_out_plain.get()).ok());
      CUDA_ASSERT_OK(cudaDeviceSynchronize());
      std::vector<float> got, plain;
      for (__nv_bfloat16 v : d_out.Download()) got.push_back(testing_gpu::ToFloat(v));
      for (__nv_bfloat16 v : d_out_plain.Download()) plain.push_back(testing_gpu::ToFloat(v));
      double max_cascade = 0, max_plain = 0;
      int64_t worst = -1;
      for (size_t i = 0; i < got.size(); ++i) {
        const double e = std::fabs(got[i] - out_cpu[i]);
        if (!(e <= max_cascade)) {
          max_cascade = e;
          worst = static_cast<int64_t>(i);
        }
        max_plain = std::max(max_plain, static_cast<double>(std::fabs(plain[i] - out_cpu[i])));
      }
      // Which rows are off: (request id, row in request, max error), at most 12.
      int printed = 0;
      std::vector<const StepRequest*> mine;
      for (const StepRequest& r : plan.requests) mine.push_back(&r);
      for (int64_t row = 0; row < t && printed < 12; ++row) {
        double e = 0;
        for (int64_t c = 0; c < qd; ++c) {
          const size_t i = static_cast<size_t>(row * qd + c);
          e = std::max(e, static_cast<double>(std::fabs(got[i] - out_cpu[i])));
        }
        if (e < 3e-2) continue;
        size_t r = 0;
        while (b_cpu.q_indptr[r + 1] <= row) ++r;
        std::printf("  layer %lld row %lld: request %llu (group %d, q_len %d) row %lld, max error %.3g\n",
                    static_cast<long long>(layer), static_cast<long long>(row),
                    static_cast<unsigned long long>(mine[r]->request_id), mine[r]->prefix_group,
                    mine[r]->q_len, static_cast<long long>(row - b_cpu.q_indptr[r]), e);
        ++printed;
      }
      double sq_cascade = 0, sq_plain = 0, sq_ref = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        sq_cascade += (got[i] - out_cpu[i]) * (got[i] - out_cpu[i]);
        sq_plain += (plain[i] - out_cpu[i]) * (plain[i] - out_cpu[i]);
        sq_ref += out_cpu[i] * out_cpu[i];
      }
      std::printf(
          "step %llu layer %lld: vs fp32 CPU, max |error| plain %.3g cascade %.3g; relative RMS plain "
          "%.3g cascade %.3g\n",
          static_cast<unsigned long long>(plan.step_id), static_cast<long long>(layer), max_plain,
          max_cascade, std::sqrt(sq_plain / sq_ref), std::sqrt(sq_cascade / sq_ref));
      EXPECT_LT(max_plain, 3e-2) << "layer " << layer << " (plain CUDA vs CPU)";
      EXPECT_LT(max_cascade, 3e-2) << "layer " << layer << ": worst row " << worst / qd << " head "
                                   << (worst % qd) / sh.head_dim;
      EXPECT_TRUE(d_out.GuardsIntact());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaExecutorCascade,
                         ::testing::Combine(::testing::Values(Shape{4, 2, 64}, Shape{4, 4, 64},
                                                              Shape{8, 1, 128}, Shape{32, 8, 128}),
                                            ::testing::Values(int64_t{16}, int64_t{64})));

}  // namespace
}  // namespace tandem
