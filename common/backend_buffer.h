// The memory a compute backend or attention executor computes in, as the network side sees it:
// allocate buffers there (or page-locked host buffers that copy to and from it fast) and copy
// between it and host memory in the backend's order. A memory rank and compute rank stage
// per-layer messages through it; the GPU transports write into it directly.
#pragma once

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"

namespace tandem {

// Memory owned by a backend: device memory (CUDA), pinned host memory (CUDA's staging buffers)
// or plain host memory (CPU). Frees itself with its deleter.
using BackendBuffer = std::unique_ptr<void, void (*)(void*)>;

class MemorySpace {
 public:
  virtual ~MemorySpace() = default;
  // True when the backend computes in host memory (then no staging copies are needed).
  virtual bool host() const = 0;
  // `bytes` of the backend's memory (pinned == false), or of host memory that copies to and from
  // it are fast with (pinned == true; page-locked for CUDA).
  virtual absl::StatusOr<BackendBuffer> Allocate(size_t bytes, bool pinned) = 0;
  // Asynchronous copies in the backend's order (its stream), and the wait for all of them.
  virtual absl::Status CopyIn(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyOut(void* host_dst, const void* src, size_t bytes) = 0;
  // A 2-D copy in the backend's order: `rows` rows of `width` bytes, row r from
  // src + r * src_pitch to dst + r * dst_pitch (pitches >= width; the ranges must not overlap).
  // Either side may be the backend's memory or a buffer Allocate()d pinned (on CUDA: one
  // cudaMemcpy2DAsync on the backend's stream, any direction; on the host: a memcpy per row,
  // done when it returns). Used to pack and unpack head slices (common/head_partition.h).
  virtual absl::Status CopyStrided(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                                   size_t width, size_t rows) = 0;
  virtual absl::Status Synchronize() = 0;
};

// The host implementation of MemorySpace::CopyStrided: a memcpy per row.
void CopyStridedHost(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                     size_t rows);

// Host memory: 64-byte aligned allocations, copies are memcpy.
class HostMemorySpace : public MemorySpace {
 public:
  bool host() const override { return true; }
  absl::StatusOr<BackendBuffer> Allocate(size_t bytes, bool pinned) override;
  absl::Status CopyIn(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyOut(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyStrided(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                           size_t rows) override {
    CopyStridedHost(dst, dst_pitch, src, src_pitch, width, rows);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
};

}  // namespace tandem
