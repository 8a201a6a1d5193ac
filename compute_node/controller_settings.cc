#include "compute_node/controller_settings.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem {

void AddSchedulerKvKnobs(ConfigSchema* schema) {
  const SchedulerKvSettings d;
  schema
      ->Int("scheduler.max_batch_size", d.max_batch_size,
            "requests batched in one step; 0: as many as the KV cache holds (at most max_tokens_per_step)", 0,
            65536)
      .Int("scheduler.max_tokens_per_step", d.max_tokens_per_step,
           "decode tokens plus prefill-chunk tokens in one step (>= max_batch_size)", 1, 1 << 20)
      .Int("kv.capacity_tokens", d.kv_capacity_tokens,
           "KV cache size in tokens; 0 sizes it from free memory (kv.memory_fraction)", 0, 1LL << 31)
      .Double("kv.memory_fraction", d.kv_memory_fraction,
              "share of free device (or host) memory, after the weights, given to the KV cache when sized "
              "automatically",
              0.01, 0.98)
      .Bool("kv.prefix_cache", d.prefix_cache,
            "keep the KV of full token blocks (prompt and generated) after a request ends and reuse it for "
            "prompts that start with them, such as a conversation's next turn (evicted least recently used "
            "when the cache is full)")
      .Int("kv.prefix_block_tokens", d.prefix_block_tokens,
           "tokens per prefix-cache block: prompts share KV in whole blocks", 1, 4096)
      .Enum("kv.prefix_sharing", d.prefix_sharing, {"auto", "on", "off"},
            "attention reads a prefix shared by several requests of a step once for all of them: auto "
            "where the measured crossover says it pays, on always, off never (needs kv.prefix_cache)")
      .Int("kv.eviction_lookahead", d.eviction_lookahead,
           "when the KV pool needs room, prefix blocks that one of the first this many waiting requests "
           "will reuse are evicted last (unused blocks no waiting request wants go first, each group least "
           "recently used first); 0: least recently used only",
           0, 1 << 20)
      .Int("kv.tiers.host_bytes", d.tiers_host_bytes,
           "KV tiers (the colocated engine and every memory rank, CPU or CUDA): bytes of host memory per "
           "memory rank that keep prefix blocks evicted from the KV pool, so that a later turn restores them "
           "instead of recomputing; 0: off",
           0, int64_t{1} << 50)
      .String("kv.tiers.disk_dir", d.tiers_disk_dir,
              "directory of the disk KV tier (memory rank m uses its subdirectory rank-<m>); needed when "
              "kv.tiers.disk_bytes > 0")
      .Int("kv.tiers.disk_bytes", d.tiers_disk_bytes,
           "bytes of block files per memory rank in kv.tiers.disk_dir, written by a thread of their own "
           "(checksummed; a bad file is discarded and its tokens recomputed); 0: off",
           0, int64_t{1} << 50)
      .Bool("kv.tiers.persist", d.tiers_persist,
            "keep the disk tier's block files (evicted blocks, written with their tokens; the colocated "
            "engine also writes the blocks still in its KV pool when it ends) and register them again at "
            "the next start with the same kv.tiers.disk_dir (each memory rank reports its rank-<m> files "
            "to compute rank 0), so that a conversation continued after a restart restores its KV; false: "
            "the files are scratch, removed at start and at the end. Needs kv.tiers.disk_bytes > 0")
      .Int("kv.tiers.prefetch_lookahead", d.tiers_prefetch_lookahead,
           "KV tiers: the first this many waiting requests get the prefix blocks they will reuse restored "
           "from the lower tiers before they are admitted, into free KV slots or the room of unused blocks "
           "that no running request and none of these waiting requests needs; 0: off (blocks come back "
           "when their request is admitted, which then waits a step)",
           0, 1 << 20)
      .Enum("kv.tiers.eviction", d.tiers_eviction, {"next_use", "lru"},
            "KV tiers: which blocks the host and disk tiers evict when full. next_use: first those that "
            "none of the first kv.eviction_lookahead waiting requests will reuse (least recently used "
            "first), then the one whose first use is farthest in the queue; lru: least recently used")
      .Bool(
          "kv.store_pre_rope", d.store_pre_rope,
          "KV tiers: reuse saved KV at new positions. A prompt block that no cached prefix holds, but whose "
          "tokens registered blocks hold elsewhere (a conversation whose oldest turns the client dropped), "
          "is "
          "restored from those rows, its keys turned to their new positions by the rotary embedding, instead "
          "of being recomputed. The first layer's KV is then exact; deeper layers keep the context the rows "
          "were computed in, an approximation (docs/benchmarks.md measures how often tokens differ). Needs "
          "kv.tiers.host_bytes or kv.tiers.disk_bytes > 0");
}

SchedulerKvSettings SchedulerKvSettingsFromConfig(const Config& config) {
  SchedulerKvSettings s;
  s.max_batch_size = config.GetInt("scheduler.max_batch_size");
  s.max_tokens_per_step = config.GetInt("scheduler.max_tokens_per_step");
  s.kv_capacity_tokens = config.GetInt("kv.capacity_tokens");
  s.kv_memory_fraction = config.GetDouble("kv.memory_fraction");
  s.prefix_cache = config.GetBool("kv.prefix_cache");
  s.prefix_block_tokens = config.GetInt("kv.prefix_block_tokens");
  s.prefix_sharing = config.GetString("kv.prefix_sharing");
  s.eviction_lookahead = config.GetInt("kv.eviction_lookahead");
  s.tiers_host_bytes = config.GetInt("kv.tiers.host_bytes");
  s.tiers_disk_dir = config.GetString("kv.tiers.disk_dir");
  s.tiers_disk_bytes = config.GetInt("kv.tiers.disk_bytes");
  s.tiers_persist = config.GetBool("kv.tiers.persist");
  s.tiers_prefetch_lookahead = config.GetInt("kv.tiers.prefetch_lookahead");
  s.tiers_eviction = config.GetString("kv.tiers.eviction");
  s.store_pre_rope = config.GetBool("kv.store_pre_rope");
  return s;
}

absl::StatusOr<ControllerOptions> ResolveControllerOptions(const SchedulerKvSettings& s,
                                                           int64_t kv_bytes_per_token) {
  ASSIGN_OR_RETURN(ControllerOptions options,
                   ResolveSchedulerOptions(s.max_batch_size, s.max_tokens_per_step));
  ASSIGN_OR_RETURN(const PrefixOptions prefix,
                   ResolvePrefixOptions(s.prefix_cache, s.prefix_block_tokens, s.prefix_sharing));
  options.prefix_block_tokens = prefix.block_tokens;
  options.eviction_lookahead = s.eviction_lookahead;
  options.prefetch_lookahead = s.tiers_prefetch_lookahead;
  if (s.tiers_eviction != "next_use" && s.tiers_eviction != "lru") {
    return absl::InvalidArgumentError(
        absl::StrCat("kv.tiers.eviction: \"", s.tiers_eviction, "\" is neither \"next_use\" nor \"lru\""));
  }
  options.tier_next_use = s.tiers_eviction == "next_use";
  options.eviction_tokens = s.tiers_persist;
  options.prefix_sharing = prefix.sharing;
  if (s.tiers_enabled()) {
    if (options.prefix_block_tokens == 0)
      return absl::InvalidArgumentError(
          "kv.tiers.host_bytes / kv.tiers.disk_bytes need kv.prefix_cache: true");
    const int64_t block_bytes = std::max<int64_t>(1, options.prefix_block_tokens * kv_bytes_per_token);
    options.tier_blocks = std::max<int64_t>(1, (s.tiers_host_bytes + s.tiers_disk_bytes) / block_bytes);
  }
  if (s.store_pre_rope && !s.tiers_enabled()) {
    return absl::InvalidArgumentError(
        "kv.store_pre_rope needs KV tiers (kv.tiers.host_bytes or kv.tiers.disk_bytes > 0)");
  }
  options.shifted_reuse = s.store_pre_rope;
  return options;
}

}  // namespace tandem
