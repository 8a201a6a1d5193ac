// Shared-prefix (cascade) attention: PrefixAttention and MergeAttentionStates (see ops.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec.h"

namespace tandem::kernels::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

absl::Status Invalid(absl::string_view op, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

absl::Status ValidatePrefix(const PrefixAttentionParams& p) {
  constexpr absl::string_view kOp = "PrefixAttention";
  const std::pair<const char*, const void*> pointers[] = {
      {"q", p.q}, {"k_cache", p.k_cache}, {"v_cache", p.v_cache}, {"out", p.out}, {"lse", p.lse}};
  for (const auto& [name, ptr] : pointers) {
    if (ptr == nullptr) return Invalid(kOp, absl::StrCat(name, " is null"));
  }
  const std::pair<const char*, int64_t> non_negative[] = {{"rows", p.rows}, {"prefix_len", p.prefix_len}};
  for (const auto& [name, v] : non_negative) {
    if (v < 0) return Invalid(kOp, absl::StrCat(name, " must be >= 0, got ", v));
  }
  const std::pair<const char*, int64_t> positive[] = {{"num_slots", p.num_slots},
                                                      {"num_heads", p.num_heads},
                                                      {"num_kv_heads", p.num_kv_heads},
                                                      {"head_dim", p.head_dim}};
  for (const auto& [name, v] : positive) {
    if (v <= 0) return Invalid(kOp, absl::StrCat(name, " must be positive, got ", v));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid(
        kOp, absl::StrCat("num_heads ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (!std::isfinite(p.scale) || !(p.scale > 0.0f)) {
    return Invalid(kOp, absl::StrCat("scale must be finite and positive, got ", p.scale));
  }
  if (p.prefix_len > 0 && p.prefix_slots == nullptr) return Invalid(kOp, "prefix_slots is null");
  for (int64_t j = 0; j < p.prefix_len; ++j) {
    if (p.prefix_slots[j] < 0 || p.prefix_slots[j] >= p.num_slots) {
      return Invalid(kOp, absl::StrCat("prefix_slots[", j, "] = ", p.prefix_slots[j],
                                       " is outside [0, num_slots=", p.num_slots, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateMerge(const MergeAttentionStatesParams& p) {
  constexpr absl::string_view kOp = "MergeAttentionStates";
  const std::pair<const char*, const void*> pointers[] = {
      {"out_a", p.out_a}, {"lse_a", p.lse_a}, {"out_b", p.out_b}, {"lse_b", p.lse_b}, {"out", p.out}};
  for (const auto& [name, ptr] : pointers) {
    if (ptr == nullptr) return Invalid(kOp, absl::StrCat(name, " is null"));
  }
  if (p.rows < 0) return Invalid(kOp, absl::StrCat("rows must be >= 0, got ", p.rows));
  const std::pair<const char*, int64_t> positive[] = {{"num_heads", p.num_heads}, {"head_dim", p.head_dim}};
  for (const auto& [name, v] : positive) {
    if (v <= 0) return Invalid(kOp, absl::StrCat(name, " must be positive, got ", v));
  }
  if (p.rows_b != nullptr) {
    if (p.num_rows_b < 0) return Invalid(kOp, absl::StrCat("num_rows_b must be >= 0, got ", p.num_rows_b));
    if (p.out == p.out_b) return Invalid(kOp, "out aliases out_b while rows_b gathers");
    if (p.lse != nullptr && p.lse == p.lse_b) return Invalid(kOp, "lse aliases lse_b while rows_b gathers");
    for (int64_t i = 0; i < p.rows; ++i) {
      if (p.rows_b[i] < 0 || p.rows_b[i] >= p.num_rows_b) {
        return Invalid(kOp, absl::StrCat("rows_b[", i, "] = ", p.rows_b[i],
                                         " is outside [0, num_rows_b=", p.num_rows_b, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PrefixAttention(const PrefixAttentionParams& p) {
  RETURN_IF_ERROR(ValidatePrefix(p));
  const int64_t H = p.num_heads, KVH = p.num_kv_heads, D = p.head_dim, P = p.prefix_len;
  const int64_t group = H / KVH;
  if (P == 0) {
    std::fill_n(p.out, p.rows * H * D, 0.0f);
    std::fill_n(p.lse, p.rows * H, kNegInf);
    return absl::OkStatus();
  }
  // Work item = (KV head, block of rows). A block's queries are its rows × the `group` query heads
  // of the KV head; each prefix K/V row is loaded once per block and used by all of them. The
  // block's score matrix (queries × P) is kept whole (bounded to ~1M floats, at least one row).
  const int64_t block_rows = std::clamp<int64_t>((int64_t{1} << 20) / (group * P), 1, 64);
  const int64_t num_blocks = (p.rows + block_rows - 1) / block_rows;
  const int64_t items = KVH * num_blocks;
  internal::ParallelFor(items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;  // (queries, P)
    std::vector<float> acc;     // (queries, D)
    std::vector<float> max(static_cast<size_t>(block_rows * group));
    std::vector<float> sum(static_cast<size_t>(block_rows * group));
    std::vector<const float*> qs(static_cast<size_t>(block_rows * group));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kvh = item / num_blocks, block = item % num_blocks;
      const int64_t row0 = block * block_rows, nrows = std::min(block_rows, p.rows - row0);
      const int64_t nq = nrows * group;  // query index qi = r * group + g
      for (int64_t r = 0; r < nrows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          qs[static_cast<size_t>(r * group + g)] = p.q + ((row0 + r) * H + kvh * group + g) * D;
        }
      }
      scores.resize(static_cast<size_t>(nq * P));
      // S = Q · Kᵀ, key-major: one K row feeds every query of the block.
      for (int64_t j = 0; j < P; ++j) {
        const float* k = p.k_cache + (int64_t{p.prefix_slots[j]} * KVH + kvh) * D;
        for (int64_t qi = 0; qi < nq; ++qi) {
          scores[static_cast<size_t>(qi * P + j)] = Dot(qs[static_cast<size_t>(qi)], k, D) * p.scale;
        }
      }
      // Softmax per query, in key order (as Attention).
      for (int64_t qi = 0; qi < nq; ++qi) {
        float* s = scores.data() + qi * P;
        float m = kNegInf;
        for (int64_t j = 0; j < P; ++j) m = std::max(m, s[j]);
        float total = 0.0f;
        for (int64_t j = 0; j < P; ++j) {
          s[j] = std::exp(s[j] - m);
          total += s[j];
        }
        max[static_cast<size_t>(qi)] = m;
        sum[static_cast<size_t>(qi)] = total;
      }
      // O = softmax(S) · V, key-major: one V row feeds every query of the block.
      acc.assign(static_cast<size_t>(nq * D), 0.0f);
      for (int64_t j = 0; j < P; ++j) {
        const float* v = p.v_cache + (int64_t{p.prefix_slots[j]} * KVH + kvh) * D;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const float w = scores[static_cast<size_t>(qi * P + j)] / sum[static_cast<size_t>(qi)];
          Axpy(w, v, acc.data() + qi * D, D);
        }
      }
      for (int64_t r = 0; r < nrows; ++r) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qi = r * group + g, h = kvh * group + g;
          std::copy_n(acc.data() + qi * D, D, p.out + ((row0 + r) * H + h) * D);
          p.lse[(row0 + r) * H + h] = max[static_cast<size_t>(qi)] + std::log(sum[static_cast<size_t>(qi)]);
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status MergeAttentionStates(const MergeAttentionStatesParams& p) {
  RETURN_IF_ERROR(ValidateMerge(p));
  const int64_t H = p.num_heads, D = p.head_dim;
  const int64_t grain = std::max<int64_t>(1, 16384 / D);
  internal::ParallelFor(p.rows * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / H, h = item % H;
      const int64_t ib = p.rows_b != nullptr ? int64_t{p.rows_b[i]} : i;
      const float la = p.lse_a[i * H + h], lb = p.lse_b[ib * H + h];
      const float* a = p.out_a + (i * H + h) * D;
      const float* b = p.out_b + (ib * H + h) * D;
      float* o = p.out + (i * H + h) * D;
      float lse;
      if (la == kNegInf && lb == kNegInf) {
        std::fill_n(o, D, 0.0f);
        lse = kNegInf;
      } else if (la == kNegInf) {
        if (o != b) std::copy_n(b, D, o);
        lse = lb;
      } else if (lb == kNegInf) {
        if (o != a) std::copy_n(a, D, o);
        lse = la;
      } else {
        // Both finite (or NaN, which propagates): weights e^{l - m} <= 1, total in [1, 2].
        const float m = std::max(la, lb);
        const float wa = std::exp(la - m), wb = std::exp(lb - m);
        const float total = wa + wb;
        const float ca = wa / total, cb = wb / total;
        for (int64_t t = 0; t < D; ++t) o[t] = ca * a[t] + cb * b[t];  // element read before written
        lse = m + std::log(total);
      }
      if (p.lse != nullptr) p.lse[i * H + h] = lse;
    }
  });
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cpu
