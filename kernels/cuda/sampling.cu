// SampleTokens: cpu::SampleToken and cpu::TokenLogprob for every row of fp32 logits, one thread
// block per row, no sort and no scratch memory.
//
// Pass 0 (every row): argmax (NaN as -inf, lowest id on ties) and an online log-sum-exp of the
// raw logits (fp32 exp terms, double sums) for the log-probability of the chosen token.
//
// Sampling rows (temperature > 0, finite max m), with p(l) = exp((l - m) / T) in double exactly as
// the CPU forms it. Probability order equals the order of the logits, so tokens are ranked by an
// order-preserving 32-bit key of their logit (NaN as -inf, -0 as +0) and ties are equal keys,
// broken by lower id as on the CPU:
//   * "Live" tokens are those with p > 0: key >= k_live, found by bisection on one thread. Tokens
//     with p == 0 are never sampled and add no mass, so every step below ignores them.
//   * Top-k: radix select on the keys (11-bit digits, shared-memory count histograms, 2-3 passes)
//     gives the k-th largest key K_k and how many tokens lie above it; the top-k set is every key
//     > K_k plus the first c_k tokens (by id) with key == K_k.
//   * Top-p: the kept prefix of the sorted order is min(P, k), where P is the shortest prefix of
//     the full sorted order whose mass reaches top_p * (mass of the top-k set): every top-k prefix
//     is a prefix of the full order. A radix select over keys >= K_k on mass histograms (double)
//     finds the key K_p where the cumulative mass from the top crosses the target; inside its tie
//     group, j = ceil((target - mass above) / p(K_p)) tokens are needed (at least 1).
//   * The kept set is then "key > K* or (key == K* and id <= T)", where T, the id of the c*-th
//     tie of K* in id order, is found by a hierarchical scan in id order (only when the tie group
//     is cut).
//   * Inverse CDF in ascending id: u = CounterUniform(seed, counter) (bit-identical to the CPU),
//     the first kept token whose cumulative mass exceeds u * (kept mass), found by the same
//     hierarchical scan: each warp sums a contiguous id range, the block scans the warp sums and
//     descends into the range that crosses, until a single block-wide prefix scan decides.
// Sums run in a different order than the CPU's sequential loops, so a token can differ only when
// a cumulative sum lies within rounding (~1e-16 relative) of a boundary.
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kBinBits = 11;
constexpr int kBins = 1 << kBinBits;
constexpr int kBinsPerLane = kBins / 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kMaxVocab = int64_t{1} << 30;

static_assert(kWarps <= 32, "warp-level scans of per-warp values assume at most 32 warps");

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("SampleTokens: ", what));
}

// ---- cpu::CounterUniform, bit for bit --------------------------------------------------------

__host__ __device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__host__ __device__ __forceinline__ float CounterUniform(uint64_t seed, uint64_t counter) {
  const uint64_t z = Mix64(Mix64(seed + 0x9E3779B97F4A7C15ull) ^ (counter * 0xD1B54A32D192ED03ull));
  return static_cast<float>(z >> 40) * 0x1.0p-24f;
}

// ---- keys and probabilities --------------------------------------------------------------------

// Order-preserving key of a logit: a < b as floats <=> Key(a) < Key(b). NaN is -inf (as on the
// CPU) and -0 is +0 (equal probabilities must be equal keys).
__device__ __forceinline__ uint32_t Key(float l) {
  uint32_t b = __float_as_uint(l);
  if ((b & 0x7fffffffu) > 0x7f800000u) b = 0xff800000u;  // NaN -> -inf
  if ((b & 0x7fffffffu) == 0) b = 0;                     // -0 -> +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float KeyValue(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// The CPU's unnormalised probability: exp((double(l) - max) * (1 / double(T))).
__device__ __forceinline__ double Prob(float l, double m, double inv_t) {
  return exp((static_cast<double>(l) - m) * inv_t);
}

// ---- warp and block helpers --------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {  // butterfly: every lane gets the same value
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
__device__ __forceinline__ int WarpMax(int v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
__device__ __forceinline__ int WarpMin(int v) {
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
template <typename T>
__device__ __forceinline__ T WarpInclusiveScan(T v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += y;
  }
  return v;
}

struct Shared {
  int cnt[kBins];
  double mass[kBins];
  double red_d[kWarps];
  float red_f[kWarps];
  int red_i[kWarps];
  int red_j[kWarps];
  // Results broadcast by one thread.
  int sel_found, sel_bin, sel_c_eq, sel_c_above;
  double sel_w_above, sel_target;
  uint32_t k_live;
  int find_warp, find_token;
  double find_carry, find_target;
};

// Block-wide reductions; every thread gets the same value (same summation order everywhere).
__device__ double BlockSum(double v, Shared& sh) {
  v = WarpSum(v);
  if ((threadIdx.x & 31) == 0) sh.red_d[threadIdx.x >> 5] = v;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += sh.red_d[w];
  __syncthreads();
  return total;
}
__device__ int BlockMin(int v, Shared& sh) {
  v = WarpMin(v);
  if ((threadIdx.x & 31) == 0) sh.red_i[threadIdx.x >> 5] = v;
  __syncthreads();
  int r = sh.red_i[0];
  for (int w = 1; w < kWarps; ++w) r = min(r, sh.red_i[w]);
  __syncthreads();
  return r;
}
__device__ int BlockMax(int v, Shared& sh) { return -BlockMin(-v, sh); }
__device__ float BlockMaxF(float v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  if ((threadIdx.x & 31) == 0) sh.red_f[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = sh.red_f[0];
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, sh.red_f[w]);
  __syncthreads();
  return r;
}
// Argmax with the lowest index on ties.
__device__ void BlockArgmax(float& v, int& i, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFullMask, v, o);
    const int oi = __shfl_xor_sync(kFullMask, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
  if ((threadIdx.x & 31) == 0) sh.red_f[threadIdx.x >> 5] = v, sh.red_i[threadIdx.x >> 5] = i;
  __syncthreads();
  v = sh.red_f[0], i = sh.red_i[0];
  for (int w = 1; w < kWarps; ++w) {
    if (sh.red_f[w] > v || (sh.red_f[w] == v && sh.red_i[w] < i)) v = sh.red_f[w], i = sh.red_i[w];
  }
  __syncthreads();
}
// Inclusive prefix sum over the block in thread order; *total gets the block's sum.
__device__ double BlockInclusiveScan(double v, double* total, Shared& sh) {
  v = WarpInclusiveScan(v);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 31) sh.red_d[warp] = v;
  __syncthreads();
  double before = 0.0, all = 0.0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = all;
    all += sh.red_d[w];
  }
  __syncthreads();
  *total = all;
  return before + v;
}

// Calls f(i, logits[i], valid) for every i of the row, each call made by all threads of the block
// together (warp-uniform control flow, so f may use warp collectives; invalid calls pass
// valid = false). 16-byte loads when the row is aligned, two of them in flight per thread.
template <typename F>
__device__ __forceinline__ void ForRow(const float* __restrict__ row, int vocab, F&& f) {
  int done = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    const int n4 = vocab >> 2;
    const float4* r4 = reinterpret_cast<const float4*>(row);
    for (int base = 0; base < n4; base += 2 * kThreads) {
      const int j0 = base + threadIdx.x, j1 = j0 + kThreads;
      const bool v0 = j0 < n4, v1 = j1 < n4;
      const float4 a = v0 ? r4[j0] : make_float4(0.f, 0.f, 0.f, 0.f);
      const float4 b = v1 ? r4[j1] : make_float4(0.f, 0.f, 0.f, 0.f);
      f(4 * j0, a.x, v0), f(4 * j0 + 1, a.y, v0), f(4 * j0 + 2, a.z, v0), f(4 * j0 + 3, a.w, v0);
      f(4 * j1, b.x, v1), f(4 * j1 + 1, b.y, v1), f(4 * j1 + 2, b.z, v1), f(4 * j1 + 3, b.w, v1);
    }
    done = 4 * n4;
  }
  for (int base = done; base < vocab; base += 4 * kThreads) {
    float x[4];
    bool ok[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = base + u * kThreads + static_cast<int>(threadIdx.x);
      ok[u] = i < vocab;
      x[u] = ok[u] ? row[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) f(base + u * kThreads + static_cast<int>(threadIdx.x), x[u], ok[u]);
  }
}

// ---- radix select on keys ----------------------------------------------------------------------

// Adds (1, w) to bin `bin` for the lanes with `in`; called by all lanes of a warp together. When
// every contributing lane hits the same bin (common for concentrated logits), the warp adds once.
__device__ __forceinline__ void HistAdd(bool in, uint32_t bin, double w, bool use_mass, Shared& sh) {
  const unsigned active = __ballot_sync(kFullMask, in);
  if (active == 0) return;
  const int lane = threadIdx.x & 31;
  const int leader = __ffs(active) - 1;
  const uint32_t leader_bin = __shfl_sync(kFullMask, bin, leader);
  if (__all_sync(kFullMask, !in || bin == leader_bin)) {
    if (use_mass) {
      const double s = WarpSum(in ? w : 0.0);
      if (lane == leader) atomicAdd(&sh.mass[leader_bin], s);
    }
    if (lane == leader) atomicAdd(&sh.cnt[leader_bin], __popc(active));
  } else if (in) {
    atomicAdd(&sh.cnt[bin], 1);
    if (use_mass) atomicAdd(&sh.mass[bin], w);
  }
}

struct Selection {
  bool found = false;
  uint32_t key = 0;      // the selected key K
  int c_above = 0;       // tokens with key > K
  int c_eq = 0;          // tokens with key == K
  double w_above = 0.0;  // weight (count or mass) of the tokens with key > K
  double target = 0.0;
};

// Warp 0, after a histogram pass: finds the highest non-empty bin where the cumulative weight from
// the top (starting at w_above) reaches the target. With set_target, target = scale * (sum of
// all bins - sub) first.
__device__ void ScanBins(bool use_mass, bool set_target, double scale, double sub, double target, int c_above,
                         double w_above, Shared& sh) {
  const int lane = threadIdx.x & 31;
  const int top = kBins - 1 - lane * kBinsPerLane;  // this lane's bins: top, top-1, ... (descending keys)
  int cc = 0;
  double cw = 0.0;
  for (int t = 0; t < kBinsPerLane; ++t) {
    const int c = sh.cnt[top - t];
    cc += c;
    cw += use_mass ? sh.mass[top - t] : static_cast<double>(c);
  }
  const int ic = WarpInclusiveScan(cc);
  const double iw = WarpInclusiveScan(cw);
  int ec = __shfl_up_sync(kFullMask, ic, 1);
  double ew = __shfl_up_sync(kFullMask, iw, 1);
  if (lane == 0) ec = 0, ew = 0.0;
  if (set_target) target = scale * (__shfl_sync(kFullMask, iw, 31) - sub);
  const bool cross = cc > 0 && (w_above + ew) + cw >= target;
  const unsigned ballot = __ballot_sync(kFullMask, cross);
  if (ballot == 0) {
    if (lane == 0) sh.sel_found = 0, sh.sel_target = target;
    return;
  }
  if (lane == __ffs(ballot) - 1) {
    double w = w_above + ew;
    int c = c_above + ec;
    int pick = -1, pick_c = 0;
    double pick_w = 0.0;
    for (int t = 0; t < kBinsPerLane; ++t) {  // the crossing bin, else (rounding) the last non-empty one
      const int b = top - t, cb = sh.cnt[b];
      if (cb == 0) continue;
      const double wb = use_mass ? sh.mass[b] : static_cast<double>(cb);
      pick = b, pick_w = w, pick_c = c;
      if (w + wb >= target) break;
      w += wb;
      c += cb;
    }
    sh.sel_found = 1, sh.sel_bin = pick, sh.sel_c_eq = sh.cnt[pick], sh.sel_c_above = pick_c;
    sh.sel_w_above = pick_w, sh.sel_target = target;
  }
}

// Over the tokens with key in [lo, hi] (hi: the row's max key; lo >= k_live), finds the highest
// key K with W(key >= K) >= target, where W counts tokens (use_mass false) or sums p. With
// set_target, the target is scale * (W(all keys in [lo, hi]) - sub), fixed after the first pass.
__device__ Selection BlockSelect(const float* row, int vocab, uint32_t lo, uint32_t hi, bool use_mass,
                                 double target, bool set_target, double scale, double sub, double m,
                                 double inv_t, Shared& sh) {
  Selection r;
  int c_above = 0;
  double w_above = 0.0;
  for (;;) {
    int shift = 0;
    while (((hi - lo) >> shift) >= static_cast<uint32_t>(kBins)) ++shift;
    for (int b = threadIdx.x; b < kBins; b += kThreads) sh.cnt[b] = 0, sh.mass[b] = 0.0;
    __syncthreads();
    ForRow(row, vocab, [&](int, float l, bool valid) {
      const uint32_t key = Key(l);
      const bool in = valid && key >= lo && key <= hi;
      const uint32_t bin = in ? (key - lo) >> shift : 0u;
      const double w = (in && use_mass) ? Prob(l, m, inv_t) : 0.0;
      HistAdd(in, bin, w, use_mass, sh);
    });
    __syncthreads();
    if (threadIdx.x < 32) ScanBins(use_mass, set_target, scale, sub, target, c_above, w_above, sh);
    __syncthreads();
    r.target = target = sh.sel_target;
    set_target = false;
    if (!sh.sel_found) {
      __syncthreads();
      return r;
    }
    const uint32_t b = static_cast<uint32_t>(sh.sel_bin);
    c_above = sh.sel_c_above;
    w_above = sh.sel_w_above;
    const int c_eq = sh.sel_c_eq;
    __syncthreads();  // sh.sel_* are rewritten by the next scan
    const uint32_t new_lo = lo + (b << shift);
    const uint64_t new_hi = static_cast<uint64_t>(new_lo) + (uint64_t{1} << shift) - 1;
    hi = new_hi < hi ? static_cast<uint32_t>(new_hi) : hi;
    lo = new_lo;
    if (shift == 0) {
      r.found = true, r.key = lo, r.c_above = c_above, r.c_eq = c_eq, r.w_above = w_above;
      return r;
    }
  }
}

// ---- first crossing in id order ----------------------------------------------------------------

// Weight of token i: its probability if kept, else 0.
struct KeptMass {
  uint32_t k_star;
  int last_tie;  // ties of k_star with id <= last_tie are kept
  double m, inv_t;
  __device__ double operator()(int i, float l) const {
    const uint32_t key = Key(l);
    return (key > k_star || (key == k_star && i <= last_tie)) ? Prob(l, m, inv_t) : 0.0;
  }
};
// 1 for the tokens whose key is k_star.
struct TieCount {
  uint32_t k_star;
  __device__ double operator()(int, float l) const { return Key(l) == k_star ? 1.0 : 0.0; }
};

// The first token i (ascending id) with val(i) > 0 and target < Σ_{t <= i} val(t); with fraction,
// target = frac_or_target * Σ_all val. Falls back to the last token with val > 0 of the range the
// search ended in when rounding leaves no crossing. Each level splits the range among the warps
// (contiguous id ranges, coalesced), scans the warp sums and descends into the crossing range.
template <typename V>
__device__ int FindFirst(const float* row, int vocab, const V& val, bool fraction, double frac_or_target,
                         Shared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int begin = 0, end = vocab;
  double carry = 0.0, target = frac_or_target;
  for (;;) {
    const int len = end - begin;
    if (len <= kThreads) {  // one token per thread: a block-wide prefix sum decides
      const int i = begin + static_cast<int>(threadIdx.x);
      const bool ok = static_cast<int>(threadIdx.x) < len;
      const double v = ok ? val(i, row[i]) : 0.0;
      double total;
      const double incl = BlockInclusiveScan(v, &total, sh);
      if (fraction) target = frac_or_target * total;
      const bool hit = v > 0.0 && target < carry + incl;
      const int first = BlockMin(hit ? i : INT_MAX, sh);
      return first != INT_MAX ? first : BlockMax(v > 0.0 ? i : -1, sh);
    }
    const int sub = ((len + kWarps - 1) / kWarps + 31) / 32 * 32;
    const int sb = begin + warp * sub;
    const int se = min(end, sb + sub);
    double s = 0.0;
    int last = -1;
    for (int base = sb; base < se; base += 4 * 32) {
      float x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * 32 + lane;
        x[u] = i < se ? row[i] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = base + u * 32 + lane;
        if (i < se) {
          const double v = val(i, x[u]);
          s += v;
          if (v > 0.0) last = i;
        }
      }
    }
    s = WarpSum(s);
    last = WarpMax(last);
    if (lane == 0) sh.red_d[warp] = s, sh.red_j[warp] = last;
    __syncthreads();
    if (warp == 0) {
      const double sw = lane < kWarps ? sh.red_d[lane] : 0.0;
      const int lw = lane < kWarps ? sh.red_j[lane] : -1;
      const double incl = WarpInclusiveScan(sw);
      double excl = __shfl_up_sync(kFullMask, incl, 1);
      if (lane == 0) excl = 0.0;
      const double t = fraction ? frac_or_target * __shfl_sync(kFullMask, incl, 31) : target;
      const unsigned ballot = __ballot_sync(kFullMask, sw > 0.0 && t < carry + (excl + sw));
      const int any_last = WarpMax(lw);
      if (lane == 0) {
        sh.find_target = t;
        sh.find_warp = ballot != 0 ? __ffs(ballot) - 1 : -1;
        sh.find_token = any_last;
      }
      if (ballot != 0 && lane == __ffs(ballot) - 1) sh.find_carry = carry + excl;
    }
    __syncthreads();
    const int w = sh.find_warp, fallback = sh.find_token;
    target = sh.find_target;
    carry = sh.find_carry;
    fraction = false;
    __syncthreads();
    if (w < 0) return fallback;
    begin = begin + w * sub;
    end = min(end, begin + sub);
  }
}

// ---- the kernel --------------------------------------------------------------------------------

// Keys below the returned one have p == 0 (exp underflows); p(k_max) == 1. Run by one thread.
__device__ uint32_t LiveThreshold(uint32_t k_max, double m, double inv_t) {
  uint32_t lo = Key(-INFINITY), hi = k_max;  // p(lo) == 0 (or NaN for T = inf: not live either)
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (Prob(KeyValue(mid), m, inv_t) > 0.0) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return hi;
}

__global__ void __launch_bounds__(kThreads, 2) SampleKernel(SampleParams p) {
  __shared__ Shared sh;
  const int r = blockIdx.x;
  const int vocab = static_cast<int>(p.vocab);
  const float* row = p.logits + static_cast<int64_t>(r) * vocab;

  // Pass 0: argmax and online log-sum-exp over the finite logits.
  float best = -INFINITY, run_max = -INFINITY;
  int best_i = INT_MAX;
  double run_sum = 0.0;
  bool bad = false;  // a NaN or +inf logit: the log-probability is NaN
  ForRow(row, vocab, [&](int i, float l, bool valid) {
    if (!valid) return;
    if (l != l) {
      bad = true;
      l = -INFINITY;
    }
    if (l > best || (l == best && i < best_i)) best = l, best_i = i;
    if (l == INFINITY) {
      bad = true;
    } else if (l > -INFINITY) {
      if (l > run_max) {
        run_sum = run_sum * static_cast<double>(expf(run_max - l)) + 1.0;
        run_max = l;
      } else {
        run_sum += static_cast<double>(expf(l - run_max));
      }
    }
  });
  BlockArgmax(best, best_i, sh);
  const float lse_max = BlockMaxF(run_max, sh);
  const double lse_sum = BlockSum(
      run_max > -INFINITY ? run_sum * exp(static_cast<double>(run_max) - static_cast<double>(lse_max)) : 0.0,
      sh);
  bad = __syncthreads_or(bad) != 0;

  int token = best_i;
  const float temperature = p.temperature[r];
  if (temperature > 0.0f && isfinite(best)) {  // block-uniform
    const double m = static_cast<double>(best);
    const double inv_t = 1.0 / static_cast<double>(temperature);
    const uint32_t k_max = Key(best);
    if (threadIdx.x == 0) sh.k_live = LiveThreshold(k_max, m, inv_t);
    __syncthreads();
    const uint32_t k_live = sh.k_live;
    const int top_k = p.top_k[r];
    const float top_p = p.top_p[r];
    const bool use_k = top_k > 0 && top_k < vocab;
    const bool use_p = top_p < 1.0f;  // NaN: off

    uint32_t k_star = k_live;  // kept: key > k_star, or key == k_star and id <= last_tie
    int last_tie = INT_MAX;
    if (use_k || use_p) {
      Selection sk;
      int c_k = 0;
      if (use_k) {
        sk = BlockSelect(row, vocab, k_live, k_max, false, static_cast<double>(top_k), false, 0.0, 0.0, m,
                         inv_t, sh);
        if (sk.found) c_k = top_k - sk.c_above;
      }
      bool have = false;
      int c_star = 0, c_eq = 0;
      if (use_p) {
        // Mass of the top-k set = mass of keys >= K_k minus the ties of K_k that top-k drops.
        const uint32_t lo = sk.found ? sk.key : k_live;
        const double sub =
            sk.found ? static_cast<double>(sk.c_eq - c_k) * Prob(KeyValue(sk.key), m, inv_t) : 0.0;
        const Selection sp = BlockSelect(row, vocab, lo, k_max, true, 0.0, true, static_cast<double>(top_p),
                                         sub, m, inv_t, sh);
        if (sp.found) {
          const double need = sp.target - sp.w_above;
          int j = 1;
          if (need > 0.0) {
            const double q = ceil(need / Prob(KeyValue(sp.key), m, inv_t));
            j = q >= static_cast<double>(sp.c_eq) ? sp.c_eq : max(1, static_cast<int>(q));
          }
          if (!sk.found || sp.c_above + j <= top_k) {
            k_star = sp.key, c_star = j, c_eq = sp.c_eq, have = true;
          }
        }
      }
      if (!have && sk.found) k_star = sk.key, c_star = c_k, c_eq = sk.c_eq, have = true;
      if (have && c_star < c_eq) {
        last_tie = FindFirst(row, vocab, TieCount{k_star}, false, static_cast<double>(c_star - 1), sh);
      }
    }
    const float u = CounterUniform(p.seed[r], p.counter[r]);
    token = FindFirst(row, vocab, KeptMass{k_star, last_tie, m, inv_t}, true, static_cast<double>(u), sh);
  }

  if (threadIdx.x == 0) {
    p.out_tokens[r] = token;
    float lp = NAN;
    if (!bad && lse_max > -INFINITY) {
      lp = static_cast<float>(static_cast<double>(row[token]) - static_cast<double>(lse_max) - log(lse_sum));
    }
    p.out_logprobs[r] = lp;
  }
}

}  // namespace

// Everything lives in shared memory and registers: no workspace (SampleTokens accepts nullptr).
int64_t SampleWorkspaceBytes(int64_t rows, int64_t vocab) { return 0; }

absl::Status SampleTokens(const SampleParams& p, void* workspace, cudaStream_t stream) {
  if (p.logits == nullptr) return Invalid("logits is null");
  if (p.temperature == nullptr) return Invalid("temperature is null");
  if (p.top_k == nullptr) return Invalid("top_k is null");
  if (p.top_p == nullptr) return Invalid("top_p is null");
  if (p.seed == nullptr) return Invalid("seed is null");
  if (p.counter == nullptr) return Invalid("counter is null");
  if (p.out_tokens == nullptr) return Invalid("out_tokens is null");
  if (p.out_logprobs == nullptr) return Invalid("out_logprobs is null");
  if (p.rows <= 0 || p.rows > INT_MAX)
    return Invalid(absl::StrCat("rows must be in [1, 2^31), got ", p.rows));
  if (p.vocab <= 0 || p.vocab > kMaxVocab) {
    return Invalid(absl::StrCat("vocab must be in [1, ", kMaxVocab, "], got ", p.vocab));
  }
  SampleKernel<<<static_cast<unsigned>(p.rows), kThreads, 0, stream>>>(p);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
