#include "colocated/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/device_choice.h"

namespace tandem {

namespace cpu = kernels::cpu;

void AddEngineKnobs(ConfigSchema* schema) {
  schema->String("runtime.device", EngineOptions{}.device,
                 "cpu, cuda, cuda:N, or auto (cuda:0 when a GPU is present)");
  schema->Bool("runtime.cuda_graphs", EngineOptions{}.cuda_graphs,
               "CUDA: run each layer's linear parts as CUDA graphs (pays where the host launches kernels "
               "slower than the GPU runs them; docs/benchmarks.md, \"Linear layers\")");
  AddSchedulerKvKnobs(schema);
}

EngineOptions EngineOptionsFromConfig(const Config& config) {
  EngineOptions o;
  static_cast<SchedulerKvSettings&>(o) = SchedulerKvSettingsFromConfig(config);
  o.device = config.GetString("runtime.device");
  o.cuda_graphs = config.GetBool("runtime.cuda_graphs");
  return o;
}

absl::StatusOr<std::unique_ptr<ColocatedEngine>> ColocatedEngine::Create(const WeightSource& source,
                                                                         const EngineOptions& requested) {
  EngineOptions options = requested;
  const ModelSpec& spec = source.spec();
  ASSIGN_OR_RETURN(const int device, kernels::ResolveDevice(options.device, spec));
  // KV elements: fp32 in the CPU pool, bf16 in the CUDA pool (the tiers' block size follows).
  const int64_t kv_elem = device < 0 ? 4 : 2;
  ASSIGN_OR_RETURN(const ControllerOptions scheduler,
                   ResolveControllerOptions(options, 2 * spec.num_layers * spec.kv_dim() * kv_elem));
  options.max_batch_size = scheduler.max_batch_size;
  const ComputeBackendOptions co{.max_tokens = options.max_tokens_per_step,
                                 .max_requests = options.max_batch_size,
                                 .profile = options.profile,
                                 .cuda_graphs = options.cuda_graphs,
                                 .gemv = options.gemv};
  const AttentionShape shape{.num_layers = spec.num_layers,
                             .num_heads = spec.num_heads,
                             .num_kv_heads = spec.num_kv_heads,
                             .head_dim = spec.head_dim,
                             .max_tokens = options.max_tokens_per_step,
                             .max_requests = options.max_batch_size};
  // The KV pool gets its share of the memory left after the weights and scratch.
  const KvPoolOptions kv{.capacity_tokens = options.kv_capacity_tokens,
                         .memory_fraction = options.kv_memory_fraction,
                         .max_useful_tokens = options.max_batch_size * spec.max_position};
  std::unique_ptr<ComputeBackend> backend;
  std::unique_ptr<AttentionExecutor> attention;
  if (device < 0) {
    ASSIGN_OR_RETURN(backend, CreateCpuComputeBackend(source, co));
    ASSIGN_OR_RETURN(attention, CreateCpuAttentionExecutor(shape, kv));
  } else {
    if (std::string why = kernels::CudaAttentionUnsupported(spec.head_dim); !why.empty()) {
      return absl::UnimplementedError(absl::StrCat("runtime.device cuda: ", why));
    }
    ASSIGN_OR_RETURN(backend, CreateCudaComputeBackend(source, co, device));
    ASSIGN_OR_RETURN(attention, CreateCudaAttentionExecutor(shape, kv, device, backend->stream()));
  }
  std::unique_ptr<KvTiers> tiers;
  if (options.tiers_enabled()) {
    ASSIGN_OR_RETURN(const KvTierEviction eviction, ParseKvTierEviction(options.tiers_eviction));
    ASSIGN_OR_RETURN(tiers,
                     KvTiers::Create({.host_bytes = options.tiers_host_bytes,
                                      .disk_dir = options.tiers_disk_dir,
                                      .disk_bytes = options.tiers_disk_bytes,
                                      .persist = options.tiers_persist,
                                      .eviction = eviction},
                                     attention.get(), scheduler.prefix_block_tokens, source.Describe()));
    tiers->set_rotary(kernels::cpu::RopeInvFreq(spec.rope, spec.head_dim));
  }
  auto engine = std::unique_ptr<ColocatedEngine>(
      new ColocatedEngine(std::move(backend), std::move(attention), options, scheduler));
  engine->tiers_ = std::move(tiers);
  engine->kv_table_.SetTiers(engine->tiers_.get());
  if (engine->tiers_ != nullptr && options.tiers_persist) {
    // The blocks a previous run left on disk: registered demoted, so that a prompt that starts with
    // them restores them.
    std::vector<TierBlock> found;
    for (KvTierBlock& b : engine->tiers_->PersistedBlocks())
      found.push_back({.hash = b.hash, .parent_hash = b.parent_hash, .tokens = std::move(b.tokens)});
    const int64_t added = engine->controller_.AddTierBlocks(0, found);
    TANDEM_LOG_INFO("engine", "kv.tiers.persist: ", added, " of ", found.size(),
                    " blocks found on disk registered for reuse");
  }
  const int64_t t = options.max_tokens_per_step;
  const size_t elem = DTypeSize(engine->backend_->dtype());
  ASSIGN_OR_RETURN(engine->qkv_,
                   engine->backend_->memory().Allocate(t * engine->backend_->qkv_width() * elem, false));
  ASSIGN_OR_RETURN(engine->attn_, engine->backend_->memory().Allocate(t * spec.q_dim() * elem, false));
  TANDEM_LOG_INFO("engine", spec.Summary(), "; device ", engine->device(), "; KV cache ",
                  engine->kv_capacity_tokens(), " tokens");
  return engine;
}

ColocatedEngine::ColocatedEngine(std::unique_ptr<ComputeBackend> backend,
                                 std::unique_ptr<AttentionExecutor> attention, const EngineOptions& options,
                                 const ControllerOptions& scheduler)
    : backend_(std::move(backend)),
      attention_(std::move(attention)),
      options_(options),
      controller_(backend_->spec(), {attention_->kv_capacity()}, scheduler),
      kv_table_(attention_->kv_capacity(), scheduler.prefix_block_tokens),
      qkv_(nullptr, &std::free),
      attn_(nullptr, &std::free) {
  AttentionExecutor* exec = attention_.get();
  kv_table_.SetPrefixSharing(scheduler.prefix_sharing, [exec](int64_t rows, int64_t tokens) {
    return exec->CascadePays(rows, tokens);
  });
}

ColocatedEngine::~ColocatedEngine() {
  if (tiers_ == nullptr || !options_.tiers_persist) return;
  // The blocks still in the pool go to disk too (each is written once; the store's destructor
  // waits for the writes), so that the next run finds every registered block.
  const PrefixIndex* index = controller_.prefix_index(0);
  kv_table_.SaveRegistered([index](uint64_t hash) -> std::span<const int32_t> {
    const int32_t id = index == nullptr ? -1 : index->Find(hash);
    return id < 0 ? std::span<const int32_t>() : std::span<const int32_t>(index->tokens(id));
  });
}

absl::StatusOr<int64_t> ColocatedEngine::Submit(GenerationRequest request) {
  return controller_.Submit(std::move(request));
}

absl::Status ColocatedEngine::Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  const auto t0 = std::chrono::steady_clock::now();
  controller_.Schedule(&step_);
  if (step_.empty()) return absl::OkStatus();
  std::vector<uint64_t> failed;
  RETURN_IF_ERROR(Annotate(kv_table_.Apply(step_.plan, 0, &batch_, &failed), "KV reservation broken"));
  if (!step_.plan.restores.empty()) controller_.RestoreResult(step_.plan, 0, failed);
  if (!step_.has_rows())
    return tiers_ == nullptr ? absl::OkStatus() : tiers_->FinishRestores();  // restores only
  SampledTokens sampled;
  RETURN_IF_ERROR(backend_->BeginStep(step_.rows));
  RETURN_IF_ERROR(attention_->BeginStep(batch_));
  for (int64_t layer = 0; layer < spec().num_layers; ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    // Layer-wise restore: this layer's KV of the blocks restored for the step, just before it is read.
    if (tiers_ != nullptr) RETURN_IF_ERROR(tiers_->RestoreLayer(layer));
    RETURN_IF_ERROR(attention_->Layer(layer, qkv_.get(), attn_.get()));
    backend_->MarkAttention();
    RETURN_IF_ERROR(backend_->PostAttention(layer, attn_.get()));
  }
  if (tiers_ != nullptr) RETURN_IF_ERROR(tiers_->FinishRestores());
  RETURN_IF_ERROR(backend_->Finish(&sampled));
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_.Complete(step_, sampled, finished, &released));
  kv_table_.Release(released[0]);
  const ControllerStats& cs = controller_.stats();
  stats_.steps = cs.steps;
  stats_.prefill_tokens = cs.prefill_tokens;
  stats_.decode_tokens = cs.decode_tokens;
  stats_.cached_tokens = cs.cached_tokens;
  stats_.restored_tokens = cs.restored_tokens;
  stats_.restore_failed_tokens = cs.restore_failed_tokens;
  stats_.demoted_tokens = cs.demoted_tokens;
  stats_.prefetched_tokens = cs.prefetched_tokens;
  if (tiers_ != nullptr) {
    KvTierCounters& t = stats_.tiers;
    const int64_t block_bytes = tiers_->store().block_bytes();
    t.enabled = t.per_tier = true;
    t.demoted_blocks = cs.demoted_blocks;
    t.restored_blocks = cs.restored_blocks;
    t.restore_failed_blocks = cs.restore_failed_blocks;
    t.pool_bytes_out = cs.demoted_blocks * block_bytes;
    t.pool_bytes_in = cs.restored_blocks * block_bytes;
    t.prefetched_blocks = cs.prefetched_blocks;
    t.prefetch_used_blocks = cs.prefetch_used_blocks;
    t.prefetch_wasted_blocks = cs.prefetch_wasted_blocks;
    t.shifted_blocks = cs.shifted_blocks;
    t.shifted_failed_blocks = cs.shifted_failed_blocks;
    const KvTierStats ts = tiers_->stats();
    t.host_hits = ts.host_hits;
    t.disk_hits = ts.disk_hits;
    t.misses = ts.misses;
    t.discarded = ts.discarded;
    t.bytes_to_host = ts.bytes_to_host;
    t.bytes_from_host = ts.bytes_from_host;
    t.bytes_to_disk = ts.bytes_to_disk;
    t.bytes_from_disk = ts.bytes_from_disk;
    t.host_evictions = ts.host_evictions;
    t.disk_evictions = ts.disk_evictions;
    t.disk_write_errors = ts.write_errors;
    t.restore_seconds = tiers_->restore_seconds();
    t.restore_stall_seconds = tiers_->restore_stall_seconds();
    t.save_seconds = tiers_->save_seconds();
  }
  stats_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::StatusOr<GenerationResult> ColocatedEngine::Cancel(int64_t id) {
  GenerationResult result;
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_.Cancel(id, &result, &released));
  kv_table_.Release(released[0]);
  return result;
}

}  // namespace tandem
