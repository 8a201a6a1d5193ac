// Prefill-chunk attention on Hopper's warpgroup MMA (wgmma), for head_dim 128: the kernel
// PrefillAttention picks on an sm_90 device for chunks of more than 64 rows (see ops.h for the
// contract; kernels/cuda/prefill_attention.cu holds the mma.sync kernel it shares the semantics
// and the tile order with). This file is compiled for sm_90a only (kernels/CMakeLists.txt).
//
// Work: one CTA of two warpgroups per (request, tile of 128 query rows, query head); warpgroup w
// owns rows 64w .. 64w+63 of the tile. Key tiles of 128 keys are visited from the last visible
// one down to 0. Every thread gathers its share of the next K and V tiles through the slot table
// with 16-byte cp.async into the other of two stages while the current tile is used (rows past
// the visible range or with a slot outside [0, num_slots) are zero-filled), so one barrier per
// tile orders loads and use.
//
// Per key tile and warpgroup: S (64 × 128, fp32) = Q · Kᵀ with 8 wgmma m64n128k16 (Q and K in
// shared memory, both K-major); the causal mask and the online softmax in registers (log2
// domain, as in the mma.sync kernel); P rounded to bf16 in registers becomes the A operand of
// O (64 × 128, fp32) += P · V, 8 wgmma with V in shared memory read MN-major (transposed). Shared
// tiles use the 128-byte swizzle of kernels/cuda/wgmma.cuh. The two warpgroups interleave on
// the SM: one's softmax runs while the other's MMAs do.
//
// The output goes back through shared memory (the Q tile's space) for 16-byte stores.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/prefill_attention_sm90.h"
#include "kernels/cuda/wgmma.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kHeadDim = 128;
constexpr int kBlockM = 128;  // query rows per CTA (two warpgroups of 64)
constexpr int kBlockN = 128;  // keys per tile
constexpr int kThreads = 256;
constexpr int kChunks = kHeadDim / 8;              // 16-byte chunks per row
constexpr int kAtomBytes = 128 * 128;              // one swizzle atom (64 columns) of 128 rows
constexpr int kTileBytes = 2 * kAtomBytes;         // 128 rows × 128 columns, bf16
constexpr int kSmemBytes = 5 * kTileBytes + 1024;  // Q, 2 × K, 2 × V, alignment slack

struct KernelArgs {
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  bf16* out;
  float* lse;
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_slots;
  int64_t num_slots;
  int num_heads, num_kv_heads;
  float scale, scale_log2;
};

// Byte offset of 16-byte chunk `chunk` (0 .. 15) of row `row` (0 .. 127) in a swizzled tile.
__device__ __forceinline__ uint32_t TileOffset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kAtomBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

template <bool kCausal>
__global__ void __launch_bounds__(kThreads, 1) PrefillAttentionSm90Kernel(const KernelArgs a) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = (SmemAddr(smem) + 1023u) & ~1023u;
  const uint32_t s_k0 = s_q + kTileBytes;
  const uint32_t s_v0 = s_k0 + 2 * kTileBytes;

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
  const int warp = (tid % 128) / 32, lane = tid % 32;
  const int64_t q_row_stride = static_cast<int64_t>(a.num_heads) * kHeadDim;
  const int64_t kv_row_stride = static_cast<int64_t>(a.num_kv_heads) * kHeadDim;

  // ---- Q tile (rows past q_len zero-filled): thread tid loads chunk tid % 16 of 8 rows ----
  const int my_chunk = tid % kChunks;
  {
    const bf16* q_base =
        a.q + (static_cast<int64_t>(q_start) + m0) * q_row_stride + static_cast<int64_t>(head) * kHeadDim;
#pragma unroll
    for (int i = 0; i < kBlockM * kChunks / kThreads; ++i) {
      const int row = i * (kThreads / kChunks) + tid / kChunks;
      const bool valid = row < rows;
      const bf16* src = valid ? q_base + row * q_row_stride + my_chunk * 8 : a.q;
      CpAsync16(s_q + TileOffset(row, my_chunk), src, valid);
    }
  }

  // ---- K/V gathering: thread tid loads chunk tid % 16 of rows tid / 16 + 16 i ----
  const int32_t* slots = a.kv_slots + kv_start;
  auto issue_tile = [&](int t, uint32_t s_k, uint32_t s_v) {
#pragma unroll
    for (int i = 0; i < kBlockN * kChunks / kThreads; ++i) {
      const int row = i * (kThreads / kChunks) + tid / kChunks;
      const int j = t * kBlockN + row;
      int64_t slot = -1;
      if (j < n_end) {
        slot = slots[j];
        if (slot < 0 || slot >= a.num_slots) slot = -1;  // outside the cache: zero-filled
      }
      const bool valid = slot >= 0;
      const int64_t off = slot * kv_row_stride + kv_head * kHeadDim + my_chunk * 8;
      CpAsync16(s_k + TileOffset(row, my_chunk), valid ? a.k_cache + off : a.k_cache, valid);
      CpAsync16(s_v + TileOffset(row, my_chunk), valid ? a.v_cache + off : a.v_cache, valid);
    }
  };
  if (n_tiles > 0) issue_tile(n_tiles - 1, s_k0, s_v0);
  CpAsyncCommit();

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  const int g = lane / 4, c = lane % 4;
  const int wg_row0 = wg * 64;                // first local row of this warpgroup
  const int warp_row0 = wg_row0 + warp * 16;  // ... and of this warp
  const int wg_last_limit = kCausal ? base_limit + wg_row0 + 63 : base_limit;
  const int warp_first_limit = kCausal ? base_limit + warp_row0 : base_limit;
  const bool wg_has_rows = wg_row0 < rows;

  for (int it = 0; it < n_tiles; ++it) {
    const int t = n_tiles - 1 - it;
    const int n0 = t * kBlockN;
    const int stage = it & 1;
    const uint32_t s_k = s_k0 + stage * kTileBytes;
    const uint32_t s_v = s_v0 + stage * kTileBytes;

    CpAsyncWait<0>();   // Q (first time), K(t) and V(t) have landed ...
    FenceProxyAsync();  // ... and are visible to wgmma
    __syncthreads();    // for every thread; and every warpgroup is done with the other stage
    if (it + 1 < n_tiles) issue_tile(t - 1, s_k0 + (stage ^ 1) * kTileBytes, s_v0 + (stage ^ 1) * kTileBytes);
    CpAsyncCommit();

    // A warpgroup whose rows see no key of this tile, or that holds only padding rows, skips it
    // (the condition is uniform over the warpgroup, as wgmma needs).
    if (!wg_has_rows || n0 > wg_last_limit) continue;

    // S = Q · Kᵀ
    float s[64];
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      const uint32_t koff = (ks >> 2) * kAtomBytes + (ks & 3) * 32;
      const uint64_t da = SwizzledDesc(s_q + wg_row0 * 128 + koff, 16, 1024);
      const uint64_t db = SwizzledDesc(s_k + koff, 16, 1024);
      WgmmaM64N128K16(s, da, db, ks > 0 ? 1 : 0);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegs(s);

    // Mask: keys past a row's limit (causal), or past kv_len (the last tile, non-causal).
    if (n0 + kBlockN - 1 > warp_first_limit) {
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int limit = kCausal ? warp_first_limit + g + (e >= 2 ? 8 : 0) : warp_first_limit;
          const int key = n0 + j * 8 + 2 * c + (e & 1);
          if (key > limit) s[4 * j + e] = -INFINITY;
        }
      }
    }
    // Online softmax (log2 domain); a row with no visible key so far keeps m = -inf.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * hr], s[4 * j + 2 * hr + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[hr], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = Exp2((m_run[hr] - m_use) * a.scale_log2);
      const float mb = m_use * a.scale_log2;
      m_run[hr] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = Exp2(fmaf(s[4 * j + 2 * hr + e], a.scale_log2, -mb));
          s[4 * j + 2 * hr + e] = p;
          sum += p;
        }
      }
      l_run[hr] = l_run[hr] * alpha + sum;
#pragma unroll
      for (int j = 0; j < kHeadDim / 8; ++j) {
        o[4 * j + 2 * hr] *= alpha;
        o[4 * j + 2 * hr + 1] *= alpha;
      }
    }

    // O += P · V: P's k16 slice ks is columns 16ks .. 16ks+15 of S, i.e. its blocks 2ks, 2ks+1.
    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      pa[ks][0] = PackBf16(s[8 * ks + 0], s[8 * ks + 1]);
      pa[ks][1] = PackBf16(s[8 * ks + 2], s[8 * ks + 3]);
      pa[ks][2] = PackBf16(s[8 * ks + 4], s[8 * ks + 5]);
      pa[ks][3] = PackBf16(s[8 * ks + 6], s[8 * ks + 7]);
    }
    FenceRegs(o);
    WgmmaFence();
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      // Keys 16ks .. 16ks+15 are rows 16ks.. of the V tile (2 groups of 8); columns (head_dim)
      // run over its two atoms, kAtomBytes apart.
      WgmmaM64N128K16RegA(o, pa[ks], SwizzledDesc(s_v + ks * 16 * 128, kAtomBytes, 1024), 1);
    }
    WgmmaCommit();
    WgmmaWait<0>();
    FenceRegs(o);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) FenceRegs(pa[ks]);
  }

  // ---- epilogue: normalise, stage the rows in the (dead) Q tile, store 16 bytes each ----
  CpAsyncWait<0>();
  __syncthreads();  // every warpgroup's last MMA has read Q
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
  __syncthreads();
  bf16* out_base = a.out + out_row0 * q_row_stride + static_cast<int64_t>(head) * kHeadDim;
#pragma unroll
  for (int i = 0; i < kBlockM * kChunks / kThreads; ++i) {
    const int row = i * (kThreads / kChunks) + tid / kChunks;
    if (row < rows) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(s_q + TileOffset(row, my_chunk))
                   : "memory");
      *reinterpret_cast<uint4*>(out_base + row * q_row_stride + my_chunk * 8) = v;
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
  const int64_t m_tiles = (p.max_q_len + kBlockM - 1) / kBlockM;
  if (m_tiles > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("PrefillAttention: max_q_len ", p.max_q_len,
                                                   " needs more than 65535 tiles of ", kBlockM, " rows"));
  }
  const int64_t ctas_x = p.num_heads * p.num_requests;
  if (ctas_x > 0x7fffffff) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefillAttention: num_heads * num_requests = ", ctas_x, " exceeds the grid limit"));
  }
  KernelArgs args;
  args.q = p.q;
  args.k_cache = p.k_cache;
  args.v_cache = p.v_cache;
  args.out = p.out;
  args.lse = p.lse;
  args.q_indptr = p.q_indptr;
  args.kv_indptr = p.kv_indptr;
  args.kv_slots = p.kv_slots;
  args.num_slots = p.num_slots;
  args.num_heads = static_cast<int>(p.num_heads);
  args.num_kv_heads = static_cast<int>(p.num_kv_heads);
  args.scale = p.scale;
  args.scale_log2 = p.scale * 1.4426950408889634f;
  auto* kernel = p.causal ? &PrefillAttentionSm90Kernel<true> : &PrefillAttentionSm90Kernel<false>;
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const dim3 grid(static_cast<unsigned>(ctas_x), static_cast<unsigned>(m_tiles));
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
