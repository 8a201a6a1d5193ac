// Prefill-chunk attention on Hopper's warpgroup MMA (wgmma), for head_dim 128: the kernel
// PrefillAttention picks on an sm_90 device for chunks of more than 64 rows (see ops.h for the
// contract; kernels/cuda/prefill_attention.cu holds the mma.sync kernel it shares the semantics
// and the tile order with). This file is compiled for sm_90a only (kernels/CMakeLists.txt).
//
// Work: one CTA per (request, tile of 128 query rows, query head) with three warpgroups: a
// producer and two consumers, consumer w owning rows 64w .. 64w+63 of the tile (FlashAttention-3's
// warp specialization). Key tiles of 128 keys are visited from the last visible one down to 0.
//
// The producer (64 registers per thread, setmaxnreg) gathers the Q tile and then K and V tiles
// through the slot table with 16-byte cp.async into a ring of kStages stages (rows past the
// visible range or with a slot outside [0, num_slots) read zeros); each load's completion is
// an arrival on an mbarrier of its stage (Q, K and V apart, so that Q·Kᵀ can start before V has
// landed). A stage's K (V) tile is loaded again once both consumers are done with the one before
// ("free" mbarriers, K and V apart: a K tile is free once its Q·Kᵀ is done, before the P·V that
// reads the V tile beside it). No CTA-wide barrier after the set-up: the consumers (216 registers)
// meet only at their turns (below). The producer's instructions are what bounds the kernel (with
// its copies left out, the consumers alone ran at 74-88% of the GEMM rate on an H200): each copy
// is the plain 16-byte cp.async (a row without a slot reads 16 zero bytes from global memory
// instead of using the zero-filling form) and each slot is read once for K and V, which together
// took 16K-token chunks from 430 to 469 TFLOP/s.
//
// Per key tile and consumer: S (64 × 128, fp32) = Q · Kᵀ with 8 wgmma m64n128k16 (Q and K in
// shared memory, both K-major); the causal mask and the online softmax in registers (log2
// domain, as in the mma.sync kernel); P rounded to bf16 in registers becomes the A operand of
// O (64 × 128, fp32) += P · V, 8 wgmma with V in shared memory read MN-major (transposed). Shared
// tiles use the 128-byte swizzle of kernels/cuda/wgmma.cuh. Two overlaps keep the tensor cores
// busy during the softmax (FlashAttention-3's): within a consumer, tile i's Q·Kᵀ is issued
// together with tile i-1's P·V (O rescaled for tile i-1 between the two issues, under the Q·Kᵀ),
// so the softmax of tile i runs while that P·V does; between the consumers, named barriers make
// them issue their MMAs in turns, so one's softmax runs under the other's MMAs. Both consumers run
// every key tile of the CTA (one fully masked for a consumer's rows gives it zero probabilities),
// as the turns need.
//
// Each consumer's output goes back through its own rows of the Q tile in shared memory for 16-byte
// stores.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/prefill_attention_launch.h"
#include "kernels/cuda/prefill_attention_sm90.h"
#include "kernels/cuda/wgmma.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockM = 128;                // query rows per CTA (two warpgroups of 64)
constexpr int kBlockN = 128;                // keys per tile
constexpr int kThreads = 384;               // producer warpgroup, then two consumers
constexpr int kChunks = kHeadDim / 8;       // 16-byte chunks per row
constexpr int kAtomBytes = 128 * 128;       // one swizzle atom (64 columns) of 128 rows
constexpr int kTileBytes = 2 * kAtomBytes;  // 128 rows × 128 columns, bf16
constexpr int kStages = 3;  // K and V tiles in flight (2 was slower: the consumers waited for loads)
// Shared memory: Q, kStages × (K, V) tiles, mbarriers (Q full; K full, V full, K free, V free per
// stage),
// each stage's slots (int32 per tile row), alignment slack: 226.7 KiB of the 227 an SM offers.
constexpr int kSmemBytes =
    (1 + 2 * kStages) * kTileBytes + 8 * (1 + 4 * kStages) + 4 * kStages * kBlockN + 1024;
static_assert(kSmemBytes <= 227 * 1024, "shared memory");
constexpr int kProducerRegs = 64, kConsumerRegs = 216;

// 16 zero bytes in global memory: the source of a K/V row without a slot.
__device__ const uint4 kZero16[1] = {{0u, 0u, 0u, 0u}};

using KernelArgs = PrefillKernelArgs;

// Byte offset of 16-byte chunk `chunk` (0 .. 15) of row `row` (0 .. 127) in a swizzled tile.
__device__ __forceinline__ uint32_t TileOffset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kAtomBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

// ---- consumer steps (one warpgroup; s, o: accumulator fragments, see wgmma.cuh) ----

// S = Q · Kᵀ for the warpgroup's 64 rows (q_rows: their first row in the Q tile), issued.
__device__ __forceinline__ void IssueQK(float (&s)[64], uint32_t q_rows, uint32_t s_k) {
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t koff = (ks >> 2) * kAtomBytes + (ks & 3) * 32;
    WgmmaM64N128K16(s, SwizzledDesc(q_rows + koff, 16, 1024), SwizzledDesc(s_k + koff, 16, 1024),
                    ks > 0 ? 1 : 0);
  }
}

// O += P · V, issued: P's k16 slice ks is keys 16ks .. 16ks+15, rows 16ks.. of the V tile (two
// groups of 8); its columns (head_dim) run over the tile's two atoms, kAtomBytes apart.
__device__ __forceinline__ void IssuePV(float (&o)[64], const uint32_t (&pa)[kBlockN / 16][4], uint32_t s_v) {
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
    WgmmaM64N128K16RegA(o, pa[ks], SwizzledDesc(s_v + ks * 16 * 128, kAtomBytes, 1024), 1);
  }
}

// Masks keys past each row's limit: causal, row r of the warp (its first row's limit
// first_limit) sees keys up to first_limit + r; not causal, every row sees up to first_limit.
template <bool kCausal>
__device__ __forceinline__ void MaskTile(float (&s)[64], int n0, int first_limit, int g, int c) {
  if (n0 + kBlockN - 1 <= first_limit) return;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int limit = kCausal ? first_limit + g + (e >= 2 ? 8 : 0) : first_limit;
      if (n0 + j * 8 + 2 * c + (e & 1) > limit) s[4 * j + e] = -INFINITY;
    }
  }
}

// Online softmax over one tile (log2 domain): s becomes the probabilities against the new running
// maximum, alpha the factor that rescales what was accumulated before. A row with no visible key
// so far keeps m = -inf.
__device__ __forceinline__ void SoftmaxTile(float (&s)[64], float (&m_run)[2], float (&l_run)[2],
                                            float (&alpha)[2], float scale_log2) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[hr], mx);
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    alpha[hr] = Exp2((m_run[hr] - m_use) * scale_log2);
    const float mb = m_use * scale_log2;
    m_run[hr] = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = Exp2(fmaf(s[4 * j + 2 * hr + e], scale_log2, -mb));
        s[4 * j + 2 * hr + e] = p;
        sum += p;
      }
    }
    l_run[hr] = l_run[hr] * alpha[hr] + sum;
  }
}

__device__ __forceinline__ void Rescale(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[4 * j + e] *= alpha[e >> 1];
  }
}

// P (bf16) as the A fragments of P · V: slice ks is S's column blocks 2ks and 2ks+1.
__device__ __forceinline__ void PackP(const float (&s)[64], uint32_t (&pa)[kBlockN / 16][4]) {
#pragma unroll
  for (int ks = 0; ks < kBlockN / 16; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[ks][r] = PackBf16(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
  }
}

template <bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) PrefillAttentionSm90Kernel(const KernelArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = (SmemAddr(smem) + 1023u) & ~1023u;
  const uint32_t s_k0 = s_q + kTileBytes;
  const uint32_t s_v0 = s_k0 + kStages * kTileBytes;
  const uint32_t bar_q = s_v0 + kStages * kTileBytes;
  auto bar_k = [&](int s) { return bar_q + 8 * (1 + s); };
  auto bar_v = [&](int s) { return bar_q + 8 * (1 + kStages + s); };
  auto bar_k_free = [&](int s) { return bar_q + 8 * (1 + 2 * kStages + s); };
  auto bar_v_free = [&](int s) { return bar_q + 8 * (1 + 3 * kStages + s); };
  const uint32_t s_slots0 = bar_q + 8 * (1 + 4 * kStages);  // kStages × kBlockN int32

  const int head = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.num_heads));
  const int req = static_cast<int>(blockIdx.x / static_cast<unsigned>(a.num_heads));
  const int m_tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q_start = a.q_indptr[req];
  const int q_len = a.q_indptr[req + 1] - q_start;
  const int m0 = m_tile * kBlockM;
  if (m0 >= q_len) return;
  const int kv_start = a.kv_indptr[req];
  const int kv_len = a.kv_indptr[req + 1] - kv_start;
  const int rows = min(kBlockM, q_len - m0);
  const int base_limit = kCausal ? kv_len - q_len + m0 : kv_len - 1;
  const int n_end = kCausal ? base_limit + rows : kv_len;
  const int n_tiles = n_end > 0 ? (n_end + kBlockN - 1) / kBlockN : 0;
  const int kv_head = head / (a.num_heads / a.num_kv_heads);

  const int tid = static_cast<int>(threadIdx.x);
  const int wg = tid / 128;
  const int64_t q_row_stride = static_cast<int64_t>(a.num_heads) * kHeadDim;
  const int64_t kv_row_stride = static_cast<int64_t>(a.num_kv_heads) * kHeadDim;

  if (tid == 0) {
    MbarInit(bar_q, 128);  // the producer's threads, one cp.async arrival each
    for (int s = 0; s < kStages; ++s) {
      MbarInit(bar_k(s), 128);
      MbarInit(bar_v(s), 128);
      MbarInit(bar_k_free(s), 8);  // the consumers' warps
      MbarInit(bar_v_free(s), 8);
    }
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: thread p loads chunk p % 16 of rows p / 16 + 8 i ----
    SetMaxRegsDec<kProducerRegs>();
    const int p = tid, chunk = p % kChunks;
    const bf16* q_base =
        a.q + (static_cast<int64_t>(q_start) + m0) * q_row_stride + static_cast<int64_t>(head) * kHeadDim;
#pragma unroll 4
    for (int i = 0; i < kBlockM * kChunks / 128; ++i) {
      const int row = i * (128 / kChunks) + p / kChunks;
      const bool valid = row < rows;
      CpAsync16(s_q + TileOffset(row, chunk), valid ? q_base + row * q_row_stride + chunk * 8 : a.q, valid);
    }
    MbarArriveOnCpAsync(bar_q);
    // Thread p fetches the slot of row p of the next tile one tile ahead (-1: outside the visible
    // range or the cache; zero-filled) and publishes it in the stage's slot array.
    const int32_t* slots = a.kv_slots + kv_start;
    auto slot_of = [&](int t) -> int32_t {
      const int j = t * kBlockN + p;
      if (j >= n_end) return -1;
      const int32_t slot = slots[j];
      return slot < 0 || slot >= a.num_slots ? -1 : slot;
    };
    int32_t next_slot = n_tiles > 0 ? slot_of(n_tiles - 1) : -1;
    const int64_t col = static_cast<int64_t>(kv_head) * kHeadDim + chunk * 8;
    const uint32_t row_off = TileOffset(p / kChunks, chunk);
    const bf16* zero16 = reinterpret_cast<const bf16*>(kZero16);
    for (int it = 0; it < n_tiles; ++it) {
      const int stage = it % kStages;
      const uint32_t free_parity = static_cast<uint32_t>((it / kStages - 1) & 1);
      if (it >= kStages) MbarWait(bar_k_free(stage), free_parity);
      const int t = n_tiles - 1 - it;
      const uint32_t s_k = s_k0 + stage * kTileBytes, s_v = s_v0 + stage * kTileBytes;
      const uint32_t s_slots = s_slots0 + stage * 4 * kBlockN;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_slots + 4 * p), "r"(next_slot) : "memory");
      NamedBarrier<3>(128);  // the producer's threads: the stage's slots are published
      if (t > 0) next_slot = slot_of(t - 1);
      // Row p / 16 + 8i of a tile: its chunk `chunk` sits at row_off + 1024 i (the swizzle depends
      // on the row modulo 8 only). A row without a slot reads 16 zero bytes instead (kZero16), so
      // every copy is the plain 16-byte cp.async.
      int32_t slot_r[kBlockN * kChunks / 128];
#pragma unroll
      for (int i = 0; i < kBlockN * kChunks / 128; ++i) {
        asm volatile("ld.shared.b32 %0, [%1];\n"
                     : "=r"(slot_r[i])
                     : "r"(s_slots + 4 * (i * (128 / kChunks) + p / kChunks))
                     : "memory");
        const bf16* src = slot_r[i] < 0 ? zero16 : a.k_cache + (slot_r[i] * kv_row_stride + col);
        CpAsync16(s_k + row_off + 1024 * i, src);
      }
      MbarArriveOnCpAsync(bar_k(stage));
      if (it >= kStages) MbarWait(bar_v_free(stage), free_parity);
#pragma unroll
      for (int i = 0; i < kBlockN * kChunks / 128; ++i) {
        const bf16* src = slot_r[i] < 0 ? zero16 : a.v_cache + (slot_r[i] * kv_row_stride + col);
        CpAsync16(s_v + row_off + 1024 * i, src);
      }
      MbarArriveOnCpAsync(bar_v(stage));
    }
    CpAsyncWait<0>();  // nothing in flight when the thread ends
    return;
  }

  // ---- consumers ----
  SetMaxRegsInc<kConsumerRegs>();
  const int cwg = wg - 1;
  const int ctid = tid - 128 * wg;  // thread index within the consumer warpgroup
  const int warp = ctid / 32, lane = tid % 32;
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  const int g = lane / 4, c = lane % 4;
  const int wg_row0 = cwg * 64;               // first local row of this warpgroup
  const int warp_row0 = wg_row0 + warp * 16;  // ... and of this warp
  const int warp_first_limit = kCausal ? base_limit + warp_row0 : base_limit;

  MbarWait(bar_q, 0);
  const uint32_t q_rows = s_q + wg_row0 * 128;
  float s[64], alpha[2];
  uint32_t pa[kBlockN / 16][4];
  if (n_tiles > 0) {
    // Both warpgroups run every tile of the CTA's range (a tile fully masked for one of them
    // gives it zero probabilities). Their MMAs take turns (named barriers 4 and 5: a warpgroup
    // issues when the other has issued), so that one's softmax runs under the other's MMAs; within
    // a warpgroup, tile it's Q·Kᵀ is issued with tile it-1's P·V, whose softmax is done.
    auto turn_begin = [&] {
      if (cwg == 0) {
        NamedBarrier<4>(256);
      } else {
        NamedBarrier<5>(256);
      }
    };
    auto turn_end = [&] {
      if (cwg == 0) {
        NamedBarrierArrive<5>(256);
      } else {
        NamedBarrierArrive<4>(256);
      }
    };
    auto release = [&](uint32_t bar) {  // this warp is done with a K or V tile
      __syncwarp();
      if (lane == 0) MbarArrive(bar);
    };
    if (cwg == 1) NamedBarrierArrive<4>(256);  // warpgroup 0 goes first
    MbarWait(bar_k(0), 0);
    FenceProxyAsync();
    turn_begin();
    WgmmaFence();
    IssueQK(s, q_rows, s_k0);
    WgmmaCommit();
    turn_end();
    WgmmaWait<0>();
    FenceRegs(s);
    release(bar_k_free(0));
    MaskTile<kCausal>(s, (n_tiles - 1) * kBlockN, warp_first_limit, g, c);
    SoftmaxTile(s, m_run, l_run, alpha, a.scale_log2);
    PackP(s, pa);
    for (int it = 1; it < n_tiles; ++it) {
      const int stage = it % kStages, prev = (it - 1) % kStages;
      MbarWait(bar_k(stage), static_cast<uint32_t>((it / kStages) & 1));
      MbarWait(bar_v(prev), static_cast<uint32_t>(((it - 1) / kStages) & 1));
      FenceProxyAsync();
      turn_begin();
      FenceRegs(o);
      WgmmaFence();
      IssueQK(s, q_rows, s_k0 + stage * kTileBytes);
      WgmmaCommit();
      Rescale(o, alpha);  // tile it-1's factor, under the Q·Kᵀ
      WgmmaFence();
      IssuePV(o, pa, s_v0 + prev * kTileBytes);
      WgmmaCommit();
      turn_end();
      WgmmaWait<1>();  // Q·Kᵀ of tile it is done; P·V of it-1 may still run
      FenceRegs(s);
      release(bar_k_free(stage));
      MaskTile<kCausal>(s, (n_tiles - 1 - it) * kBlockN, warp_first_limit, g, c);
      SoftmaxTile(s, m_run, l_run, alpha, a.scale_log2);
      WgmmaWait<0>();
      FenceRegs(o);
#pragma unroll
      for (int ks = 0; ks < kBlockN / 16; ++ks) FenceRegs(pa[ks]);
      release(bar_v_free(prev));
      PackP(s, pa);
    }
    const int last = (n_tiles - 1) % kStages;
    MbarWait(bar_v(last), static_cast<uint32_t>(((n_tiles - 1) / kStages) & 1));
    FenceProxyAsync();
    turn_begin();
    FenceRegs(o);
    Rescale(o, alpha);
    WgmmaFence();
    IssuePV(o, pa, s_v0 + last * kTileBytes);
    WgmmaCommit();
    turn_end();
    WgmmaWait<0>();
    FenceRegs(o);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) FenceRegs(pa[ks]);
    release(bar_v_free(last));
  }

  // ---- epilogue: normalise, stage this warpgroup's rows in its own (dead) Q rows, store ----
  const int64_t out_row0 = static_cast<int64_t>(q_start) + m0;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float l = l_run[hr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int row = warp_row0 + g + 8 * hr;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const uint32_t v = PackBf16(o[4 * j + 2 * hr] * inv, o[4 * j + 2 * hr + 1] * inv);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(s_q + TileOffset(row, j) + c * 4), "r"(v) : "memory");
    }
    if (a.lse != nullptr && c == 0 && row < rows) {
      a.lse[(out_row0 + row) * a.num_heads + head] = l > 0.0f ? m_run[hr] * a.scale + logf(l) : -INFINITY;
    }
  }
  // This warpgroup's rows are staged (barrier ids must be constants).
  if (cwg == 0) {
    NamedBarrier<1>(128);
  } else {
    NamedBarrier<2>(128);
  }
  bf16* out_base = a.out + out_row0 * q_row_stride + static_cast<int64_t>(head) * kHeadDim;
  const int chunk = ctid % kChunks;
#pragma unroll
  for (int i = 0; i < 64 * kChunks / 128; ++i) {
    const int row = wg_row0 + i * (128 / kChunks) + ctid / kChunks;
    if (row < rows) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(s_q + TileOffset(row, chunk))
                   : "memory");
      *reinterpret_cast<uint4*>(out_base + row * q_row_stride + chunk * 8) = v;
    }
  }
#else
  __trap();  // never launched: PrefillAttentionSm90Supported() is false without sm_90a code
#endif
}

template <bool kCausal>
bool KernelHasCode() {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, &PrefillAttentionSm90Kernel<kCausal>) != cudaSuccess) {
    (void)cudaGetLastError();  // no image for this device: not sticky, cleared
    return false;
  }
  return attr.binaryVersion == 90;
}

}  // namespace

bool PrefillAttentionSm90Supported(const AttentionParams& p) {
  if (p.head_dim != kHeadDim || p.max_q_len <= 64) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (major != 9 || minor != 0) return false;
  static const bool has_code = KernelHasCode<true>() && KernelHasCode<false>();
  return has_code;
}

absl::Status PrefillAttentionSm90(const AttentionParams& p, cudaStream_t stream) {
  ASSIGN_OR_RETURN(const dim3 grid, PrefillGrid(p, kBlockM));
  const KernelArgs args = MakePrefillKernelArgs(p);
  auto* kernel = p.causal ? &PrefillAttentionSm90Kernel<true> : &PrefillAttentionSm90Kernel<false>;
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
