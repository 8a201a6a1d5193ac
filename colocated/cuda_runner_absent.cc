// Built when the CUDA backend is not compiled in: says so instead of pretending.
#include "colocated/runner.h"

namespace tandem {

std::string CudaRunnerUnsupported(const ModelSpec&) {
  return "this tandem was built without the CUDA backend";
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaRunner(const WeightSource&, const RunnerOptions&,
                                                              int device) {
  return absl::UnavailableError(
      "runtime.device: cuda requested, but this tandem was built without the CUDA backend (TANDEM_CUDA=OFF "
      "or no nvcc)");
}

}  // namespace tandem
