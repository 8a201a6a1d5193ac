#include "kernels/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "kernels/cpu/parallel.h"

#if defined(TANDEM_HAVE_BLAS)
#include <cblas.h>
#endif

namespace tandem::kernels::cpu {
namespace {

using internal::ParallelFor;

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

absl::Status CheckPositive(absl::string_view op, absl::string_view field, int64_t v) {
  if (v > 0) return absl::OkStatus();
  return Invalid(op, absl::StrCat(field, " must be positive, got ", v));
}

absl::Status CheckNotNull(absl::string_view op, absl::string_view field, const void* ptr) {
  if (ptr != nullptr) return absl::OkStatus();
  return Invalid(op, absl::StrCat(field, " is null"));
}

// Rows per thread chunk so that a chunk holds at least ~16K elements of work.
int64_t RowGrain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elems, 1)); }

}  // namespace

absl::Status Embedding(const EmbeddingParams& p) {
  constexpr absl::string_view kOp = "Embedding";
  RETURN_IF_ERROR(CheckNotNull(kOp, "ids", p.ids));
  RETURN_IF_ERROR(CheckNotNull(kOp, "table", p.table));
  RETURN_IF_ERROR(CheckNotNull(kOp, "out", p.out));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "vocab", p.vocab));
  RETURN_IF_ERROR(CheckPositive(kOp, "hidden", p.hidden));
  for (int64_t i = 0; i < p.n; ++i) {
    if (p.ids[i] < 0 || p.ids[i] >= p.vocab) {
      return Invalid(kOp, absl::StrCat("ids[", i, "] = ", p.ids[i], " is outside [0, vocab=", p.vocab, ")"));
    }
  }
  ParallelFor(p.n, RowGrain(p.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(p.out + i * p.hidden, p.table + int64_t{p.ids[i]} * p.hidden,
                  sizeof(float) * static_cast<size_t>(p.hidden));
    }
  });
  return absl::OkStatus();
}

absl::Status RmsNorm(const RmsNormParams& p) {
  constexpr absl::string_view kOp = "RmsNorm";
  RETURN_IF_ERROR(CheckNotNull(kOp, "x", p.x));
  RETURN_IF_ERROR(CheckNotNull(kOp, "weight", p.weight));
  RETURN_IF_ERROR(CheckNotNull(kOp, "out", p.out));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "d", p.d));
  if (!(p.eps >= 0.0f) || !std::isfinite(p.eps)) {
    return Invalid(kOp, absl::StrCat("eps must be finite and >= 0, got ", p.eps));
  }
  ParallelFor(p.n, RowGrain(p.d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = p.x + i * p.d;
      const float* in = x;
      if (p.residual != nullptr) {
        float* r = p.residual + i * p.d;
        for (int64_t j = 0; j < p.d; ++j) r[j] += x[j];
        in = r;
      }
      // Sum of squares in double: the fp32 mean is then correctly rounded whatever the summation
      // order, so this reference sits within half an ulp of every fp32 reduction order (torch's
      // vectorised one, a CUDA warp tree) instead of being one more arbitrary order.
      double ss = 0.0;
      for (int64_t j = 0; j < p.d; ++j) ss += static_cast<double>(in[j]) * in[j];
      // transformers: variance (fp32) + eps (fp32), rsqrt, then weight * (x * rsqrt).
      const float var = static_cast<float>(ss / static_cast<double>(p.d));
      const float inv = static_cast<float>(1.0 / std::sqrt(static_cast<double>(var + p.eps)));
      float* out = p.out + i * p.d;
      for (int64_t j = 0; j < p.d; ++j) out[j] = p.weight[j] * (in[j] * inv);
    }
  });
  return absl::OkStatus();
}

std::vector<float> RopeInvFreq(const RopeSpec& spec, int64_t head_dim) {
  if (head_dim <= 0) return {};
  const int64_t half = head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), every step in fp32.
  // Each step is rounded to fp32 here too; pow runs in double and is rounded once, i.e. the
  // correctly rounded fp32 pow, which torch's fp32 pow matches to within an ulp.
  const float base = static_cast<float>(spec.theta);
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    const float pw = static_cast<float>(std::pow(static_cast<double>(base), double{exponent}));
    inv[static_cast<size_t>(i)] = 1.0f / pw;
  }
  if (spec.type != RopeType::kLlama3) return inv;

  // transformers `_compute_llama3_parameters`, tensor ops in fp32 with Python scalars.
  const float factor = static_cast<float>(spec.factor);
  const float low_freq_factor = static_cast<float>(spec.low_freq_factor);
  const float old_context_len = static_cast<float>(spec.original_max_position);
  const float smooth_den = static_cast<float>(spec.high_freq_factor - spec.low_freq_factor);
  const double low_freq_wavelen = static_cast<double>(spec.original_max_position) / spec.low_freq_factor;
  const double high_freq_wavelen = static_cast<double>(spec.original_max_position) / spec.high_freq_factor;
  const float two_pi = static_cast<float>(2.0 * std::numbers::pi);
  for (float& f : inv) {
    const float wavelen = two_pi / f;
    if (wavelen > low_freq_wavelen) {
      f = f / factor;
    } else if (!(wavelen < high_freq_wavelen)) {
      const float smooth = (old_context_len / wavelen - low_freq_factor) / smooth_den;
      f = (1.0f - smooth) * f / factor + smooth * f;
    }
  }
  return inv;
}

absl::Status Rope(const RopeParams& p) {
  constexpr absl::string_view kOp = "Rope";
  RETURN_IF_ERROR(CheckNotNull(kOp, "q", p.q));
  RETURN_IF_ERROR(CheckNotNull(kOp, "positions", p.positions));
  RETURN_IF_ERROR(CheckNotNull(kOp, "inv_freq", p.inv_freq));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "num_heads", p.num_heads));
  RETURN_IF_ERROR(CheckPositive(kOp, "head_dim", p.head_dim));
  if (p.head_dim % 2 != 0) return Invalid(kOp, absl::StrCat("head_dim must be even, got ", p.head_dim));
  if (p.k != nullptr) RETURN_IF_ERROR(CheckPositive(kOp, "num_kv_heads", p.num_kv_heads));
  const int64_t q_stride = p.q_stride == 0 ? p.num_heads * p.head_dim : p.q_stride;
  const int64_t k_stride = p.k_stride == 0 ? p.num_kv_heads * p.head_dim : p.k_stride;
  if (q_stride < p.num_heads * p.head_dim) {
    return Invalid(kOp, absl::StrCat("q_stride ", q_stride, " < num_heads * head_dim"));
  }
  if (p.k != nullptr && k_stride < p.num_kv_heads * p.head_dim) {
    return Invalid(kOp, absl::StrCat("k_stride ", k_stride, " < num_kv_heads * head_dim"));
  }
  for (int64_t i = 0; i < p.n; ++i) {
    if (p.positions[i] < 0) {
      return Invalid(kOp, absl::StrCat("positions[", i, "] = ", p.positions[i], " is negative"));
    }
  }
  const int64_t half = p.head_dim / 2;
  const int64_t heads = p.num_heads + (p.k != nullptr ? p.num_kv_heads : 0);
  ParallelFor(p.n, RowGrain(heads * p.head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
    auto rotate = [&](float* x) {
      for (int64_t j = 0; j < half; ++j) {
        const float a = x[j], b = x[j + half];
        const float c = cos_v[static_cast<size_t>(j)], s = sin_v[static_cast<size_t>(j)];
        x[j] = a * c - b * s;
        x[j + half] = b * c + a * s;
      }
    };
    for (int64_t i = begin; i < end; ++i) {
      const float pos = static_cast<float>(p.positions[i]);
      for (int64_t j = 0; j < half; ++j) {
        // fp32 angle as torch forms it; cos/sin evaluated in double and rounded once.
        const double angle = static_cast<double>(pos * p.inv_freq[j]);
        cos_v[static_cast<size_t>(j)] = static_cast<float>(std::cos(angle));
        sin_v[static_cast<size_t>(j)] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < p.num_heads; ++h) rotate(p.q + i * q_stride + h * p.head_dim);
      if (p.k != nullptr) {
        for (int64_t h = 0; h < p.num_kv_heads; ++h) rotate(p.k + i * k_stride + h * p.head_dim);
      }
    }
  });
  return absl::OkStatus();
}

absl::Status CopyRows(const CopyRowsParams& p) {
  constexpr absl::string_view kOp = "CopyRows";
  RETURN_IF_ERROR(CheckNotNull(kOp, "cache", p.cache));
  RETURN_IF_ERROR(CheckNotNull(kOp, "src", p.src));
  RETURN_IF_ERROR(CheckNotNull(kOp, "dst", p.dst));
  RETURN_IF_ERROR(CheckPositive(kOp, "width", p.width));
  RETURN_IF_ERROR(CheckPositive(kOp, "planes", p.planes));
  if (p.planes > 1 && p.plane_stride < p.num_rows * p.width)
    return Invalid(kOp, absl::StrCat("plane_stride ", p.plane_stride, " < num_rows * width"));
  std::vector<bool> is_src(static_cast<size_t>(std::max<int64_t>(p.num_rows, 0))), is_dst(is_src.size());
  for (int64_t i = 0; i < p.n; ++i) {
    for (const int32_t r : {p.src[i], p.dst[i]}) {
      if (r < 0 || r >= p.num_rows)
        return Invalid(kOp, absl::StrCat("row ", r, " outside [0, ", p.num_rows, ")"));
    }
    is_src[static_cast<size_t>(p.src[i])] = true;
    if (is_dst[static_cast<size_t>(p.dst[i])])
      return Invalid(kOp, absl::StrCat("dst row ", p.dst[i], " repeats"));
    is_dst[static_cast<size_t>(p.dst[i])] = true;
  }
  for (int64_t i = 0; i < p.n; ++i) {
    if (is_src[static_cast<size_t>(p.dst[i])])
      return Invalid(kOp, absl::StrCat("dst row ", p.dst[i], " is a src row"));
  }
  for (int64_t q = 0; q < p.planes; ++q) {
    float* plane = p.cache + q * p.plane_stride;
    for (int64_t i = 0; i < p.n; ++i) {
      std::memcpy(plane + static_cast<int64_t>(p.dst[i]) * p.width,
                  plane + static_cast<int64_t>(p.src[i]) * p.width,
                  static_cast<size_t>(p.width) * sizeof(float));
    }
  }
  return absl::OkStatus();
}

void RopeShiftAngles(int32_t from, int32_t to, const float* inv_freq, int64_t half, float* cos_out,
                     float* sin_out) {
  const float f = static_cast<float>(from), t = static_cast<float>(to);
  for (int64_t j = 0; j < half; ++j) {
    const double delta = static_cast<double>(t * inv_freq[j]) - static_cast<double>(f * inv_freq[j]);
    cos_out[j] = static_cast<float>(std::cos(delta));
    sin_out[j] = static_cast<float>(std::sin(delta));
  }
}

absl::Status RopeShift(const RopeShiftParams& p) {
  constexpr absl::string_view kOp = "RopeShift";
  RETURN_IF_ERROR(CheckNotNull(kOp, "k", p.k));
  RETURN_IF_ERROR(CheckNotNull(kOp, "rows", p.rows));
  RETURN_IF_ERROR(CheckNotNull(kOp, "from_positions", p.from_positions));
  RETURN_IF_ERROR(CheckNotNull(kOp, "to_positions", p.to_positions));
  RETURN_IF_ERROR(CheckNotNull(kOp, "inv_freq", p.inv_freq));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "num_kv_heads", p.num_kv_heads));
  RETURN_IF_ERROR(CheckPositive(kOp, "head_dim", p.head_dim));
  if (p.head_dim % 2 != 0) return Invalid(kOp, absl::StrCat("head_dim must be even, got ", p.head_dim));
  const int64_t stride = p.k_stride == 0 ? p.num_kv_heads * p.head_dim : p.k_stride;
  if (stride < p.num_kv_heads * p.head_dim) {
    return Invalid(kOp, absl::StrCat("k_stride ", stride, " < num_kv_heads * head_dim"));
  }
  for (int64_t i = 0; i < p.n; ++i) {
    if (p.rows[i] < 0 || p.rows[i] >= p.num_rows) {
      return Invalid(kOp, absl::StrCat("rows[", i, "] = ", p.rows[i], " outside [0, ", p.num_rows, ")"));
    }
    if (p.from_positions[i] < 0 || p.to_positions[i] < 0) {
      return Invalid(kOp, absl::StrCat("positions of row ", i, " (", p.from_positions[i], " -> ",
                                       p.to_positions[i], ") must be >= 0"));
    }
  }
  const int64_t half = p.head_dim / 2;
  ParallelFor(p.n, RowGrain(p.num_kv_heads * p.head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
    for (int64_t i = begin; i < end; ++i) {
      if (p.from_positions[i] == p.to_positions[i]) continue;
      RopeShiftAngles(p.from_positions[i], p.to_positions[i], p.inv_freq, half, cos_v.data(), sin_v.data());
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        float* x = p.k + static_cast<int64_t>(p.rows[i]) * stride + h * p.head_dim;
        for (int64_t j = 0; j < half; ++j) {
          const float a = x[j], b = x[j + half];
          const float c = cos_v[static_cast<size_t>(j)], s = sin_v[static_cast<size_t>(j)];
          x[j] = a * c - b * s;
          x[j + half] = b * c + a * s;
        }
      }
    }
  });
  return absl::OkStatus();
}

// ---- Matmul ------------------------------------------------------------------------------------

namespace {

#if !defined(TANDEM_HAVE_BLAS)
// Portable fallback: register-blocked dot products vectorised with GCC vector extensions, built
// twice (baseline SSE2 and AVX2+FMA, picked at run time), cache-blocked over k and threaded over
// tiles of (rows of x) x (rows of w).
using V8 = float __attribute__((vector_size(32)));

// By reference and through memcpy (an unaligned load): V8 never crosses a call by value, which
// would change the ABI between the two builds (-Wpsabi).
[[gnu::always_inline]] inline void LoadV8(V8& v, const float* p) { std::memcpy(&v, p, sizeof(v)); }

[[gnu::always_inline]] inline float HorizontalSum(const V8& v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// acc(MR, NR) = x[0..MR) · w[0..NR) over kc columns; added to y (y[i * ldy + j]).
template <int MR, int NR>
[[gnu::always_inline]] inline void MicroKernel(const float* x, int64_t ldx, const float* w, int64_t ldw,
                                               int64_t kc, float* y, int64_t ldy) {
  // Fully unrolled (the pragmas) so that acc lives in registers rather than on the stack.
  V8 acc[MR][NR] = {};
  int64_t kk = 0;
  for (; kk + 8 <= kc; kk += 8) {
    V8 xv[MR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) LoadV8(xv[i], x + i * ldx + kk);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      V8 wv;
      LoadV8(wv, w + j * ldw + kk);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[i][j] += xv[i] * wv;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      float s = HorizontalSum(acc[i][j]);
      for (int64_t t = kk; t < kc; ++t) s += x[i * ldx + t] * w[j * ldw + t];
      y[i * ldy + j] += s;
    }
  }
}

constexpr int kMR = 2, kNR = 4;
constexpr int64_t kKC = 1024;  // k columns per block: a 64-row w tile is 256 KiB, L2-resident

// y[m0..m1, n0..n1) += x · wᵀ over all k, k-blocked so the w tile stays in L2 across x rows.
[[gnu::always_inline]] inline void TileBody(const MatmulParams& p, int64_t ldx, int64_t ldy, int64_t m0,
                                            int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kKC) {
    const int64_t kc = std::min(kKC, p.k - k0);
    for (int64_t i = m0; i < m1; i += kMR) {
      const float* x = p.x + i * ldx + k0;
      float* y = p.y + i * ldy;
      const bool full_m = i + kMR <= m1;
      int64_t j = n0;
      for (; j + kNR <= n1; j += kNR) {
        const float* w = p.w + j * p.k + k0;
        if (full_m) {
          MicroKernel<kMR, kNR>(x, ldx, w, p.k, kc, y + j, ldy);
        } else {
          MicroKernel<1, kNR>(x, ldx, w, p.k, kc, y + j, ldy);
        }
      }
      for (; j < n1; ++j) {
        const float* w = p.w + j * p.k + k0;
        if (full_m) {
          MicroKernel<kMR, 1>(x, ldx, w, p.k, kc, y + j, ldy);
        } else {
          MicroKernel<1, 1>(x, ldx, w, p.k, kc, y + j, ldy);
        }
      }
    }
  }
}

[[gnu::target("avx2,fma")]] void TileAvx2(const MatmulParams& p, int64_t ldx, int64_t ldy, int64_t m0,
                                          int64_t m1, int64_t n0, int64_t n1) {
  TileBody(p, ldx, ldy, m0, m1, n0, n1);
}

void TileBaseline(const MatmulParams& p, int64_t ldx, int64_t ldy, int64_t m0, int64_t m1, int64_t n0,
                  int64_t n1) {
  TileBody(p, ldx, ldy, m0, m1, n0, n1);
}

void MatmulFallback(const MatmulParams& p, int64_t ldx, int64_t ldy) {
  static const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!p.accumulate) {
    for (int64_t i = 0; i < p.m; ++i) std::fill_n(p.y + i * ldy, p.n, 0.0f);
  }
  // Tiles: up to 64 rows of x by 64 rows of w; more, thinner w tiles when m is small.
  constexpr int64_t kTileM = 64;
  const int64_t tile_n = p.m <= 4 ? 16 : 64;
  const int64_t tiles_m = (p.m + kTileM - 1) / kTileM;
  const int64_t tiles_n = (p.n + tile_n - 1) / tile_n;
  // A tile is worth a thread from ~64K multiply-adds on.
  const int64_t tile_work = std::min(p.m, kTileM) * tile_n * p.k;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(tile_work, 1));
  ParallelFor(tiles_m * tiles_n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tm = t / tiles_n, tn = t % tiles_n;
      const int64_t m0 = tm * kTileM, m1 = std::min(p.m, m0 + kTileM);
      const int64_t n0 = tn * tile_n, n1 = std::min(p.n, n0 + tile_n);
      if (kAvx2) {
        TileAvx2(p, ldx, ldy, m0, m1, n0, n1);
      } else {
        TileBaseline(p, ldx, ldy, m0, m1, n0, n1);
      }
    }
  });
}
#endif  // !TANDEM_HAVE_BLAS

}  // namespace

absl::Status Matmul(const MatmulParams& p) {
  constexpr absl::string_view kOp = "Matmul";
  RETURN_IF_ERROR(CheckNotNull(kOp, "x", p.x));
  RETURN_IF_ERROR(CheckNotNull(kOp, "w", p.w));
  RETURN_IF_ERROR(CheckNotNull(kOp, "y", p.y));
  RETURN_IF_ERROR(CheckPositive(kOp, "m", p.m));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "k", p.k));
  const int64_t ldx = p.x_stride == 0 ? p.k : p.x_stride;
  const int64_t ldy = p.y_stride == 0 ? p.n : p.y_stride;
  if (ldx < p.k) return Invalid(kOp, absl::StrCat("x_stride ", ldx, " < k = ", p.k));
  if (ldy < p.n) return Invalid(kOp, absl::StrCat("y_stride ", ldy, " < n = ", p.n));
#if defined(TANDEM_HAVE_BLAS)
  constexpr int64_t kBlasMax = 0x7fffffff;
  if (p.m > kBlasMax || p.n > kBlasMax || p.k > kBlasMax || ldx > kBlasMax || ldy > kBlasMax) {
    return Invalid(kOp, "a size or stride exceeds the BLAS int range");
  }
  const float beta = p.accumulate ? 1.0f : 0.0f;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  if (p.m == 1) {
    // One row: y = W·x as a matrix-vector product (OpenBLAS 0.3.21 does not route m=1 sgemm
    // to gemv itself).
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, p.w, k, p.x, 1, beta, p.y, 1);
  } else {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, p.x, static_cast<int>(ldx), p.w, k,
                beta, p.y, static_cast<int>(ldy));
  }
#else
  MatmulFallback(p, ldx, ldy);
#endif
  return absl::OkStatus();
}

absl::Status SiluMul(const SiluMulParams& p) {
  constexpr absl::string_view kOp = "SiluMul";
  RETURN_IF_ERROR(CheckNotNull(kOp, "gate_up", p.gate_up));
  RETURN_IF_ERROR(CheckNotNull(kOp, "out", p.out));
  RETURN_IF_ERROR(CheckPositive(kOp, "n", p.n));
  RETURN_IF_ERROR(CheckPositive(kOp, "inter", p.inter));
  ParallelFor(p.n, RowGrain(p.inter), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* g = p.gate_up + i * 2 * p.inter;
      const float* u = g + p.inter;
      float* out = p.out + i * p.inter;
      // torch: silu(g) = g / (1 + exp(-g)) in fp32, then * up.
      for (int64_t j = 0; j < p.inter; ++j) out[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
  });
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cpu
