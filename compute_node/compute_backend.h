// The compute half of a decode step on one device (docs/architecture.md, "One layer of a decode
// step", without attention): embedding, per layer the linear parts before and after attention,
// then logits and sampling. Attention happens elsewhere: on a memory rank, or in the colocated
// engine's attention executor.
//
//   BeginStep(step)                         // upload the step's tokens, positions, sampling; embed
//   for each layer:  PreAttention(l, qkv)   // norm, QKV GEMM, RoPE -> qkv (T, qkv_width)
//                    ... attention fills attn (T, q_dim) ...
//                    PostAttention(l, attn) // x += attn·Woᵀ; x += FFN(norm(x))
//   Finish(&sampled)                        // logits of the sample rows, sampling, results
//
// qkv and attn live in the backend's memory (device for CUDA, host for CPU); staging to and from
// the network goes through memory() (Allocate(pinned), CopyIn, CopyOut, Synchronize). The CPU backend
// computes in fp32, the CUDA backend in bf16 (fp32 residual stream and accumulation).
//
// Thread safety: one thread drives a backend.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/backend_buffer.h"
#include "common/dtype.h"
#include "common/model_spec.h"
#include "common/top_logprobs.h"
#include "compute_node/weights.h"
#include "kernels/cpu/ops.h"

namespace tandem {

// The compute side of one step: rows in step order.
struct StepTokens {
  std::vector<int32_t> tokens;     // (T) input token of each row
  std::vector<int32_t> positions;  // (T) its position in its request's context
  // Rows whose logits are sampled, with their sampling parameters and counters.
  std::vector<int32_t> sample_rows;
  std::vector<kernels::cpu::SamplingParams> sampling;
  std::vector<uint64_t> counters;
  // Top log-probability alternatives each sample row asks for, in [0, kMaxTopLogprobs]; empty when
  // no row asks (the default: then Finish copies no logits and sorts nothing).
  std::vector<int32_t> top_logprobs;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int32_t top_logprobs_of(size_t sample) const { return top_logprobs.empty() ? 0 : top_logprobs[sample]; }
};

// What Finish produces: one entry per sample row, in order.
struct SampledTokens {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;  // log_softmax(logits)[token], natural log, before temperature
  // Empty when no row asked for alternatives; else one list per row (empty for a row that asked
  // for none): its StepTokens::top_logprobs most probable tokens (common/top_logprobs.h).
  std::vector<std::vector<TopLogprob>> top;
  size_t size() const { return tokens.size(); }
  std::span<const TopLogprob> top_of(size_t i) const {
    return top.empty() ? std::span<const TopLogprob>() : std::span<const TopLogprob>(top[i]);
  }
  // Appends one row (keeping `top` empty while no row has alternatives, else one list per row).
  void Append(int32_t token, float logprob, std::span<const TopLogprob> alternatives = {}) {
    tokens.push_back(token);
    logprobs.push_back(logprob);
    if (top.empty() && alternatives.empty()) return;
    top.resize(tokens.size() - 1);  // the rows before, when this is the first with alternatives
    top.emplace_back(alternatives.begin(), alternatives.end());
  }
  void AppendFrom(const SampledTokens& other, size_t i) {
    Append(other.tokens[i], other.logprobs[i], other.top_of(i));
  }
};

struct ComputeBackendOptions {
  int64_t max_tokens = 2048;  // rows per step at most
  int64_t max_requests = 64;  // sampled rows per step at most
  bool profile = false;       // per-phase device times (CUDA events; benchmarks)
  // CUDA: run each layer's linear parts as CUDA graphs for steps of up to 512 rows (rows padded
  // up to a bucket: 1, 2, 4, 8, 16, 24, ..., 512), captured on first use. Off by default: on an
  // H200 host that enqueues quickly, graphs measured 0-10% slower than launching each kernel
  // (docs/benchmarks.md, "Linear layers"); they are for hosts whose launches cannot keep up with
  // the GPU. Ignored on the CPU.
  bool cuda_graphs = false;
  // CUDA: one-row GEMMs (decode at batch 1) through tandem's GEMV kernel instead of cuBLAS
  // (docs/benchmarks.md, "Linear layers alone"). false: cuBLAS for every GEMM (benchmarks compare
  // the two). Ignored on the CPU.
  bool gemv = true;
};

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  virtual const ModelSpec& spec() const = 0;
  virtual std::string device() const = 0;  // "cpu", "cuda:0 (NVIDIA H200)"
  virtual DType dtype() const = 0;         // of qkv and attn rows: f32 (cpu), bf16 (cuda)
  int64_t qkv_width() const { return spec().q_dim() + 2 * spec().kv_dim(); }

  // InvalidArgument if the step exceeds the limits the backend was created with.
  virtual absl::Status BeginStep(const StepTokens& step) = 0;
  virtual absl::Status PreAttention(int64_t layer, void* qkv) = 0;
  // May hold its work until the next PreAttention or Finish, which enqueue it first (the CUDA
  // backend does, to run it and the next layer's PreAttention as one graph): attn must stay
  // unchanged until then.
  virtual absl::Status PostAttention(int64_t layer, const void* attn) = 0;
  // Appends one token, its log-probability and (for rows that ask) its top alternatives per sample
  // row to `out`; waits for the step's work. Alternatives cost only the rows that ask: their logits
  // rows (copied to the host on CUDA) go through kernels::cpu::TopLogprobs.
  virtual absl::Status Finish(SampledTokens* out) = 0;

  // Ends a step this backend does not sample (pipeline.mode rotational: a micro-batch whose last
  // layer runs on another compute rank): waits for the step's work and, on the backend that opened
  // the phase timeline, closes it, as Finish does.
  virtual absl::Status EndStep() = 0;
  // The residual stream: (max_tokens, hidden_size) fp32 in memory(), rows [0, T) this step's. A
  // rotational pipeline (common/pipeline_schedule.h) hands it from one compute rank to the next
  // between PreAttention(l) and PostAttention(l): the sender reads it once PreAttention(l)'s work
  // is done (stream order on a GPU), the receiver overwrites it after BeginStep and before
  // PostAttention(l). The CUDA backend's is one allocation for the backend's life (a transport
  // can register it); the CPU backend's is valid from BeginStep to the next BeginStep.
  virtual void* residual() = 0;
  int64_t residual_bytes(int64_t rows) const { return rows * spec().hidden_size * 4; }

  // Where qkv and attn live, for staging to and from the network (see the file comment).
  virtual MemorySpace& memory() = 0;
  // The CUDA stream the backend enqueues on (cudaStream_t), so attention can share it; nullptr
  // on the CPU.
  virtual void* stream() const { return nullptr; }
  // With `profile`: device time (ms) per phase so far ("gemm", "attention", "other",
  // "sampling"). MarkAttention() charges the time since the backend's last mark to "attention"
  // (call it after enqueueing attention on stream()). Empty / no-op otherwise.
  virtual std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return {}; }
  virtual void MarkAttention() {}

  // A lane: another backend over the same weights, with step state and scratch of its own, so that
  // several micro-batches can be in flight at once (pipelining; compute_node/micro_batches.h). A
  // lane of a CUDA backend enqueues on the same stream, and with `profile` charges its phases to
  // the same timeline, which this backend opens in BeginStep and closes in Finish: in a step that
  // uses lanes, call this backend's BeginStep before any lane's and its Finish after every
  // lane's. A lane's PhaseTotalsMs is empty (its time is in this backend's). This backend must
  // outlive its lanes.
  virtual absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateLane() = 0;
};

// fp32 weights in host memory.
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCpuComputeBackend(const WeightSource& source,
                                                                        const ComputeBackendOptions& options);
// bf16 weights on CUDA device `device` (made current). Unavailable without the CUDA backend or
// the device.
absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCudaComputeBackend(const WeightSource& source,
                                                                         const ComputeBackendOptions& options,
                                                                         int device);

}  // namespace tandem
