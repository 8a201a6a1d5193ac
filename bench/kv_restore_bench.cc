// The cost of KV tiers on the colocated engine (memory_node/kv_tiers.h), CPU or CUDA: conversations
// whose turns outgrow the KV pool, their evicted blocks restored from the host tier, once with
// layer-wise restore (each layer's pool copy just before that layer's attention) and once with
// whole-block restore (every layer copied before the step's first layer), and once without tiers
// (the evicted history recomputed). Prints, per mode, the blocks restored, the restore time, the
// part of it spent before a step's layers (the stall), the time saving demoted blocks (copies out of
// the pool) and the run's wall time; the tokens of the tier modes must be equal. Greedy, random
// weights, every conversation's turn queued together (so prefetch restores run too).
// Usage: kv_restore_bench [--model small] [--device cpu] [--conversations 4] [--turns 4] [--new 48]
//                         [--answer 8] [--prefetch 8] [--repeat 3]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "colocated/engine.h"
#include "common/model_spec.h"
#include "compute_node/weights.h"

namespace {

struct Result {
  std::vector<std::vector<int32_t>> answers;
  tandem::KvTierCounters tiers;
  double wall_s = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string model = "small", device = "cpu";
  int conversations = 4, turns = 4, fresh = 48, answer = 8, repeat = 3;
  int64_t prefetch = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--model")
      model = argv[i + 1];
    else if (flag == "--device")
      device = argv[i + 1];
    else if (flag == "--conversations")
      conversations = std::atoi(argv[i + 1]);
    else if (flag == "--turns")
      turns = std::atoi(argv[i + 1]);
    else if (flag == "--new")
      fresh = std::atoi(argv[i + 1]);
    else if (flag == "--answer")
      answer = std::atoi(argv[i + 1]);
    else if (flag == "--prefetch")
      prefetch = std::atoll(argv[i + 1]);
    else if (flag == "--repeat")
      repeat = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  absl::StatusOr<tandem::ModelSpec> spec = tandem::PresetSpec(model);
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
    return 1;
  }
  const std::unique_ptr<tandem::WeightSource> weights = tandem::RandomWeights(*spec, 1);
  constexpr int64_t kBlock = 16;
  // The pool holds the longest turn and a little more: every round evicts the other conversations.
  const int64_t longest = static_cast<int64_t>(turns) * (fresh + answer);
  const int64_t capacity = (longest + longest / 2 + kBlock - 1) / kBlock * kBlock;
  // tiers: 0 off (recompute), 1 layer-wise restore, 2 whole-block restore.
  auto run = [&](int tiers) -> Result {
    const bool layerwise = tiers == 1;
    tandem::EngineOptions o;
    o.device = device;
    o.max_batch_size = 1;
    o.max_tokens_per_step = 512;
    o.kv_capacity_tokens = capacity;
    o.prefix_block_tokens = kBlock;
    o.tiers_host_bytes = tiers > 0 ? int64_t{16} << 30 : 0;
    o.tiers_prefetch_lookahead = prefetch;
    absl::StatusOr<std::unique_ptr<tandem::ColocatedEngine>> e = tandem::ColocatedEngine::Create(*weights, o);
    if (!e.ok()) {
      std::fprintf(stderr, "%s\n", e.status().ToString().c_str());
      std::exit(1);
    }
    if (tiers > 0) (*e)->tiers()->set_layerwise(layerwise);
    Result r;
    std::vector<std::vector<int32_t>> history(static_cast<size_t>(conversations));
    uint32_t x = 12345;
    const auto t0 = std::chrono::steady_clock::now();
    for (int turn = 0; turn < turns; ++turn) {
      std::vector<tandem::GenerationRequest> round;
      for (auto& h : history) {
        for (int i = 0; i < fresh; ++i) {
          x = x * 1664525u + 1013904223u;
          h.push_back(static_cast<int32_t>(2 + (x >> 8) % static_cast<uint32_t>(spec->vocab_size - 2)));
        }
        tandem::GenerationRequest q;
        q.prompt = h;
        q.max_tokens = answer;
        q.ignore_eos = true;
        round.push_back(q);
      }
      absl::StatusOr<std::vector<tandem::GenerationResult>> out = (*e)->GenerateAll(round);
      if (!out.ok()) {
        std::fprintf(stderr, "%s\n", out.status().ToString().c_str());
        std::exit(1);
      }
      for (size_t k = 0; k < round.size(); ++k) {
        history[k].insert(history[k].end(), (*out)[k].token_ids.begin(), (*out)[k].token_ids.end());
        r.answers.push_back((*out)[k].token_ids);
      }
    }
    r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.tiers = (*e)->stats().tiers;
    return r;
  };
  std::printf(
      "model %s on %s, %d conversations x %d turns (+%d tokens, %d answered), KV pool %lld tokens, block "
      "%lld\n",
      model.c_str(), device.c_str(), conversations, turns, fresh, answer, static_cast<long long>(capacity),
      static_cast<long long>(kBlock));
  std::printf("%-10s %8s %10s %12s %12s %10s %10s\n", "restore", "blocks", "prefetched", "restore ms",
              "stall ms", "save ms", "wall s");
  std::vector<int32_t> first;
  for (int rep = 0; rep < repeat; ++rep) {
    for (const int tiers : {0, 2, 1}) {
      const Result r = run(tiers);
      std::printf("%-10s %8lld %10lld %12.3f %12.3f %10.3f %10.3f\n",
                  tiers == 0   ? "recompute"
                  : tiers == 1 ? "layerwise"
                               : "whole",
                  static_cast<long long>(r.tiers.restored_blocks),
                  static_cast<long long>(r.tiers.prefetched_blocks), r.tiers.restore_seconds * 1e3,
                  r.tiers.restore_stall_seconds * 1e3, r.tiers.save_seconds * 1e3, r.wall_s);
      if (tiers == 0) continue;  // recomputed KV may round differently on a GPU
      std::vector<int32_t> all;
      for (const auto& a : r.answers) all.insert(all.end(), a.begin(), a.end());
      if (first.empty()) first = all;
      if (all != first) {
        std::fprintf(stderr, "the answers differ between runs\n");
        return 1;
      }
    }
  }
  return 0;
}
