// Prefill-chunk attention on tensor cores, FlashAttention-2 style (see ops.h for the contract).
//
// Work: one CTA per (request, tile of kBlockM query rows, query head); the grid is sized from the
// host bounds (max_q_len, num_requests) and CTAs whose tile lies past their request's q_len exit
// at once. Tile indices run in reverse launch order so that the heaviest (last, causal) tiles start
// first. Each warp owns 16·kMAtoms query rows.
//
// Per CTA, key tiles of kBlockN keys are visited from the last visible one down to 0 (the tiles
// that need the causal mask come first). K and V tiles are gathered row by row through the slot
// table into shared memory with 16-byte cp.async (rows past the visible range or with a slot
// outside [0, num_slots) are zero-filled), double-buffered: tile t-1 loads while tile t is used.
// S = Q·Kᵀ and O += P·V use mma.sync m16n8k16 bf16 with fp32 accumulation, operands read with
// ldmatrix from XOR-swizzled tiles (conflict-free); the online softmax runs in fp32 registers
// in the log2 domain; P is rounded to bf16 for P·V while the row sums use the fp32 values.
// The output tile goes back through shared memory for 16-byte stores.
//
// Causal or not (AttentionParams::causal) is a template parameter, so the causal kernel is the
// same code as before the flag existed. Both are one rule, "local row i sees keys 0 .. limit(i)":
// causal limit(i) = kv_len - q_len + m0 + i, non-causal limit(i) = kv_len - 1 for every row. The
// non-causal kernel thus visits all ceil(kv_len / kBlockN) key tiles for every tile of rows
// (whatever q_len is), and only the last key tile, where it extends past kv_len, is masked: its
// zero-filled rows past kv_len would otherwise score 0 instead of -inf.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/prefill_attention_launch.h"
#include "kernels/cuda/prefill_attention_sm90.h"

namespace tandem::kernels::cuda {
namespace {

template <int kHeadDim_, int kWarps_, int kMAtoms_, int kBlockN_>
struct PrefillConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kMAtoms = kMAtoms_;  // 16-row MMA atoms per warp
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = 16 * kMAtoms;
  static constexpr int kBlockM = kWarps * kRowsPerWarp;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;
  static constexpr int kSmemBytes = kQBytes + 4 * kKvBytes;  // Q + 2 stages of K and of V
  // K/V tile loading: each warp gathers kLoadRows rows, kRowsPerPass rows per instruction.
  static constexpr int kLoadRows = kBlockN / kWarps;
  static constexpr int kRowsPerPass = 32 / kChunks;
  static constexpr int kPasses = kLoadRows / kRowsPerPass;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head_dim");
  static_assert(kBlockN % 16 == 0 && kBlockN % kWarps == 0, "kBlockN");
  static_assert(kLoadRows <= 32 && kLoadRows % kRowsPerPass == 0, "K/V load mapping");
};

using KernelArgs = PrefillKernelArgs;

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile with kChunks chunks per row. The low
// three bits of the chunk index are XORed with the row, so the 8 rows read by one ldmatrix phase
// (or written by one 16-byte store phase) hit 8 distinct bank groups.
template <int kChunks>
__device__ __forceinline__ uint32_t Swizzle(int row, int chunk) {
  return static_cast<uint32_t>((row * kChunks + (chunk ^ (row & 7))) * 16);
}

__device__ __forceinline__ void Ldsm4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <class C, bool kCausal>
__global__ void __launch_bounds__(C::kThreads) PrefillAttentionKernel(const KernelArgs a) {
  constexpr int D = C::kHeadDim, BN = C::kBlockN, MA = C::kMAtoms, CH = C::kChunks;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t s_q = SmemAddr(smem);
  const uint32_t s_k0 = s_q + C::kQBytes;
  const uint32_t s_v0 = s_k0 + 2 * C::kKvBytes;

  const int head = static_cast<int>(blockIdx.x % static_cast<unsigned>(a.num_heads));
  const int req = static_cast<int>(blockIdx.x / static_cast<unsigned>(a.num_heads));
  const int m_tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q_start = a.q_indptr[req];
  const int q_len = a.q_indptr[req + 1] - q_start;
  const int m0 = m_tile * C::kBlockM;
  if (m0 >= q_len) return;
  const int kv_start = a.kv_indptr[req];
  const int kv_len = a.kv_indptr[req + 1] - kv_start;
  const int rows = min(C::kBlockM, q_len - m0);
  // Causal: local row i (query row m0 + i) sees keys 0 .. base_limit + i. Non-causal: every row
  // sees keys 0 .. base_limit = kv_len - 1.
  const int base_limit = kCausal ? kv_len - q_len + m0 : kv_len - 1;
  // Keys [0, n_end) are visible to some row of the tile.
  const int n_end = kCausal ? base_limit + rows : kv_len;
  const int n_tiles = n_end > 0 ? (n_end + BN - 1) / BN : 0;
  const int kv_head = head / (a.num_heads / a.num_kv_heads);

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int64_t q_row_stride = static_cast<int64_t>(a.num_heads) * D;
  const int64_t kv_row_stride = static_cast<int64_t>(a.num_kv_heads) * D;

  // ---- Q tile (rows past q_len zero-filled) ----
  {
    const bf16* q_base =
        a.q + (static_cast<int64_t>(q_start) + m0) * q_row_stride + static_cast<int64_t>(head) * D;
    for (int idx = tid; idx < C::kBlockM * CH; idx += C::kThreads) {
      const int row = idx / CH, chunk = idx % CH;
      const bool valid = row < rows;
      const bf16* src = valid ? q_base + row * q_row_stride + chunk * 8 : a.q;
      CpAsync16(s_q + Swizzle<CH>(row, chunk), src, valid);
    }
    CpAsyncCommit();
  }

  // ---- K/V gathering: lane l of warp w holds the slot of tile row w·kLoadRows + l % kLoadRows ----
  const int32_t* slots = a.kv_slots + kv_start;
  auto load_slot = [&](int t) -> int {
    const int j = t * BN + warp * C::kLoadRows + lane % C::kLoadRows;
    int s = -1;
    if (j < n_end) {
      s = slots[j];
      if (s < 0 || s >= a.num_slots) s = -1;  // outside the cache: zero-filled, never read
    }
    return s;
  };
  const int load_chunk = lane % CH;
  auto issue_tile = [&](const bf16* cache, uint32_t s_dst, int slot_reg) {
#pragma unroll
    for (int p = 0; p < C::kPasses; ++p) {
      const int r = p * C::kRowsPerPass + lane / CH;
      const int slot = __shfl_sync(0xffffffffu, slot_reg, r);
      const bool valid = slot >= 0;
      const bf16* src = valid ? cache + slot * kv_row_stride + kv_head * D + load_chunk * 8 : cache;
      CpAsync16(s_dst + Swizzle<CH>(warp * C::kLoadRows + r, load_chunk), src, valid);
    }
  };

  int slot_reg = 0;
  if (n_tiles > 0) {
    slot_reg = load_slot(n_tiles - 1);
    issue_tile(a.k_cache, s_k0, slot_reg);
    CpAsyncCommit();
    issue_tile(a.v_cache, s_v0, slot_reg);
    CpAsyncCommit();
    if (n_tiles > 1) slot_reg = load_slot(n_tiles - 2);
  }

  float o[MA][D / 8][4];
  float m_run[MA][2], l_run[MA][2];
#pragma unroll
  for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[ma][db][e] = 0.0f;
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      m_run[ma][hr] = -INFINITY;
      l_run[ma][hr] = 0.0f;
    }
  }

  const int g = lane / 4, c = lane % 4;    // MMA fragment coordinates
  const int wr0 = warp * C::kRowsPerWarp;  // first local row of this warp
  // ldmatrix row addresses. Every fragment starts at a row that is a multiple of 8 and at an even
  // chunk, so Swizzle() reduces to a per-lane row offset plus (chunk·16) XOR a per-lane constant:
  //   A operands (Q) and the transposed V reads: lane -> row lane & 15, chunk + (lane >> 4);
  //   B operands (K): lane -> row (lane & 7) + 8·(lane >> 4), chunk + ((lane >> 3) & 1).
  constexpr int kRowBytes = D * 2;
  const int xor_a = (((lane >> 4) ^ (lane & 7)) * 16);
  const int xor_b = ((((lane >> 3) & 1) ^ (lane & 7)) * 16);
  const uint32_t q_frag_base = s_q + (wr0 + (lane & 15)) * kRowBytes;
  const uint32_t k_frag_off = ((lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
  const uint32_t v_frag_off = (lane & 15) * kRowBytes;
  // Key limits of the warp's first and last rows (all rows share base_limit when not causal).
  const int warp_first_limit = kCausal ? base_limit + wr0 : base_limit;
  const int warp_last_limit = kCausal ? warp_first_limit + C::kRowsPerWarp - 1 : base_limit;

  for (int it = 0; it < n_tiles; ++it) {
    const int t = n_tiles - 1 - it;
    const int n0 = t * BN;
    const int stage = it & 1;
    const uint32_t s_k = s_k0 + stage * C::kKvBytes;
    const uint32_t s_v = s_v0 + stage * C::kKvBytes;
    const bool more = it + 1 < n_tiles;

    CpAsyncWait<1>();  // Q and K(t) have landed (V(t) may still be in flight)
    __syncthreads();   // ... for every thread; and everyone is done with tile t+1's buffers
    if (more) {
      issue_tile(a.k_cache, s_k0 + (stage ^ 1) * C::kKvBytes, slot_reg);
      CpAsyncCommit();
      issue_tile(a.v_cache, s_v0 + (stage ^ 1) * C::kKvBytes, slot_reg);
      CpAsyncCommit();
      if (it + 2 < n_tiles) slot_reg = load_slot(t - 2);
    }

    // Warps whose rows see no key of this tile, or that hold only padding rows, skip it.
    const bool active = wr0 < rows && n0 <= warp_last_limit;
    float s[MA][BN / 8][4];
    if (active) {
#pragma unroll
      for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[ma][nb][e] = 0.0f;
        }
      }
      // S = Q · Kᵀ
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t qa[MA][4];
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) {
          Ldsm4(q_frag_base + ma * 16 * kRowBytes + ((ks * 32) ^ xor_a), qa[ma]);
        }
#pragma unroll
        for (int nb2 = 0; nb2 < BN / 16; ++nb2) {
          uint32_t kb[4];
          Ldsm4(s_k + k_frag_off + nb2 * 16 * kRowBytes + ((ks * 32) ^ xor_b), kb);
#pragma unroll
          for (int ma = 0; ma < MA; ++ma) {
            Mma(s[ma][2 * nb2], qa[ma], kb[0], kb[1]);
            Mma(s[ma][2 * nb2 + 1], qa[ma], kb[2], kb[3]);
          }
        }
      }
      // Causal mask, only where some key of the tile is past this warp's first row's limit (not
      // causal: the end of the keys, in the last tile only).
      if (n0 + BN - 1 > warp_first_limit) {
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
          for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int limit =
                  kCausal ? warp_first_limit + ma * 16 + g + (e >= 2 ? 8 : 0) : warp_first_limit;
              const int key = n0 + nb * 8 + 2 * c + (e & 1);
              if (key > limit) s[ma][nb][e] = -INFINITY;
            }
          }
        }
      }
      // Online softmax (log2 domain); a row with no visible key so far keeps m = -inf.
#pragma unroll
      for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int nb = 0; nb < BN / 8; ++nb) mx = fmaxf(mx, fmaxf(s[ma][nb][2 * hr], s[ma][nb][2 * hr + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[ma][hr], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          const float alpha = Exp2((m_run[ma][hr] - m_use) * a.scale_log2);
          const float mb = m_use * a.scale_log2;
          m_run[ma][hr] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nb = 0; nb < BN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = Exp2(fmaf(s[ma][nb][2 * hr + e], a.scale_log2, -mb));
              s[ma][nb][2 * hr + e] = p;
              sum += p;
            }
          }
          l_run[ma][hr] = l_run[ma][hr] * alpha + sum;
#pragma unroll
          for (int db = 0; db < D / 8; ++db) {
            o[ma][db][2 * hr] *= alpha;
            o[ma][db][2 * hr + 1] *= alpha;
          }
        }
      }
    }

    if (more) {
      CpAsyncWait<2>();  // V(t) has landed; K(t-1), V(t-1) may be in flight
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();

    if (active) {
      // O += P · V
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        uint32_t pa[MA][4];
#pragma unroll
        for (int ma = 0; ma < MA; ++ma) {
          pa[ma][0] = PackBf16(s[ma][2 * ks][0], s[ma][2 * ks][1]);
          pa[ma][1] = PackBf16(s[ma][2 * ks][2], s[ma][2 * ks][3]);
          pa[ma][2] = PackBf16(s[ma][2 * ks + 1][0], s[ma][2 * ks + 1][1]);
          pa[ma][3] = PackBf16(s[ma][2 * ks + 1][2], s[ma][2 * ks + 1][3]);
        }
#pragma unroll
        for (int db2 = 0; db2 < D / 16; ++db2) {
          uint32_t vb[4];
          Ldsm4Trans(s_v + v_frag_off + ks * 16 * kRowBytes + ((db2 * 32) ^ xor_a), vb);
#pragma unroll
          for (int ma = 0; ma < MA; ++ma) {
            Mma(o[ma][2 * db2], pa[ma], vb[0], vb[1]);
            Mma(o[ma][2 * db2 + 1], pa[ma], vb[2], vb[3]);
          }
        }
      }
    }
  }

  // ---- epilogue: normalise, stage this warp's rows in its own (dead) Q rows, store 16 B each ----
  CpAsyncWait<0>();  // only the Q group can be in flight here, when n_tiles == 0
  __syncthreads();   // (Q rows are loaded by all threads; each warp now reuses its own)
  const int64_t out_row0 = static_cast<int64_t>(q_start) + m0;
#pragma unroll
  for (int ma = 0; ma < MA; ++ma) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float l = l_run[ma][hr];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = wr0 + ma * 16 + g + 8 * hr;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        const uint32_t v = PackBf16(o[ma][db][2 * hr] * inv, o[ma][db][2 * hr + 1] * inv);
        asm volatile(
            "st.shared.b32 [%0], %1;\n" ::"r"(s_q + row * kRowBytes + ((db * 16) ^ (g * 16)) + c * 4), "r"(v)
            : "memory");
      }
      if (a.lse != nullptr && c == 0 && row < rows) {
        a.lse[(out_row0 + row) * a.num_heads + head] =
            l > 0.0f ? m_run[ma][hr] * a.scale + logf(l) : -INFINITY;
      }
    }
  }
  __syncwarp();
  bf16* out_base = a.out + out_row0 * q_row_stride + static_cast<int64_t>(head) * D;
#pragma unroll
  for (int idx = lane; idx < C::kRowsPerWarp * CH; idx += 32) {
    const int row = wr0 + idx / CH, chunk = idx % CH;
    if (row < rows) {
      uint4 v;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(s_q + Swizzle<CH>(row, chunk))
                   : "memory");
      *reinterpret_cast<uint4*>(out_base + row * q_row_stride + chunk * 8) = v;
    }
  }
}

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("PrefillAttention: ", what));
}

template <class C>
absl::Status Launch(const AttentionParams& p, cudaStream_t stream) {
  ASSIGN_OR_RETURN(const dim3 grid, PrefillGrid(p, C::kBlockM));
  const KernelArgs args = MakePrefillKernelArgs(p);
  auto* kernel = p.causal ? &PrefillAttentionKernel<C, true> : &PrefillAttentionKernel<C, false>;
  // A host-side attribute, not a stream operation: allowed while a graph is being captured.
  CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

// Short chunks (max_q_len <= 64) use 64-row tiles so that fewer rows are padding.
template <int kHeadDim>
absl::Status Dispatch(const AttentionParams& p, cudaStream_t stream) {
  if (p.max_q_len <= 64) return Launch<PrefillConfig<kHeadDim, 4, 1, 64>>(p, stream);
  return Launch<PrefillConfig<kHeadDim, 4, 2, 64>>(p, stream);
}

}  // namespace

absl::Status PrefillAttention(const AttentionParams& p, cudaStream_t stream, PrefillKernel kernel) {
  const std::pair<const char*, const void*> pointers[] = {{"q", p.q},
                                                          {"k_cache", p.k_cache},
                                                          {"v_cache", p.v_cache},
                                                          {"out", p.out},
                                                          {"q_indptr", p.q_indptr},
                                                          {"kv_indptr", p.kv_indptr},
                                                          {"kv_slots", p.kv_slots}};
  for (const auto& pr : pointers) {
    if (pr.second == nullptr) return Invalid(absl::StrCat(pr.first, " is null"));
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_requests", p.num_requests}, {"num_slots", p.num_slots}, {"num_heads", p.num_heads},
      {"num_kv_heads", p.num_kv_heads}, {"head_dim", p.head_dim},   {"max_q_len", p.max_q_len},
      {"max_kv_len", p.max_kv_len}};
  for (const auto& pr : sizes) {
    if (pr.second <= 0) return Invalid(absl::StrCat(pr.first, " must be positive, got ", pr.second));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return Invalid(absl::StrCat("head_dim ", p.head_dim, " is not supported (64 or 128)"));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid(
        absl::StrCat("num_heads ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (p.num_heads > std::numeric_limits<int32_t>::max() ||
      p.max_q_len > std::numeric_limits<int32_t>::max() ||
      p.max_kv_len > std::numeric_limits<int32_t>::max()) {
    return Invalid("num_heads, max_q_len and max_kv_len must fit in int32");
  }
  if (!std::isfinite(p.scale) || !(p.scale > 0.0f)) {
    return Invalid(absl::StrCat("scale must be finite and positive, got ", p.scale));
  }
  const std::pair<const char*, const void*> aligned[] = {
      {"q", p.q}, {"k_cache", p.k_cache}, {"v_cache", p.v_cache}, {"out", p.out}};
  for (const auto& pr : aligned) {
    if (reinterpret_cast<uintptr_t>(pr.second) % 16 != 0) {
      return Invalid(absl::StrCat(pr.first, " must be 16-byte aligned"));
    }
  }
  if (kernel != PrefillKernel::kMmaSync) {
    if (PrefillAttentionSm90Supported(p)) return PrefillAttentionSm90(p, stream);
    if (kernel == PrefillKernel::kWgmma) {
      return absl::FailedPreconditionError(
          "PrefillAttention: the wgmma kernel needs an sm_90 device with sm_90a code in this build, "
          "head_dim 128 and max_q_len > 64");
    }
  }
  if (p.head_dim == 64) return Dispatch<64>(p, stream);
  return Dispatch<128>(p, stream);
}

}  // namespace tandem::kernels::cuda
