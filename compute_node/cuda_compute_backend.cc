// The CUDA compute backend: bf16 weights (CudaLayerExecutor), an fp32 residual stream, sampling
// on the device. One metadata upload and one result download per step; in a step where requests
// asked for top log-probability alternatives, also their logits rows (fp32, vocab each), whose
// top k the CPU reference (kernels::cpu::TopLogprobs) picks: a copy of ~0.5 MB and a pass over
// the row per asking request (Llama 3's 128k vocabulary), paid only by those requests.
//
// Layer parts as CUDA graphs (ComputeBackendOptions::cuda_graphs). Enqueueing a layer's linear
// part eagerly costs a dozen API calls (kernels, cuBLAS, events), and on some measured hosts the
// host took longer to enqueue a decode step than the GPU took to run it, so the GEMMs waited for
// their launches. Layer l's post-attention part and layer l + 1's pre-attention part become one
// graph (PostAttention is held until the next call), captured at first use for each (layer, row
// bucket, buffers); a step of t rows replays the graphs of bucket T >= t. The T - t padding rows are
// row-local work that nothing reads: x is zeroed there at BeginStep, their positions are whatever follows the
// step's positions in the metadata (RoPE of any integer is finite), and their qkv and attn rows lie inside
// buffers sized for max_tokens rows.
#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/log.h"
#include "common/status.h"
#include "compute_node/compute_backend.h"
#include "compute_node/cuda_layer_executor.h"
#include "kernels/cuda/buffers.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/ops.h"

namespace tandem {

namespace kc = kernels::cuda;
using bf16 = __nv_bfloat16;

namespace {

class CudaComputeBackend : public ComputeBackend {
 public:
  ~CudaComputeBackend() override {
    for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
    executor_.reset();
    weights_.reset();
    if (host_meta_) cudaFreeHost(host_meta_);
    if (host_out_) cudaFreeHost(host_out_);
    if (own_stream_ && stream_) cudaStreamDestroy(stream_);
  }

  static absl::StatusOr<std::unique_ptr<ComputeBackend>> Create(const WeightSource& source,
                                                                const ComputeBackendOptions& o, int device) {
    std::unique_ptr<CudaComputeBackend> b(new CudaComputeBackend());
    ASSIGN_OR_RETURN(const int count, kernels::CudaDeviceCount());
    if (device < 0 || device >= count) {
      return absl::UnavailableError(
          absl::StrCat("cuda:", device, " requested but ", count, " CUDA device(s) are visible"));
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
    b->device_name_ = absl::StrCat("cuda:", device, " (", prop.name, ")");
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&b->stream_, cudaStreamNonBlocking));
    b->own_stream_ = true;
    b->memory_.set_stream(b->stream_);
    ASSIGN_OR_RETURN(std::unique_ptr<CudaModelWeights> weights, CudaModelWeights::Upload(source));
    b->weights_ = std::move(weights);
    const ModelSpec& s = b->weights_->spec();
    RETURN_IF_ERROR(b->Init(o));
    if (o.profile) {
      b->own_timer_.Enable(b->stream_);
      b->executor_->set_timer(&b->own_timer_);
    }
    TANDEM_LOG_INFO("compute", s.Summary(), "; device ", b->device_name_,
                    absl::StrFormat("; weights %.2f GiB bf16", b->weights_->bytes() / 1073741824.0));
    return std::unique_ptr<ComputeBackend>(std::move(b));
  }

  absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateLane() override {
    std::unique_ptr<CudaComputeBackend> b(new CudaComputeBackend());
    b->device_name_ = device_name_;
    b->stream_ = stream_;  // the lane enqueues on this backend's stream, which it does not own
    b->memory_.set_stream(stream_);
    b->weights_ = weights_;
    b->lane_ = true;
    b->timer_ = timer_;  // one timeline for the lanes of a step (opened and closed by this backend)
    RETURN_IF_ERROR(b->Init(options_));
    if (timer_->enabled()) b->executor_->set_timer(timer_);
    return std::unique_ptr<ComputeBackend>(std::move(b));
  }

  const ModelSpec& spec() const override { return weights_->spec(); }
  std::string device() const override { return device_name_; }
  DType dtype() const override { return DType::kBF16; }
  void* stream() const override { return stream_; }

  absl::Status BeginStep(const StepTokens& st) override {
    const int64_t t = st.num_tokens(), rows = static_cast<int64_t>(st.sample_rows.size());
    if (t > options_.max_tokens || rows > options_.max_requests) {
      return absl::InvalidArgumentError(absl::StrCat("step of ", t, " rows and ", rows,
                                                     " sampled rows exceeds the limits (",
                                                     options_.max_tokens, ", ", options_.max_requests, ")"));
    }
    t_ = t;
    rows_ = rows;
    graph_rows_ = GraphRows(t);
    held_post_ = -1;
    if (!lane_) timer_->Begin();
    packer_.Reset();
    o_pos_ = packer_.Add(st.positions);  // first, at a fixed address for the graphs
    const int64_t o_tokens = packer_.Add(st.tokens);
    std::vector<float> temperature, top_p;
    std::vector<int32_t> top_k;
    std::vector<uint64_t> seed;
    for (const auto& sp : st.sampling) {
      temperature.push_back(sp.temperature);
      top_k.push_back(sp.top_k);
      top_p.push_back(sp.top_p);
      seed.push_back(sp.seed);
    }
    o_rows_ = packer_.Add(st.sample_rows);
    o_temp_ = packer_.Add(temperature);
    o_topk_ = packer_.Add(top_k);
    o_topp_ = packer_.Add(top_p);
    o_seed_ = packer_.Add(seed);
    o_counter_ = packer_.Add(st.counters);
    top_logprobs_ = st.top_logprobs;  // empty unless a request asked for alternatives
    const std::vector<unsigned char>& mb = packer_.bytes();
    if (static_cast<int64_t>(mb.size()) > host_meta_bytes_)
      return absl::InternalError("step metadata overflow");
    // The previous step synchronised in Finish, so the pinned buffer is free to overwrite.
    std::memcpy(host_meta_, mb.data(), mb.size());
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(meta_.ptr, host_meta_, mb.size(), cudaMemcpyHostToDevice, stream_));
    if (graph_rows_ > t) {
      const size_t row = static_cast<size_t>(spec().hidden_size) * 4;
      CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(x_.as<float>() + t * spec().hidden_size, 0, (graph_rows_ - t) * row, stream_));
    }
    timer_->Mark(PhaseTimer::kOther);
    return executor_->Embed(meta_.as<int32_t>(o_tokens), t, x_.as<float>());
  }

  // With graphs, layer l's post-attention part and layer l + 1's pre-attention part run as one
  // graph: PostAttention(l) is held until PreAttention(l + 1) (or Finish) enqueues it.
  absl::Status PreAttention(int64_t layer, void* qkv) override {
    auto pre = [this, layer, qkv](int64_t rows) {
      return executor_->PreAttention(layer, x_.as<float>(), meta_.as<int32_t>(o_pos_), rows,
                                     static_cast<bf16*>(qkv));
    };
    if (held_post_ == layer - 1 && layer > 0) {
      held_post_ = -1;
      const int64_t prev = layer - 1;
      const void* attn = held_attn_;
      return RunLayerPart(layer, Part::kPostPre, attn, qkv, [&](int64_t rows) {
        RETURN_IF_ERROR(executor_->PostAttention(prev, x_.as<float>(), static_cast<const bf16*>(attn), rows));
        return pre(rows);
      });
    }
    RETURN_IF_ERROR(ReleaseHeldPost());
    return RunLayerPart(layer, Part::kPre, qkv, nullptr, pre);
  }
  absl::Status PostAttention(int64_t layer, const void* attn) override {
    RETURN_IF_ERROR(ReleaseHeldPost());
    if (graph_rows_ > 0 && layer + 1 < spec().num_layers) {
      held_post_ = layer;
      held_attn_ = attn;
      return absl::OkStatus();
    }
    return RunPost(layer, attn);
  }
  void MarkAttention() override { timer_->Mark(PhaseTimer::kAttention); }

  absl::Status Finish(SampledTokens* out) override {
    RETURN_IF_ERROR(ReleaseHeldPost());
    const int64_t rows = rows_, vocab = spec().vocab_size;
    asked_.clear();
    for (size_t i = 0; i < top_logprobs_.size(); ++i) {
      if (top_logprobs_[i] > 0) asked_.push_back(static_cast<int64_t>(i));
    }
    if (rows > 0) {
      float* logits = logits_.as<float>();
      RETURN_IF_ERROR(executor_->Logits(x_.as<float>(), t_, meta_.as<int32_t>(o_rows_), rows, logits));
      kc::SampleParams sp;
      sp.logits = logits;
      sp.temperature = meta_.as<float>(o_temp_);
      sp.top_k = meta_.as<int32_t>(o_topk_);
      sp.top_p = meta_.as<float>(o_topp_);
      sp.seed = meta_.as<uint64_t>(o_seed_);
      sp.counter = meta_.as<uint64_t>(o_counter_);
      sp.out_tokens = out_.as<int32_t>();
      sp.out_logprobs = out_.as<float>(rows * 4);
      sp.rows = rows;
      sp.vocab = vocab;
      RETURN_IF_ERROR(kc::SampleTokens(sp, sample_ws_.ptr, stream_));
      timer_->Mark(PhaseTimer::kSampling);
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_out_, out_.ptr, static_cast<size_t>(rows * 8),
                                           cudaMemcpyDeviceToHost, stream_));
      // Alternatives: only the logits rows of the requests that asked come to the host (none in a
      // step where nobody asked), and the CPU reference picks their top k.
      host_logits_.resize(asked_.size() * static_cast<size_t>(vocab));
      for (size_t j = 0; j < asked_.size(); ++j) {
        CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_logits_.data() + j * static_cast<size_t>(vocab),
                                             logits + asked_[j] * vocab, static_cast<size_t>(vocab) * 4,
                                             cudaMemcpyDeviceToHost, stream_));
      }
    }
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (!lane_) timer_->Collect();
    const auto* out_tokens = static_cast<const int32_t*>(host_out_);
    const auto* out_logprobs =
        reinterpret_cast<const float*>(static_cast<const unsigned char*>(host_out_) + rows * 4);
    size_t next = 0;
    for (int64_t i = 0; i < rows; ++i) {
      top_.clear();
      if (next < asked_.size() && asked_[next] == i) {
        kernels::cpu::TopLogprobs(host_logits_.data() + next * static_cast<size_t>(vocab), vocab,
                                  top_logprobs_[static_cast<size_t>(i)], &top_);
        ++next;
      }
      out->Append(out_tokens[i], out_logprobs[i], top_);
    }
    return absl::OkStatus();
  }

  absl::Status EndStep() override {
    RETURN_IF_ERROR(ReleaseHeldPost());
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (!lane_) timer_->Collect();
    return absl::OkStatus();
  }
  void* residual() override { return x_.ptr; }
  MemorySpace& memory() override { return memory_; }

  std::vector<std::pair<std::string, double>> PhaseTotalsMs() const override {
    std::vector<std::pair<std::string, double>> out;
    if (!timer_->enabled() || lane_) return out;
    for (int p = 0; p < PhaseTimer::kNumPhases; ++p) {
      out.emplace_back(PhaseTimer::Name(static_cast<PhaseTimer::Phase>(p)), timer_->totals_ms()[p]);
    }
    return out;
  }

 private:
  struct LayerGraph {
    cudaGraphExec_t exec = nullptr;
    PhaseTimer::Marks marks;
  };
  static constexpr int64_t kGraphBuckets[] = {1,  2,   4,   8,   16,  24,  32,  40,  48,  56,  64, 80,
                                              96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512};

  enum class Part { kPre, kPost, kPostPre };

  absl::Status RunPost(int64_t layer, const void* attn) {
    return RunLayerPart(layer, Part::kPost, attn, nullptr, [&](int64_t rows) {
      return executor_->PostAttention(layer, x_.as<float>(), static_cast<const bf16*>(attn), rows);
    });
  }
  absl::Status ReleaseHeldPost() {
    if (held_post_ < 0) return absl::OkStatus();
    const int64_t layer = held_post_;
    held_post_ = -1;
    return RunPost(layer, held_attn_);
  }

  // The rows a step of t rows runs as graphs (its bucket), or 0 to run it eagerly.
  int64_t GraphRows(int64_t t) const {
    if (!graphs_on_) return 0;
    for (int64_t b : kGraphBuckets)
      if (b >= t) return std::min(b, options_.max_tokens);
    return 0;
  }

  // Runs enqueue(rows) for the step: as the graph of (layer, part, bucket, buffers), captured
  // the first time, or eagerly with the step's rows. A capture that fails turns graphs off for
  // this backend (logged once) and the part runs eagerly.
  template <typename Enqueue>
  absl::Status RunLayerPart(int64_t layer, Part part, const void* a, const void* b, Enqueue&& enqueue) {
    if (graph_rows_ == 0) return enqueue(t_);
    const auto key = std::make_tuple(graph_rows_, layer, part, a, b);
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      absl::StatusOr<LayerGraph> g = Capture(enqueue);
      if (!g.ok()) {
        TANDEM_LOG_WARN("compute", "CUDA graphs off: capturing layer ", layer,
                        " failed: ", g.status().message());
        graphs_on_ = false;
        graph_rows_ = 0;
        return enqueue(t_);
      }
      it = graphs_.emplace(key, *std::move(g)).first;
    }
    CUDA_RETURN_IF_ERROR(cudaGraphLaunch(it->second.exec, stream_));
    timer_->Replayed(it->second.marks);
    return absl::OkStatus();
  }

  template <typename Enqueue>
  absl::StatusOr<LayerGraph> Capture(Enqueue& enqueue) {
    CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    timer_->BeginCapture();
    const absl::Status enqueued = enqueue(graph_rows_);
    LayerGraph g;
    g.marks = timer_->EndCapture();
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    if (!enqueued.ok() || ended != cudaSuccess) {
      if (graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();
      RETURN_IF_ERROR(enqueued);
      CUDA_RETURN_IF_ERROR(ended);
    }
    const cudaError_t made = cudaGraphInstantiate(&g.exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_RETURN_IF_ERROR(made);
    return g;
  }

  // Step state and scratch (the weights and the stream are set).
  absl::Status Init(const ComputeBackendOptions& o) {
    const ModelSpec& s = weights_->spec();
    options_ = o;
    graphs_on_ = o.cuda_graphs;
    ASSIGN_OR_RETURN(executor_, CudaLayerExecutor::Create(weights_.get(), o.max_tokens, stream_, o.gemv));
    const int64_t t = o.max_tokens, r = o.max_requests;
    RETURN_IF_ERROR(x_.Reserve(t * s.hidden_size * 4));
    CUDA_RETURN_IF_ERROR(cudaMemset(x_.ptr, 0, static_cast<size_t>(t * s.hidden_size * 4)));
    RETURN_IF_ERROR(logits_.Reserve(r * s.vocab_size * 4));
    RETURN_IF_ERROR(sample_ws_.Reserve(std::max<int64_t>(16, kc::SampleWorkspaceBytes(r, s.vocab_size))));
    RETURN_IF_ERROR(out_.Reserve(r * 8));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_out_, static_cast<size_t>(r * 8)));
    // Metadata: tokens, positions (2T), sample rows and parameters (6R), 16-byte slack each.
    const int64_t meta_bytes = 2 * t * 4 + r * 32 + 16 * 16;
    RETURN_IF_ERROR(meta_.Reserve(meta_bytes));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_meta_, static_cast<size_t>(meta_bytes)));
    host_meta_bytes_ = meta_bytes;
    return absl::OkStatus();
  }

  kc::CudaMemorySpace memory_;
  CudaComputeBackend() = default;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  ComputeBackendOptions options_;
  std::shared_ptr<const CudaModelWeights> weights_;  // shared with the lanes
  bool own_stream_ = false;
  bool lane_ = false;  // a lane of another backend (CreateLane): its timer is that backend's
  std::unique_ptr<CudaLayerExecutor> executor_;
  kc::DeviceBuffer x_, logits_, sample_ws_, out_, meta_;
  void* host_meta_ = nullptr;
  int64_t host_meta_bytes_ = 0;
  void* host_out_ = nullptr;
  kc::MetaPacker packer_;
  PhaseTimer own_timer_;
  PhaseTimer* timer_ = &own_timer_;
  int64_t t_ = 0, rows_ = 0;
  bool graphs_on_ = false;
  int64_t graph_rows_ = 0;  // this step's bucket, or 0: eager
  int64_t held_post_ = -1;  // layer whose PostAttention waits for the next call (graphs)
  const void* held_attn_ = nullptr;
  std::map<std::tuple<int64_t, int64_t, Part, const void*, const void*>, LayerGraph> graphs_;
  int64_t o_pos_ = 0, o_rows_ = 0, o_temp_ = 0, o_topk_ = 0, o_topp_ = 0, o_seed_ = 0, o_counter_ = 0;
  // Alternatives (StepTokens::top_logprobs): per sample row of this step, the sample rows that
  // asked, their logits rows on the host, one row's result.
  std::vector<int32_t> top_logprobs_;
  std::vector<int64_t> asked_;
  std::vector<float> host_logits_;
  std::vector<TopLogprob> top_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCudaComputeBackend(const WeightSource& source,
                                                                         const ComputeBackendOptions& options,
                                                                         int device) {
  return CudaComputeBackend::Create(source, options, device);
}

}  // namespace tandem
