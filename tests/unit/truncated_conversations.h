// Shared by the kv.store_pre_rope tests of the colocated engine (unit/kv_tiers_test.cc) and of a
// deployment (integration/disaggregated_test.cc): conversations whose client drops the first turn.
#pragma once

#include <cstdint>
#include <vector>

#include "compute_node/engine.h"
#include "gtest/gtest.h"

namespace tandem::testing_tiers {

// The third turns' answers and log-probabilities of TruncatedConversations.
struct TruncatedRun {
  std::vector<std::vector<int32_t>> answers;
  std::vector<std::vector<float>> logprobs;
};

// Three conversations sharing a system prompt of two blocks of `block_tokens`, one request at a
// time, greedy with EOS ignored: two turns each (13 new tokens, 9 answered), then a third whose
// prompt leaves the first turn out (its question and answer, 22 tokens: what follows moves by a
// distance that is no multiple of the block) and adds 13 new tokens.
inline TruncatedRun TruncatedConversations(Engine& e, int64_t vocab, int64_t block_tokens) {
  uint32_t x = 777;
  const auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2));
  };
  std::vector<int32_t> system;
  for (int64_t i = 0; i < 2 * block_tokens; ++i) system.push_back(next());
  std::vector<std::vector<int32_t>> history(3, system), kept(3);
  TruncatedRun run;
  for (int turn = 0; turn < 3; ++turn) {
    for (size_t k = 0; k < history.size(); ++k) {
      std::vector<int32_t>& h = history[k];
      if (turn == 2) h = kept[k];
      for (int i = 0; i < 13; ++i) h.push_back(next());
      GenerationRequest r;
      r.prompt = h;
      r.max_tokens = 9;
      r.ignore_eos = true;
      absl::StatusOr<std::vector<GenerationResult>> out = e.GenerateAll({r});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return run;
      const GenerationResult& res = (*out)[0];
      h.insert(h.end(), res.token_ids.begin(), res.token_ids.end());
      if (turn == 1) {  // the system prompt, then this turn's question and answer
        kept[k] = system;
        kept[k].insert(kept[k].end(), h.end() - 13 - 9, h.end());
      }
      if (turn == 2) {
        run.answers.push_back(res.token_ids);
        run.logprobs.push_back(res.logprobs);
      }
    }
  }
  return run;
}

// With one layer (a token's KV there depends on its id and position alone): the third turns of a
// run reusing KV at new positions equal recomputation's (`want`), tokens and log-probabilities, and
// every truncated turn reused its kept history without a failed restore.
inline void ExpectExactReuse(const TruncatedRun& got, const TruncatedRun& want, const KvTierCounters& t) {
  EXPECT_EQ(got.answers, want.answers);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    ASSERT_EQ(got.logprobs[i].size(), want.logprobs[i].size());
    for (size_t j = 0; j < got.logprobs[i].size(); ++j)
      EXPECT_NEAR(got.logprobs[i][j], want.logprobs[i][j], 1e-4);
  }
  EXPECT_GE(t.shifted_blocks, 3) << "each truncated turn reuses its kept history";
  EXPECT_EQ(t.shifted_failed_blocks, 0);
  EXPECT_EQ(t.restore_failed_blocks, 0);
}

}  // namespace tandem::testing_tiers
