// Built when the CUDA backend is not compiled in: answers truthfully that it is absent.
#include "kernels/cuda/device.h"

namespace tandem::kernels {

bool CudaCompiledIn() { return false; }

absl::StatusOr<int> CudaDeviceCount() {
  return absl::UnavailableError(
      "this tandem was built without the CUDA backend (TANDEM_CUDA=OFF or no nvcc)");
}

absl::StatusOr<std::vector<CudaDeviceInfo>> CudaDevices() {
  absl::StatusOr<int> n = CudaDeviceCount();
  return n.status();
}

}  // namespace tandem::kernels
