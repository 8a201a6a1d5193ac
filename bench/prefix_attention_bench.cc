// Cascade (shared-prefix) attention against plain decode attention: what does computing a shared
// prefix once for a group of decode rows save? Not a test: prints figures.
//
//   prefix_attention_bench [--models llama3-8b,llama-13b] [--batches 64,128,256,512]
//                          [--prefixes 1024,4096,16384,32768] [--suffixes 64,256,1024,2048]
//                          [--reps N] [--quick] [--crossover] [--prefill-kernel auto|mma|wgmma]
//
// Main table (default): B decode rows share one prefix of P keys and each has S keys of its own
// (the suffix, its newest key included). One layer's KV pool in bf16, P + B·S slots in a random
// permutation (no context is contiguous), K/V filled with fresh random values (never zeros), q
// random in [-4, 4) (scores of std ≈ 0.8: the softmax neither flat nor one-hot).
//   plain    DecodeAttention over every row's whole context (prefix slots, then suffix slots),
//            with its PlanDecodeAttention workspace.
//   cascade  GatherRows of the B q rows (a copy the engine makes too, so it is timed) + one
//            PrefillAttention with causal == false over the prefix for all B rows as one group
//            (tensor cores; each prefix K/V tile is read once per tile of 64/128 rows and head)
//            + DecodeAttention over the suffixes with lse + MergeStates. GQA packing, as the
//            engine does (memory_node/cuda_attention_executor.cc), wherever heads > kv_heads:
//            GatherRows with pack = heads / kv_heads stores each row's heads j-major, so that the
//            prefix launch sees B·pack rows of kv_heads heads (num_heads = num_kv_heads =
//            kv_heads): the pack query heads that share a KV head are rows of it, and each K/V
//            tile is read once for all of them; the final MergeStates unpacks (b_pack = pack).
//            MHA (llama-13b): pack = 1, nothing changes.
//   split    the cascade with the prefix cut into K chunks, each a "request" of its own with its
//            own gathered copy of the B rows, the K partial states merged pairwise (ceil(log2 K)
//            MergeStates calls, elementwise on the packed states: b_pack = 1) before the final
//            merge: PrefillAttention has no split-KV, so one group of few rows over a long prefix
//            runs on few SMs (B = 64 on llama3-8b: 16 CTAs packed, 32 unpacked). K = 1 where the
//            (tile of rows, head) CTAs already cover every SM, else enough for about one full
//            wave, at least 512 keys per chunk (AutoSplits; CTAs counted as the engine does:
//            kv_heads × ceil(B·pack / tile), tile 64 if B·pack <= 64 else 128).
//   ovl      the split cascade with GatherRows + PrefillAttention on a second stream, concurrent
//            with the suffix DecodeAttention; the merges after both (an event join).
//   nopack   the split cascade without GQA packing (pack = 1: B rows of heads query heads over
//            kv_heads KV heads, K from AutoSplits with heads × ceil(B / tile) CTAs): what the
//            engine did before packing, for comparison. Timed only where heads > kv_heads; "-"
//            for MHA, where it would be the split cascade again.
// Each figure is the median of --reps runs (default 10) after 2 warm-up runs, timed with CUDA
// events; the L2 is flushed (a 4×L2 write) before every run, outside the timed span, as the
// other layers of a real step would. Columns: plain µs and its KV rate (GB/s: every row's K and V
// bytes over the time; the shared prefix is mostly served from L2, so this can exceed the HBM
// rate); cascade µs, its parts (gather, prefix, suffix, merge µs), speedup plain / cascade, the
// prefix part's effective TFLOP/s (4·B·heads·P·head_dim flops over the PrefillAttention time);
// split K, µs and speedup; ovl µs and speedup; nopack µs and speedup (all speedups are plain µs
// over the variant's µs). Every configuration checks that each cascade variant's output (packed
// and unpacked) matches the plain output: max|diff| and max|diff| / max|plain| (worst over the
// variants) are printed, and a relative difference above 2e-2 (bf16: each path rounds its
// partial results to bf16) or a non-finite value marks the row MISMATCH and makes the exit
// status 1.
//
// --crossover: which is faster for a small group? For llama3-8b and llama-13b, a group of G rows
// (G in 1..64) sharing a prefix of P keys (P in 16..4096) with 32 own keys each, in a batch with
// 64 other decode rows of 1024 keys. plain: one DecodeAttention over all rows; cascade: one
// DecodeAttention over every row's own keys (the group's suffixes, the others' contexts) with
// lse + GatherRows + non-causal PrefillAttention (G rows, P keys; GQA-packed as above) +
// MergeStates, sequential (the faster of K = 1 and K = auto) and overlapped (ovl). Medians of
// max(--reps, 30) runs. Prints each (G, P) with the winner and the ratio, then per G the smallest
// P at which each cascade variant wins.
//
// Random inputs come from the fill kernel of bench/bench_cuda.h.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "common/dtype.h"
#include "kernels/cuda/ops.h"

namespace {

namespace kc = ::tandem::kernels::cuda;

// The prefix launches' kernel (--prefill-kernel; ops.h PrefillKernel).
kc::PrefillKernel g_prefill_kernel = kc::PrefillKernel::kAuto;

#define BENCH_OK(expr)                                                            \
  do {                                                                            \
    const absl::Status bench_st_ = (expr);                                        \
    if (!bench_st_.ok()) {                                                        \
      std::fprintf(stderr, "%s failed at %s:%d: %s\n", #expr, __FILE__, __LINE__, \
                   std::string(bench_st_.ToString()).c_str());                    \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

int g_sms = 0;
tandem::bench::Helpers g_helpers;

void LoadFill() { g_helpers = tandem::bench::LoadHelpers(); }

// bf16 values ±[2^-7, 1), never zero, inf or NaN.
void FillBf16(void* p, uint64_t n, uint64_t seed, cudaStream_t s) {
  tandem::bench::FillBf16(g_helpers, p, n, seed, g_sms, s);
}

// A device allocation freed at scope exit.
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) {
    if (bytes > 0) BENCH_CUDA(cudaMalloc(&p_, bytes));
  }
  ~DevBuf() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

template <typename T>
void Upload(const DevBuf& d, const std::vector<T>& h) {
  BENCH_CUDA(cudaMemcpy(d.get(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
size_t Bytes(const std::vector<T>& v) {
  return std::max<size_t>(1, v.size()) * sizeof(T);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Flushes the L2 by writing a buffer several times its size.
struct L2Flusher {
  void* buf = nullptr;
  size_t bytes = 0;
  void operator()(cudaStream_t s) const { FillBf16(buf, bytes / 2, 777, s); }
};

// Runs `stages` in order, `warmup` untimed times then `reps` timed times, the L2 flushed before
// each run. Returns the median µs of each stage, then of the whole run.
std::vector<double> TimeStages(const std::vector<std::function<void()>>& stages, int warmup, int reps,
                               const L2Flusher& flush, cudaStream_t s) {
  const size_t ns = stages.size();
  for (int i = 0; i < warmup; ++i) {
    flush(s);
    for (const auto& f : stages) f();
  }
  std::vector<cudaEvent_t> ev(static_cast<size_t>(reps) * (ns + 1));
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int r = 0; r < reps; ++r) {
    flush(s);
    cudaEvent_t* e = ev.data() + static_cast<size_t>(r) * (ns + 1);
    BENCH_CUDA(cudaEventRecord(e[0], s));
    for (size_t i = 0; i < ns; ++i) {
      stages[i]();
      BENCH_CUDA(cudaEventRecord(e[i + 1], s));
    }
  }
  BENCH_CUDA(cudaStreamSynchronize(s));
  std::vector<std::vector<double>> t(ns + 1);
  for (int r = 0; r < reps; ++r) {
    cudaEvent_t* e = ev.data() + static_cast<size_t>(r) * (ns + 1);
    float ms = 0;
    for (size_t i = 0; i < ns; ++i) {
      BENCH_CUDA(cudaEventElapsedTime(&ms, e[i], e[i + 1]));
      t[i].push_back(ms * 1e3);
    }
    BENCH_CUDA(cudaEventElapsedTime(&ms, e[0], e[ns]));
    t[ns].push_back(ms * 1e3);
  }
  for (auto& e : ev) BENCH_CUDA(cudaEventDestroy(e));
  std::vector<double> med;
  for (auto& v : t) med.push_back(Median(v));
  return med;
}

struct Model {
  const char* name;
  int64_t heads, kv_heads, head_dim;
};
const Model kModels[] = {{"llama3-8b", 32, 8, 128}, {"llama-13b", 40, 40, 128}};

// Query heads per KV head: the engine's GQA packing of the prefix launch (1 for MHA).
int64_t GqaPack(const Model& m) { return m.heads / m.kv_heads; }

// One cascade variant to time.
struct Variant {
  int k = 1;                // prefix splits (1: the plain cascade)
  int64_t pack = 1;         // GatherRowsParams::pack of the prefix launch (1: unpacked)
  bool overlapped = false;  // gather + prefix on a second stream, concurrent with the suffix decode
};

// One batch: rows [0, G) share a prefix of P keys and have S own keys each; rows [G, G + U) are
// ungrouped with C keys each.
struct Scenario {
  Model m;
  int64_t G = 0, P = 0, S = 0, U = 0, C = 0;
  std::vector<Variant> variants;  // cascade variants to time, in this order
  int reps = 10;
  uint64_t seed = 1;
};

struct Result {
  double plain_us = 0, plain_gbps = 0;
  struct Cascade {
    Variant v;
    std::vector<double> us;  // sequential: gather, prefix, suffix, merge, total; overlapped: total
    double max_abs = 0, rel = 0;
    bool finite = true;
  };
  std::vector<Cascade> cascades;  // one per Scenario::variants entry, in that order
  bool ok = true;
};

// Host copy of a bf16 device array as floats.
std::vector<float> DownloadBf16(const DevBuf& d, size_t n) {
  std::vector<uint16_t> bits(n);
  BENCH_CUDA(cudaMemcpy(bits.data(), d.get(), n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = tandem::Bf16ToFloat(bits[i]);
  return f;
}

Result RunScenario(const Scenario& sc, const L2Flusher& flush, cudaStream_t s, cudaStream_t s2) {
  const int64_t H = sc.m.heads, KVH = sc.m.kv_heads, D = sc.m.head_dim;
  const int64_t G = sc.G, P = sc.P, S = sc.S, U = sc.U, C = sc.C, N = G + U;
  const int64_t num_slots = P + G * S + U * C;
  const int64_t token_elems = KVH * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));

  // KV pool and slot permutation: prefix = perm[0, P), suffix g, then ungrouped contexts.
  DevBuf k(static_cast<size_t>(num_slots * token_elems * 2)),
      v(static_cast<size_t>(num_slots * token_elems * 2));
  FillBf16(k.get(), static_cast<uint64_t>(num_slots * token_elems), sc.seed * 4 + 1, s);
  FillBf16(v.get(), static_cast<uint64_t>(num_slots * token_elems), sc.seed * 4 + 2, s);
  std::vector<int32_t> perm(static_cast<size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(sc.seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  auto slots_of = [&](int64_t begin, int64_t n) {
    return std::vector<int32_t>(perm.begin() + begin, perm.begin() + begin + n);
  };
  const std::vector<int32_t> prefix = slots_of(0, P);

  // plain: whole contexts; cascade: own keys (group suffixes, ungrouped contexts).
  std::vector<int32_t> plain_indptr = {0}, plain_slots, own_indptr = {0}, own_slots;
  plain_slots.reserve(static_cast<size_t>(G * (P + S) + U * C));
  for (int64_t g = 0; g < G; ++g) {
    const std::vector<int32_t> suf = slots_of(P + g * S, S);
    plain_slots.insert(plain_slots.end(), prefix.begin(), prefix.end());
    plain_slots.insert(plain_slots.end(), suf.begin(), suf.end());
    own_slots.insert(own_slots.end(), suf.begin(), suf.end());
    plain_indptr.push_back(static_cast<int32_t>(plain_slots.size()));
    own_indptr.push_back(static_cast<int32_t>(own_slots.size()));
  }
  for (int64_t u = 0; u < U; ++u) {
    const std::vector<int32_t> ctx = slots_of(P + G * S + u * C, C);
    plain_slots.insert(plain_slots.end(), ctx.begin(), ctx.end());
    own_slots.insert(own_slots.end(), ctx.begin(), ctx.end());
    plain_indptr.push_back(static_cast<int32_t>(plain_slots.size()));
    own_indptr.push_back(static_cast<int32_t>(own_slots.size()));
  }
  const int64_t plain_max = std::max(P + S, U > 0 ? C : 0), own_max = std::max(S, U > 0 ? C : 0);

  // q in [-4, 4).
  std::vector<uint16_t> q_host(static_cast<size_t>(N * H * D));
  std::uniform_real_distribution<float> uq(-4.0f, 4.0f);
  for (auto& x : q_host) x = tandem::FloatToBf16(uq(rng));

  int kmax = 1;
  for (const Variant& var : sc.variants) kmax = std::max(kmax, var.k);
  DevBuf q(Bytes(q_host)), plain_indptr_d(Bytes(plain_indptr)), plain_slots_d(Bytes(plain_slots)),
      own_indptr_d(Bytes(own_indptr)), own_slots_d(Bytes(own_slots)), prefix_d(Bytes(prefix));
  Upload(q, q_host);
  Upload(plain_indptr_d, plain_indptr);
  Upload(plain_slots_d, plain_slots);
  Upload(own_indptr_d, own_indptr);
  Upload(own_slots_d, own_slots);
  Upload(prefix_d, prefix);
  DevBuf out_plain(static_cast<size_t>(N * H * D * 2)), out(static_cast<size_t>(N * H * D * 2)),
      lse(static_cast<size_t>(N * H * 4));
  DevBuf q_pre(static_cast<size_t>(kmax * G * H * D * 2)), out_pre(static_cast<size_t>(kmax * G * H * D * 2)),
      lse_pre(static_cast<size_t>(kmax * G * H * 4));
  // Gathered rows: [0, G) once per split; split indptrs (over the prefix slots) per split count.
  std::vector<int32_t> gather_rows;
  for (int r = 0; r < kmax; ++r)
    for (int64_t g = 0; g < G; ++g) gather_rows.push_back(static_cast<int32_t>(g));
  DevBuf gather_rows_d(Bytes(gather_rows));
  Upload(gather_rows_d, gather_rows);

  kc::AttentionParams base;
  base.k_cache = k.as<kc::bf16>();
  base.v_cache = v.as<kc::bf16>();
  base.num_slots = num_slots;
  base.num_heads = H;
  base.num_kv_heads = KVH;
  base.head_dim = D;
  base.scale = scale;

  Result res;
  // ---- plain ----
  const kc::DecodePlan plain_plan = kc::PlanDecodeAttention(N, H, KVH, D, plain_max, g_sms);
  DevBuf plain_ws(static_cast<size_t>(plain_plan.workspace_bytes));
  kc::AttentionParams pp = base;
  pp.q = q.as<kc::bf16>();
  pp.out = out_plain.as<kc::bf16>();
  pp.kv_indptr = plain_indptr_d.as<int32_t>();
  pp.kv_slots = plain_slots_d.as<int32_t>();
  pp.num_requests = N;
  pp.max_q_len = 1;
  pp.max_kv_len = plain_max;
  const std::vector<double> plain_t = TimeStages(
      {[&] { BENCH_OK(kc::DecodeAttention(pp, plain_plan, plain_ws.get(), s)); }}, 2, sc.reps, flush, s);
  res.plain_us = plain_t.back();
  res.plain_gbps =
      2.0 * static_cast<double>(plain_slots.size()) * token_elems * 2 / (res.plain_us * 1e-6) * 1e-9;
  const std::vector<float> ref = DownloadBf16(out_plain, static_cast<size_t>(N * H * D));
  float max_ref = 0.0f;
  bool ref_finite = true;
  for (float x : ref) {
    if (!std::isfinite(x)) ref_finite = false;
    max_ref = std::max(max_ref, std::fabs(x));
  }

  // ---- cascade, per variant ----
  const kc::DecodePlan own_plan = kc::PlanDecodeAttention(N, H, KVH, D, own_max, g_sms);
  DevBuf own_ws(static_cast<size_t>(own_plan.workspace_bytes));
  kc::AttentionParams own = base;
  own.q = q.as<kc::bf16>();
  own.out = out.as<kc::bf16>();
  own.lse = lse.as<float>();
  own.kv_indptr = own_indptr_d.as<int32_t>();
  own.kv_slots = own_slots_d.as<int32_t>();
  own.num_requests = N;
  own.max_q_len = 1;
  own.max_kv_len = own_max;
  auto check = [&](Result::Cascade* cr) {
    const std::vector<float> got = DownloadBf16(out, static_cast<size_t>(N * H * D));
    cr->finite = ref_finite;
    for (size_t i = 0; i < got.size(); ++i) {
      if (!std::isfinite(got[i])) cr->finite = false;
      cr->max_abs = std::max<double>(cr->max_abs, std::fabs(got[i] - ref[i]));
    }
    cr->rel = max_ref > 0 ? cr->max_abs / max_ref : cr->max_abs;
    if (!cr->finite || !(cr->rel <= 2e-2)) res.ok = false;
  };
  for (const Variant& var : sc.variants) {
    const int ksplit = var.k;
    const int64_t pack = var.pack;
    // Split r covers prefix keys [r·P/K, (r+1)·P/K) for the r-th copy of the G rows; packed, each
    // copy is G·pack rows of H / pack (= KVH) heads.
    std::vector<int32_t> pre_q_indptr = {0}, pre_kv_indptr = {0};
    int64_t pre_max_kv = 1;
    for (int r = 0; r < ksplit; ++r) {
      pre_q_indptr.push_back(static_cast<int32_t>((r + 1) * G * pack));
      pre_kv_indptr.push_back(static_cast<int32_t>(P * (r + 1) / ksplit));
      pre_max_kv = std::max<int64_t>(pre_max_kv, pre_kv_indptr[r + 1] - pre_kv_indptr[r]);
    }
    DevBuf pre_q_indptr_d(Bytes(pre_q_indptr)), pre_kv_indptr_d(Bytes(pre_kv_indptr));
    Upload(pre_q_indptr_d, pre_q_indptr);
    Upload(pre_kv_indptr_d, pre_kv_indptr);

    kc::GatherRowsParams gp;
    gp.src = q.as<kc::bf16>();
    gp.dst = q_pre.as<kc::bf16>();
    gp.rows = gather_rows_d.as<int32_t>();
    gp.n = ksplit * G;
    gp.width = H * D;
    gp.pack = pack;
    gp.head_dim = D;
    kc::AttentionParams prep = base;
    prep.q = q_pre.as<kc::bf16>();
    prep.out = out_pre.as<kc::bf16>();
    prep.lse = lse_pre.as<float>();
    prep.q_indptr = pre_q_indptr_d.as<int32_t>();
    prep.kv_indptr = pre_kv_indptr_d.as<int32_t>();
    prep.kv_slots = prefix_d.as<int32_t>();
    prep.num_requests = ksplit;
    prep.num_heads = H / pack;  // packed: G·pack query rows per KV head
    prep.num_kv_heads = KVH;
    prep.max_q_len = G * pack;
    prep.max_kv_len = pre_max_kv;
    prep.causal = false;
    // Merges: the K partial prefix states pairwise into the first (upper half into lower half,
    // ceil(log2 K) calls; elementwise, so in their packed head order: b_pack = 1), then that one
    // into each row's own-keys state (unpacked: b_pack = pack).
    auto merge = [&](cudaStream_t st) {
      kc::MergeStatesParams mp;
      mp.num_heads = H;
      mp.head_dim = D;
      for (int m = ksplit; m > 1;) {
        const int half = m / 2;  // copies [m - half, m) into [0, half)
        mp.out = out_pre.as<kc::bf16>();
        mp.lse = lse_pre.as<float>();
        mp.out_b = out_pre.as<kc::bf16>() + (m - half) * G * H * D;
        mp.lse_b = lse_pre.as<float>() + (m - half) * G * H;
        mp.n = half * G;
        mp.b_pack = 1;
        BENCH_OK(kc::MergeStates(mp, st));
        m -= half;
      }
      mp.out = out.as<kc::bf16>();
      mp.lse = lse.as<float>();
      mp.out_b = out_pre.as<kc::bf16>();
      mp.lse_b = lse_pre.as<float>();
      mp.n = G;
      mp.b_pack = pack;
      BENCH_OK(kc::MergeStates(mp, st));
    };
    Result::Cascade cr;
    cr.v = var;
    if (!var.overlapped) {
      cr.us = TimeStages(
          {[&] { BENCH_OK(kc::GatherRows(gp, s)); },
           [&] { BENCH_OK(kc::PrefillAttention(prep, s, g_prefill_kernel)); },
           [&] { BENCH_OK(kc::DecodeAttention(own, own_plan, own_ws.get(), s)); }, [&] { merge(s); }},
          2, sc.reps, flush, s);
    } else {
      // The prefix part (gather, prefill) on a second stream, concurrent with the own-keys decode;
      // the merges after both.
      cudaEvent_t fork, join;
      BENCH_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
      BENCH_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
      cr.us = TimeStages({[&] {
                           BENCH_CUDA(cudaEventRecord(fork, s));
                           BENCH_CUDA(cudaStreamWaitEvent(s2, fork, 0));
                           BENCH_OK(kc::GatherRows(gp, s2));
                           BENCH_OK(kc::PrefillAttention(prep, s2, g_prefill_kernel));
                           BENCH_CUDA(cudaEventRecord(join, s2));
                           BENCH_OK(kc::DecodeAttention(own, own_plan, own_ws.get(), s));
                           BENCH_CUDA(cudaStreamWaitEvent(s, join, 0));
                           merge(s);
                         }},
                         2, sc.reps, flush, s);
      BENCH_CUDA(cudaStreamSynchronize(s));
      BENCH_CUDA(cudaEventDestroy(fork));
      BENCH_CUDA(cudaEventDestroy(join));
    }
    check(&cr);
    res.cascades.push_back(cr);
  }
  return res;
}

// Prefix splits for the non-causal PrefillAttention launch of `rows` rows, GQA-packed by `pack`
// (GqaPack, or 1 unpacked), as the engine plans them (PlanGroups in
// memory_node/cuda_attention_executor.cc): none when one CTA per (tile of rows·pack rows, head of
// heads / pack) already covers every SM, else enough for about one full wave (two CTAs per SM:
// 80-96 KB of shared memory each), each split at least 512 keys (8 key tiles: the Q load and the
// epilogue amortised).
int AutoSplits(const Model& m, int64_t rows, int64_t prefix, int64_t pack) {
  const int64_t packed_rows = rows * pack, launch_heads = m.heads / pack;
  const int64_t tile = packed_rows <= 64 ? 64 : 128;
  const int64_t ctas = launch_heads * ((packed_rows + tile - 1) / tile);
  if (ctas >= g_sms) return 1;
  const int64_t want = (2 * int64_t{g_sms} + ctas - 1) / ctas;
  return static_cast<int>(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, prefix / 512)));
}

// The cascade variants of a configuration, GQA-packed as the engine does: casc (K = 1), split
// (K = auto; the same as casc where that is 1), ovl (split, overlapped) and, with `nopack` where
// the model has heads > kv_heads, the split cascade unpacked (its own K = auto).
struct VariantSet {
  std::vector<Variant> variants;
  size_t casc = 0, split = 0, ovl = 0;  // indices into variants (and Result::cascades)
  int nopack = -1;                      // index, -1 where not timed
};
VariantSet PlanVariants(const Model& m, int64_t rows, int64_t prefix, bool nopack) {
  VariantSet vs;
  const int64_t pack = GqaPack(m);
  const int k = AutoSplits(m, rows, prefix, pack);
  vs.variants.push_back({1, pack, false});
  if (k > 1) {
    vs.split = vs.variants.size();
    vs.variants.push_back({k, pack, false});
  }
  vs.ovl = vs.variants.size();
  vs.variants.push_back({k, pack, true});
  if (nopack && pack > 1) {
    vs.nopack = static_cast<int>(vs.variants.size());
    vs.variants.push_back({AutoSplits(m, rows, prefix, 1), 1, false});
  }
  return vs;
}

std::vector<int64_t> ParseList(const char* s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) v.push_back(std::atoll(item.c_str()));
  }
  return v;
}

struct Options {
  std::vector<std::string> models = {"llama3-8b", "llama-13b"};
  std::vector<int64_t> batches = {64, 128, 256, 512};
  std::vector<int64_t> prefixes = {1024, 4096, 16384, 32768};
  std::vector<int64_t> suffixes = {64, 256, 1024, 2048};
  int reps = 10;
  bool crossover = false;
};

Options ParseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--models" && has_value) {
      o.models.clear();
      std::stringstream ss(argv[++i]);
      std::string item;
      while (std::getline(ss, item, ',')) o.models.push_back(item);
    } else if (a == "--batches" && has_value) {
      o.batches = ParseList(argv[++i]);
    } else if (a == "--prefixes" && has_value) {
      o.prefixes = ParseList(argv[++i]);
    } else if (a == "--suffixes" && has_value) {
      o.suffixes = ParseList(argv[++i]);
    } else if (a == "--reps" && has_value) {
      o.reps = std::max(3, std::atoi(argv[++i]));
    } else if (a == "--quick") {
      o.batches = {64, 512};
      o.prefixes = {4096, 32768};
      o.suffixes = {256, 2048};
    } else if (a == "--crossover") {
      o.crossover = true;
    } else if (a == "--prefill-kernel" && has_value) {
      const std::string k = argv[++i];
      if (k != "auto" && k != "mma" && k != "wgmma") {
        std::fprintf(stderr, "--prefill-kernel: auto, mma or wgmma, got %s\n", k.c_str());
        std::exit(2);
      }
      g_prefill_kernel = k == "mma"     ? kc::PrefillKernel::kMmaSync
                         : k == "wgmma" ? kc::PrefillKernel::kWgmma
                                        : kc::PrefillKernel::kAuto;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--models llama3-8b,llama-13b] [--batches 64,128,256,512]\n"
                   "  [--prefixes 1024,4096,16384,32768] [--suffixes 64,256,1024,2048] [--reps N] [--quick]\n"
                   "  [--crossover] [--prefill-kernel auto|mma|wgmma]\n",
                   argv[0]);
      std::exit(a == "--help" || a == "-h" ? 0 : 2);
    }
  }
  return o;
}

std::vector<Model> SelectModels(const Options& o) {
  std::vector<Model> out;
  for (const std::string& name : o.models) {
    bool found = false;
    for (const Model& m : kModels) {
      if (name == m.name) {
        out.push_back(m);
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "unknown model %s (llama3-8b, llama-13b)\n", name.c_str());
      std::exit(2);
    }
  }
  return out;
}

double KvBytes(const Model& m, int64_t slots) {
  return 2.0 * static_cast<double>(slots) * m.kv_heads * m.head_dim * 2;
}

// Max |diff| and max relative diff over every timed cascade variant.
void WorstDiff(const Result& r, double* max_abs, double* rel) {
  *max_abs = 0;
  *rel = 0;
  for (const auto& c : r.cascades) {
    *max_abs = std::max(*max_abs, c.max_abs);
    *rel = std::max(*rel, c.rel);
  }
}

int RunMain(const Options& o, const L2Flusher& flush, double budget, cudaStream_t s, cudaStream_t s2) {
  std::printf(
      "casc, split, ovl: the prefix launch GQA-packed where heads > kv_heads (pack = heads / kv_heads), as "
      "the engine does; nopack: split without packing\n");
  std::printf(
      "%-9s %4s %6s %5s | %9s %6s | %9s %7s %8s %7s %6s %7s %6s | %2s %9s %7s | %9s %7s | %9s %7s | %8s "
      "%8s\n",
      "model", "B", "P", "S", "plain_us", "GB/s", "casc_us", "gather", "prefix", "suffix", "merge", "speedup",
      "TFLOPs", "K", "split_us", "speedup", "ovl_us", "speedup", "nopack_us", "speedup", "max|d|", "rel");
  bool all_ok = true;
  uint64_t seed = 1;
  const std::vector<Model> models = SelectModels(o);
  const size_t total = models.size() * o.batches.size() * o.prefixes.size() * o.suffixes.size();
  size_t done = 0;
  for (const Model& m : models) {
    for (int64_t B : o.batches) {
      for (int64_t P : o.prefixes) {
        for (int64_t S : o.suffixes) {
          ++done;
          std::fprintf(stderr, "[%zu/%zu] %s B=%lld P=%lld S=%lld\n", done, total, m.name,
                       static_cast<long long>(B), static_cast<long long>(P), static_cast<long long>(S));
          const double kv = KvBytes(m, P + B * S);
          const double tables = 4.0 * B * (P + S) * 1.05;
          if (kv + tables > budget) {
            std::printf("%-9s %4lld %6lld %5lld   skipped: %.1f GB > 60%% of free memory\n", m.name,
                        static_cast<long long>(B), static_cast<long long>(P), static_cast<long long>(S),
                        (kv + tables) / 1e9);
            continue;
          }
          Scenario sc;
          sc.m = m;
          sc.G = B;
          sc.P = P;
          sc.S = S;
          sc.reps = o.reps;
          sc.seed = seed++;
          const VariantSet vs = PlanVariants(m, B, P, /*nopack=*/true);
          sc.variants = vs.variants;
          const Result r = RunScenario(sc, flush, s, s2);
          const Result::Cascade& c1 = r.cascades[vs.casc];
          const Result::Cascade& ck = r.cascades[vs.split];
          const Result::Cascade& ov = r.cascades[vs.ovl];
          char nopack[2][32] = {"-", "-"};
          if (vs.nopack >= 0) {
            const double np = r.cascades[static_cast<size_t>(vs.nopack)].us.back();
            std::snprintf(nopack[0], sizeof(nopack[0]), "%.1f", np);
            std::snprintf(nopack[1], sizeof(nopack[1]), "%.2fx", r.plain_us / np);
          }
          double max_abs, rel;
          WorstDiff(r, &max_abs, &rel);
          const double tflops = 4.0 * B * m.heads * P * m.head_dim / (c1.us[1] * 1e-6) * 1e-12;
          std::printf(
              "%-9s %4lld %6lld %5lld | %9.1f %6.0f | %9.1f %7.1f %8.1f %7.1f %6.1f %6.2fx %6.1f | %2d %9.1f "
              "%6.2fx | %9.1f %6.2fx | %9s %7s | %8.1e %8.1e%s\n",
              m.name, static_cast<long long>(B), static_cast<long long>(P), static_cast<long long>(S),
              r.plain_us, r.plain_gbps, c1.us[4], c1.us[0], c1.us[1], c1.us[2], c1.us[3],
              r.plain_us / c1.us[4], tflops, ck.v.k, ck.us[4], r.plain_us / ck.us[4], ov.us.back(),
              r.plain_us / ov.us.back(), nopack[0], nopack[1], max_abs, rel, r.ok ? "" : "  MISMATCH");
          std::fflush(stdout);
          all_ok = all_ok && r.ok;
        }
      }
    }
  }
  return all_ok ? 0 : 1;
}

int RunCrossover(const Options& o, const L2Flusher& flush, cudaStream_t s, cudaStream_t s2) {
  const int64_t groups[] = {1, 2, 4, 8, 16, 32, 64};
  const int64_t prefixes[] = {16, 32, 64, 128, 256, 512, 1024, 4096};
  constexpr int64_t kSuffix = 32, kOthers = 64, kOtherCtx = 1024;
  std::printf(
      "crossover: a group of G rows sharing P prefix keys (+%lld own keys each) in a batch with %lld other "
      "decode rows of %lld keys\n"
      "  seq: the cascade on one stream, the faster of K = 1 and K = auto prefix splits (K shown);\n"
      "  ovl: K = auto, gather + prefix on a second stream concurrent with the own-keys decode;\n"
      "  the prefix launch GQA-packed where heads > kv_heads, as the engine does\n",
      static_cast<long long>(kSuffix), static_cast<long long>(kOthers), static_cast<long long>(kOtherCtx));
  std::printf("%-9s %3s %5s | %9s | %9s %2s %-7s %6s | %9s %-7s %6s | %8s\n", "model", "G", "P", "plain_us",
              "seq_us", "K", "faster", "by", "ovl_us", "faster", "by", "rel");
  bool all_ok = true;
  uint64_t seed = 1000;
  const std::vector<Model> models = SelectModels(o);
  struct Summary {
    const Model* m;
    int64_t g;
    int64_t first_win[2] = {-1, -1};  // seq, ovl
    bool monotone[2] = {true, true};
    bool won[2] = {false, false};
  };
  std::vector<Summary> summary;
  const size_t total = models.size() * std::size(groups) * std::size(prefixes);
  size_t done = 0;
  for (const Model& m : models) {
    for (int64_t G : groups) {
      Summary sm{&m, G};
      for (int64_t P : prefixes) {
        ++done;
        std::fprintf(stderr, "[%zu/%zu] crossover %s G=%lld P=%lld\n", done, total, m.name,
                     static_cast<long long>(G), static_cast<long long>(P));
        Scenario sc;
        sc.m = m;
        sc.G = G;
        sc.P = P;
        sc.S = kSuffix;
        sc.U = kOthers;
        sc.C = kOtherCtx;
        sc.reps = std::max(o.reps, 30);
        sc.seed = seed++;
        const VariantSet vs = PlanVariants(m, G, P, /*nopack=*/false);
        sc.variants = vs.variants;
        const Result r = RunScenario(sc, flush, s, s2);
        const Result::Cascade* best = &r.cascades[vs.casc];
        if (r.cascades[vs.split].us.back() < best->us.back()) best = &r.cascades[vs.split];
        const double t[2] = {best->us.back(), r.cascades[vs.ovl].us.back()};
        bool wins[2];
        for (int v = 0; v < 2; ++v) {
          wins[v] = t[v] < r.plain_us;
          if (wins[v] && sm.first_win[v] < 0) sm.first_win[v] = P;
          if (!wins[v] && sm.won[v]) sm.monotone[v] = false;
          sm.won[v] = sm.won[v] || wins[v];
        }
        double max_abs, rel;
        WorstDiff(r, &max_abs, &rel);
        std::printf("%-9s %3lld %5lld | %9.1f | %9.1f %2d %-7s %5.2fx | %9.1f %-7s %5.2fx | %8.1e%s\n",
                    m.name, static_cast<long long>(G), static_cast<long long>(P), r.plain_us, t[0], best->v.k,
                    wins[0] ? "cascade" : "plain", wins[0] ? r.plain_us / t[0] : t[0] / r.plain_us, t[1],
                    wins[1] ? "cascade" : "plain", wins[1] ? r.plain_us / t[1] : t[1] / r.plain_us, rel,
                    r.ok ? "" : "  MISMATCH");
        std::fflush(stdout);
        all_ok = all_ok && r.ok;
      }
      summary.push_back(sm);
    }
  }
  std::printf("\nsmallest prefix P at which the cascade is faster (P tested: 16..4096):\n");
  std::printf("  %-9s %-5s %-28s %s\n", "model", "G", "seq", "ovl");
  for (const Summary& sm : summary) {
    std::string col[2];
    for (int v = 0; v < 2; ++v) {
      col[v] = sm.first_win[v] < 0 ? "never" : "P >= " + std::to_string(sm.first_win[v]);
      if (sm.first_win[v] >= 0 && !sm.monotone[v]) col[v] += " (not at every larger P)";
    }
    std::printf("  %-9s %-5lld %-28s %s\n", sm.m->name, static_cast<long long>(sm.g), col[0].c_str(),
                col[1].c_str());
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = ParseArgs(argc, argv);
  int dev = 0;
  BENCH_CUDA(cudaSetDevice(dev));
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, dev));
  g_sms = prop.multiProcessorCount;
  cudaStream_t s, s2;
  BENCH_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  BENCH_CUDA(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  LoadFill();

  L2Flusher flush;
  flush.bytes = std::max<size_t>(4 * static_cast<size_t>(prop.l2CacheSize), size_t{256} << 20);
  BENCH_CUDA(cudaMalloc(&flush.buf, flush.bytes));
  size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  std::printf("device: %s (%d SMs, L2 %.0f MB, %.1f GB free); medians of %d runs, L2 flushed before each\n",
              prop.name, g_sms, prop.l2CacheSize / 1e6, free_b / 1e9,
              opt.crossover ? std::max(opt.reps, 30) : opt.reps);
  const int rc = opt.crossover ? RunCrossover(opt, flush, s, s2) : RunMain(opt, flush, 0.6 * free_b, s, s2);
  BENCH_CUDA(cudaFree(flush.buf));
  return rc;
}
