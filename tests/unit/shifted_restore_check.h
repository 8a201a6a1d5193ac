// Shared by the KV tiers tests on the CPU (unit/kv_tiers_test.cc) and the GPU
// (gpu/cuda_kv_tiers_test.cc): a shifted restore (kv.store_pre_rope, KvTiers::RestoreShifted)
// assembles a block from rows of a block in the pool and of a block only the host tier holds, and
// turns their keys to the new positions; AttentionExecutor::CopySlots' refusals.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "common/dtype.h"
#include "common/model_spec.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "memory_node/attention_executor.h"
#include "memory_node/kv_tiers.h"

namespace tandem::testing_tiers {

// Blocks of 4 tokens: A (positions 8..11) stays in the pool, B (12..15) is demoted and its slots
// overwritten; the new block at positions 4..7 takes A's rows 2, 3 and B's rows 0, 1. Its keys must
// equal cpu::RopeShift of the source keys (exactly on an fp32 pool, within one bf16 step of the
// fp32 result on a bf16 one), its values the sources' bytes; a source that no tier holds, or
// segments that do not fill the block, make the restore fail.
inline void CheckShiftedRestore(AttentionExecutor& exec) {
  const AttentionShape& shape = exec.shape();
  const bool bf16 = exec.dtype() == DType::kBF16;
  ASSERT_TRUE(bf16 || exec.dtype() == DType::kF32);
  constexpr int64_t kB = 4;
  const int64_t kv_dim = shape.kv_dim(), layers = shape.num_layers;
  const size_t value_bytes = bf16 ? 2 : 4;
  const size_t block_values = static_cast<size_t>(layers * 2 * kB * kv_dim);
  absl::StatusOr<std::unique_ptr<KvTiers>> tiers = KvTiers::Create({.host_bytes = 1 << 20}, &exec, kB, "m");
  ASSERT_TRUE(tiers.ok()) << tiers.status();
  RopeSpec rope{.theta = 500000.0};
  const std::vector<float> inv = kernels::cpu::RopeInvFreq(rope, shape.head_dim);
  // Values as the pool stores them (bf16 values are exact floats of bf16).
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto random_block = [&] {
    std::vector<float> v(block_values);
    for (float& x : v) x = bf16 ? Bf16ToFloat(FloatToBf16(u(rng))) : u(rng);
    return v;
  };
  const auto to_bytes = [&](const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * value_bytes);
    for (size_t i = 0; i < v.size(); ++i) {
      if (bf16) {
        const uint16_t h = FloatToBf16(v[i]);
        std::memcpy(b.data() + 2 * i, &h, 2);
      } else {
        std::memcpy(b.data() + 4 * i, &v[i], 4);
      }
    }
    return b;
  };
  const auto to_floats = [&](const std::vector<uint8_t>& b) {
    std::vector<float> v(b.size() / value_bytes);
    for (size_t i = 0; i < v.size(); ++i) {
      if (bf16) {
        uint16_t h;
        std::memcpy(&h, b.data() + 2 * i, 2);
        v[i] = Bf16ToFloat(h);
      } else {
        std::memcpy(&v[i], b.data() + 4 * i, 4);
      }
    }
    return v;
  };
  const std::vector<int32_t> slots_a = {0, 5, 2, 7}, slots_b = {9, 1, 12, 3}, fresh = {20, 21, 22, 23};
  const std::vector<float> a = random_block(), b = random_block();
  ASSERT_TRUE(exec.WriteSlots(slots_a, to_bytes(a).data()).ok());
  ASSERT_TRUE(exec.WriteSlots(slots_b, to_bytes(b).data()).ok());
  constexpr uint64_t kHashA = 0xa, kHashB = 0xb;
  (*tiers)->Demote(kHashB, kHashA, 4, slots_b, {});
  ASSERT_TRUE((*tiers)->FinishRestores().ok());
  ASSERT_TRUE(exec.WriteSlots(slots_b, to_bytes(random_block()).data()).ok());  // B lives in the tier only

  std::vector<KvShiftedSource> sources = {{.hash = kHashA,
                                           .source_index = 2,
                                           .row = 2,
                                           .rows = 2,
                                           .pool_slots = std::span(slots_a).subspan(2, 2)},
                                          {.hash = kHashB, .source_index = 3, .row = 0, .rows = 2}};
  EXPECT_FALSE((*tiers)->RestoreShifted(sources, fresh, 4)) << "no rotary frequencies set";
  (*tiers)->set_rotary(inv);
  ASSERT_TRUE((*tiers)->RestoreShifted(sources, fresh, 4));
  std::vector<uint8_t> got_bytes(block_values * value_bytes);
  ASSERT_TRUE(exec.ReadSlots(fresh, got_bytes.data()).ok());
  const std::vector<float> got = to_floats(got_bytes);
  // The expected block: per layer, K rows then V rows, rows A2, A3, B0, B1; keys turned from 10..13
  // to 4..7 in fp32.
  std::vector<float> want(block_values);
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t r = 0; r < kB; ++r) {
        const std::vector<float>& src = r < 2 ? a : b;
        const int64_t src_row = r < 2 ? r + 2 : r - 2;
        std::memcpy(want.data() + ((l * 2 + half) * kB + r) * kv_dim,
                    src.data() + ((l * 2 + half) * kB + src_row) * kv_dim,
                    static_cast<size_t>(kv_dim) * sizeof(float));
      }
    }
    const std::vector<int32_t> rows = {0, 1, 2, 3}, from = {10, 11, 12, 13}, to = {4, 5, 6, 7};
    ASSERT_TRUE(kernels::cpu::RopeShift({.k = want.data() + l * 2 * kB * kv_dim,
                                         .rows = rows.data(),
                                         .from_positions = from.data(),
                                         .to_positions = to.data(),
                                         .inv_freq = inv.data(),
                                         .n = kB,
                                         .num_rows = kB,
                                         .num_kv_heads = shape.num_kv_heads,
                                         .head_dim = shape.head_dim})
                    .ok());
  }
  for (size_t i = 0; i < want.size(); ++i) {
    const bool key = (i / static_cast<size_t>(kB * kv_dim)) % 2 == 0;
    if (!bf16 || !key) {
      ASSERT_EQ(got[i], bf16 ? Bf16ToFloat(FloatToBf16(want[i])) : want[i]) << "value " << i;
    } else {
      // One bf16 rounding of the GPU's fp32 result, which may differ from the CPU's by an fp32 ulp.
      ASSERT_NEAR(got[i], want[i], std::ldexp(std::abs(want[i]), -7) + 1e-6) << "key value " << i;
    }
  }
  // A source the tiers never held, or segments that leave rows empty: no restore.
  sources[1].hash = 0xc;
  EXPECT_FALSE((*tiers)->RestoreShifted(sources, fresh, 4));
  sources[1].hash = kHashB;
  sources.pop_back();
  EXPECT_FALSE((*tiers)->RestoreShifted(sources, fresh, 4));
  // CopySlots refuses copies onto a source, repeated or outside targets and mismatched lengths,
  // before anything moves.
  const std::vector<int32_t> two = {0, 5}, onto = {5, 20}, twice = {20, 20}, outside = {20, 32}, one = {20};
  for (const std::vector<int32_t>* dst : {&onto, &twice, &outside, &one}) {
    EXPECT_EQ(exec.CopySlots(two, *dst).code(), absl::StatusCode::kInvalidArgument);
  }
  std::vector<uint8_t> after(got_bytes.size());
  ASSERT_TRUE(exec.ReadSlots(fresh, after.data()).ok());
  EXPECT_EQ(after, got_bytes) << "a refused copy changed the pool";
}

}  // namespace tandem::testing_tiers
