// cuda::Embedding, AddRmsNorm, Rope, RopeShift, CopyRows, SiluMul and KvAppend against the CPU references
// (fp32) on the exact fp32 values of random bf16 inputs (fixed seeds), aligned and odd shapes (n = 17, d =
// 97, strided rows, misaligned pointers for the scalar paths). Every device output sits in a GuardedBuffer
// whose guards must stay intact; NaN in an output always fails.
//
// Tolerances (reasons):
//   Embedding, KvAppend, the fp32 residual of AddRmsNorm: exact (copies and one fp32 add, the
//     same operation as on the CPU).
//   AddRmsNorm and SiluMul outputs: |gpu - ref| <= 1 bf16 ulp of ref. The output is the fp32
//     result rounded to bf16; the GPU's fp32 value equals the reference's or is within a few fp32
//     ulps (expf, sum order), so rounding lands on the nearest or the neighbouring bf16 value.
//   Rope: |gpu - ref| <= 1 bf16 ulp of ref + 1e-6. Same rounding argument; the kernel forms the
//     fp32 angle and the products exactly as the CPU does, and the absolute term covers cos/sin
//     differing by one fp32 ulp (inputs are at most 1 in magnitude) where a result cancels to
//     nearly 0. Much tighter than ~1e-2, so an angle formed in double instead of fp32 (off by up
//     to ~6e-3 rad at position 1e5) would fail.
// RejectsInvalidParams touches no device memory and runs without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
// gpu_test_util.h memcpy's into __nv_bfloat16 (fine, but -Wclass-memaccess flags it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclass-memaccess"
#include "gpu_test_util.h"
#pragma GCC diagnostic pop
#include "common/model_spec.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::Bf16Ulp;
using ::tandem::testing_gpu::GuardedBuffer;
using ::tandem::testing_gpu::RandomBf16;
using ::tandem::testing_gpu::ToFloat;
using ::testing::HasSubstr;

std::vector<float> ToFloats(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = ToFloat(v[i]);
  return f;
}

std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(rng);
  return v;
}

// got[i] within tol(want[i]) of want[i] for every i (NaN fails); reports the first few misses.
template <typename Tol>
::testing::AssertionResult AllClose(const std::vector<float>& got, const std::vector<float>& want, Tol tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  int64_t bad = 0;
  std::ostringstream msg;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    if (std::isnan(got[i]) || std::isnan(want[i]) || !(err <= tol(want[i]))) {
      if (bad++ < 5)
        msg << "\n  [" << i << "] got " << got[i] << " want " << want[i] << " (tol " << tol(want[i]) << ")";
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements off:" << msg.str();
}

::testing::AssertionResult BitEqual(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "[" << i << "] got " << got[i] << " want " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

auto OneBf16Ulp() {
  return [](float want) { return Bf16Ulp(want); };
}

// ---- Embedding -----------------------------------------------------------------------------------

void CheckEmbedding(int64_t n, int64_t vocab, int64_t hidden, int64_t table_offset) {
  SCOPED_TRACE("n " + std::to_string(n) + " vocab " + std::to_string(vocab) + " hidden " +
               std::to_string(hidden) + " table offset " + std::to_string(table_offset));
  std::mt19937 rng(static_cast<uint32_t>(hidden * 7 + table_offset));
  std::vector<bf16> table;
  std::vector<float> table_f;
  RandomBf16(rng, vocab * hidden, -2.0f, 2.0f, &table, &table_f);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = pick(rng);
  const bool with_bad_ids = n > 11;
  if (with_bad_ids) {
    ids[3] = -1;                           // out of range: a zero row
    ids[7] = static_cast<int32_t>(vocab);  // out of range: a zero row
    ids[11] = static_cast<int32_t>(vocab - 1);
  }

  std::vector<int32_t> valid_ids = ids;
  for (int32_t& id : valid_ids) id = std::clamp<int32_t>(id, 0, static_cast<int32_t>(vocab - 1));
  std::vector<float> want(static_cast<size_t>(n * hidden));
  cpu::EmbeddingParams cp;
  cp.ids = valid_ids.data();
  cp.table = table_f.data();
  cp.out = want.data();
  cp.n = n;
  cp.vocab = vocab;
  cp.hidden = hidden;
  ASSERT_TRUE(cpu::Embedding(cp).ok());
  if (with_bad_ids) {
    for (const int row : {3, 7}) std::fill_n(want.begin() + row * hidden, hidden, 0.0f);
  }

  GuardedBuffer<int32_t> d_ids(n);
  GuardedBuffer<bf16> d_table(vocab * hidden + table_offset);
  GuardedBuffer<float> d_out(n * hidden);
  d_ids.Upload(ids);
  std::vector<bf16> padded(static_cast<size_t>(table_offset), table[0]);
  padded.insert(padded.end(), table.begin(), table.end());
  d_table.Upload(padded);
  EmbeddingParams p;
  p.ids = d_ids.get();
  p.table = d_table.get() + table_offset;
  p.out = d_out.get();
  p.n = n;
  p.vocab = vocab;
  p.hidden = hidden;
  const absl::Status st = Embedding(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(BitEqual(d_out.Download(), want));
  EXPECT_TRUE(d_out.GuardsIntact());
}

TEST(CudaOpsTest, EmbeddingMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  CheckEmbedding(17, 1000, 256, 0);  // 16-byte path
  CheckEmbedding(17, 1000, 97, 0);   // odd hidden
  CheckEmbedding(17, 1000, 256, 1);  // misaligned table: scalar path
  CheckEmbedding(1, 1, 8, 0);
}

// ---- AddRmsNorm ----------------------------------------------------------------------------------

struct NormCase {
  int64_t n, d;
  bool delta;
  std::vector<int32_t> out_rows;  // empty: all rows
};

void CheckAddRmsNorm(const NormCase& c) {
  SCOPED_TRACE("n " + std::to_string(c.n) + " d " + std::to_string(c.d) + (c.delta ? " delta" : " no delta") +
               (c.out_rows.empty() ? "" : " out_rows"));
  std::mt19937 rng(static_cast<uint32_t>(c.n * 1000 + c.d + (c.delta ? 1 : 0)));
  const std::vector<float> residual = RandomFloats(rng, c.n * c.d, -3.0f, 3.0f);
  std::vector<bf16> delta, weight;
  std::vector<float> delta_f, weight_f;
  RandomBf16(rng, c.n * c.d, -1.0f, 1.0f, &delta, &delta_f);
  RandomBf16(rng, c.d, 0.5f, 1.5f, &weight, &weight_f);
  const float eps = 1e-5f;

  // Reference: all rows, then the gathered ones.
  std::vector<float> ref_residual = residual, ref_out(static_cast<size_t>(c.n * c.d));
  cpu::RmsNormParams cp;
  cp.x = c.delta ? delta_f.data() : ref_residual.data();
  cp.residual = c.delta ? ref_residual.data() : nullptr;
  cp.weight = weight_f.data();
  cp.out = ref_out.data();
  cp.n = c.n;
  cp.d = c.d;
  cp.eps = eps;
  ASSERT_TRUE(cpu::RmsNorm(cp).ok());
  const int64_t n_out = c.out_rows.empty() ? c.n : static_cast<int64_t>(c.out_rows.size());
  std::vector<float> want(static_cast<size_t>(n_out * c.d));
  for (int64_t j = 0; j < n_out; ++j) {
    const int64_t src = c.out_rows.empty() ? j : c.out_rows[static_cast<size_t>(j)];
    std::copy_n(ref_out.begin() + src * c.d, c.d, want.begin() + j * c.d);
  }

  GuardedBuffer<float> d_residual(c.n * c.d);
  GuardedBuffer<bf16> d_delta(c.n * c.d), d_weight(c.d), d_out(n_out * c.d);
  GuardedBuffer<int32_t> d_rows(std::max<int64_t>(1, static_cast<int64_t>(c.out_rows.size())));
  d_residual.Upload(residual);
  d_delta.Upload(delta);
  d_weight.Upload(weight);
  if (!c.out_rows.empty()) d_rows.Upload(c.out_rows);
  AddRmsNormParams p;
  p.residual = d_residual.get();
  p.delta = c.delta ? d_delta.get() : nullptr;
  p.weight = d_weight.get();
  p.out = d_out.get();
  p.out_rows = c.out_rows.empty() ? nullptr : d_rows.get();
  p.n = c.n;
  p.d = c.d;
  p.n_out = c.out_rows.empty() ? 0 : n_out;
  p.eps = eps;
  const absl::Status st = AddRmsNorm(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(BitEqual(d_residual.Download(), ref_residual)) << "residual after the add";
  EXPECT_TRUE(AllClose(ToFloats(d_out.Download()), want, OneBf16Ulp())) << "normalised output";
  EXPECT_TRUE(d_residual.GuardsIntact());
  EXPECT_TRUE(d_out.GuardsIntact());
}

TEST(CudaOpsTest, AddRmsNormMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  CheckAddRmsNorm({17, 4096, true, {}});
  CheckAddRmsNorm({17, 4096, false, {}});
  CheckAddRmsNorm({17, 97, true, {}});
  CheckAddRmsNorm({17, 97, false, {}});
  CheckAddRmsNorm({17, 4096, true, {16, 3, 3, 0, 9}});  // gather (the LM-head rows), duplicates
  CheckAddRmsNorm({17, 97, true, {5}});
  CheckAddRmsNorm({17, 4096, false, {2, 16}});
  CheckAddRmsNorm({3, 40000, true, {}});  // rows longer than the register cache (vector path)
  CheckAddRmsNorm({3, 3001, true, {}});   // rows longer than the register cache (scalar path)
  CheckAddRmsNorm({1, 1, true, {}});
}

// ---- Rope ----------------------------------------------------------------------------------------

struct RopeCase {
  RopeType type;
  int64_t head_dim, num_heads, num_kv_heads;
  bool fused;   // q and k inside fused qkv rows of width q_dim + 2 kv_dim (v must stay untouched)
  bool with_k;  // rotate k too
};

void CheckRope(const RopeCase& c) {
  const int64_t n = 17;
  SCOPED_TRACE(std::string(c.type == RopeType::kLlama3 ? "llama3" : "default") + " head_dim " +
               std::to_string(c.head_dim) + (c.fused ? " fused qkv" : " packed") +
               (c.with_k ? "" : " q only"));
  RopeSpec spec;
  spec.type = c.type;
  if (c.type == RopeType::kLlama3) {
    spec.theta = 500000.0;
    spec.factor = 8.0;
    spec.low_freq_factor = 1.0;
    spec.high_freq_factor = 4.0;
    spec.original_max_position = 8192;
  }
  const std::vector<float> inv_freq = cpu::RopeInvFreq(spec, c.head_dim);
  const int64_t q_dim = c.num_heads * c.head_dim, kv_dim = c.num_kv_heads * c.head_dim;
  const int64_t width = c.fused ? q_dim + 2 * kv_dim : q_dim;
  std::mt19937 rng(static_cast<uint32_t>(c.head_dim * 3 + (c.fused ? 1 : 0) + static_cast<int>(c.type) * 11));
  std::vector<bf16> qkv, kbuf;
  std::vector<float> qkv_f, kbuf_f;
  RandomBf16(rng, n * width, -1.0f, 1.0f, &qkv, &qkv_f);
  if (!c.fused && c.with_k) RandomBf16(rng, n * kv_dim, -1.0f, 1.0f, &kbuf, &kbuf_f);
  std::uniform_int_distribution<int32_t> pos_dist(0, 131071);
  std::vector<int32_t> positions(static_cast<size_t>(n));
  for (int32_t& x : positions) x = pos_dist(rng);
  positions[0] = 0;
  positions[1] = 1;
  positions[2] = 131071;
  positions[3] = 100000;

  std::vector<float> want_qkv = qkv_f, want_k = kbuf_f;
  cpu::RopeParams cp;
  cp.q = want_qkv.data();
  cp.k = !c.with_k ? nullptr : (c.fused ? want_qkv.data() + q_dim : want_k.data());
  cp.positions = positions.data();
  cp.inv_freq = inv_freq.data();
  cp.n = n;
  cp.num_heads = c.num_heads;
  cp.num_kv_heads = c.num_kv_heads;
  cp.head_dim = c.head_dim;
  cp.q_stride = c.fused ? width : 0;
  cp.k_stride = c.fused ? width : 0;
  ASSERT_TRUE(cpu::Rope(cp).ok());

  GuardedBuffer<bf16> d_qkv(n * width), d_k(std::max<int64_t>(1, n * kv_dim));
  GuardedBuffer<int32_t> d_pos(n);
  GuardedBuffer<float> d_inv(static_cast<int64_t>(inv_freq.size()));
  d_qkv.Upload(qkv);
  if (!kbuf.empty()) d_k.Upload(kbuf);
  d_pos.Upload(positions);
  d_inv.Upload(inv_freq);
  RopeParams p;
  p.q = d_qkv.get();
  p.k = !c.with_k ? nullptr : (c.fused ? d_qkv.get() + q_dim : d_k.get());
  p.positions = d_pos.get();
  p.inv_freq = d_inv.get();
  p.n = n;
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.q_stride = cp.q_stride;
  p.k_stride = cp.k_stride;
  const absl::Status st = Rope(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  auto tol = [](float want) { return Bf16Ulp(want) + 1e-6; };
  const std::vector<float> got_qkv = ToFloats(d_qkv.Download());
  EXPECT_TRUE(AllClose(got_qkv, want_qkv, tol)) << "q (and fused k)";
  if (c.fused) {  // the v part (and k when not rotated) is untouched, bit for bit
    for (int64_t i = 0; i < n; ++i) {
      const int64_t from = i * width + q_dim + (c.with_k ? kv_dim : 0);
      for (int64_t j = from; j < (i + 1) * width; ++j) {
        ASSERT_EQ(got_qkv[static_cast<size_t>(j)], qkv_f[static_cast<size_t>(j)])
            << "untouched element " << j;
      }
    }
  }
  if (!c.fused && c.with_k) {
    EXPECT_TRUE(AllClose(ToFloats(d_k.Download()), want_k, tol)) << "k";
  }
  EXPECT_TRUE(d_qkv.GuardsIntact());
  EXPECT_TRUE(d_k.GuardsIntact());
}

TEST(CudaOpsTest, RopeMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const RopeType type : {RopeType::kDefault, RopeType::kLlama3}) {
    for (const int64_t hd : {int64_t{64}, int64_t{128}}) {
      CheckRope({type, hd, 8, 2, /*fused=*/true, /*with_k=*/true});
      CheckRope({type, hd, 4, 4, /*fused=*/false, /*with_k=*/true});
    }
  }
  CheckRope({RopeType::kDefault, 128, 8, 2, /*fused=*/true, /*with_k=*/false});  // q only, v and k untouched
  CheckRope({RopeType::kDefault, 6, 3, 1, /*fused=*/false, /*with_k=*/true});    // half = 3: scalar path
  CheckRope({RopeType::kLlama3, 10, 3, 1, /*fused=*/true, /*with_k=*/true});     // odd strides: scalar path
  CheckRope({RopeType::kDefault, 4, 1, 1, /*fused=*/false, /*with_k=*/true});    // half = 2: pairs path
}

// ---- RopeShift -----------------------------------------------------------------------------------

// Keys of random bf16 values in a cache of several layers, some rows turned from one position to
// another: against cpu::RopeShift on the same fp32 values (the kernel forms the same cos/sin and
// products, so within 1 bf16 ulp + 1e-6 as Rope); rows not listed, rows whose positions are equal
// and every V half stay bit-identical.
void CheckRopeShift(RopeType type, int64_t head_dim, int64_t kv_heads) {
  SCOPED_TRACE(std::string(type == RopeType::kLlama3 ? "llama3" : "default") + " head_dim " +
               std::to_string(head_dim) + " kv_heads " + std::to_string(kv_heads));
  RopeSpec spec;
  if (type == RopeType::kLlama3) spec = {.type = type, .theta = 500000.0, .factor = 8.0};
  const std::vector<float> inv_freq = cpu::RopeInvFreq(spec, head_dim);
  const int64_t layers = 3, num_rows = 37, n = 19, kv_dim = kv_heads * head_dim;
  const int64_t layer_stride =
      2 * num_rows * kv_dim;  // K then V per layer, as the attention executor lays them
  std::mt19937 rng(static_cast<uint32_t>(head_dim * 7 + kv_heads + static_cast<int>(type) * 13));
  std::vector<bf16> cache;
  std::vector<float> cache_f;
  RandomBf16(rng, layers * layer_stride, -1.0f, 1.0f, &cache, &cache_f);
  std::vector<int32_t> rows(static_cast<size_t>(num_rows));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  rows.resize(static_cast<size_t>(n));
  std::vector<int32_t> from(static_cast<size_t>(n)), to(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> pd(0, 131071);
  for (int64_t i = 0; i < n; ++i)
    from[static_cast<size_t>(i)] = pd(rng), to[static_cast<size_t>(i)] = pd(rng);
  from[0] = 131071, to[0] = 0;
  to[1] = from[1];  // not moved
  std::vector<float> want = cache_f;
  for (int64_t l = 0; l < layers; ++l) {
    ASSERT_TRUE(cpu::RopeShift({.k = want.data() + l * layer_stride,
                                .rows = rows.data(),
                                .from_positions = from.data(),
                                .to_positions = to.data(),
                                .inv_freq = inv_freq.data(),
                                .n = n,
                                .num_rows = num_rows,
                                .num_kv_heads = kv_heads,
                                .head_dim = head_dim})
                    .ok());
  }
  GuardedBuffer<bf16> d_cache(layers * layer_stride);
  GuardedBuffer<int32_t> d_rows(n), d_from(n), d_to(n);
  GuardedBuffer<float> d_inv(static_cast<int64_t>(inv_freq.size()));
  d_cache.Upload(cache);
  d_rows.Upload(rows);
  d_from.Upload(from);
  d_to.Upload(to);
  d_inv.Upload(inv_freq);
  const absl::Status st = RopeShift({.k = d_cache.get(),
                                     .rows = d_rows.get(),
                                     .from_positions = d_from.get(),
                                     .to_positions = d_to.get(),
                                     .inv_freq = d_inv.get(),
                                     .n = n,
                                     .num_kv_heads = kv_heads,
                                     .head_dim = head_dim,
                                     .layers = layers,
                                     .layer_stride = layer_stride},
                                    nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<float> got = ToFloats(d_cache.Download());
  EXPECT_TRUE(AllClose(got, want, [](float w) { return Bf16Ulp(w) + 1e-6; }));
  int64_t changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t in_layer = static_cast<int64_t>(i) % layer_stride, row = in_layer / kv_dim;
    const bool moved = in_layer < num_rows * kv_dim &&
                       (row == rows[0] || std::find(rows.begin() + 2, rows.end(), row) != rows.end());
    if (!moved) {
      ASSERT_EQ(got[i], cache_f[i]) << "element " << i << " must keep its bits";
    }
    changed += got[i] != cache_f[i];
  }
  EXPECT_GT(changed, 0);
  EXPECT_TRUE(d_cache.GuardsIntact());
}

// CopyRows on random bf16 planes against cpu::CopyRows on their fp32 values: exact (copies).
TEST(CudaOpsTest, CopyRowsMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const int64_t width : {int64_t{256}, int64_t{97}}) {  // 16-byte and scalar copies
    SCOPED_TRACE("width " + std::to_string(width));
    std::mt19937 rng(static_cast<uint32_t>(width));
    const int64_t planes = 6, num_rows = 41, n = 13, stride = num_rows * width;
    std::vector<bf16> cache;
    std::vector<float> cache_f;
    RandomBf16(rng, planes * stride, -1.0f, 1.0f, &cache, &cache_f);
    std::vector<int32_t> rows(static_cast<size_t>(num_rows));
    std::iota(rows.begin(), rows.end(), 0);
    std::shuffle(rows.begin(), rows.end(), rng);
    const std::vector<int32_t> src(rows.begin(), rows.begin() + n),
        dst(rows.begin() + n, rows.begin() + 2 * n);
    std::vector<float> want = cache_f;
    ASSERT_TRUE(cpu::CopyRows({.cache = want.data(),
                               .src = src.data(),
                               .dst = dst.data(),
                               .n = n,
                               .width = width,
                               .num_rows = num_rows,
                               .planes = planes,
                               .plane_stride = stride})
                    .ok());
    GuardedBuffer<bf16> d_cache(planes * stride);
    GuardedBuffer<int32_t> d_src(n), d_dst(n);
    d_cache.Upload(cache);
    d_src.Upload(src);
    d_dst.Upload(dst);
    const absl::Status st = CopyRows({.cache = d_cache.get(),
                                      .src = d_src.get(),
                                      .dst = d_dst.get(),
                                      .n = n,
                                      .width = width,
                                      .num_rows = num_rows,
                                      .planes = planes,
                                      .plane_stride = stride},
                                     nullptr);
    ASSERT_TRUE(st.ok()) << st;
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    EXPECT_EQ(ToFloats(d_cache.Download()), want);
    EXPECT_TRUE(d_cache.GuardsIntact());
  }
}

TEST(CudaOpsTest, RopeShiftMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (const RopeType type : {RopeType::kDefault, RopeType::kLlama3}) {
    CheckRopeShift(type, 128, 8);
    CheckRopeShift(type, 64, 2);
  }
  CheckRopeShift(RopeType::kDefault, 6, 3);  // odd half
}

// ---- SiluMul -------------------------------------------------------------------------------------

void CheckSiluMul(int64_t n, int64_t inter) {
  SCOPED_TRACE("n " + std::to_string(n) + " inter " + std::to_string(inter));
  std::mt19937 rng(static_cast<uint32_t>(n * 100 + inter));
  std::vector<bf16> gate_up;
  std::vector<float> gate_up_f;
  RandomBf16(rng, n * 2 * inter, -8.0f, 8.0f, &gate_up, &gate_up_f);  // silu's saturated ends too
  std::vector<float> want(static_cast<size_t>(n * inter));
  cpu::SiluMulParams cp;
  cp.gate_up = gate_up_f.data();
  cp.out = want.data();
  cp.n = n;
  cp.inter = inter;
  ASSERT_TRUE(cpu::SiluMul(cp).ok());
  GuardedBuffer<bf16> d_in(n * 2 * inter), d_out(n * inter);
  d_in.Upload(gate_up);
  SiluMulParams p;
  p.gate_up = d_in.get();
  p.out = d_out.get();
  p.n = n;
  p.inter = inter;
  const absl::Status st = SiluMul(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(AllClose(ToFloats(d_out.Download()), want, OneBf16Ulp()));
  EXPECT_TRUE(d_out.GuardsIntact());
}

TEST(CudaOpsTest, SiluMulMatchesCpu) {
  TANDEM_SKIP_WITHOUT_GPU();
  CheckSiluMul(17, 1024);  // 16-byte path
  CheckSiluMul(17, 97);    // odd
  CheckSiluMul(1, 14336);
  CheckSiluMul(1, 1);
}

// ---- KvAppend ------------------------------------------------------------------------------------

void CheckKvAppend(int64_t n, int64_t kv_dim, int64_t num_slots, bool fused) {
  SCOPED_TRACE("n " + std::to_string(n) + " kv_dim " + std::to_string(kv_dim) +
               (fused ? " fused" : " packed"));
  std::mt19937 rng(static_cast<uint32_t>(n * 10 + kv_dim + (fused ? 1 : 0)));
  // k and v rows: inside fused qkv rows (width q_dim + 2 kv_dim), or packed buffers.
  const int64_t q_dim = 2 * kv_dim;
  const int64_t width = fused ? q_dim + 2 * kv_dim : kv_dim;
  std::vector<bf16> kin, vin;
  std::vector<float> kin_f, vin_f;
  RandomBf16(rng, n * width, -4.0f, 4.0f, &kin, &kin_f);
  RandomBf16(rng, n * width, -4.0f, 4.0f, &vin, &vin_f);
  std::vector<int32_t> all(static_cast<size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<int32_t> slots(all.begin(), all.begin() + n);

  GuardedBuffer<bf16> d_k(n * width), d_v(n * width), k_cache(num_slots * kv_dim),
      v_cache(num_slots * kv_dim);
  GuardedBuffer<int32_t> d_slots(n);
  d_k.Upload(kin);
  d_v.Upload(vin);  // fused: k at q_dim of d_k's rows, v at q_dim + kv_dim of d_v's rows
  d_slots.Upload(slots);
  KvAppendParams p;
  p.k = fused ? d_k.get() + q_dim : d_k.get();
  p.v = fused ? d_v.get() + q_dim + kv_dim : d_v.get();
  p.k_stride = fused ? width : 0;
  p.v_stride = fused ? width : 0;
  p.slots = d_slots.get();
  p.k_cache = k_cache.get();
  p.v_cache = v_cache.get();
  p.n = n;
  p.kv_dim = kv_dim;
  p.num_slots = num_slots;
  const absl::Status st = KvAppend(p, nullptr);
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<bf16> kc = k_cache.Download(), vc = v_cache.Download();
  std::vector<int64_t> row_of(static_cast<size_t>(num_slots), -1);
  for (int64_t i = 0; i < n; ++i) row_of[static_cast<size_t>(slots[static_cast<size_t>(i)])] = i;
  const uint16_t sentinel = 0xA5A5;  // GuardedBuffer's fill: slots nobody wrote keep it
  int64_t bad = 0;
  for (int64_t s = 0; s < num_slots; ++s) {
    const int64_t i = row_of[static_cast<size_t>(s)];
    for (int64_t j = 0; j < kv_dim; ++j) {
      const size_t at = static_cast<size_t>(s * kv_dim + j);
      uint16_t kb, vb, kw = sentinel, vw = sentinel;
      std::memcpy(&kb, &kc[at], 2);
      std::memcpy(&vb, &vc[at], 2);
      if (i >= 0) {
        std::memcpy(&kw, &kin[static_cast<size_t>(i * width + (fused ? q_dim : 0) + j)], 2);
        std::memcpy(&vw, &vin[static_cast<size_t>(i * width + (fused ? q_dim + kv_dim : 0) + j)], 2);
      }
      if ((kb != kw || vb != vw) && bad++ < 5) {
        ADD_FAILURE() << "slot " << s << " (row " << i << ") element " << j << ": k " << kb << " want " << kw
                      << ", v " << vb << " want " << vw;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_TRUE(k_cache.GuardsIntact());
  EXPECT_TRUE(v_cache.GuardsIntact());
}

TEST(CudaOpsTest, KvAppendMatchesSlots) {
  TANDEM_SKIP_WITHOUT_GPU();
  CheckKvAppend(17, 256, 64, /*fused=*/true);  // strided rows, 16-byte path
  CheckKvAppend(17, 256, 64, /*fused=*/false);
  CheckKvAppend(17, 97, 40, /*fused=*/true);   // odd: scalar path
  CheckKvAppend(17, 97, 17, /*fused=*/false);  // every slot written
}

// ---- capture -------------------------------------------------------------------------------------

// The ops allocate nothing and never synchronise: a sequence of them captures into a CUDA graph
// and the graph gives the eager results bit for bit.
TEST(CudaOpsTest, CapturesInCudaGraph) {
  TANDEM_SKIP_WITHOUT_GPU();
  constexpr int64_t n = 17, hidden = 256, vocab = 100, heads = 4, kv_heads = 2, hd = 64, inter = 512,
                    slots = 32;
  constexpr int64_t qkv_w = (heads + 2 * kv_heads) * hd;
  std::mt19937 rng(3);
  std::vector<bf16> table, weight, qkv, gate_up;
  std::vector<float> unused;
  RandomBf16(rng, vocab * hidden, -1.0f, 1.0f, &table, &unused);
  RandomBf16(rng, hidden, 0.5f, 1.5f, &weight, &unused);
  RandomBf16(rng, n * qkv_w, -1.0f, 1.0f, &qkv, &unused);
  RandomBf16(rng, n * 2 * inter, -4.0f, 4.0f, &gate_up, &unused);
  std::vector<int32_t> ids(n), pos(n), slot(n);
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = static_cast<int32_t>((i * 37) % vocab);
    pos[i] = static_cast<int32_t>(i * 1000);
    slot[i] = static_cast<int32_t>(slots - 1 - i);
  }
  const std::vector<float> inv_freq = cpu::RopeInvFreq(RopeSpec{}, hd);
  GuardedBuffer<int32_t> d_ids(n), d_pos(n), d_slot(n);
  GuardedBuffer<bf16> d_table(vocab * hidden), d_weight(hidden), d_norm(n * hidden), d_qkv(n * qkv_w),
      d_gu(n * 2 * inter), d_act(n * inter), d_kc(slots * kv_heads * hd), d_vc(slots * kv_heads * hd);
  GuardedBuffer<float> d_res(n * hidden), d_inv(hd / 2);
  d_ids.Upload(ids);
  d_pos.Upload(pos);
  d_slot.Upload(slot);
  d_table.Upload(table);
  d_weight.Upload(weight);
  d_gu.Upload(gate_up);
  d_inv.Upload(inv_freq);

  auto run = [&](cudaStream_t s) {
    EmbeddingParams e;
    e.ids = d_ids.get(), e.table = d_table.get(), e.out = d_res.get(), e.n = n, e.vocab = vocab,
    e.hidden = hidden;
    AddRmsNormParams a;
    a.residual = d_res.get(), a.weight = d_weight.get(), a.out = d_norm.get(), a.n = n, a.d = hidden;
    RopeParams r;
    r.q = d_qkv.get(), r.k = d_qkv.get() + heads * hd, r.positions = d_pos.get(), r.inv_freq = d_inv.get();
    r.n = n, r.num_heads = heads, r.num_kv_heads = kv_heads, r.head_dim = hd, r.q_stride = qkv_w,
    r.k_stride = qkv_w;
    KvAppendParams k;
    k.k = d_qkv.get() + heads * hd, k.v = d_qkv.get() + (heads + kv_heads) * hd, k.k_stride = qkv_w,
    k.v_stride = qkv_w;
    k.slots = d_slot.get(), k.k_cache = d_kc.get(), k.v_cache = d_vc.get(), k.n = n, k.kv_dim = kv_heads * hd,
    k.num_slots = slots;
    SiluMulParams m;
    m.gate_up = d_gu.get(), m.out = d_act.get(), m.n = n, m.inter = inter;
    absl::Status st = Embedding(e, s);
    if (st.ok()) st = AddRmsNorm(a, s);
    if (st.ok()) st = Rope(r, s);
    if (st.ok()) st = KvAppend(k, s);
    if (st.ok()) st = SiluMul(m, s);
    return st;
  };
  auto snapshot = [&] {
    std::vector<bf16> out = d_norm.Download();
    for (auto* b : {&d_qkv, &d_act, &d_kc, &d_vc}) {
      const std::vector<bf16> x = b->Download();
      out.insert(out.end(), x.begin(), x.end());
    }
    std::vector<uint16_t> bits(out.size());
    std::memcpy(bits.data(), out.data(), out.size() * 2);
    return bits;
  };
  d_qkv.Upload(qkv);
  ASSERT_TRUE(run(nullptr).ok());
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> eager = snapshot();

  d_qkv.Upload(qkv);  // Rope works in place: start from the same input
  cudaStream_t stream = nullptr;
  CUDA_ASSERT_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CUDA_ASSERT_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const absl::Status st = run(stream);
  CUDA_ASSERT_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(st.ok()) << st;
  CUDA_ASSERT_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_ASSERT_OK(cudaGraphLaunch(exec, stream));
  CUDA_ASSERT_OK(cudaStreamSynchronize(stream));
  EXPECT_EQ(snapshot(), eager);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- validation ----------------------------------------------------------------------------------

template <typename P, typename Op>
void ExpectInvalid(Op op, const P& p, const char* field) {
  const absl::Status st = op(p, nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << field << ": " << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr(field));
}

TEST(CudaOpsTest, RejectsInvalidParams) {
  int32_t i32 = 0;
  float f32 = 0.0f;
  bf16 h{};
  {
    EmbeddingParams ok;
    ok.ids = &i32, ok.table = &h, ok.out = &f32, ok.n = 1, ok.vocab = 1, ok.hidden = 1;
    EmbeddingParams p = ok;
    p.ids = nullptr;
    ExpectInvalid(Embedding, p, "ids");
    p = ok, p.table = nullptr;
    ExpectInvalid(Embedding, p, "table");
    p = ok, p.out = nullptr;
    ExpectInvalid(Embedding, p, "out");
    p = ok, p.n = 0;
    ExpectInvalid(Embedding, p, "n");
    p = ok, p.hidden = -1;
    ExpectInvalid(Embedding, p, "hidden");
  }
  {
    AddRmsNormParams ok;
    ok.residual = &f32, ok.weight = &h, ok.out = &h, ok.n = 1, ok.d = 1;
    AddRmsNormParams p = ok;
    p.residual = nullptr;
    ExpectInvalid(AddRmsNorm, p, "residual");
    p = ok, p.weight = nullptr;
    ExpectInvalid(AddRmsNorm, p, "weight");
    p = ok, p.d = 0;
    ExpectInvalid(AddRmsNorm, p, "d");
    p = ok, p.out_rows = &i32, p.n_out = 0;
    ExpectInvalid(AddRmsNorm, p, "n_out");
    p = ok, p.eps = -1.0f;
    ExpectInvalid(AddRmsNorm, p, "eps");
  }
  {
    RopeParams ok;
    ok.q = &h, ok.positions = &i32, ok.inv_freq = &f32, ok.n = 1, ok.num_heads = 1, ok.head_dim = 2;
    RopeParams p = ok;
    p.q = nullptr;
    ExpectInvalid(Rope, p, "q");
    p = ok, p.positions = nullptr;
    ExpectInvalid(Rope, p, "positions");
    p = ok, p.inv_freq = nullptr;
    ExpectInvalid(Rope, p, "inv_freq");
    p = ok, p.head_dim = 3;
    ExpectInvalid(Rope, p, "head_dim");
    p = ok, p.k = &h, p.num_kv_heads = 0;
    ExpectInvalid(Rope, p, "num_kv_heads");
    p = ok, p.num_heads = 2, p.q_stride = 2;
    ExpectInvalid(Rope, p, "q_stride");
    p = ok, p.k = &h, p.num_kv_heads = 2, p.k_stride = 3;
    ExpectInvalid(Rope, p, "k_stride");
  }
  {
    SiluMulParams ok;
    ok.gate_up = &h, ok.out = &h, ok.n = 1, ok.inter = 1;
    SiluMulParams p = ok;
    p.gate_up = nullptr;
    ExpectInvalid(SiluMul, p, "gate_up");
    p = ok, p.inter = 0;
    ExpectInvalid(SiluMul, p, "inter");
  }
  {
    KvAppendParams ok;
    ok.k = &h, ok.v = &h, ok.slots = &i32, ok.k_cache = &h, ok.v_cache = &h, ok.n = 1, ok.kv_dim = 1,
    ok.num_slots = 1;
    KvAppendParams p = ok;
    p.v = nullptr;
    ExpectInvalid(KvAppend, p, "v");
    p = ok, p.slots = nullptr;
    ExpectInvalid(KvAppend, p, "slots");
    p = ok, p.k_cache = nullptr;
    ExpectInvalid(KvAppend, p, "k_cache");
    p = ok, p.num_slots = 0;
    ExpectInvalid(KvAppend, p, "num_slots");
    p = ok, p.kv_dim = 4, p.k_stride = 2;
    ExpectInvalid(KvAppend, p, "k_stride");
  }
}

}  // namespace
}  // namespace tandem::kernels::cuda
