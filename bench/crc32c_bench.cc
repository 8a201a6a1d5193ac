// The cost of the control messages' checksum (common/wire.h: every frame carries a CRC-32C of its
// body, computed by the encoder and checked by the decoder): ns per KiB of Crc32c (SSE4.2 where
// the CPU has it) and of the portable table version, over bodies of control-message sizes, and a
// whole encode + decode of a step plan of 64 requests. Prints one line per size.
// Usage: crc32c_bench [--iterations N]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "common/wire.h"

namespace {

template <typename F>
double NsPerCall(int iterations, F&& f) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) f();
  const auto ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  return ns / iterations;
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = 20000;
  if (argc == 3 && std::strcmp(argv[1], "--iterations") == 0) iterations = std::atoi(argv[2]);
  volatile uint32_t sink = 0;
  std::printf("%10s %16s %20s\n", "bytes", "crc32c ns/KiB", "portable ns/KiB");
  for (size_t bytes : {64, 1024, 4096, 65536, 1 << 20}) {
    std::vector<uint8_t> body(bytes);
    for (size_t i = 0; i < bytes; ++i) body[i] = static_cast<uint8_t>(i * 131 + 7);
    const int n = static_cast<int>(std::max<size_t>(10, iterations * 1024 / std::max<size_t>(bytes, 1024)));
    const double fast = NsPerCall(n, [&] { sink = sink + tandem::Crc32c(body); });
    const double portable = NsPerCall(n, [&] { sink = sink + tandem::Crc32cPortableForTest(body); });
    std::printf("%10zu %16.1f %20.1f\n", bytes, fast * 1024 / bytes, portable * 1024 / bytes);
  }
  tandem::StepPlan plan{.step_id = 1};
  for (uint64_t r = 0; r < 64; ++r)
    plan.requests.push_back(
        {.request_id = r + 1, .position = 100, .q_len = 1, .kv_len = 101, .sample = true});
  const std::vector<uint8_t> frame = tandem::EncodeStepPlan(plan);
  const double round = NsPerCall(iterations, [&] {
    sink =
        sink + static_cast<uint32_t>(tandem::DecodeStepPlan(tandem::EncodeStepPlan(plan))->requests.size());
  });
  const double crc = NsPerCall(
      iterations, [&] { sink = sink + tandem::Crc32c(absl::Span<const uint8_t>(frame).subspan(16)); });
  std::printf("step plan of 64 requests (%zu bytes): encode + decode %.0f ns, of which 2 crcs %.0f ns\n",
              frame.size(), round, 2 * crc);
  return 0;
}
