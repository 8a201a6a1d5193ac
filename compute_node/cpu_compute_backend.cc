// The CPU compute backend: fp32 weights (CpuLayerExecutor) and sampling by the CPU reference.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "compute_node/compute_backend.h"
#include "compute_node/layer_executor.h"

namespace tandem {

namespace cpu = kernels::cpu;

namespace {

class CpuComputeBackend : public ComputeBackend {
 public:
  CpuComputeBackend(std::shared_ptr<const ModelWeightsF32> weights, const ComputeBackendOptions& o)
      : weights_(std::move(weights)), executor_(weights_.get()), options_(o) {}

  const ModelSpec& spec() const override { return weights_->spec; }
  std::string device() const override { return "cpu"; }
  DType dtype() const override { return DType::kF32; }

  absl::Status BeginStep(const StepTokens& step) override {
    if (step.num_tokens() > options_.max_tokens ||
        static_cast<int64_t>(step.sample_rows.size()) > options_.max_requests) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step of ", step.num_tokens(), " rows and ", step.sample_rows.size(),
          " sampled rows exceeds the limits (", options_.max_tokens, ", ", options_.max_requests, ")"));
    }
    step_ = &step;
    x_.resize(static_cast<size_t>(step.num_tokens() * spec().hidden_size));
    return executor_.Embed(step.tokens, x_.data());
  }
  absl::Status PreAttention(int64_t layer, void* qkv) override {
    return executor_.PreAttention(layer, x_.data(), step_->positions, static_cast<float*>(qkv));
  }
  absl::Status PostAttention(int64_t layer, const void* attn) override {
    return executor_.PostAttention(layer, x_.data(), static_cast<const float*>(attn), step_->num_tokens());
  }
  absl::Status Finish(SampledTokens* out) override {
    const StepTokens& st = *step_;
    if (st.sample_rows.empty()) return absl::OkStatus();
    const int64_t vocab = spec().vocab_size;
    logits_.resize(st.sample_rows.size() * static_cast<size_t>(vocab));
    RETURN_IF_ERROR(executor_.Logits(x_.data(), st.sample_rows, logits_.data()));
    for (size_t i = 0; i < st.sample_rows.size(); ++i) {
      const float* row = logits_.data() + static_cast<int64_t>(i) * vocab;
      const int32_t token = cpu::SampleToken(row, vocab, st.sampling[i], st.counters[i]);
      top_.clear();
      if (const int32_t k = st.top_logprobs_of(i); k > 0) cpu::TopLogprobs(row, vocab, k, &top_);
      out->Append(token, cpu::TokenLogprob(row, vocab, token), top_);
    }
    return absl::OkStatus();
  }

  absl::Status EndStep() override { return absl::OkStatus(); }
  void* residual() override { return x_.data(); }
  MemorySpace& memory() override { return memory_; }

  absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateLane() override {
    return std::unique_ptr<ComputeBackend>(new CpuComputeBackend(weights_, options_));
  }

 private:
  HostMemorySpace memory_;
  std::shared_ptr<const ModelWeightsF32> weights_;
  CpuLayerExecutor executor_;
  ComputeBackendOptions options_;
  const StepTokens* step_ = nullptr;
  std::vector<float> x_, logits_;
  std::vector<TopLogprob> top_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCpuComputeBackend(
    const WeightSource& source, const ComputeBackendOptions& options) {
  ASSIGN_OR_RETURN(ModelWeightsF32 weights, LoadWeightsF32(source));
  return std::unique_ptr<ComputeBackend>(
      new CpuComputeBackend(std::make_shared<const ModelWeightsF32>(std::move(weights)), options));
}

}  // namespace tandem
