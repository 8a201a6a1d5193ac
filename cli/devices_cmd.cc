// `tandem devices`: the accelerators this process can use, and the transports this build has.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cli/commands.h"
#include "common/transport/factory.h"
#include "common/transport/verbs/verbs_transport.h"
#include "kernels/cuda/device.h"

namespace tandem::cli {

void AddDevicesCommand(CLI::App& app) {
  app.add_subcommand("devices",
                     "List the CUDA devices and RDMA devices this process can see, and the transports "
                     "this build has")
      ->callback([] {
        absl::StatusOr<std::vector<kernels::CudaDeviceInfo>> devices = kernels::CudaDevices();
        if (!devices.ok()) {
          std::printf("%s; tandem runs on the CPU backend\n",
                      std::string(devices.status().message()).c_str());
        } else if (devices->empty()) {
          std::printf("no CUDA device found; tandem runs on the CPU backend\n");
        }
        for (const kernels::CudaDeviceInfo& d :
             devices.ok() ? *devices : std::vector<kernels::CudaDeviceInfo>{}) {
          std::printf("%s\n",
                      absl::StrFormat("cuda:%d  %s  sm_%d%d  %d SMs  %.1f GiB (%.1f GiB free)", d.index,
                                      d.name, d.compute_major, d.compute_minor, d.multiprocessors,
                                      d.total_memory_bytes / 1073741824.0, d.free_memory_bytes / 1073741824.0)
                          .c_str());
        }
        std::vector<std::string> built;
        for (const transport::TransportInfo& t : transport::TransportTable()) {
          if (t.built) built.push_back(t.name);
        }
        const std::vector<std::string> rdma = transport::RdmaDeviceNames();
        std::printf("transports in this build: %s\n", absl::StrJoin(built, ", ").c_str());
        std::printf("RDMA devices (verbs): %s\n", rdma.empty() ? "none" : absl::StrJoin(rdma, ", ").c_str());
      });
}

}  // namespace tandem::cli
