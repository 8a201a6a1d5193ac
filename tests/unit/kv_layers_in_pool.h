// Shared by the KV tiers tests on the CPU (unit/kv_tiers_test.cc) and the GPU
// (gpu/cuda_kv_tiers_test.cc): how far a layer-wise restore has reached the pool.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "memory_node/attention_executor.h"

namespace tandem::testing_tiers {

// How many leading layers of `slots` in the executor's pool hold the block `kv` (ReadSlots'
// layout, `layers` layers); every layer must be either the block's or still `garbage` (what was
// written there before the restore). `pool` receives what ReadSlots read.
inline int LayersInPool(const AttentionExecutor& exec, std::span<const int32_t> slots,
                        const std::vector<uint8_t>& kv, const std::vector<uint8_t>& garbage, int layers,
                        std::vector<uint8_t>* pool) {
  pool->assign(kv.size(), 0);
  EXPECT_TRUE(exec.ReadSlots(slots, pool->data()).ok());
  const size_t layer_bytes = kv.size() / static_cast<size_t>(layers);
  int n = 0;
  for (int l = 0; l < layers; ++l) {
    const auto at = static_cast<std::ptrdiff_t>(static_cast<size_t>(l) * layer_bytes);
    const auto end = at + static_cast<std::ptrdiff_t>(layer_bytes);
    const bool restored = std::equal(pool->begin() + at, pool->begin() + end, kv.begin() + at);
    const bool untouched = std::equal(pool->begin() + at, pool->begin() + end, garbage.begin() + at);
    EXPECT_TRUE(restored || untouched) << "layer " << l << " is neither the block's KV nor untouched";
    if (restored && n == l) ++n;
  }
  return n;
}

}  // namespace tandem::testing_tiers
