// The CPU attention executor: fp32 KV in host memory, attention by the CPU reference op.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/host_memory.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "memory_node/attention_executor.h"

namespace tandem {

namespace {

class CpuAttentionExecutor : public AttentionExecutor {
 public:
  CpuAttentionExecutor(const AttentionShape& shape, int64_t slots) : shape_(shape), num_slots_(slots) {
    const size_t layer_floats = static_cast<size_t>(slots * shape.kv_dim());
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      // Left uninitialised: a slot is written before it is read, and untouched pages of a large
      // pool cost no memory or start-up time.
      k_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
      v_cache_.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
    }
  }

  int64_t kv_capacity() const override { return num_slots_; }
  std::string device() const override { return "cpu"; }
  DType dtype() const override { return DType::kF32; }
  const AttentionShape& shape() const override { return shape_; }

  absl::Status BeginStep(const AttentionBatch& batch) override {
    RETURN_IF_ERROR(CheckAttentionBatch(batch, shape_, num_slots_));
    batch_ = &batch;
    q_.resize(static_cast<size_t>(batch.num_tokens() * shape_.q_dim()));
    return absl::OkStatus();
  }

  absl::Status Layer(int64_t layer, const void* qkv_v, void* out) override {
    const AttentionBatch& b = *batch_;
    const int64_t t = b.num_tokens(), qd = shape_.q_dim(), kvd = shape_.kv_dim(), width = shape_.qkv_width();
    const auto* qkv = static_cast<const float*>(qkv_v);
    float* kc = k_cache_[static_cast<size_t>(layer)].get();
    float* vc = v_cache_[static_cast<size_t>(layer)].get();
    for (int64_t r = 0; r < t; ++r) {
      const float* row = qkv + r * width;
      const int64_t slot = b.new_slots[static_cast<size_t>(r)];
      std::memcpy(q_.data() + r * qd, row, static_cast<size_t>(qd) * sizeof(float));
      std::memcpy(kc + slot * kvd, row + qd, static_cast<size_t>(kvd) * sizeof(float));
      std::memcpy(vc + slot * kvd, row + qd + kvd, static_cast<size_t>(kvd) * sizeof(float));
    }
    return kernels::cpu::Attention({.q = q_.data(),
                                    .k_cache = kc,
                                    .v_cache = vc,
                                    .out = static_cast<float*>(out),
                                    .q_indptr = b.q_indptr.data(),
                                    .kv_indptr = b.kv_indptr.data(),
                                    .kv_slots = b.kv_slots.data(),
                                    .num_requests = b.num_requests(),
                                    .num_slots = num_slots_,
                                    .num_heads = shape_.num_heads,
                                    .num_kv_heads = shape_.num_kv_heads,
                                    .head_dim = shape_.head_dim,
                                    .scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim))});
  }

  MemorySpace& memory() override { return memory_; }

 private:
  HostMemorySpace memory_;
  AttentionShape shape_;
  int64_t num_slots_;
  const AttentionBatch* batch_ = nullptr;
  std::vector<std::unique_ptr<float[]>> k_cache_, v_cache_;  // per layer (slots, kv_dim)
  std::vector<float> q_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateCpuAttentionExecutor(const AttentionShape& shape,
                                                                              const KvPoolOptions& kv) {
  const int64_t per_token = shape.kv_bytes_per_token(sizeof(float));
  int64_t slots = kv.capacity_tokens;
  if (slots == 0) {
    const int64_t avail = AvailableHostBytes();
    slots = static_cast<int64_t>(static_cast<double>(avail) * kv.memory_fraction) / per_token;
    if (kv.max_useful_tokens > 0) slots = std::min(slots, kv.max_useful_tokens);
    if (slots < 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no host memory left for the KV cache (", avail >> 20, " MiB available, ", per_token,
                       " bytes per token); set kv.capacity_tokens or use a smaller model"));
    }
  }
  if (slots > INT32_MAX) return absl::InvalidArgumentError("kv.capacity_tokens exceeds 2^31-1");
  TANDEM_LOG_INFO("attention", "device cpu; KV cache ", slots, " tokens (", (slots * per_token) >> 20,
                  " MiB fp32)");
  return std::unique_ptr<AttentionExecutor>(new CpuAttentionExecutor(shape, slots));
}

}  // namespace tandem
