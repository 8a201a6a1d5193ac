// The cost of the device path's payload checksums (common/transport/device/payload_checksum.h) on
// this GPU, per layer turn of a model's decode step: one side receives a message (its doorbell
// wait), consumes it (a device-to-device copy of 32 MiB standing in for a layer's attention or
// linear work) and replies (the write kernel), without checks, and with them (the reply stores its
// checksum entry; the received message is checked on the side stream beside the consumer, joined
// before the reply). "bare turn" leaves the consumer out, so nothing hides the check: the upper
// bound. Each figure is the GPU time of many turns enqueued behind a gate before the GPU runs them
// (CUDA events; fresh random payloads, local buffers). Per decode step: num_layers x (the memory
// rank's turn, receiving q,k,v and replying with the attention output, + compute rank 0's,
// receiving the output and replying with the next q,k,v); with the two ranks in turn on the
// step's critical path (no pipelining) that is what a step pays. Divide by a step time measured
// in the same session (deploy_step_bench) for the share. Last, for nccl, the sender's checksum
// kernel alone (nccl's sends are NCCL's own kernels: the checksum is summed before each), per
// message and per step.
// Usage: device_checksum_bench [--model llama3-8b] [--batches 1,64,256] [--iterations 200]
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/model_spec.h"
#include "common/transport/device/device_path.h"
#include "common/transport/device/payload_checksum.h"

namespace {

using tandem::transport::ChecksumEntry;
using tandem::transport::DevicePath;

#define BENCH_CUDA(expr)                                               \
  do {                                                                 \
    const cudaError_t e_ = (expr);                                     \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

struct Buffers {
  void *src = nullptr, *dst = nullptr;
  uint64_t* bell = nullptr;
  ChecksumEntry* entries = nullptr;
};

// GPU microseconds per call of `enqueue` (seqno 1, 2, ...), averaged over `n` calls after a
// warm-up. The stream first waits on a gate that the host opens once every call is enqueued, so
// what is timed is the GPU running them back to back, not the host launching them (a step's
// device path is enqueued ahead of the GPU the same way).
template <typename F>
double UsPer(DevicePath& path, cudaStream_t stream, volatile uint64_t* gate, const uint64_t* gate_dev, int n,
             uint64_t& seqno, F&& enqueue) {
  for (int i = 0; i < 20; ++i) enqueue(++seqno);
  const uint64_t open = *gate + 1;
  (void)path.EnqueueWait(gate_dev, open, absl::Seconds(30), "gate", stream);
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  BENCH_CUDA(cudaEventRecord(a, stream));
  for (int i = 0; i < n; ++i) enqueue(++seqno);
  BENCH_CUDA(cudaEventRecord(b, stream));
  *gate = open;
  BENCH_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1000.0 / n;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "llama3-8b";
  std::vector<int64_t> batches = {1, 64, 256};
  int iterations = 200;  // launches enqueued behind the gate (the launch queue holds about a thousand)
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") {
      model = v;
    } else if (k == "--batches") {
      batches.clear();
      for (absl::string_view p : absl::StrSplit(v, ',')) {
        int64_t b = 0;
        if (!absl::SimpleAtoi(p, &b) || b <= 0) {
          std::fprintf(stderr, "--batches: '%s' is not a positive integer\n", std::string(p).c_str());
          return 2;
        }
        batches.push_back(b);
      }
    } else if (k == "--iterations" && absl::SimpleAtoi(v, &iterations) && iterations > 0) {
    } else {
      std::fprintf(stderr,
                   "usage: device_checksum_bench [--model NAME] [--batches 1,64,256] [--iterations N]\n");
      return 2;
    }
  }
  absl::StatusOr<tandem::ModelSpec> spec = tandem::PresetSpec(model);
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", std::string(spec.status().message()).c_str());
    return 2;
  }
  const size_t qkv_row = static_cast<size_t>(spec->q_dim() + 2 * spec->kv_dim()) * 2;  // bf16
  const size_t out_row = static_cast<size_t>(spec->q_dim()) * 2;
  int64_t max_batch = 1;
  for (int64_t b : batches) max_batch = std::max(max_batch, b);
  const size_t max_bytes = static_cast<size_t>(max_batch) * qkv_row;
  BENCH_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  Buffers b;
  BENCH_CUDA(cudaMalloc(&b.src, max_bytes));
  BENCH_CUDA(cudaMalloc(&b.dst, max_bytes));
  BENCH_CUDA(cudaMalloc(&b.bell, sizeof(uint64_t)));
  BENCH_CUDA(cudaMalloc(&b.entries, tandem::transport::kChecksumRing * sizeof(ChecksumEntry)));
  BENCH_CUDA(cudaMemset(b.bell, 0, sizeof(uint64_t)));
  std::vector<uint8_t> host(max_bytes);
  std::mt19937_64 rng(absl::ToUnixNanos(absl::Now()));
  for (auto& x : host) x = static_cast<uint8_t>(rng());
  BENCH_CUDA(cudaMemcpy(b.src, host.data(), max_bytes, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaDeviceSynchronize());
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::StatusOr<std::unique_ptr<DevicePath>> path = DevicePath::Create(0);
  if (!path.ok()) {
    std::fprintf(stderr, "%s\n", std::string(path.status().message()).c_str());
    return 1;
  }
  void* gate_host = nullptr;
  BENCH_CUDA(cudaHostAlloc(&gate_host, sizeof(uint64_t), cudaHostAllocMapped));
  auto* gate = static_cast<volatile uint64_t*>(gate_host);
  *gate = 0;
  void* gate_dev = nullptr;
  BENCH_CUDA(cudaHostGetDevicePointer(&gate_dev, gate_host, 0));
  auto time = [&](uint64_t& seq, auto&& enqueue) {
    return UsPer(**path, stream, gate, static_cast<const uint64_t*>(gate_dev), iterations, seq, enqueue);
  };
  const int layers = static_cast<int>(spec->num_layers);
  std::printf("%s, %s: %d layers, q,k,v row %zu B, attention output row %zu B (bf16); us per launch\n",
              prop.name, model.c_str(), layers, qkv_row, out_row);
  // The consumer of a received message: a device-to-device copy of kConsumerBytes (tens of us, as a
  // layer's attention or linear work is), which a check on the side stream runs beside.
  constexpr size_t kConsumerBytes = 32u << 20;
  void *consumer_src = nullptr, *consumer_dst = nullptr, *reply = nullptr;
  BENCH_CUDA(cudaMalloc(&consumer_src, kConsumerBytes));
  BENCH_CUDA(cudaMalloc(&consumer_dst, kConsumerBytes));
  BENCH_CUDA(cudaMemset(consumer_src, 1, kConsumerBytes));
  BENCH_CUDA(cudaMalloc(&reply, max_bytes));
  ChecksumEntry* reply_entries = nullptr;  // the peer's, apart from the received message's
  BENCH_CUDA(cudaMalloc(&reply_entries, tandem::transport::kChecksumRing * sizeof(ChecksumEntry)));
  uint64_t* reply_bell = nullptr;
  BENCH_CUDA(cudaMalloc(&reply_bell, sizeof(uint64_t)));
  BENCH_CUDA(cudaMemset(reply_bell, 0, sizeof(uint64_t)));
  BENCH_CUDA(cudaDeviceSynchronize());
  std::printf("%6s %8s %10s %10s %10s %10s %12s %12s\n", "batch", "side", "receives", "replies", "turn",
              "+checks", "bare turn", "+checks");
  const uint64_t big = ~0ull >> 1;  // the received message's seqno: its doorbell is past every wait
  uint64_t reply_seq = 0;
  for (int64_t batch : batches) {
    double hidden_us = 0, bare_us = 0;
    for (int side = 0; side < 2; ++side) {
      // The memory rank receives q,k,v and replies with the attention output; compute rank 0
      // receives the output and replies with the next layer's q,k,v.
      const size_t in = static_cast<size_t>(batch) * (side == 0 ? qkv_row : out_row);
      const size_t out = static_cast<size_t>(batch) * (side == 0 ? out_row : qkv_row);
      (void)(*path)->EnqueueWriteWithDoorbell(b.dst, b.src, in, b.bell, big, stream,
                                              b.entries + big % tandem::transport::kChecksumRing);
      const ChecksumEntry* e = b.entries + big % tandem::transport::kChecksumRing;
      auto turn = [&](bool checks, bool consumer) {
        uint64_t wseq = 0;
        return time(wseq, [&](uint64_t) {
          (void)(*path)->EnqueueWait(b.bell, big, absl::Seconds(10), "bench", stream);
          if (checks) (void)(*path)->EnqueueVerify(b.dst, in, e, big, "bench", stream);
          if (consumer) {
            BENCH_CUDA(cudaMemcpyAsync(consumer_dst, consumer_src, kConsumerBytes, cudaMemcpyDeviceToDevice,
                                       stream));
          }
          ++reply_seq;
          (void)(*path)->EnqueueWriteWithDoorbell(
              reply, b.src, out, reply_bell, reply_seq, stream,
              checks ? reply_entries + reply_seq % tandem::transport::kChecksumRing : nullptr);
        });
      };
      const double plain = turn(false, true), checked = turn(true, true);
      const double bare = turn(false, false), bare_checked = turn(true, false);
      const absl::Status st = (*path)->Sync(stream, absl::Now() + absl::Seconds(60), nullptr);
      if (!st.ok()) {
        std::fprintf(stderr, "batch %lld: %s\n", static_cast<long long>(batch),
                     std::string(st.message()).c_str());
        return 1;
      }
      std::printf("%6lld %8s %10zu %10zu %10.2f %10.2f %12.2f %12.2f\n", static_cast<long long>(batch),
                  side == 0 ? "memory" : "compute", in, out, plain, checked, bare, bare_checked);
      hidden_us += checked - plain;
      bare_us += bare_checked - bare;
    }
    std::printf(
        "%6lld added per decode step (%d layers, both sides): %.1f us behind a consumer, %.1f us with "
        "none\n",
        static_cast<long long>(batch), layers, hidden_us * layers, bare_us * layers);
  }
  // nccl: NCCL reads the source itself, so the sender's checksum is a kernel of its own on the send
  // stream, before the send (DevicePath::EnqueueChecksum); the send waits for it. Its GPU time per
  // message, and per decode step (the q,k,v sent to the memory rank and the output sent back).
  std::printf("nccl sender's checksum kernel, us per message: %6s %10s %10s %14s\n", "batch", "q,k,v",
              "output", "per step");
  for (int64_t batch : batches) {
    double us[2];
    for (int side = 0; side < 2; ++side) {
      const size_t bytes = static_cast<size_t>(batch) * (side == 0 ? qkv_row : out_row);
      uint64_t seq = 0;
      us[side] = time(seq, [&](uint64_t k) {
        (void)(*path)->EnqueueChecksum(b.src, bytes, k, reply_entries + k % tandem::transport::kChecksumRing,
                                       stream);
      });
    }
    std::printf("%47lld %10.2f %10.2f %14.1f\n", static_cast<long long>(batch), us[0], us[1],
                (us[0] + us[1]) * layers);
  }
  cudaFree(consumer_src);
  cudaFree(consumer_dst);
  cudaFree(reply);
  cudaFree(reply_bell);
  cudaFree(reply_entries);
  cudaStreamDestroy(stream);
  cudaFree(b.src);
  cudaFree(b.dst);
  cudaFree(b.bell);
  cudaFree(b.entries);
  cudaFreeHost(gate_host);
  return 0;
}
