// Converts CUDA runtime errors into absl::Status at the call site, keeping the failing expression
// and file:line (after NCCL's CUDACHECK). Include only from CUDA-enabled translation units.
#pragma once

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace tandem::kernels {

inline absl::Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(expr, " failed at ", file, ":", line, ": ", cudaGetErrorName(err), " (",
                                 cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(msg);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(msg);
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return absl::UnavailableError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace tandem::kernels

#define CUDA_RETURN_IF_ERROR(expr) \
  RETURN_IF_ERROR(::tandem::kernels::CudaErrorToStatus((expr), #expr, __FILE__, __LINE__))
