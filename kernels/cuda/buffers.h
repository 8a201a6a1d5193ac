// Host-side helpers for code that drives the CUDA ops: a growable device allocation, and a
// packer that gathers a step's metadata arrays into one pinned buffer so they reach the device
// in a single copy. Include only from CUDA-enabled translation units.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cuda/cuda_check.h"

namespace tandem::kernels::cuda {

// A device allocation freed on destruction.
struct DeviceBuffer {
  void* ptr = nullptr;
  int64_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  // Grows to at least `n` bytes (contents are not kept).
  absl::Status Reserve(int64_t n) {
    if (n <= bytes) return absl::OkStatus();
    if (ptr) CUDA_RETURN_IF_ERROR(cudaFree(ptr));
    ptr = nullptr;
    bytes = 0;
    CUDA_RETURN_IF_ERROR(cudaMalloc(&ptr, static_cast<size_t>(n)));
    bytes = n;
    return absl::OkStatus();
  }
  template <typename T>
  T* as(int64_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(ptr) + byte_offset);
  }
};

// Packs arrays at 16-byte aligned offsets of one byte string.
class MetaPacker {
 public:
  void Reset() { bytes_.clear(); }
  template <typename T>
  int64_t Add(const T* data, size_t n) {
    const int64_t at = (static_cast<int64_t>(bytes_.size()) + 15) / 16 * 16;
    bytes_.resize(static_cast<size_t>(at) + n * sizeof(T));
    if (n) std::memcpy(bytes_.data() + at, data, n * sizeof(T));
    return at;
  }
  template <typename T>
  int64_t Add(const std::vector<T>& v) {
    return Add(v.data(), v.size());
  }
  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  std::vector<unsigned char> bytes_;
};

}  // namespace tandem::kernels::cuda

#include "common/backend_buffer.h"

namespace tandem::kernels::cuda {

// Device memory of the current device, and pinned host memory, ordered on one stream.
class CudaMemorySpace : public MemorySpace {
 public:
  explicit CudaMemorySpace(cudaStream_t stream = nullptr) : stream_(stream) {}
  void set_stream(cudaStream_t stream) { stream_ = stream; }
  bool host() const override { return false; }
  absl::StatusOr<BackendBuffer> Allocate(size_t bytes, bool pinned) override {
    void* p = nullptr;
    if (pinned) {
      CUDA_RETURN_IF_ERROR(cudaMallocHost(&p, bytes < 16 ? 16 : bytes));
      return BackendBuffer(p, [](void* q) { cudaFreeHost(q); });
    }
    CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes < 16 ? 16 : bytes));
    return BackendBuffer(p, [](void* q) { cudaFree(q); });
  }
  absl::Status CopyIn(void* dst, const void* src, size_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
    return absl::OkStatus();
  }
  absl::Status CopyOut(void* dst, const void* src, size_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
    return absl::OkStatus();
  }
  // cudaMemcpyDefault: either side may be device memory or pinned host memory (unified addressing).
  absl::Status CopyStrided(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width,
                           size_t rows) override {
    if (width == 0 || rows == 0) return absl::OkStatus();
    CUDA_RETURN_IF_ERROR(
        cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, stream_));
    return absl::OkStatus();
  }
  absl::Status Synchronize() override {
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace tandem::kernels::cuda
