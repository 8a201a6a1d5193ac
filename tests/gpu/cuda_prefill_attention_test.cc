// PrefillAttention (CUDA, tensor cores) against cpu::Attention on the exact fp32 values of random
// bf16 inputs.
//
// Inputs: q, k in [-2, 2) and v in [-1, 1) (scores of std ≈ 1.3 after scaling: softmax neither
// flat nor one-hot), fixed seeds. Slot tables are shuffled over a cache with unused slots that
// hold NaN: a read through a wrong slot turns the output NaN. out and lse are prefilled with NaN
// (a row left unwritten fails) inside guard regions (a write out of bounds fails). NaN anywhere
// in an output fails.
//
// Tolerances:
//   out: max|gpu - ref| / max|ref| <= 1e-2 per case. The kernel rounds the probabilities P to
//     bf16 (relative error <= 2^-9 each) before P·V and rounds out to bf16 (<= 2^-9 relative);
//     scores, softmax statistics and accumulators are fp32. The observed error is a few 1e-3.
//   lse: |gpu - ref| <= 2e-3 (absolute; lse is O(1..10)). It comes from fp32 scores and fp32 sums
//     of unrounded probabilities, so only summation order and ex2.approx (~2^-22 relative) differ.
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

#include "gpu_test_util.h"
#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

using ::tandem::testing_gpu::FromBits;
using ::tandem::testing_gpu::GuardedBuffer;
using ::tandem::testing_gpu::RandomBf16;
using ::tandem::testing_gpu::ToFloat;

constexpr double kOutTol = 1e-2;  // normalized: max|err| / max|ref|
constexpr double kLseTol = 2e-3;  // absolute
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct RequestShape {
  int q_len;
  int kv_len;  // context including the chunk's own keys; kv_len >= q_len
};

struct Case {
  std::vector<RequestShape> requests;
  int64_t num_heads = 8, num_kv_heads = 2, head_dim = 128;
  int64_t unused_slots = 64;  // cache slots outside every request's table (NaN-filled)
  bool shuffle_slots = true;
  int64_t max_q_len_slack = 0;  // added to the true max_q_len (a loose host bound)
  uint32_t seed = 1;

  std::string Describe() const {
    std::ostringstream os;
    os << "heads " << num_heads << "/" << num_kv_heads << " d" << head_dim << " requests [";
    for (size_t i = 0; i < requests.size(); ++i) {
      os << (i ? " " : "") << requests[i].q_len << "/" << requests[i].kv_len;
    }
    os << "] (q_len/kv_len) seed " << seed;
    return os.str();
  }
};

// Host inputs (bf16 for the device, exact fp32 for the reference) and the slot tables.
struct Inputs {
  std::vector<int32_t> q_indptr, kv_indptr, kv_slots;
  int64_t total_q = 0, total_kv = 0, num_slots = 0, max_q_len = 0, max_kv_len = 0;
  std::vector<__nv_bfloat16> q, k, v;
  std::vector<float> q_f, k_f, v_f;
};

Inputs MakeInputs(const Case& c) {
  Inputs in;
  std::mt19937 rng(c.seed);
  in.q_indptr.push_back(0);
  in.kv_indptr.push_back(0);
  for (const RequestShape& r : c.requests) {
    in.q_indptr.push_back(in.q_indptr.back() + r.q_len);
    in.kv_indptr.push_back(in.kv_indptr.back() + r.kv_len);
    in.max_q_len = std::max<int64_t>(in.max_q_len, r.q_len);
    in.max_kv_len = std::max<int64_t>(in.max_kv_len, r.kv_len);
  }
  in.max_q_len = std::max<int64_t>(in.max_q_len, 1) + c.max_q_len_slack;
  in.max_kv_len = std::max<int64_t>(in.max_kv_len, 1);
  in.total_q = in.q_indptr.back();
  in.total_kv = in.kv_indptr.back();
  in.num_slots = in.total_kv + c.unused_slots;
  std::vector<int32_t> perm(static_cast<size_t>(in.num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  if (c.shuffle_slots) std::shuffle(perm.begin(), perm.end(), rng);
  in.kv_slots.assign(perm.begin(), perm.begin() + in.total_kv);

  const int64_t H = c.num_heads, KVH = c.num_kv_heads, D = c.head_dim;
  RandomBf16(rng, in.total_q * H * D, -2.0f, 2.0f, &in.q, &in.q_f);
  RandomBf16(rng, in.num_slots * KVH * D, -2.0f, 2.0f, &in.k, &in.k_f);
  RandomBf16(rng, in.num_slots * KVH * D, -1.0f, 1.0f, &in.v, &in.v_f);
  // Unused slots hold NaN.
  std::vector<bool> used(static_cast<size_t>(in.num_slots), false);
  for (int32_t s : in.kv_slots) used[static_cast<size_t>(s)] = true;
  const __nv_bfloat16 nan_bf16 = FromBits(0x7FC0);
  for (int64_t s = 0; s < in.num_slots; ++s) {
    if (used[static_cast<size_t>(s)]) continue;
    for (int64_t i = s * KVH * D; i < (s + 1) * KVH * D; ++i) {
      in.k[static_cast<size_t>(i)] = in.v[static_cast<size_t>(i)] = nan_bf16;
      in.k_f[static_cast<size_t>(i)] = in.v_f[static_cast<size_t>(i)] = kNaN;
    }
  }
  return in;
}

struct Reference {
  std::vector<float> out, lse;
};

Reference RunCpu(const Case& c, const Inputs& in) {
  Reference ref;
  ref.out.assign(static_cast<size_t>(in.total_q * c.num_heads * c.head_dim), kNaN);
  ref.lse.assign(static_cast<size_t>(in.total_q * c.num_heads), kNaN);
  cpu::AttentionParams p;
  p.q = in.q_f.data();
  p.k_cache = in.k_f.data();
  p.v_cache = in.v_f.data();
  p.out = ref.out.data();
  p.lse = ref.lse.data();
  p.q_indptr = in.q_indptr.data();
  p.kv_indptr = in.kv_indptr.data();
  p.kv_slots = in.kv_slots.data();
  p.num_requests = static_cast<int64_t>(c.requests.size());
  p.num_slots = in.num_slots;
  p.num_heads = c.num_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const absl::Status st = cpu::Attention(p);
  EXPECT_TRUE(st.ok()) << st;
  return ref;
}

// Device copies of the inputs and guarded, NaN-prefilled outputs.
class DeviceCase {
 public:
  DeviceCase(const Case& c, const Inputs& in)
      : c_(c),
        in_(in),
        q_(static_cast<int64_t>(in.q.size())),
        k_(static_cast<int64_t>(in.k.size())),
        v_(static_cast<int64_t>(in.v.size())),
        q_indptr_(static_cast<int64_t>(in.q_indptr.size())),
        kv_indptr_(static_cast<int64_t>(in.kv_indptr.size())),
        kv_slots_(std::max<int64_t>(1, static_cast<int64_t>(in.kv_slots.size()))),
        out_(std::max<int64_t>(1, in.total_q * c.num_heads * c.head_dim)),
        lse_(std::max<int64_t>(1, in.total_q * c.num_heads)) {
    q_.Upload(in.q);
    k_.Upload(in.k);
    v_.Upload(in.v);
    q_indptr_.Upload(in.q_indptr);
    kv_indptr_.Upload(in.kv_indptr);
    kv_slots_.Upload(in.kv_slots);
  }

  AttentionParams Params(bool with_lse) {
    AttentionParams p;
    p.q = q_.get();
    p.k_cache = k_.get();
    p.v_cache = v_.get();
    p.out = out_.get();
    p.lse = with_lse ? lse_.get() : nullptr;
    p.q_indptr = q_indptr_.get();
    p.kv_indptr = kv_indptr_.get();
    p.kv_slots = kv_slots_.get();
    p.num_requests = static_cast<int64_t>(c_.requests.size());
    p.num_slots = in_.num_slots;
    p.num_heads = c_.num_heads;
    p.num_kv_heads = c_.num_kv_heads;
    p.head_dim = c_.head_dim;
    p.scale = 1.0f / std::sqrt(static_cast<float>(c_.head_dim));
    p.max_q_len = in_.max_q_len;
    p.max_kv_len = in_.max_kv_len;
    return p;
  }

  // Prefills the outputs with NaN, runs the kernel, and downloads out (as float) and lse. With
  // `ran`, a kernel that cannot run this case (FailedPrecondition) sets *ran = false instead of
  // failing.
  void Run(bool with_lse, std::vector<float>* out, std::vector<float>* lse,
           PrefillKernel kernel = PrefillKernel::kAuto, bool* ran = nullptr) {
    out_.Upload(std::vector<__nv_bfloat16>(static_cast<size_t>(out_.size()), FromBits(0x7FC0)));
    lse_.Upload(std::vector<float>(static_cast<size_t>(lse_.size()), kNaN));
    const absl::Status st = PrefillAttention(Params(with_lse), nullptr, kernel);
    if (ran != nullptr) {
      *ran = st.ok();
      if (absl::IsFailedPrecondition(st)) return;
    }
    ASSERT_TRUE(st.ok()) << st;
    CUDA_ASSERT_OK(cudaDeviceSynchronize());
    ASSERT_TRUE(out_.GuardsIntact()) << "write outside out";
    ASSERT_TRUE(lse_.GuardsIntact()) << "write outside lse";
    const std::vector<__nv_bfloat16> o = out_.Download();
    out->resize(o.size());
    for (size_t i = 0; i < o.size(); ++i) (*out)[i] = ToFloat(o[i]);
    *lse = lse_.Download();
  }

  // Overwrites key `j` (all KV heads) of the cache at `slot` with new random values.
  void ReplaceKey(int32_t slot, std::mt19937& rng) {
    const int64_t n = c_.num_kv_heads * c_.head_dim;
    std::vector<__nv_bfloat16> kn, vn;
    std::vector<float> unused;
    RandomBf16(rng, n, -2.0f, 2.0f, &kn, &unused);
    RandomBf16(rng, n, -1.0f, 1.0f, &vn, &unused);
    cudaMemcpy(k_.get() + slot * n, kn.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
    cudaMemcpy(v_.get() + slot * n, vn.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice);
  }

 private:
  const Case& c_;
  const Inputs& in_;
  GuardedBuffer<__nv_bfloat16> q_, k_, v_;
  GuardedBuffer<int32_t> q_indptr_, kv_indptr_, kv_slots_;
  GuardedBuffer<__nv_bfloat16> out_;
  GuardedBuffer<float> lse_;
};

// Compares with the reference; reports the worst element with its request, row, head and dim.
void ExpectMatches(const Case& c, const Inputs& in, const Reference& ref, const std::vector<float>& out,
                   const std::vector<float>& lse) {
  const int64_t H = c.num_heads, D = c.head_dim;
  double max_ref = 0.0, max_err = 0.0, max_lse_err = 0.0;
  int64_t worst = -1, worst_lse = -1, nan_out = 0, nan_lse = 0;
  for (int64_t i = 0; i < in.total_q * H * D; ++i) {
    const double r = ref.out[static_cast<size_t>(i)], g = out[static_cast<size_t>(i)];
    if (std::isnan(g)) {
      ++nan_out;
      continue;
    }
    max_ref = std::max(max_ref, std::fabs(r));
    if (std::fabs(g - r) > max_err) {
      max_err = std::fabs(g - r);
      worst = i;
    }
  }
  for (int64_t i = 0; i < in.total_q * H; ++i) {
    const double r = ref.lse[static_cast<size_t>(i)], g = lse[static_cast<size_t>(i)];
    if (std::isnan(g)) {
      ++nan_lse;
      continue;
    }
    if (std::fabs(g - r) > max_lse_err) {
      max_lse_err = std::fabs(g - r);
      worst_lse = i;
    }
  }
  auto where = [&](int64_t row) {
    const int64_t r = std::upper_bound(in.q_indptr.begin(), in.q_indptr.end(), static_cast<int32_t>(row)) -
                      in.q_indptr.begin() - 1;
    std::ostringstream os;
    os << "request " << r << " row " << row - in.q_indptr[static_cast<size_t>(r)];
    return os.str();
  };
  EXPECT_EQ(nan_out, 0) << "NaN in out; " << c.Describe();
  EXPECT_EQ(nan_lse, 0) << "NaN in lse; " << c.Describe();
  const double rel = max_ref > 0.0 ? max_err / max_ref : max_err;
  EXPECT_LE(rel, kOutTol) << c.Describe() << ": max|err| " << max_err << " / max|ref| " << max_ref << " at "
                          << (worst >= 0 ? where(worst / (H * D)) : "-") << " head " << (worst / D) % H
                          << " dim " << worst % D;
  EXPECT_LE(max_lse_err, kLseTol) << c.Describe() << ": lse error at "
                                  << (worst_lse >= 0 ? where(worst_lse / H) : "-") << " head "
                                  << worst_lse % H;
}

// Runs the case on each kernel that can run it (the mma.sync kernel always; the wgmma kernel on
// an sm_90 device for head_dim 128 and chunks over 64 rows) and compares each with the reference.
void CheckCase(const Case& c) {
  SCOPED_TRACE(c.Describe());
  const Inputs in = MakeInputs(c);
  const Reference ref = RunCpu(c, in);
  DeviceCase dev(c, in);
  for (PrefillKernel kernel : {PrefillKernel::kMmaSync, PrefillKernel::kWgmma}) {
    SCOPED_TRACE(kernel == PrefillKernel::kWgmma ? "wgmma kernel" : "mma.sync kernel");
    std::vector<float> out, lse;
    bool ran = false;
    ASSERT_NO_FATAL_FAILURE(dev.Run(/*with_lse=*/true, &out, &lse, kernel, &ran));
    if (ran) ExpectMatches(c, in, ref, out, lse);
  }
}

// On a compute capability 9.0 device the wgmma kernel must be there (an sm_90a build) and be what
// kAuto picks for head_dim 128 and chunks over 64 rows; elsewhere it is refused with
// FailedPrecondition and kAuto runs the mma.sync kernel.
TEST(CudaPrefillAttention, WgmmaKernelOnSm90) {
  TANDEM_SKIP_WITHOUT_GPU();
  int device = 0, major = 0, minor = 0;
  CUDA_ASSERT_OK(cudaGetDevice(&device));
  CUDA_ASSERT_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_ASSERT_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  Case c;
  c.requests = {{200, 300}, {65, 65}};
  const Inputs in = MakeInputs(c);
  DeviceCase dev(c, in);
  const absl::Status wgmma = PrefillAttention(dev.Params(true), nullptr, PrefillKernel::kWgmma);
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
  if (major == 9 && minor == 0) {
    ASSERT_TRUE(wgmma.ok()) << wgmma;
    std::vector<float> out_auto, lse_auto, out_wgmma, lse_wgmma;
    ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out_auto, &lse_auto, PrefillKernel::kAuto));
    ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out_wgmma, &lse_wgmma, PrefillKernel::kWgmma));
    EXPECT_EQ(std::memcmp(out_auto.data(), out_wgmma.data(), out_auto.size() * sizeof(float)), 0)
        << "kAuto did not run the wgmma kernel";
  } else {
    EXPECT_TRUE(absl::IsFailedPrecondition(wgmma)) << wgmma;
  }
  // Never for head_dim 64 or chunks of at most 64 rows.
  AttentionParams p = dev.Params(true);
  p.max_q_len = 64;
  EXPECT_TRUE(absl::IsFailedPrecondition(PrefillAttention(p, nullptr, PrefillKernel::kWgmma)));
}

// ---- single requests over head layouts and head dims -----------------------------------------

struct Layout {
  const char* name;
  int64_t heads, kv_heads, head_dim;
};

class PrefillLayoutTest : public ::testing::TestWithParam<Layout> {};

TEST_P(PrefillLayoutTest, SingleRequestFreshAndWithHistory) {
  TANDEM_SKIP_WITHOUT_GPU();
  const Layout l = GetParam();
  uint32_t seed = 100;
  for (int chunk : {1, 17, 64, 97, 128, 512}) {
    for (int history : {0, 300}) {
      Case c;
      c.requests = {{chunk, chunk + history}};
      c.num_heads = l.heads;
      c.num_kv_heads = l.kv_heads;
      c.head_dim = l.head_dim;
      c.seed = ++seed;
      CheckCase(c);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, PrefillLayoutTest,
                         ::testing::Values(Layout{"Mha4x4D64", 4, 4, 64}, Layout{"Mha4x4D128", 4, 4, 128},
                                           Layout{"Gqa8x2D64", 8, 2, 64}, Layout{"Gqa8x2D128", 8, 2, 128},
                                           Layout{"Gqa32x8D64", 32, 8, 64}, Layout{"Gqa32x8D128", 32, 8, 128},
                                           Layout{"Mqa8x1D64", 8, 1, 64}, Layout{"Mqa8x1D128", 8, 1, 128}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return std::string(info.param.name);
                         });

// ---- mixed batches ---------------------------------------------------------------------------

// ~7 requests: chunks 1..max_chunk, histories 0..500, one with no query rows, a single-row one on
// a long history; shuffled slots with unused (NaN) slots; a loose max_q_len.
Case MixedCase(uint32_t seed, int64_t heads, int64_t kv_heads, int64_t head_dim, int max_chunk) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> chunk(1, max_chunk), history(0, 500);
  Case c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.seed = seed;
  c.unused_slots = 333;
  c.max_q_len_slack = 37;
  c.requests.push_back({1, 1 + 480});
  for (int i = 0; i < 5; ++i) {
    const int q = chunk(rng);
    c.requests.push_back({q, q + history(rng)});
  }
  c.requests.insert(c.requests.begin() + 2, RequestShape{0, 50});
  std::shuffle(c.requests.begin(), c.requests.end(), rng);
  return c;
}

TEST(CudaPrefillAttention, MixedBatch) {
  TANDEM_SKIP_WITHOUT_GPU();
  uint32_t seed = 7;
  for (int64_t d : {64, 128}) {
    CheckCase(MixedCase(++seed, 32, 8, d, 200));
    CheckCase(MixedCase(++seed, 8, 1, d, 200));
    CheckCase(MixedCase(++seed, 4, 4, d, 200));
    CheckCase(MixedCase(++seed, 8, 2, d, 48));  // every chunk <= 64: the 64-row tile kernel
  }
}

TEST(CudaPrefillAttention, LongHistory) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128}) {
    Case c;
    c.requests = {{256, 4096}, {1, 3000}, {40, 2500}};
    c.num_heads = 8;
    c.num_kv_heads = 2;
    c.head_dim = d;
    c.seed = 77;
    CheckCase(c);
  }
}

TEST(CudaPrefillAttention, IdentitySlotsNoUnusedSlots) {
  TANDEM_SKIP_WITHOUT_GPU();
  Case c;
  c.requests = {{200, 200}, {33, 90}};
  c.unused_slots = 0;
  c.shuffle_slots = false;
  c.seed = 5;
  CheckCase(c);
}

// ---- causality, determinism, optional lse ----------------------------------------------------

// Changing the key (and value) at context position p leaves every row that cannot see it
// bit-identical, and changes the rows that can.
TEST(CudaPrefillAttention, ChangingALaterKeyLeavesEarlierRowsBitIdentical) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128}) {
    Case c;
    const int q_len = 150, kv_len = 350;
    c.requests = {{q_len, kv_len}, {20, 40}};
    c.head_dim = d;
    c.seed = 31;
    const Inputs in = MakeInputs(c);
    DeviceCase dev(c, in);
    std::vector<float> out0, lse0;
    ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out0, &lse0));
    std::mt19937 rng(99);
    for (int first_row_seeing : {70, q_len - 1, 1}) {
      SCOPED_TRACE(::testing::Message() << "d" << d << " key seen from row " << first_row_seeing);
      const int pos = kv_len - q_len + first_row_seeing;
      dev.ReplaceKey(in.kv_slots[static_cast<size_t>(pos)], rng);
      std::vector<float> out1, lse1;
      ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out1, &lse1));
      const int64_t row_elems = c.num_heads * c.head_dim;
      for (int row = 0; row < q_len; ++row) {
        const bool same_out = std::memcmp(out0.data() + row * row_elems, out1.data() + row * row_elems,
                                          row_elems * sizeof(float)) == 0;
        const bool same_lse = std::memcmp(lse0.data() + row * c.num_heads, lse1.data() + row * c.num_heads,
                                          c.num_heads * sizeof(float)) == 0;
        if (row < first_row_seeing) {
          ASSERT_TRUE(same_out && same_lse) << "row " << row << " changed";
        } else {
          ASSERT_FALSE(same_lse) << "row " << row << " does not see the changed key";
        }
      }
      // The other request is untouched.
      EXPECT_EQ(std::memcmp(out0.data() + q_len * row_elems, out1.data() + q_len * row_elems,
                            20 * row_elems * sizeof(float)),
                0);
      out0 = out1;
      lse0 = lse1;
    }
  }
}

TEST(CudaPrefillAttention, RepeatedRunsAreBitIdenticalAndLseIsOptional) {
  TANDEM_SKIP_WITHOUT_GPU();
  for (int64_t d : {64, 128}) {
    for (int max_chunk : {200, 48}) {
      const Case c = MixedCase(1234 + static_cast<uint32_t>(d + max_chunk), 32, 8, d, max_chunk);
      SCOPED_TRACE(c.Describe());
      const Inputs in = MakeInputs(c);
      DeviceCase dev(c, in);
      std::vector<float> out0, lse0;
      ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out0, &lse0));
      for (int rep = 0; rep < 4; ++rep) {
        std::vector<float> out1, lse1;
        ASSERT_NO_FATAL_FAILURE(dev.Run(true, &out1, &lse1));
        ASSERT_EQ(std::memcmp(out0.data(), out1.data(), out0.size() * sizeof(float)), 0) << "rep " << rep;
        ASSERT_EQ(std::memcmp(lse0.data(), lse1.data(), lse0.size() * sizeof(float)), 0) << "rep " << rep;
      }
      std::vector<float> out2, lse2;
      ASSERT_NO_FATAL_FAILURE(dev.Run(false, &out2, &lse2));
      EXPECT_EQ(std::memcmp(out0.data(), out2.data(), out0.size() * sizeof(float)), 0) << "without lse";
      for (float x : lse2) ASSERT_TRUE(std::isnan(x)) << "lse written although null";
    }
  }
}

// ---- invalid params --------------------------------------------------------------------------

TEST(CudaPrefillAttention, InvalidParams) {
  TANDEM_SKIP_WITHOUT_GPU();
  Case c;
  c.requests = {{4, 8}};
  const Inputs in = MakeInputs(c);
  DeviceCase dev(c, in);
  ASSERT_TRUE(PrefillAttention(dev.Params(true), nullptr).ok());
  CUDA_ASSERT_OK(cudaDeviceSynchronize());

  struct Mutation {
    const char* field;
    void (*apply)(AttentionParams*);
  };
  const Mutation mutations[] = {
      {"q", [](AttentionParams* p) { p->q = nullptr; }},
      {"k_cache", [](AttentionParams* p) { p->k_cache = nullptr; }},
      {"v_cache", [](AttentionParams* p) { p->v_cache = nullptr; }},
      {"out", [](AttentionParams* p) { p->out = nullptr; }},
      {"q_indptr", [](AttentionParams* p) { p->q_indptr = nullptr; }},
      {"kv_indptr", [](AttentionParams* p) { p->kv_indptr = nullptr; }},
      {"kv_slots", [](AttentionParams* p) { p->kv_slots = nullptr; }},
      {"num_requests", [](AttentionParams* p) { p->num_requests = 0; }},
      {"num_slots", [](AttentionParams* p) { p->num_slots = -1; }},
      {"num_heads", [](AttentionParams* p) { p->num_heads = 0; }},
      {"num_kv_heads", [](AttentionParams* p) { p->num_kv_heads = 0; }},
      {"num_kv_heads", [](AttentionParams* p) { p->num_kv_heads = 3; }},
      {"head_dim", [](AttentionParams* p) { p->head_dim = 0; }},
      {"head_dim", [](AttentionParams* p) { p->head_dim = 96; }},
      {"head_dim", [](AttentionParams* p) { p->head_dim = 256; }},
      {"max_q_len", [](AttentionParams* p) { p->max_q_len = 0; }},
      {"max_kv_len", [](AttentionParams* p) { p->max_kv_len = -5; }},
      {"scale", [](AttentionParams* p) { p->scale = 0.0f; }},
      {"scale", [](AttentionParams* p) { p->scale = std::numeric_limits<float>::quiet_NaN(); }},
      {"out", [](AttentionParams* p) { p->out = p->out + 1; }},  // misaligned
  };
  for (const Mutation& m : mutations) {
    AttentionParams p = dev.Params(true);
    m.apply(&p);
    const absl::Status st = PrefillAttention(p, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << m.field << ": " << st;
    EXPECT_NE(std::string(st.message()).find(m.field), std::string::npos) << st;
  }
  CUDA_ASSERT_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace tandem::kernels::cuda
