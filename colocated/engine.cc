#include "colocated/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cuda/device.h"

namespace tandem {

namespace cpu = kernels::cpu;

void AddEngineKnobs(ConfigSchema* schema) {
  schema->String("runtime.device", EngineOptions{}.device,
                 "cpu, cuda, cuda:N, or auto (cuda:0 when a GPU is present)");
  AddSchedulerKvKnobs(schema);
}

void AddSchedulerKvKnobs(ConfigSchema* schema) {
  const EngineOptions d;
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
            "where the measured crossover says it pays, on always, off never (needs kv.prefix_cache)");
}

absl::Status ResolvePrefixOptions(bool prefix_cache, int64_t block_tokens, const std::string& sharing,
                                  ControllerOptions* options) {
  if (block_tokens < 1 || block_tokens > 4096)
    return absl::InvalidArgumentError(
        absl::StrCat("kv.prefix_block_tokens must be in [1, 4096], got ", block_tokens));
  options->prefix_block_tokens = prefix_cache ? block_tokens : 0;
  if (sharing == "off") {
    options->prefix_sharing = PrefixSharing::kOff;
  } else if (sharing == "on" || sharing == "auto") {
    if (!prefix_cache && sharing == "on")
      return absl::InvalidArgumentError("kv.prefix_sharing: on needs kv.prefix_cache: true");
    options->prefix_sharing = !prefix_cache     ? PrefixSharing::kOff
                              : sharing == "on" ? PrefixSharing::kOn
                                                : PrefixSharing::kAuto;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("kv.prefix_sharing: expected auto, on or off, got \"", sharing, "\""));
  }
  return absl::OkStatus();
}

EngineOptions EngineOptionsFromConfig(const Config& config) {
  EngineOptions o;
  o.device = config.GetString("runtime.device");
  o.max_batch_size = config.GetInt("scheduler.max_batch_size");
  o.max_tokens_per_step = config.GetInt("scheduler.max_tokens_per_step");
  o.kv_capacity_tokens = config.GetInt("kv.capacity_tokens");
  o.kv_memory_fraction = config.GetDouble("kv.memory_fraction");
  o.prefix_cache = config.GetBool("kv.prefix_cache");
  o.prefix_block_tokens = config.GetInt("kv.prefix_block_tokens");
  o.prefix_sharing = config.GetString("kv.prefix_sharing");
  return o;
}

// "cpu" -> -1; "cuda" -> 0; "cuda:N" -> N; "auto" -> 0 if a CUDA device is present and the CUDA
// runner supports the model, else -1.
absl::StatusOr<int> ResolveDevice(const std::string& device, const ModelSpec& spec) {
  if (device == "cpu") return -1;
  if (device == "auto") {
    absl::StatusOr<int> n = kernels::CudaDeviceCount();
    if (!n.ok() || *n == 0) return -1;
    const std::string why = CudaAttentionUnsupported(spec.head_dim);
    if (!why.empty()) {
      TANDEM_LOG_WARN("engine", "running on the CPU although a GPU is present: ", why);
      return -1;
    }
    return 0;
  }
  int index = 0;
  if (device == "cuda" ||
      (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &index) && index >= 0)) {
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("runtime.device: expected cpu, cuda, cuda:N or auto, got \"", device, "\""));
}

absl::StatusOr<std::unique_ptr<ColocatedEngine>> ColocatedEngine::Create(const WeightSource& source,
                                                                         const EngineOptions& requested) {
  EngineOptions options = requested;
  ASSIGN_OR_RETURN(ControllerOptions scheduler,
                   ResolveSchedulerOptions(options.max_batch_size, options.max_tokens_per_step));
  RETURN_IF_ERROR(ResolvePrefixOptions(options.prefix_cache, options.prefix_block_tokens,
                                       options.prefix_sharing, &scheduler));
  options.max_batch_size = scheduler.max_batch_size;
  const ModelSpec& spec = source.spec();
  ASSIGN_OR_RETURN(const int device, ResolveDevice(options.device, spec));
  const ComputeBackendOptions co{.max_tokens = options.max_tokens_per_step,
                                 .max_requests = options.max_batch_size,
                                 .profile = options.profile,
                                 .cuda_graphs = options.cuda_graphs};
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
    if (std::string why = CudaAttentionUnsupported(spec.head_dim); !why.empty()) {
      return absl::UnimplementedError(absl::StrCat("runtime.device cuda: ", why));
    }
    ASSIGN_OR_RETURN(backend, CreateCudaComputeBackend(source, co, device));
    ASSIGN_OR_RETURN(attention, CreateCudaAttentionExecutor(shape, kv, device, backend->stream()));
  }
  auto engine = std::unique_ptr<ColocatedEngine>(
      new ColocatedEngine(std::move(backend), std::move(attention), options, scheduler));
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

absl::StatusOr<int64_t> ColocatedEngine::Submit(GenerationRequest request) {
  return controller_.Submit(std::move(request));
}

absl::Status ColocatedEngine::Step(std::vector<std::pair<int64_t, GenerationResult>>* finished) {
  const auto t0 = std::chrono::steady_clock::now();
  controller_.Schedule(&step_);
  if (step_.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Annotate(kv_table_.Apply(step_.plan, 0, &batch_), "KV reservation broken"));
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  RETURN_IF_ERROR(backend_->BeginStep(step_.rows));
  RETURN_IF_ERROR(attention_->BeginStep(batch_));
  for (int64_t layer = 0; layer < spec().num_layers; ++layer) {
    RETURN_IF_ERROR(backend_->PreAttention(layer, qkv_.get()));
    RETURN_IF_ERROR(attention_->Layer(layer, qkv_.get(), attn_.get()));
    backend_->MarkAttention();
    RETURN_IF_ERROR(backend_->PostAttention(layer, attn_.get()));
  }
  RETURN_IF_ERROR(backend_->Finish(&tokens, &logprobs));
  std::vector<std::vector<uint64_t>> released;
  RETURN_IF_ERROR(controller_.Complete(step_, tokens, logprobs, finished, &released));
  kv_table_.Release(released[0]);
  const ControllerStats& cs = controller_.stats();
  stats_.steps = cs.steps;
  stats_.prefill_tokens = cs.prefill_tokens;
  stats_.decode_tokens = cs.decode_tokens;
  stats_.cached_tokens = cs.cached_tokens;
  stats_.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<GenerationResult>> ColocatedEngine::GenerateAll(
    std::vector<GenerationRequest> requests) {
  return RunToCompletion(
      controller_, std::move(requests),
      [this](std::vector<std::pair<int64_t, GenerationResult>>* done) { return Step(done); });
}

}  // namespace tandem
