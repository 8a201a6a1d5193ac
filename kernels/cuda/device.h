// What CUDA devices this process can see. Works in every build: without the CUDA backend compiled
// in, DeviceCount() says so with an Unavailable status instead of pretending there is no GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::kernels {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int64_t total_memory_bytes = 0;
  int64_t free_memory_bytes = 0;
  int multiprocessors = 0;
};

// True when this binary was built with the CUDA backend.
bool CudaCompiledIn();
// Number of visible CUDA devices: 0 when a driver reports none (or no driver is installed),
// Unavailable when the CUDA backend is not compiled in.
absl::StatusOr<int> CudaDeviceCount();
// Properties of every visible device.
absl::StatusOr<std::vector<CudaDeviceInfo>> CudaDevices();

}  // namespace tandem::kernels
