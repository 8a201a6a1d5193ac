#include "common/backend_buffer.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tandem {

void CopyStridedHost(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                     size_t rows) {
  if (width == 0) return;
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t r = 0; r < rows; ++r) std::memcpy(d + r * dst_pitch, s + r * src_pitch, width);
}

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
