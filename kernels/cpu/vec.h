// The fp32 inner loops of the CPU attention ops, shared by Attention (attention.cc) and
// PrefixAttention (prefix_attention.cc). One definition on purpose: a prefix that a row sees whole
// gives the same bits through either op only because both sum in exactly this order.
#pragma once

#include <cstdint>

namespace tandem::kernels::cpu {

// fp32 dot product with 8 independent partial sums (vectorisable, and a fixed order).
inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// acc += w · v, 8 lanes at a time (vectorisable: the pointers are declared not to alias).
inline void Axpy(float w, const float* __restrict v, float* __restrict acc, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) acc[i + l] += w * v[i + l];
  }
  for (; i < n; ++i) acc[i] += w * v[i];
}

}  // namespace tandem::kernels::cpu
