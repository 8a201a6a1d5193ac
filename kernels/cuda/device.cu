#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device.h"

namespace tandem::kernels {

bool CudaCompiledIn() { return true; }

absl::StatusOr<int> CudaDeviceCount() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  // No driver or no device is a normal answer on CPU machines, not an error.
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    (void)cudaGetLastError();
    return 0;
  }
  CUDA_RETURN_IF_ERROR(err);
  return n;
}

absl::StatusOr<std::vector<CudaDeviceInfo>> CudaDevices() {
  ASSIGN_OR_RETURN(const int n, CudaDeviceCount());
  std::vector<CudaDeviceInfo> out;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, i));
    CUDA_RETURN_IF_ERROR(cudaSetDevice(i));
    size_t free_b = 0, total_b = 0;
    CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_b, &total_b));
    out.push_back({.index = i,
                   .name = prop.name,
                   .compute_major = prop.major,
                   .compute_minor = prop.minor,
                   .total_memory_bytes = static_cast<int64_t>(total_b),
                   .free_memory_bytes = static_cast<int64_t>(free_b),
                   .multiprocessors = prop.multiProcessorCount});
  }
  return out;
}

}  // namespace tandem::kernels
