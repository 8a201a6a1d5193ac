// The CPU runner: fp32 weights (compute_node/CpuLayerExecutor) and an fp32 KV pool in host
// memory, attention and sampling by the CPU reference ops.
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "colocated/runner.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/layer_executor.h"

namespace tandem {

namespace cpu = kernels::cpu;

namespace {

class CpuRunner : public ModelRunner {
 public:
  CpuRunner(ModelWeightsF32 weights, int64_t slots)
      : weights_(std::move(weights)), executor_(&weights_), num_slots_(slots) {
    const size_t layer_floats = static_cast<size_t>(slots * weights_.spec.kv_dim());
    for (int64_t l = 0; l < weights_.spec.num_layers; ++l) {
      // Left uninitialised: a slot is written before it is read, and untouched pages of a large
      // pool cost no memory or start-up time.
      k_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
      v_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
    }
  }

  const ModelSpec& spec() const override { return weights_.spec; }
  int64_t kv_capacity() const override { return num_slots_; }
  std::string device() const override { return "cpu"; }

  absl::Status Forward(const StepBatch& b, std::vector<int32_t>* tokens,
                       std::vector<float>* logprobs) override {
    const ModelSpec& s = spec();
    const int64_t t = b.num_tokens();
    const int64_t hidden = s.hidden_size, qd = s.q_dim(), kvd = s.kv_dim();
    const int64_t width = executor_.qkv_width();
    x_.resize(static_cast<size_t>(t * hidden));
    qkv_.resize(static_cast<size_t>(t * width));
    q_.resize(static_cast<size_t>(t * qd));
    attn_.resize(static_cast<size_t>(t * qd));
    RETURN_IF_ERROR(executor_.Embed(b.tokens, x_.data()));
    for (int64_t layer = 0; layer < s.num_layers; ++layer) {
      RETURN_IF_ERROR(executor_.PreAttention(layer, x_.data(), b.positions, qkv_.data()));
      float* kc = k_cache_[static_cast<size_t>(layer)].get();
      float* vc = v_cache_[static_cast<size_t>(layer)].get();
      for (int64_t r = 0; r < t; ++r) {
        const float* row = qkv_.data() + r * width;
        const int64_t slot = b.new_slots[static_cast<size_t>(r)];
        std::memcpy(q_.data() + r * qd, row, static_cast<size_t>(qd) * sizeof(float));
        std::memcpy(kc + slot * kvd, row + qd, static_cast<size_t>(kvd) * sizeof(float));
        std::memcpy(vc + slot * kvd, row + qd + kvd, static_cast<size_t>(kvd) * sizeof(float));
      }
      RETURN_IF_ERROR(cpu::Attention({.q = q_.data(),
                                      .k_cache = kc,
                                      .v_cache = vc,
                                      .out = attn_.data(),
                                      .q_indptr = b.q_indptr.data(),
                                      .kv_indptr = b.kv_indptr.data(),
                                      .kv_slots = b.kv_slots.data(),
                                      .num_requests = b.num_requests(),
                                      .num_slots = num_slots_,
                                      .num_heads = s.num_heads,
                                      .num_kv_heads = s.num_kv_heads,
                                      .head_dim = s.head_dim,
                                      .scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim))}));
      RETURN_IF_ERROR(executor_.PostAttention(layer, x_.data(), attn_.data(), t));
    }
    if (b.sample_rows.empty()) return absl::OkStatus();
    logits_.resize(b.sample_rows.size() * static_cast<size_t>(s.vocab_size));
    RETURN_IF_ERROR(executor_.Logits(x_.data(), b.sample_rows, logits_.data()));
    for (size_t i = 0; i < b.sample_rows.size(); ++i) {
      const float* row = logits_.data() + static_cast<int64_t>(i) * s.vocab_size;
      const int32_t token = cpu::SampleToken(row, s.vocab_size, b.sampling[i], b.counters[i]);
      tokens->push_back(token);
      logprobs->push_back(cpu::TokenLogprob(row, s.vocab_size, token));
    }
    return absl::OkStatus();
  }

 private:
  ModelWeightsF32 weights_;
  CpuLayerExecutor executor_;
  int64_t num_slots_;
  std::vector<std::unique_ptr<float[]>> k_cache_, v_cache_;  // per layer (slots, kv_dim)
  std::vector<float> x_, qkv_, q_, attn_, logits_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuRunner(const WeightSource& source,
                                                             const RunnerOptions& options) {
  ASSIGN_OR_RETURN(ModelWeightsF32 weights, LoadWeightsF32(source));
  const ModelSpec& spec = weights.spec;
  const int64_t per_token = spec.kv_bytes_per_token(sizeof(float));
  int64_t slots = options.kv_capacity_tokens;
  if (slots == 0) {
    const int64_t avail = AvailableHostBytes();
    const int64_t by_memory =
        static_cast<int64_t>(static_cast<double>(avail) * options.kv_memory_fraction) / per_token;
    // Never more than the batch could ever use.
    slots = std::min(by_memory, options.max_batch_size * spec.max_position);
    if (slots < 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no host memory left for the KV cache (", avail >> 20, " MiB available, ", per_token,
                       " bytes per token); set kv.capacity_tokens or use a smaller model"));
    }
  }
  if (slots > INT32_MAX) return absl::InvalidArgumentError("kv.capacity_tokens exceeds 2^31-1");
  TANDEM_LOG_INFO("engine", spec.Summary(), "; device cpu; KV cache ", slots, " tokens (",
                  (slots * per_token) >> 20, " MiB fp32)");
  return std::unique_ptr<ModelRunner>(new CpuRunner(std::move(weights), slots));
}

}  // namespace tandem
