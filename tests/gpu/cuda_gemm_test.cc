// The CUDA backend's GEMMs against the CPU reference cpu::Matmul (fp32 on the exact values of
// random bf16 inputs): Gemv directly, and CublasGemm::Run, which sends m = 1 to Gemv and the rest
// to cuBLAS, over m = 1–20, odd n (the last block's partial columns), k
// from 8 to 14336, strided x and y rows, bf16 and fp32 outputs and the fp32 accumulate (residual
// add). Fresh random inputs per case (seeded by the shape); every output sits in a GuardedBuffer
// whose guards must stay intact, and y starts as random values so that an unwritten element fails.
//
// Tolerance: the GPU sums the same products in another order, in fp32: |gpu − ref| ≤
// 1e-5 · Σ|x·w| (fp32 rounding over k ≤ 14336 terms grows far slower than k·2^-24 ≈ 9e-4 of that
// sum; the bound is a few fp32 ulps of the absolute sum), plus one bf16 ulp of ref for bf16 outputs.
// Gemv reduces in a fixed order: two runs are bit-equal.
// RejectsUnsupported touches no device memory and runs without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

// gpu_test_util.h memcpy's into __nv_bfloat16 (fine, but -Wclass-memaccess flags it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclass-memaccess"
#include "gpu_test_util.h"
#pragma GCC diagnostic pop
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/gemm.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::Bf16Ulp;
using ::tandem::testing_gpu::GuardedBuffer;
using ::tandem::testing_gpu::RandomBf16;
using ::tandem::testing_gpu::ToFloat;
using bf16 = __nv_bfloat16;

struct Case {
  int64_t m, n, k;
  int64_t x_pad = 0, y_pad = 0;  // extra elements per row (strided rows)
  bool y_fp32 = false, accumulate = false;
  std::string Name() const {
    std::ostringstream s;
    s << "m " << m << " n " << n << " k " << k << " x_pad " << x_pad << " y_pad " << y_pad
      << (y_fp32 ? (accumulate ? " fp32+=" : " fp32") : " bf16");
    return s.str();
  }
};

enum class Path { kGemv, kRun };

// Runs one case on the GPU through `path` and compares with the CPU; returns the GPU's output
// (as floats, padded rows included) for the determinism check.
std::vector<float> CheckCase(const Case& c, Path path, uint32_t seed) {
  SCOPED_TRACE(c.Name());
  std::mt19937 rng(seed);
  const int64_t ldx = c.k + c.x_pad, ldy = c.n + c.y_pad;
  std::vector<bf16> x, w, y0;
  std::vector<float> xf, wf, y0f;
  RandomBf16(rng, c.m * ldx, -1.0f, 1.0f, &x, &xf);
  RandomBf16(rng, c.n * c.k, -1.0f, 1.0f, &w, &wf);
  RandomBf16(rng, c.m * ldy, -4.0f, 4.0f, &y0, &y0f);  // the residual, and poison for the others

  // Reference: y = x·wᵀ (+ y0), with the absolute sums for the bound.
  std::vector<float> want(static_cast<size_t>(c.m * c.n)), abs_sum(want.size());
  cpu::MatmulParams mp;
  mp.x = xf.data();
  mp.w = wf.data();
  mp.y = want.data();
  mp.m = c.m;
  mp.n = c.n;
  mp.k = c.k;
  mp.x_stride = ldx;
  EXPECT_TRUE(cpu::Matmul(mp).ok());
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t j = 0; j < c.n; ++j) {
      double s = 0;
      for (int64_t i = 0; i < c.k; ++i) s += std::abs(double{xf[r * ldx + i]} * wf[j * c.k + i]);
      abs_sum[r * c.n + j] = static_cast<float>(s);
      if (c.accumulate) want[r * c.n + j] += y0f[r * ldy + j];
    }
  }

  GuardedBuffer<bf16> dx(c.m * ldx), dw(c.n * c.k);
  dx.Upload(x);
  dw.Upload(w);
  GuardedBuffer<float> dy32(c.y_fp32 ? c.m * ldy : 1);
  GuardedBuffer<bf16> dy16(c.y_fp32 ? 1 : c.m * ldy);
  if (c.y_fp32) {
    dy32.Upload(y0f);
  } else {
    dy16.Upload(y0);
  }
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  GemmParams p{.x = dx.get(),
               .w = dw.get(),
               .y = c.y_fp32 ? static_cast<void*>(dy32.get()) : static_cast<void*>(dy16.get()),
               .y_fp32 = c.y_fp32,
               .accumulate = c.accumulate,
               .m = c.m,
               .n = c.n,
               .k = c.k,
               .x_stride = ldx,
               .y_stride = ldy};
  absl::Status st;
  if (path == Path::kGemv) {
    EXPECT_TRUE(GemvSupports(p));
    st = Gemv(p, stream);
  } else {
    auto gemm = CublasGemm::Create(stream);
    EXPECT_TRUE(gemm.ok()) << gemm.status();
    if (gemm.ok()) st = (*gemm)->Run(p);
  }
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  cudaStreamDestroy(stream);

  std::vector<float> got(static_cast<size_t>(c.m * ldy));
  if (c.y_fp32) {
    got = dy32.Download();
    EXPECT_TRUE(dy32.GuardsIntact());
  } else {
    const std::vector<bf16> g = dy16.Download();
    for (size_t i = 0; i < g.size(); ++i) got[i] = ToFloat(g[i]);
    EXPECT_TRUE(dy16.GuardsIntact());
  }
  int64_t bad = 0;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t j = 0; j < ldy; ++j) {
      const float g = got[r * ldy + j];
      if (j >= c.n) {  // padding between rows: untouched
        const float before = c.y_fp32 ? y0f[r * ldy + j] : ToFloat(y0[r * ldy + j]);
        if (std::memcmp(&g, &before, sizeof(float)) != 0 && bad++ < 5)
          ADD_FAILURE() << "row " << r << " padding column " << j << " was written";
        continue;
      }
      const float ref = want[r * c.n + j];
      const double tol = 1e-5 * abs_sum[r * c.n + j] + (c.y_fp32 ? 0.0 : Bf16Ulp(ref));
      if (!(std::abs(double{g} - ref) <= tol) && bad++ < 5)
        ADD_FAILURE() << "y[" << r << ", " << j << "] = " << g << ", want " << ref << " (tol " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0);
  return got;
}

std::vector<Case> RandomCases(uint32_t seed, int64_t max_m, int count) {
  std::mt19937 rng(seed);
  std::vector<Case> cases;
  const int64_t ks[] = {8, 24, 136, 1000, 4096, 14336};
  for (int i = 0; i < count; ++i) {
    Case c;
    c.m = 1 + static_cast<int64_t>(rng() % max_m);
    c.k = ks[rng() % 6];
    c.n = 1 + static_cast<int64_t>(rng() % (c.k >= 4096 ? 300 : 1100));
    c.x_pad = (rng() % 3 == 0) ? 8 * (1 + rng() % 4) : 0;
    c.y_pad = (rng() % 3 == 0) ? 1 + rng() % 7 : 0;
    const int out = static_cast<int>(rng() % 3);
    c.y_fp32 = out > 0;
    c.accumulate = out == 2;
    cases.push_back(c);
  }
  // Fixed corners: one column; n not a multiple of the kernel's columns per block; the largest k.
  cases.push_back({1, 1, 8});
  cases.push_back({max_m, 7, 4096, 0, 0, true, true});
  cases.push_back({max_m, 4099, 14336, 16, 3, false, false});
  return cases;
}

TEST(CudaGemmTest, GemvMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  for (const Case& c : RandomCases(11, 1, 30)) {
    CheckCase(c, Path::kGemv, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(CudaGemmTest, RunMatchesCpuOnBothPaths) {
  TANDEM_SKIP_WITHOUT_GPU();
  uint32_t seed = 100;
  for (const Case& c : RandomCases(12, 20, 30)) {
    CheckCase(c, Path::kRun, ++seed);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(CudaGemmTest, GemvIsDeterministic) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Case c{1, 513, 14336, 0, 0, true, false};
  const std::vector<float> a = CheckCase(c, Path::kGemv, 7), b = CheckCase(c, Path::kGemv, 7);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

TEST(CudaGemmTest, RejectsUnsupported) {
  alignas(16) static bf16 buf[64];
  GemmParams p{.x = buf, .w = buf, .y = buf, .m = 1, .n = 4, .k = 16};
  EXPECT_TRUE(GemvSupports(p));
  GemmParams bad = p;
  bad.k = 12;  // not a multiple of 8
  EXPECT_FALSE(GemvSupports(bad));
  EXPECT_EQ(Gemv(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
  bad = p;
  bad.m = 2;
  EXPECT_FALSE(GemvSupports(bad));
  bad = p;
  bad.x = buf + 1;  // misaligned
  EXPECT_FALSE(GemvSupports(bad));
  bad = p;
  bad.accumulate = true;  // needs fp32 output
  EXPECT_FALSE(GemvSupports(bad));
  bad = p;
  bad.w = nullptr;
  EXPECT_EQ(Gemv(bad, nullptr).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::kernels::cuda
