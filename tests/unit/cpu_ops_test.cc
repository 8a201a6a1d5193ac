// CPU reference ops against naive double-precision implementations written here.
//
// Every output buffer is surrounded by guard floats holding a sentinel and prefilled with NaN:
// a write out of bounds changes a guard, an element left unwritten stays NaN, and NaN anywhere in
// an output fails. Inputs are random with fixed seeds; shapes mix aligned and odd sizes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {
namespace {

constexpr float kSentinel = -1.2345e30f;
constexpr int64_t kGuard = 16;  // floats on each side
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kFloatEps = 0x1.0p-24;  // unit roundoff of fp32

// A float buffer with guard zones; data() starts after the leading guard.
class Guarded {
 public:
  explicit Guarded(int64_t n, float fill = kNaN)
      : n_(n), buf_(static_cast<size_t>(n + 2 * kGuard), kSentinel) {
    std::fill_n(data(), n, fill);
  }
  float* data() { return buf_.data() + kGuard; }
  const float* data() const { return buf_.data() + kGuard; }
  float& operator[](int64_t i) { return data()[i]; }
  float operator[](int64_t i) const { return data()[i]; }
  int64_t size() const { return n_; }
  std::vector<float> values() const { return {data(), data() + n_}; }
  ::testing::AssertionResult GuardsIntact() const {
    for (int64_t i = 0; i < kGuard; ++i) {
      if (buf_[static_cast<size_t>(i)] != kSentinel) {
        return ::testing::AssertionFailure() << "guard before the buffer overwritten at " << i - kGuard;
      }
      if (buf_[static_cast<size_t>(n_ + kGuard + i)] != kSentinel) {
        return ::testing::AssertionFailure() << "guard after the buffer overwritten at +" << i;
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  int64_t n_;
  std::vector<float> buf_;
};

std::vector<float> RandomFloats(std::mt19937& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

void Fill(Guarded& g, const std::vector<float>& v) {
  ASSERT_EQ(g.size(), static_cast<int64_t>(v.size()));
  std::copy(v.begin(), v.end(), g.data());
}

// |got - ref| <= atol + rtol * |ref| elementwise, NaN in `got` always fails. `tol_at` may widen
// the bound per element (for bounds that depend on the element's terms).
::testing::AssertionResult AllClose(const float* got, const std::vector<double>& ref, double atol,
                                    double rtol, const std::vector<double>* abs_tol = nullptr) {
  int bad = 0;
  double worst = 0.0;
  std::string first;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i];
    const double tol = (abs_tol ? (*abs_tol)[i] : atol) + rtol * std::abs(ref[i]);
    const double err = std::abs(g - ref[i]);
    if (std::isnan(g) || !(err <= tol)) {
      if (bad++ == 0) {
        first = "index " + std::to_string(i) + ": got " + std::to_string(g) + ", want " +
                std::to_string(ref[i]) + " (tol " + std::to_string(tol) + ")";
      }
    }
    if (!std::isnan(err)) worst = std::max(worst, err);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << ref.size() << " elements off; first at " << first << "; max abs error " << worst;
}

bool MessageHas(const absl::Status& s, const std::string& want) {
  return std::string(s.message()).find(want) != std::string::npos;
}

// ---- Embedding ----------------------------------------------------------------------------------

TEST(EmbeddingTest, CopiesRows) {
  std::mt19937 rng(1);
  for (int64_t hidden : {1, 17, 64}) {
    for (int64_t n : {1, 17}) {
      SCOPED_TRACE("hidden " + std::to_string(hidden) + " n " + std::to_string(n));
      const int64_t vocab = 33;
      const std::vector<float> table = RandomFloats(rng, vocab * hidden);
      std::vector<int32_t> ids(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % vocab);
      ids.back() = static_cast<int32_t>(vocab - 1);
      ids.front() = 0;
      Guarded out(n * hidden);
      ASSERT_TRUE(Embedding({ids.data(), table.data(), out.data(), n, vocab, hidden}).ok());
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < hidden; ++j) {
          // A copy: exact.
          ASSERT_EQ(out[i * hidden + j],
                    table[static_cast<size_t>(ids[static_cast<size_t>(i)] * hidden + j)]);
        }
      }
      EXPECT_TRUE(out.GuardsIntact());
    }
  }
}

TEST(EmbeddingTest, RejectsBadIds) {
  const std::vector<float> table(4 * 2, 1.0f);
  const std::vector<int32_t> ids = {0, 4};
  Guarded out(2 * 2);
  const absl::Status s = Embedding({ids.data(), table.data(), out.data(), 2, 4, 2});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(s, "ids[1]")) << s;
  EXPECT_EQ(Embedding({nullptr, table.data(), out.data(), 2, 4, 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Embedding({ids.data(), table.data(), out.data(), 0, 4, 2}).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- RmsNorm ------------------------------------------------------------------------------------

std::vector<double> RmsNormRef(const std::vector<float>& in, const std::vector<float>& w, int64_t n,
                               int64_t d, double eps) {
  std::vector<double> out(in.size());
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0.0;
    for (int64_t j = 0; j < d; ++j)
      ss += double{in[static_cast<size_t>(i * d + j)]} * in[static_cast<size_t>(i * d + j)];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (int64_t j = 0; j < d; ++j) {
      out[static_cast<size_t>(i * d + j)] =
          in[static_cast<size_t>(i * d + j)] * inv * w[static_cast<size_t>(j)];
    }
  }
  return out;
}

// The fp32 result takes ~4 roundings (mean, +eps, rsqrt, two products) of relative 2^-24 each
// around the double reference; 1e-6 relative leaves margin and still catches any wrong term.
constexpr double kRmsNormRtol = 1e-6;

TEST(RmsNormTest, MatchesDoubleReference) {
  std::mt19937 rng(2);
  for (int64_t d : {1, 17, 64, 768}) {
    for (int64_t n : {1, 17}) {
      SCOPED_TRACE("d " + std::to_string(d) + " n " + std::to_string(n));
      const std::vector<float> x = RandomFloats(rng, n * d, -3.0f, 3.0f);
      const std::vector<float> w = RandomFloats(rng, d, 0.5f, 1.5f);
      Guarded out(n * d);
      ASSERT_TRUE(RmsNorm({x.data(), nullptr, w.data(), out.data(), n, d, 1e-5f}).ok());
      EXPECT_TRUE(AllClose(out.data(), RmsNormRef(x, w, n, d, 1e-5), 0.0, kRmsNormRtol));
      EXPECT_TRUE(out.GuardsIntact());
    }
  }
}

TEST(RmsNormTest, FusedResidualAddsThenNormalises) {
  std::mt19937 rng(3);
  const int64_t n = 17, d = 97;
  const std::vector<float> x = RandomFloats(rng, n * d);
  const std::vector<float> r0 = RandomFloats(rng, n * d, -2.0f, 2.0f);
  const std::vector<float> w = RandomFloats(rng, d, 0.5f, 1.5f);
  Guarded residual(n * d), out(n * d);
  Fill(residual, r0);
  ASSERT_TRUE(RmsNorm({x.data(), residual.data(), w.data(), out.data(), n, d, 1e-6f}).ok());
  std::vector<float> updated(r0.size());
  for (size_t i = 0; i < r0.size(); ++i) {
    updated[i] = r0[i] + x[i];  // one fp32 addition: must match bit for bit
    ASSERT_EQ(residual[static_cast<int64_t>(i)], updated[i]) << i;
  }
  EXPECT_TRUE(AllClose(out.data(), RmsNormRef(updated, w, n, d, 1e-6), 0.0, kRmsNormRtol));
  EXPECT_TRUE(residual.GuardsIntact());
  EXPECT_TRUE(out.GuardsIntact());
}

TEST(RmsNormTest, OutMayAliasX) {
  std::mt19937 rng(4);
  const int64_t n = 3, d = 64;
  const std::vector<float> x = RandomFloats(rng, n * d);
  const std::vector<float> w = RandomFloats(rng, d);
  Guarded separate(n * d), inplace(n * d);
  Fill(inplace, x);
  ASSERT_TRUE(RmsNorm({x.data(), nullptr, w.data(), separate.data(), n, d, 1e-5f}).ok());
  ASSERT_TRUE(RmsNorm({inplace.data(), nullptr, w.data(), inplace.data(), n, d, 1e-5f}).ok());
  EXPECT_EQ(separate.values(), inplace.values());  // same arithmetic: identical bits
  EXPECT_TRUE(inplace.GuardsIntact());
}

TEST(RmsNormTest, RejectsBadParams) {
  const std::vector<float> x(4, 1.0f), w(4, 1.0f);
  std::vector<float> out(4);
  EXPECT_EQ(RmsNorm({x.data(), nullptr, nullptr, out.data(), 1, 4, 1e-5f}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RmsNorm({x.data(), nullptr, w.data(), out.data(), 1, 0, 1e-5f}).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- RoPE ---------------------------------------------------------------------------------------

TEST(RopeInvFreqTest, DefaultMatchesFormula) {
  for (int64_t d : {32, 64, 128}) {
    for (double theta : {10000.0, 500000.0}) {
      RopeSpec spec;
      spec.theta = theta;
      const std::vector<float> inv = RopeInvFreq(spec, d);
      ASSERT_EQ(static_cast<int64_t>(inv.size()), d / 2);
      std::vector<double> ref(inv.size());
      for (size_t i = 0; i < ref.size(); ++i) {
        ref[i] = 1.0 / std::pow(theta, 2.0 * static_cast<double>(i) / static_cast<double>(d));
      }
      // transformers rounds the exponent 2i/d to fp32 (relative 2^-24) before pow; that error
      // is amplified by ln(theta) <= 13.2, so ~8e-7 relative, plus two roundings: 2e-6.
      EXPECT_TRUE(AllClose(inv.data(), ref, 0.0, 2e-6)) << "d " << d << " theta " << theta;
    }
  }
  // Exact values: theta^0 = 1, and 10000^(32/64) = 100 exactly.
  const std::vector<float> inv = RopeInvFreq(RopeSpec{}, 64);
  EXPECT_EQ(inv[0], 1.0f);
  EXPECT_EQ(inv[16], 1.0f / 100.0f);
  EXPECT_TRUE(RopeInvFreq(RopeSpec{}, 0).empty());
}

TEST(RopeInvFreqTest, Llama3MatchesHandComputedValues) {
  RopeSpec spec;  // Llama 3.1's rope_scaling
  spec.type = RopeType::kLlama3;
  spec.theta = 500000.0;
  spec.factor = 8.0;
  spec.low_freq_factor = 1.0;
  spec.high_freq_factor = 4.0;
  spec.original_max_position = 8192;
  const std::vector<float> inv = RopeInvFreq(spec, 128);
  ASSERT_EQ(inv.size(), 64u);
  // Computed in double with the transformers formula (Python): wavelen = 2π/inv_freq against
  // 2048 (high) and 8192 (low); bands: i <= 28 unchanged, 29..34 smoothed, >= 35 divided by 8.
  struct Want {
    int i;
    double value;
  };
  const Want wants[] = {{0, 1.000000000e+00},  {20, 1.656044008e-02}, {28, 3.211445995e-03},
                        {29, 2.166570764e-03}, {31, 8.567514129e-04}, {34, 1.785078128e-04},
                        {35, 9.556212354e-05}, {36, 7.784655274e-05}, {63, 3.068925989e-07}};
  for (const Want& w : wants) {
    // fp32 steps (see DefaultMatchesFormula) plus the fp32 smoothing arithmetic (~4 roundings,
    // the smooth factor's error amplified by at most 8/7): 4e-6 relative.
    EXPECT_NEAR(inv[static_cast<size_t>(w.i)], w.value, 4e-6 * w.value) << "i " << w.i;
  }
  // Default frequencies are unchanged in the high band and divided by `factor` in the low one.
  RopeSpec plain = spec;
  plain.type = RopeType::kDefault;
  const std::vector<float> base = RopeInvFreq(plain, 128);
  EXPECT_EQ(inv[10], base[10]);
  EXPECT_EQ(inv[50], base[50] / 8.0f);
}

// Naive double RoPE with the contract's fp32 angle: float(pos) * inv_freq rounded to fp32.
void RopeRef(std::vector<double>& x, int64_t rows, int64_t stride, int64_t heads, int64_t d,
             const std::vector<int32_t>& pos, const std::vector<float>& inv, int64_t offset) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      double* v = x.data() + offset + i * stride + h * d;
      for (int64_t j = 0; j < d / 2; ++j) {
        const float angle_f = static_cast<float>(pos[static_cast<size_t>(i)]) * inv[static_cast<size_t>(j)];
        const double c = std::cos(double{angle_f}), s = std::sin(double{angle_f});
        const double a = v[j], b = v[j + d / 2];
        v[j] = a * c - b * s;
        v[j + d / 2] = b * c + a * s;
      }
    }
  }
}

TEST(RopeTest, MatchesDoubleReferenceInFusedQkvRows) {
  std::mt19937 rng(5);
  struct Shape {
    int64_t heads, kv_heads, d;
  };
  for (const Shape& sh : {Shape{4, 2, 64}, Shape{2, 2, 128}, Shape{3, 1, 32}}) {
    for (int64_t n : {1, 17}) {
      SCOPED_TRACE("heads " + std::to_string(sh.heads) + "/" + std::to_string(sh.kv_heads) + " d " +
                   std::to_string(sh.d) + " n " + std::to_string(n));
      // Rows of a fused qkv projection: [q | k | v], so q_stride = k_stride = row width.
      const int64_t q_w = sh.heads * sh.d, kv_w = sh.kv_heads * sh.d, row = q_w + 2 * kv_w;
      const std::vector<float> qkv = RandomFloats(rng, n * row);
      std::vector<int32_t> pos(static_cast<size_t>(n));
      std::uniform_int_distribution<int32_t> pd(0, 8000);
      for (auto& p : pos) p = pd(rng);
      pos[0] = 0;
      RopeSpec spec;
      const std::vector<float> inv = RopeInvFreq(spec, sh.d);
      Guarded buf(n * row);
      Fill(buf, qkv);
      ASSERT_TRUE(Rope({buf.data(), buf.data() + q_w, pos.data(), inv.data(), n, sh.heads, sh.kv_heads, sh.d,
                        row, row})
                      .ok());
      std::vector<double> ref(qkv.begin(), qkv.end());
      RopeRef(ref, n, row, sh.heads, sh.d, pos, inv, 0);
      RopeRef(ref, n, row, sh.kv_heads, sh.d, pos, inv, q_w);
      // Inputs in [-1, 1]: fp32 cos/sin (1 rounding each), two products and a sum give at most
      // ~4 · 2^-24 · (|a| + |b|) ≈ 5e-7 absolute; 1e-6 with margin. v must be untouched.
      EXPECT_TRUE(AllClose(buf.data(), ref, 1e-6, 0.0));
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = q_w + kv_w; j < row; ++j)
          ASSERT_EQ(buf[i * row + j], qkv[static_cast<size_t>(i * row + j)]);
      }
      EXPECT_TRUE(buf.GuardsIntact());
    }
  }
}

TEST(RopeTest, SeparateQAndKvRowsWithDifferentStrides) {
  std::mt19937 rng(19);
  const int64_t n = 17, heads = 6, kv_heads = 2, d = 64;  // q_w = 384 != k_stride = 256
  const int64_t q_w = heads * d, kv_w = kv_heads * d;
  // q packed (q_stride 0); k inside rows of [k | v], so k_stride = 2 · kv_w.
  const std::vector<float> q0 = RandomFloats(rng, n * q_w), kv0 = RandomFloats(rng, n * 2 * kv_w);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(3 * i + 1);
  const std::vector<float> inv = RopeInvFreq(RopeSpec{}, d);
  Guarded q(n * q_w), kv(n * 2 * kv_w);
  Fill(q, q0);
  Fill(kv, kv0);
  ASSERT_TRUE(Rope({q.data(), kv.data(), pos.data(), inv.data(), n, heads, kv_heads, d, 0, 2 * kv_w}).ok());
  std::vector<double> q_ref(q0.begin(), q0.end()), kv_ref(kv0.begin(), kv0.end());
  RopeRef(q_ref, n, q_w, heads, d, pos, inv, 0);
  RopeRef(kv_ref, n, 2 * kv_w, kv_heads, d, pos, inv, 0);
  EXPECT_TRUE(AllClose(q.data(), q_ref, 1e-6, 0.0));    // tolerance: see the fused-rows test
  EXPECT_TRUE(AllClose(kv.data(), kv_ref, 1e-6, 0.0));  // v halves must be untouched (exact)
  EXPECT_TRUE(q.GuardsIntact());
  EXPECT_TRUE(kv.GuardsIntact());
  // k may be null: q alone rotates, to the same bits.
  Guarded q_only(n * q_w);
  Fill(q_only, q0);
  ASSERT_TRUE(Rope({q_only.data(), nullptr, pos.data(), inv.data(), n, heads, 0, d, 0, 0}).ok());
  EXPECT_EQ(q_only.values(), q.values());
}

TEST(RopeTest, PreservesNormsAndPositionZeroIsIdentity) {
  std::mt19937 rng(6);
  const int64_t n = 17, heads = 4, kv_heads = 2, d = 128;
  const std::vector<float> q0 = RandomFloats(rng, n * heads * d);
  const std::vector<float> k0 = RandomFloats(rng, n * kv_heads * d);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i * 997);
  RopeSpec spec;
  spec.theta = 500000.0;
  const std::vector<float> inv = RopeInvFreq(spec, d);
  std::vector<float> q = q0, k = k0;
  ASSERT_TRUE(Rope({q.data(), k.data(), pos.data(), inv.data(), n, heads, kv_heads, d}).ok());
  for (int64_t i = 0; i < n * heads; ++i) {
    for (int64_t j = 0; j < d / 2; ++j) {
      const size_t a = static_cast<size_t>(i * d + j), b = a + static_cast<size_t>(d / 2);
      const double before = double{q0[a]} * q0[a] + double{q0[b]} * q0[b];
      const double after = double{q[a]} * q[a] + double{q[b]} * q[b];
      // A rotation keeps each pair's norm; fp32 rounding of cos/sin/products: ~1e-6 relative.
      ASSERT_NEAR(after, before, 2e-6 * before + 1e-12) << "row " << i / heads << " pair " << j;
    }
  }
  // Row 0 sits at position 0: cos = 1, sin = 0, so a·1 − b·0 = a exactly.
  for (int64_t j = 0; j < heads * d; ++j) ASSERT_EQ(q[static_cast<size_t>(j)], q0[static_cast<size_t>(j)]);
  for (int64_t j = 0; j < kv_heads * d; ++j) ASSERT_EQ(k[static_cast<size_t>(j)], k0[static_cast<size_t>(j)]);
}

TEST(RopeTest, RejectsBadParams) {
  std::vector<float> q(8), k(8), inv(2);
  const std::vector<int32_t> pos = {0, -1};
  EXPECT_EQ(Rope({q.data(), k.data(), pos.data(), inv.data(), 2, 1, 1, 4}).code(),
            absl::StatusCode::kInvalidArgument);  // negative position
  const std::vector<int32_t> ok_pos = {0, 1};
  EXPECT_EQ(Rope({q.data(), k.data(), ok_pos.data(), inv.data(), 2, 1, 1, 3}).code(),
            absl::StatusCode::kInvalidArgument);  // odd head_dim
  EXPECT_EQ(Rope({q.data(), k.data(), ok_pos.data(), nullptr, 2, 1, 1, 4}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Rope({q.data(), k.data(), ok_pos.data(), inv.data(), 2, 1, 1, 4}).ok());
}

// RopeShift: keys rotated at one position and turned to another equal keys rotated at the other
// (a double reference of Rope at the new position); rows not listed, and rows whose two positions
// are equal, keep their bits.
TEST(RopeShiftTest, TurnedKeysMatchRopeAtTheNewPosition) {
  std::mt19937 rng(23);
  struct Shape {
    int64_t kv_heads, d, stride;
  };
  for (const Shape& sh : {Shape{2, 64, 0}, Shape{1, 128, 0}, Shape{3, 32, 3 * 32 + 8}}) {
    for (const RopeType type : {RopeType::kDefault, RopeType::kLlama3}) {
      SCOPED_TRACE("kv_heads " + std::to_string(sh.kv_heads) + " d " + std::to_string(sh.d));
      RopeSpec spec;
      if (type == RopeType::kLlama3) spec = {.type = type, .theta = 500000.0, .factor = 8.0};
      const std::vector<float> inv = RopeInvFreq(spec, sh.d);
      const int64_t width = sh.kv_heads * sh.d, stride = sh.stride == 0 ? width : sh.stride;
      const int64_t num_rows = 40, n = 23;
      const std::vector<float> x = RandomFloats(rng, num_rows * stride);
      // n distinct rows; positions up to 100K, the last row not moved.
      std::vector<int32_t> rows(static_cast<size_t>(num_rows));
      std::iota(rows.begin(), rows.end(), 0);
      std::shuffle(rows.begin(), rows.end(), rng);
      rows.resize(static_cast<size_t>(n));
      std::vector<int32_t> from(static_cast<size_t>(n)), to(static_cast<size_t>(n)), all_from(num_rows, 0);
      std::uniform_int_distribution<int32_t> pd(0, 100000);
      for (int64_t i = 0; i < n; ++i) {
        from[static_cast<size_t>(i)] = pd(rng), to[static_cast<size_t>(i)] = pd(rng);
        all_from[static_cast<size_t>(rows[static_cast<size_t>(i)])] = from[static_cast<size_t>(i)];
      }
      to[static_cast<size_t>(n - 1)] = from[static_cast<size_t>(n - 1)];
      std::vector<float> k = x;  // every row rotated at its from position (0 for the unlisted)
      ASSERT_TRUE(Rope({.q = k.data(),
                        .positions = all_from.data(),
                        .inv_freq = inv.data(),
                        .n = num_rows,
                        .num_heads = sh.kv_heads,
                        .head_dim = sh.d,
                        .q_stride = stride})
                      .ok());
      const std::vector<float> before = k;
      ASSERT_TRUE(RopeShift({.k = k.data(),
                             .rows = rows.data(),
                             .from_positions = from.data(),
                             .to_positions = to.data(),
                             .inv_freq = inv.data(),
                             .n = n,
                             .num_rows = num_rows,
                             .num_kv_heads = sh.kv_heads,
                             .head_dim = sh.d,
                             .k_stride = sh.stride})
                      .ok());
      std::vector<int32_t> want_pos = all_from;
      for (int64_t i = 0; i < n; ++i)
        want_pos[static_cast<size_t>(rows[static_cast<size_t>(i)])] = to[static_cast<size_t>(i)];
      std::vector<double> ref(x.begin(), x.end());
      RopeRef(ref, num_rows, stride, sh.kv_heads, sh.d, want_pos, inv, 0);
      // Two rotations of inputs in [-1, 1], each within ~5e-7 (see the Rope tests): 2e-6.
      for (int64_t r = 0; r < num_rows; ++r) {
        for (int64_t j = 0; j < width; ++j) {
          const size_t at = static_cast<size_t>(r * stride + j);
          ASSERT_NEAR(k[at], ref[at], 2e-6) << "row " << r << " element " << j;
        }
        for (int64_t j = width; j < stride; ++j)
          ASSERT_EQ(k[static_cast<size_t>(r * stride + j)], x[static_cast<size_t>(r * stride + j)]);
      }
      const auto listed = [&](int32_t r) {
        return std::find(rows.begin(), rows.end() - 1, r) != rows.end() - 1;
      };
      for (int32_t r = 0; r < num_rows; ++r) {
        if (listed(r)) continue;
        for (int64_t j = 0; j < stride; ++j)
          ASSERT_EQ(k[static_cast<size_t>(r * stride + j)], before[static_cast<size_t>(r * stride + j)]);
      }
    }
  }
}

// CopyRows against a naive copy over random planes, and its refusals.
TEST(CopyRowsTest, CopiesRowsOfEveryPlaneAndNothingElse) {
  std::mt19937 rng(31);
  const int64_t planes = 3, num_rows = 20, width = 12, stride = num_rows * width + 5;
  const std::vector<float> x = RandomFloats(rng, planes * stride);
  std::vector<int32_t> rows(static_cast<size_t>(num_rows));
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  const std::vector<int32_t> src(rows.begin(), rows.begin() + 7), dst(rows.begin() + 7, rows.begin() + 14);
  std::vector<float> got = x, want = x;
  ASSERT_TRUE(CopyRows({.cache = got.data(),
                        .src = src.data(),
                        .dst = dst.data(),
                        .n = 7,
                        .width = width,
                        .num_rows = num_rows,
                        .planes = planes,
                        .plane_stride = stride})
                  .ok());
  for (int64_t q = 0; q < planes; ++q) {
    for (size_t i = 0; i < src.size(); ++i) {
      for (int64_t j = 0; j < width; ++j)
        want[static_cast<size_t>(q * stride + dst[i] * width + j)] =
            x[static_cast<size_t>(q * stride + src[i] * width + j)];
    }
  }
  EXPECT_EQ(got, want);
  const std::vector<int32_t> repeat = {dst[0], dst[0]}, two = {src[0], src[1]}, onto_src = {src[1], dst[1]},
                             outside = {dst[0], static_cast<int32_t>(num_rows)};
  for (const std::vector<int32_t>* bad : {&repeat, &onto_src, &outside}) {
    EXPECT_EQ(CopyRows({.cache = got.data(),
                        .src = two.data(),
                        .dst = bad->data(),
                        .n = 2,
                        .width = width,
                        .num_rows = num_rows})
                  .code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(got, want) << "a refused copy changed the cache";
}

TEST(RopeShiftTest, RejectsBadParams) {
  std::vector<float> k(16), inv(2);
  const std::vector<int32_t> rows = {0, 1}, pos = {0, 5}, neg = {0, -1}, outside = {0, 4};
  auto params = [&](const std::vector<int32_t>& r, const std::vector<int32_t>& from, int64_t d) {
    return RopeShiftParams{.k = k.data(),
                           .rows = r.data(),
                           .from_positions = from.data(),
                           .to_positions = pos.data(),
                           .inv_freq = inv.data(),
                           .n = 2,
                           .num_rows = 4,
                           .num_kv_heads = 1,
                           .head_dim = d};
  };
  EXPECT_TRUE(RopeShift(params(rows, pos, 4)).ok());
  EXPECT_EQ(RopeShift(params(rows, neg, 4)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RopeShift(params(outside, pos, 4)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RopeShift(params(rows, pos, 3)).code(), absl::StatusCode::kInvalidArgument);
  RopeShiftParams no_freq = params(rows, pos, 4);
  no_freq.inv_freq = nullptr;
  EXPECT_EQ(RopeShift(no_freq).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Matmul -------------------------------------------------------------------------------------

struct MatmulCase {
  int64_t m, n, k;
};

// y = x·wᵀ (+ y0) in double, and per element the rigorous bound of any fp32 summation order:
// |err| <= γ(k+1) · (Σ|x||w| + |y0|) with γ(j) ≈ j · 2^-24 (Higham, Thm 3.1). Any wrong, missing
// or doubled term is far larger for random inputs.
void MatmulRef(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w,
               const std::vector<float>* y0, int64_t ldy0, const MatmulCase& c, std::vector<double>* ref,
               std::vector<double>* tol) {
  ref->assign(static_cast<size_t>(c.m * c.n), 0.0);
  tol->assign(ref->size(), 0.0);
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double s = 0.0, mag = 0.0;
      for (int64_t t = 0; t < c.k; ++t) {
        const double prod = double{x[static_cast<size_t>(i * ldx + t)]} * w[static_cast<size_t>(j * c.k + t)];
        s += prod;
        mag += std::abs(prod);
      }
      if (y0 != nullptr) {
        const double y = (*y0)[static_cast<size_t>(i * ldy0 + j)];
        s += y;
        mag += std::abs(y);
      }
      (*ref)[static_cast<size_t>(i * c.n + j)] = s;
      (*tol)[static_cast<size_t>(i * c.n + j)] = static_cast<double>(c.k + 1) * kFloatEps * mag + 1e-30;
    }
  }
}

TEST(MatmulTest, MatchesDoubleReference) {
  std::mt19937 rng(7);
  // Odd shapes cross the fallback's register tiles (2 x 4), k blocks (1024) and thread tiles.
  for (const MatmulCase& c : {MatmulCase{1, 1, 1}, MatmulCase{1, 17, 33}, MatmulCase{17, 1, 64},
                              MatmulCase{17, 17, 97}, MatmulCase{1, 768, 768}, MatmulCase{64, 768, 768},
                              MatmulCase{5, 130, 1030}, MatmulCase{3, 5, 2100}}) {
    SCOPED_TRACE("m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k));
    const std::vector<float> x = RandomFloats(rng, c.m * c.k);
    const std::vector<float> w = RandomFloats(rng, c.n * c.k);
    Guarded y(c.m * c.n);  // prefilled with NaN: beta = 0 must not read y
    ASSERT_TRUE(Matmul({x.data(), w.data(), y.data(), c.m, c.n, c.k}).ok());
    std::vector<double> ref, tol;
    MatmulRef(x, c.k, w, nullptr, 0, c, &ref, &tol);
    EXPECT_TRUE(AllClose(y.data(), ref, 0.0, 0.0, &tol));
    EXPECT_TRUE(y.GuardsIntact());
  }
}

TEST(MatmulTest, AccumulatesWithStrides) {
  std::mt19937 rng(8);
  for (const MatmulCase& c : {MatmulCase{1, 17, 97}, MatmulCase{17, 33, 64}, MatmulCase{64, 96, 200}}) {
    SCOPED_TRACE("m " + std::to_string(c.m) + " n " + std::to_string(c.n) + " k " + std::to_string(c.k));
    const int64_t ldx = c.k + 3, ldy = c.n + 5;
    const std::vector<float> x = RandomFloats(rng, c.m * ldx);
    const std::vector<float> w = RandomFloats(rng, c.n * c.k);
    std::vector<float> y0 = RandomFloats(rng, c.m * ldy);
    for (int64_t accumulate = 0; accumulate < 2; ++accumulate) {
      Guarded y(c.m * ldy);
      Fill(y, y0);
      for (int64_t i = 0; i < c.m; ++i) {  // the padding columns hold a marker
        for (int64_t j = c.n; j < ldy; ++j) y[i * ldy + j] = kSentinel;
      }
      MatmulParams p{x.data(), w.data(), y.data(), c.m, c.n, c.k, ldx, ldy, accumulate != 0};
      ASSERT_TRUE(Matmul(p).ok());
      std::vector<double> ref, tol;
      MatmulRef(x, ldx, w, accumulate ? &y0 : nullptr, ldy, c, &ref, &tol);
      std::vector<float> packed(static_cast<size_t>(c.m * c.n));
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) packed[static_cast<size_t>(i * c.n + j)] = y[i * ldy + j];
        for (int64_t j = c.n; j < ldy; ++j) ASSERT_EQ(y[i * ldy + j], kSentinel) << "row " << i;
      }
      EXPECT_TRUE(AllClose(packed.data(), ref, 0.0, 0.0, &tol)) << "accumulate " << accumulate;
      EXPECT_TRUE(y.GuardsIntact());
    }
  }
}

TEST(MatmulTest, RepeatedRunsAreBitIdentical) {
  // Threads split the output, never a dot product: any race shows as changed bits.
  std::mt19937 rng(9);
  const MatmulCase c{33, 200, 300};
  const std::vector<float> x = RandomFloats(rng, c.m * c.k), w = RandomFloats(rng, c.n * c.k);
  std::vector<float> first(static_cast<size_t>(c.m * c.n)), again(first.size());
  ASSERT_TRUE(Matmul({x.data(), w.data(), first.data(), c.m, c.n, c.k}).ok());
  for (int rep = 0; rep < 5; ++rep) {
    ASSERT_TRUE(Matmul({x.data(), w.data(), again.data(), c.m, c.n, c.k}).ok());
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0) << rep;
  }
}

TEST(MatmulTest, RejectsBadParams) {
  std::vector<float> x(8), w(8), y(8);
  EXPECT_EQ(Matmul({nullptr, w.data(), y.data(), 2, 2, 2}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Matmul({x.data(), w.data(), y.data(), 0, 2, 2}).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status s = Matmul({x.data(), w.data(), y.data(), 2, 2, 4, 3, 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(MessageHas(s, "x_stride")) << s;
}

// ---- SiluMul ------------------------------------------------------------------------------------

TEST(SiluMulTest, MatchesDoubleReference) {
  std::mt19937 rng(10);
  for (int64_t inter : {1, 17, 64}) {
    for (int64_t n : {1, 17}) {
      SCOPED_TRACE("inter " + std::to_string(inter) + " n " + std::to_string(n));
      const std::vector<float> gu = RandomFloats(rng, n * 2 * inter, -10.0f, 10.0f);
      Guarded out(n * inter);
      ASSERT_TRUE(SiluMul({gu.data(), out.data(), n, inter}).ok());
      std::vector<double> ref(static_cast<size_t>(n * inter));
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < inter; ++j) {
          const double g = gu[static_cast<size_t>(i * 2 * inter + j)];
          const double u = gu[static_cast<size_t>(i * 2 * inter + inter + j)];
          ref[static_cast<size_t>(i * inter + j)] = g / (1.0 + std::exp(-g)) * u;
        }
      }
      // expf (< 1 ulp), an addition, a division and a product: ~4 roundings, 1e-6 relative.
      // The addition 1 + exp(-g) is well conditioned, so relative error holds near zero too.
      EXPECT_TRUE(AllClose(out.data(), ref, 0.0, 1e-6));
      EXPECT_TRUE(out.GuardsIntact());
    }
  }
}

TEST(SiluMulTest, ExtremeGatesStayFinite) {
  const std::vector<float> gu = {-200.0f, 200.0f, 0.0f, 3.0f, 3.0f, 3.0f};  // n = 1, inter = 3
  Guarded out(3);
  ASSERT_TRUE(SiluMul({gu.data(), out.data(), 1, 3}).ok());
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 600.0f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_TRUE(out.GuardsIntact());
}

// ---- Attention ----------------------------------------------------------------------------------

struct RequestShape {
  int32_t q_len, kv_len;
};

// A ragged batch in a KV cache whose slots are a random permutation, every K/V element random.
struct AttentionCase {
  int64_t heads, kv_heads, d;
  std::vector<RequestShape> requests;
  std::vector<int32_t> q_indptr, kv_indptr, slots;
  int64_t num_slots = 0, total_q = 0;
  std::vector<float> q, k_cache, v_cache;

  AttentionCase(int64_t h, int64_t kvh, int64_t dim, std::vector<RequestShape> reqs, uint32_t seed)
      : heads(h), kv_heads(kvh), d(dim), requests(std::move(reqs)) {
    std::mt19937 rng(seed);
    q_indptr = {0};
    kv_indptr = {0};
    for (const RequestShape& r : requests) {
      q_indptr.push_back(q_indptr.back() + r.q_len);
      kv_indptr.push_back(kv_indptr.back() + r.kv_len);
    }
    total_q = q_indptr.back();
    num_slots = kv_indptr.back() + 13;  // some slots belong to no request
    std::vector<int32_t> perm(static_cast<size_t>(num_slots));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    slots.assign(perm.begin(), perm.begin() + kv_indptr.back());
    q = RandomFloats(rng, total_q * heads * d);
    k_cache = RandomFloats(rng, num_slots * kv_heads * d);
    v_cache = RandomFloats(rng, num_slots * kv_heads * d);
  }

  float scale() const { return 1.0f / std::sqrt(static_cast<float>(d)); }

  AttentionParams Params(float* out, float* lse) const {
    AttentionParams p;
    p.q = q.data();
    p.k_cache = k_cache.data();
    p.v_cache = v_cache.data();
    p.out = out;
    p.lse = lse;
    p.q_indptr = q_indptr.data();
    p.kv_indptr = kv_indptr.data();
    p.kv_slots = slots.data();
    p.num_requests = static_cast<int64_t>(requests.size());
    p.num_slots = num_slots;
    p.num_heads = heads;
    p.num_kv_heads = kv_heads;
    p.head_dim = d;
    p.scale = scale();
    return p;
  }

  // Naive double attention: explicit positions, causal mask, GQA mapping.
  void Reference(std::vector<double>* out, std::vector<double>* lse) const {
    out->assign(static_cast<size_t>(total_q * heads * d), 0.0);
    lse->assign(static_cast<size_t>(total_q * heads), 0.0);
    for (size_t r = 0; r < requests.size(); ++r) {
      const int64_t q_len = requests[r].q_len, kv_len = requests[r].kv_len;
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t row = q_indptr[r] + i;
        const int64_t position = kv_len - q_len + i;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t kvh = h * kv_heads / heads;
          std::vector<double> s;
          for (int64_t j = 0; j <= position; ++j) {
            const int64_t slot = slots[static_cast<size_t>(kv_indptr[r] + j)];
            double dot = 0.0;
            for (int64_t t = 0; t < d; ++t) {
              dot += double{q[static_cast<size_t>((row * heads + h) * d + t)]} *
                     k_cache[static_cast<size_t>((slot * kv_heads + kvh) * d + t)];
            }
            s.push_back(dot * scale());
          }
          const double m = *std::max_element(s.begin(), s.end());
          double sum = 0.0;
          for (double v : s) sum += std::exp(v - m);
          (*lse)[static_cast<size_t>(row * heads + h)] = m + std::log(sum);
          for (int64_t j = 0; j <= position; ++j) {
            const int64_t slot = slots[static_cast<size_t>(kv_indptr[r] + j)];
            const double pj = std::exp(s[static_cast<size_t>(j)] - m) / sum;
            for (int64_t t = 0; t < d; ++t) {
              (*out)[static_cast<size_t>((row * heads + h) * d + t)] +=
                  pj * v_cache[static_cast<size_t>((slot * kv_heads + kvh) * d + t)];
            }
          }
        }
      }
    }
  }
};

// Mixed batch: a 97-token prefill, a decode row with context 97, a 17-token chunk continuing a
// 23-token prefix, a first-token decode (one key) and a request with no rows this step.
std::vector<RequestShape> MixedBatch() { return {{97, 97}, {1, 97}, {17, 40}, {1, 1}, {0, 5}}; }

// Scores s = scale·q·k with |q|,|k| <= 1: the fp32 dot has error <= γ(d)·scale·Σ|q||k| <=
// 128 · 2^-24 · sqrt(128) ≈ 9e-5 in the worst case, ~1e-6 typically; a score error δ moves each
// output (a convex combination of |v| <= 1) and lse by at most ~δ. exp/log/normalisation add
// a few 2^-24. 2e-5 absolute sits between typical error and any indexing or masking mistake.
constexpr double kAttentionAtol = 2e-5;

void ExpectAttentionMatches(const AttentionCase& c) {
  Guarded out(c.total_q * c.heads * c.d), lse(c.total_q * c.heads);
  ASSERT_TRUE(Attention(c.Params(out.data(), lse.data())).ok());
  std::vector<double> ref_out, ref_lse;
  c.Reference(&ref_out, &ref_lse);
  EXPECT_TRUE(AllClose(out.data(), ref_out, kAttentionAtol, 0.0));
  EXPECT_TRUE(AllClose(lse.data(), ref_lse, kAttentionAtol, 0.0));
  EXPECT_TRUE(out.GuardsIntact());
  EXPECT_TRUE(lse.GuardsIntact());
  // lse is optional; without it out is the same bits.
  Guarded out2(c.total_q * c.heads * c.d);
  ASSERT_TRUE(Attention(c.Params(out2.data(), nullptr)).ok());
  EXPECT_EQ(std::memcmp(out.data(), out2.data(), sizeof(float) * static_cast<size_t>(out.size())), 0);
}

TEST(AttentionTest, MhaMixedBatchHeadDim64) {
  ExpectAttentionMatches(AttentionCase(4, 4, 64, MixedBatch(), 11));
}
TEST(AttentionTest, GqaMixedBatchHeadDim128) {
  ExpectAttentionMatches(AttentionCase(8, 2, 128, MixedBatch(), 12));
}
TEST(AttentionTest, MqaMixedBatchHeadDim32) {
  ExpectAttentionMatches(AttentionCase(4, 1, 32, MixedBatch(), 13));
}
TEST(AttentionTest, DecodeOnlyBatch) {
  ExpectAttentionMatches(AttentionCase(6, 3, 64, {{1, 17}, {1, 1}, {1, 97}, {1, 2}}, 14));
}

TEST(AttentionTest, SingleKeyReturnsValueExactly) {
  const AttentionCase c(4, 2, 64, {{1, 1}}, 15);
  Guarded out(c.heads * c.d), lse(c.heads);
  ASSERT_TRUE(Attention(c.Params(out.data(), lse.data())).ok());
  const int64_t slot = c.slots[0];
  for (int64_t h = 0; h < c.heads; ++h) {
    const int64_t kvh = h / (c.heads / c.kv_heads);
    double score = 0.0;
    for (int64_t t = 0; t < c.d; ++t) {
      score += double{c.q[static_cast<size_t>(h * c.d + t)]} *
               c.k_cache[static_cast<size_t>((slot * c.kv_heads + kvh) * c.d + t)];
      // softmax of one score is exactly 1, and 1 · v = v.
      ASSERT_EQ(out[h * c.d + t], c.v_cache[static_cast<size_t>((slot * c.kv_heads + kvh) * c.d + t)]) << h;
    }
    // lse = score + log(1): just the fp32 score (64-term dot, see kAttentionAtol).
    EXPECT_NEAR(lse[h], score * c.scale(), kAttentionAtol) << h;
  }
}

TEST(AttentionTest, CausalRowsIgnoreLaterKeys) {
  AttentionCase c(4, 2, 32, {{1, 9}, {23, 30}}, 16);
  const int64_t n_out = c.total_q * c.heads * c.d;
  Guarded before(n_out), after(n_out);
  ASSERT_TRUE(Attention(c.Params(before.data(), nullptr)).ok());
  // Change K and V of request 1's key 15 (its chunk starts at position 7, so query row i sits at
  // position 7 + i): rows 0..7 (positions < 15) must not move, rows 8.. must.
  const int64_t slot = c.slots[static_cast<size_t>(c.kv_indptr[1] + 15)];
  for (int64_t t = 0; t < c.kv_heads * c.d; ++t) {
    c.k_cache[static_cast<size_t>(slot * c.kv_heads * c.d + t)] = 5.0f;
    c.v_cache[static_cast<size_t>(slot * c.kv_heads * c.d + t)] = -5.0f;
  }
  ASSERT_TRUE(Attention(c.Params(after.data(), nullptr)).ok());
  const int64_t row_floats = c.heads * c.d;
  for (int64_t row = 0; row < c.total_q; ++row) {
    const bool same = std::memcmp(before.data() + row * row_floats, after.data() + row * row_floats,
                                  sizeof(float) * static_cast<size_t>(row_floats)) == 0;
    const int64_t i = row - c.q_indptr[1];  // row within request 1; request 0's row is row 0
    if (row < c.q_indptr[1] || i < 8) {
      EXPECT_TRUE(same) << "row " << row << " saw a later key or another request's key";
    } else {
      EXPECT_FALSE(same) << "row " << row << " ignored a visible key";
    }
  }
}

TEST(AttentionTest, RepeatedRunsAreBitIdentical) {
  const AttentionCase c(8, 2, 64, MixedBatch(), 17);
  const int64_t n_out = c.total_q * c.heads * c.d;
  std::vector<float> first(static_cast<size_t>(n_out)), again(first.size());
  ASSERT_TRUE(Attention(c.Params(first.data(), nullptr)).ok());
  for (int rep = 0; rep < 5; ++rep) {
    ASSERT_TRUE(Attention(c.Params(again.data(), nullptr)).ok());
    ASSERT_EQ(std::memcmp(first.data(), again.data(), sizeof(float) * first.size()), 0) << rep;
  }
}

TEST(AttentionTest, ConcurrentCallersGetIdenticalResults) {
  // Ops are reentrant: callers on several threads share one internal pool (a busy pool runs the
  // call inline). Every caller must get the bits of a lone call.
  const AttentionCase c(8, 2, 64, MixedBatch(), 20);
  const int64_t n_out = c.total_q * c.heads * c.d;
  std::vector<float> want(static_cast<size_t>(n_out));
  ASSERT_TRUE(Attention(c.Params(want.data(), nullptr)).ok());
  constexpr int kCallers = 4;
  std::vector<std::vector<float>> got(kCallers, std::vector<float>(want.size()));
  std::vector<absl::Status> status(kCallers);
  std::vector<std::thread> threads;
  for (int t = 0; t < kCallers; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3 && status[static_cast<size_t>(t)].ok(); ++rep) {
        status[static_cast<size_t>(t)] = Attention(c.Params(got[static_cast<size_t>(t)].data(), nullptr));
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kCallers; ++t) {
    ASSERT_TRUE(status[static_cast<size_t>(t)].ok()) << status[static_cast<size_t>(t)];
    EXPECT_EQ(std::memcmp(got[static_cast<size_t>(t)].data(), want.data(), sizeof(float) * want.size()), 0)
        << "caller " << t;
  }
}

// Runs Attention with one field broken and checks InvalidArgument naming `want` in the message.
template <typename Mutate>
void ExpectInvalid(const AttentionCase& base, Mutate mutate, const std::string& want) {
  AttentionCase c = base;
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(c.total_q, 1) * c.heads * c.d));
  AttentionParams p = c.Params(out.data(), nullptr);
  mutate(c, p);
  const absl::Status s = Attention(p);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << want << ": " << s;
  EXPECT_TRUE(MessageHas(s, want)) << "want '" << want << "' in: " << s;
}

TEST(AttentionTest, RejectsInvalidParams) {
  const AttentionCase base(4, 2, 32, {{2, 5}, {1, 3}, {3, 4}}, 18);
  using P = AttentionParams;
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.q = nullptr; }, "q is null");
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.v_cache = nullptr; }, "v_cache is null");
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.kv_slots = nullptr; }, "kv_slots is null");
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.num_kv_heads = 3; }, "num_kv_heads");
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.head_dim = 0; }, "head_dim");
  ExpectInvalid(
      base, [](AttentionCase&, P& p) { p.scale = 0.0f; }, "scale");
  ExpectInvalid(
      base,
      [](AttentionCase& c, P& p) {
        c.q_indptr[2] = 1;
        p.q_indptr = c.q_indptr.data();
      },
      "q_indptr decreases at request 1");
  ExpectInvalid(
      base,
      [](AttentionCase& c, P& p) {
        c.kv_indptr[1] = 9;
        p.kv_indptr = c.kv_indptr.data();
      },
      "kv_indptr decreases at request 1");
  // Request 1 keeps no key but has a query row.
  ExpectInvalid(
      base,
      [](AttentionCase& c, P& p) {
        c.kv_indptr[1] = 8;
        p.kv_indptr = c.kv_indptr.data();
      },
      "request 1 has q_len 1 > kv_len 0");
  ExpectInvalid(
      base,
      [](AttentionCase& c, P& p) {
        c.slots[6] = static_cast<int32_t>(c.num_slots);
        p.kv_slots = c.slots.data();
      },
      "kv_slots[6] = ");
  ExpectInvalid(
      base,
      [](AttentionCase& c, P& p) {
        c.slots[6] = -1;
        p.kv_slots = c.slots.data();
      },
      "(request 1, key 1)");
}

}  // namespace
}  // namespace tandem::kernels::cpu
