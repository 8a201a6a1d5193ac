// A model runner executes one engine step on one backend: the forward pass of every layer for the
// step's tokens (embedding, norms, GEMMs, RoPE, KV append, attention) and the sampling of the
// rows that produce a token. The engine (colocated/engine.h) owns scheduling and the KV slot
// allocator; a runner owns the weights, the KV storage for the slots and the scratch memory.
//
// Thread safety: one thread drives a runner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_spec.h"
#include "compute_node/weights.h"
#include "kernels/cpu/ops.h"

namespace tandem {

// The tokens of one step, already placed in KV slots by the engine. Requests are ordered with
// every single-row request (decode, or a one-token prefill chunk) first: the first `num_single`
// requests have exactly one query row each.
struct StepBatch {
  std::vector<int32_t> tokens;     // (T) input token of each row
  std::vector<int32_t> positions;  // (T) its position in its request's context
  std::vector<int32_t> new_slots;  // (T) the KV slot its K and V are written to
  std::vector<int32_t> q_indptr;   // (R + 1) rows of request r: [q_indptr[r], q_indptr[r+1])
  std::vector<int32_t> kv_indptr;  // (R + 1)
  std::vector<int32_t> kv_slots;   // slots of each request's whole context, in position order
  int64_t num_single = 0;
  int64_t max_kv_len = 0, max_q_len = 0;
  // Rows whose logits are sampled, with their sampling parameters and counters.
  std::vector<int32_t> sample_rows;
  std::vector<kernels::cpu::SamplingParams> sampling;
  std::vector<uint64_t> counters;

  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_requests() const { return static_cast<int64_t>(q_indptr.size()) - 1; }
};

struct RunnerOptions {
  int64_t max_batch_size = 64;
  int64_t max_tokens_per_step = 2048;
  int64_t kv_capacity_tokens = 0;   // 0: sized from free memory
  double kv_memory_fraction = 0.5;  // share of free memory after weights for KV when sized
  bool profile = false;             // time phases of each step (CUDA events; for benchmarks)
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelSpec& spec() const = 0;
  // KV slots the runner holds storage for.
  virtual int64_t kv_capacity() const = 0;
  // "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string device() const = 0;
  // Runs the step; appends one token and its log-probability per sample row.
  virtual absl::Status Forward(const StepBatch& batch, std::vector<int32_t>* tokens,
                               std::vector<float>* logprobs) = 0;
  // With RunnerOptions::profile: device time (ms) spent so far per phase ("gemm", "attention",
  // "other", "sampling"). Empty when not profiling or not supported.
  virtual std::vector<std::pair<std::string, double>> PhaseTotalsMs() const { return {}; }
};

// fp32 weights and KV in host memory (the reference).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuRunner(const WeightSource& source,
                                                             const RunnerOptions& options);
// Empty if the CUDA runner can run models of `spec`, else why not (e.g. an unsupported head_dim).
std::string CudaRunnerUnsupported(const ModelSpec& spec);
// bf16 weights and KV on CUDA device `device`; Unavailable when the CUDA backend is not built
// or the device is absent, Unimplemented for a model it cannot run (CudaRunnerUnsupported).
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(const WeightSource& source,
                                                              const RunnerOptions& options, int device);

}  // namespace tandem
