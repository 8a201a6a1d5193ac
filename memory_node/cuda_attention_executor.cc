// The CUDA attention executor: a bf16 token-granular KV pool on one device; per layer, the KV
// append, then the decode kernel for the single-row requests and the prefill kernel for chunks.
// One metadata upload per step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cuda/buffers.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/device_choice.h"
#include "kernels/cuda/ops.h"
#include "memory_node/attention_executor.h"

namespace tandem {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

namespace {

// One MergeStates launch of a step: metadata offsets of its row lists, and the pair count.
struct Merge {
  int64_t rows_a = 0, rows_b = 0, n = 0;
};

class CudaAttentionExecutor : public AttentionExecutor {
 public:
  absl::Status MarkLayerStart() override { return RecordTimingEvent(); }
  absl::Status MarkLayerEnd() override { return RecordTimingEvent(); }
  absl::StatusOr<uint64_t> TakeLayerTimeNs() override {
    double ms = 0;
    if (timing_used_ > 0) CUDA_RETURN_IF_ERROR(cudaEventSynchronize(timing_[timing_used_ - 1]));
    for (size_t i = 0; i + 1 < timing_used_; i += 2) {
      float part = 0;
      CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&part, timing_[i], timing_[i + 1]));
      ms += part;
    }
    timing_used_ = 0;
    return static_cast<uint64_t>(ms * 1e6);
  }

  ~CudaAttentionExecutor() override {
    for (cudaEvent_t e : timing_) cudaEventDestroy(e);
    if (host_meta_) cudaFreeHost(host_meta_);
    if (split_host_meta_) cudaFreeHost(split_host_meta_);
    if (own_stream_ && stream_) cudaStreamDestroy(stream_);
    if (side_) cudaStreamDestroy(side_);
    if (q_ready_) cudaEventDestroy(q_ready_);
    if (prefix_done_) cudaEventDestroy(prefix_done_);
    for (ReadBuffer& r : read_ring_) {
      if (r.done) cudaEventSynchronize(r.done);
      if (r.ready) cudaEventDestroy(r.ready);
      if (r.done) cudaEventDestroy(r.done);
    }
    if (copy_) cudaStreamDestroy(copy_);
  }

  static absl::StatusOr<std::unique_ptr<AttentionExecutor>> Create(const AttentionShape& shape,
                                                                   const KvPoolOptions& kv, int device,
                                                                   void* stream) {
    if (std::string why = kernels::CudaAttentionUnsupported(shape.head_dim); !why.empty()) {
      return absl::UnimplementedError(why);
    }
    ASSIGN_OR_RETURN(const int count, kernels::CudaDeviceCount());
    if (device < 0 || device >= count) {
      return absl::UnavailableError(
          absl::StrCat("cuda:", device, " requested but ", count, " CUDA device(s) are visible"));
    }
    std::unique_ptr<CudaAttentionExecutor> e(new CudaAttentionExecutor());
    e->shape_ = shape;
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
    e->device_name_ = absl::StrCat("cuda:", device, " (", prop.name, ")");
    e->num_sms_ = prop.multiProcessorCount;
    if (stream) {
      e->stream_ = static_cast<cudaStream_t>(stream);
    } else {
      CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&e->stream_, cudaStreamNonBlocking));
      e->own_stream_ = true;
    }
    e->memory_.set_stream(e->stream_);
    RETURN_IF_ERROR(e->InitScratch());

    // KV: the configured share of what is free now (after whatever this process loaded before).
    const int64_t per_token = shape.kv_bytes_per_token(2);
    int64_t slots = kv.capacity_tokens;
    size_t free_b = 0, total_b = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
    if (slots == 0) {
      slots = static_cast<int64_t>(static_cast<double>(free_b) * kv.memory_fraction) / per_token;
      if (kv.max_useful_tokens > 0) slots = std::min(slots, kv.max_useful_tokens);
      slots = std::min<int64_t>(slots, INT32_MAX);
      if (slots < 1) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "no device memory left for the KV cache on %s (%.2f GiB free, %d bytes per token)",
            e->device_name_, free_b / 1073741824.0, per_token));
      }
    }
    if (slots > INT32_MAX) return absl::InvalidArgumentError("kv.capacity_tokens exceeds 2^31-1");
    e->kv_ = std::make_shared<kc::DeviceBuffer>();
    RETURN_IF_ERROR(Annotate(e->kv_->Reserve(slots * per_token),
                             absl::StrFormat("allocating the KV cache (%d tokens, %.2f GiB) on %s", slots,
                                             slots * per_token / 1073741824.0, e->device_name_)));
    e->num_slots_ = slots;
    RETURN_IF_ERROR(e->InitMeta());
    TANDEM_LOG_INFO("attention", absl::StrFormat("device %s; KV cache %d tokens (%.2f GiB bf16)",
                                                 e->device_name_, slots, slots * per_token / 1073741824.0));
    return std::unique_ptr<AttentionExecutor>(std::move(e));
  }

  absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateLane() override {
    std::unique_ptr<CudaAttentionExecutor> e(new CudaAttentionExecutor());
    e->shape_ = shape_;
    e->device_name_ = device_name_;
    e->num_sms_ = num_sms_;
    e->stream_ = stream_;  // not owned
    e->memory_.set_stream(stream_);
    e->kv_ = kv_;
    e->num_slots_ = num_slots_;
    e->expect_split_ = expect_split_;
    RETURN_IF_ERROR(e->InitScratch());
    RETURN_IF_ERROR(e->InitMeta());
    return std::unique_ptr<AttentionExecutor>(std::move(e));
  }

  int64_t kv_capacity() const override { return num_slots_; }
  std::string device() const override { return device_name_; }
  DType dtype() const override { return DType::kBF16; }
  const AttentionShape& shape() const override { return shape_; }

  absl::Status BeginStep(const AttentionBatch& b) override {
    RETURN_IF_ERROR(CheckAttentionBatch(b, shape_, num_slots_));
    batch_ = &b;
    split_ready_ = false;
    const int64_t num_req = b.num_requests(), ns = b.num_single;
    t_ = b.num_tokens();
    ns_ = ns;
    nm_ = num_req - ns;
    max_kv_len_ = b.max_kv_len;
    max_q_len_ = b.max_q_len;
    // Single-row and multi-row groups rebased to start at 0.
    packer_.Reset();
    o_new_ = packer_.Add(b.new_slots);
    kv_split_ = b.kv_indptr[static_cast<size_t>(ns)];
    q_split_ = b.q_indptr[static_cast<size_t>(ns)];
    std::vector<int32_t> kv_s(b.kv_indptr.begin(), b.kv_indptr.begin() + ns + 1);
    std::vector<int32_t> q_m, kv_m;
    for (int64_t r = ns; r <= num_req; ++r) {
      q_m.push_back(b.q_indptr[static_cast<size_t>(r)] - q_split_);
      kv_m.push_back(b.kv_indptr[static_cast<size_t>(r)] - kv_split_);
    }
    o_kv_s_ = packer_.Add(kv_s);
    o_q_m_ = packer_.Add(q_m);
    o_kv_m_ = packer_.Add(kv_m);
    o_slots_ = packer_.Add(b.kv_slots);
    RETURN_IF_ERROR(PlanGroups(b));
    const std::vector<unsigned char>& mb = packer_.bytes();
    // The pinned buffer may still feed the previous step's copy: wait for it.
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (static_cast<int64_t>(mb.size()) > host_meta_bytes_) {
      // Contexts that share attached prefix blocks can list more slots than the pool has.
      const int64_t grown = static_cast<int64_t>(mb.size()) * 3 / 2;
      CUDA_RETURN_IF_ERROR(cudaFreeHost(host_meta_));
      host_meta_ = nullptr;
      host_meta_bytes_ = 0;
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_meta_, static_cast<size_t>(grown)));
      host_meta_bytes_ = grown;
      RETURN_IF_ERROR(meta_.Reserve(grown));
    }
    std::memcpy(host_meta_, mb.data(), mb.size());
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.ptr, host_meta_, mb.size(), cudaMemcpyHostToDevice, stream_));
    if (ns > 0) {
      plan_ = kc::PlanDecodeAttention(ns, shape_.num_heads, shape_.num_kv_heads, shape_.head_dim,
                                      b.max_kv_len, num_sms_);
      RETURN_IF_ERROR(decode_ws_.Reserve(std::max<int64_t>(16, plan_.workspace_bytes)));
    }
    if (expect_split_) RETURN_IF_ERROR(PrepareSplit());
    return absl::OkStatus();
  }

  absl::Status Layer(int64_t layer, const void* qkv_v, void* out_v) override {
    const int64_t width = shape_.qkv_width(), q_dim = shape_.q_dim(), kv_dim = shape_.kv_dim();
    const auto* qkv = static_cast<const bf16*>(qkv_v);
    RETURN_IF_ERROR(AppendKv(layer, qkv + q_dim, qkv + q_dim + kv_dim, width));
    CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(q_.ptr, q_dim * 2, qkv, width * 2, q_dim * 2, t_,
                                           cudaMemcpyDeviceToDevice, stream_));
    return Attend(layer, static_cast<bf16*>(out_v));
  }

  // q-first: the context part. Single rows run the decode kernel (split-KV over long contexts),
  // chunks the prefill kernel without mask, each over its request's keys before the step into
  // (ctx_out_, ctx_lse_); the groups' shared keys are merged in as Layer merges them.
  bool SupportsSplitLayer() const override { return true; }
  void ExpectSplitLayers() override { expect_split_ = true; }

  absl::Status LayerContext(int64_t layer, const void* q) override {
    if (!split_ready_) RETURN_IF_ERROR(PrepareSplit());
    const int64_t q_dim = shape_.q_dim(), heads = shape_.num_heads;
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(q_.ptr, q, static_cast<size_t>(t_ * q_dim * 2), cudaMemcpyDeviceToDevice, stream_));
    if (!split_ || !ctx_any_) return absl::OkStatus();  // whole in LayerNew, or nothing before the step
    const kc::AttentionParams ap = LayerParams(layer);
    bf16* qb = q_.as<bf16>();
    bf16* ctx_out = ctx_out_.as<bf16>();
    float* ctx_lse = ctx_lse_.as<float>();
    if (groups_ > 0) RETURN_IF_ERROR(SharedPrefixes(ap, qb));
    if (ns_ > 0) {
      kc::AttentionParams d = ap;
      d.q = qb;
      d.out = ctx_out;
      d.lse = ctx_lse;
      d.q_indptr = nullptr;
      d.kv_indptr = split_meta_.as<int32_t>(o_ctx_s_);
      d.kv_slots = split_meta_.as<int32_t>(o_ctx_slots_);
      d.num_requests = ns_;
      d.max_q_len = 1;
      d.max_kv_len = std::max<int64_t>(1, max_ctx_single_);  // empty contexts give the empty state
      RETURN_IF_ERROR(kc::DecodeAttention(d, ctx_plan_, decode_ws_.ptr, stream_));
    }
    if (nm_ > 0) {
      kc::AttentionParams p = ap;
      p.causal = false;
      p.q = qb + static_cast<int64_t>(q_split_) * q_dim;
      p.out = ctx_out + static_cast<int64_t>(q_split_) * q_dim;
      p.lse = ctx_lse + static_cast<int64_t>(q_split_) * heads;
      p.q_indptr = meta_.as<int32_t>(o_q_m_);
      p.kv_indptr = split_meta_.as<int32_t>(o_ctx_m_);
      p.kv_slots = split_meta_.as<int32_t>(o_ctx_slots_) + ctx_split_;
      p.num_requests = nm_;
      p.max_q_len = max_q_len_;
      p.max_kv_len = std::max<int64_t>(1, max_ctx_multi_);
      RETURN_IF_ERROR(kc::PrefillAttention(p, stream_));
    }
    if (groups_ > 0) RETURN_IF_ERROR(MergeSharedPrefixes(ctx_out, ctx_lse));
    return absl::OkStatus();
  }

  // q-first: the new part. k,v appended as Layer appends them; each request's rows over its new
  // keys (causal: request r's new keys are its rows' slots) straight into out, then the context
  // state merged in (MergeStates: an empty context state leaves a row's bits as they are).
  absl::Status LayerNew(int64_t layer, const void* kv_v, void* out_v) override {
    if (!split_ready_) return absl::FailedPreconditionError("LayerNew before LayerContext of the step");
    const int64_t q_dim = shape_.q_dim(), kv_dim = shape_.kv_dim(), heads = shape_.num_heads;
    const auto* kv = static_cast<const bf16*>(kv_v);
    auto* out = static_cast<bf16*>(out_v);
    RETURN_IF_ERROR(AppendKv(layer, kv, kv + kv_dim, 2 * kv_dim));
    if (!split_) return Attend(layer, out);
    const kc::AttentionParams ap = LayerParams(layer);
    bf16* qb = q_.as<bf16>();
    float* new_lse = ctx_any_ ? new_lse_.as<float>() : nullptr;
    if (ns_ > 0) {
      kc::AttentionParams d = ap;
      d.q = qb;
      d.out = out;
      d.lse = new_lse;
      d.q_indptr = nullptr;
      d.kv_indptr = split_meta_.as<int32_t>(o_q_s_);  // one key each: the row's own
      d.kv_slots = meta_.as<int32_t>(o_new_);
      d.num_requests = ns_;
      d.max_q_len = 1;
      d.max_kv_len = 1;
      RETURN_IF_ERROR(kc::DecodeAttention(d, new_plan_, decode_ws_.ptr, stream_));
    }
    if (nm_ > 0) {
      kc::AttentionParams p = ap;
      p.q = qb + static_cast<int64_t>(q_split_) * q_dim;
      p.out = out + static_cast<int64_t>(q_split_) * q_dim;
      p.lse = new_lse == nullptr ? nullptr : new_lse + static_cast<int64_t>(q_split_) * heads;
      p.q_indptr = meta_.as<int32_t>(o_q_m_);
      p.kv_indptr = meta_.as<int32_t>(o_q_m_);  // as many keys as rows
      p.kv_slots = meta_.as<int32_t>(o_new_) + q_split_;
      p.num_requests = nm_;
      p.max_q_len = max_q_len_;
      p.max_kv_len = max_q_len_;
      RETURN_IF_ERROR(kc::PrefillAttention(p, stream_));
    }
    if (!ctx_any_) return absl::OkStatus();
    return kc::MergeStates({.out = out,
                            .lse = new_lse,
                            .out_b = ctx_out_.as<bf16>(),
                            .lse_b = ctx_lse_.as<float>(),
                            .n = t_,
                            .num_heads = heads,
                            .head_dim = shape_.head_dim},
                           stream_);
  }

  // Layer `layer`'s K and V rows of the step (row i at k + i * stride, v + i * stride) into the
  // new slots.
  absl::Status AppendKv(int64_t layer, const bf16* k, const bf16* v, int64_t stride) {
    const int64_t kv_dim = shape_.kv_dim(), layer_kv = num_slots_ * kv_dim;
    bf16* kc_layer = kv_->as<bf16>() + 2 * layer * layer_kv;
    kc::KvAppendParams app;
    app.k = k;
    app.v = v;
    app.k_stride = stride;
    app.v_stride = stride;
    app.slots = meta_.as<int32_t>(o_new_);
    app.k_cache = kc_layer;
    app.v_cache = kc_layer + layer_kv;
    app.n = t_;
    app.kv_dim = kv_dim;
    app.num_slots = num_slots_;
    return kc::KvAppend(app, stream_);
  }

  // What every attention launch of layer `layer` shares.
  kc::AttentionParams LayerParams(int64_t layer) const {
    const int64_t layer_kv = num_slots_ * shape_.kv_dim();  // elements of one layer's K (or V)
    kc::AttentionParams ap;
    ap.k_cache = kv_->as<bf16>() + 2 * layer * layer_kv;
    ap.v_cache = ap.k_cache + layer_kv;
    ap.num_slots = num_slots_;
    ap.num_heads = shape_.num_heads;
    ap.num_kv_heads = shape_.num_kv_heads;
    ap.head_dim = shape_.head_dim;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
    ap.max_kv_len = max_kv_len_;
    return ap;
  }

  // The whole layer from q_ and the pool (this step's K and V already in it): single rows by the
  // decode kernel, chunks by the prefill kernel, each over its own keys (its suffix when it is in a
  // group), then the groups' shared keys merged in.
  absl::Status Attend(int64_t layer, bf16* out) {
    const int64_t q_dim = shape_.q_dim();
    bf16* q = q_.as<bf16>();
    const kc::AttentionParams ap = LayerParams(layer);
    if (groups_ > 0) RETURN_IF_ERROR(SharedPrefixes(ap, q));
    if (ns_ > 0) {
      kc::AttentionParams d = ap;
      d.q = q;
      d.out = out;
      d.q_indptr = nullptr;
      d.kv_indptr = meta_.as<int32_t>(o_kv_s_);
      d.kv_slots = meta_.as<int32_t>(o_slots_);
      d.num_requests = ns_;
      d.max_q_len = 1;
      if (groups_ > 0) d.lse = lse_.as<float>();
      RETURN_IF_ERROR(kc::DecodeAttention(d, plan_, decode_ws_.ptr, stream_));
    }
    if (nm_ > 0) {
      kc::AttentionParams p = ap;
      p.q = q + static_cast<int64_t>(q_split_) * q_dim;
      p.out = out + static_cast<int64_t>(q_split_) * q_dim;
      p.q_indptr = meta_.as<int32_t>(o_q_m_);
      p.kv_indptr = meta_.as<int32_t>(o_kv_m_);
      p.kv_slots = meta_.as<int32_t>(o_slots_) + kv_split_;
      p.num_requests = nm_;
      p.max_q_len = max_q_len_;
      if (groups_ > 0) p.lse = lse_.as<float>() + static_cast<int64_t>(q_split_) * shape_.num_heads;
      RETURN_IF_ERROR(kc::PrefillAttention(p, stream_));
    }
    if (groups_ > 0) RETURN_IF_ERROR(MergeSharedPrefixes(out, lse_.as<float>()));
    return absl::OkStatus();
  }

  // q-first, once per step (in BeginStep after ExpectSplitLayers, else in the step's first
  // LayerContext): whether the split holds (every request's keys end with its new rows' slots, and
  // no context or shared-prefix key is a new slot), as the CPU executor decides it, and if so each
  // request's context keys, uploaded on the stream from a pinned buffer of their own (BeginStep's
  // copy from host_meta_ may still be in flight), and the scratch of the two states.
  absl::Status PrepareSplit() {
    if (batch_ == nullptr) return absl::FailedPreconditionError("LayerContext before BeginStep");
    const AttentionBatch& b = *batch_;
    split_ready_ = true;
    split_ = true;
    ctx_any_ = false;
    sorted_new_.assign(b.new_slots.begin(), b.new_slots.end());
    std::sort(sorted_new_.begin(), sorted_new_.end());
    auto is_new = [&](int32_t slot) {
      return std::binary_search(sorted_new_.begin(), sorted_new_.end(), slot);
    };
    ctx_kv_indptr_.assign(1, 0);
    ctx_kv_slots_.clear();
    max_ctx_single_ = max_ctx_multi_ = 0;
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
      int64_t& max_ctx = r < ns_ ? max_ctx_single_ : max_ctx_multi_;
      max_ctx = std::max<int64_t>(max_ctx, k1 - q_len - k0);
    }
    for (size_t k = 0; k < b.group_kv_slots.size() && split_; ++k) split_ = !is_new(b.group_kv_slots[k]);
    if (!split_) {
      TANDEM_LOG_DEBUG("attention",
                       "q-first: this step's keys do not split into context and new rows; the "
                       "layers run whole");
      return absl::OkStatus();
    }
    ctx_any_ = !ctx_kv_slots_.empty() || groups_ > 0;
    // Single rows' new keys: kv_indptr 0, 1, .., ns over new_slots (the rows' q_indptr).
    split_packer_.Reset();
    o_q_s_ = split_packer_.Add(b.q_indptr.data(), static_cast<size_t>(ns_) + 1);
    if (ctx_any_) {
      ctx_split_ = ctx_kv_indptr_[static_cast<size_t>(ns_)];
      std::vector<int32_t> ctx_m;
      for (size_t r = static_cast<size_t>(ns_); r < ctx_kv_indptr_.size(); ++r)
        ctx_m.push_back(ctx_kv_indptr_[r] - ctx_split_);
      o_ctx_s_ = split_packer_.Add(ctx_kv_indptr_.data(), static_cast<size_t>(ns_) + 1);
      o_ctx_m_ = split_packer_.Add(ctx_m);
      o_ctx_slots_ = split_packer_.Add(ctx_kv_slots_);
    }
    const std::vector<unsigned char>& mb = split_packer_.bytes();
    if (static_cast<int64_t>(mb.size()) > split_host_bytes_) {
      const int64_t grown = std::max<int64_t>(4096, static_cast<int64_t>(mb.size()) * 3 / 2);
      if (split_host_meta_) CUDA_RETURN_IF_ERROR(cudaFreeHost(split_host_meta_));
      split_host_meta_ = nullptr;
      split_host_bytes_ = 0;
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&split_host_meta_, static_cast<size_t>(grown)));
      split_host_bytes_ = grown;
      RETURN_IF_ERROR(split_meta_.Reserve(grown));
    }
    std::memcpy(split_host_meta_, mb.data(), mb.size());
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(split_meta_.ptr, split_host_meta_, mb.size(), cudaMemcpyHostToDevice, stream_));
    const int64_t heads = shape_.num_heads;
    if (ctx_any_) {
      RETURN_IF_ERROR(ctx_out_.Reserve(std::max<int64_t>(16, t_ * shape_.q_dim() * 2)));
      RETURN_IF_ERROR(ctx_lse_.Reserve(std::max<int64_t>(16, t_ * heads * 4)));
      RETURN_IF_ERROR(new_lse_.Reserve(std::max<int64_t>(16, t_ * heads * 4)));
    }
    if (ns_ > 0) {
      new_plan_ = kc::PlanDecodeAttention(ns_, heads, shape_.num_kv_heads, shape_.head_dim, 1, num_sms_);
      ctx_plan_ = kc::PlanDecodeAttention(ns_, heads, shape_.num_kv_heads, shape_.head_dim,
                                          std::max<int64_t>(1, max_ctx_single_), num_sms_);
      RETURN_IF_ERROR(decode_ws_.Reserve(std::max<int64_t>(
          {16, plan_.workspace_bytes, new_plan_.workspace_bytes, ctx_plan_.workspace_bytes})));
    }
    return absl::OkStatus();
  }

  // Shared-prefix metadata of a step. The prefix launch has one "request" per (group, split):
  // PrefillAttention has no split over keys, so a group whose (row tile, head) CTAs would leave
  // SMs idle cuts its keys into splits (about one wave, at least 512 keys each), each reading the
  // same gathered rows. Split states are merged pairwise into split 0 (upper half into lower half,
  // all groups per round), then each group's split 0 into its rows' states, one level at a time
  // (a row is in one group per level).
  absl::Status PlanGroups(const AttentionBatch& b) {
    groups_ = b.num_groups();
    levels_.clear();
    rounds_.clear();
    if (groups_ == 0) return absl::OkStatus();
    const auto at = [](const std::vector<int32_t>& v, int64_t i) { return v[static_cast<size_t>(i)]; };
    // One query head per CTA. GQA packing (a KV head's query heads as rows of one launch,
    // GatherRowsParams::pack) measured no faster on llama3-8b (bench/prefix_attention_bench,
    // nopack column: 0.85-1.1x), so it is not used here.
    const int64_t tile = b.max_group_rows <= 64 ? 64 : 128;
    int64_t ctas = 0;
    for (int64_t g = 0; g < groups_; ++g) {
      const int64_t rows = at(b.group_row_indptr, g + 1) - at(b.group_row_indptr, g);
      ctas += shape_.num_heads * ((rows + tile - 1) / tile);
    }
    const int64_t want = ctas >= num_sms_ ? 1 : (2 * num_sms_ + ctas - 1) / ctas;
    std::vector<int32_t> gather, q_indptr{0}, kv_indptr{0}, base(static_cast<size_t>(groups_)), splits;
    int64_t max_chunk = 0;
    for (int64_t g = 0; g < groups_; ++g) {
      const int32_t r0 = at(b.group_row_indptr, g), rows = at(b.group_row_indptr, g + 1) - r0;
      const int32_t k0 = at(b.group_kv_indptr, g), keys = at(b.group_kv_indptr, g + 1) - k0;
      const int32_t k = static_cast<int32_t>(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, keys / 512)));
      base[static_cast<size_t>(g)] = static_cast<int32_t>(gather.size());
      splits.push_back(k);
      for (int32_t j = 0; j < k; ++j) {
        gather.insert(gather.end(), b.group_rows.begin() + r0, b.group_rows.begin() + r0 + rows);
        q_indptr.push_back(static_cast<int32_t>(gather.size()));
        const int32_t end = k0 + static_cast<int32_t>(static_cast<int64_t>(keys) * (j + 1) / k);
        max_chunk = std::max<int64_t>(max_chunk, end - kv_indptr.back());
        kv_indptr.push_back(end);
      }
    }
    // kv_indptr above is relative to group_kv_slots: pairs cover each group's keys in order.
    prefix_requests_ = static_cast<int64_t>(q_indptr.size()) - 1;
    group_rows_ = static_cast<int64_t>(gather.size());
    max_group_rows_ = b.max_group_rows;
    max_group_kv_ = max_chunk;
    o_g_rows_ = packer_.Add(gather);
    o_g_q_ = packer_.Add(q_indptr);
    o_g_kv_ = packer_.Add(kv_indptr);
    o_g_slots_ = packer_.Add(b.group_kv_slots);
    // Split reduction rounds: for every group with m > 1 live splits, [m - m/2, m) into [0, m/2).
    std::vector<int32_t> live = splits;
    for (bool more = true; more;) {
      more = false;
      std::vector<int32_t> ra, rb;
      for (int64_t g = 0; g < groups_; ++g) {
        int32_t& m = live[static_cast<size_t>(g)];
        if (m <= 1) continue;
        const int32_t rows = at(b.group_row_indptr, g + 1) - at(b.group_row_indptr, g), half = m / 2;
        for (int32_t i = 0; i < half * rows; ++i) {
          ra.push_back(base[static_cast<size_t>(g)] + i);
          rb.push_back(base[static_cast<size_t>(g)] + (m - half) * rows + i);
        }
        m -= half;
        more = true;
      }
      if (!ra.empty()) rounds_.push_back({packer_.Add(ra), packer_.Add(rb), static_cast<int64_t>(ra.size())});
    }
    int32_t num_levels = 0;
    for (int32_t l : b.group_level) num_levels = std::max(num_levels, l + 1);
    std::vector<std::vector<int32_t>> rows_a(static_cast<size_t>(num_levels)), rows_b(rows_a.size());
    for (int64_t g = 0; g < groups_; ++g) {
      const size_t l = static_cast<size_t>(at(b.group_level, g));
      for (int32_t k = at(b.group_row_indptr, g); k < at(b.group_row_indptr, g + 1); ++k) {
        rows_a[l].push_back(b.group_rows[static_cast<size_t>(k)]);
        rows_b[l].push_back(base[static_cast<size_t>(g)] + k - at(b.group_row_indptr, g));
      }
    }
    for (size_t l = 0; l < rows_a.size(); ++l) {
      levels_.push_back(
          {packer_.Add(rows_a[l]), packer_.Add(rows_b[l]), static_cast<int64_t>(rows_a[l].size())});
    }
    RETURN_IF_ERROR(lse_.Reserve(std::max<int64_t>(16, t_ * shape_.num_heads * 4)));
    RETURN_IF_ERROR(group_q_.Reserve(std::max<int64_t>(16, group_rows_ * shape_.q_dim() * 2)));
    RETURN_IF_ERROR(group_out_.Reserve(std::max<int64_t>(16, group_rows_ * shape_.q_dim() * 2)));
    RETURN_IF_ERROR(group_lse_.Reserve(std::max<int64_t>(16, group_rows_ * shape_.num_heads * 4)));
    return absl::OkStatus();
  }

  // Cascade, part 1: every group's shared keys once for all its rows (tensor cores, no mask) on
  // the side stream, concurrent with the rows' own keys on the main stream (see PlanGroups). The
  // prefix keys were written in earlier steps; q is ready once the main stream gets here.
  absl::Status SharedPrefixes(const kc::AttentionParams& ap, const bf16* q) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(q_ready_, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(side_, q_ready_, 0));
    RETURN_IF_ERROR(kc::GatherRows({.src = q,
                                    .dst = group_q_.as<bf16>(),
                                    .rows = meta_.as<int32_t>(o_g_rows_),
                                    .n = group_rows_,
                                    .width = shape_.q_dim(),
                                    .src_stride = shape_.q_dim()},
                                   side_));
    kc::AttentionParams p = ap;
    p.causal = false;
    p.q = group_q_.as<bf16>();
    p.out = group_out_.as<bf16>();
    p.lse = group_lse_.as<float>();
    p.q_indptr = meta_.as<int32_t>(o_g_q_);
    p.kv_indptr = meta_.as<int32_t>(o_g_kv_);
    p.kv_slots = meta_.as<int32_t>(o_g_slots_);
    p.num_requests = prefix_requests_;
    p.max_q_len = max_group_rows_;
    p.max_kv_len = max_group_kv_;
    RETURN_IF_ERROR(kc::PrefillAttention(p, side_));
    for (const Merge& m : rounds_) {
      RETURN_IF_ERROR(Merge1(m, group_out_.as<bf16>(), group_lse_.as<float>(), side_));
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(prefix_done_, side_));
    return absl::OkStatus();
  }

  // Cascade, part 2 (main stream, after the rows' own keys): each group's state merged into its
  // rows' states (out, lse), one level at a time.
  absl::Status MergeSharedPrefixes(bf16* out, float* lse) {
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, prefix_done_, 0));
    for (const Merge& m : levels_) RETURN_IF_ERROR(Merge1(m, out, lse, stream_));
    return absl::OkStatus();
  }

  // One MergeStates launch into (o, lse) from the group states.
  absl::Status Merge1(const Merge& m, bf16* o, float* lse, cudaStream_t stream) {
    return kc::MergeStates({.out = o,
                            .lse = lse,
                            .out_b = group_out_.as<bf16>(),
                            .lse_b = group_lse_.as<float>(),
                            .rows_a = meta_.as<int32_t>(m.rows_a),
                            .rows_b = meta_.as<int32_t>(m.rows_b),
                            .n = m.n,
                            .num_heads = shape_.num_heads,
                            .head_dim = shape_.head_dim},
                           stream);
  }

  // Measured on an H200 (bench/prefix_attention_bench --crossover; docs/benchmarks.md): below 16
  // rows the gather, the extra launch and the merges (about 20 µs a layer) never pay; from 16 rows
  // the cascade wins once the plain kernel would read about 80M shared K/V elements a layer (rows x
  // prefix x kv_dim: 64 rows x 1K keys on llama3-8b, 16 rows x 1K on llama-13b).
  bool CascadePays(int64_t rows, int64_t prefix_tokens) const override {
    return rows >= kCascadeMinRows && rows * prefix_tokens * shape_.kv_dim() >= kCascadeMinElements;
  }

  MemorySpace& memory() override { return memory_; }
  void* stream() const override { return stream_; }

  // KV tiers: a block's slots are gathered into (or scattered from) a device staging buffer in
  // ReadSlots' layout with the existing row kernels (GatherRows, KvAppend), and that buffer is copied
  // to or from the host buffer in one piece, on the executor's stream. ReadSlots waits for its copy
  // (the caller reads `out` next); the writes are stream-ordered before the attention that reads
  // the slots, and read their host bytes asynchronously when those are pinned: the caller keeps
  // them until memory().Synchronize() (KvTiers does).
  absl::Status ReadSlots(std::span<const int32_t> slots, uint8_t* out) const override {
    RETURN_IF_ERROR(CheckSlots(slots));
    const int64_t n = static_cast<int64_t>(slots.size()), kv_dim = shape_.kv_dim();
    if (n == 0) return absl::OkStatus();
    RETURN_IF_ERROR(UploadSlots(slots, shape_.num_layers));
    bf16* stage = tier_stage_.as<bf16>();
    RETURN_IF_ERROR(GatherSlots(n, stage));
    const size_t bytes = static_cast<size_t>(shape_.num_layers * 2 * n * kv_dim * 2);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out, stage, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  // The asynchronous save: the gathers run on the executor's stream (before anything enqueued later
  // can overwrite the slots), into one of kReadRing device staging buffers; the device-to-host copy
  // runs on a copy stream of its own, beside the step's work. A ring buffer is reused once its
  // previous copy is done.
  bool AsyncReads() const override { return true; }
  absl::StatusOr<int64_t> StartReadSlots(std::span<const int32_t> slots, uint8_t* out) override {
    RETURN_IF_ERROR(CheckSlots(slots));
    const int64_t n = static_cast<int64_t>(slots.size()), kv_dim = shape_.kv_dim();
    if (n == 0) return int64_t{-1};
    if (copy_ == nullptr) CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    const int64_t ticket = next_read_++;
    ReadBuffer& r = read_ring_[static_cast<size_t>(ticket % kReadRing)];
    if (r.done == nullptr) {
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&r.ready, cudaEventDisableTiming));
      CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&r.done, cudaEventDisableTiming));
    } else {
      CUDA_RETURN_IF_ERROR(cudaEventSynchronize(r.done));
    }
    const int64_t bytes = shape_.num_layers * 2 * n * kv_dim * 2;
    RETURN_IF_ERROR(r.stage.Reserve(bytes));
    RETURN_IF_ERROR(UploadSlots(slots, 0));
    RETURN_IF_ERROR(GatherSlots(n, r.stage.as<bf16>()));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(r.ready, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(copy_, r.ready, 0));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(out, r.stage.ptr, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, copy_));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(r.done, copy_));
    return ticket;
  }
  // Waits for the ticket's copy (or a later one of its ring buffer, which the copy stream runs after
  // it). The event handles are made before the ticket is handed out and never replaced.
  absl::Status FinishReadSlots(int64_t ticket) override {
    if (ticket < 0) return absl::OkStatus();
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(read_ring_[static_cast<size_t>(ticket % kReadRing)].done));
    return absl::OkStatus();
  }
  // kv.store_pre_rope: the slot pairs go up in one copy (pageable: staged before it returns), then one
  // CopyRows launch copies them in every layer's K and V planes, on the executor's stream.
  absl::Status CopySlots(std::span<const int32_t> src, std::span<const int32_t> dst) override {
    RETURN_IF_ERROR(CheckSlotCopy(src, dst, num_slots_));
    const int64_t n = static_cast<int64_t>(src.size());
    if (n == 0) return absl::OkStatus();
    std::vector<int32_t> pairs(src.begin(), src.end());
    pairs.insert(pairs.end(), dst.begin(), dst.end());
    RETURN_IF_ERROR(copy_meta_.Reserve(2 * n * 4));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(copy_meta_.ptr, pairs.data(), pairs.size() * 4, cudaMemcpyHostToDevice, stream_));
    return kc::CopyRows({.cache = kv_->as<bf16>(),
                         .src = copy_meta_.as<int32_t>(),
                         .dst = copy_meta_.as<int32_t>() + n,
                         .n = n,
                         .width = shape_.kv_dim(),
                         .num_rows = num_slots_,
                         .planes = 2 * shape_.num_layers,
                         .plane_stride = num_slots_ * shape_.kv_dim()},
                        stream_);
  }
  // kv.store_pre_rope: the slots, their positions and the frequencies go up in one copy (from pageable
  // memory: staged before cudaMemcpyAsync returns), then one kernel turns every layer's keys, on the
  // executor's stream.
  absl::Status RotateKeys(std::span<const int32_t> slots, std::span<const int32_t> from_positions,
                          std::span<const int32_t> to_positions, std::span<const float> inv_freq) override {
    RETURN_IF_ERROR(CheckRotation(shape_, slots, from_positions, to_positions, inv_freq));
    RETURN_IF_ERROR(CheckSlots(slots));
    const int64_t n = static_cast<int64_t>(slots.size());
    if (n == 0) return absl::OkStatus();
    std::vector<int32_t> meta(static_cast<size_t>(3 * n + static_cast<int64_t>(inv_freq.size())));
    std::copy(slots.begin(), slots.end(), meta.begin());
    std::copy(from_positions.begin(), from_positions.end(), meta.begin() + n);
    std::copy(to_positions.begin(), to_positions.end(), meta.begin() + 2 * n);
    std::memcpy(meta.data() + 3 * n, inv_freq.data(), inv_freq.size() * sizeof(float));
    RETURN_IF_ERROR(shift_meta_.Reserve(static_cast<int64_t>(meta.size()) * 4));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(shift_meta_.ptr, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice, stream_));
    const int32_t* d = shift_meta_.as<int32_t>();
    return kc::RopeShift({.k = kv_->as<bf16>(),
                          .rows = d,
                          .from_positions = d + n,
                          .to_positions = d + 2 * n,
                          .inv_freq = reinterpret_cast<const float*>(d + 3 * n),
                          .n = n,
                          .num_kv_heads = shape_.num_kv_heads,
                          .head_dim = shape_.head_dim,
                          .layers = shape_.num_layers,
                          .layer_stride = 2 * num_slots_ * shape_.kv_dim()},
                         stream_);
  }
  absl::Status WriteSlots(std::span<const int32_t> slots, const uint8_t* in) override {
    for (int64_t l = 0; l < shape_.num_layers; ++l) RETURN_IF_ERROR(WriteSlotsLayer(slots, l, in));
    return absl::OkStatus();
  }
  absl::Status WriteSlotsLayer(std::span<const int32_t> slots, int64_t layer, const uint8_t* in) override {
    RETURN_IF_ERROR(CheckSlots(slots));
    if (layer < 0 || layer >= shape_.num_layers)
      return absl::InvalidArgumentError(absl::StrCat("KV tiers: layer ", layer, " outside the model"));
    const int64_t n = static_cast<int64_t>(slots.size()), kv_dim = shape_.kv_dim();
    if (n == 0) return absl::OkStatus();
    RETURN_IF_ERROR(UploadSlots(slots, 1));
    const int64_t part = 2 * n * kv_dim;  // elements of one layer's K and V rows
    bf16* stage = tier_stage_.as<bf16>();
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stage, in + layer * part * 2, static_cast<size_t>(part * 2),
                                         cudaMemcpyHostToDevice, stream_));
    const int64_t layer_kv = num_slots_ * kv_dim;
    bf16* k_cache = kv_->as<bf16>() + 2 * layer * layer_kv;
    kc::KvAppendParams app;
    app.k = stage;
    app.v = stage + n * kv_dim;
    app.slots = tier_slots_.as<int32_t>();
    app.k_cache = k_cache;
    app.v_cache = k_cache + layer_kv;
    app.n = n;
    app.kv_dim = kv_dim;
    app.num_slots = num_slots_;
    return kc::KvAppend(app, stream_);
  }

 private:
  kc::CudaMemorySpace memory_;
  CudaAttentionExecutor() = default;
  AttentionShape shape_;
  std::string device_name_;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  std::vector<cudaEvent_t> timing_;  // MarkLayerStart/End events, in pairs; reused every take
  size_t timing_used_ = 0;

  // The side stream and events of shared-prefix work, and the q scratch.
  absl::Status InitScratch() {
    // Shared-prefix work runs beside the suffix kernels on a second stream (SharedPrefixes).
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&q_ready_, cudaEventDisableTiming));
    CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&prefix_done_, cudaEventDisableTiming));
    return q_.Reserve(std::max<int64_t>(16, shape_.max_tokens * shape_.q_dim() * 2));
  }
  // Metadata: new slots (T), indptrs (3R + 3), context slots (<= capacity), 16-byte slack each.
  absl::Status InitMeta() {
    const int64_t meta_bytes = (shape_.max_tokens + 3 * (shape_.max_requests + 1) + num_slots_) * 4 + 16 * 8;
    RETURN_IF_ERROR(meta_.Reserve(meta_bytes));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_meta_, static_cast<size_t>(meta_bytes)));
    host_meta_bytes_ = meta_bytes;
    return absl::OkStatus();
  }

  absl::Status RecordTimingEvent() {
    if (timing_used_ == timing_.size()) {
      cudaEvent_t e = nullptr;
      CUDA_RETURN_IF_ERROR(cudaEventCreate(&e));
      timing_.push_back(e);
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(timing_[timing_used_++], stream_));
    return absl::OkStatus();
  }
  absl::Status CheckSlots(std::span<const int32_t> slots) const {
    for (int32_t s : slots) {
      if (s < 0 || s >= num_slots_)
        return absl::InvalidArgumentError(absl::StrCat("KV tiers: slot ", s, " outside the pool"));
    }
    return absl::OkStatus();
  }
  // The slots of a tier copy on the device, and staging room for `layers` layers of their K and V.
  // Growing a buffer frees the old one (cudaFree waits for the work that still uses it).
  absl::Status UploadSlots(std::span<const int32_t> slots, int64_t layers) const {
    const int64_t n = static_cast<int64_t>(slots.size());
    RETURN_IF_ERROR(tier_slots_.Reserve(n * 4));
    RETURN_IF_ERROR(tier_stage_.Reserve(layers * 2 * n * shape_.kv_dim() * 2));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(tier_slots_.ptr, slots.data(), static_cast<size_t>(n * 4),
                                         cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  // The K and V of the n slots in tier_slots_ (UploadSlots) over every layer into `dst`, in ReadSlots'
  // layout, on the executor's stream.
  absl::Status GatherSlots(int64_t n, bf16* dst) const {
    const int64_t kv_dim = shape_.kv_dim(), layer_kv = num_slots_ * kv_dim;
    for (int64_t l = 0; l < shape_.num_layers; ++l) {
      for (int64_t half = 0; half < 2; ++half) {
        RETURN_IF_ERROR(kc::GatherRows({.src = kv_->as<bf16>() + (2 * l + half) * layer_kv,
                                        .dst = dst + (2 * l + half) * n * kv_dim,
                                        .rows = tier_slots_.as<int32_t>(),
                                        .n = n,
                                        .width = kv_dim,
                                        .src_stride = kv_dim},
                                       stream_));
      }
    }
    return absl::OkStatus();
  }
  mutable kc::DeviceBuffer tier_slots_, tier_stage_;  // KV tiers' slot copies (ReadSlots, WriteSlots*)
  kc::DeviceBuffer shift_meta_;                       // RotateKeys' slots, positions and frequencies
  kc::DeviceBuffer copy_meta_;                        // CopySlots' src and dst slots
  // StartReadSlots' ring of device staging buffers, each with the events of its gathers (ready) and
  // of its device-to-host copy (done), and the copy stream.
  struct ReadBuffer {
    kc::DeviceBuffer stage;
    cudaEvent_t ready = nullptr, done = nullptr;
  };
  static constexpr int64_t kReadRing = 4;
  ReadBuffer read_ring_[kReadRing];
  int64_t next_read_ = 0;
  cudaStream_t copy_ = nullptr;
  int64_t num_slots_ = 0;
  std::shared_ptr<kc::DeviceBuffer> kv_;  // the KV pool, shared with the lanes
  kc::DeviceBuffer q_, meta_, decode_ws_;
  void* host_meta_ = nullptr;
  int64_t host_meta_bytes_ = 0;
  kc::MetaPacker packer_;
  kc::DecodePlan plan_;
  // The current step.
  int64_t t_ = 0, ns_ = 0, nm_ = 0, max_kv_len_ = 0, max_q_len_ = 0;
  int32_t kv_split_ = 0, q_split_ = 0;
  int64_t o_new_ = 0, o_kv_s_ = 0, o_q_m_ = 0, o_kv_m_ = 0, o_slots_ = 0;
  // Shared-prefix groups of the current step.
  kc::DeviceBuffer lse_, group_q_, group_out_, group_lse_;
  cudaStream_t side_ = nullptr;  // shared-prefix work, beside the main stream
  cudaEvent_t q_ready_ = nullptr, prefix_done_ = nullptr;
  int64_t groups_ = 0, prefix_requests_ = 0, group_rows_ = 0, max_group_rows_ = 0, max_group_kv_ = 0;
  int64_t o_g_rows_ = 0, o_g_q_ = 0, o_g_kv_ = 0, o_g_slots_ = 0;
  std::vector<Merge> rounds_, levels_;  // split reduction rounds; per level, groups into rows
  // q-first (LayerContext / LayerNew): the step's batch, whether its split was prepared and holds,
  // and whether any row has keys before the step (its context or a group's); each request's
  // context keys (host), their metadata on the device (split_meta_: the single rows' q_indptr at
  // o_q_s_, context kv_indptr of the single rows at o_ctx_s_ and of the chunks rebased at o_ctx_m_,
  // context slots at o_ctx_slots_, the chunks' from ctx_split_), the decode plans of both parts and
  // the context state (T, q_dim) bf16 and (T, heads) fp32 natural-log lse, and the new part's lse.
  const AttentionBatch* batch_ = nullptr;
  bool expect_split_ = false, split_ready_ = false, split_ = false, ctx_any_ = false;
  std::vector<int32_t> sorted_new_, ctx_kv_indptr_, ctx_kv_slots_;
  int64_t max_ctx_single_ = 0, max_ctx_multi_ = 0;
  int32_t ctx_split_ = 0;
  kc::MetaPacker split_packer_;
  void* split_host_meta_ = nullptr;
  int64_t split_host_bytes_ = 0;
  kc::DeviceBuffer split_meta_, ctx_out_, ctx_lse_, new_lse_;
  int64_t o_q_s_ = 0, o_ctx_s_ = 0, o_ctx_m_ = 0, o_ctx_slots_ = 0;
  kc::DecodePlan ctx_plan_, new_plan_;
  static constexpr int64_t kCascadeMinRows = 16, kCascadeMinElements = 80'000'000;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateCudaAttentionExecutor(const AttentionShape& shape,
                                                                               const KvPoolOptions& kv,
                                                                               int device, void* stream) {
  return CudaAttentionExecutor::Create(shape, kv, device, stream);
}

}  // namespace tandem
