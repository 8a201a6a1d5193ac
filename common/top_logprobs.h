// Top log-probability alternatives: for a sampled row, the k most probable tokens of the model's
// distribution and their log-probabilities (what the OpenAI API calls `top_logprobs`).
//
// Contract (every producer: kernels::cpu::TopLogprobs, the compute backends, a compute replica's
// result on the wire):
//   * `logprob` is log_softmax(logits)[token] in natural log over the raw logits, before
//     temperature, top-k and top-p: the same distribution, and the same arithmetic, as the chosen
//     token's log-probability (kernels::cpu::TokenLogprob), so a token reported in both places has
//     bit-identical values.
//   * Entries are ordered most probable first; equal logits order by lower token id (the order
//     greedy sampling breaks ties in), so under greedy sampling the chosen token is entry 0.
//   * k is in [0, kMaxTopLogprobs] (the OpenAI API's limit).
#pragma once

#include <cstdint>

namespace tandem {

inline constexpr int32_t kMaxTopLogprobs = 20;

struct TopLogprob {
  int32_t token = 0;
  float logprob = 0.0f;

  friend bool operator==(const TopLogprob&, const TopLogprob&) = default;
};

}  // namespace tandem
