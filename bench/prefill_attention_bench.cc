// Prefill-chunk attention throughput (kernels::cuda::PrefillAttention) against the bf16 GEMM rate
// measured in the same run (cublasGemmEx 8192³, bf16 in and out, fp32 compute).
//
// Both kernels (ops.h PrefillKernel): mma.sync, and wgmma where the device runs it (sm_90).
// Shapes: fresh prefill (kv_len == chunk), chunk ∈ {512, 1K, 2K, 4K, 16K}, batch = 16K / chunk
// requests, heads 32/8 (GQA) and 32/32 (MHA), head_dim 128, token-granular KV with a shuffled
// slot table. FLOPs (causal) = 4·d·heads·Σ_rows(visible keys); a fresh chunk of c rows sees
// c(c+1)/2 keys in all. Each figure is the median of --reps runs (default 20) timed with CUDA
// events after 3 warm-up runs; inputs are random (never zeros) and larger than L2. Before timing,
// a few (row, head) outputs of every shape are checked against a double-precision computation.
//
// Usage: prefill_attention_bench [--json PATH] [--reps N]
// Prints rows "kind kernel chunk batch time_ms TFLOP/s %gemm"; --json writes the same rows.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "kernels/cuda/ops.h"

namespace {

using tandem::kernels::cuda::AttentionParams;
using tandem::kernels::cuda::PrefillAttention;
using tandem::kernels::cuda::PrefillKernel;

#define CHECK_CUDA(expr)                                                                                   \
  do {                                                                                                     \
    const cudaError_t e_ = (expr);                                                                         \
    if (e_ != cudaSuccess) {                                                                               \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)

#define CHECK_CUBLAS(expr)                                                        \
  do {                                                                            \
    const cublasStatus_t s_ = (expr);                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                            \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, \
                   cublasGetStatusString(s_));                                    \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// Random bf16 bits of uniform values in [lo, hi) (xorshift64*; fast enough for 10⁸ values).
std::vector<uint16_t> RandomBf16Bits(size_t n, float lo, float hi, uint64_t seed) {
  std::vector<uint16_t> out(n);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const uint64_t r = x * 0x2545F4914F6CDD1Dull;
    const float u = static_cast<float>(r >> 40) * 0x1.0p-24f;
    out[i] = tandem::FloatToBf16(lo + (hi - lo) * u);
  }
  return out;
}

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Median milliseconds of `reps` runs of `fn` (after 3 warm-up runs), each timed with events.
template <typename Fn>
double TimeMs(int reps, cudaStream_t stream, Fn fn) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();
  CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    fn();
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return Median(ms);
}

struct Row {
  std::string kind, kernel;
  int64_t chunk = 0, batch = 0;
  double time_ms = 0.0, tflops = 0.0, pct_gemm = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::max(10, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--json PATH] [--reps N (>= 10)]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "prefill_attention_bench: no usable CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  std::printf("device: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);

  // ---- cuBLAS bf16 GEMM ceiling ----
  double gemm_tflops = 0.0, gemm_ms = 0.0;
  {
    const int n = 8192;
    const size_t elems = static_cast<size_t>(n) * n;
    uint16_t* a = DeviceCopy(RandomBf16Bits(elems, -1.0f, 1.0f, 11));
    uint16_t* b = DeviceCopy(RandomBf16Bits(elems, -1.0f, 1.0f, 12));
    uint16_t* c = nullptr;
    CHECK_CUDA(cudaMalloc(&c, elems * 2));
    cublasHandle_t handle;
    CHECK_CUBLAS(cublasCreate(&handle));
    CHECK_CUBLAS(cublasSetStream(handle, stream));
    const float alpha = 1.0f, beta = 0.0f;
    gemm_ms = TimeMs(reps, stream, [&] {
      CHECK_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b,
                                CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
    });
    gemm_tflops = 2.0 * n * static_cast<double>(n) * n / (gemm_ms * 1e-3) / 1e12;
    CHECK_CUBLAS(cublasDestroy(handle));
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
    CHECK_CUDA(cudaFree(c));
  }

  // ---- attention inputs, sized for the largest shape ----
  const int64_t kTokens = 16384, kHeads = 32, kMaxKvHeads = 32, kDim = 128;
  const std::vector<uint16_t> q_h =
      RandomBf16Bits(static_cast<size_t>(kTokens * kHeads * kDim), -2.0f, 2.0f, 21);
  const std::vector<uint16_t> k_h =
      RandomBf16Bits(static_cast<size_t>(kTokens * kMaxKvHeads * kDim), -2.0f, 2.0f, 22);
  const std::vector<uint16_t> v_h =
      RandomBf16Bits(static_cast<size_t>(kTokens * kMaxKvHeads * kDim), -1.0f, 1.0f, 23);
  std::vector<int32_t> slots_h(static_cast<size_t>(kTokens));
  std::iota(slots_h.begin(), slots_h.end(), 0);
  std::shuffle(slots_h.begin(), slots_h.end(), std::mt19937(5));
  uint16_t* q = DeviceCopy(q_h);
  uint16_t* k = DeviceCopy(k_h);
  uint16_t* v = DeviceCopy(v_h);
  int32_t* slots = DeviceCopy(slots_h);
  uint16_t* out = nullptr;
  float* lse = nullptr;
  int32_t* indptr = nullptr;
  CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(kTokens * kHeads * kDim) * 2));
  CHECK_CUDA(cudaMalloc(&lse, static_cast<size_t>(kTokens * kHeads) * 4));
  CHECK_CUDA(cudaMalloc(&indptr, (kTokens + 1) * sizeof(int32_t)));

  std::vector<Row> rows;
  rows.push_back(Row{"gemm8192", "cublas", 8192, 1, gemm_ms, gemm_tflops, 100.0});
  bool all_checks_ok = true;
  std::printf("%-10s %-8s %6s %6s %10s %9s %7s\n", "kind", "kernel", "chunk", "batch", "time_ms", "TFLOP/s",
              "%gemm");
  std::printf("%-10s %-8s %6d %6d %10.3f %9.1f %7.1f\n", "gemm8192", "cublas", 8192, 1, gemm_ms, gemm_tflops,
              100.0);
  for (int64_t kv_heads : {int64_t{8}, int64_t{32}}) {
    for (int64_t chunk : {512, 1024, 2048, 4096, 16384}) {
      const int64_t batch = kTokens / chunk;
      std::vector<int32_t> indptr_h(static_cast<size_t>(batch + 1));
      for (int64_t r = 0; r <= batch; ++r) indptr_h[static_cast<size_t>(r)] = static_cast<int32_t>(r * chunk);
      CHECK_CUDA(
          cudaMemcpy(indptr, indptr_h.data(), indptr_h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      AttentionParams p;
      p.q = reinterpret_cast<const __nv_bfloat16*>(q);
      p.k_cache = reinterpret_cast<const __nv_bfloat16*>(k);
      p.v_cache = reinterpret_cast<const __nv_bfloat16*>(v);
      p.out = reinterpret_cast<__nv_bfloat16*>(out);
      p.lse = lse;
      p.q_indptr = indptr;  // fresh prefill: q and kv share the indptr
      p.kv_indptr = indptr;
      p.kv_slots = slots;
      p.num_requests = batch;
      p.num_slots = kTokens;
      p.num_heads = kHeads;
      p.num_kv_heads = kv_heads;
      p.head_dim = kDim;
      p.scale = 1.0f / std::sqrt(static_cast<float>(kDim));
      p.max_q_len = chunk;
      p.max_kv_len = chunk;
      for (const PrefillKernel kernel : {PrefillKernel::kMmaSync, PrefillKernel::kWgmma}) {
        const char* kernel_name = kernel == PrefillKernel::kWgmma ? "wgmma" : "mma.sync";
        const absl::Status st = PrefillAttention(p, stream, kernel);
        if (absl::IsFailedPrecondition(st)) {
          std::printf("(%s kernel: %s)\n", kernel_name, std::string(st.message()).c_str());
          continue;
        }
        if (!st.ok()) {
          std::fprintf(stderr, "PrefillAttention: %s\n", std::string(st.ToString()).c_str());
          return 1;
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));

        // Spot check: a few (row, head) outputs against double precision.
        std::vector<uint16_t> out_h(static_cast<size_t>(kTokens * kHeads * kDim));
        CHECK_CUDA(cudaMemcpy(out_h.data(), out, out_h.size() * 2, cudaMemcpyDeviceToHost));
        double max_err = 0.0, max_ref = 0.0;
        std::mt19937 rng(static_cast<uint32_t>(chunk + kv_heads));
        for (int s = 0; s < 12; ++s) {
          const int64_t t = std::uniform_int_distribution<int64_t>(0, kTokens - 1)(rng);
          const int64_t h = std::uniform_int_distribution<int64_t>(0, kHeads - 1)(rng);
          const int64_t r = t / chunk, i = t % chunk, kvh = h / (kHeads / kv_heads);
          std::vector<double> scores(static_cast<size_t>(i + 1));
          double m = -1e300;
          for (int64_t j = 0; j <= i; ++j) {
            const int64_t slot = slots_h[static_cast<size_t>(r * chunk + j)];
            double dot = 0.0;
            for (int64_t d = 0; d < kDim; ++d) {
              dot += static_cast<double>(
                         tandem::Bf16ToFloat(q_h[static_cast<size_t>((t * kHeads + h) * kDim + d)])) *
                     tandem::Bf16ToFloat(k_h[static_cast<size_t>((slot * kv_heads + kvh) * kDim + d)]);
            }
            scores[static_cast<size_t>(j)] = dot * p.scale;
            m = std::max(m, scores[static_cast<size_t>(j)]);
          }
          double sum = 0.0;
          for (double& sc : scores) sum += (sc = std::exp(sc - m));
          for (int64_t d = 0; d < kDim; ++d) {
            double acc = 0.0;
            for (int64_t j = 0; j <= i; ++j) {
              const int64_t slot = slots_h[static_cast<size_t>(r * chunk + j)];
              acc += scores[static_cast<size_t>(j)] *
                     tandem::Bf16ToFloat(v_h[static_cast<size_t>((slot * kv_heads + kvh) * kDim + d)]);
            }
            acc /= sum;
            const double got = tandem::Bf16ToFloat(out_h[static_cast<size_t>((t * kHeads + h) * kDim + d)]);
            max_ref = std::max(max_ref, std::fabs(acc));
            max_err = std::isnan(got) ? 1e30 : std::max(max_err, std::fabs(got - acc));
          }
        }
        const double rel = max_err / std::max(max_ref, 1e-30);
        if (!(rel <= 1e-2)) {
          all_checks_ok = false;
          std::fprintf(stderr,
                       "CHECK FAILED: %s kernel, heads %lld/%lld chunk %lld: max|err|/max|ref| = %g\n",
                       kernel_name, static_cast<long long>(kHeads), static_cast<long long>(kv_heads),
                       static_cast<long long>(chunk), rel);
        }

        const double ms = TimeMs(reps, stream, [&] { (void)PrefillAttention(p, stream, kernel); });
        const double flops = 4.0 * kDim * kHeads * batch * (static_cast<double>(chunk) * (chunk + 1) / 2.0);
        Row row;
        row.kind = kv_heads == kHeads ? "mha32/32" : "gqa32/8";
        row.kernel = kernel_name;
        row.chunk = chunk;
        row.batch = batch;
        row.time_ms = ms;
        row.tflops = flops / (ms * 1e-3) / 1e12;
        row.pct_gemm = 100.0 * row.tflops / gemm_tflops;
        rows.push_back(row);
        std::printf("%-10s %-8s %6lld %6lld %10.3f %9.1f %7.1f\n", row.kind.c_str(), kernel_name,
                    static_cast<long long>(chunk), static_cast<long long>(batch), ms, row.tflops,
                    row.pct_gemm);
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "(d128, fresh prefill, %lld tokens per batch, shuffled slot table, median of %d runs; spot checks "
      "%s)\n",
      static_cast<long long>(kTokens), reps, all_checks_ok ? "passed" : "FAILED");

  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "{\n  \"bench\": \"prefill_attention\",\n  \"device\": \"%s\",\n  \"head_dim\": %lld,\n",
                 prop.name, static_cast<long long>(kDim));
    std::fprintf(f, "  \"tokens_per_batch\": %lld,\n  \"reps\": %d,\n  \"checks_ok\": %s,\n  \"rows\": [\n",
                 static_cast<long long>(kTokens), reps, all_checks_ok ? "true" : "false");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   "    {\"kind\": \"%s\", \"kernel\": \"%s\", \"chunk\": %lld, \"batch\": %lld, "
                   "\"time_ms\": %.4f, \"tflops\": %.2f, "
                   "\"pct_gemm\": %.2f}%s\n",
                   r.kind.c_str(), r.kernel.c_str(), static_cast<long long>(r.chunk),
                   static_cast<long long>(r.batch), r.time_ms, r.tflops, r.pct_gemm,
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  CHECK_CUDA(cudaFree(q));
  CHECK_CUDA(cudaFree(k));
  CHECK_CUDA(cudaFree(v));
  CHECK_CUDA(cudaFree(slots));
  CHECK_CUDA(cudaFree(out));
  CHECK_CUDA(cudaFree(lse));
  CHECK_CUDA(cudaFree(indptr));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return all_checks_ok ? 0 : 1;
}
