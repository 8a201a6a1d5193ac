#include "compute_node/cuda_layer_executor.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/dtype.h"
#include "common/log.h"
#include "common/status.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem {

namespace kc = kernels::cuda;

namespace {
int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
constexpr int64_t kAlign = 256;  // bytes; keeps every tensor 16-byte (vector load) aligned
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
}  // namespace

absl::StatusOr<std::unique_ptr<CudaModelWeights>> CudaModelWeights::Upload(const WeightSource& source) {
  std::unique_ptr<CudaModelWeights> w(new CudaModelWeights());
  w->spec_ = source.spec();
  const ModelSpec& s = w->spec_;
  const std::vector<ExpectedTensor> tensors = ExpectedTensors(s);
  // Device offsets: tensors of one fused matrix are placed back to back, in ExpectedTensors'
  // order within a layer (q, k, v and gate, up adjacent).
  std::vector<int64_t> offset(tensors.size());
  std::map<std::string, size_t> index;
  int64_t total = 0;
  auto place = [&](const std::string& name) -> int64_t {
    const size_t i = index.at(name);
    offset[i] = total;
    total += Elements(tensors[i].shape) * 2;
    return offset[i];
  };
  for (size_t i = 0; i < tensors.size(); ++i) index[tensors[i].name] = i;
  place(HfNames::Embed());
  for (int64_t l = 0; l < s.num_layers; ++l) {
    total = AlignUp(total);
    place(HfNames::Layer(l, "input_layernorm.weight"));
    total = AlignUp(total);
    place(HfNames::Layer(l, "self_attn.q_proj.weight"));
    place(HfNames::Layer(l, "self_attn.k_proj.weight"));
    place(HfNames::Layer(l, "self_attn.v_proj.weight"));
    total = AlignUp(total);
    place(HfNames::Layer(l, "self_attn.o_proj.weight"));
    total = AlignUp(total);
    place(HfNames::Layer(l, "post_attention_layernorm.weight"));
    total = AlignUp(total);
    place(HfNames::Layer(l, "mlp.gate_proj.weight"));
    place(HfNames::Layer(l, "mlp.up_proj.weight"));
    total = AlignUp(total);
    place(HfNames::Layer(l, "mlp.down_proj.weight"));
  }
  total = AlignUp(total);
  place(HfNames::FinalNorm());
  if (!s.tie_word_embeddings) {
    total = AlignUp(total);
    place(HfNames::LmHead());
  }
  total = AlignUp(total);
  const int64_t inv_freq_offset = total;
  total += s.head_dim / 2 * 4;

  size_t free_b = 0, total_b = 0;
  CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
  if (static_cast<size_t>(total) > free_b) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "%s needs %.1f GiB of device memory for bf16 weights; %.1f GiB of %.1f GiB are free",
        source.Describe(), total / 1073741824.0, free_b / 1073741824.0, total_b / 1073741824.0));
  }
  CUDA_RETURN_IF_ERROR(cudaMalloc(&w->base_, static_cast<size_t>(total)));
  w->bytes_ = total;
  auto* base = static_cast<unsigned char*>(w->base_);

  // Convert and copy on several host threads; the first error wins and nothing is used.
  std::atomic<size_t> next{0};
  std::vector<absl::Status> errors(tensors.size());
  auto work = [&] {
    std::vector<float> f32;
    std::vector<uint16_t> b16;
    for (size_t i = next++; i < tensors.size(); i = next++) {
      const int64_t n = Elements(tensors[i].shape);
      f32.resize(static_cast<size_t>(n));
      b16.resize(static_cast<size_t>(n));
      absl::Status st = source.ReadF32(tensors[i].name, f32.data());
      if (st.ok()) {
        for (int64_t j = 0; j < n; ++j)
          b16[static_cast<size_t>(j)] = FloatToBf16(f32[static_cast<size_t>(j)]);
        const cudaError_t e =
            cudaMemcpy(base + offset[i], b16.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice);
        if (e != cudaSuccess) st = kernels::CudaErrorToStatus(e, "cudaMemcpy(weights)", __FILE__, __LINE__);
      }
      errors[i] = st;
    }
  };
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 8u);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(work);
  for (auto& t : pool) t.join();
  for (const absl::Status& st : errors) RETURN_IF_ERROR(st);

  auto at = [&](const std::string& name) { return reinterpret_cast<bf16*>(base + offset[index.at(name)]); };
  w->embed_ = at(HfNames::Embed());
  w->final_norm_ = at(HfNames::FinalNorm());
  w->lm_head_ = s.tie_word_embeddings ? w->embed_ : at(HfNames::LmHead());
  for (int64_t l = 0; l < s.num_layers; ++l) {
    w->layers_.push_back(
        {at(HfNames::Layer(l, "input_layernorm.weight")), at(HfNames::Layer(l, "self_attn.q_proj.weight")),
         at(HfNames::Layer(l, "self_attn.o_proj.weight")),
         at(HfNames::Layer(l, "post_attention_layernorm.weight")),
         at(HfNames::Layer(l, "mlp.gate_proj.weight")), at(HfNames::Layer(l, "mlp.down_proj.weight"))});
  }
  const std::vector<float> inv_freq = kernels::cpu::RopeInvFreq(s.rope, s.head_dim);
  w->inv_freq_ = reinterpret_cast<float*>(base + inv_freq_offset);
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(w->inv_freq_, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice));
  return w;
}

CudaModelWeights::~CudaModelWeights() {
  if (base_) cudaFree(base_);
}

const char* PhaseTimer::Name(Phase p) {
  static const char* kNames[] = {"gemm", "attention", "other", "sampling"};
  return kNames[p];
}

PhaseTimer::~PhaseTimer() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  for (cudaEvent_t e : owned_) cudaEventDestroy(e);
}

cudaEvent_t PhaseTimer::NewEvent() {
  cudaEvent_t e = nullptr;
  cudaEventCreate(&e);
  return e;
}

void PhaseTimer::Begin() {
  if (!stream_) return;
  step_.clear();
  pool_used_ = 0;
  Mark(kOther);  // the step's start; its phase is never charged
}

void PhaseTimer::Mark(Phase phase) {
  if (!stream_) return;
  if (capturing_) {
    owned_.push_back(NewEvent());
    cudaEventRecordWithFlags(owned_.back(), stream_, cudaEventRecordExternal);
    captured_.emplace_back(owned_.back(), phase);
    return;
  }
  if (pool_used_ == pool_.size()) pool_.push_back(NewEvent());
  cudaEvent_t e = pool_[pool_used_++];
  cudaEventRecord(e, stream_);
  step_.emplace_back(e, phase);
}

void PhaseTimer::BeginCapture() {
  capturing_ = enabled();
  captured_.clear();
}

PhaseTimer::Marks PhaseTimer::EndCapture() {
  capturing_ = false;
  return std::move(captured_);
}

void PhaseTimer::Replayed(const Marks& marks) {
  if (stream_) step_.insert(step_.end(), marks.begin(), marks.end());
}

void PhaseTimer::Collect() {
  if (!stream_) return;
  for (size_t i = 1; i < step_.size(); ++i) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, step_[i - 1].first, step_[i].first) == cudaSuccess)
      totals_[step_[i].second] += ms;
  }
  step_.clear();
}

absl::StatusOr<std::unique_ptr<CudaLayerExecutor>> CudaLayerExecutor::Create(const CudaModelWeights* weights,
                                                                             int64_t max_tokens,
                                                                             cudaStream_t stream, bool gemv) {
  std::unique_ptr<CudaLayerExecutor> e(new CudaLayerExecutor());
  e->weights_ = weights;
  e->stream_ = stream;
  e->max_tokens_ = max_tokens;
  ASSIGN_OR_RETURN(e->gemm_, kernels::cuda::CublasGemm::Create(stream));
  e->gemm_->set_gemv(gemv);
  const ModelSpec& s = weights->spec();
  const int64_t normed = AlignUp(max_tokens * s.hidden_size * 2);
  const int64_t gate_up = AlignUp(max_tokens * 2 * s.intermediate_size * 2);
  const int64_t act = AlignUp(max_tokens * s.intermediate_size * 2);
  CUDA_RETURN_IF_ERROR(cudaMalloc(&e->scratch_, static_cast<size_t>(normed + gate_up + act)));
  auto* base = static_cast<unsigned char*>(e->scratch_);
  e->normed_ = reinterpret_cast<bf16*>(base);
  e->gate_up_ = reinterpret_cast<bf16*>(base + normed);
  e->act_ = reinterpret_cast<bf16*>(base + normed + gate_up);
  return e;
}

CudaLayerExecutor::~CudaLayerExecutor() {
  if (scratch_) cudaFree(scratch_);
}

absl::Status CudaLayerExecutor::Embed(const int32_t* tokens, int64_t num_tokens, float* x) {
  const ModelSpec& s = spec();
  kc::EmbeddingParams p;
  p.ids = tokens;
  p.table = weights_->embed();
  p.out = x;
  p.n = num_tokens;
  p.vocab = s.vocab_size;
  p.hidden = s.hidden_size;
  RETURN_IF_ERROR(kc::Embedding(p, stream_));
  Mark(PhaseTimer::kOther);
  return absl::OkStatus();
}

absl::Status CudaLayerExecutor::PreAttention(int64_t layer, float* x, const int32_t* positions,
                                             int64_t num_tokens, bf16* qkv) {
  const ModelSpec& s = spec();
  const CudaModelWeights::Layer& w = weights_->layer(layer);
  if (num_tokens > max_tokens_)
    return absl::InvalidArgumentError("PreAttention: more rows than the executor holds");
  kc::AddRmsNormParams norm;
  norm.residual = x;
  norm.weight = w.input_norm;
  norm.out = normed_;
  norm.n = num_tokens;
  norm.d = s.hidden_size;
  norm.eps = static_cast<float>(s.rms_norm_eps);
  RETURN_IF_ERROR(kc::AddRmsNorm(norm, stream_));
  Mark(PhaseTimer::kOther);
  RETURN_IF_ERROR(gemm_->Run(
      {.x = normed_, .w = w.wqkv, .y = qkv, .m = num_tokens, .n = qkv_width(), .k = s.hidden_size}));
  Mark(PhaseTimer::kGemm);
  kc::RopeParams rope;
  rope.q = qkv;
  rope.k = qkv + s.q_dim();
  rope.positions = positions;
  rope.inv_freq = weights_->inv_freq();
  rope.n = num_tokens;
  rope.num_heads = s.num_heads;
  rope.num_kv_heads = s.num_kv_heads;
  rope.head_dim = s.head_dim;
  rope.q_stride = qkv_width();
  rope.k_stride = qkv_width();
  RETURN_IF_ERROR(kc::Rope(rope, stream_));
  Mark(PhaseTimer::kOther);
  return absl::OkStatus();
}

absl::Status CudaLayerExecutor::PostAttention(int64_t layer, float* x, const bf16* attn, int64_t num_tokens) {
  const ModelSpec& s = spec();
  const CudaModelWeights::Layer& w = weights_->layer(layer);
  const int64_t inter = s.intermediate_size;
  RETURN_IF_ERROR(gemm_->Run({.x = attn,
                              .w = w.wo,
                              .y = x,
                              .y_fp32 = true,
                              .accumulate = true,
                              .m = num_tokens,
                              .n = s.hidden_size,
                              .k = s.q_dim()}));
  Mark(PhaseTimer::kGemm);
  kc::AddRmsNormParams norm;
  norm.residual = x;
  norm.weight = w.post_norm;
  norm.out = normed_;
  norm.n = num_tokens;
  norm.d = s.hidden_size;
  norm.eps = static_cast<float>(s.rms_norm_eps);
  RETURN_IF_ERROR(kc::AddRmsNorm(norm, stream_));
  Mark(PhaseTimer::kOther);
  RETURN_IF_ERROR(gemm_->Run(
      {.x = normed_, .w = w.w_gate_up, .y = gate_up_, .m = num_tokens, .n = 2 * inter, .k = s.hidden_size}));
  Mark(PhaseTimer::kGemm);
  kc::SiluMulParams act;
  act.gate_up = gate_up_;
  act.out = act_;
  act.n = num_tokens;
  act.inter = inter;
  RETURN_IF_ERROR(kc::SiluMul(act, stream_));
  Mark(PhaseTimer::kOther);
  RETURN_IF_ERROR(gemm_->Run({.x = act_,
                              .w = w.w_down,
                              .y = x,
                              .y_fp32 = true,
                              .accumulate = true,
                              .m = num_tokens,
                              .n = s.hidden_size,
                              .k = inter}));
  Mark(PhaseTimer::kGemm);
  return absl::OkStatus();
}

absl::Status CudaLayerExecutor::Logits(float* x, int64_t num_tokens, const int32_t* rows, int64_t num_rows,
                                       float* logits) {
  const ModelSpec& s = spec();
  kc::AddRmsNormParams norm;
  norm.residual = x;
  norm.weight = weights_->final_norm();
  norm.out = normed_;
  norm.out_rows = rows;
  norm.n = num_tokens;
  norm.n_out = num_rows;
  norm.d = s.hidden_size;
  norm.eps = static_cast<float>(s.rms_norm_eps);
  RETURN_IF_ERROR(kc::AddRmsNorm(norm, stream_));
  Mark(PhaseTimer::kOther);
  RETURN_IF_ERROR(gemm_->Run({.x = normed_,
                              .w = weights_->lm_head(),
                              .y = logits,
                              .y_fp32 = true,
                              .m = num_rows,
                              .n = s.vocab_size,
                              .k = s.hidden_size}));
  Mark(PhaseTimer::kGemm);
  return absl::OkStatus();
}

}  // namespace tandem
