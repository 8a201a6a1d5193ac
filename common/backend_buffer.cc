#include "common/backend_buffer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tandem {

absl::StatusOr<BackendBuffer> HostMemorySpace::Allocate(size_t bytes, bool) {
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
  if (!p)
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  return BackendBuffer(p, &std::free);
}

absl::Status HostMemorySpace::CopyIn(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status HostMemorySpace::CopyOut(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

}  // namespace tandem
