#include "common/transport/device/device_path.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "common/transport/device/device_path_kernels.h"

namespace tandem::transport {
namespace {

constexpr int kCounters = 256;  // write kernels that may be in flight at once

#define DP_CUDA(expr)                                                                                    \
  do {                                                                                                   \
    const cudaError_t dp_err_ = (expr);                                                                  \
    if (dp_err_ != cudaSuccess) {                                                                        \
      return absl::InternalError(                                                                        \
          absl::StrCat(#expr, ": ", cudaGetErrorName(dp_err_), " (", cudaGetErrorString(dp_err_), ")")); \
    }                                                                                                    \
  } while (0)

}  // namespace

absl::StatusOr<std::unique_ptr<DevicePath>> DevicePath::Create(int device) {
  std::unique_ptr<DevicePath> p(new DevicePath());
  p->device_ = device;
  DP_CUDA(cudaSetDevice(device));
  void* host = nullptr;
  DP_CUDA(cudaHostAlloc(&host, sizeof(DeviceWaitRecord), cudaHostAllocMapped));
  p->record_ = static_cast<DeviceWaitRecord*>(host);
  *p->record_ = DeviceWaitRecord{};
  void* dev = nullptr;
  DP_CUDA(cudaHostGetDevicePointer(&dev, host, 0));
  p->record_dev_ = static_cast<DeviceWaitRecord*>(dev);
  DP_CUDA(cudaMalloc(&p->counters_, kCounters * sizeof(uint32_t)));
  DP_CUDA(cudaMemset(p->counters_, 0, kCounters * sizeof(uint32_t)));
  DP_CUDA(cudaMalloc(&p->failed_flag_, sizeof(uint32_t)));
  DP_CUDA(cudaMemset(p->failed_flag_, 0, sizeof(uint32_t)));
  DP_CUDA(cudaMalloc(&p->sums_, kCounters * sizeof(unsigned long long)));
  DP_CUDA(cudaMemset(p->sums_, 0, kCounters * sizeof(unsigned long long)));
  DP_CUDA(cudaDeviceSynchronize());
  return p;
}

DevicePath::~DevicePath() {
  cudaSetDevice(device_);
  if (record_ != nullptr) {
    record_->abort = 1;  // nothing may spin on memory about to be freed
    cudaDeviceSynchronize();
    cudaFreeHost(record_);
  }
  for (auto& [caller, side] : sides_) {
    cudaEventDestroy(static_cast<cudaEvent_t>(side.fork));
    cudaEventDestroy(static_cast<cudaEvent_t>(side.done));
    cudaStreamDestroy(static_cast<cudaStream_t>(side.stream));
  }
  if (counters_ != nullptr) cudaFree(counters_);
  if (sums_ != nullptr) cudaFree(sums_);
  if (failed_flag_ != nullptr) cudaFree(failed_flag_);
}

absl::Status DevicePath::EnqueueWait(const uint64_t* doorbell, uint64_t seqno, absl::Duration timeout,
                                     std::string label, void* stream) {
  if (!failure_.ok())
    return absl::FailedPreconditionError(absl::StrCat("device path failed: ", failure_.message()));
  if (!pending_.ok()) return absl::OkStatus();  // failed (Fail): the next Sync says why
  const uint64_t timeout_ns = static_cast<uint64_t>(std::max<int64_t>(0, absl::ToInt64Nanoseconds(timeout)));
  const uint32_t index = static_cast<uint32_t>(waits_.size());
  waits_.push_back({std::move(label), seqno, timeout});
  DP_CUDA(LaunchWaitDoorbell(doorbell, seqno, timeout_ns, record_dev_, failed_flag_, index, stream));
  return absl::OkStatus();
}

absl::Status DevicePath::EnqueueWriteWithDoorbell(void* dst, const void* src, size_t bytes,
                                                  uint64_t* doorbell, uint64_t seqno, void* stream,
                                                  ChecksumEntry* checksum) {
  if (!failure_.ok())
    return absl::FailedPreconditionError(absl::StrCat("device path failed: ", failure_.message()));
  if (!pending_.ok()) return absl::OkStatus();  // nothing leaves a failed step (see the kernel)
  RETURN_IF_ERROR(Join(stream));
  const uint32_t slot = next_counter_++ % kCounters;
  DP_CUDA(LaunchWriteWithDoorbell(dst, src, bytes, doorbell, seqno, counters_ + slot, sums_ + slot, checksum,
                                  failed_flag_, stream));
  return absl::OkStatus();
}

absl::Status DevicePath::EnqueueChecksum(const void* src, size_t bytes, uint64_t seqno, ChecksumEntry* entry,
                                         void* stream) {
  const uint32_t slot = next_counter_++ % kCounters;
  DP_CUDA(LaunchWriteWithDoorbell(nullptr, src, bytes, nullptr, seqno, counters_ + slot, sums_ + slot, entry,
                                  nullptr, stream));
  return absl::OkStatus();
}

absl::Status DevicePath::Join(void* stream) {
  auto it = sides_.find(stream);
  if (it == sides_.end() || !it->second.pending) return absl::OkStatus();
  DP_CUDA(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(it->second.done), 0));
  it->second.pending = false;
  return absl::OkStatus();
}

absl::Status DevicePath::EnqueueVerify(const void* data, size_t bytes, const ChecksumEntry* entry,
                                       uint64_t seqno, std::string label, void* stream, bool beside) {
  if (!failure_.ok())
    return absl::FailedPreconditionError(absl::StrCat("device path failed: ", failure_.message()));
  if (!pending_.ok()) return absl::OkStatus();
  const uint32_t index = static_cast<uint32_t>(waits_.size());
  waits_.push_back({std::move(label), seqno, absl::ZeroDuration(), bytes});
  Side* side = nullptr;
  if (beside) {
    auto [it, made] = sides_.try_emplace(stream);
    side = &it->second;
    if (made) {
      cudaStream_t s = nullptr;
      cudaEvent_t fork = nullptr, done = nullptr;
      DP_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      side->stream = s;
      DP_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      side->fork = fork;
      DP_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      side->done = done;
    }
    // A wait on an event takes the event's latest record at the time of the call, so one fork and
    // one done event per side serve every check.
    DP_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(side->fork), static_cast<cudaStream_t>(stream)));
    DP_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(side->stream), static_cast<cudaEvent_t>(side->fork),
                                0));
  }
  const uint32_t slot = next_counter_++ % kCounters;
  DP_CUDA(LaunchVerifyChecksum(data, bytes, entry, seqno, counters_ + slot, sums_ + slot, record_dev_,
                               failed_flag_, index, beside ? side->stream : stream));
  if (beside) {
    DP_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(side->done), static_cast<cudaStream_t>(side->stream)));
    side->pending = true;
  }
  return absl::OkStatus();
}

absl::Status DevicePath::Reset(void* stream) {
  DP_CUDA(cudaSetDevice(device_));
  std::vector<void*> streams = {stream};
  for (const auto& [caller, side] : sides_) streams.push_back(side.stream);
  const absl::Time until = absl::Now() + absl::Seconds(1);
  for (void* s : streams) {
    cudaError_t q;
    while ((q = cudaStreamQuery(static_cast<cudaStream_t>(s))) == cudaErrorNotReady && absl::Now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (q == cudaErrorNotReady) {
      return absl::FailedPreconditionError(
          "the failed step's device work has not drained: the device path cannot be reset");
    }
    DP_CUDA(q);
  }
  auto* cuda_stream = static_cast<cudaStream_t>(stream);
  DP_CUDA(cudaMemsetAsync(failed_flag_, 0, sizeof(uint32_t), cuda_stream));
  DP_CUDA(cudaMemsetAsync(counters_, 0, kCounters * sizeof(uint32_t), cuda_stream));
  DP_CUDA(cudaMemsetAsync(sums_, 0, kCounters * sizeof(unsigned long long), cuda_stream));
  DP_CUDA(cudaStreamSynchronize(cuda_stream));
  volatile DeviceWaitRecord* r = record_;
  r->failed = 0;
  r->wait = 0;
  r->seen = 0;
  r->expected = 0;
  r->abort = 0;
  for (auto& [caller, side] : sides_) side.pending = false;
  waits_.clear();
  failure_ = absl::OkStatus();
  pending_ = absl::OkStatus();
  return absl::OkStatus();
}

void DevicePath::Abort() { reinterpret_cast<volatile DeviceWaitRecord*>(record_)->abort = 1; }

void DevicePath::Fail(absl::Status status) {
  if (pending_.ok()) pending_ = std::move(status);
  Abort();
}

absl::Status DevicePath::Sync(void* stream, absl::Time deadline, const std::function<absl::Status()>& pump) {
  if (!failure_.ok())
    return absl::FailedPreconditionError(absl::StrCat("device path failed: ", failure_.message()));
  DP_CUDA(cudaSetDevice(device_));
  RETURN_IF_ERROR(Join(stream));  // the step's checks are part of it
  cudaEvent_t done = nullptr;
  DP_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const cudaError_t rec = cudaEventRecord(done, static_cast<cudaStream_t>(stream));
  absl::Status st;
  // Drains the stream after an abort (the waits fall through at once), so that nothing still runs
  // on buffers the caller may free after this error.
  auto drain = [&] {
    Abort();
    const absl::Time until = absl::Now() + absl::Seconds(2);
    while (cudaEventQuery(done) == cudaErrorNotReady && absl::Now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };
  if (rec != cudaSuccess) {
    st = absl::InternalError(absl::StrCat("cudaEventRecord: ", cudaGetErrorString(rec)));
  } else {
    auto last_pump = std::chrono::steady_clock::now();
    for (uint32_t polls = 0;; ++polls) {
      const cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        st = absl::InternalError(
            absl::StrCat("the stream failed: ", cudaGetErrorName(q), " (", cudaGetErrorString(q), ")"));
        break;
      }
      const auto now = std::chrono::steady_clock::now();
      if (pump && now - last_pump > std::chrono::milliseconds(1)) {
        last_pump = now;
        st = pump();
        if (!st.ok()) {
          drain();
          break;
        }
      }
      if (absl::Now() >= deadline) {
        st = absl::DeadlineExceededError("the step's device work did not finish before its deadline");
        drain();
        break;
      }
      if (polls > 256) std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
  }
  cudaEventDestroy(done);
  const volatile DeviceWaitRecord* r = record_;
  if (st.ok() && !pending_.ok()) {
    st = pending_;
  } else if (st.ok() && r->failed != 0) {
    const uint32_t i = r->wait;
    if (i < waits_.size() && r->failed >= 3) {
      const Wait& w = waits_[i];
      st = absl::DataLossError(
          r->failed == 3
              ? absl::StrFormat("%s: the payload's checksum does not match (seqno %d, %d bytes: the writer's "
                                "%016x, %016x here): it changed between the writer and this check",
                                w.label, w.seqno, w.bytes, static_cast<uint64_t>(r->expected),
                                static_cast<uint64_t>(r->seen))
              : absl::StrFormat("%s: no checksum of seqno %d (%d bytes) came with it: its entry holds "
                                "seqno %d's",
                                w.label, w.seqno, w.bytes, static_cast<uint64_t>(r->expected)));
    } else if (i < waits_.size()) {
      const Wait& w = waits_[i];
      st = absl::DeadlineExceededError(absl::StrCat(
          w.label, ": ", r->failed == 1 ? "waited " : "aborted after less than ",
          absl::FormatDuration(w.timeout), " for doorbell seqno ", w.seqno, ", it is at ", r->seen));
      if (r->failed == 2) st = absl::AbortedError(st.message());
    } else {
      st = absl::InternalError("a device wait failed outside the waits enqueued since the last sync");
    }
  }
  waits_.clear();
  if (!st.ok()) {
    Abort();
    failure_ = st;
  }
  return st;
}

}  // namespace tandem::transport
