// The controller's prefix cache against the memory ranks' KV tables: a randomized run in which
// every plan the controller makes is applied to one KvTable per memory rank (as the memory ranks
// do), with prompts drawn from shared system prompts and few-shot blocks, arrivals in bursts,
// cancellations, and KV pools small enough to force eviction. Checked after every step:
//   * every plan applies (the controller never promises KV a rank does not have, never attaches,
//     publishes, evicts or groups a block the rank does not hold as it says);
//   * the controller's view of each rank (reserved + registered tokens) covers what the rank
//     really uses, and its registered blocks are exactly the rank's;
//   * every request finishes with its max_tokens (ignore_eos), none is lost, and cached_tokens
//     counts whole blocks that were really attached.
#include "compute_node/controller.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <random>
#include <tuple>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "memory_node/kv_table.h"

namespace tandem {
namespace {

struct Scenario {
  int ranks;
  int64_t capacity;  // KV slots per rank
  int64_t block;
  int64_t batch, step_tokens;
  PrefixSharing sharing;
  uint32_t seed;
};

class ControllerPrefix : public ::testing::TestWithParam<Scenario> {};

TEST_P(ControllerPrefix, PlansAlwaysApplyAndAccountingCoversTheRanks) {
  const Scenario sc = GetParam();
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  ASSERT_TRUE(spec.ok());
  ControllerOptions o;
  o.max_batch_size = sc.batch;
  o.max_tokens_per_step = sc.step_tokens;
  o.prefix_block_tokens = sc.block;
  o.prefix_sharing = sc.sharing;
  Controller c(*spec, std::vector<int64_t>(static_cast<size_t>(sc.ranks), sc.capacity), o);
  std::vector<std::unique_ptr<KvTable>> tables;
  for (int m = 0; m < sc.ranks; ++m) {
    tables.push_back(std::make_unique<KvTable>(sc.capacity, sc.block));
    tables.back()->SetPrefixSharing(sc.sharing, [](int64_t rows, int64_t) { return rows >= 2; });
  }

  std::mt19937 rng(sc.seed);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto tokens = [&](int n) {
    std::vector<int32_t> t;
    for (int i = 0; i < n; ++i) t.push_back(rnd(2, static_cast<int>(spec->vocab_size) - 1));
    return t;
  };
  std::vector<std::vector<int32_t>> systems, shots;
  for (int i = 0; i < 3; ++i) systems.push_back(tokens(rnd(1, 5) * static_cast<int>(sc.block) + rnd(0, 3)));
  for (int i = 0; i < 4; ++i) shots.push_back(tokens(rnd(0, 3) * static_cast<int>(sc.block)));

  std::map<int64_t, GenerationRequest> live;  // submitted, not finished
  int64_t submitted = 0, finished_count = 0, cancelled = 0, attached_tokens = 0;
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  for (int step = 0; step < 600; ++step) {
    // Bursts of arrivals sharing prompts.
    if (step < 450 && rnd(0, 3) == 0) {
      for (int k = rnd(1, 6); k > 0; --k) {
        GenerationRequest r;
        r.prompt = systems[static_cast<size_t>(rnd(0, 2))];
        if (rnd(0, 2) != 0) {
          const auto& s = shots[static_cast<size_t>(rnd(0, 3))];
          r.prompt.insert(r.prompt.end(), s.begin(), s.end());
        }
        const std::vector<int32_t> own = tokens(rnd(0, 2 * static_cast<int>(sc.block)));
        r.prompt.insert(r.prompt.end(), own.begin(), own.end());
        if (r.prompt.empty()) r.prompt.push_back(3);
        r.max_tokens = rnd(1, 12);
        r.ignore_eos = true;
        if (c.Check(r).code() == absl::StatusCode::kResourceExhausted) continue;  // can never fit
        absl::StatusOr<int64_t> id = c.Submit(r);
        ASSERT_TRUE(id.ok()) << id.status();
        live[*id] = r;
        ++submitted;
      }
    }
    // Now and then a cancellation (waiting or running).
    if (!live.empty() && rnd(0, 19) == 0) {
      auto it = live.begin();
      std::advance(it, rnd(0, static_cast<int>(live.size()) - 1));
      GenerationResult res;
      ASSERT_TRUE(c.Cancel(it->first, &res, &released).ok());
      EXPECT_EQ(res.finish_reason, "cancelled");
      for (int m = 0; m < sc.ranks; ++m)
        tables[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
      live.erase(it);
      ++cancelled;
    }
    PlannedStep ps;
    c.Schedule(&ps);
    if (ps.empty()) {
      if (c.Idle() && step >= 450) break;
      continue;
    }
    for (int m = 0; m < sc.ranks; ++m) {
      AttentionBatch batch;
      const absl::Status s = tables[static_cast<size_t>(m)]->Apply(ps.plan, static_cast<uint16_t>(m), &batch);
      ASSERT_TRUE(s.ok()) << "step " << step << " rank " << m << ": " << s;
      ASSERT_EQ(batch.num_tokens(),
                ps.rank_rows[static_cast<size_t>(m) + 1] - ps.rank_rows[static_cast<size_t>(m)]);
    }
    for (const StepRequest& r : ps.plan.requests) {
      if (r.attach_hash != 0) attached_tokens += r.position;
    }
    // Any token will do (ignore_eos): the prefix logic does not look at generated tokens.
    SampledTokens sampled;
    for (size_t i = 0; i < ps.rows.sample_rows.size(); ++i) sampled.Append(5, -1.0f);
    finished.clear();
    ASSERT_TRUE(c.Complete(ps, sampled, &finished, &released).ok());
    for (int m = 0; m < sc.ranks; ++m)
      tables[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
    for (auto& [id, res] : finished) {
      auto it = live.find(id);
      ASSERT_NE(it, live.end());
      EXPECT_EQ(static_cast<int64_t>(res.token_ids.size()), it->second.max_tokens);
      EXPECT_EQ(res.cached_tokens % sc.block, 0);
      EXPECT_LT(res.cached_tokens, static_cast<int64_t>(it->second.prompt.size()));
      live.erase(it);
      ++finished_count;
    }
    // The controller's accounting covers each rank's real use, and the registries agree.
    for (int m = 0; m < sc.ranks; ++m) {
      const KvTable& t = *tables[static_cast<size_t>(m)];
      const PrefixIndex* index = c.prefix_index(m);
      ASSERT_NE(index, nullptr);
      ASSERT_EQ(index->stats().blocks, t.num_blocks()) << "rank " << m << " step " << step;
      const int64_t used = t.num_slots() - t.num_free();
      ASSERT_LE(used, c.kv_reserved(m) + index->stats().tokens_held) << "rank " << m << " step " << step;
      ASSERT_LE(c.kv_reserved(m) + index->stats().tokens_held, sc.capacity)
          << "rank " << m << " step " << step;
    }
  }
  EXPECT_TRUE(c.Idle());
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(finished_count + cancelled, submitted);
  EXPECT_EQ(c.stats().cached_tokens, attached_tokens);
  EXPECT_GT(attached_tokens, 0) << "no prompt ever reused a block";
  if (sc.sharing != PrefixSharing::kOff) {
    EXPECT_GT(c.stats().grouped_rows, 0);
  }
  int64_t evictions = 0;
  for (int m = 0; m < sc.ranks; ++m) evictions += c.prefix_index(m)->stats().evictions;
  std::printf(
      "%d rank(s), %lld slots each: %lld requests (%lld cancelled), %lld prompt tokens reused, %lld "
      "rows in groups, %lld blocks evicted\n",
      sc.ranks, static_cast<long long>(sc.capacity), static_cast<long long>(submitted),
      static_cast<long long>(cancelled), static_cast<long long>(attached_tokens),
      static_cast<long long>(c.stats().grouped_rows), static_cast<long long>(evictions));
}

INSTANTIATE_TEST_SUITE_P(Scenarios, ControllerPrefix,
                         ::testing::Values(Scenario{1, 4096, 8, 16, 128, PrefixSharing::kOn, 1},
                                           Scenario{2, 600, 8, 12, 64, PrefixSharing::kOn,
                                                    2},  // eviction pressure
                                           Scenario{3, 400, 4, 24, 48, PrefixSharing::kAuto, 3},
                                           Scenario{2, 2048, 16, 32, 512, PrefixSharing::kOff, 4},
                                           Scenario{1, 300, 8, 8, 32, PrefixSharing::kOn, 5}),
                         [](const ::testing::TestParamInfo<Scenario>& info) {
                           const Scenario& s = info.param;
                           const char* sharing = s.sharing == PrefixSharing::kOn     ? "on"
                                                 : s.sharing == PrefixSharing::kAuto ? "auto"
                                                                                     : "off";
                           return absl::StrCat(s.ranks, "ranks_", s.capacity, "slots_block", s.block,
                                               "_sharing_", sharing);
                         });

// kv.eviction_lookahead: when admitting a request needs room, the blocks a waiting request will
// reuse are evicted last. One rank of 120 slots, blocks of 16, one request at a time: A and B
// (48-token prompts) finish and stay registered (96 slots); then D (a new 48-token prompt) and C
// (A's prompt plus 20 tokens) arrive together. D's admission must evict 32 tokens: least recently
// used alone takes A's last two blocks, so C reuses 16 tokens; with C in the look-ahead, B's go and
// C reuses all 48.
int64_t CachedTokensOfFollowUp(int64_t lookahead) {
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  EXPECT_TRUE(spec.ok());
  constexpr int64_t kCapacity = 120, kBlockTokens = 16;
  ControllerOptions o;
  o.max_batch_size = 1;
  o.max_tokens_per_step = 256;
  o.prefix_block_tokens = kBlockTokens;
  o.eviction_lookahead = lookahead;
  Controller c(*spec, {kCapacity}, o);
  KvTable table(kCapacity, kBlockTokens);
  std::map<int64_t, GenerationResult> results;
  std::vector<std::vector<uint64_t>> released;
  auto run = [&] {
    for (int step = 0; step < 100 && !c.Idle(); ++step) {
      PlannedStep ps;
      c.Schedule(&ps);
      if (ps.empty()) continue;
      AttentionBatch batch;
      const absl::Status st = table.Apply(ps.plan, 0, &batch);
      EXPECT_TRUE(st.ok()) << st;
      SampledTokens sampled;
      for (size_t i = 0; i < ps.rows.sample_rows.size(); ++i) sampled.Append(5, -1.0f);
      std::vector<std::pair<int64_t, GenerationResult>> finished;
      EXPECT_TRUE(c.Complete(ps, sampled, &finished, &released).ok());
      table.Release(released[0]);
      for (auto& [id, res] : finished) results[id] = std::move(res);
    }
    EXPECT_TRUE(c.Idle());
  };
  auto prompt = [](int n, int32_t first) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = first + i;
    return t;
  };
  auto submit = [&](std::vector<int32_t> tokens) {
    GenerationRequest r;
    r.prompt = std::move(tokens);
    r.max_tokens = 1;
    r.ignore_eos = true;
    absl::StatusOr<int64_t> id = c.Submit(r);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : -1;
  };
  submit(prompt(48, 10));  // A
  run();
  submit(prompt(48, 100));  // B
  run();
  submit(prompt(48, 200));  // D
  std::vector<int32_t> follow_up = prompt(48, 10);
  for (int32_t t : prompt(20, 300)) follow_up.push_back(t);
  const int64_t id_c = submit(follow_up);  // C
  run();
  return results.count(id_c) ? results[id_c].cached_tokens : -1;
}

TEST(ControllerEviction, WaitingRequestsKeepTheirPrefixBlocks) {
  EXPECT_EQ(CachedTokensOfFollowUp(0), 16);  // least recently used only
  EXPECT_EQ(CachedTokensOfFollowUp(1), 48);
  EXPECT_EQ(CachedTokensOfFollowUp(64), 48);
}

// KV tiers with prefetch (kv.tiers.prefetch_lookahead) against the memory ranks' KV tables, over
// tiers that keep every demoted block and lose some (a restore of those fails and is recomputed).
// Conversations come back in bursts, so that the queue holds turns whose history was demoted.
// Checked after every step, as above: every plan applies, the accounting covers each rank, and the
// registries agree (resident blocks are the rank's); and the property of prefetch: no block that
// a running request or one of the first prefetch_lookahead waiting requests matched before the
// step is evicted to make room for a prefetch.
class RecordingTiers : public KvBlockTiers {
 public:
  explicit RecordingTiers(uint32_t seed) : rng_(seed) {}
  void Demote(uint64_t hash, uint64_t, int32_t, std::span<const int32_t>, std::span<const int32_t>) override {
    saved_.insert(hash);
  }
  bool Restore(uint64_t hash, uint64_t, int32_t, std::span<const int32_t>) override {
    return saved_.contains(hash) && rng_() % 16 != 0;  // one in 16 copies is found damaged
  }
  void SetNextUse(std::span<const KvTierNextUse> uses) override {
    next_uses_.assign(uses.begin(), uses.end());
  }
  // A source must be in the pool or saved; one in 16 shifted restores fails.
  bool RestoreShifted(std::span<const KvShiftedSource> sources, std::span<const int32_t>, int64_t) override {
    ++shifted_;
    for (const KvShiftedSource& s : sources) {
      if (s.pool_slots.empty() && !saved_.contains(s.hash)) return false;
    }
    return rng_() % 16 != 0;
  }
  const std::vector<KvTierNextUse>& next_uses() const { return next_uses_; }
  int64_t shifted() const { return shifted_; }

 private:
  std::mt19937 rng_;
  std::unordered_set<uint64_t> saved_;
  std::vector<KvTierNextUse> next_uses_;
  int64_t shifted_ = 0;
};

struct PrefetchRun {
  int64_t steps = 0, prefetch_evictions = 0, restored = 0, failed = 0, prefetched = 0, used = 0, wasted = 0,
          cached = 0, next_uses = 0, shifted = 0, shifted_failed = 0, shifted_calls = 0;
};

// With `truncate`, a returning conversation now and then drops some tokens after its system prompt,
// as a client that truncates its history does; `shifted` is kv.store_pre_rope.
PrefetchRun RunConversations(int ranks, int64_t capacity, int64_t prefetch, uint32_t seed,
                             bool truncate = false, bool shifted = false) {
  PrefetchRun run;
  absl::StatusOr<ModelSpec> spec = PresetSpec("tiny-gqa");
  EXPECT_TRUE(spec.ok());
  constexpr int64_t kBlockTokens = 8;
  ControllerOptions o;
  o.max_batch_size = 3;
  o.max_tokens_per_step = 48;
  o.prefix_block_tokens = kBlockTokens;
  o.tier_blocks = 4096;
  o.eviction_lookahead = 16;
  o.prefetch_lookahead = prefetch;
  o.shifted_reuse = shifted;
  Controller c(*spec, std::vector<int64_t>(static_cast<size_t>(ranks), capacity), o);
  std::vector<std::unique_ptr<KvTable>> tables;
  std::vector<std::unique_ptr<RecordingTiers>> tiers;
  for (int m = 0; m < ranks; ++m) {
    tables.push_back(std::make_unique<KvTable>(capacity, kBlockTokens));
    tiers.push_back(std::make_unique<RecordingTiers>(seed + static_cast<uint32_t>(m)));
    tables.back()->SetTiers(tiers.back().get());
  }
  std::mt19937 rng(seed);
  auto rnd = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  // Conversations open with one of two system prompts of two blocks: a waiting turn often
  // matches resident shared blocks followed by its own demoted ones.
  std::vector<std::vector<int32_t>> systems(2);
  for (auto& sys : systems) {
    for (int i = 0; i < 2 * kBlockTokens; ++i) sys.push_back(rnd(2, static_cast<int>(spec->vocab_size) - 1));
  }
  std::vector<std::vector<int32_t>> history(12);
  std::vector<bool> busy(history.size(), false);  // a turn of it is live
  struct Turn {
    size_t conv;
    int64_t max_tokens;
  };
  std::map<int64_t, Turn> live;  // by id: submission order
  std::vector<std::pair<int64_t, GenerationResult>> finished;
  std::vector<std::vector<uint64_t>> released;
  for (int step = 0; step < 2000; ++step) {
    if (step < 1500 && rnd(0, 5) == 0) {  // a burst of returning conversations
      for (int k = rnd(1, 6); k > 0; --k) {
        const size_t conv = static_cast<size_t>(rnd(0, static_cast<int>(history.size()) - 1));
        if (busy[conv]) continue;
        if (history[conv].empty()) history[conv] = systems[conv % systems.size()];
        const auto sys_end = static_cast<std::ptrdiff_t>(2 * kBlockTokens);
        if (truncate && static_cast<std::ptrdiff_t>(history[conv].size()) > sys_end + 24 && rnd(0, 2) == 0)
          history[conv].erase(history[conv].begin() + sys_end, history[conv].begin() + sys_end + rnd(1, 20));
        for (int i = rnd(3, 12); i > 0; --i)
          history[conv].push_back(rnd(2, static_cast<int>(spec->vocab_size) - 1));
        GenerationRequest r;
        r.prompt = history[conv];
        r.max_tokens = rnd(1, 8);
        r.ignore_eos = true;
        if (!c.Check(r).ok()) {  // grew past the pool: start over
          history[conv].clear();
          continue;
        }
        absl::StatusOr<int64_t> id = c.Submit(r);
        EXPECT_TRUE(id.ok()) << id.status();
        live[*id] = {conv, r.max_tokens};
        busy[conv] = true;
      }
    }
    if (!live.empty() && rnd(0, 39) == 0) {  // a cancellation now and then
      auto it = live.begin();
      std::advance(it, rnd(0, static_cast<int>(live.size()) - 1));
      GenerationResult res;
      EXPECT_TRUE(c.Cancel(it->first, &res, &released).ok());
      for (int m = 0; m < ranks; ++m)
        tables[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
      busy[it->second.conv] = false;
      history[it->second.conv].clear();
      live.erase(it);
    }
    // What the step must not evict for a prefetch: the blocks that running requests use (on their
    // rank) and that the first `prefetch` waiting ones match (on any rank) and still need after
    // the step's admissions (FIFO: the waiting requests are the newest live ones; one admitted by
    // the step holds its blocks on its rank, which no eviction may take).
    std::vector<std::unordered_set<uint64_t>> needed(static_cast<size_t>(ranks));
    std::vector<std::vector<std::unordered_set<uint64_t>>> window;  // per waiting request, per rank
    const size_t running = live.size() - static_cast<size_t>(c.num_waiting());
    size_t pos = 0;
    for (const auto& [id, turn] : live) {
      const bool waiting = pos >= running;
      if (pos++ >= running + static_cast<size_t>(prefetch)) break;
      const std::optional<std::vector<int32_t>> h = c.History(id);
      EXPECT_TRUE(h.has_value());
      if (waiting) window.emplace_back(static_cast<size_t>(ranks));
      for (int m = 0; m < ranks; ++m) {
        const PrefixIndex& index = *c.prefix_index(m);
        for (int32_t b : index.Match(*h, static_cast<int64_t>(h->size()) / kBlockTokens)) {
          if (!index.resident(b)) break;
          if (waiting) window.back()[static_cast<size_t>(m)].insert(index.hash(b));
          if (!waiting && index.users(b) > 0) needed[static_cast<size_t>(m)].insert(index.hash(b));
        }
      }
    }
    const size_t waiting_before = static_cast<size_t>(c.num_waiting());
    PlannedStep ps;
    c.Schedule(&ps);
    const size_t admitted = waiting_before - static_cast<size_t>(c.num_waiting());
    for (size_t w = admitted; w < window.size(); ++w) {
      for (int m = 0; m < ranks; ++m)
        needed[static_cast<size_t>(m)].insert(window[w][static_cast<size_t>(m)].begin(),
                                              window[w][static_cast<size_t>(m)].end());
    }
    if (ps.empty()) {
      if (c.Idle() && step >= 1500) break;
      continue;
    }
    ++run.steps;
    // Next-use records: exactly the demoted blocks that the first eviction_lookahead waiting
    // requests match, per rank, each with the queue position of the first one that matches it.
    {
      std::map<std::pair<uint16_t, uint64_t>, int32_t> want;
      const size_t first_waiting = live.size() - static_cast<size_t>(c.num_waiting());
      int32_t w = 0;
      for (auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(first_waiting));
           it != live.end() && w < o.eviction_lookahead; ++it, ++w) {
        const std::optional<std::vector<int32_t>> h = c.History(it->first);
        EXPECT_TRUE(h.has_value());
        for (int m = 0; m < ranks; ++m) {
          const PrefixIndex& index = *c.prefix_index(m);
          for (int32_t b : index.Match(*h, (static_cast<int64_t>(h->size()) - 1) / kBlockTokens)) {
            if (!index.resident(b)) want.emplace(std::pair(static_cast<uint16_t>(m), index.hash(b)), w);
          }
        }
      }
      std::map<std::pair<uint16_t, uint64_t>, int32_t> got;
      for (const PrefixNextUse& u : ps.plan.next_uses) got[{u.memory_rank, u.block_hash}] = u.next_use;
      EXPECT_EQ(got.size(), ps.plan.next_uses.size()) << "step " << step << ": a block listed twice";
      EXPECT_EQ(got, want) << "step " << step;
      run.next_uses += static_cast<int64_t>(ps.plan.next_uses.size());
    }
    run.prefetch_evictions += static_cast<int64_t>(ps.prefetch_evictions.size());
    for (uint64_t h : ps.prefetch_evictions) {
      const auto e = std::find_if(ps.plan.evictions.begin(), ps.plan.evictions.end(),
                                  [&](const PrefixEvict& x) { return x.block_hash == h; });
      EXPECT_NE(e, ps.plan.evictions.end()) << "a prefetch eviction that is not in the plan";
      if (e == ps.plan.evictions.end()) continue;
      EXPECT_FALSE(needed[e->memory_rank].contains(h))
          << "step " << step << ": block " << h << " was evicted for a prefetch but a request ahead needs it";
    }
    for (int m = 0; m < ranks; ++m) {
      AttentionBatch batch;
      std::vector<uint64_t> failed;
      const absl::Status st =
          tables[static_cast<size_t>(m)]->Apply(ps.plan, static_cast<uint16_t>(m), &batch, &failed);
      EXPECT_TRUE(st.ok()) << "step " << step << " rank " << m << ": " << st;
      if (!st.ok()) return run;
      if (std::any_of(ps.plan.restores.begin(), ps.plan.restores.end(),
                      [&](const PrefixRestore& r) { return r.memory_rank == m; }))
        c.RestoreResult(ps.plan, m, failed);
      // The table handed its rank's restores (used now) and records to the tiers.
      std::vector<std::pair<uint64_t, int32_t>> mine, handed;
      for (const PrefixRestore& r : ps.plan.restores)
        if (r.memory_rank == m) mine.emplace_back(r.block_hash, 0);
      for (const PrefixNextUse& u : ps.plan.next_uses)
        if (u.memory_rank == m) mine.emplace_back(u.block_hash, u.next_use);
      for (const KvTierNextUse& u : tiers[static_cast<size_t>(m)]->next_uses())
        handed.emplace_back(u.hash, u.next_use);
      EXPECT_EQ(mine, handed) << "step " << step << " rank " << m;
    }
    SampledTokens sampled;
    for (size_t i = 0; i < ps.rows.sample_rows.size(); ++i) sampled.Append(5, -1.0f);
    finished.clear();
    EXPECT_TRUE(c.Complete(ps, sampled, &finished, &released).ok());
    for (int m = 0; m < ranks; ++m) tables[static_cast<size_t>(m)]->Release(released[static_cast<size_t>(m)]);
    for (auto& [id, res] : finished) {
      auto it = live.find(id);
      EXPECT_NE(it, live.end());
      if (it == live.end()) continue;
      std::vector<int32_t>& h = history[it->second.conv];
      EXPECT_EQ(static_cast<int64_t>(res.token_ids.size()), it->second.max_tokens);
      h.insert(h.end(), res.token_ids.begin(), res.token_ids.end());
      busy[it->second.conv] = false;
      live.erase(it);
    }
    for (int m = 0; m < ranks; ++m) {
      const KvTable& t = *tables[static_cast<size_t>(m)];
      const PrefixIndex& index = *c.prefix_index(m);
      EXPECT_EQ(index.stats().blocks - index.stats().demoted, t.num_blocks())
          << "rank " << m << " step " << step;
      EXPECT_LE(t.num_slots() - t.num_free(), c.kv_reserved(m) + index.stats().tokens_held)
          << "rank " << m << " step " << step;
      EXPECT_LE(c.kv_reserved(m) + index.stats().tokens_held, capacity) << "rank " << m << " step " << step;
    }
    if (::testing::Test::HasFailure()) return run;
  }
  EXPECT_TRUE(c.Idle());
  EXPECT_TRUE(live.empty());
  const ControllerStats& s = c.stats();
  run.restored = s.restored_blocks;
  run.failed = s.restore_failed_blocks;
  run.prefetched = s.prefetched_blocks;
  run.used = s.prefetch_used_blocks;
  run.wasted = s.prefetch_wasted_blocks;
  run.cached = s.cached_tokens;
  run.shifted = s.shifted_blocks;
  run.shifted_failed = s.shifted_failed_blocks;
  for (const auto& t : tiers) run.shifted_calls += t->shifted();
  // Every shifted restore that succeeded reached the tiers; one whose parent failed in the same
  // plan fails without reaching them.
  EXPECT_LE(run.shifted, run.shifted_calls);
  EXPECT_LE(run.shifted_calls, run.shifted + run.shifted_failed);
  EXPECT_LE(run.shifted, run.restored);
  EXPECT_LE(run.shifted_failed, run.failed);
  EXPECT_LE(run.prefetched, run.restored);
  EXPECT_LE(run.used + run.wasted, run.prefetched);
  std::printf(
      "%d rank(s), %lld slots, prefetch %lld: %lld steps, %lld blocks restored (%lld failed), "
      "%lld prefetched (%lld used, %lld wasted; %lld blocks evicted for them), %lld prompt tokens "
      "reused\n",
      ranks, static_cast<long long>(capacity), static_cast<long long>(prefetch),
      static_cast<long long>(run.steps), static_cast<long long>(run.restored),
      static_cast<long long>(run.failed), static_cast<long long>(run.prefetched),
      static_cast<long long>(run.used), static_cast<long long>(run.wasted),
      static_cast<long long>(run.prefetch_evictions), static_cast<long long>(run.cached));
  return run;
}

TEST(ControllerPrefetch, NeverEvictsWhatRequestsAheadNeedAndPlansAlwaysApply) {
  for (const auto& [ranks, capacity, seed] :
       std::vector<std::tuple<int, int64_t, uint32_t>>{{1, 240, 11}, {2, 200, 12}, {3, 160, 13}}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks of ", capacity, " slots"));
    const PrefetchRun on = RunConversations(ranks, capacity, 8, seed);
    EXPECT_GT(on.prefetched, 0) << "the queue held returning conversations but nothing was prefetched";
    EXPECT_GT(on.used, 0) << "no prefetched block was ever attached";
    EXPECT_GT(on.failed, 0) << "the damaged copies were never met";
    const PrefetchRun off = RunConversations(ranks, capacity, 0, seed);
    EXPECT_EQ(off.prefetched, 0);
    EXPECT_EQ(off.used + off.wasted, 0);
    EXPECT_GT(off.restored, 0);
    EXPECT_GT(on.next_uses, 0) << "no plan listed a demoted block that a waiting request wants";
  }
}

// kv.store_pre_rope: truncated histories are restored from shifted rows; with restores that fail
// now and then (a source gone, a damaged copy), every plan still applies, the accounting holds and
// every request ends with its max_tokens (all checked by RunConversations after each step).
TEST(ControllerShifted, TruncatedHistoriesAreRestoredAndPlansAlwaysApply) {
  for (const auto& [ranks, capacity, seed] :
       std::vector<std::tuple<int, int64_t, uint32_t>>{{1, 240, 21}, {2, 200, 22}, {3, 160, 23}}) {
    SCOPED_TRACE(absl::StrCat(ranks, " ranks of ", capacity, " slots"));
    const PrefetchRun on = RunConversations(ranks, capacity, 8, seed, /*truncate=*/true, /*shifted=*/true);
    EXPECT_GT(on.shifted, 0) << "no truncated history was restored from shifted rows";
    EXPECT_GT(on.shifted_failed, 0) << "the failing shifted restores were never met";
    const PrefetchRun off = RunConversations(ranks, capacity, 8, seed, /*truncate=*/true, /*shifted=*/false);
    EXPECT_EQ(off.shifted_calls, 0);
  }
}

}  // namespace
}  // namespace tandem
