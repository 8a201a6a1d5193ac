// kv.store_pre_rope on the colocated engine: conversations whose client keeps a window of the
// history (the system prompt, then the newest turns that fit in --window tokens; older turns are
// dropped), run once recomputing what follows the system prompt after a drop (prefix cache and KV
// tiers on, the setting off) and once reusing the kept turns' KV at their new positions (the
// setting on). Both runs see the same prompts: every turn's history carries the recomputing run's
// answers. Prints, per mode, the prompt tokens prefilled and reused, the blocks reused at new
// positions and the wall time; then, over the turns that followed a drop, how often the reusing
// run's answer equals the recomputing run's (whole answers, first tokens, and the mean share of
// leading tokens that agree). Greedy; prompts are random token ids.
// Usage: pre_rope_bench [--model small|<checkpoint dir>|<file.gguf>] [--device cpu] [--conversations 4]
//                       [--turns 8] [--system 64] [--new 48] [--answer 16] [--window 256]
//                       [--block 16] [--kv-capacity 16384] [--host-bytes 1073741824]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "colocated/engine.h"
#include "common/model_spec.h"
#include "compute_node/weights.h"

namespace {

struct Flags {
  std::string model = "small", device = "cpu";
  int conversations = 4, turns = 8, system = 64, fresh = 48, answer = 16, window = 256, block = 16;
  int64_t kv_capacity = 16384, host_bytes = int64_t{1} << 30;
};

struct Turn {
  std::vector<int32_t> question, answer;
};

struct Run {
  std::vector<std::vector<std::vector<int32_t>>> answers;  // [turn][conversation]
  std::vector<std::vector<bool>> truncated;                // [turn][conversation]: older turns dropped
  tandem::EngineStats stats;
  double wall_s = 0;
};

// The prompt of a conversation's next turn: the system prompt, then the newest earlier turns that
// fit in `window` tokens with the new question, then the question.
std::vector<int32_t> Prompt(const std::vector<int32_t>& system, const std::vector<Turn>& earlier,
                            const std::vector<int32_t>& question, int window, bool* truncated) {
  size_t first = earlier.size();
  int64_t used = static_cast<int64_t>(question.size());
  while (first > 0) {
    const Turn& t = earlier[first - 1];
    const int64_t n = static_cast<int64_t>(t.question.size() + t.answer.size());
    if (used + n > window) break;
    used += n;
    --first;
  }
  *truncated = first > 0;
  std::vector<int32_t> p = system;
  for (size_t i = first; i < earlier.size(); ++i) {
    p.insert(p.end(), earlier[i].question.begin(), earlier[i].question.end());
    p.insert(p.end(), earlier[i].answer.begin(), earlier[i].answer.end());
  }
  p.insert(p.end(), question.begin(), question.end());
  return p;
}

// One mode. `reference` (empty for the first run) supplies the answers every history carries.
Run Converse(const tandem::WeightSource& w, const Flags& f, bool pre_rope, const Run* reference) {
  tandem::EngineOptions o;
  o.device = f.device;
  o.max_batch_size = f.conversations;
  o.max_tokens_per_step = 2048;
  o.kv_capacity_tokens = f.kv_capacity;
  o.prefix_block_tokens = f.block;
  o.tiers_host_bytes = f.host_bytes;
  o.store_pre_rope = pre_rope;
  absl::StatusOr<std::unique_ptr<tandem::ColocatedEngine>> e = tandem::ColocatedEngine::Create(w, o);
  if (!e.ok()) {
    std::fprintf(stderr, "pre_rope_bench: %s\n", e.status().ToString().c_str());
    std::exit(1);
  }
  const int64_t vocab = w.spec().vocab_size;
  uint32_t x = 12345;  // the same questions in every mode
  const auto next = [&] {
    x = x * 1664525u + 1013904223u;
    return static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(vocab - 2));
  };
  std::vector<int32_t> system;
  for (int i = 0; i < f.system; ++i) system.push_back(next());
  std::vector<std::vector<Turn>> history(static_cast<size_t>(f.conversations));
  Run run;
  const auto t0 = std::chrono::steady_clock::now();
  for (int turn = 0; turn < f.turns; ++turn) {
    std::vector<tandem::GenerationRequest> requests;
    std::vector<bool> truncated;
    for (int c = 0; c < f.conversations; ++c) {
      Turn t;
      for (int i = 0; i < f.fresh; ++i) t.question.push_back(next());
      bool cut = false;
      tandem::GenerationRequest r;
      r.prompt = Prompt(system, history[static_cast<size_t>(c)], t.question, f.window, &cut);
      r.max_tokens = f.answer;
      r.ignore_eos = true;
      requests.push_back(std::move(r));
      truncated.push_back(cut);
      history[static_cast<size_t>(c)].push_back(std::move(t));
    }
    absl::StatusOr<std::vector<tandem::GenerationResult>> out = (*e)->GenerateAll(requests);
    if (!out.ok()) {
      std::fprintf(stderr, "pre_rope_bench: turn %d: %s\n", turn, out.status().ToString().c_str());
      std::exit(1);
    }
    run.answers.emplace_back();
    for (int c = 0; c < f.conversations; ++c) {
      run.answers.back().push_back((*out)[static_cast<size_t>(c)].token_ids);
      history[static_cast<size_t>(c)].back().answer =
          reference != nullptr ? reference->answers[static_cast<size_t>(turn)][static_cast<size_t>(c)]
                               : run.answers.back().back();
    }
    run.truncated.push_back(truncated);
  }
  run.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  run.stats = (*e)->stats();
  return run;
}

void PrintMode(const char* name, const Run& r) {
  std::printf(
      "%-10s prefilled %8lld  reused %8lld  at new positions %6lld blocks (%lld failed)  wall %.2f s\n", name,
      static_cast<long long>(r.stats.prefill_tokens), static_cast<long long>(r.stats.cached_tokens),
      static_cast<long long>(r.stats.tiers.shifted_blocks),
      static_cast<long long>(r.stats.tiers.shifted_failed_blocks), r.wall_s);
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help") {
      std::printf(
          "pre_rope_bench [--model small|<checkpoint dir>|<file.gguf>] [--device cpu] [--conversations 4]\n"
          "               [--turns 8] [--system 64] [--new 48] [--answer 16] [--window 256] [--block 16]\n"
          "               [--kv-capacity 16384] [--host-bytes 1073741824]\n"
          "Conversations that keep a window of their history, recomputed and reused at new positions\n"
          "(kv.store_pre_rope): prefill work and how often the answers agree.\n");
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "pre_rope_bench: %s needs a value (--help)\n", flag.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (flag == "--model") {
      f.model = v;
    } else if (flag == "--device") {
      f.device = v;
    } else if (flag == "--conversations") {
      f.conversations = std::atoi(v);
    } else if (flag == "--turns") {
      f.turns = std::atoi(v);
    } else if (flag == "--system") {
      f.system = std::atoi(v);
    } else if (flag == "--new") {
      f.fresh = std::atoi(v);
    } else if (flag == "--answer") {
      f.answer = std::atoi(v);
    } else if (flag == "--window") {
      f.window = std::atoi(v);
    } else if (flag == "--block") {
      f.block = std::atoi(v);
    } else if (flag == "--kv-capacity") {
      f.kv_capacity = std::atoll(v);
    } else if (flag == "--host-bytes") {
      f.host_bytes = std::atoll(v);
    } else {
      std::fprintf(stderr, "pre_rope_bench: unknown flag %s (--help)\n", flag.c_str());
      return 2;
    }
  }
  if (f.conversations < 1 || f.turns < 1 || f.system < 0 || f.fresh < 1 || f.answer < 1 || f.block < 1 ||
      f.window < f.fresh) {
    std::fprintf(stderr, "pre_rope_bench: counts must be positive and --window at least --new\n");
    return 2;
  }
  absl::StatusOr<std::unique_ptr<tandem::WeightSource>> w = tandem::OpenModel(f.model, 1);
  if (!w.ok()) {
    std::fprintf(stderr, "pre_rope_bench: %s\n", w.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "pre_rope_bench: %s on %s, %d conversations x %d turns, system %d, question %d, answer %d, window %d, "
      "block %d\n",
      f.model.c_str(), f.device.c_str(), f.conversations, f.turns, f.system, f.fresh, f.answer, f.window,
      f.block);
  const Run recompute = Converse(**w, f, /*pre_rope=*/false, nullptr);
  const Run reuse = Converse(**w, f, /*pre_rope=*/true, &recompute);
  PrintMode("recompute", recompute);
  PrintMode("pre_rope", reuse);
  int64_t turns = 0, equal = 0, first = 0;
  double agree = 0;
  for (size_t t = 0; t < recompute.answers.size(); ++t) {
    for (size_t c = 0; c < recompute.answers[t].size(); ++c) {
      if (!recompute.truncated[t][c]) continue;
      const std::vector<int32_t>& a = recompute.answers[t][c];
      const std::vector<int32_t>& b = reuse.answers[t][c];
      const auto diverge = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
      const int64_t same = diverge.first - a.begin();
      ++turns;
      equal += a == b;
      first += same > 0;
      agree += static_cast<double>(same) / static_cast<double>(std::max<size_t>(1, a.size()));
    }
  }
  if (turns == 0) {
    std::printf("no turn dropped history: raise --turns or lower --window\n");
    return 0;
  }
  std::printf(
      "turns after a drop: %lld; answers equal %.1f%%, first token equal %.1f%%, leading tokens agreeing "
      "%.1f%% on average\n",
      static_cast<long long>(turns), 100.0 * static_cast<double>(equal) / static_cast<double>(turns),
      100.0 * static_cast<double>(first) / static_cast<double>(turns),
      100.0 * agree / static_cast<double>(turns));
  return 0;
}
