// The controller (docs/architecture.md, "Processes"): request queue, continuous batching, placement of each
// request's KV on a memory rank, and the token history of every live request. It plans steps and
// consumes their sampled tokens; it runs nothing itself. The colocated engine drives it with one
// "memory rank" (its own KV pool); compute rank 0 drives it with the deployment's memory ranks.
//
// Scheduling, per step:
//   1. admission: the policy picks the next waiting request (FIFO: the oldest); it is placed on
//      a memory rank that can hold its whole context (prompt + max_tokens, less the prompt blocks
//      that rank already has registered, evicting unused registered blocks if needed): the one
//      with the longest prefix of its prompt registered or being computed by a running request,
//      then the one with the most KV not yet promised. If no rank can, admission stops for this step (FIFO
//      does not let later requests overtake) and the request waits; nothing is dropped. Because the whole
//      context is reserved, a running request never waits for KV and is never preempted. Admission also stops
//      at scheduler.max_batch_size running requests. A request reuses the registered blocks' KV (attach) and
//      starts its prefill after them; at least one prompt token is always prefilled, since its logits give
//      the first token.
//   2. every running request that has finished its prompt gets one decode row;
//   3. the rest of scheduler.max_tokens_per_step goes to prompt chunks (chunked prefill) in
//      admission order, piggybacked on the decode rows.
// The plan lists requests grouped by memory rank (rank 0 first) and, within a rank, every
// single-row request before the multi-row ones; rows follow the same order, so each memory
// rank's rows are one contiguous range.
//
// Prefix registry (options.prefix_block_tokens > 0; compute_node/prefix_index.h): as a request's
// prompt chunks and decode steps complete full blocks (prompt, then generated tokens), they are
// registered on its rank (publish) and stay after it ends, until admission needs their KV (LRU
// eviction): a later request that starts with them, such as the next turn of a conversation,
// reuses their KV. A request matches the registry when admitted
// and again just before its first chunk; if its next block is being computed in this step by
// another request of its rank, it waits one step and then reuses it. With prefix_sharing on or auto,
// the requests of a step that use the same registered blocks form prefix groups (nested where
// they share different depths), which let attention read those blocks once per step.
//
// KV tiers (options.tier_blocks > 0; docs/architecture.md, "KV cache on a memory rank"): eviction
// demotes blocks (the memory rank saves them to its host and disk tiers) and the registry keeps
// them, not resident. A request admitted with demoted blocks in its match is placed as if they
// were registered (placement prefers the rank that holds its prefix in any tier) and room is made
// for them in the pool; the plan asks the rank to restore them (StepPlan::restores) and the
// request waits until RestoreResult reports the outcome for that plan (the engine calls it before
// the next Schedule). Blocks that failed (no good copy left) are forgotten and the requests that
// waited for them compute those tokens instead: a lost block costs time, never tokens. A rank whose
// tiers already hold blocks when it starts (kv.tiers.persist) offers them with AddTierBlocks; they
// are registered demoted, so that a prompt starting with them restores them.
//
// Prefetch (options.prefetch_lookahead > 0, with tiers): after a step's admissions, each of the
// first prefetch_lookahead waiting requests, in queue order, whose prefix match (on the rank with
// the longest one, where admission will prefer to place it) holds demoted blocks gets them
// restored in the same plan (StepPlan::restores, parents first), as far as the rank has room: its
// free slots, then resident blocks that no running request uses and that no request of the
// look-ahead window matches (least recently used first; they are demoted). Blocks a running or
// a waiting request of the window needs are never evicted for a prefetch, and no slot promised
// to a running request is taken, so a prefetch never delays an admission: a prefetched block is
// an unused registered block until its request is admitted and attaches it (prefetch_used_blocks),
// and admission may still evict it when it needs the room (prefetch_wasted_blocks; it is taken
// after every block that no waiting request of kv.eviction_lookahead wants).
//
// Next-use eviction in the tiers (options.tier_next_use, with tiers and eviction_lookahead > 0):
// every plan lists, per rank, the demoted blocks that the first eviction_lookahead waiting requests
// match there (resident ones need no tier copy), each with the queue position of the first request
// that does (StepPlan::next_uses, at most kMaxPrefixNextUses: the nearest uses first; the rest
// count as unwanted). The rank's tiers evict the blocks nobody in that window wants first, then the
// farthest use (memory_node/tier_eviction_order.h). A request's prompt block hashes are computed once
// (Live::prompt_hashes); each plan then costs registry look-ups only, and nothing while no rank
// holds demoted blocks.
//
// Shifted reuse (options.shifted_reuse: kv.store_pre_rope, with tiers; compute_node/shifted_match.h):
// before a waiting request is placed or prefetched, the prompt blocks after its chained match on a
// rank that shifted runs of that rank's registered blocks can give are registered there, demoted,
// each with its recipe (the runs). Match then covers them, and their restores (admission or
// prefetch) carry the recipe (PrefixRestore::segments): the rank assembles the block from those rows
// and turns the keys to their new positions. A block whose KV does not exist yet (a recipe not yet
// restored) is never a source. A shifted restore that fails is forgotten like any other, and its
// hash is not synthesized again (the rank could not find a source).
//
// Stop conditions: an EOS token (unless ignore_eos), max_tokens, or Cancel(). A finished
// request's KV is released on its rank (Complete()/Cancel() report which ids to release).
//
// Thread safety: not thread-safe; one thread drives a controller.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "common/wire.h"
#include "compute_node/compute_backend.h"
#include "compute_node/prefix_index.h"
#include "compute_node/shifted_match.h"
#include "kernels/cpu/ops.h"

namespace tandem {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids, at least one
  int64_t max_tokens = 16;      // generated tokens at most, >= 1
  kernels::cpu::SamplingParams sampling;
  bool ignore_eos = false;  // keep going past EOS (benchmarks)
  // Report each generated token's top_logprobs most probable alternatives, in [0, kMaxTopLogprobs]
  // (common/top_logprobs.h); 0 costs nothing.
  int32_t top_logprobs = 0;
};

struct GenerationResult {
  std::vector<int32_t> token_ids;  // generated tokens (EOS included when it stopped there)
  std::vector<float> logprobs;     // natural log-probability of each generated token
  // With GenerationRequest::top_logprobs > 0: per generated token, its alternatives (most probable
  // first); else empty.
  std::vector<std::vector<TopLogprob>> top_logprobs;
  // "stop" (EOS), "length" (max_tokens), "cancelled", or "error" (see `error`).
  std::string finish_reason;
  // Not OK when the request ended without completing (finish_reason "error"): after a memory rank
  // was lost, its context (prompt + max_tokens) fits no surviving rank (Unavailable, naming the
  // need and the largest surviving rank). The tokens generated before are kept.
  absl::Status error;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // prompt tokens whose KV was reused from the prefix registry
};

struct ControllerOptions {
  int64_t max_batch_size = 64;         // running requests at most (>= 1)
  int64_t max_tokens_per_step = 2048;  // rows per step at most (>= max_batch_size)
  // Prefix registry (kv.prefix_cache, kv.prefix_block_tokens): 0 turns it off.
  int64_t prefix_block_tokens = 0;
  // kv.prefix_sharing: off puts no prefix groups in the plans (the memory rank decides auto/on).
  PrefixSharing prefix_sharing = PrefixSharing::kOff;
  // KV tiers: demoted blocks the registry keeps per rank (kv.tiers.*); 0: no tiers, eviction forgets.
  int64_t tier_blocks = 0;
  // kv.eviction_lookahead: eviction takes the blocks that the first this many waiting requests match
  // last (their next use is nearest); 0: least recently used only.
  int64_t eviction_lookahead = 64;
  // kv.tiers.prefetch_lookahead: waiting requests (from the head of the queue) whose demoted prefix
  // blocks are restored before they are admitted; 0: off (blocks come back at admission).
  int64_t prefetch_lookahead = 8;
  // kv.tiers.eviction next_use (true) or lru (false): with tiers, each plan lists the demoted
  // blocks that the first eviction_lookahead waiting requests will reuse (StepPlan::next_uses).
  bool tier_next_use = true;
  // kv.tiers.persist: with tiers, each plan's evictions carry their blocks' tokens
  // (PrefixEvict::tokens), which the tiers write into the block files, so that a restarted engine
  // or memory rank can offer them back (AddTierBlocks).
  bool eviction_tokens = false;
  // kv.store_pre_rope, with tiers: a prompt block that no chained match finds but whose tokens
  // registered blocks hold at other positions is restored from their rows (see the top).
  bool shifted_reuse = false;
};

// scheduler.max_batch_size and scheduler.max_tokens_per_step as the controller takes them: a
// batch size of 0 means "as many as the KV cache holds" (at most max_tokens_per_step). Errors name
// the setting (every decoding request needs one token per step, so tokens >= batch).
absl::StatusOr<ControllerOptions> ResolveSchedulerOptions(int64_t max_batch_size,
                                                          int64_t max_tokens_per_step);

// What a policy sees of a waiting request.
struct WaitingRequest {
  int64_t id = 0;
  int64_t prompt_tokens = 0;
  int64_t context_tokens = 0;  // prompt + max_tokens: the KV it reserves
};

// Chooses which waiting request to admit next.
class SchedulingPolicy {
 public:
  virtual ~SchedulingPolicy() = default;
  virtual std::string name() const = 0;
  // Index into `waiting` (arrival order, never empty) of the request to try next. If it does not
  // fit, admission stops for this step.
  virtual size_t NextToAdmit(std::span<const WaitingRequest> waiting) const = 0;
};
// First come, first served (admission in arrival order).
std::unique_ptr<SchedulingPolicy> MakeFifoPolicy();

// One planned step: the plan for the memory ranks and the rows for the compute backend.
struct PlannedStep {
  StepPlan plan;
  StepTokens rows;                 // tokens, positions, sample rows and their parameters
  std::vector<int32_t> rank_rows;  // (memory ranks + 1): rows of rank m are [rank_rows[m], rank_rows[m+1])
  // Nothing to send. A plan with restores and no requests is sent (the ranks restore) but runs no
  // layers.
  // The hashes among plan.evictions that were evicted to make room for prefetched blocks (never a
  // block that a running request or a waiting request of the prefetch window matches).
  std::vector<uint64_t> prefetch_evictions;
  bool empty() const { return plan.requests.empty() && plan.restores.empty(); }
  bool has_rows() const { return !plan.requests.empty(); }
};

// A prefix block that a rank's lower tiers hold already (kv.tiers.persist: found at start).
struct TierBlock {
  uint64_t hash = 0;
  uint64_t parent_hash = 0;     // 0: the first block of its chain
  std::vector<int32_t> tokens;  // prefix_block_tokens of them
};

struct ControllerStats {
  int64_t steps = 0;
  int64_t prefill_tokens = 0;
  int64_t decode_tokens = 0;          // generated tokens
  int64_t cached_tokens = 0;          // prompt tokens reused from the prefix registry (not prefilled)
  int64_t grouped_rows = 0;           // rows planned inside a prefix group
  int64_t demoted_tokens = 0;         // KV tiers: tokens of blocks evicted to a lower tier
  int64_t restored_tokens = 0;        // tokens of blocks restored from a lower tier
  int64_t restore_failed_tokens = 0;  // tokens of restores that failed (recomputed)
  int64_t demoted_blocks = 0;         // blocks of demoted_tokens
  int64_t restored_blocks = 0;        // blocks of restored_tokens
  int64_t restore_failed_blocks = 0;  // blocks of restore_failed_tokens
  int64_t tier_blocks_added = 0;      // blocks offered with AddTierBlocks and registered
  // Prefetch (options.prefetch_lookahead): blocks restored for waiting requests (also counted in
  // restored_*), those an admitted request then attached, and those evicted again before any
  // request attached them (wasted).
  int64_t prefetched_blocks = 0;
  int64_t prefetched_tokens = 0;
  int64_t prefetch_used_blocks = 0;
  int64_t prefetch_wasted_blocks = 0;
  // kv.store_pre_rope: blocks restored from shifted rows of other blocks (also counted in
  // restored_*), and those whose restore failed (also in restore_failed_*).
  int64_t shifted_blocks = 0;
  int64_t shifted_failed_blocks = 0;
};

class Controller {
 public:
  // `kv_capacity[m]`: KV slots of memory rank m (at least one rank).
  Controller(const ModelSpec& spec, std::vector<int64_t> kv_capacity, const ControllerOptions& options,
             std::unique_ptr<SchedulingPolicy> policy = MakeFifoPolicy());

  // InvalidArgument for an empty prompt, an id outside the vocabulary, max_tokens < 1, bad
  // sampling parameters, or a context longer than the model's; ResourceExhausted if its context
  // fits on no memory rank even when empty.
  absl::Status Check(const GenerationRequest& request) const;
  // Check()s and queues a request; returns its id (0, 1, 2, ... in submission order).
  absl::StatusOr<int64_t> Submit(GenerationRequest request);
  // Ends a waiting or running request now with finish_reason "cancelled" (the tokens generated so
  // far are kept). Its id is appended to released[rank] if it holds KV. NotFound for an unknown id.
  absl::Status Cancel(int64_t id, GenerationResult* result, std::vector<std::vector<uint64_t>>* released);

  // Registers blocks that rank m's tiers hold (parents before children), demoted, with tiers on
  // (options.tier_blocks > 0). A block is taken when its parent is registered (or it starts a
  // chain), its tokens give its hash and the hash is new; the rest are ignored. At most
  // tier_blocks are kept, the last offered first. Returns the blocks registered.
  int64_t AddTierBlocks(int m, std::span<const TierBlock> blocks);
  // Plans the next step into `step` (empty when nothing can run).
  void Schedule(PlannedStep* step);
  // The outcome of the restores that `plan` asked of rank m: `failed` lists those not registered
  // (the others were). Call once per plan with restores for m, before the next Schedule; a no-op
  // for a rank given up with LoseRank (its restores were forgotten there).
  void RestoreResult(const StepPlan& plan, int m, std::span<const uint64_t> failed);
  // Applies the sampled tokens of `step` (one per sample row, in order; alternatives for the rows
  // whose request asked, exactly as many as it asked or the vocabulary holds). Finished requests are
  // appended to `finished`; released[m] gets the ids whose KV rank m can free.
  absl::Status Complete(const PlannedStep& step, const SampledTokens& sampled,
                        std::vector<std::pair<int64_t, GenerationResult>>* finished,
                        std::vector<std::vector<uint64_t>>* released);

  // Memory rank m is gone (died, disconnected or went silent) with the KV of its requests: it
  // takes no more requests (its capacity becomes 0 and its prefix registry is forgotten, with the
  // blocks demoted to its KV tiers and the restores planned or awaiting its reply), and each
  // of its running requests goes back to the front of the queue, in admission order, to be
  // placed on a surviving rank and recompute its KV by prefilling its prompt and the tokens it has
  // generated so far; it then goes on generating where it was, with the same sampling counter, so
  // its client sees a delay and the tokens it would have got. A step planned before the loss must
  // not be Complete()d for those requests: Complete skips requests that are no longer running.
  // Returns the ids requeued. No-op for a rank already lost.
  std::vector<int64_t> LoseRank(int m);
  // Ends every waiting request (requeued by LoseRank or not yet admitted) whose context fits no
  // surviving rank even when empty, which would otherwise wait at the head of the queue forever:
  // appended to `failed` with finish_reason "error" and an Unavailable error naming its need, the
  // largest surviving rank and the ranks lost. Call after LoseRank. Its KV held nothing (waiting).
  void FailUnplaceable(std::vector<std::pair<int64_t, GenerationResult>>* failed);
  // Memory rank m, lost (LoseRank), is back: a new process of that rank, with an empty KV pool of
  // `capacity` slots (it need not be what the rank had). It takes requests again from the next
  // Schedule: its capacity is `capacity`, nothing is reserved on it, and its prefix registry is a
  // fresh one (the blocks of the lost process, resident or demoted, are not there). Requests
  // requeued by its loss stay where they were placed meanwhile. InvalidArgument (nothing changed)
  // for a rank out of range or not lost, or a capacity below 1.
  absl::Status RejoinRank(int m, int64_t capacity);
  bool rank_lost(int m) const { return lost_[static_cast<size_t>(m)]; }
  int live_ranks() const { return static_cast<int>(std::count(lost_.begin(), lost_.end(), false)); }

  bool Idle() const { return waiting_.empty() && running_.empty(); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int num_memory_ranks() const { return static_cast<int>(capacity_.size()); }
  // KV slots of rank m promised to running requests (beyond the registered blocks they use).
  int64_t kv_reserved(int m) const { return reserved_[static_cast<size_t>(m)]; }
  int64_t kv_capacity(int m) const { return capacity_[static_cast<size_t>(m)]; }
  // The prefix registry of rank m; nullptr when it is off.
  const PrefixIndex* prefix_index(int m) const {
    return index_.empty() ? nullptr : index_[static_cast<size_t>(m)].get();
  }
  // Token history of a live request (prompt, then generated tokens); nullopt if not live.
  std::optional<std::vector<int32_t>> History(int64_t id) const;
  // A live request's result so far (tokens and log-probabilities generated up to the last
  // Complete), or nullptr when `id` is not live. Valid until the next Submit, Complete or Cancel.
  const GenerationResult* Progress(int64_t id) const;
  const ControllerStats& stats() const { return stats_; }
  const SchedulingPolicy& policy() const { return *policy_; }

 private:
  // Rank m's placement state from scratch (LoseRank, RejoinRank): `capacity` KV tokens, nothing
  // reserved, evicted, pending, restoring or prefetched, and a fresh prefix registry.
  void ResetRank(size_t m, int64_t capacity);
  struct Live {
    int64_t id = 0;
    GenerationRequest request;
    GenerationResult result;
    int memory_rank = -1;
    int64_t prefilled = 0;            // prompt tokens processed (or reused)
    int64_t context = 0;              // tokens whose KV exists on the rank
    int64_t reserve = 0;              // KV slots promised to it beyond registered blocks
    bool started = false;             // has been in a step
    std::vector<int32_t> chain;       // registered blocks it uses (attached, then published), in order
    std::vector<uint64_t> pending;    // hashes of prompt blocks it will compute (counted in pending_)
    std::vector<uint64_t> restoring;  // hashes of its blocks being restored: it waits for them
    // Generated tokens folded into request.prompt by LoseRank (recomputed with the prompt): the
    // history is request.prompt + result.token_ids[resumed:].
    int64_t resumed = 0;
    // Chained hashes of the prompt blocks a match may cover ((prompt - 1) / block tokens of
    // them), computed for hashed_prompt_tokens tokens of prompt (-1: not yet).
    std::vector<uint64_t> prompt_hashes;
    int64_t hashed_prompt_tokens = -1;
  };
  int64_t ContextNeed(const GenerationRequest& r) const {
    return static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
  }
  int64_t ContextNeed(const Live& l) const { return ContextNeed(l.request) - l.resumed; }
  int64_t LargestCapacity() const { return *std::max_element(capacity_.begin(), capacity_.end()); }
  // "; memory rank(s) 1, 3 lost" when any is, else "".
  std::string LostRanksNote() const;
  void Admit();
  // Restores the demoted prefix blocks of the first options_.prefetch_lookahead waiting requests
  // (see the top of this file); appends the hashes it evicted for room to `evictions`.
  void Prefetch(std::vector<uint64_t>* evictions);
  // Shifted reuse (see the top): registers the blocks of `prompt` after rank m's chained match that
  // shifted runs can give, demoted, with their recipes.
  void AddShiftedBlocks(size_t m, std::span<const int32_t> prompt);
  // The restore record of block `id` of rank m (index k in its chain, after `parent`), with its
  // recipe's segments when it is a shifted block (the recipe is then used up).
  PrefixRestore MakeRestore(size_t m, int32_t id, int32_t parent, size_t k);
  // A fresh prefix registry for a rank.
  std::unique_ptr<PrefixIndex> MakeIndex() const;
  // Evicts unused blocks of rank m for `need` tokens of room, those that the first
  // kv.eviction_lookahead waiting requests match last; returns the tokens freed.
  int64_t EvictForRoom(size_t m, int64_t need);
  // Counts the evictions appended to evicted_[m] from index `from` on (demotions; prefetched blocks
  // evicted before use are wasted).
  void CountEvictions(size_t m, size_t from);
  // A request attaches blocks of rank m: prefetched ones among them were used.
  void NoteAttached(size_t m, std::span<const int32_t> ids);
  // The next-use records of the plan (see the top of this file).
  void PlanNextUses(StepPlan* plan);
  // Live::prompt_hashes, brought up to date.
  const std::vector<uint64_t>& PromptHashes(Live& live) const;
  // Forgets the blocks a request was going to compute (its prefill ended, or it did).
  void DropPending(Live& live);
  // Ends a running request's claims: its reservation and its use of registered blocks.
  void Retire(Live& live, std::vector<std::vector<uint64_t>>* released);
  // Registers the full blocks that the request's KV covers once this step's `rows` rows are in
  // (prefill chunks publish as they go, so that requests behind them can reuse the blocks; decode
  // steps publish blocks of generated tokens, for a conversation's next turn).
  void Publish(Live& live, int64_t rows, StepPlan* plan);
  // Before a request's first step: reuse the blocks registered since its admission.
  void Rematch(Live& live);
  // Hashes of the prompt blocks [live.chain.size(), end_tokens / block) of a request.
  std::vector<uint64_t> PendingBlockHashes(const Live& live, int64_t end_tokens) const;
  // Prefix groups of rank m's requests in the step; sets each request's prefix_group.
  void Group(int m, const std::vector<std::pair<Live*, int64_t>>& chosen, StepPlan* plan) const;

  ModelSpec spec_;
  std::vector<int64_t> capacity_;
  std::vector<bool> lost_;                           // per rank: LoseRank
  std::vector<int64_t> reserved_;                    // per rank: reservations of running requests
  std::vector<std::unique_ptr<PrefixIndex>> index_;  // per rank, when the registry is on
  std::vector<std::vector<uint64_t>> evicted_;       // per rank: for the next plan
  std::vector<std::vector<std::vector<int32_t>>> evicted_tokens_;  // per rank, with tiers: their tokens
  std::vector<std::vector<PrefixRestore>> restores_;               // per rank: for the next plan
  std::vector<std::unordered_map<uint64_t, int32_t>>
      restoring_;  // per rank: hash -> block id, until RestoreResult
  // Per rank: block hash -> running requests that will compute it (placement looks ahead).
  std::vector<std::unordered_map<uint64_t, int32_t>> pending_;
  // Per rank: prefetch restores awaiting RestoreResult, and prefetched blocks restored and not yet
  // attached by a request nor evicted (by hash).
  std::vector<std::unordered_set<uint64_t>> prefetching_;
  std::vector<std::unordered_set<uint64_t>> prefetched_;
  // Per rank, shifted reuse: hash of a shifted block not restored yet -> its recipe, and the hashes
  // of shifted blocks whose restore failed (not synthesized again).
  struct ShiftedRecipe {
    std::vector<PrefixSegment> segments;
    ShiftedCursor next;  // where the run of the block after it would continue
  };
  std::vector<std::unordered_map<uint64_t, ShiftedRecipe>> shifted_;
  std::vector<std::unordered_set<uint64_t>> shifted_failed_;
  ControllerOptions options_;
  std::unique_ptr<SchedulingPolicy> policy_;
  int64_t next_id_ = 0;
  uint64_t next_step_ = 0;
  std::deque<Live> waiting_;
  std::vector<std::unique_ptr<Live>> running_;  // admission order
  ControllerStats stats_;
};

}  // namespace tandem
