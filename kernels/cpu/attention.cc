#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/vec.h"

namespace tandem::kernels::cpu {
namespace {

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("Attention: ", what));
}

absl::Status Validate(const AttentionParams& p, int64_t* max_kv_len) {
  const std::pair<const char*, const void*> pointers[] = {
      {"q", p.q},     {"k_cache", p.k_cache},   {"v_cache", p.v_cache},
      {"out", p.out}, {"q_indptr", p.q_indptr}, {"kv_indptr", p.kv_indptr}};
  for (const auto& [name, ptr] : pointers) {
    if (ptr == nullptr) return Invalid(absl::StrCat(name, " is null"));
  }
  const std::pair<const char*, int64_t> sizes[] = {{"num_requests", p.num_requests},
                                                   {"num_slots", p.num_slots},
                                                   {"num_heads", p.num_heads},
                                                   {"num_kv_heads", p.num_kv_heads},
                                                   {"head_dim", p.head_dim}};
  for (const auto& [name, v] : sizes) {
    if (v <= 0) return Invalid(absl::StrCat(name, " must be positive, got ", v));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid(
        absl::StrCat("num_heads ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (!std::isfinite(p.scale) || !(p.scale > 0.0f)) {
    return Invalid(absl::StrCat("scale must be finite and positive, got ", p.scale));
  }
  if (p.q_indptr[0] != 0) return Invalid(absl::StrCat("q_indptr[0] = ", p.q_indptr[0], ", not 0"));
  if (p.kv_indptr[0] != 0) {
    return Invalid(absl::StrCat("kv_indptr[0] = ", p.kv_indptr[0], ", not 0"));
  }
  *max_kv_len = 0;
  for (int64_t r = 0; r < p.num_requests; ++r) {
    const int64_t q_len = int64_t{p.q_indptr[r + 1]} - p.q_indptr[r];
    const int64_t kv_len = int64_t{p.kv_indptr[r + 1]} - p.kv_indptr[r];
    if (q_len < 0) {
      return Invalid(
          absl::StrCat("q_indptr decreases at request ", r, ": ", p.q_indptr[r], " -> ", p.q_indptr[r + 1]));
    }
    if (kv_len < 0) {
      return Invalid(absl::StrCat("kv_indptr decreases at request ", r, ": ", p.kv_indptr[r], " -> ",
                                  p.kv_indptr[r + 1]));
    }
    if (q_len > kv_len) {
      return Invalid(
          absl::StrCat("request ", r, " has q_len ", q_len, " > kv_len ", kv_len, " (q_indptr/kv_indptr)"));
    }
    *max_kv_len = std::max(*max_kv_len, kv_len);
  }
  const int64_t total_kv = p.kv_indptr[p.num_requests];
  if (total_kv > 0 && p.kv_slots == nullptr) return Invalid("kv_slots is null");
  for (int64_t r = 0; r < p.num_requests; ++r) {
    for (int64_t j = p.kv_indptr[r]; j < p.kv_indptr[r + 1]; ++j) {
      if (p.kv_slots[j] < 0 || p.kv_slots[j] >= p.num_slots) {
        return Invalid(absl::StrCat("kv_slots[", j, "] = ", p.kv_slots[j], " (request ", r, ", key ",
                                    j - p.kv_indptr[r], ") is outside [0, num_slots=", p.num_slots, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Attention(const AttentionParams& p) {
  int64_t max_kv_len = 0;
  RETURN_IF_ERROR(Validate(p, &max_kv_len));
  const int64_t total_q = p.q_indptr[p.num_requests];
  const int64_t H = p.num_heads, KVH = p.num_kv_heads, D = p.head_dim;
  const int64_t group = H / KVH;
  // Work item = (query row, head), row-major; rows of one request are contiguous.
  const int64_t items = total_q * H;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(max_kv_len * D, 1));
  internal::ParallelFor(items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(max_kv_len));
    std::vector<float> acc(static_cast<size_t>(D));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / H, h = item % H;
      const int64_t r = std::upper_bound(p.q_indptr, p.q_indptr + p.num_requests + 1, t) - p.q_indptr - 1;
      const int64_t q_len = p.q_indptr[r + 1] - p.q_indptr[r];
      const int64_t kv_len = p.kv_indptr[r + 1] - p.kv_indptr[r];
      const int64_t n_keys = kv_len - q_len + (t - p.q_indptr[r]) + 1;  // causal
      const int32_t* slots = p.kv_slots + p.kv_indptr[r];
      const int64_t kvh = h / group;
      const float* q = p.q + (t * H + h) * D;

      // As Hugging Face's eager attention: s = (q·k) * scale, softmax in fp32 with the row max
      // subtracted, probabilities normalised before they weight v.
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n_keys; ++j) {
        const float* k = p.k_cache + (int64_t{slots[j]} * KVH + kvh) * D;
        const float s = Dot(q, k, D) * p.scale;
        scores[static_cast<size_t>(j)] = s;
        m = std::max(m, s);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n_keys; ++j) {
        float& s = scores[static_cast<size_t>(j)];
        s = std::exp(s - m);
        sum += s;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) {
        const float w = scores[static_cast<size_t>(j)] / sum;
        const float* v = p.v_cache + (int64_t{slots[j]} * KVH + kvh) * D;
        Axpy(w, v, acc.data(), D);
      }
      std::copy(acc.begin(), acc.end(), p.out + (t * H + h) * D);
      if (p.lse != nullptr) p.lse[t * H + h] = m + std::log(sum);
    }
  });
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cpu
