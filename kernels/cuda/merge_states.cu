// Cascade-attention helpers (see ops.h): MergeStates (log-sum-exp merge of two partial attention
// states, in place) and GatherRows (packs selected rows). Both are small bandwidth-bound kernels.
//
// Accesses are 16 bytes (8 bf16) wide where the sizes and pointers allow it (head_dim or width
// and the row stride multiples of 8 elements, base pointers 16-byte aligned: every row then
// starts 16-byte aligned), else one element each. The kVec template parameter selects which.
//
// MergeStates: each (pair i, head) is handled by a group of lanes of one warp (the smallest power
// of two >= the chunks of a head row, at most 32; several pairs per warp for short rows), which
// walks the head row's chunks. Every lane of the group reads lse[a] and lse_b[b] itself (one
// broadcast load), and the group's first lane writes lse[a] after a __syncwarp: the merge is in
// place, so without the barrier a lane of the group could still be reading lse[a] when it is
// overwritten. The loop over pairs is warp-uniform (whole warps step together) so that the
// barrier is always reached by all 32 lanes. Distinct rows_a entries (a precondition) keep
// different pairs off each other's rows.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride loops cover the rest

// kVec consecutive bf16 <-> fp32 (kVec = 8: one 16-byte access; 1: one element).
template <int kVec>
__device__ __forceinline__ void LoadF(const bf16* p, float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // bf16 -> fp32 is exact: the bits shifted into the high half
      f[2 * i] = __uint_as_float(words[i] << 16);
      f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
    f[0] = __bfloat162float(*p);
  }
}

template <int kVec>
__device__ __forceinline__ void StoreF(bf16* p, const float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);  // .x in the low half
      words[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  } else {
    *p = __float2bfloat16_rn(f[0]);
  }
}

// Bit copy and zero fill of kVec elements.
template <int kVec>
__device__ __forceinline__ void CopyBits(bf16* dst, const bf16* src) {
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    *dst = *src;
  }
}

template <int kVec>
__device__ __forceinline__ void Zero(bf16* dst) {
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  } else {
    *dst = __float2bfloat16_rn(0.0f);
  }
}

struct MergeArgs {
  bf16* out;
  float* lse;
  const bf16* out_b;
  const float* lse_b;
  const int32_t* rows_a;
  const int32_t* rows_b;
  int64_t num_pairs;  // n · num_heads
  int num_heads, head_dim;
  int chunks;       // head_dim / kVec
  int group_lanes;  // lanes per pair: power of two, >= min(chunks, 32)
  int group_shift;  // log2(group_lanes)
  int b_pack;       // state b's heads stored j-major (see MergeStatesParams::b_pack)
};

template <int kVec>
__global__ void __launch_bounds__(kThreads) MergeStatesKernel(const MergeArgs a) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int sub = lane & (a.group_lanes - 1);  // lane within the pair's group
  const int64_t pairs_per_warp = 32 >> a.group_shift;
  const int64_t warp = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const int64_t num_warps = int64_t{gridDim.x} * kThreads / 32;
  for (int64_t base = warp * pairs_per_warp; base < a.num_pairs; base += num_warps * pairs_per_warp) {
    const int64_t pair = base + (lane >> a.group_shift);
    int64_t ra = -1, rb = -1;
    int h = 0;
    if (pair < a.num_pairs) {
      const int64_t i = pair / a.num_heads;
      h = static_cast<int>(pair % a.num_heads);
      ra = a.rows_a != nullptr ? int64_t{a.rows_a[i]} : i;
      rb = a.rows_b != nullptr ? int64_t{a.rows_b[i]} : i;
    }
    const bool work = ra >= 0 && rb >= 0;  // a negative row (or past the end) skips the pair
    float la = 0.0f, lb = 0.0f, new_lse = 0.0f;
    bool write_lse = false;
    if (work) {
      const int hb = a.b_pack == 1 ? h : (h % a.b_pack) * (a.num_heads / a.b_pack) + h / a.b_pack;
      const int64_t hrow_a = ra * a.num_heads + h, hrow_b = rb * a.num_heads + hb;
      la = a.lse[hrow_a];
      lb = a.lse_b[hrow_b];
      bf16* o = a.out + hrow_a * a.head_dim;
      const bf16* ob = a.out_b + hrow_b * a.head_dim;
      if (la == -INFINITY) {
        // a is empty: b copied exactly (both empty: zeros, lse stays -inf).
        write_lse = lb != -INFINITY;
        new_lse = lb;
        for (int c = sub; c < a.chunks; c += a.group_lanes) {
          if (lb == -INFINITY) {
            Zero<kVec>(o + c * kVec);
          } else {
            CopyBits<kVec>(o + c * kVec, ob + c * kVec);
          }
        }
      } else if (lb != -INFINITY) {
        // Both non-empty (or NaN, which propagates as on the CPU: std::max keeps a NaN la, and a
        // NaN lb makes wb NaN). The weights e^{l - m} are <= 1, the total in [1, 2].
        const float m = la < lb ? lb : la;
        const float wa = expf(la - m), wb = expf(lb - m);
        const float total = wa + wb;
        const float ca = wa / total, cb = wb / total;
        write_lse = true;
        new_lse = m + logf(total);
        for (int c = sub; c < a.chunks; c += a.group_lanes) {
          float fa[kVec], fb[kVec];
          LoadF<kVec>(o + c * kVec, fa);
          LoadF<kVec>(ob + c * kVec, fb);
#pragma unroll
          for (int e = 0; e < kVec; ++e) fa[e] = ca * fa[e] + cb * fb[e];
          StoreF<kVec>(o + c * kVec, fa);
        }
      }
      // else b is empty: (out[a], lse[a]) stay as they are.
    }
    __syncwarp();  // every lane of the group has read lse[a] before it is overwritten
    if (write_lse && sub == 0) a.lse[ra * a.num_heads + h] = new_lse;
  }
}

struct GatherArgs {
  const bf16* src;
  bf16* dst;
  const int32_t* rows;
  int64_t n, width, src_stride;
  int64_t chunks;          // width / kVec
  int64_t pack, head_dim;  // pack > 1: heads reordered (see GatherRowsParams::pack)
};

template <int kVec>
__global__ void __launch_bounds__(kThreads) GatherRowsKernel(const GatherArgs a) {
  const int64_t total = a.n * a.chunks;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t item = int64_t{blockIdx.x} * kThreads + threadIdx.x; item < total; item += stride) {
    const int64_t i = item / a.chunks, c = item % a.chunks;
    const int64_t r = a.rows[i];
    bf16* d = a.dst + i * a.width + c * kVec;
    if (r < 0) {
      Zero<kVec>(d);
    } else {
      int64_t e = c * kVec;  // element of the destination row
      if (a.pack > 1) {      // destination head j·(H/pack) + g comes from source head g·pack + j
        const int64_t kv = a.width / a.head_dim / a.pack, head = e / a.head_dim;
        e = ((head % kv) * a.pack + head / kv) * a.head_dim + e % a.head_dim;
      }
      CopyBits<kVec>(d, a.src + r * a.src_stride + e);
    }
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned Blocks(int64_t threads_needed) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((threads_needed + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

absl::Status MergeStates(const MergeStatesParams& p, cudaStream_t stream) {
  auto invalid = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("MergeStates: ", what));
  };
  if (p.n < 0) return invalid(absl::StrCat("n must be >= 0, got ", p.n));
  if (p.n == 0) return absl::OkStatus();
  const std::pair<const char*, const void*> pointers[] = {
      {"out", p.out}, {"lse", p.lse}, {"out_b", p.out_b}, {"lse_b", p.lse_b}};
  for (const auto& pr : pointers) {
    if (pr.second == nullptr) return invalid(absl::StrCat(pr.first, " is null"));
  }
  const std::pair<const char*, int64_t> sizes[] = {{"num_heads", p.num_heads}, {"head_dim", p.head_dim}};
  for (const auto& pr : sizes) {
    if (pr.second <= 0) return invalid(absl::StrCat(pr.first, " must be positive, got ", pr.second));
    if (pr.second > INT32_MAX) return invalid(absl::StrCat(pr.first, " must fit in int32, got ", pr.second));
  }
  if (p.n > INT64_MAX / p.num_heads / p.head_dim) return invalid("n * num_heads * head_dim overflows");
  if (p.b_pack < 1 || p.num_heads % p.b_pack != 0) {
    return invalid(absl::StrCat("b_pack ", p.b_pack, " must be >= 1 and divide num_heads ", p.num_heads));
  }
  // With both row lists, one buffer may hold both states (rows read and rows written are disjoint
  // by precondition); with an identity list, equal pointers would merge a row into itself.
  const bool lists = p.rows_a != nullptr && p.rows_b != nullptr;
  if (!lists && static_cast<const void*>(p.out) == static_cast<const void*>(p.out_b)) {
    return invalid("out aliases out_b without rows_a and rows_b (the merge would read the rows it writes)");
  }
  if (!lists && static_cast<const void*>(p.lse) == static_cast<const void*>(p.lse_b)) {
    return invalid("lse aliases lse_b without rows_a and rows_b (the merge would read the rows it writes)");
  }

  const bool vec = p.head_dim % 8 == 0 && Aligned16(p.out) && Aligned16(p.out_b);
  MergeArgs a;
  a.out = p.out;
  a.lse = p.lse;
  a.out_b = p.out_b;
  a.lse_b = p.lse_b;
  a.rows_a = p.rows_a;
  a.rows_b = p.rows_b;
  a.num_pairs = p.n * p.num_heads;
  a.num_heads = static_cast<int>(p.num_heads);
  a.head_dim = static_cast<int>(p.head_dim);
  a.chunks = static_cast<int>(vec ? p.head_dim / 8 : p.head_dim);
  a.group_shift = 0;
  while ((1 << a.group_shift) < a.chunks && a.group_shift < 5) ++a.group_shift;
  a.group_lanes = 1 << a.group_shift;
  a.b_pack = static_cast<int>(p.b_pack);
  const int64_t pairs_per_warp = 32 / a.group_lanes;
  const unsigned blocks = Blocks((a.num_pairs + pairs_per_warp - 1) / pairs_per_warp * 32);
  if (vec) {
    MergeStatesKernel<8><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    MergeStatesKernel<1><<<blocks, kThreads, 0, stream>>>(a);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status GatherRows(const GatherRowsParams& p, cudaStream_t stream) {
  auto invalid = [](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("GatherRows: ", what));
  };
  if (p.n < 0) return invalid(absl::StrCat("n must be >= 0, got ", p.n));
  if (p.n == 0) return absl::OkStatus();
  const std::pair<const char*, const void*> pointers[] = {{"src", p.src}, {"dst", p.dst}, {"rows", p.rows}};
  for (const auto& pr : pointers) {
    if (pr.second == nullptr) return invalid(absl::StrCat(pr.first, " is null"));
  }
  if (p.width <= 0) return invalid(absl::StrCat("width must be positive, got ", p.width));
  const int64_t stride = p.src_stride == 0 ? p.width : p.src_stride;
  if (stride < p.width) {
    return invalid(
        absl::StrCat("src_stride ", p.src_stride, " is less than width ", p.width, " (0 means packed)"));
  }
  if (p.n > INT64_MAX / p.width) return invalid("n * width overflows");
  if (p.pack < 1) return invalid(absl::StrCat("pack must be >= 1, got ", p.pack));
  if (p.pack > 1 && (p.head_dim <= 0 || p.width % (p.head_dim * p.pack) != 0)) {
    return invalid(absl::StrCat("pack ", p.pack, " needs head_dim > 0 with width ", p.width,
                                " a multiple of head_dim * pack (head_dim ", p.head_dim, ")"));
  }

  const bool vec = p.width % 8 == 0 && stride % 8 == 0 && Aligned16(p.src) && Aligned16(p.dst) &&
                   (p.pack == 1 || p.head_dim % 8 == 0);
  GatherArgs a;
  a.src = p.src;
  a.dst = p.dst;
  a.rows = p.rows;
  a.n = p.n;
  a.width = p.width;
  a.src_stride = stride;
  a.chunks = vec ? p.width / 8 : p.width;
  a.pack = p.pack;
  a.head_dim = p.pack > 1 ? p.head_dim : 1;
  const unsigned blocks = Blocks(p.n * a.chunks);
  if (vec) {
    GatherRowsKernel<8><<<blocks, kThreads, 0, stream>>>(a);
  } else {
    GatherRowsKernel<1><<<blocks, kThreads, 0, stream>>>(a);
  }
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
