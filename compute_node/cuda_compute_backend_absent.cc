// Built when the CUDA backend is not: the CUDA compute backend says so.
#include "compute_node/compute_backend.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<ComputeBackend>> CreateCudaComputeBackend(const WeightSource&,
                                                                         const ComputeBackendOptions&, int) {
  return absl::UnavailableError(
      "this tandem was built without the CUDA backend (TANDEM_CUDA=OFF or no nvcc)");
}

}  // namespace tandem
