// Built when the CUDA backend is not: the CUDA attention executor says so.
#include "absl/strings/str_cat.h"
#include "memory_node/attention_executor.h"

namespace tandem {

absl::StatusOr<std::unique_ptr<AttentionExecutor>> CreateCudaAttentionExecutor(const AttentionShape&,
                                                                               const KvPoolOptions&, int,
                                                                               void*) {
  return absl::UnavailableError(
      "this tandem was built without the CUDA backend (TANDEM_CUDA=OFF or no nvcc)");
}

}  // namespace tandem
