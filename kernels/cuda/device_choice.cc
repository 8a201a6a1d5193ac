#include "kernels/cuda/device_choice.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "kernels/cuda/device.h"

namespace tandem::kernels {

std::string CudaAttentionUnsupported(int64_t head_dim) {
  if (head_dim != 64 && head_dim != 128) {
    return absl::StrCat("head_dim ", head_dim, " is not supported by the CUDA attention kernels (64 or 128)");
  }
  return "";
}

absl::StatusOr<int> ResolveDevice(const std::string& device, const ModelSpec& spec) {
  if (device == "cpu") return -1;
  if (device == "auto") {
    absl::StatusOr<int> n = CudaDeviceCount();
    if (!n.ok() || *n == 0) return -1;
    const std::string why = CudaAttentionUnsupported(spec.head_dim);
    if (!why.empty()) {
      TANDEM_LOG_WARN("engine", "running on the CPU although a GPU is present: ", why);
      return -1;
    }
    return 0;
  }
  int index = 0;
  if (device == "cuda" ||
      (device.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(device.substr(5), &index) && index >= 0)) {
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("runtime.device: expected cpu, cuda, cuda:N or auto, got \"", device, "\""));
}

}  // namespace tandem::kernels
