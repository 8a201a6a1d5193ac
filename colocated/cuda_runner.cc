// The CUDA runner: bf16 weights (compute_node/CudaLayerExecutor), a bf16 token-granular KV pool
// on the same device, attention by the decode (single-row requests) and prefill-chunk kernels,
// and sampling on the device. One metadata upload and one result download per step.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "colocated/runner.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/cuda_layer_executor.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace tandem {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

namespace {

// A device allocation freed on destruction.
struct DeviceBuffer {
  void* ptr = nullptr;
  int64_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  absl::Status Reserve(int64_t n) {
    if (n <= bytes) return absl::OkStatus();
    if (ptr) CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    ptr = nullptr;
    bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, static_cast<size_t>(n)));
    bytes = n;
    return absl::OkStatus();
  }
  template <typename T>
  T* as(int64_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(ptr) + byte_offset);
  }
};

// Packs the step's metadata into one pinned host buffer (one copy to the device per step).
class MetaPacker {
 public:
  void Reset() { bytes_.clear(); }
  template <typename T>
  int64_t Add(const T* data, size_t n) {
    const int64_t at = (static_cast<int64_t>(bytes_.size()) + 15) / 16 * 16;
    bytes_.resize(static_cast<size_t>(at) + n * sizeof(T));
    if (n) std::memcpy(bytes_.data() + at, data, n * sizeof(T));
    return at;
  }
  template <typename T>
  int64_t Add(const std::vector<T>& v) {
    return Add(v.data(), v.size());
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

class CudaRunner : public ModelRunner {
 public:
  ~CudaRunner() override {
    executor_.reset();
    weights_.reset();
    if (host_meta_) cudaFreeHost(host_meta_);
    if (host_out_) cudaFreeHost(host_out_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const WeightSource& source,
                                                             const RunnerOptions& o, int device) {
    if (const std::string why = CudaRunnerUnsupported(source.spec()); !why.empty()) {
      return absl::UnimplementedError(absl::StrCat("runtime.device cuda: ", why));
    }
    std::unique_ptr<CudaRunner> r(new CudaRunner());
    ASSIGN_OR_RETURN(const int count, kernels::CudaDeviceCount());
    if (device >= count) {
      return absl::UnavailableError(absl::StrCat("runtime.device: cuda:", device, " requested but ", count,
                                                 " CUDA device(s) are visible"));
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
    r->device_name_ = absl::StrCat("cuda:", device, " (", prop.name, ")");
    r->num_sms_ = prop.multiProcessorCount;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&r->stream_, cudaStreamNonBlocking));
    ASSIGN_OR_RETURN(r->weights_, CudaModelWeights::Upload(source));
    const ModelSpec& s = r->weights_->spec();
    r->max_tokens_ = o.max_tokens_per_step;
    r->max_requests_ = o.max_batch_size;
    ASSIGN_OR_RETURN(r->executor_, CudaLayerExecutor::Create(r->weights_.get(), r->max_tokens_, r->stream_));
    if (o.profile) {
      r->timer_.Enable(r->stream_);
      r->executor_->set_timer(&r->timer_);
    }

    const int64_t t = r->max_tokens_, q_dim = s.q_dim();
    RETURN_IF_ERROR(r->x_.Reserve(t * s.hidden_size * 4));
    RETURN_IF_ERROR(r->qkv_.Reserve(t * r->executor_->qkv_width() * 2));
    RETURN_IF_ERROR(r->q_.Reserve(t * q_dim * 2));
    RETURN_IF_ERROR(r->attn_.Reserve(t * q_dim * 2));
    RETURN_IF_ERROR(r->logits_.Reserve(r->max_requests_ * s.vocab_size * 4));
    RETURN_IF_ERROR(r->sample_ws_.Reserve(
        std::max<int64_t>(16, kc::SampleWorkspaceBytes(r->max_requests_, s.vocab_size))));
    RETURN_IF_ERROR(r->out_.Reserve(r->max_requests_ * 8));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&r->host_out_, static_cast<size_t>(r->max_requests_ * 8)));

    // KV: what is left, after weights and scratch, times the configured fraction.
    const int64_t per_token = s.kv_bytes_per_token(2);
    int64_t slots = o.kv_capacity_tokens;
    size_t free_b = 0, total_b = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
    if (slots == 0) {
      const int64_t by_memory =
          static_cast<int64_t>(static_cast<double>(free_b) * o.kv_memory_fraction) / per_token;
      slots = std::min<int64_t>({by_memory, o.max_batch_size * s.max_position, INT32_MAX});
      if (slots < 1) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "no device memory left for the KV cache after the weights (%.2f GiB free, %d bytes per token)",
            free_b / 1073741824.0, per_token));
      }
    }
    RETURN_IF_ERROR(
        Annotate(r->kv_.Reserve(slots * per_token), "allocating the KV cache (kv.capacity_tokens)"));
    r->num_slots_ = slots;
    // Metadata: tokens, positions, slots (3T), indptrs (4R+4), context slots (<= capacity),
    // sample rows and parameters (6R), with 16-byte alignment slack per segment.
    const int64_t meta_bytes =
        (3 * t + 4 * (r->max_requests_ + 1) + slots) * 4 + r->max_requests_ * 32 + 16 * 16;
    RETURN_IF_ERROR(r->meta_.Reserve(meta_bytes));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&r->host_meta_, static_cast<size_t>(meta_bytes)));
    r->host_meta_bytes_ = meta_bytes;
    TANDEM_LOG_INFO(
        "engine", s.Summary(), "; device ", r->device_name_,
        absl::StrFormat("; weights %.2f GiB bf16; KV cache %d tokens (%.2f GiB bf16)",
                        r->weights_->bytes() / 1073741824.0, slots, slots * per_token / 1073741824.0));
    return std::unique_ptr<ModelRunner>(std::move(r));
  }

  const ModelSpec& spec() const override { return weights_->spec(); }
  int64_t kv_capacity() const override { return num_slots_; }
  std::string device() const override { return device_name_; }
  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const override {
    std::vector<std::pair<std::string, double>> out;
    if (!timer_.enabled()) return out;
    for (int p = 0; p < PhaseTimer::kNumPhases; ++p) {
      out.emplace_back(PhaseTimer::Name(static_cast<PhaseTimer::Phase>(p)), timer_.totals_ms()[p]);
    }
    return out;
  }

  absl::Status Forward(const StepBatch& b, std::vector<int32_t>* tokens,
                       std::vector<float>* logprobs) override {
    const ModelSpec& s = spec();
    const int64_t t = b.num_tokens();
    const int64_t num_req = b.num_requests();
    const int64_t ns = b.num_single, nm = num_req - ns;
    const int64_t rows = static_cast<int64_t>(b.sample_rows.size());
    if (t > max_tokens_ || num_req > max_requests_ || rows > max_requests_) {
      return absl::InvalidArgumentError("CudaRunner: step larger than the sizes it was created for");
    }
    timer_.Begin();
    // Metadata, with the single-row and multi-row request groups rebased to start at 0.
    meta_packer_.Reset();
    const int64_t o_tokens = meta_packer_.Add(b.tokens);
    const int64_t o_pos = meta_packer_.Add(b.positions);
    const int64_t o_new = meta_packer_.Add(b.new_slots);
    const int32_t kv_split = b.kv_indptr[static_cast<size_t>(ns)];
    const int32_t q_split = b.q_indptr[static_cast<size_t>(ns)];
    std::vector<int32_t> kv_s(b.kv_indptr.begin(), b.kv_indptr.begin() + ns + 1);
    std::vector<int32_t> q_m, kv_m;
    for (int64_t r = ns; r <= num_req; ++r) {
      q_m.push_back(b.q_indptr[static_cast<size_t>(r)] - q_split);
      kv_m.push_back(b.kv_indptr[static_cast<size_t>(r)] - kv_split);
    }
    const int64_t o_kv_s = meta_packer_.Add(kv_s);
    const int64_t o_q_m = meta_packer_.Add(q_m);
    const int64_t o_kv_m = meta_packer_.Add(kv_m);
    const int64_t o_slots = meta_packer_.Add(b.kv_slots);
    std::vector<float> temperature, top_p;
    std::vector<int32_t> top_k;
    std::vector<uint64_t> seed;
    for (const auto& sp : b.sampling) {
      temperature.push_back(sp.temperature);
      top_k.push_back(sp.top_k);
      top_p.push_back(sp.top_p);
      seed.push_back(sp.seed);
    }
    const int64_t o_rows = meta_packer_.Add(b.sample_rows);
    const int64_t o_temp = meta_packer_.Add(temperature);
    const int64_t o_topk = meta_packer_.Add(top_k);
    const int64_t o_topp = meta_packer_.Add(top_p);
    const int64_t o_seed = meta_packer_.Add(seed);
    const int64_t o_counter = meta_packer_.Add(b.counters);
    const std::vector<unsigned char>& mb = meta_packer_.bytes();
    if (static_cast<int64_t>(mb.size()) > host_meta_bytes_)
      return absl::InternalError("CudaRunner: metadata overflow");
    // The previous step synchronised at its end, so the pinned buffer is free to overwrite.
    std::memcpy(host_meta_, mb.data(), mb.size());
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.ptr, host_meta_, mb.size(), cudaMemcpyHostToDevice, stream_));
    timer_.Mark(PhaseTimer::kOther);

    float* x = x_.as<float>();
    bf16* qkv = qkv_.as<bf16>();
    bf16* q = q_.as<bf16>();
    bf16* attn = attn_.as<bf16>();
    const int64_t width = executor_->qkv_width(), q_dim = s.q_dim(), kv_dim = s.kv_dim();
    const int64_t layer_kv = num_slots_ * kv_dim;  // elements of one layer's K (or V)
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));

    kc::DecodePlan plan;
    if (ns > 0) {
      plan = kc::PlanDecodeAttention(ns, s.num_heads, s.num_kv_heads, s.head_dim, b.max_kv_len, num_sms_);
      RETURN_IF_ERROR(decode_ws_.Reserve(std::max<int64_t>(16, plan.workspace_bytes)));
    }

    RETURN_IF_ERROR(executor_->Embed(meta_.as<int32_t>(o_tokens), t, x));
    for (int64_t layer = 0; layer < s.num_layers; ++layer) {
      RETURN_IF_ERROR(executor_->PreAttention(layer, x, meta_.as<int32_t>(o_pos), t, qkv));
      bf16* kc_layer = kv_.as<bf16>() + 2 * layer * layer_kv;
      bf16* vc_layer = kc_layer + layer_kv;
      kc::KvAppendParams app;
      app.k = qkv + q_dim;
      app.v = qkv + q_dim + kv_dim;
      app.k_stride = width;
      app.v_stride = width;
      app.slots = meta_.as<int32_t>(o_new);
      app.k_cache = kc_layer;
      app.v_cache = vc_layer;
      app.n = t;
      app.kv_dim = kv_dim;
      app.num_slots = num_slots_;
      RETURN_IF_ERROR(kc::KvAppend(app, stream_));
      CUDA_RETURN_IF_ERROR(
          cudaMemcpy2DAsync(q, q_dim * 2, qkv, width * 2, q_dim * 2, t, cudaMemcpyDeviceToDevice, stream_));
      timer_.Mark(PhaseTimer::kOther);
      kc::AttentionParams ap;
      ap.k_cache = kc_layer;
      ap.v_cache = vc_layer;
      ap.num_slots = num_slots_;
      ap.num_heads = s.num_heads;
      ap.num_kv_heads = s.num_kv_heads;
      ap.head_dim = s.head_dim;
      ap.scale = scale;
      ap.max_kv_len = b.max_kv_len;
      if (ns > 0) {
        kc::AttentionParams d = ap;
        d.q = q;
        d.out = attn;
        d.q_indptr = nullptr;
        d.kv_indptr = meta_.as<int32_t>(o_kv_s);
        d.kv_slots = meta_.as<int32_t>(o_slots);
        d.num_requests = ns;
        d.max_q_len = 1;
        RETURN_IF_ERROR(kc::DecodeAttention(d, plan, decode_ws_.ptr, stream_));
      }
      if (nm > 0) {
        kc::AttentionParams p = ap;
        p.q = q + static_cast<int64_t>(q_split) * q_dim;
        p.out = attn + static_cast<int64_t>(q_split) * q_dim;
        p.q_indptr = meta_.as<int32_t>(o_q_m);
        p.kv_indptr = meta_.as<int32_t>(o_kv_m);
        p.kv_slots = meta_.as<int32_t>(o_slots) + kv_split;
        p.num_requests = nm;
        p.max_q_len = b.max_q_len;
        RETURN_IF_ERROR(kc::PrefillAttention(p, stream_));
      }
      timer_.Mark(PhaseTimer::kAttention);
      RETURN_IF_ERROR(executor_->PostAttention(layer, x, attn, t));
    }
    if (rows > 0) {
      float* logits = logits_.as<float>();
      RETURN_IF_ERROR(executor_->Logits(x, t, meta_.as<int32_t>(o_rows), rows, logits));
      kc::SampleParams sp;
      sp.logits = logits;
      sp.temperature = meta_.as<float>(o_temp);
      sp.top_k = meta_.as<int32_t>(o_topk);
      sp.top_p = meta_.as<float>(o_topp);
      sp.seed = meta_.as<uint64_t>(o_seed);
      sp.counter = meta_.as<uint64_t>(o_counter);
      sp.out_tokens = out_.as<int32_t>();
      sp.out_logprobs = out_.as<float>(rows * 4);
      sp.rows = rows;
      sp.vocab = s.vocab_size;
      RETURN_IF_ERROR(kc::SampleTokens(sp, sample_ws_.ptr, stream_));
      timer_.Mark(PhaseTimer::kSampling);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_out_, out_.ptr, static_cast<size_t>(rows * 8),
                                           cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    timer_.Collect();
    const auto* out_tokens = static_cast<const int32_t*>(host_out_);
    const auto* out_logprobs =
        reinterpret_cast<const float*>(static_cast<const unsigned char*>(host_out_) + rows * 4);
    tokens->insert(tokens->end(), out_tokens, out_tokens + rows);
    logprobs->insert(logprobs->end(), out_logprobs, out_logprobs + rows);
    return absl::OkStatus();
  }

 private:
  CudaRunner() = default;
  std::string device_name_;
  int num_sms_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<CudaModelWeights> weights_;
  std::unique_ptr<CudaLayerExecutor> executor_;
  int64_t max_tokens_ = 0, max_requests_ = 0, num_slots_ = 0;
  DeviceBuffer x_, qkv_, q_, attn_, logits_, sample_ws_, decode_ws_, out_, kv_, meta_;
  void* host_meta_ = nullptr;
  int64_t host_meta_bytes_ = 0;
  void* host_out_ = nullptr;
  MetaPacker meta_packer_;
  PhaseTimer timer_;
};

}  // namespace

std::string CudaRunnerUnsupported(const ModelSpec& spec) {
  if (spec.head_dim != 64 && spec.head_dim != 128) {
    return absl::StrCat("head_dim ", spec.head_dim,
                        " is not supported by the CUDA attention kernels (64 or 128)");
  }
  return "";
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(const WeightSource& source,
                                                              const RunnerOptions& options, int device) {
  return CudaRunner::Create(source, options, device);
}

}  // namespace tandem
