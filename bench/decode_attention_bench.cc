// Decode attention bandwidth: KV bytes read per second by cuda::DecodeAttention over a shuffled
// (gathered) token-granular KV pool, as a fraction of the device read bandwidth measured here:
// the best of several read kernels over a 4 GB buffer (bench/ceilings.h; the plain grid-stride
// sum used before read 3–5% low, so that torch SDPA seemed to beat the ceiling). Not a test: prints a table
// (and JSON with --json).
//
//   decode_attention_bench [--quick] [--iters N] [--kinds mha,gqa] [--batches 1,8] [--contexts 1024]
//                          [--splits 1,2,4] [--json PATH]
// --splits adds, after each configuration's planned split count, a row per forced count (the
// planner's choices are checked against these).
//
// Per configuration: fresh random bf16 K/V/q (never zeros), a random slot table; several slot
// tables over disjoint slots when the KV is small, so that consecutive launches never find their
// KV in L2; L2 flushed before timing. Timed launches are queued back to back, each between its
// own pair of events; the median is reported. Time covers
// the whole DecodeAttention call (split kernel and, with splits, the merge).
// Rows: kind batch ctx splits time_us GB/s %peak.
//
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

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench_cuda.h"
#include "ceilings.h"
#include "kernels/cuda/ops.h"

namespace {

namespace kc = ::tandem::kernels::cuda;
using ::tandem::bench::Helpers;
using ::tandem::bench::LoadHelpers;

int g_sms = 0;

void FillBf16(const Helpers& h, void* p, uint64_t n, uint64_t seed, cudaStream_t s) {
  tandem::bench::FillBf16(h, p, n, seed, g_sms, s);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Row {
  std::string kind;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, batch = 0, ctx = 0;
  int splits = 0;
  double time_us = 0, gbps = 0, pct = 0;
  bool finite = true;
};

struct Kind {
  const char* name;
  int64_t heads, kv_heads, head_dim;
};

struct Options {
  bool quick = false;
  int iters = 30;
  std::string json;
  std::vector<std::string> kinds;
  std::vector<int64_t> batches, contexts, splits;
};

std::vector<int64_t> ParseInts(const char* flag, const std::string& list) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(list, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 1) {
      std::fprintf(stderr, "%s: '%s' is not a positive integer\n", flag, std::string(p).c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.quick = true;
    } else if (a == "--iters" && i + 1 < argc) {
      o.iters = std::max(5, std::atoi(argv[++i]));
    } else if (a == "--json" && i + 1 < argc) {
      o.json = argv[++i];
    } else if (a == "--kinds" && i + 1 < argc) {
      o.kinds = absl::StrSplit(argv[++i], ',', absl::SkipEmpty());
    } else if (a == "--batches" && i + 1 < argc) {
      o.batches = ParseInts("--batches", argv[++i]);
    } else if (a == "--contexts" && i + 1 < argc) {
      o.contexts = ParseInts("--contexts", argv[++i]);
    } else if (a == "--splits" && i + 1 < argc) {
      o.splits = ParseInts("--splits", argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--iters N] [--kinds mha,gqa] [--batches 1,8] [--contexts 1024] "
                   "[--splits 1,2,4] [--json PATH]\n",
                   argv[0]);
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  return o;
}

constexpr int kWarmup = 3;

// Bytes of K (and of V) that a configuration's slot tables span: enough tables over disjoint slots
// that the KV of the timed launches spans 3× L2.
int64_t SlotsFor(const Kind& kind, int64_t batch, int64_t ctx, int iters, size_t l2_bytes) {
  const int64_t tokens = batch * ctx;
  const double kv_bytes = 2.0 * static_cast<double>(tokens) * kind.kv_heads * kind.head_dim * 2;
  const int64_t rot =
      std::clamp<int64_t>(static_cast<int64_t>(3.0 * l2_bytes / kv_bytes) + 1, 1, kWarmup + iters);
  return rot * tokens;
}

// The K and V caches, allocated once for the largest configuration and shared by all, as a
// memory rank allocates its pool once: fresh allocations per configuration measured up to 17%
// slower on some of them (GQA 256 × 1K: 432.8 µs on a fresh allocation, 371.0 µs on the next one
// of the same size, the same split count), which timed the allocation rather than the kernel.
struct KvPool {
  void* k = nullptr;
  void* v = nullptr;
  size_t bytes = 0;
};

// Runs one configuration; returns false (and prints why) if it cannot run.
bool RunConfig(const KvPool& pool, const Helpers& h, const Kind& kind, int64_t batch, int64_t ctx, int iters,
               size_t l2_bytes, size_t flush_bytes, void* flush_buf, uint64_t seed, cudaStream_t s,
               int forced_splits, Row* row) {
  const int64_t H = kind.heads, KVH = kind.kv_heads, D = kind.head_dim;
  const int64_t tokens = batch * ctx;
  const int64_t token_bytes = KVH * D * 2;  // one of K or V
  const double kv_bytes = 2.0 * static_cast<double>(tokens) * token_bytes;
  const int64_t num_slots = SlotsFor(kind, batch, ctx, iters, l2_bytes);
  const int64_t rot = num_slots / tokens;
  if (static_cast<size_t>(num_slots * token_bytes) > pool.bytes) {
    std::fprintf(stderr, "internal: the KV pool (%zu bytes) is smaller than a configuration needs\n",
                 pool.bytes);
    std::exit(1);
  }

  void *k = pool.k, *v = pool.v, *q = nullptr, *out = nullptr, *ws = nullptr;
  float* lse = nullptr;
  int32_t *indptr = nullptr, *slots = nullptr;
  BENCH_CUDA(cudaMalloc(&q, static_cast<size_t>(batch * H * D * 2)));
  BENCH_CUDA(cudaMalloc(&out, static_cast<size_t>(batch * H * D * 2)));
  BENCH_CUDA(cudaMalloc(&lse, static_cast<size_t>(batch * H * 4)));
  BENCH_CUDA(cudaMalloc(&indptr, static_cast<size_t>((batch + 1) * 4)));
  BENCH_CUDA(cudaMalloc(&slots, static_cast<size_t>(num_slots * 4)));
  FillBf16(h, k, static_cast<uint64_t>(num_slots * token_bytes / 2), seed * 3 + 1, s);
  FillBf16(h, v, static_cast<uint64_t>(num_slots * token_bytes / 2), seed * 3 + 2, s);
  FillBf16(h, q, static_cast<uint64_t>(batch * H * D), seed * 3 + 3, s);

  std::vector<int32_t> host_indptr(static_cast<size_t>(batch + 1));
  for (int64_t r = 0; r <= batch; ++r) host_indptr[static_cast<size_t>(r)] = static_cast<int32_t>(r * ctx);
  std::vector<int32_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);  // table t = perm[t·tokens, (t+1)·tokens)
  BENCH_CUDA(cudaMemcpy(indptr, host_indptr.data(), host_indptr.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(slots, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));

  kc::DecodePlan plan = kc::PlanDecodeAttention(batch, H, KVH, D, ctx, g_sms);
  if (forced_splits > 0) {
    plan.num_splits = forced_splits;
    // Partial o and lse per (request, head, split), fp32, plus alignment: an upper bound.
    plan.workspace_bytes = forced_splits > 1 ? batch * H * forced_splits * (D + 1) * 4 + 512 : 0;
  }
  if (plan.workspace_bytes > 0) BENCH_CUDA(cudaMalloc(&ws, static_cast<size_t>(plan.workspace_bytes)));

  kc::AttentionParams p;
  p.q = static_cast<const kc::bf16*>(q);
  p.k_cache = static_cast<const kc::bf16*>(k);
  p.v_cache = static_cast<const kc::bf16*>(v);
  p.out = static_cast<kc::bf16*>(out);
  p.lse = lse;
  p.kv_indptr = indptr;
  p.num_requests = batch;
  p.num_slots = num_slots;
  p.num_heads = H;
  p.num_kv_heads = KVH;
  p.head_dim = D;
  p.scale = 1.0f / std::sqrt(static_cast<float>(D));
  p.max_kv_len = ctx;
  p.max_q_len = 1;
  auto launch = [&](int64_t i) {
    p.kv_slots = slots + (i % rot) * tokens;
    const absl::Status st = kc::DecodeAttention(p, plan, ws, s);
    if (!st.ok()) {
      std::fprintf(stderr, "DecodeAttention: %s\n", st.ToString().c_str());
      std::exit(1);
    }
  };

  for (int i = 0; i < kWarmup; ++i) launch(i);
  BENCH_CUDA(cudaStreamSynchronize(s));
  FillBf16(h, flush_buf, flush_bytes / 2, seed, s);  // evicts the KV from L2

  std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * iters));
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  // Direct launches, queued ahead of the GPU (events recorded inside a CUDA graph cannot be
  // timed with cudaEventElapsedTime).
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(ev[2 * i], s));
    launch(kWarmup + i);
    BENCH_CUDA(cudaEventRecord(ev[2 * i + 1], s));
  }
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]));
    times.push_back(ms * 1e-3);
  }
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));

  // The output must be finite (inputs are finite): a cheap guard against timing a broken kernel.
  std::vector<uint16_t> host_out(static_cast<size_t>(batch * H * D));
  BENCH_CUDA(cudaMemcpy(host_out.data(), out, host_out.size() * 2, cudaMemcpyDeviceToHost));
  row->finite =
      std::none_of(host_out.begin(), host_out.end(), [](uint16_t b) { return (b & 0x7f80) == 0x7f80; });

  const double t = Median(times);
  row->kind = kind.name;
  row->heads = H;
  row->kv_heads = KVH;
  row->head_dim = D;
  row->batch = batch;
  row->ctx = ctx;
  row->splits = plan.num_splits;
  row->time_us = t * 1e6;
  row->gbps = kv_bytes / t * 1e-9;

  for (void* ptr :
       {q, out, static_cast<void*>(lse), static_cast<void*>(indptr), static_cast<void*>(slots), ws}) {
    if (ptr) BENCH_CUDA(cudaFree(ptr));
  }
  return true;
}

std::string JsonEscape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) o += c;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseArgs(argc, argv);
  int dev = 0;
  BENCH_CUDA(cudaSetDevice(dev));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, dev));
  g_sms = prop.multiProcessorCount;
  cudaStream_t s;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const Helpers h = LoadHelpers();

  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const size_t bw_bytes = std::min<size_t>(size_t{4} << 30, free_b / 4) / 256 * 256;
  const tandem::bench::ReadCeiling ceiling = tandem::bench::MeasureReadCeiling(bw_bytes, 20, s);
  const double read_bw = ceiling.bytes_per_s;

  const size_t l2 = static_cast<size_t>(prop.l2CacheSize);
  const size_t flush_bytes = std::max<size_t>(4 * l2, size_t{256} << 20);
  void* flush_buf = nullptr;
  BENCH_CUDA(cudaMalloc(&flush_buf, flush_bytes));
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  const double budget = 0.6 * static_cast<double>(free_b);

  std::printf("device: %s (%d SMs, L2 %.0f MB, %.1f GB free)\n", prop.name, g_sms, l2 / 1e6, free_b / 1e9);
  for (const auto& v : ceiling.variants)
    std::printf("  read %-28s %7.0f GB/s\n", v.name.c_str(), v.bytes_per_s * 1e-9);
  std::printf("read bandwidth (best over %.1f GB: %s): %.0f GB/s\n", bw_bytes / 1e9, ceiling.best.c_str(),
              read_bw * 1e-9);
  std::printf("%-5s %6s %6s %6s %10s %8s %6s\n", "kind", "batch", "ctx", "splits", "time_us", "GB/s",
              "%peak");

  const Kind kinds[] = {{"mha", 32, 32, 128}, {"gqa", 32, 8, 128}};
  std::vector<int64_t> batches = {1, 8, 64, 256, 512};
  std::vector<int64_t> ctxs = {128, 1024, 4096, 16384, 32768};
  if (opt.quick) {
    batches = {1, 64, 256};
    ctxs = {1024, 4096};
  }
  if (!opt.batches.empty()) batches = opt.batches;
  if (!opt.contexts.empty()) ctxs = opt.contexts;
  auto wanted = [&](const Kind& kind) {
    return opt.kinds.empty() || std::find(opt.kinds.begin(), opt.kinds.end(), kind.name) != opt.kinds.end();
  };
  auto fits = [&](const Kind& kind, int64_t b, int64_t c) {
    return 2.0 * b * c * kind.kv_heads * kind.head_dim * 2 * 1.02 <= budget;
  };
  KvPool pool;
  for (const Kind& kind : kinds) {
    if (!wanted(kind)) continue;
    for (int64_t b : batches)
      for (int64_t c : ctxs)
        if (fits(kind, b, c))
          pool.bytes = std::max(pool.bytes, static_cast<size_t>(SlotsFor(kind, b, c, opt.iters, l2) *
                                                                kind.kv_heads * kind.head_dim * 2));
  }
  if (pool.bytes > 0) {
    BENCH_CUDA(cudaMalloc(&pool.k, pool.bytes));
    BENCH_CUDA(cudaMalloc(&pool.v, pool.bytes));
  }
  std::vector<Row> rows;
  uint64_t seed = 1;
  for (const Kind& kind : kinds) {
    if (!wanted(kind)) continue;
    for (int64_t b : batches) {
      for (int64_t c : ctxs) {
        const double kv = 2.0 * b * c * kind.kv_heads * kind.head_dim * 2;
        if (!fits(kind, b, c)) {
          std::printf("%-5s %6lld %6lld   skipped: KV %.1f GB > 60%% of free memory\n", kind.name,
                      static_cast<long long>(b), static_cast<long long>(c), kv / 1e9);
          continue;
        }
        std::vector<int64_t> forced = {0};  // 0: the planner's choice
        forced.insert(forced.end(), opt.splits.begin(), opt.splits.end());
        for (const int64_t f : forced) {
          Row row;
          if (!RunConfig(pool, h, kind, b, c, opt.iters, l2, flush_bytes, flush_buf, seed++, s,
                         static_cast<int>(f), &row))
            continue;
          row.pct = 100.0 * row.gbps / (read_bw * 1e-9);
          std::printf("%-5s %6lld %6lld %6d %10.1f %8.0f %6.1f%s%s\n", row.kind.c_str(),
                      static_cast<long long>(row.batch), static_cast<long long>(row.ctx), row.splits,
                      row.time_us, row.gbps, row.pct, f > 0 ? "  (forced)" : "",
                      row.finite ? "" : "  NON-FINITE OUTPUT");
          std::fflush(stdout);
          if (f == 0) rows.push_back(row);
        }
      }
    }
  }
  BENCH_CUDA(cudaFree(flush_buf));
  if (pool.k) BENCH_CUDA(cudaFree(pool.k));
  if (pool.v) BENCH_CUDA(cudaFree(pool.v));

  if (!opt.json.empty()) {
    FILE* f = std::fopen(opt.json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", opt.json.c_str());
      return 1;
    }
    std::fprintf(
        f, "{\n  \"device\": \"%s\",\n  \"sms\": %d,\n  \"read_bandwidth_GBps\": %.1f,\n  \"iters\": %d,\n",
        JsonEscape(prop.name).c_str(), g_sms, read_bw * 1e-9, opt.iters);
    std::fprintf(f, "  \"rows\": [\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(
          f,
          "    {\"kind\": \"%s\", \"heads\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, \"batch\": %lld, "
          "\"ctx\": %lld, "
          "\"splits\": %d, \"time_us\": %.2f, \"GBps\": %.1f, \"pct_peak\": %.2f, \"finite\": %s}%s\n",
          r.kind.c_str(), static_cast<long long>(r.heads), static_cast<long long>(r.kv_heads),
          static_cast<long long>(r.head_dim), static_cast<long long>(r.batch), static_cast<long long>(r.ctx),
          r.splits, r.time_us, r.gbps, r.pct, r.finite ? "true" : "false", i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  for (const Row& r : rows) {
    if (!r.finite) return 1;
  }
  return 0;
}
