// The CPU attention executor: fp32 KV in host memory, attention by the CPU reference op.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

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
  // The KV pool: per layer (slots, kv_dim) K and V, shared with the lanes.
  struct Pool {
    std::vector<std::unique_ptr<float[]>> k, v;
  };

  CpuAttentionExecutor(const AttentionShape& shape, int64_t slots) : shape_(shape), num_slots_(slots) {
    auto pool = std::make_shared<Pool>();
    const size_t layer_floats = static_cast<size_t>(slots * shape.kv_dim());
    for (int64_t l = 0; l < shape.num_layers; ++l) {
      // Left uninitialised: a slot is written before it is read, and untouched pages of a large
      // pool cost no memory or start-up time.
      pool->k.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
      pool->v.push_back(std::make_unique_for_overwrite<float[]>(layer_floats));
    }
    pool_ = std::move(pool);
  }
  CpuAttentionExecutor(const AttentionShape& shape, int64_t slots, std::shared_ptr<Pool> pool)
      : shape_(shape), num_slots_(slots), pool_(std::move(pool)) {}

  absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateLane() override {
    return std::unique_ptr<AttentionExecutor>(new CpuAttentionExecutor(shape_, num_slots_, pool_));
  }

  int64_t kv_capacity() const override { return num_slots_; }
  std::string device() const override { return "cpu"; }
  DType dtype() const override { return DType::kF32; }
  const AttentionShape& shape() const override { return shape_; }

  absl::Status BeginStep(const AttentionBatch& batch) override {
    RETURN_IF_ERROR(CheckAttentionBatch(batch, shape_, num_slots_));
    batch_ = &batch;
    q_.resize(static_cast<size_t>(batch.num_tokens() * shape_.q_dim()));
    if (batch.num_groups() > 0) {
      lse_.resize(static_cast<size_t>(batch.num_tokens() * shape_.num_heads));
      group_q_.resize(static_cast<size_t>(batch.max_group_rows * shape_.q_dim()));
      group_out_.resize(group_q_.size());
      group_lse_.resize(static_cast<size_t>(batch.max_group_rows * shape_.num_heads));
    }
    split_ready_ = false;
    return absl::OkStatus();
  }

  bool SupportsSplitLayer() const override { return true; }

  absl::Status LayerContext(int64_t layer, const void* q) override {
    if (!split_ready_) RETURN_IF_ERROR(PrepareSplit());
    const AttentionBatch& b = *batch_;
    const int64_t t = b.num_tokens(), qd = shape_.q_dim(), heads = shape_.num_heads;
    std::memcpy(q_.data(), q, static_cast<size_t>(t * qd) * sizeof(float));
    if (!split_) return absl::OkStatus();  // runs whole in LayerNew
    const float* kc = pool_->k[static_cast<size_t>(layer)].get();
    const float* vc = pool_->v[static_cast<size_t>(layer)].get();
    // Each request's rows over its keys before this step: every one of them precedes every row,
    // so no mask (an empty context gives the empty state, lse -inf).
    for (int64_t r = 0; r < b.num_requests(); ++r) {
      const int32_t row0 = b.q_indptr[static_cast<size_t>(r)];
      const int32_t k0 = ctx_kv_indptr_[static_cast<size_t>(r)];
      RETURN_IF_ERROR(
          kernels::cpu::PrefixAttention({.q = q_.data() + row0 * qd,
                                         .k_cache = kc,
                                         .v_cache = vc,
                                         .prefix_slots = ctx_kv_slots_.data() + k0,
                                         .out = ctx_out_.data() + row0 * qd,
                                         .lse = ctx_lse_.data() + row0 * heads,
                                         .rows = b.q_indptr[static_cast<size_t>(r) + 1] - row0,
                                         .prefix_len = ctx_kv_indptr_[static_cast<size_t>(r) + 1] - k0,
                                         .num_slots = num_slots_,
                                         .num_heads = heads,
                                         .num_kv_heads = shape_.num_kv_heads,
                                         .head_dim = shape_.head_dim,
                                         .scale = Scale()}));
    }
    return MergeGroups(kc, vc, ctx_out_.data(), ctx_lse_.data());
  }

  absl::Status LayerNew(int64_t layer, const void* kv_v, void* out) override {
    if (!split_ready_) return absl::FailedPreconditionError("LayerNew before LayerContext of the step");
    const AttentionBatch& b = *batch_;
    const int64_t t = b.num_tokens(), kvd = shape_.kv_dim(), heads = shape_.num_heads;
    const auto* kv = static_cast<const float*>(kv_v);
    float* kc = pool_->k[static_cast<size_t>(layer)].get();
    float* vc = pool_->v[static_cast<size_t>(layer)].get();
    for (int64_t r = 0; r < t; ++r) {
      const int64_t slot = b.new_slots[static_cast<size_t>(r)];
      std::memcpy(kc + slot * kvd, kv + r * 2 * kvd, static_cast<size_t>(kvd) * sizeof(float));
      std::memcpy(vc + slot * kvd, kv + r * 2 * kvd + kvd, static_cast<size_t>(kvd) * sizeof(float));
    }
    if (!split_) return Attend(kc, vc, static_cast<float*>(out));
    // The new rows' own keys, causal (request r's keys are its rows' slots, in position order),
    // then the merge with the context state.
    RETURN_IF_ERROR(kernels::cpu::Attention({.q = q_.data(),
                                             .k_cache = kc,
                                             .v_cache = vc,
                                             .out = new_out_.data(),
                                             .lse = new_lse_.data(),
                                             .q_indptr = b.q_indptr.data(),
                                             .kv_indptr = b.q_indptr.data(),
                                             .kv_slots = b.new_slots.data(),
                                             .num_requests = b.num_requests(),
                                             .num_slots = num_slots_,
                                             .num_heads = heads,
                                             .num_kv_heads = shape_.num_kv_heads,
                                             .head_dim = shape_.head_dim,
                                             .scale = Scale()}));
    return kernels::cpu::MergeAttentionStates({.out_a = ctx_out_.data(),
                                               .lse_a = ctx_lse_.data(),
                                               .out_b = new_out_.data(),
                                               .lse_b = new_lse_.data(),
                                               .out = static_cast<float*>(out),
                                               .rows = t,
                                               .num_heads = heads,
                                               .head_dim = shape_.head_dim});
  }

  absl::Status Layer(int64_t layer, const void* qkv_v, void* out) override {
    const AttentionBatch& b = *batch_;
    const int64_t t = b.num_tokens(), qd = shape_.q_dim(), kvd = shape_.kv_dim(), width = shape_.qkv_width();
    const auto* qkv = static_cast<const float*>(qkv_v);
    float* kc = pool_->k[static_cast<size_t>(layer)].get();
    float* vc = pool_->v[static_cast<size_t>(layer)].get();
    for (int64_t r = 0; r < t; ++r) {
      const float* row = qkv + r * width;
      const int64_t slot = b.new_slots[static_cast<size_t>(r)];
      std::memcpy(q_.data() + r * qd, row, static_cast<size_t>(qd) * sizeof(float));
      std::memcpy(kc + slot * kvd, row + qd, static_cast<size_t>(kvd) * sizeof(float));
      std::memcpy(vc + slot * kvd, row + qd + kvd, static_cast<size_t>(kvd) * sizeof(float));
    }
    return Attend(kc, vc, static_cast<float*>(out));
  }

  // Measured with bench/cpu_prefix_attention_bench (docs/benchmarks.md, 2 threads): the cascade
  // wins from about 256 shared keys with kv_dim 128 and 32-128 keys with kv_dim 1024, noisy at the
  // edge; the rule keeps to the safe side: at least 2 rows and prefix x kv_dim >= 64K elements.
  bool CascadePays(int64_t rows, int64_t prefix_tokens) const override {
    return rows >= kCascadeMinRows && prefix_tokens * shape_.kv_dim() >= kCascadeMinElements;
  }

  MemorySpace& memory() override { return memory_; }

  absl::Status ReadSlots(std::span<const int32_t> slots, uint8_t* out) const override {
    RETURN_IF_ERROR(CheckSlots(slots));
    const size_t row = static_cast<size_t>(shape_.kv_dim()) * sizeof(float);
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      for (const auto* cache :
           {pool_->k[static_cast<size_t>(l)].get(), pool_->v[static_cast<size_t>(l)].get()}) {
        for (int32_t s : slots) {
          std::memcpy(out, cache + static_cast<int64_t>(s) * shape_.kv_dim(), row);
          out += row;
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status WriteSlots(std::span<const int32_t> slots, const uint8_t* in) override {
    RETURN_IF_ERROR(CheckSlots(slots));
    const size_t row = static_cast<size_t>(shape_.kv_dim()) * sizeof(float);
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      for (float* cache : {pool_->k[static_cast<size_t>(l)].get(), pool_->v[static_cast<size_t>(l)].get()}) {
        for (int32_t s : slots) {
          std::memcpy(cache + static_cast<int64_t>(s) * shape_.kv_dim(), in, row);
          in += row;
        }
      }
    }
    return absl::OkStatus();
  }
  absl::Status CopySlots(std::span<const int32_t> src, std::span<const int32_t> dst) override {
    RETURN_IF_ERROR(CheckSlotCopy(src, dst, num_slots_));
    if (src.empty()) return absl::OkStatus();
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      for (float* cache : {pool_->k[static_cast<size_t>(l)].get(), pool_->v[static_cast<size_t>(l)].get()}) {
        RETURN_IF_ERROR(kernels::cpu::CopyRows({.cache = cache,
                                                .src = src.data(),
                                                .dst = dst.data(),
                                                .n = static_cast<int64_t>(src.size()),
                                                .width = shape_.kv_dim(),
                                                .num_rows = num_slots_}));
      }
    }
    return absl::OkStatus();
  }
  absl::Status RotateKeys(std::span<const int32_t> slots, std::span<const int32_t> from_positions,
                          std::span<const int32_t> to_positions, std::span<const float> inv_freq) override {
    RETURN_IF_ERROR(CheckRotation(shape_, slots, from_positions, to_positions, inv_freq));
    RETURN_IF_ERROR(CheckSlots(slots));
    if (slots.empty()) return absl::OkStatus();
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      RETURN_IF_ERROR(kernels::cpu::RopeShift({.k = pool_->k[static_cast<size_t>(l)].get(),
                                               .rows = slots.data(),
                                               .from_positions = from_positions.data(),
                                               .to_positions = to_positions.data(),
                                               .inv_freq = inv_freq.data(),
                                               .n = static_cast<int64_t>(slots.size()),
                                               .num_rows = num_slots_,
                                               .num_kv_heads = shape_.num_kv_heads,
                                               .head_dim = shape_.head_dim}));
    }
    return absl::OkStatus();
  }
  absl::Status WriteSlotsLayer(std::span<const int32_t> slots, int64_t layer, const uint8_t* in) override {
    RETURN_IF_ERROR(CheckSlots(slots));
    if (layer < 0 || layer >= shape_.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("KV tiers: layer ", layer, " outside the model"));
    const size_t row = static_cast<size_t>(shape_.kv_dim()) * sizeof(float);
    in += static_cast<size_t>(layer) * 2 * slots.size() * row;
    for (float* cache :
         {pool_->k[static_cast<size_t>(layer)].get(), pool_->v[static_cast<size_t>(layer)].get()}) {
      for (int32_t s : slots) {
        std::memcpy(cache + static_cast<int64_t>(s) * shape_.kv_dim(), in, row);
        in += row;
      }
    }
    return absl::OkStatus();
  }

 private:
  float Scale() const { return 1.0f / std::sqrt(static_cast<float>(shape_.head_dim)); }

  // The whole layer from q_ and the pool (this step's K and V already in it): each request's own
  // keys (its suffix when it is in a group), then each group's shared keys merged in.
  absl::Status Attend(const float* kc, const float* vc, float* o) {
    const AttentionBatch& b = *batch_;
    const int64_t groups = b.num_groups();
    RETURN_IF_ERROR(kernels::cpu::Attention({.q = q_.data(),
                                             .k_cache = kc,
                                             .v_cache = vc,
                                             .out = o,
                                             .lse = groups > 0 ? lse_.data() : nullptr,
                                             .q_indptr = b.q_indptr.data(),
                                             .kv_indptr = b.kv_indptr.data(),
                                             .kv_slots = b.kv_slots.data(),
                                             .num_requests = b.num_requests(),
                                             .num_slots = num_slots_,
                                             .num_heads = shape_.num_heads,
                                             .num_kv_heads = shape_.num_kv_heads,
                                             .head_dim = shape_.head_dim,
                                             .scale = Scale()}));
    return MergeGroups(kc, vc, o, lse_.data());
  }

  // Each group's shared keys once for all its rows (q_), merged into the state (o, lse) of each
  // of those rows.
  absl::Status MergeGroups(const float* kc, const float* vc, float* o, float* lse) {
    const AttentionBatch& b = *batch_;
    const int64_t qd = shape_.q_dim(), heads = shape_.num_heads;
    for (int64_t g = 0; g < b.num_groups(); ++g) {
      const int32_t row0 = b.group_row_indptr[static_cast<size_t>(g)];
      const int64_t n = b.group_row_indptr[static_cast<size_t>(g) + 1] - row0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = b.group_rows[static_cast<size_t>(row0 + i)];
        std::memcpy(group_q_.data() + i * qd, q_.data() + row * qd, static_cast<size_t>(qd) * sizeof(float));
      }
      const int32_t kv0 = b.group_kv_indptr[static_cast<size_t>(g)];
      RETURN_IF_ERROR(
          kernels::cpu::PrefixAttention({.q = group_q_.data(),
                                         .k_cache = kc,
                                         .v_cache = vc,
                                         .prefix_slots = b.group_kv_slots.data() + kv0,
                                         .out = group_out_.data(),
                                         .lse = group_lse_.data(),
                                         .rows = n,
                                         .prefix_len = b.group_kv_indptr[static_cast<size_t>(g) + 1] - kv0,
                                         .num_slots = num_slots_,
                                         .num_heads = heads,
                                         .num_kv_heads = shape_.num_kv_heads,
                                         .head_dim = shape_.head_dim,
                                         .scale = Scale()}));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = b.group_rows[static_cast<size_t>(row0 + i)];
        RETURN_IF_ERROR(kernels::cpu::MergeAttentionStates({.out_a = o + row * qd,
                                                            .lse_a = lse + row * heads,
                                                            .out_b = group_out_.data() + i * qd,
                                                            .lse_b = group_lse_.data() + i * heads,
                                                            .out = o + row * qd,
                                                            .lse = lse + row * heads,
                                                            .rows = 1,
                                                            .num_heads = heads,
                                                            .head_dim = shape_.head_dim}));
      }
    }
    return absl::OkStatus();
  }

  // Once per step, before its first LayerContext: whether the split holds (every request's keys
  // end with its new rows' slots, and no context or shared-prefix key is a new slot), and if so
  // each request's context keys (its keys less its new rows') and the split's scratch.
  absl::Status PrepareSplit() {
    if (batch_ == nullptr) return absl::FailedPreconditionError("LayerContext before BeginStep");
    const AttentionBatch& b = *batch_;
    const int64_t t = b.num_tokens(), heads = shape_.num_heads;
    split_ready_ = true;
    split_ = true;
    sorted_new_.assign(b.new_slots.begin(), b.new_slots.end());
    std::sort(sorted_new_.begin(), sorted_new_.end());
    auto is_new = [&](int32_t slot) {
      return std::binary_search(sorted_new_.begin(), sorted_new_.end(), slot);
    };
    ctx_kv_indptr_.assign(1, 0);
    ctx_kv_slots_.clear();
    for (int64_t r = 0; r < b.num_requests() && split_; ++r) {
      const int32_t q0 = b.q_indptr[static_cast<size_t>(r)],
                    q_len = b.q_indptr[static_cast<size_t>(r) + 1] - q0;
      const int32_t k0 = b.kv_indptr[static_cast<size_t>(r)], k1 = b.kv_indptr[static_cast<size_t>(r) + 1];
      if (k1 - k0 < q_len) {
        split_ = false;
        break;
      }
      for (int32_t i = 0; i < q_len; ++i) {
        if (b.kv_slots[static_cast<size_t>(k1 - q_len + i)] != b.new_slots[static_cast<size_t>(q0 + i)])
          split_ = false;
      }
      for (int32_t k = k0; k < k1 - q_len && split_; ++k) {
        const int32_t slot = b.kv_slots[static_cast<size_t>(k)];
        if (is_new(slot)) split_ = false;
        ctx_kv_slots_.push_back(slot);
      }
      ctx_kv_indptr_.push_back(static_cast<int32_t>(ctx_kv_slots_.size()));
    }
    for (size_t k = 0; k < b.group_kv_slots.size() && split_; ++k) split_ = !is_new(b.group_kv_slots[k]);
    if (!split_) {
      TANDEM_LOG_DEBUG("attention",
                       "q-first: this step's keys do not split into context and new rows; the "
                       "layers run whole");
      return absl::OkStatus();
    }
    ctx_out_.resize(static_cast<size_t>(t * shape_.q_dim()));
    new_out_.resize(ctx_out_.size());
    ctx_lse_.resize(static_cast<size_t>(t * heads));
    new_lse_.resize(ctx_lse_.size());
    if (b.num_groups() > 0) lse_.resize(ctx_lse_.size());
    return absl::OkStatus();
  }

  absl::Status CheckSlots(std::span<const int32_t> slots) const {
    for (int32_t s : slots) {
      if (s < 0 || s >= num_slots_)
        return absl::InvalidArgumentError(absl::StrCat("KV tiers: slot ", s, " outside the pool"));
    }
    return absl::OkStatus();
  }
  HostMemorySpace memory_;
  AttentionShape shape_;
  int64_t num_slots_;
  const AttentionBatch* batch_ = nullptr;
  std::shared_ptr<Pool> pool_;
  std::vector<float> q_, lse_;                          // (T, q_dim), (T, heads)
  std::vector<float> group_q_, group_out_, group_lse_;  // one group's rows
  // q-first (LayerContext / LayerNew): whether this step's split was checked and holds, each
  // request's context keys, and the two partial states.
  bool split_ready_ = false, split_ = false;
  std::vector<int32_t> sorted_new_, ctx_kv_indptr_, ctx_kv_slots_;
  std::vector<float> ctx_out_, ctx_lse_, new_out_, new_lse_;  // (T, q_dim), (T, heads)
  static constexpr int64_t kCascadeMinRows = 2, kCascadeMinElements = 65536;
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
  const int64_t bytes = slots * per_token;  // < 2^31 slots of a few KiB: no overflow
  if (const int64_t avail = AvailableHostBytes(); bytes > avail) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kv.capacity_tokens: ", slots, " tokens need ", bytes >> 20,
                     " MiB of host memory for the KV cache, but ", avail >> 20, " MiB are available"));
  }
  TANDEM_LOG_INFO("attention", "device cpu; KV cache ", slots, " tokens (", bytes >> 20, " MiB fp32)");
  try {
    return std::unique_ptr<AttentionExecutor>(new CpuAttentionExecutor(shape, slots));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("kv.capacity_tokens: could not allocate ", bytes >> 20,
                                                     " MiB of host memory for ", slots, " KV tokens"));
  }
}

}  // namespace tandem
