// Decode attention (one query row per request) over the token-granular bf16 KV cache, split-KV.
//
// Split kernel: one CTA of 128 threads per (request, kv head, split, head chunk). The CTA streams
// its key range in tiles of 32 keys through a cp.async ring of shared-memory stages (each K and V
// row is one 16-byte chunk per thread, gathered through the slot table; slot indices are loaded a
// tile ahead) and reads every K/V row once for all query heads of its GQA group (up to 8 heads,
// more in further head chunks). Per tile:
//   QK  warp w, lane = key: partial dot products over quarter w of head_dim for every head
//       (q is warp-uniform in shared memory, so its loads are broadcasts), into shared memory.
//   softmax  warp w owns heads w, w+4: sums the 4 quarters, tile max by shuffles, online max,
//       p = exp2(s - m) (q is pre-scaled by scale·log2 e), rescale factor for the accumulators.
//   PV  16 (d128) or 8 (d64) threads per V row, 8 columns each; every thread accumulates all
//       heads for its columns over its rows of the tile (fp32).
// That CUDA-core kernel serves MHA (one head per CTA); GQA chunks of 2..8 heads go to
// DecodeSplitMmaKernel (same loads and ring, QK and PV on tensor cores, one barrier per tile;
// described at the kernel).
// Shared-memory K/V rows are XOR-swizzled by 16-byte chunk (chunk ^ (row & 7)), which keeps the
// cp.async writes, the QK column reads and the PV row reads free of bank conflicts.
// The CTA's row groups are summed through shared memory at the end (fixed order, so results are
// bit-reproducible). One split: out/lse written directly; else normalised partial o (fp32) and
// base-2 lse go to the workspace, and a merge kernel combines the splits by log-sum-exp.
//
// Behaviour at the edges (documented here, not checkable on the host):
//   * a request with no keys gets out = 0 and lse = -inf;
//   * with q_indptr, a request's last row is computed and a request with no rows is skipped;
//   * slots outside [0, num_slots) read as zero rows (never out-of-bounds memory);
//   * split s covers keys [s·c, (s+1)·c), c = max_kv_len / num_splits rounded up to whole tiles,
//     and the last split runs to the request's end, so an underestimated max_kv_len is slow but
//     never wrong.
// Workspace: part_o (num_requests, num_heads, num_splits, head_dim) fp32, 256-byte aligned, then
// part_lse (num_requests, num_heads, num_splits) fp32 (base 2).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;  // keys per pipeline stage
constexpr int kMaxHeadsPerCta = 8;
constexpr int kMinKeysPerSplit = 256;
constexpr int kMaxSplits = 256;
constexpr int kCtasPerSmEstimate = 4;  // occupancy the plan assumes (smem ~55 KB, <= 128 regs)
// One wave: a sweep of forced split counts on an H100 (GQA 32/8, d128; docs/benchmarks.md,
// "Decode attention: the split plan") found the fastest count where the CTAs fill about one wave
// (64 × 1K: 1 split 98.7 µs against 3 splits 109.6; 8 × 4K: 8 splits 59.4 against 16 67.8); a
// second wave of shorter splits costs its merge and its CTAs' set-up without reading faster.
constexpr int kTargetWaves = 1;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D>
struct Cfg {
  static constexpr int kChunks = D / 8;                      // 16-byte chunks per row
  static constexpr int kRowGroups = kThreads / kChunks;      // rows in flight per load / PV step
  static constexpr int kRowsPerThread = kTile / kRowGroups;  // K (and V) rows each thread copies
  static constexpr int kQkChunks = kChunks / kWarps;         // chunks per warp in QK
  static constexpr int kStages = D == 128 ? 3 : 6;           // 16 KB / 8 KB per stage
  static constexpr int kStageElems = 2 * kTile * D;          // K tile then V tile (bf16)
};

struct SplitArgs {
  const bf16* q;
  const bf16* k_cache;
  const bf16* v_cache;
  bf16* out;
  float* lse;
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_slots;
  float* part_o;    // (num_requests, num_heads, num_splits, D), used when num_splits > 1
  float* part_lse;  // (num_requests, num_heads, num_splits), base-2 log-sum-exp
  int64_t num_slots;
  int num_heads, num_kv_heads, group, heads_per_chunk, head_chunks, num_splits;
  int keys_per_split;
  float q_scale;  // scale · log2(e)
};

struct MergeArgs {
  const float* part_o;
  const float* part_lse;
  bf16* out;
  float* lse;
  const int32_t* q_indptr;
  int64_t num_pairs;  // num_requests · num_heads
  int num_heads, num_splits;
};

__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two bf16 packed in a 32-bit word -> fp32 (exact).
__device__ __forceinline__ void Unpack8(const uint4& w, float (&f)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// Query row of request r: q_indptr[r+1]-1 (the last row, which attends to every key), or r when
// q_indptr is null; -1 when the request has no query row.
__device__ __forceinline__ int64_t QueryRow(const int32_t* q_indptr, int64_t r) {
  if (q_indptr == nullptr) return r;
  const int32_t b = q_indptr[r], e = q_indptr[r + 1];
  return e > b ? int64_t{e} - 1 : -1;
}

// The work of one CTA of either decode kernel: block index = ((request · num_kv_heads + kv head)
// · num_splits + split) · head_chunks + head chunk. Keys [key_begin, key_begin + n) of the
// request; the last split runs to the end, so an underestimated max_kv_len is slow, never wrong.
template <int D>
struct SplitWork {
  const SplitArgs& a;
  int hc, split, kvh;
  int64_t r, row, kv_begin, key_begin;
  int n, nh, head0;  // keys of the split; heads of the chunk, the first one's index

  __device__ SplitWork(const SplitArgs& args, int64_t bid) : a(args) {
    hc = static_cast<int>(bid % a.head_chunks);
    bid /= a.head_chunks;
    split = static_cast<int>(bid % a.num_splits);
    bid /= a.num_splits;
    kvh = static_cast<int>(bid % a.num_kv_heads);
    r = bid / a.num_kv_heads;
    row = QueryRow(a.q_indptr, r);  // < 0: the request has no query row
    kv_begin = a.kv_indptr[r];
    const int64_t kv_len = int64_t{a.kv_indptr[r + 1]} - kv_begin;
    key_begin = int64_t{split} * a.keys_per_split;
    int64_t key_end = key_begin + a.keys_per_split;
    if (split == a.num_splits - 1 || key_end > kv_len) key_end = kv_len;
    n = key_end > key_begin ? static_cast<int>(key_end - key_begin) : 0;
    const int head0_in_group = hc * a.heads_per_chunk;
    nh = min(a.heads_per_chunk, a.group - head0_in_group);
    head0 = kvh * a.group + head0_in_group;
  }

  // Output element (head g of the chunk, column d) and the base-2 lse: straight to out/lse with
  // one split, else to the split's partial result for the merge kernel.
  __device__ void Write(int g, int d, float o, float lse2) const {
    const int64_t h = head0 + g;
    if (a.num_splits == 1) {
      a.out[(row * a.num_heads + h) * D + d] = __float2bfloat16_rn(o);
      if (d == 0 && a.lse != nullptr) a.lse[row * a.num_heads + h] = lse2 * kLn2;
    } else {
      const int64_t pair = r * a.num_heads + h;
      a.part_o[(pair * a.num_splits + split) * D + d] = o;
      if (d == 0) a.part_lse[pair * a.num_splits + split] = lse2;
    }
  }
};

// Brings one split's K and V rows, gathered through the slot table, into the shared-memory ring
// of both decode kernels: tile t (kTile keys) goes to stage t % kStages with 16-byte cp.async
// copies, rows XOR-swizzled by 16-byte chunk. Keys past the split and slots outside
// [0, num_slots) read as zero rows. Each thread copies the same chunk of kRowsPerThread rows.
template <int D>
struct KvTileLoader {
  using C = Cfg<D>;
  const SplitArgs& a;
  const int32_t* slots;  // the split's first key
  bf16* kv_s;
  int n, kvh, ld_chunk, ld_row, num_tiles;

  __device__ KvTileLoader(const SplitArgs& args, const int32_t* split_slots, bf16* ring, int keys,
                          int kv_head, int tid)
      : a(args),
        slots(split_slots),
        kv_s(ring),
        n(keys),
        kvh(kv_head),
        ld_chunk(tid % C::kChunks),
        ld_row(tid / C::kChunks),
        num_tiles((keys + kTile - 1) / kTile) {}

  // The slot indices of this thread's rows of `tile` (-1 past the end).
  __device__ void LoadSlots(int tile, int (&sl)[C::kRowsPerThread]) const {
#pragma unroll
    for (int i = 0; i < C::kRowsPerThread; ++i) {
      const int key = tile * kTile + ld_row + i * C::kRowGroups;
      sl[i] = (tile < num_tiles && key < n) ? slots[key] : -1;
    }
  }

  // Issues the copies of one tile (slots from LoadSlots) into ring stage `stage`.
  __device__ void Issue(int stage, const int (&sl)[C::kRowsPerThread]) const {
    bf16* ks = kv_s + stage * C::kStageElems;
    bf16* vs = ks + kTile * D;
#pragma unroll
    for (int i = 0; i < C::kRowsPerThread; ++i) {
      const int rr = ld_row + i * C::kRowGroups;
      const bool valid = sl[i] >= 0 && sl[i] < a.num_slots;  // out-of-range slots read as zeros
      const int64_t off = valid ? (int64_t{sl[i]} * a.num_kv_heads + kvh) * D + ld_chunk * 8 : 0;
      const int dst = rr * D + ((ld_chunk ^ (rr & 7)) * 8);
      CpAsync16(ks + dst, a.k_cache + off, valid);
      CpAsync16(vs + dst, a.v_cache + off, valid);
    }
  }

  // Issues the first kStages - 1 tiles, one commit group each (empty groups past the end keep the
  // wait_group arithmetic uniform), and loads the slots of tile kStages - 1 into `next`.
  __device__ void Prologue(int (&next)[C::kRowsPerThread]) const {
    int pro[C::kStages - 1][C::kRowsPerThread];
#pragma unroll
    for (int t = 0; t < C::kStages - 1; ++t) LoadSlots(t, pro[t]);
#pragma unroll
    for (int t = 0; t < C::kStages - 1; ++t) {
      if (t < num_tiles) Issue(t, pro[t]);
      CpAsyncCommit();
    }
    LoadSlots(C::kStages - 1, next);
  }
};

template <int D, int HPB>
__global__ void __launch_bounds__(kThreads, HPB >= 8 ? 3 : 4) DecodeSplitKernel(const SplitArgs a) {
  using C = Cfg<D>;
  constexpr int kHeadsPerWarp = (HPB + kWarps - 1) / kWarps;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* kv_s = reinterpret_cast<bf16*>(smem_raw);  // kStages × (K tile, V tile), swizzled rows
  float* q_s = reinterpret_cast<float*>(smem_raw + sizeof(bf16) * C::kStages * C::kStageElems);  // (HPB, D)
  float* part_s = q_s + HPB * D;                      // (kWarps, HPB, kTile): QK partial dots
  float* p_s = part_s + kWarps * HPB * kTile;         // (kTile, HPB): probabilities of the tile
  float* alpha_s = p_s + kTile * HPB;                 // (HPB): accumulator rescale of the tile
  float* m_s = alpha_s + HPB;                         // (HPB): running max (base 2)
  float* l_s = m_s + HPB;                             // (HPB): final row sums
  float* red_s = reinterpret_cast<float*>(smem_raw);  // (kRowGroups, HPB, D), aliases the stages

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const SplitWork<D> w(a, blockIdx.x);
  if (w.row < 0) return;  // no query row: nothing to write (the merge skips it too)
  const int kvh = w.kvh, n = w.n, nh = w.nh, head0 = w.head0;
  const int64_t row = w.row, kv_begin = w.kv_begin, key_begin = w.key_begin;
  auto write_result = [&](int g, int d, float o, float lse2) { w.Write(g, d, o, lse2); };

  if (n == 0) {  // empty range (or a request without keys): out = 0, lse = -inf
    for (int i = tid; i < nh * D; i += kThreads) write_result(i / D, i % D, 0.0f, -INFINITY);
    return;
  }

  // q (pre-scaled, fp32) into shared memory; padding heads are zero and never written out.
  for (int i = tid; i < HPB * D; i += kThreads) {
    const int g = i / D;
    float v = 0.0f;
    if (g < nh) v = __bfloat162float(a.q[(row * a.num_heads + head0 + g) * D + i % D]) * a.q_scale;
    q_s[i] = v;
  }

  const KvTileLoader<D> loader(a, a.kv_slots + kv_begin + key_begin, kv_s, n, kvh, tid);
  const int num_tiles = loader.num_tiles;
  int next_slots[C::kRowsPerThread];
  loader.Prologue(next_slots);

  float acc[HPB][8];
#pragma unroll
  for (int g = 0; g < HPB; ++g)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[g][e] = 0.0f;
  float m_run[kHeadsPerWarp], l_lane[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    m_run[i] = -INFINITY;
    l_lane[i] = 0.0f;
  }

  const int pv_chunk = tid % C::kChunks, pv_group = tid / C::kChunks;

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<C::kStages - 2>();
    __syncthreads();  // tile's data visible to all; everyone is done with the stage refilled next
    {
      const int nt = tile + C::kStages - 1;
      if (nt < num_tiles) {
        loader.Issue(nt % C::kStages, next_slots);
        loader.LoadSlots(nt + 1, next_slots);
      }
      CpAsyncCommit();
    }
    const bf16* ks = kv_s + (tile % C::kStages) * C::kStageElems;
    const bf16* vs = ks + kTile * D;
    const int tile_n = min(kTile, n - tile * kTile);

    // QK: lane = key, warp = quarter of head_dim.
    {
      float s[HPB];
#pragma unroll
      for (int g = 0; g < HPB; ++g) s[g] = 0.0f;
#pragma unroll
      for (int j = 0; j < C::kQkChunks; ++j) {
        const int c = warp * C::kQkChunks + j;
        const uint4 kw = *reinterpret_cast<const uint4*>(ks + lane * D + ((c ^ (lane & 7)) * 8));
        float kf[8];
        Unpack8(kw, kf);
#pragma unroll
        for (int g = 0; g < HPB; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(q_s + g * D + c * 8);
          const float4 qb = *reinterpret_cast<const float4*>(q_s + g * D + c * 8 + 4);
          float t = s[g];
          t = fmaf(qa.x, kf[0], t);
          t = fmaf(qa.y, kf[1], t);
          t = fmaf(qa.z, kf[2], t);
          t = fmaf(qa.w, kf[3], t);
          t = fmaf(qb.x, kf[4], t);
          t = fmaf(qb.y, kf[5], t);
          t = fmaf(qb.z, kf[6], t);
          t = fmaf(qb.w, kf[7], t);
          s[g] = t;
        }
      }
#pragma unroll
      for (int g = 0; g < HPB; ++g) part_s[(warp * HPB + g) * kTile + lane] = s[g];
    }
    __syncthreads();

    // Online softmax: warp w owns heads w, w + 4 (lane = key).
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; ++i) {
      const int g = warp + i * kWarps;
      if (g < HPB) {
        float s = -INFINITY;
        if (lane < tile_n) {
          s = part_s[(0 * HPB + g) * kTile + lane];
#pragma unroll
          for (int w = 1; w < kWarps; ++w) s += part_s[(w * HPB + g) * kTile + lane];
        }
        float mt = s;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
        const float m_new = fmaxf(m_run[i], mt);
        const float alpha = m_run[i] == m_new ? 1.0f : exp2f(m_run[i] - m_new);
        const float p = s == -INFINITY ? 0.0f : exp2f(s - m_new);
        m_run[i] = m_new;
        l_lane[i] = l_lane[i] * alpha + p;
        p_s[lane * HPB + g] = p;
        if (lane == 0) alpha_s[g] = alpha;
      }
    }
    __syncthreads();

    // PV: thread = (row group, 8 columns); all heads.
    {
#pragma unroll
      for (int g = 0; g < HPB; ++g) {
        const float al = alpha_s[g];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] *= al;
      }
#pragma unroll
      for (int it = 0; it < C::kRowsPerThread; ++it) {
        const int kk = pv_group + it * C::kRowGroups;
        if (kk < tile_n) {
          const uint4 vw = *reinterpret_cast<const uint4*>(vs + kk * D + ((pv_chunk ^ (kk & 7)) * 8));
          float vf[8];
          Unpack8(vw, vf);
          float p[HPB];
          if constexpr (HPB % 4 == 0) {
#pragma unroll
            for (int g = 0; g < HPB; g += 4) {
              const float4 p4 = *reinterpret_cast<const float4*>(p_s + kk * HPB + g);
              p[g] = p4.x;
              p[g + 1] = p4.y;
              p[g + 2] = p4.z;
              p[g + 3] = p4.w;
            }
          } else {
#pragma unroll
            for (int g = 0; g < HPB; ++g) p[g] = p_s[kk * HPB + g];
          }
#pragma unroll
          for (int g = 0; g < HPB; ++g)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p[g], vf[e], acc[g][e]);
        }
      }
    }
  }

  // Combine the row groups (and the lanes' row sums) through shared memory, in a fixed order.
  CpAsyncWait<0>();
  __syncthreads();
#pragma unroll
  for (int g = 0; g < HPB; ++g) {
    float* dst = red_s + (pv_group * HPB + g) * D + pv_chunk * 8;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[g][4], acc[g][5], acc[g][6], acc[g][7]);
  }
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; ++i) {
    const int g = warp + i * kWarps;
    if (g < HPB) {
      float l = l_lane[i];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      if (lane == 0) {
        l_s[g] = l;
        m_s[g] = m_run[i];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < nh * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float o = 0.0f;
#pragma unroll
    for (int rg = 0; rg < C::kRowGroups; ++rg) o += red_s[(rg * HPB + g) * D + d];
    const float l = l_s[g];
    write_result(g, d, o / l, m_s[g] + log2f(l));
  }
}

// ---- GQA path on tensor cores (groups of 2..8 heads per CTA) ----
// Same cp.async ring and swizzled stages as DecodeSplitKernel, but warp w owns keys
// [8w, 8w+8) of every 32-key tile and keeps its own running max, row sums and output for the
// group (flash-decoding inside the CTA), so the only barrier per tile is the ring's.
//   QK  mma.m16n8k16 (bf16 in, fp32 accumulate): A = the group's q rows (rows >= nh and 8..15
//       are zero), B = K^T of the warp's 8 keys (ldmatrix from the swizzled rows). The products
//       of bf16 values are exact, so this matches the fp32 dot product up to summation order.
//   softmax  lane (g = lane/4, t = lane%4) holds scores of head g for keys 2t, 2t+1; row max by
//       two shuffles; base-2 online softmax with the scale applied to the fp32 scores.
//   PV  transposed, o^T (D × 8 heads) += V^T (D × 16) · P^T (16 × 8 heads): the score fragment
//       (head g, keys 2t, 2t+1) is already the B fragment, the heads fill n8 exactly, and the
//       A fragments come from ldmatrix.trans of the V rows. k = 16: keys 0..7 carry bf16(p) and
//       keys 8..15 the rounding remainder p - bf16(p) against the same V rows (a2 = a0,
//       a3 = a1), so p is used to ~2^-17 relative precision at no extra cost. The fp32 row sums
//       use the unrounded p.
// The warps' (m, l, o) are combined through shared memory in a fixed order at the end.
__device__ __forceinline__ void MmaBf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* smem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lower address, lower column) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

constexpr int kMmaMaxHeads = 8;  // rows of the m16 tile that carry heads (lane / 4)

template <int D>
struct MmaCfg {
  using C = Cfg<D>;
  static constexpr int kKeysPerWarp = kTile / kWarps;  // 8
  static constexpr int kKSteps = D / 16;               // QK k-steps
  static constexpr int kMTiles = D / 16;               // PV m-tiles of o^T (16 columns of d)
  static constexpr size_t kStageBytes = sizeof(bf16) * C::kStages * C::kStageElems;
  static constexpr size_t kRedBytes = sizeof(float) * kWarps * kMmaMaxHeads * (D + 2);
  static constexpr size_t kSmemBytes = kStageBytes > kRedBytes ? kStageBytes : kRedBytes;
  static_assert(kKeysPerWarp == 8, "one n8 tile of keys per warp");
};

template <int D>
__global__ void __launch_bounds__(kThreads, 4) DecodeSplitMmaKernel(const SplitArgs a) {
  using C = Cfg<D>;
  using M = MmaCfg<D>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* kv_s = reinterpret_cast<bf16*>(smem_raw);  // kStages × (K tile, V tile), swizzled rows
  // After the loop (aliases the stages): per warp, o (kMmaMaxHeads, D), then m and l (kMmaMaxHeads).
  float* red_s = reinterpret_cast<float*>(smem_raw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;

  const SplitWork<D> w(a, blockIdx.x);
  if (w.row < 0) return;  // no query row: nothing to write (the merge skips it too)
  const int kvh = w.kvh, n = w.n, nh = w.nh, head0 = w.head0;
  const int64_t row = w.row, kv_begin = w.kv_begin, key_begin = w.key_begin;
  auto write_result = [&](int g, int d, float o, float lse2) { w.Write(g, d, o, lse2); };

  if (n == 0) {
    for (int i = tid; i < nh * D; i += kThreads) write_result(i / D, i % D, 0.0f, -INFINITY);
    return;
  }

  const KvTileLoader<D> loader(a, a.kv_slots + kv_begin + key_begin, kv_s, n, kvh, tid);
  const int num_tiles = loader.num_tiles;
  int next_slots[C::kRowsPerThread];
  loader.Prologue(next_slots);

  // q as A fragments (bf16, unscaled): a0 = q[gq][16s + 2tq, +1], a2 = q[gq][16s + 8 + 2tq, +1].
  uint32_t qa[M::kKSteps][2];
  {
    const bool has = gq < nh;
    const uint32_t* qrow =
        reinterpret_cast<const uint32_t*>(a.q + (row * a.num_heads + head0 + (has ? gq : 0)) * D);
#pragma unroll
    for (int s = 0; s < M::kKSteps; ++s) {
      qa[s][0] = has ? qrow[(16 * s + 2 * tq) / 2] : 0u;
      qa[s][1] = has ? qrow[(16 * s + 8 + 2 * tq) / 2] : 0u;
    }
  }

  // o^T fragments: m-tile j holds (d = 16j + gq, heads 2tq, 2tq+1) and (d = 16j + 8 + gq, same).
  float o[M::kMTiles][4];
#pragma unroll
  for (int j = 0; j < M::kMTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
  float m_run = -INFINITY, l_lane = 0.0f;  // head gq; l over this lane's keys

  const int key0 = warp * M::kKeysPerWarp;  // first key of the warp in each tile
  // ldmatrix row addresses: lane provides row (key0 + lane % 8) of matrix lane / 8.
  const int lm_row = key0 + (lane & 7), lm_mat = lane >> 3;

  for (int tile = 0; tile < num_tiles; ++tile) {
    CpAsyncWait<C::kStages - 2>();
    __syncthreads();  // tile's data visible to all; everyone is done with the stage refilled next
    {
      const int nt = tile + C::kStages - 1;
      if (nt < num_tiles) {
        loader.Issue(nt % C::kStages, next_slots);
        loader.LoadSlots(nt + 1, next_slots);
      }
      CpAsyncCommit();
    }
    const bf16* ks = kv_s + (tile % C::kStages) * C::kStageElems;
    const bf16* vs = ks + kTile * D;
    const int tile_n = min(kTile, n - tile * kTile);

    // QK: S (16 × 8 keys), rows gq.
    float s4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int q4 = 0; q4 < C::kChunks / 4; ++q4) {
      uint32_t kb[4];  // chunks 4·q4 + i of keys key0..key0+7
      const int c = 4 * q4 + lm_mat;
      LdMatrixX4(kb, ks + lm_row * D + ((c ^ (lm_row & 7)) * 8));
      MmaBf16(s4, qa[2 * q4][0], 0u, qa[2 * q4][1], 0u, kb[0], kb[1]);
      MmaBf16(s4, qa[2 * q4 + 1][0], 0u, qa[2 * q4 + 1][1], 0u, kb[2], kb[3]);
    }

    // Online softmax for head gq over keys key0 + 2tq, +1.
    const int k0 = key0 + 2 * tq;
    const float sa = k0 < tile_n ? s4[0] * a.q_scale : -INFINITY;
    const float sb = k0 + 1 < tile_n ? s4[1] * a.q_scale : -INFINITY;
    float mt = fmaxf(sa, sb);
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
    mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
    const float m_new = fmaxf(m_run, mt);
    const float alpha = m_run == m_new ? 1.0f : exp2f(m_run - m_new);
    const float pa = sa == -INFINITY ? 0.0f : exp2f(sa - m_new);
    const float pb = sb == -INFINITY ? 0.0f : exp2f(sb - m_new);
    m_run = m_new;
    l_lane = l_lane * alpha + (pa + pb);
    const uint32_t p_hi = PackBf16(pa, pb);
    const __nv_bfloat162 hi2 = *reinterpret_cast<const __nv_bfloat162*>(&p_hi);
    const uint32_t p_lo = PackBf16(pa - __low2float(hi2), pb - __high2float(hi2));

    // PV: o^T (D × 16) += [V^T | V^T] (D × 16) · [p_hi; p_lo]^T over the warp's 8 keys.
    const float alpha_a = __shfl_sync(0xffffffffu, alpha, (2 * tq) * 4);      // head 2tq
    const float alpha_b = __shfl_sync(0xffffffffu, alpha, (2 * tq + 1) * 4);  // head 2tq + 1
#pragma unroll
    for (int q4 = 0; q4 < C::kChunks / 4; ++q4) {
      uint32_t va[4];  // V^T of chunks 4·q4 + i (d rows), keys key0..key0+7
      const int c = 4 * q4 + lm_mat;
      LdMatrixX4Trans(va, vs + lm_row * D + ((c ^ (lm_row & 7)) * 8));
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float(&acc)[4] = o[2 * q4 + i];
        acc[0] *= alpha_a;
        acc[1] *= alpha_b;
        acc[2] *= alpha_a;
        acc[3] *= alpha_b;
        MmaBf16(acc, va[2 * i], va[2 * i + 1], va[2 * i], va[2 * i + 1], p_hi, p_lo);
      }
    }
  }

  // Combine the warps through shared memory, in a fixed order.
  CpAsyncWait<0>();
  __syncthreads();
  {
    float l = l_lane;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float* ow = red_s + warp * kMmaMaxHeads * (D + 2);
#pragma unroll
    for (int j = 0; j < M::kMTiles; ++j) {
      ow[(2 * tq) * D + 16 * j + gq] = o[j][0];
      ow[(2 * tq + 1) * D + 16 * j + gq] = o[j][1];
      ow[(2 * tq) * D + 16 * j + 8 + gq] = o[j][2];
      ow[(2 * tq + 1) * D + 16 * j + 8 + gq] = o[j][3];
    }
    if (tq == 0) {
      ow[kMmaMaxHeads * D + gq] = m_run;
      ow[kMmaMaxHeads * D + kMmaMaxHeads + gq] = l;
    }
  }
  __syncthreads();
  for (int i = tid; i < nh * D; i += kThreads) {
    const int g = i / D, d = i % D;
    float mw[kWarps];
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      mw[w] = red_s[w * kMmaMaxHeads * (D + 2) + kMmaMaxHeads * D + g];
      m = fmaxf(m, mw[w]);
    }
    float acc = 0.0f, l = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* ow = red_s + w * kMmaMaxHeads * (D + 2);
      if (mw[w] == -INFINITY) continue;  // the warp saw no keys
      const float sc = exp2f(mw[w] - m);
      acc = fmaf(sc, ow[g * D + d], acc);
      l = fmaf(sc, ow[kMmaMaxHeads * D + kMmaMaxHeads + g], l);
    }
    write_result(g, d, acc / l, m + log2f(l));
  }
}

// One (request, head) per D/4 threads, 4 columns each. Splits with lse = -inf weigh 0; if all
// are -inf (no keys) out = 0 and lse = -inf.
template <int D>
__global__ void __launch_bounds__(kThreads) DecodeMergeKernel(const MergeArgs a) {
  constexpr int kPerPair = D / 4;
  constexpr int kPairsPerBlock = kThreads / kPerPair;
  const int64_t pair = int64_t{blockIdx.x} * kPairsPerBlock + threadIdx.x / kPerPair;
  if (pair >= a.num_pairs) return;
  const int col = (threadIdx.x % kPerPair) * 4;
  const int64_t r = pair / a.num_heads;
  const int h = static_cast<int>(pair % a.num_heads);
  const int64_t row = QueryRow(a.q_indptr, r);
  if (row < 0) return;

  const float* pl = a.part_lse + pair * a.num_splits;
  float m = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) m = fmaxf(m, pl[s]);
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float lse = -INFINITY;
  if (m != -INFINITY) {
    float sum = 0.0f;
    const float* po = a.part_o + pair * a.num_splits * D + col;
    for (int s = 0; s < a.num_splits; ++s) {
      const float ls = pl[s];
      if (ls == -INFINITY) continue;
      const float w = exp2f(ls - m);
      sum += w;
      const float4 v = *reinterpret_cast<const float4*>(po + int64_t{s} * D);
      o.x = fmaf(w, v.x, o.x);
      o.y = fmaf(w, v.y, o.y);
      o.z = fmaf(w, v.z, o.z);
      o.w = fmaf(w, v.w, o.w);
    }
    const float inv = 1.0f / sum;
    o.x *= inv;
    o.y *= inv;
    o.z *= inv;
    o.w *= inv;
    lse = (m + log2f(sum)) * kLn2;
  }
  bf16* dst = a.out + (row * a.num_heads + h) * D + col;
  dst[0] = __float2bfloat16_rn(o.x);
  dst[1] = __float2bfloat16_rn(o.y);
  dst[2] = __float2bfloat16_rn(o.z);
  dst[3] = __float2bfloat16_rn(o.w);
  if (col == 0 && a.lse != nullptr) a.lse[row * a.num_heads + h] = lse;
}

// Heads of one GQA group handled per CTA, and the kernel bucket (1, 2, 4, 8) that holds them.
struct HeadChunking {
  int chunks, per_chunk, bucket;
};
HeadChunking ChunkHeads(int64_t group) {
  HeadChunking c;
  c.chunks = static_cast<int>((group + kMaxHeadsPerCta - 1) / kMaxHeadsPerCta);
  c.per_chunk = static_cast<int>((group + c.chunks - 1) / c.chunks);
  c.bucket = c.per_chunk <= 1 ? 1 : c.per_chunk <= 2 ? 2 : c.per_chunk <= 4 ? 4 : 8;
  return c;
}

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

int64_t WorkspaceBytes(int64_t num_requests, int64_t num_heads, int64_t head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  const int64_t entries = num_requests * num_heads * num_splits;
  return AlignUp(entries * head_dim * 4, 256) + AlignUp(entries * 4, 256);
}

int KeysPerSplit(int64_t max_kv_len, int num_splits) {
  const int64_t per = (max_kv_len + num_splits - 1) / num_splits;
  return static_cast<int>(AlignUp(std::max<int64_t>(per, 1), kTile));
}

template <int D, int HPB>
size_t SplitSmemBytes() {
  using C = Cfg<D>;
  const size_t stages = sizeof(bf16) * C::kStages * C::kStageElems;
  const size_t floats = HPB * D + kWarps * HPB * kTile + kTile * HPB + 3 * HPB;
  static_assert(sizeof(float) * C::kRowGroups * HPB * D <= sizeof(bf16) * C::kStages * C::kStageElems,
                "the reduction buffer must fit in the stages it aliases");
  return stages + sizeof(float) * floats;
}

template <int D, int HPB>
absl::Status LaunchSplit(const SplitArgs& args, int64_t grid, cudaStream_t stream) {
  const size_t smem = SplitSmemBytes<D, HPB>();
  // Per launch (cheap, allowed during stream capture): the attribute is per device.
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      DecodeSplitKernel<D, HPB>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  DecodeSplitKernel<D, HPB><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchSplitMma(const SplitArgs& args, int64_t grid, cudaStream_t stream) {
  static_assert(kMaxHeadsPerCta <= kMmaMaxHeads, "a head chunk must fit the mma rows");
  const size_t smem = MmaCfg<D>::kSmemBytes;
  CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      DecodeSplitMmaKernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  DecodeSplitMmaKernel<D><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

template <int D>
absl::Status LaunchSplitForBucket(int bucket, const SplitArgs& args, int64_t grid, cudaStream_t stream) {
  switch (bucket) {
    case 1:
      return LaunchSplit<D, 1>(args, grid, stream);
    default:
      return LaunchSplitMma<D>(args, grid, stream);
  }
}

template <int D>
absl::Status LaunchMerge(const MergeArgs& args, cudaStream_t stream) {
  constexpr int64_t kPairsPerBlock = kThreads / (D / 4);
  const int64_t blocks = (args.num_pairs + kPairsPerBlock - 1) / kPairsPerBlock;
  DecodeMergeKernel<D><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::Status Invalid(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("DecodeAttention: ", what));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

DecodePlan PlanDecodeAttention(int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t max_kv_len, int num_sms) {
  DecodePlan plan;
  if (num_requests <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 || max_kv_len <= 0 ||
      num_heads % num_kv_heads != 0) {
    return plan;  // one split; DecodeAttention reports what is wrong
  }
  const HeadChunking hc = ChunkHeads(num_heads / num_kv_heads);
  const int64_t ctas_per_split = num_requests * num_kv_heads * hc.chunks;
  const int64_t target = int64_t{kTargetWaves} * (num_sms > 0 ? num_sms : 132) * kCtasPerSmEstimate;
  int64_t splits = (target + ctas_per_split / 2) / ctas_per_split;  // nearest: 512 CTAs fill 528 slots
  splits = std::min<int64_t>(splits, (max_kv_len + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  splits = std::clamp<int64_t>(splits, 1, kMaxSplits);
  // Whole tiles per split, and no split left empty by the rounding.
  auto rounded = [&](int64_t s) {
    return s > 1 ? (max_kv_len + KeysPerSplit(max_kv_len, static_cast<int>(s)) - 1) /
                       KeysPerSplit(max_kv_len, static_cast<int>(s))
                 : int64_t{1};
  };
  splits = rounded(splits);
  if (splits > 1) {
    // Wave quantisation: with equal CTAs the time is ~ waves · keys per split. Where a nearby
    // split count is clearly better (e.g. 17 splits = 2.06 waves), take the one closest to it.
    const int64_t slots = int64_t{num_sms > 0 ? num_sms : 132} * kCtasPerSmEstimate;
    const int64_t cap = std::min<int64_t>(kMaxSplits, (max_kv_len + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
    auto cost = [&](int64_t s) {
      const int64_t keys = s > 1 ? KeysPerSplit(max_kv_len, static_cast<int>(s)) : max_kv_len;
      return (ctas_per_split * s + slots - 1) / slots * keys;
    };
    const int64_t lo = std::max<int64_t>(1, splits / 2), hi = std::min<int64_t>(cap, 2 * splits);
    int64_t best = splits, best_cost = cost(splits);
    for (int64_t s = lo; s <= hi; ++s) {
      const int64_t sr = rounded(s);
      const int64_t c = cost(sr);
      const bool closer = std::abs(sr - splits) < std::abs(best - splits);
      if (c < best_cost || (c == best_cost && closer)) {
        best = sr;
        best_cost = c;
      }
    }
    if (best_cost * 20 < cost(splits) * 19) splits = best;  // only for a gain above 5%
  }
  plan.num_splits = static_cast<int>(splits);
  plan.workspace_bytes = WorkspaceBytes(num_requests, num_heads, head_dim, plan.num_splits);
  return plan;
}

absl::Status DecodeAttention(const AttentionParams& p, const DecodePlan& plan, void* workspace,
                             cudaStream_t stream) {
  const std::pair<const char*, const void*> pointers[] = {
      {"q", p.q},     {"k_cache", p.k_cache},     {"v_cache", p.v_cache},
      {"out", p.out}, {"kv_indptr", p.kv_indptr}, {"kv_slots", p.kv_slots}};
  for (const auto& pr : pointers) {
    if (pr.second == nullptr) return Invalid(absl::StrCat(pr.first, " is null"));
  }
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_requests", p.num_requests}, {"num_slots", p.num_slots}, {"num_heads", p.num_heads},
      {"num_kv_heads", p.num_kv_heads}, {"head_dim", p.head_dim},   {"max_kv_len", p.max_kv_len}};
  for (const auto& pr : sizes) {
    if (pr.second <= 0) return Invalid(absl::StrCat(pr.first, " must be positive, got ", pr.second));
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return Invalid(absl::StrCat("head_dim must be 64 or 128, got ", p.head_dim));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return Invalid(
        absl::StrCat("num_heads ", p.num_heads, " is not a multiple of num_kv_heads ", p.num_kv_heads));
  }
  if (!std::isfinite(p.scale) || !(p.scale > 0.0f)) {
    return Invalid(absl::StrCat("scale must be finite and positive, got ", p.scale));
  }
  if (p.max_q_len > 1) {
    return Invalid(absl::StrCat("max_q_len is ", p.max_q_len, "; decode takes one query row per request"));
  }
  if (p.num_slots > INT32_MAX || p.max_kv_len > INT32_MAX) {
    return Invalid("num_slots and max_kv_len must fit in int32 (slot indices are int32)");
  }
  if (!Aligned16(p.q) || !Aligned16(p.k_cache) || !Aligned16(p.v_cache)) {
    return Invalid("q, k_cache and v_cache must be 16-byte aligned");
  }
  if (plan.num_splits < 1 || plan.num_splits > 65536) {
    return Invalid(absl::StrCat("plan.num_splits must be in [1, 65536], got ", plan.num_splits));
  }
  const int64_t need = WorkspaceBytes(p.num_requests, p.num_heads, p.head_dim, plan.num_splits);
  if (need > 0) {
    if (workspace == nullptr) return Invalid("workspace is null but the plan has more than one split");
    if (!Aligned16(workspace)) return Invalid("workspace must be 16-byte aligned");
    if (plan.workspace_bytes < need) {
      return Invalid(absl::StrCat(
          "workspace too small for the plan: plan.workspace_bytes = ", plan.workspace_bytes, ", need ", need,
          " for ", p.num_requests, " requests, ", p.num_heads, " heads, ", plan.num_splits, " splits"));
    }
  }

  const HeadChunking hc = ChunkHeads(p.num_heads / p.num_kv_heads);
  const int64_t grid = p.num_requests * p.num_kv_heads * plan.num_splits * hc.chunks;
  if (grid > INT32_MAX) return Invalid(absl::StrCat("too much work for one launch: ", grid, " blocks"));

  SplitArgs a;
  a.q = p.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.out = p.out;
  a.lse = p.lse;
  a.q_indptr = p.q_indptr;
  a.kv_indptr = p.kv_indptr;
  a.kv_slots = p.kv_slots;
  a.part_o = nullptr;
  a.part_lse = nullptr;
  if (need > 0) {
    const int64_t entries = p.num_requests * p.num_heads * plan.num_splits;
    a.part_o = static_cast<float*>(workspace);
    a.part_lse = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) +
                                          AlignUp(entries * p.head_dim * 4, 256));
  }
  a.num_slots = p.num_slots;
  a.num_heads = static_cast<int>(p.num_heads);
  a.num_kv_heads = static_cast<int>(p.num_kv_heads);
  a.group = static_cast<int>(p.num_heads / p.num_kv_heads);
  a.heads_per_chunk = hc.per_chunk;
  a.head_chunks = hc.chunks;
  a.num_splits = plan.num_splits;
  a.keys_per_split = plan.num_splits == 1 ? INT32_MAX : KeysPerSplit(p.max_kv_len, plan.num_splits);
  a.q_scale = p.scale * kLog2e;

  if (p.head_dim == 128) {
    RETURN_IF_ERROR(LaunchSplitForBucket<128>(hc.bucket, a, grid, stream));
  } else {
    RETURN_IF_ERROR(LaunchSplitForBucket<64>(hc.bucket, a, grid, stream));
  }
  if (plan.num_splits == 1) return absl::OkStatus();

  MergeArgs m;
  m.part_o = a.part_o;
  m.part_lse = a.part_lse;
  m.out = p.out;
  m.lse = p.lse;
  m.q_indptr = p.q_indptr;
  m.num_pairs = p.num_requests * p.num_heads;
  m.num_heads = a.num_heads;
  m.num_splits = plan.num_splits;
  return p.head_dim == 128 ? LaunchMerge<128>(m, stream) : LaunchMerge<64>(m, stream);
}

}  // namespace tandem::kernels::cuda
