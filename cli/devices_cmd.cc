// `tandem devices`: the accelerators this process can use.
#include <cstdio>

#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "kernels/cuda/device.h"

namespace tandem::cli {

void AddDevicesCommand(CLI::App& app) {
  app.add_subcommand("devices", "List the CUDA devices this process can see")->callback([] {
    absl::StatusOr<std::vector<kernels::CudaDeviceInfo>> devices = kernels::CudaDevices();
    if (!devices.ok()) Fail("devices", devices.status());
    if (devices->empty()) std::printf("no CUDA device found; tandem runs on the CPU backend\n");
    for (const kernels::CudaDeviceInfo& d : *devices) {
      std::printf("%s\n",
                  absl::StrFormat("cuda:%d  %s  sm_%d%d  %d SMs  %.1f GiB (%.1f GiB free)", d.index, d.name,
                                  d.compute_major, d.compute_minor, d.multiprocessors,
                                  d.total_memory_bytes / 1073741824.0, d.free_memory_bytes / 1073741824.0)
                      .c_str());
    }
  });
}

}  // namespace tandem::cli
