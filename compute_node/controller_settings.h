// The "scheduler.*" and "kv.*" settings, shared by every schema that runs a controller (the
// colocated engine's and a deployment's; see docs/architecture.md, "Configuration"), and their
// conversion into the controller's options.
//
//   scheduler.max_batch_size       requests in one step; 0: as many as the KV cache holds
//   scheduler.max_tokens_per_step  decode tokens + prefill-chunk tokens in one step
//   kv.capacity_tokens             KV slots (per memory rank); 0: sized from free memory
//   kv.memory_fraction             share of free memory (after weights) for KV when sized
//   kv.prefix_cache                keep full blocks' KV after a request ends and reuse it
//   kv.prefix_block_tokens         tokens per registered block
//   kv.prefix_sharing              shared-prefix attention: auto, on or off
//   kv.eviction_lookahead          waiting requests whose prefix blocks eviction takes last
//   kv.tiers.host_bytes            KV tiers (per memory rank): host DRAM below the KV pool; 0: off
//   kv.tiers.disk_dir              directory of the disk tier (each memory rank uses rank-<m>/)
//   kv.tiers.disk_bytes            disk tier size; 0: off
//   kv.tiers.persist               the disk tier survives a restart (plans' evictions carry tokens)
//   kv.tiers.prefetch_lookahead    waiting requests whose demoted prefix blocks are restored before
//                                  admission; 0: off
//   kv.tiers.eviction              next_use: each tier evicts the blocks no request of the first
//                                  kv.eviction_lookahead waiting ones wants first, then the farthest
//                                  use; lru: least recently used
//   kv.store_pre_rope              with tiers: reuse registered blocks' KV at other positions (keys
//                                  turned by their rotary embedding), e.g. a history whose oldest
//                                  turns were dropped; an approximation (docs/architecture.md)
//
// The kv.capacity_tokens and kv.memory_fraction values are not the controller's: they size the
// KV pool of whoever owns it (the colocated engine, or each memory rank through the hello).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/config.h"
#include "compute_node/controller.h"

namespace tandem {

// The values of the settings above; the defaults are the schema's.
struct SchedulerKvSettings {
  int64_t max_batch_size = 0;               // requests in one step; 0: as many as the KV cache holds
                                            // (at most max_tokens_per_step)
  int64_t max_tokens_per_step = 2048;       // decode tokens + prefill chunk tokens in one step
  int64_t kv_capacity_tokens = 0;           // KV slots; 0: sized from free device or host memory
  double kv_memory_fraction = 0.9;          // share of free memory (after weights) for KV when auto
  bool prefix_cache = true;                 // reuse registered prompt blocks' KV (kv.prefix_cache)
  int64_t prefix_block_tokens = 64;         // tokens per registered block
  std::string prefix_sharing = "auto";      // shared-prefix attention: auto, on or off
  int64_t eviction_lookahead = 64;          // kv.eviction_lookahead
  int64_t tiers_host_bytes = 0;             // kv.tiers.host_bytes
  std::string tiers_disk_dir;               // kv.tiers.disk_dir
  int64_t tiers_disk_bytes = 0;             // kv.tiers.disk_bytes
  bool tiers_persist = false;               // kv.tiers.persist
  int64_t tiers_prefetch_lookahead = 8;     // kv.tiers.prefetch_lookahead
  std::string tiers_eviction = "next_use";  // kv.tiers.eviction: next_use or lru
  bool store_pre_rope = false;              // kv.store_pre_rope
  bool tiers_enabled() const { return tiers_host_bytes > 0 || tiers_disk_bytes > 0; }
};

// Adds the "scheduler.*" and "kv.*" knobs (type, default, range, help) to `schema`.
void AddSchedulerKvKnobs(ConfigSchema* schema);
// Reads them from a config whose schema has them (AddSchedulerKvKnobs).
SchedulerKvSettings SchedulerKvSettingsFromConfig(const Config& config);
// The controller's options: ResolveSchedulerOptions and ResolvePrefixOptions together. Errors
// name the setting at fault.
// With KV tiers on, the controller keeps at most as many demoted blocks per rank as the rank's tiers
// can hold: (host_bytes + disk_bytes) / bytes of a block, a block being prefix_block_tokens tokens
// of `kv_bytes_per_token` each (the memory rank's own LRU decides what it really keeps).
// InvalidArgument naming kv.tiers when tiers are on without the prefix cache.
absl::StatusOr<ControllerOptions> ResolveControllerOptions(const SchedulerKvSettings& settings,
                                                           int64_t kv_bytes_per_token = 0);

}  // namespace tandem
