#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/status.h"
#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {
namespace {

// splitmix64's finaliser (Stafford's Mix13): a bijection with full avalanche.
uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// NaN counts as -inf everywhere, so a NaN logit is never chosen over a number.
double Logit(const float* logits, int64_t i) {
  const float l = logits[i];
  return std::isnan(l) ? -std::numeric_limits<double>::infinity() : static_cast<double>(l);
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  double best_v = Logit(logits, 0);
  for (int64_t i = 1; i < vocab; ++i) {
    const double v = Logit(logits, i);
    if (v > best_v) {
      best_v = v;
      best = i;
    }
  }
  return static_cast<int32_t>(best);
}

}  // namespace

float CounterUniform(uint64_t seed, uint64_t counter) {
  const uint64_t z = Mix64(Mix64(seed + 0x9E3779B97F4A7C15ull) ^ (counter * 0xD1B54A32D192ED03ull));
  // Top 24 bits -> k / 2^24, exactly representable, at most 1 - 2^-24 < 1.
  return static_cast<float>(z >> 40) * 0x1.0p-24f;
}

int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& params, uint64_t counter) {
  TANDEM_CHECK(logits != nullptr);
  TANDEM_CHECK(vocab > 0 && vocab <= std::numeric_limits<int32_t>::max());
  if (!(params.temperature > 0.0f)) return Argmax(logits, vocab);  // 0, negative or NaN
  const int32_t greedy = Argmax(logits, vocab);
  const double max_logit = Logit(logits, greedy);
  // All -inf/NaN, or a +inf logit: the distribution degenerates to the argmax.
  if (!std::isfinite(max_logit)) return greedy;

  // Unnormalised probabilities exp((l - max) / T), in double.
  const double inv_t = 1.0 / static_cast<double>(params.temperature);
  std::vector<double> prob(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) {
    prob[static_cast<size_t>(i)] = std::exp((Logit(logits, i) - max_logit) * inv_t);
  }

  // keep[i]: token i survives top-k and top-p.
  std::vector<char> keep(static_cast<size_t>(vocab), 1);
  const bool use_top_k = params.top_k > 0 && params.top_k < vocab;
  const bool use_top_p = params.top_p < 1.0f;  // NaN: off
  if (use_top_k || use_top_p) {
    // Candidates by probability, descending; ties by lower token id.
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    std::iota(order.begin(), order.end(), 0);
    auto before = [&](int32_t a, int32_t b) {
      const double pa = prob[static_cast<size_t>(a)], pb = prob[static_cast<size_t>(b)];
      return pa > pb || (pa == pb && a < b);
    };
    size_t kept = order.size();
    if (use_top_k) {
      kept = static_cast<size_t>(params.top_k);
      std::partial_sort(order.begin(), order.begin() + static_cast<ptrdiff_t>(kept), order.end(), before);
    } else {
      std::sort(order.begin(), order.end(), before);
    }
    if (use_top_p) {
      // Smallest prefix whose mass, renormalised over the top-k survivors, reaches top_p.
      double total = 0.0;
      for (size_t i = 0; i < kept; ++i) total += prob[static_cast<size_t>(order[i])];
      const double target = static_cast<double>(params.top_p) * total;
      double cum = 0.0;
      size_t prefix = 0;
      while (prefix < kept) {
        cum += prob[static_cast<size_t>(order[prefix])];
        ++prefix;
        if (cum >= target) break;
      }
      kept = std::max<size_t>(prefix, 1);
    }
    std::fill(keep.begin(), keep.end(), 0);
    for (size_t i = 0; i < kept; ++i) keep[static_cast<size_t>(order[i])] = 1;
  }

  // Inverse CDF over the kept tokens in ascending token id.
  double total = 0.0;
  for (int64_t i = 0; i < vocab; ++i) {
    if (keep[static_cast<size_t>(i)]) total += prob[static_cast<size_t>(i)];
  }
  const double u = static_cast<double>(CounterUniform(params.seed, counter)) * total;
  double cum = 0.0;
  int64_t last = greedy;  // rounding fallback: the last kept token with mass
  for (int64_t i = 0; i < vocab; ++i) {
    const double pi = prob[static_cast<size_t>(i)];
    if (!keep[static_cast<size_t>(i)] || pi <= 0.0) continue;
    cum += pi;
    last = i;
    if (u < cum) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);
}

namespace {

// The max logit and Σ exp(logit - max) of a row, in double: the shift and scale every
// log-probability of the row is computed with (TokenLogprob and TopLogprobs share them, so their
// values agree bit for bit). NaN logits make the sum NaN.
struct RowNormalizer {
  double max = -std::numeric_limits<double>::infinity();
  double log_sum = 0.0;
  bool finite = false;
  RowNormalizer(const float* logits, int64_t vocab) {
    for (int64_t i = 0; i < vocab; ++i) max = std::max(max, static_cast<double>(logits[i]));
    finite = std::isfinite(max);
    if (!finite) return;
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - max);
    log_sum = std::log(sum);
  }
  float Logprob(float logit) const {
    if (!finite) return std::numeric_limits<float>::quiet_NaN();
    return static_cast<float>(static_cast<double>(logit) - max - log_sum);
  }
};

}  // namespace

float TokenLogprob(const float* logits, int64_t vocab, int32_t token) {
  TANDEM_CHECK(logits != nullptr);
  TANDEM_CHECK_MSG(token >= 0 && token < vocab, "token ", token, " outside [0, ", vocab, ")");
  return RowNormalizer(logits, vocab).Logprob(logits[token]);
}

void TopLogprobs(const float* logits, int64_t vocab, int32_t k, std::vector<TopLogprob>* out) {
  TANDEM_CHECK(logits != nullptr);
  TANDEM_CHECK(vocab > 0);
  out->clear();
  const int64_t want = std::clamp<int64_t>(k, 0, std::min<int64_t>(vocab, kMaxTopLogprobs));
  if (want == 0) return;
  // A window of the best `want` ids so far, best first. Ids arrive in ascending order, so an id
  // whose logit equals the window's last one ranks after it: only a strictly larger logit enters.
  int32_t best[kMaxTopLogprobs];
  double value[kMaxTopLogprobs];
  int64_t size = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const double v = Logit(logits, i);
    if (size == want && !(v > value[size - 1])) continue;
    int64_t at = size < want ? size++ : want - 1;
    while (at > 0 && v > value[at - 1]) {
      best[at] = best[at - 1];
      value[at] = value[at - 1];
      --at;
    }
    best[at] = static_cast<int32_t>(i);
    value[at] = v;
  }
  const RowNormalizer norm(logits, vocab);
  out->reserve(static_cast<size_t>(size));
  for (int64_t j = 0; j < size; ++j) out->push_back({best[j], norm.Logprob(logits[best[j]])});
}

}  // namespace tandem::kernels::cpu
