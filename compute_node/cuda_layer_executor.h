// The non-attention half of a Llama decoder on the CUDA backend: bf16 weights on one device,
// cuBLAS GEMMs with fp32 accumulation, an fp32 residual stream (the residual adds are fused into
// the Wo and W_down GEMMs), bf16 activations. The counterpart of CpuLayerExecutor; same split:
//
//   Embed → for each layer: PreAttention (norm, QKV GEMM, RoPE) · attention elsewhere ·
//   PostAttention (Wo GEMM into x, norm, gate/up GEMM, SiLU·up, W_down GEMM into x) → Logits.
//
// All pointers are device pointers; calls enqueue work on the executor's stream and never
// synchronise. Thread safety: one thread per executor.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "compute_node/weights.h"
#include "kernels/cuda/gemm.h"

namespace tandem {

// Weights of a model in one device allocation, fused like ModelWeightsF32 (wqkv = [q; k; v],
// w_gate_up = [gate; up]), in bf16, plus the RoPE inverse frequencies (fp32).
class CudaModelWeights {
 public:
  using bf16 = __nv_bfloat16;
  struct Layer {
    bf16 *input_norm, *wqkv, *wo, *post_norm, *w_gate_up, *w_down;
  };
  // Reads every tensor of `source` (several host threads), converts to bf16 and copies it to the
  // current device. ResourceExhausted naming the sizes if the device cannot hold it.
  static absl::StatusOr<std::unique_ptr<CudaModelWeights>> Upload(const WeightSource& source);
  ~CudaModelWeights();
  CudaModelWeights(const CudaModelWeights&) = delete;
  CudaModelWeights& operator=(const CudaModelWeights&) = delete;

  const ModelSpec& spec() const { return spec_; }
  int64_t bytes() const { return bytes_; }
  const bf16* embed() const { return embed_; }
  const bf16* lm_head() const { return lm_head_; }
  const bf16* final_norm() const { return final_norm_; }
  const Layer& layer(int64_t l) const { return layers_[static_cast<size_t>(l)]; }
  const float* inv_freq() const { return inv_freq_; }

 private:
  CudaModelWeights() = default;
  ModelSpec spec_;
  void* base_ = nullptr;
  int64_t bytes_ = 0;
  bf16 *embed_ = nullptr, *lm_head_ = nullptr, *final_norm_ = nullptr;
  std::vector<Layer> layers_;
  float* inv_freq_ = nullptr;
};

// Attributes the GPU time of a step to phases with CUDA events, for benchmarks: each Mark(phase)
// charges the time since the previous mark to `phase`. Disabled (the default), every call is a
// no-op. Work captured into a CUDA graph keeps its marks: between BeginCapture and EndCapture,
// Mark records events as graph nodes (cudaEventRecordExternal) that belong to that graph, and
// Replayed(marks) puts them into the current step each time the graph is launched. Not
// thread-safe.
class PhaseTimer {
 public:
  enum Phase { kGemm = 0, kAttention, kOther, kSampling, kNumPhases };
  using Marks = std::vector<std::pair<cudaEvent_t, Phase>>;  // events of one captured graph
  static const char* Name(Phase p);
  PhaseTimer() = default;
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  void Enable(cudaStream_t stream) { stream_ = stream; }
  bool enabled() const { return stream_ != nullptr; }
  void Begin();            // starts a step
  void Mark(Phase phase);  // time since the previous mark goes to `phase`
  // Capture of a graph on the timer's stream: the marks in between become the graph's own.
  void BeginCapture();
  Marks EndCapture();
  // A graph whose capture produced `marks` was launched on the stream (after the last mark).
  void Replayed(const Marks& marks);
  // After the stream has been synchronised: adds the step's times (ms) to the totals.
  void Collect();
  const double* totals_ms() const { return totals_; }

 private:
  cudaEvent_t NewEvent();
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> pool_;  // events of eager marks, reused every step
  size_t pool_used_ = 0;
  std::vector<cudaEvent_t> owned_;  // events of captured graphs
  Marks step_;                      // this step's marks in stream order; step_[0] is its start
  bool capturing_ = false;
  Marks captured_;
  double totals_[kNumPhases] = {0, 0, 0, 0};
};

class CudaLayerExecutor {
 public:
  using bf16 = __nv_bfloat16;
  // Scratch for up to `max_tokens` rows per call and `max_logit_rows` rows of logits.
  static absl::StatusOr<std::unique_ptr<CudaLayerExecutor>> Create(const CudaModelWeights* weights,
                                                                   int64_t max_tokens, cudaStream_t stream,
                                                                   bool gemv = true);
  ~CudaLayerExecutor();
  CudaLayerExecutor(const CudaLayerExecutor&) = delete;
  CudaLayerExecutor& operator=(const CudaLayerExecutor&) = delete;

  const ModelSpec& spec() const { return weights_->spec(); }
  int64_t qkv_width() const { return spec().q_dim() + 2 * spec().kv_dim(); }
  // Phases of the executor's work are charged to `timer` (which must outlive the executor).
  void set_timer(PhaseTimer* timer) { timer_ = timer; }

  // x(T, hidden) fp32 = embedding rows of tokens (device ids, validated by the caller).
  absl::Status Embed(const int32_t* tokens, int64_t num_tokens, float* x);
  // qkv(T, qkv_width) bf16 for `layer`, RoPE applied to q and k at `positions` (device).
  absl::Status PreAttention(int64_t layer, float* x, const int32_t* positions, int64_t num_tokens, bf16* qkv);
  // x += attn(T, q_dim)·Woᵀ; x += W_down·(silu(gate)·up)(RMSNorm(x)).
  absl::Status PostAttention(int64_t layer, float* x, const bf16* attn, int64_t num_tokens);
  // logits(R, vocab) fp32 for rows `rows` (device, R of them) of x.
  absl::Status Logits(float* x, int64_t num_tokens, const int32_t* rows, int64_t num_rows, float* logits);

 private:
  CudaLayerExecutor() = default;
  const CudaModelWeights* weights_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::cuda::CublasGemm> gemm_;
  int64_t max_tokens_ = 0;
  PhaseTimer* timer_ = nullptr;
  void Mark(PhaseTimer::Phase p) {
    if (timer_) timer_->Mark(p);
  }
  void* scratch_ = nullptr;
  bf16* normed_ = nullptr;   // (max_tokens, hidden)
  bf16* gate_up_ = nullptr;  // (max_tokens, 2·intermediate)
  bf16* act_ = nullptr;      // (max_tokens, intermediate)
};

}  // namespace tandem
