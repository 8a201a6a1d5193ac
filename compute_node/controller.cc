#include "compute_node/controller.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"

namespace tandem {

namespace cpu = kernels::cpu;

namespace {

class FifoPolicy : public SchedulingPolicy {
 public:
  std::string name() const override { return "fifo"; }
  size_t NextToAdmit(std::span<const WaitingRequest>) const override { return 0; }
};

absl::Status ValidateSampling(const cpu::SamplingParams& s) {
  if (!std::isfinite(s.temperature) || s.temperature < 0) {
    return absl::InvalidArgumentError(absl::StrCat("temperature must be >= 0, got ", s.temperature));
  }
  if (s.top_k < 0) return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", s.top_k));
  if (!(s.top_p > 0 && s.top_p <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", s.top_p));
  }
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<SchedulingPolicy> MakeFifoPolicy() { return std::make_unique<FifoPolicy>(); }

absl::StatusOr<ControllerOptions> ResolveSchedulerOptions(int64_t max_batch_size,
                                                          int64_t max_tokens_per_step) {
  if (max_batch_size < 0) return absl::InvalidArgumentError("scheduler.max_batch_size must be >= 0");
  if (max_tokens_per_step < 1)
    return absl::InvalidArgumentError("scheduler.max_tokens_per_step must be >= 1");
  if (max_batch_size == 0) max_batch_size = max_tokens_per_step;  // the KV cache limits the batch
  if (max_tokens_per_step < max_batch_size) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler.max_tokens_per_step (", max_tokens_per_step,
                                                   ") must be at least scheduler.max_batch_size (",
                                                   max_batch_size,
                                                   "): every decoding request needs one token per step"));
  }
  return ControllerOptions{.max_batch_size = max_batch_size, .max_tokens_per_step = max_tokens_per_step};
}

Controller::Controller(const ModelSpec& spec, std::vector<int64_t> kv_capacity,
                       const ControllerOptions& options, std::unique_ptr<SchedulingPolicy> policy)
    : spec_(spec),
      capacity_(std::move(kv_capacity)),
      lost_(capacity_.size(), false),
      reserved_(capacity_.size(), 0),
      options_(options),
      policy_(std::move(policy)) {
  TANDEM_CHECK(!capacity_.empty());
  TANDEM_CHECK(options_.max_batch_size >= 1 && options_.max_tokens_per_step >= options_.max_batch_size);
  TANDEM_CHECK(options_.prefix_block_tokens >= 0);
  evicted_.resize(capacity_.size());
  evicted_tokens_.resize(capacity_.size());
  restores_.resize(capacity_.size());
  restoring_.resize(capacity_.size());
  pending_.resize(capacity_.size());
  prefetching_.resize(capacity_.size());
  prefetched_.resize(capacity_.size());
  shifted_.resize(capacity_.size());
  shifted_failed_.resize(capacity_.size());
  if (options_.prefix_block_tokens > 0) {
    for (size_t m = 0; m < capacity_.size(); ++m) index_.push_back(MakeIndex());
  }
}

std::unique_ptr<PrefixIndex> Controller::MakeIndex() const {
  auto index =
      std::make_unique<PrefixIndex>(options_.prefix_block_tokens, &DefaultBlockHash, options_.tier_blocks);
  index->set_demoted_wanted_last(options_.tier_next_use);
  if (options_.shifted_reuse) index->EnableContentLookup();
  return index;
}

void Controller::AddShiftedBlocks(size_t m, std::span<const int32_t> prompt) {
  if (!options_.shifted_reuse || index_.empty() || lost_[m]) return;
  PrefixIndex& index = *index_[m];
  const int64_t bt = index.block_tokens();
  const int64_t max_blocks = (static_cast<int64_t>(prompt.size()) - 1) / bt;
  const std::vector<int32_t> match = index.Match(prompt, max_blocks);
  if (static_cast<int64_t>(match.size()) >= max_blocks) return;
  auto& recipes = shifted_[m];
  // Recipes of blocks the registry forgot before they were restored.
  if (recipes.size() > 4096) {
    std::erase_if(recipes, [&](const auto& entry) { return index.Find(entry.first) < 0; });
  }
  if (shifted_failed_[m].size() > 4096) shifted_failed_[m].clear();
  const auto usable = [&](int32_t id) { return !recipes.contains(index.hash(id)); };
  int32_t prev = match.empty() ? -1 : match.back();
  ShiftedCursor cursor;
  if (prev >= 0) {
    auto it = recipes.find(index.hash(prev));
    if (it != recipes.end()) cursor = it->second.next;
  }
  for (int64_t b = static_cast<int64_t>(match.size()); b < max_blocks; ++b) {
    ShiftedCursor next;
    const std::optional<std::vector<ShiftedRun>> runs =
        FindShiftedBlock(index, prompt, b * bt, prev, cursor, usable, &next);
    if (!runs) return;
    const std::span<const int32_t> tokens =
        prompt.subspan(static_cast<size_t>(b * bt), static_cast<size_t>(bt));
    const uint64_t parent_hash = prev >= 0 ? index.hash(prev) : PrefixIndex::kSeed;
    const uint64_t hash = index.HashBlock(parent_hash, tokens);
    if (shifted_failed_[m].contains(hash)) return;
    ShiftedRecipe recipe{.next = next};
    for (const ShiftedRun& run : *runs) {
      int32_t depth = 0;
      for (int32_t id = run.block; id >= 0; id = index.parent(id)) ++depth;
      recipe.segments.push_back({.source_hash = index.hash(run.block),
                                 .source_index = depth - 1,
                                 .source_row = static_cast<uint16_t>(run.row),
                                 .rows = static_cast<uint16_t>(run.rows)});
    }
    const int32_t id = index.AddDemoted(hash, parent_hash, tokens);
    if (id < 0 || index.Find(hash) != id) return;  // taken, or trimmed at once
    recipes[hash] = std::move(recipe);
    prev = id;
    cursor = next;
  }
}

PrefixRestore Controller::MakeRestore(size_t m, int32_t id, int32_t parent, size_t k) {
  const PrefixIndex& index = *index_[m];
  PrefixRestore r{.block_hash = index.hash(id),
                  .parent_hash = k == 0 ? 0 : index.hash(parent),
                  .block_index = static_cast<int32_t>(k),
                  .memory_rank = static_cast<uint16_t>(m)};
  auto it = shifted_[m].find(r.block_hash);
  if (it != shifted_[m].end()) {
    r.segments = std::move(it->second.segments);
    shifted_[m].erase(it);
  }
  return r;
}

absl::Status Controller::Check(const GenerationRequest& request) const {
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    if (t < 0 || t >= spec_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", i, " is ", t,
                                                     ", outside the vocabulary [0, ", spec_.vocab_size, ")"));
    }
  }
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", request.max_tokens));
  }
  RETURN_IF_ERROR(ValidateSampling(request.sampling));
  if (request.top_logprobs < 0 || request.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs must be in [0, ", kMaxTopLogprobs, "], got ", request.top_logprobs));
  }
  const int64_t prompt_len = static_cast<int64_t>(request.prompt.size());
  if (request.max_tokens > spec_.max_position - prompt_len) {  // no overflow for any max_tokens
    return absl::InvalidArgumentError(absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (",
                                                   request.max_tokens, ") exceeds the model's context of ",
                                                   spec_.max_position, " tokens"));
  }
  const int64_t largest = LargestCapacity();
  if (ContextNeed(request) > largest) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", ContextNeed(request), " KV slots (prompt + max_tokens) but the largest ",
        live_ranks() < num_memory_ranks() ? "surviving " : "", "KV cache holds ", largest, " tokens",
        LostRanksNote(), "; raise kv.capacity_tokens or shorten the request"));
  }
  return absl::OkStatus();
}

std::string Controller::LostRanksNote() const {
  std::vector<int> lost;
  for (size_t m = 0; m < lost_.size(); ++m) {
    if (lost_[m]) lost.push_back(static_cast<int>(m));
  }
  return lost.empty() ? "" : absl::StrCat("; memory rank(s) ", absl::StrJoin(lost, ", "), " lost");
}

void Controller::FailUnplaceable(std::vector<std::pair<int64_t, GenerationResult>>* failed) {
  const int64_t largest = LargestCapacity();
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const int64_t need = ContextNeed(*it);
    if (need <= largest) {
      ++it;
      continue;
    }
    GenerationResult result = std::move(it->result);
    result.finish_reason = "error";
    result.error = absl::UnavailableError(absl::StrCat(
        "request needs ", need, " KV slots (prompt + max_tokens, less the tokens already generated) ",
        "but the largest surviving memory rank holds ", largest, " tokens", LostRanksNote()));
    failed->emplace_back(it->id, std::move(result));
    it = waiting_.erase(it);
  }
}

absl::StatusOr<int64_t> Controller::Submit(GenerationRequest request) {
  RETURN_IF_ERROR(Check(request));
  Live live;
  live.id = next_id_++;
  live.result.prompt_tokens = static_cast<int64_t>(request.prompt.size());
  live.request = std::move(request);
  waiting_.push_back(std::move(live));
  return waiting_.back().id;
}

void Controller::Admit() {
  std::vector<WaitingRequest> view;
  while (!waiting_.empty() && static_cast<int64_t>(running_.size()) < options_.max_batch_size) {
    view.clear();
    for (const Live& w : waiting_) {
      view.push_back({.id = w.id,
                      .prompt_tokens = static_cast<int64_t>(w.request.prompt.size()),
                      .context_tokens = ContextNeed(w)});
    }
    const size_t pick = policy_->NextToAdmit(view);
    TANDEM_CHECK(pick < waiting_.size());
    const std::vector<int32_t>& prompt = waiting_[pick].request.prompt;
    for (size_t m = 0; m < capacity_.size(); ++m) AddShiftedBlocks(m, prompt);
    // The prompt's block hashes (all ranks hash alike), for blocks that running requests are
    // computing: a rank where the prompt's leading blocks are registered or about to be is
    // preferred, so that requests arriving together with one prompt share it on one rank.
    std::vector<uint64_t> hashes;
    if (!index_.empty()) {
      const int64_t bt = options_.prefix_block_tokens;
      uint64_t h = PrefixIndex::kSeed;
      for (int64_t i = 0; (i + 1) * bt <= static_cast<int64_t>(prompt.size()) - 1; ++i) {
        h = index_[0]->HashBlock(
            h, std::span(prompt).subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt)));
        hashes.push_back(h);
      }
    }
    // Per rank: the registered prefix it would reuse, the KV it then needs, and what the rank can
    // give (free, plus unused registered blocks other than the reused ones, which eviction frees).
    int best = -1;
    std::vector<int32_t> best_match;
    int64_t best_need = 0, best_avail = 0;
    size_t best_shared = 0;
    for (int m = 0; m < num_memory_ranks(); ++m) {
      const size_t mi = static_cast<size_t>(m);
      std::vector<int32_t> match;
      int64_t avail = capacity_[mi] - reserved_[mi];
      if (!index_.empty()) {
        const PrefixIndex& index = *index_[mi];
        const int64_t bt = index.block_tokens();
        match = index.Match(prompt, (static_cast<int64_t>(prompt.size()) - 1) / bt);
        int64_t reused_unused = 0;
        for (int32_t id : match) reused_unused += index.resident(id) && index.users(id) == 0 ? bt : 0;
        avail += index.unused_tokens() - index.stats().tokens_held - reused_unused;
      }
      // Demoted blocks of the match (the resident ones are a prefix of it) come back into the pool:
      // they need room like the tokens the request computes.
      int64_t resident = 0;
      while (resident < static_cast<int64_t>(match.size()) &&
             index_[mi]->resident(match[static_cast<size_t>(resident)]))
        ++resident;
      const int64_t need = view[pick].context_tokens - resident * options_.prefix_block_tokens;
      if (need > avail) continue;
      size_t shared = match.size();
      if (!index_.empty()) {
        while (shared < hashes.size() && pending_[mi].contains(hashes[shared])) ++shared;
      }
      if (best < 0 || shared > best_shared ||
          (shared == best_shared && avail - need > best_avail - best_need)) {
        best = m;
        best_match = std::move(match);
        best_need = need;
        best_avail = avail;
        best_shared = shared;
      }
    }
    if (best < 0) break;  // waits for KV; no overtaking
    const size_t bi = static_cast<size_t>(best);
    auto live = std::make_unique<Live>(std::move(waiting_[pick]));
    waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(pick));
    live->memory_rank = best;
    live->reserve = best_need;
    if (!index_.empty()) {
      PrefixIndex& index = *index_[bi];
      // Demoted blocks are restored (in chain order, parents first); blocks another admission is
      // restoring are waited for too.
      for (size_t k = 0; k < best_match.size(); ++k) {
        const int32_t id = best_match[k];
        const uint64_t h = index.hash(id);
        if (!index.resident(id)) {
          index.MarkRestored(id);
          restoring_[bi][h] = id;
          restores_[bi].push_back(MakeRestore(bi, id, k == 0 ? -1 : best_match[k - 1], k));
          live->reserve -= index.block_tokens();  // held as a registered block from now on
        }
        if (restoring_[bi].contains(h)) live->restoring.push_back(h);
      }
      index.Acquire(best_match);
      NoteAttached(bi, best_match);
      const int64_t cached = static_cast<int64_t>(best_match.size()) * index.block_tokens();
      index.CountLookup(static_cast<int64_t>(live->request.prompt.size()), cached);
      best_need = live->reserve;
      const int64_t free = capacity_[bi] - reserved_[bi] - index.stats().tokens_held;
      if (free < best_need) {
        EvictForRoom(bi, best_need - free);
      }
      live->chain = std::move(best_match);
      live->prefilled = live->context = live->result.cached_tokens = cached;
      live->pending = PendingBlockHashes(*live, static_cast<int64_t>(live->request.prompt.size()));
      for (uint64_t h : live->pending) ++pending_[bi][h];
    }
    reserved_[bi] += best_need;
    running_.push_back(std::move(live));
  }
}

int64_t Controller::EvictForRoom(size_t m, int64_t need) {
  PrefixIndex& index = *index_[m];
  // The blocks the next waiting requests would reuse here are taken last (kv.eviction_lookahead).
  std::vector<int32_t> wanted;
  const size_t lookahead = std::min(waiting_.size(), static_cast<size_t>(options_.eviction_lookahead));
  for (size_t w = 0; w < lookahead; ++w) {
    const std::vector<int32_t>& p = waiting_[w].request.prompt;
    const std::vector<int32_t> match =
        index.Match(p, (static_cast<int64_t>(p.size()) - 1) / index.block_tokens());
    wanted.insert(wanted.end(), match.begin(), match.end());
  }
  const size_t before = evicted_[m].size();
  const int64_t freed =
      index.Evict(need, &evicted_[m], options_.tier_blocks > 0 ? &evicted_tokens_[m] : nullptr, wanted);
  CountEvictions(m, before);
  return freed;
}

void Controller::CountEvictions(size_t m, size_t from) {
  if (options_.tier_blocks == 0) return;
  const int64_t blocks = static_cast<int64_t>(evicted_[m].size() - from);
  stats_.demoted_blocks += blocks;
  stats_.demoted_tokens += blocks * options_.prefix_block_tokens;
  for (size_t i = from; i < evicted_[m].size(); ++i)
    stats_.prefetch_wasted_blocks += prefetched_[m].erase(evicted_[m][i]);
}

void Controller::NoteAttached(size_t m, std::span<const int32_t> ids) {
  if (prefetched_[m].empty()) return;
  const PrefixIndex& index = *index_[m];
  for (int32_t id : ids) stats_.prefetch_used_blocks += prefetched_[m].erase(index.hash(id));
}

void Controller::Prefetch(std::vector<uint64_t>* evictions) {
  if (index_.empty() || options_.tier_blocks == 0 || options_.prefetch_lookahead == 0 || waiting_.empty())
    return;
  bool demoted = false;
  for (size_t m = 0; m < index_.size(); ++m) demoted |= !lost_[m] && index_[m]->stats().demoted > 0;
  if (!demoted) return;
  const int64_t bt = options_.prefix_block_tokens;
  const size_t window = std::min(waiting_.size(), static_cast<size_t>(options_.prefetch_lookahead));
  for (size_t w = 0; w < window; ++w) {
    for (size_t m = 0; m < index_.size(); ++m) AddShiftedBlocks(m, waiting_[w].request.prompt);
  }
  // Per rank: the blocks that the window's requests match (resident or not), kept from eviction.
  std::vector<std::vector<int32_t>> keep(index_.size());
  for (size_t w = 0; w < window; ++w) {
    const std::vector<int32_t>& prompt = waiting_[w].request.prompt;
    for (size_t m = 0; m < index_.size(); ++m) {
      if (lost_[m]) continue;
      const std::vector<int32_t> match =
          index_[m]->Match(prompt, (static_cast<int64_t>(prompt.size()) - 1) / bt);
      keep[m].insert(keep[m].end(), match.begin(), match.end());
    }
  }
  for (size_t w = 0; w < window; ++w) {
    const std::vector<int32_t>& prompt = waiting_[w].request.prompt;
    // The rank admission will prefer: the longest match in any tier, then the most of it resident.
    int best = -1;
    std::vector<int32_t> best_match;
    size_t best_resident = 0;
    for (size_t m = 0; m < index_.size(); ++m) {
      if (lost_[m]) continue;
      const PrefixIndex& index = *index_[m];
      std::vector<int32_t> match = index.Match(prompt, (static_cast<int64_t>(prompt.size()) - 1) / bt);
      size_t resident = 0;
      while (resident < match.size() && index.resident(match[resident])) ++resident;
      if (match.size() > best_match.size() ||
          (match.size() == best_match.size() && resident > best_resident)) {
        best = static_cast<int>(m);
        best_match = std::move(match);
        best_resident = resident;
      }
    }
    if (best < 0 || best_resident == best_match.size()) continue;  // nothing demoted
    const size_t bi = static_cast<size_t>(best);
    PrefixIndex& index = *index_[bi];
    const int64_t want = static_cast<int64_t>(best_match.size() - best_resident) * bt;
    int64_t room = capacity_[bi] - reserved_[bi] - index.stats().tokens_held;
    if (room < want) {
      const size_t before = evicted_[bi].size();
      room +=
          index.EvictExcept(want - std::max<int64_t>(room, 0), keep[bi], &evicted_[bi], &evicted_tokens_[bi]);
      evictions->insert(evictions->end(), evicted_[bi].begin() + static_cast<std::ptrdiff_t>(before),
                        evicted_[bi].end());
      CountEvictions(bi, before);
      // Eviction may have forgotten demoted leaves beyond the tiers' size: match again.
      best_match = index.Match(prompt, (static_cast<int64_t>(prompt.size()) - 1) / bt);
    }
    for (size_t k = best_resident; k < best_match.size() && room >= bt; ++k) {
      const int32_t id = best_match[k];
      TANDEM_CHECK(!index.resident(id));
      const uint64_t h = index.hash(id);
      index.MarkRestored(id);
      restoring_[bi][h] = id;
      prefetching_[bi].insert(h);
      restores_[bi].push_back(MakeRestore(bi, id, k == 0 ? -1 : best_match[k - 1], k));
      room -= bt;
    }
  }
}

void Controller::DropPending(Live& live) {
  auto& pending = pending_[static_cast<size_t>(live.memory_rank)];
  for (uint64_t h : live.pending) {
    auto it = pending.find(h);
    if (--it->second == 0) pending.erase(it);
  }
  live.pending.clear();
}

void Controller::Retire(Live& live, std::vector<std::vector<uint64_t>>* released) {
  const size_t m = static_cast<size_t>(live.memory_rank);
  reserved_[m] -= live.reserve;
  if (!index_.empty()) {
    index_[m]->Release(live.chain);
    DropPending(live);
  }
  (*released)[m].push_back(static_cast<uint64_t>(live.id));
}

void Controller::Rematch(Live& live) {
  PrefixIndex& index = *index_[static_cast<size_t>(live.memory_rank)];
  const int64_t bt = index.block_tokens();
  std::vector<int32_t> match =
      index.Match(live.request.prompt, (static_cast<int64_t>(live.request.prompt.size()) - 1) / bt);
  // Only blocks whose KV is in the pool now: not demoted, not on their way back.
  const auto& restoring = restoring_[static_cast<size_t>(live.memory_rank)];
  for (size_t k = 0; k < match.size(); ++k) {
    if (!index.resident(match[k]) || restoring.contains(index.hash(match[k]))) {
      match.resize(k);
      break;
    }
  }
  // Blocks in use are never evicted, so the blocks attached at admission are a prefix of `match`.
  if (match.size() <= live.chain.size()) return;
  const std::span<const int32_t> extra = std::span(match).subspan(live.chain.size());
  index.Acquire(extra);
  NoteAttached(static_cast<size_t>(live.memory_rank), extra);
  const int64_t tokens = static_cast<int64_t>(extra.size()) * bt;
  index.CountLookup(0, tokens);
  live.reserve -= tokens;
  reserved_[static_cast<size_t>(live.memory_rank)] -= tokens;
  live.chain = std::move(match);
  live.prefilled = live.context = live.result.cached_tokens = static_cast<int64_t>(live.chain.size()) * bt;
}

std::vector<uint64_t> Controller::PendingBlockHashes(const Live& live, int64_t end_tokens) const {
  const PrefixIndex& index = *index_[static_cast<size_t>(live.memory_rank)];
  const int64_t bt = index.block_tokens();
  std::vector<uint64_t> hashes;
  uint64_t parent = live.chain.empty() ? PrefixIndex::kSeed : index.hash(live.chain.back());
  for (int64_t i = static_cast<int64_t>(live.chain.size()); (i + 1) * bt <= end_tokens; ++i) {
    parent = index.HashBlock(
        parent, std::span(live.request.prompt).subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt)));
    hashes.push_back(parent);
  }
  return hashes;
}

void Controller::Publish(Live& live, int64_t rows, StepPlan* plan) {
  PrefixIndex& index = *index_[static_cast<size_t>(live.memory_rank)];
  const int64_t prompt_len = static_cast<int64_t>(live.request.prompt.size());
  if (live.prefilled < prompt_len && live.prefilled + rows == prompt_len) DropPending(live);  // prefill ends
  const int64_t end = live.context + rows;  // positions whose KV exists once this step is done
  const int64_t blocks = end / index.block_tokens();
  if (blocks <= static_cast<int64_t>(live.chain.size())) return;
  // The tokens at those positions: the prompt, then the generated ones (a decode row's input is
  // the last token sampled), so a follow-up turn that repeats this conversation reuses its KV.
  std::vector<int32_t> history;
  std::span<const int32_t> tokens(live.request.prompt);
  if (end > prompt_len) {
    history = live.request.prompt;
    history.insert(history.end(), live.result.token_ids.begin() + live.resumed, live.result.token_ids.end());
    tokens = history;
  }
  TANDEM_CHECK(static_cast<int64_t>(tokens.size()) >= end);
  for (int64_t i = static_cast<int64_t>(live.chain.size()); i < blocks; ++i) {
    const int32_t parent = live.chain.empty() ? -1 : live.chain.back();
    const int32_t id = index.Insert(tokens, i, parent);
    // Registered meanwhile by a request that computed the same tokens (or a hash collision): the
    // rest of this request's KV stays private, so every registered chain is one request's slots.
    if (id < 0) break;
    // A shifted block registered for a waiting request and computed here first: its KV is this
    // request's now (exact), so its recipe is not needed.
    if (!shifted_.empty()) shifted_[static_cast<size_t>(live.memory_rank)].erase(index.hash(id));
    index.Acquire({&id, 1});
    live.chain.push_back(id);
    live.reserve -= index.block_tokens();
    reserved_[static_cast<size_t>(live.memory_rank)] -= index.block_tokens();
    plan->publishes.push_back({.request_id = static_cast<uint64_t>(live.id),
                               .block_hash = index.hash(id),
                               .parent_hash = parent < 0 ? 0 : index.hash(parent),
                               .block_index = static_cast<int32_t>(i),
                               .memory_rank = static_cast<uint16_t>(live.memory_rank)});
  }
}

void Controller::Group(int m, const std::vector<std::pair<Live*, int64_t>>& chosen, StepPlan* plan) const {
  const PrefixIndex& index = *index_[static_cast<size_t>(m)];
  std::unordered_map<uint64_t, int32_t> deepest;  // request id -> its deepest group
  // `members` share chain[0, depth) and the block chain[depth]; the group covers the longest run
  // they all share, and subsets sharing more become nested groups.
  std::function<void(const std::vector<const Live*>&, size_t, int32_t)> build =
      [&](const std::vector<const Live*>& members, size_t depth, int32_t parent) {
        size_t d = depth;
        for (;; ++d) {
          const Live* first = members.front();
          if (first->chain.size() <= d) break;
          const bool all = std::all_of(members.begin(), members.end(), [&](const Live* l) {
            return l->chain.size() > d && l->chain[d] == first->chain[d];
          });
          if (!all) break;
        }
        const int32_t g = static_cast<int32_t>(plan->groups.size());
        plan->groups.push_back({.block_hash = index.hash(members.front()->chain[d - 1]),
                                .prefix_tokens = static_cast<int32_t>(d * index.block_tokens()),
                                .parent = parent,
                                .memory_rank = static_cast<uint16_t>(m)});
        std::vector<std::pair<int32_t, std::vector<const Live*>>> parts;  // by next block, in order
        for (const Live* l : members) {
          deepest[static_cast<uint64_t>(l->id)] = g;
          if (l->chain.size() == d) continue;
          auto it =
              std::find_if(parts.begin(), parts.end(), [&](const auto& p) { return p.first == l->chain[d]; });
          if (it == parts.end()) {
            parts.push_back({l->chain[d], {l}});
          } else {
            it->second.push_back(l);
          }
        }
        for (const auto& [block, part] : parts) {
          if (part.size() >= 2) build(part, d, g);
        }
      };
  std::vector<std::pair<int32_t, std::vector<const Live*>>> roots;
  for (const auto& [live, n] : chosen) {
    if (live->memory_rank != m || live->chain.empty()) continue;
    auto it =
        std::find_if(roots.begin(), roots.end(), [&](const auto& p) { return p.first == live->chain[0]; });
    if (it == roots.end()) {
      roots.push_back({live->chain[0], {live}});
    } else {
      it->second.push_back(live);
    }
  }
  for (const auto& [block, members] : roots) {
    if (members.size() >= 2) build(members, 0, -1);
  }
  for (StepRequest& r : plan->requests) {
    auto it = deepest.find(r.request_id);
    if (r.memory_rank == m && it != deepest.end()) r.prefix_group = it->second;
  }
}

void Controller::Schedule(PlannedStep* step) {
  step->plan = StepPlan{};
  step->rows = StepTokens{};
  step->prefetch_evictions.clear();
  step->rank_rows.assign(capacity_.size() + 1, 0);
  Admit();
  Prefetch(&step->prefetch_evictions);
  // Rows per request: one for each decoding request, then prompt chunks in admission order.
  std::vector<std::pair<Live*, int64_t>> chosen;
  int64_t budget = options_.max_tokens_per_step;
  for (auto& live : running_) {
    if (live->prefilled == static_cast<int64_t>(live->request.prompt.size())) {
      chosen.emplace_back(live.get(), 1);
      --budget;
    }
  }
  // Blocks that this step's prompt chunks complete, by rank: a request that has not started and
  // whose next block is among them waits one step, then reuses it instead of computing it again
  // (many requests arriving together with one system prompt prefill it once).
  std::vector<std::unordered_set<uint64_t>> inflight(index_.size());
  for (auto& live : running_) {
    if (!live->restoring.empty()) continue;  // its blocks come back with this step's plan
    if (!index_.empty() && !live->started) {
      Rematch(*live);
      const std::vector<uint64_t> next = PendingBlockHashes(*live, live->context + index_[0]->block_tokens());
      if (!next.empty() && inflight[static_cast<size_t>(live->memory_rank)].contains(next[0])) continue;
    }
    const int64_t left = static_cast<int64_t>(live->request.prompt.size()) - live->prefilled;
    if (left > 0 && budget > 0) {
      const int64_t n = std::min(left, budget);
      chosen.emplace_back(live.get(), n);
      budget -= n;
      if (!index_.empty()) {
        for (uint64_t h : PendingBlockHashes(*live, live->prefilled + n))
          inflight[static_cast<size_t>(live->memory_rank)].insert(h);
      }
    }
  }
  bool restoring = false;
  for (const auto& r : restores_) restoring |= !r.empty();
  if (chosen.empty() && !restoring) return;
  // Plan order: by memory rank, single-row requests first within a rank (stable otherwise).
  std::stable_sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) {
    if (a.first->memory_rank != b.first->memory_rank) return a.first->memory_rank < b.first->memory_rank;
    return (a.second == 1) > (b.second == 1);
  });
  step->plan.step_id = next_step_++;
  StepTokens& rows = step->rows;
  for (const auto& [live, n] : chosen) {
    const int64_t prompt_len = static_cast<int64_t>(live->request.prompt.size());
    const bool prefill = live->prefilled < prompt_len;
    const int64_t start = live->context;
    for (int64_t j = 0; j < n; ++j) {
      rows.tokens.push_back(prefill ? live->request.prompt[static_cast<size_t>(live->prefilled + j)]
                                    : live->result.token_ids.back());
      rows.positions.push_back(static_cast<int32_t>(start + j));
    }
    const bool sample = !prefill || live->prefilled + n == prompt_len;
    StepRequest r;
    r.request_id = static_cast<uint64_t>(live->id);
    r.memory_rank = static_cast<uint16_t>(live->memory_rank);
    r.position = static_cast<int32_t>(start);
    r.q_len = static_cast<int32_t>(n);
    r.kv_len = static_cast<int32_t>(start + n);
    r.sample = sample;
    r.temperature = live->request.sampling.temperature;
    r.top_k = live->request.sampling.top_k;
    r.top_p = live->request.sampling.top_p;
    r.seed = live->request.sampling.seed;
    r.counter = live->result.token_ids.size();
    r.top_logprobs = static_cast<uint8_t>(live->request.top_logprobs);
    if (!live->started && start > 0)
      r.attach_hash = index_[static_cast<size_t>(live->memory_rank)]->hash(live->chain.back());
    if (!live->started) stats_.cached_tokens += live->result.cached_tokens;  // reused from now on
    live->started = true;
    step->plan.requests.push_back(r);
    step->rank_rows[static_cast<size_t>(live->memory_rank) + 1] += static_cast<int32_t>(n);
    if (sample) {
      rows.sample_rows.push_back(static_cast<int32_t>(rows.tokens.size()) - 1);
      rows.sampling.push_back(live->request.sampling);
      rows.counters.push_back(live->result.token_ids.size());
      if (live->request.top_logprobs > 0 || !rows.top_logprobs.empty()) {
        rows.top_logprobs.resize(rows.sample_rows.size() - 1);  // 0 for the rows before the first asking
        rows.top_logprobs.push_back(live->request.top_logprobs);
      }
    }
  }
  for (size_t m = 1; m < step->rank_rows.size(); ++m) step->rank_rows[m] += step->rank_rows[m - 1];
  if (index_.empty()) return;
  for (size_t m = 0; m < restores_.size(); ++m) {
    step->plan.restores.insert(step->plan.restores.end(), restores_[m].begin(), restores_[m].end());
    restores_[m].clear();
  }
  // Prefix work of the step, in the order a memory rank applies it: evictions (made by admissions
  // since the last plan), then the groups over blocks registered before the step, then the blocks
  // that this step's rows complete (prompt chunks and decode rows).
  for (size_t m = 0; m < evicted_.size(); ++m) {
    const bool tokens = options_.tier_blocks > 0 && options_.eviction_tokens;
    for (size_t i = 0; i < evicted_[m].size(); ++i) {
      step->plan.evictions.push_back({.block_hash = evicted_[m][i], .memory_rank = static_cast<uint16_t>(m)});
      if (tokens && i < evicted_tokens_[m].size())
        step->plan.evictions.back().tokens = std::move(evicted_tokens_[m][i]);
    }
    evicted_[m].clear();
    evicted_tokens_[m].clear();
  }
  if (options_.prefix_sharing != PrefixSharing::kOff) {
    for (int m = 0; m < num_memory_ranks(); ++m) Group(m, chosen, &step->plan);
    for (const StepRequest& r : step->plan.requests) stats_.grouped_rows += r.prefix_group >= 0 ? r.q_len : 0;
  }
  for (const auto& [live, n] : chosen) {
    Publish(*live, n, &step->plan);
  }
  PlanNextUses(&step->plan);
}

const std::vector<uint64_t>& Controller::PromptHashes(Live& live) const {
  const std::vector<int32_t>& prompt = live.request.prompt;
  if (live.hashed_prompt_tokens == static_cast<int64_t>(prompt.size())) return live.prompt_hashes;
  const int64_t bt = options_.prefix_block_tokens;
  live.prompt_hashes.clear();
  uint64_t h = PrefixIndex::kSeed;
  for (int64_t i = 0; (i + 1) * bt <= static_cast<int64_t>(prompt.size()) - 1; ++i) {
    h = index_[0]->HashBlock(h,
                             std::span(prompt).subspan(static_cast<size_t>(i * bt), static_cast<size_t>(bt)));
    live.prompt_hashes.push_back(h);
  }
  live.hashed_prompt_tokens = static_cast<int64_t>(prompt.size());
  return live.prompt_hashes;
}

void Controller::PlanNextUses(StepPlan* plan) {
  if (index_.empty() || options_.tier_blocks == 0 || !options_.tier_next_use || waiting_.empty()) return;
  std::vector<size_t> ranks;  // those with demoted blocks
  for (size_t m = 0; m < index_.size(); ++m) {
    if (!lost_[m] && index_[m]->stats().demoted > 0) ranks.push_back(m);
  }
  if (ranks.empty()) return;
  const size_t window = std::min(waiting_.size(), static_cast<size_t>(options_.eviction_lookahead));
  std::vector<std::unordered_set<uint64_t>> listed(index_.size());
  for (size_t w = 0; w < window; ++w) {
    const std::vector<uint64_t>& hashes = PromptHashes(waiting_[w]);
    for (size_t m : ranks) {
      const PrefixIndex& index = *index_[m];
      int32_t parent = -1;
      // The registered run of the prompt's blocks, as Match finds it (a hash names one block; its
      // parent link confirms the chain).
      for (uint64_t h : hashes) {
        const int32_t id = index.Find(h);
        if (id < 0 || index.parent(id) != parent) break;
        parent = id;
        if (index.resident(id) || !listed[m].insert(h).second) continue;
        if (plan->next_uses.size() == kMaxPrefixNextUses) return;
        plan->next_uses.push_back(
            {.block_hash = h, .next_use = static_cast<int32_t>(w), .memory_rank = static_cast<uint16_t>(m)});
      }
    }
  }
}

int64_t Controller::AddTierBlocks(int m, std::span<const TierBlock> blocks) {
  if (index_.empty() || options_.tier_blocks == 0 || lost_[static_cast<size_t>(m)]) return 0;
  PrefixIndex& index = *index_[static_cast<size_t>(m)];
  int64_t added = 0;
  for (const TierBlock& b : blocks) {
    const uint64_t parent = b.parent_hash == 0 ? PrefixIndex::kSeed : b.parent_hash;
    added += index.AddDemoted(b.hash, parent, b.tokens) >= 0;
  }
  stats_.tier_blocks_added += added;
  return added;
}

void Controller::RestoreResult(const StepPlan& plan, int m, std::span<const uint64_t> failed) {
  const size_t mi = static_cast<size_t>(m);
  if (lost_[mi]) return;  // LoseRank forgot its restores and requeued their requests
  PrefixIndex& index = *index_[mi];
  const int64_t bt = index.block_tokens();
  const std::unordered_set<uint64_t> bad(failed.begin(), failed.end());
  std::vector<int32_t> forget;
  for (const PrefixRestore& r : plan.restores) {
    if (r.memory_rank != m) continue;
    auto it = restoring_[mi].find(r.block_hash);
    if (it == restoring_[mi].end()) continue;
    const bool prefetch = prefetching_[mi].erase(r.block_hash) > 0;
    if (bad.contains(r.block_hash)) {
      forget.push_back(it->second);
      stats_.restore_failed_tokens += bt;
      ++stats_.restore_failed_blocks;
      if (!r.segments.empty()) {
        ++stats_.shifted_failed_blocks;
        shifted_failed_[mi].insert(r.block_hash);
      }
    } else {
      stats_.restored_tokens += bt;
      ++stats_.restored_blocks;
      if (!r.segments.empty()) {
        ++stats_.shifted_blocks;
      }
      if (prefetch) {
        prefetched_[mi].insert(r.block_hash);
        stats_.prefetched_tokens += bt;
        ++stats_.prefetched_blocks;
      }
    }
    restoring_[mi].erase(it);
  }
  // Requests that waited: keep the chain up to the first block that failed, compute the rest.
  std::vector<Live*> cut;  // admission order
  for (auto& live : running_) {
    if (live->memory_rank != m || live->restoring.empty()) continue;
    std::erase_if(live->restoring, [&](uint64_t h) { return !restoring_[mi].contains(h); });
    size_t keep = 0;
    while (keep < live->chain.size() && !bad.contains(index.hash(live->chain[keep]))) ++keep;
    if (keep == live->chain.size()) continue;
    const std::span<const int32_t> lost = std::span(live->chain).subspan(keep);
    index.Release(lost);
    const int64_t tokens = static_cast<int64_t>(lost.size()) * bt;
    live->chain.resize(keep);
    live->reserve += tokens;
    reserved_[mi] += tokens;
    DropPending(*live);
    live->prefilled = live->context = live->result.cached_tokens = static_cast<int64_t>(keep) * bt;
    live->pending = PendingBlockHashes(*live, static_cast<int64_t>(live->request.prompt.size()));
    for (uint64_t h : live->pending) ++pending_[mi][h];
    cut.push_back(live.get());
  }
  // Their blocks (and everything below them) are gone from the rank's tiers as far as we know.
  for (int32_t id : forget) {
    const uint64_t h = index.hash(id);
    if (index.Find(h) == id) index.Forget(id);
  }
  // Requests that shared a failed block now each compute it, and the rank may lack room for the
  // copies: the most recently admitted of them go back to the front of the queue (none has
  // started) until the rest fit; admission places them again at the next Schedule, evicting
  // unused blocks as it needs.
  int64_t over = reserved_[mi] + index.stats().tokens_held - capacity_[mi];
  std::vector<Live> back;
  while (over > 0) {
    TANDEM_CHECK_MSG(!cut.empty(), "memory rank ", m, ": ", over,
                     " KV slots over capacity after failed restores");
    Live* live = cut.back();
    cut.pop_back();
    TANDEM_CHECK(!live->started);
    reserved_[mi] -= live->reserve;
    over -= live->reserve;
    index.Release(live->chain);
    DropPending(*live);
    auto it = std::find_if(running_.begin(), running_.end(), [&](const auto& r) { return r.get() == live; });
    Live requeued = std::move(**it);
    running_.erase(it);
    requeued.memory_rank = -1;
    requeued.prefilled = requeued.context = requeued.reserve = requeued.result.cached_tokens = 0;
    requeued.chain.clear();
    requeued.restoring.clear();
    back.push_back(std::move(requeued));
  }
  for (Live& live : back) waiting_.push_front(std::move(live));  // newest first: admission order
}

absl::Status Controller::Complete(const PlannedStep& step, const SampledTokens& sampled,
                                  std::vector<std::pair<int64_t, GenerationResult>>* finished,
                                  std::vector<std::vector<uint64_t>>* released) {
  released->assign(capacity_.size(), {});
  if (step.empty()) return absl::OkStatus();
  const std::span<const int32_t> tokens = sampled.tokens;
  if (tokens.size() != step.rows.sample_rows.size() || sampled.logprobs.size() != tokens.size() ||
      !(sampled.top.empty() || sampled.top.size() == tokens.size())) {
    return absl::InternalError(absl::StrCat("step ", step.plan.step_id, ": ", tokens.size(), " tokens, ",
                                            sampled.logprobs.size(), " log-probabilities and ",
                                            sampled.top.size(), " alternative lists for ",
                                            step.rows.sample_rows.size(), " sample rows"));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t want =
        static_cast<size_t>(std::min<int64_t>(step.rows.top_logprobs_of(i), spec_.vocab_size));
    if (sampled.top_of(i).size() != want) {
      return absl::InternalError(absl::StrCat("step ", step.plan.step_id, ": sample row ", i, " has ",
                                              sampled.top_of(i).size(), " top log-probabilities, asked for ",
                                              want));
    }
  }
  // Index the running requests by id (the plan names them).
  std::unordered_map<int64_t, Live*> by_id;
  for (auto& live : running_) by_id[live->id] = live.get();
  size_t next_token = 0;
  for (const StepRequest& r : step.plan.requests) {
    auto it = by_id.find(static_cast<int64_t>(r.request_id));
    if (it == by_id.end()) {  // cancelled, or its memory rank lost, while the step ran
      next_token += r.sample ? 1 : 0;
      continue;
    }
    Live& live = *it->second;
    const int64_t prompt_len = static_cast<int64_t>(live.request.prompt.size());
    if (live.prefilled < prompt_len) {
      live.prefilled += r.q_len;
      stats_.prefill_tokens += r.q_len;
    }
    live.context += r.q_len;
    if (!r.sample) continue;
    const int32_t token = tokens[next_token];
    live.result.token_ids.push_back(token);
    live.result.logprobs.push_back(sampled.logprobs[next_token]);
    if (live.request.top_logprobs > 0) {
      const std::span<const TopLogprob> top = sampled.top_of(next_token);
      live.result.top_logprobs.emplace_back(top.begin(), top.end());
    }
    ++next_token;
    ++stats_.decode_tokens;
    const bool eos =
        !live.request.ignore_eos &&
        std::find(spec_.eos_token_ids.begin(), spec_.eos_token_ids.end(), token) != spec_.eos_token_ids.end();
    if (eos) {
      live.result.finish_reason = "stop";
    } else if (static_cast<int64_t>(live.result.token_ids.size()) == live.request.max_tokens) {
      live.result.finish_reason = "length";
    }
  }
  for (auto it = running_.begin(); it != running_.end();) {
    Live& live = **it;
    if (live.result.finish_reason.empty()) {
      ++it;
      continue;
    }
    Retire(live, released);
    finished->emplace_back(live.id, std::move(live.result));
    it = running_.erase(it);
  }
  ++stats_.steps;
  return absl::OkStatus();
}

absl::Status Controller::Cancel(int64_t id, GenerationResult* result,
                                std::vector<std::vector<uint64_t>>* released) {
  released->assign(capacity_.size(), {});
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
    if (it->id != id) continue;
    *result = std::move(it->result);
    result->finish_reason = "cancelled";
    waiting_.erase(it);
    return absl::OkStatus();
  }
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    Live& live = **it;
    if (live.id != id) continue;
    Retire(live, released);
    *result = std::move(live.result);
    result->finish_reason = "cancelled";
    if (!live.started) result->cached_tokens = 0;  // it never ran: nothing was reused
    running_.erase(it);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("no live request with id ", id));
}

std::vector<int64_t> Controller::LoseRank(int m) {
  const size_t mi = static_cast<size_t>(m);
  std::vector<int64_t> requeued;
  if (lost_[mi]) return requeued;
  lost_[mi] = true;
  // Its KV tiers went with it: every block the registry knew there, resident or demoted, is
  // forgotten, and restores not yet sent or not yet answered are dropped (their requests are
  // requeued below; no restore reply of the rank is awaited any more).
  ResetRank(mi, 0);
  std::vector<Live> back;
  for (auto it = running_.begin(); it != running_.end();) {
    if ((*it)->memory_rank != m) {
      ++it;
      continue;
    }
    Live live = std::move(**it);
    it = running_.erase(it);
    // Its KV is gone: the prompt and the tokens generated so far are prefilled again (the last
    // one's logits give the next token, as a decode step of it would have).
    live.request.prompt.insert(live.request.prompt.end(), live.result.token_ids.begin() + live.resumed,
                               live.result.token_ids.end());
    live.resumed = static_cast<int64_t>(live.result.token_ids.size());
    live.memory_rank = -1;
    live.prefilled = live.context = live.reserve = 0;
    live.started = false;
    live.chain.clear();
    live.pending.clear();
    live.restoring.clear();
    requeued.push_back(live.id);
    back.push_back(std::move(live));
  }
  // Ahead of every waiting request (they arrived earlier), in admission order.
  for (auto it = back.rbegin(); it != back.rend(); ++it) waiting_.push_front(std::move(*it));
  return requeued;
}

absl::Status Controller::RejoinRank(int m, int64_t capacity) {
  if (m < 0 || m >= num_memory_ranks()) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory rank ", m, " rejoins, but the deployment has ", num_memory_ranks()));
  }
  const size_t mi = static_cast<size_t>(m);
  if (!lost_[mi])
    return absl::InvalidArgumentError(absl::StrCat("memory rank ", m, " rejoins but was not lost"));
  if (capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory rank ", m, " rejoins with a KV capacity of ", capacity, " tokens"));
  }
  // LoseRank emptied its state (no request is placed on it, nothing is pending or restoring); the
  // registry starts again, as the new process's pool does.
  lost_[mi] = false;
  ResetRank(mi, capacity);
  return absl::OkStatus();
}

void Controller::ResetRank(size_t m, int64_t capacity) {
  capacity_[m] = capacity;
  reserved_[m] = 0;
  evicted_[m].clear();
  evicted_tokens_[m].clear();
  pending_[m].clear();
  restores_[m].clear();
  restoring_[m].clear();
  prefetching_[m].clear();
  prefetched_[m].clear();
  shifted_[m].clear();
  shifted_failed_[m].clear();
  if (!index_.empty()) index_[m] = MakeIndex();
}

const GenerationResult* Controller::Progress(int64_t id) const {
  for (const Live& w : waiting_)
    if (w.id == id) return &w.result;
  for (const auto& r : running_)
    if (r->id == id) return &r->result;
  return nullptr;
}

std::optional<std::vector<int32_t>> Controller::History(int64_t id) const {
  auto history = [](const Live& l) {
    std::vector<int32_t> h = l.request.prompt;
    h.insert(h.end(), l.result.token_ids.begin() + l.resumed, l.result.token_ids.end());
    return h;
  };
  for (const Live& w : waiting_)
    if (w.id == id) return history(w);
  for (const auto& r : running_)
    if (r->id == id) return history(*r);
  return std::nullopt;
}

}  // namespace tandem
