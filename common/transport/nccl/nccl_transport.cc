// The NCCL transport's factory (see nccl_internal.h for the design).
#include "common/transport/nccl/nccl_transport.h"

#include <unistd.h>

#include <cstdlib>

#include "common/transport/nccl/nccl_internal.h"

namespace tandem::transport {

using nccl_internal::NcclTransport;

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError(absl::StrCat("nccl transport: no CUDA device (",
                                               err == cudaSuccess ? "none found" : cudaGetErrorString(err),
                                               ")"));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("nccl transport: cuda:", options.device, " requested but ",
                                                   count, " device(s) are visible"));
  }
  if (options.share_gpu && std::getenv("NCCL_HOSTID") == nullptr) {
    // Before NCCL's first use in this process (it reads the host id once): ranks of other
    // processes on this GPU then look like ranks of other hosts (factory.h).
    char host[256] = {};
    (void)gethostname(host, sizeof(host) - 1);
    const std::string id = absl::StrCat(host, "-tandem-", getpid());
    setenv("NCCL_HOSTID", id.c_str(), 0);
    TANDEM_LOG_INFO("transport", "nccl: TANDEM_NCCL_SHARE_GPU: NCCL_HOSTID=", id,
                    " (ranks on one GPU talk over NCCL's network transport)");
  }
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version < NCCL_VERSION(2, 18, 0)) {
    return absl::UnavailableError(absl::StrCat(
        "nccl transport: NCCL 2.18 or newer is needed; the loaded library is version code ", version));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Transport> control,
                   CreateUcxTransport({.listen_address = options.listen_address}));
  auto t = std::make_unique<NcclTransport>(std::move(control), options.device);
  RETURN_IF_ERROR(t->Init());
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace tandem::transport
