// The compute half of a decode step on one device (docs/architecture.md, "One layer of a decode
// step", without attention): embedding, per layer the linear parts before and after attention,
// then logits and sampling. Attention happens elsewhere: on a memory rank, or in the colocated
// engine's attention executor.
//
//   BeginStep(step)                         // upload the step's tokens, positions, sampling; embed
//   for each layer:  PreAttention(l, qkv)   // norm, QKV GEMM, RoPE -> qkv (T, qkv_width)
//                    ... attention fills attn (T, q_dim) ...
//                    PostAttention(l, attn) // x += attn·Woᵀ; x += FFN(norm(x))
//   Finish(&tokens, &logprobs)              // logits of the sample rows, sampling, results
//
// qkv and attn live in the backend's memory (device for CUDA, host for CPU); staging to and from
// the network goes through memory() (Allocate(pinned), CopyIn, CopyOut, Synchronize). The CPU backend
// computes in fp32, the CUDA backend in bf16 (fp32 residual stream and accumulation).
//
// Thread safety: one thread drives a backend.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/backend_buffer.h"
#include "common/dtype.h"
#include "common/model_spec.h"
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
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
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
  // Appends one token and its log-probability per sample row; waits for the step's work.
  virtual absl::Status Finish(std::vector<int32_t>* tokens, std::vector<float>* logprobs) = 0;

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
