#!/usr/bin/env python3
"""FlashInfer on the shapes of tandem's attention benchmarks, in one process on one GPU.

Three sections, each with the shapes and columns of the tandem benchmark it sits beside:
  decode   bench/sdpa_baseline.py and decode_attention_bench: kinds mha (32/32) and gqa (32/8),
           head_dim 128, batches 1..512, contexts 128..32K; BatchDecodeWithPagedKVCacheWrapper
           (the CUDA-core decode kernel, what FlashInfer picks for one query token per request
           on sm_90) over a paged KV cache of page size 1 and 16 whose pages are a random
           permutation of the pool. Rows fi_p1_gqa, fi_p16_mha, ...: time, KV bytes / time, % of
           the read bandwidth measured here. Fresh random data per shape, several KV copies when
           the KV is small (consecutive calls never find their KV in L2), L2 flushed, launches
           queued behind a sleep kernel, one pair of CUDA events per call, median.
  prefill  bench/prefill_attention_bench: fresh causal prefill, chunk 512..4096, 16384 tokens per
           batch (batch = 16384 / chunk), GQA 32/8 and MHA, BatchPrefillWithPagedKVCacheWrapper
           with backend fa3 (FlashInfer's default on sm_90) and fa2, page size 1 and 16, shuffled
           pages. FLOPs = 4·d·heads·Σ visible keys (a chunk of c rows sees c(c+1)/2 keys);
           TFLOP/s and % of the bf16 GEMM rate measured here (torch.matmul 8192³).
  cascade  bench/prefix_attention_bench: B decode rows share a prefix of P keys and each has S
           keys of its own; llama3-8b (32/8) and llama-13b (40/40). plain: the decode wrapper
           over every row's whole context; cascade: MultiLevelCascadeAttentionWrapper with two
           levels (the prefix for all B rows as one request, then each row's suffix, merged by
           log-sum-exp). L2 flushed before every run; the two outputs are compared on every
           configuration.

FlashInfer must come with its kernels compiled ahead of time for sm_90a (the .fi/ folder of the
repository root; see docs/benchmarks.md): the script points FlashInfer's workspace at a
temporary folder, forbids JIT compilation, and exits with status 2 if FlashInfer cannot be
imported, the GPU is not sm_90, or a kernel module is missing (it would need compiling). Before
any timing, outputs of small odd shapes of every path (section, backend, page size) are compared
with a float32 reference computed with torch (max |error| printed, tolerance 1e-2); a path whose
check fails, or that FlashInfer refuses, is reported as CHECK FAILED and not timed, and the exit
status is 1 (as it is for a configuration that fails while timed, or a cascade output that differs
from the plain one).

    PYTHONPATH=.fi/site python3 bench/flashinfer_baseline.py [--quick] [--sections decode,prefill,cascade]
        [--page-sizes 1,16] [--backends fa3,fa2] [--iters N] [--reps N] [--cascade-reps N] [--json PATH]
"""

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FI_SITE = os.path.join(os.path.dirname(HERE), ".fi", "site")

# FlashInfer reads these when it is imported: the kernels for sm_90a only, and never a compiler.
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0")
os.environ["FLASHINFER_DISABLE_JIT"] = "1"
if os.path.isdir(FI_SITE) and FI_SITE not in sys.path:
    sys.path.insert(0, FI_SITE)

import torch  # noqa: E402

DECODE_KINDS = [("mha", 32, 32), ("gqa", 32, 8)]
DECODE_BATCHES = [1, 8, 64, 256, 512]
DECODE_CTXS = [128, 1024, 4096, 16384, 32768]
PREFILL_CHUNKS = [512, 1024, 2048, 4096]
PREFILL_TOKENS = 16384
PREFILL_BACKENDS = ["fa3", "fa2"]
CASCADE_MODELS = [("llama3-8b", 32, 8), ("llama-13b", 40, 40)]
CASCADE_BATCHES = [64, 128, 256, 512]
CASCADE_PREFIXES = [1024, 4096, 16384, 32768]
CASCADE_SUFFIXES = [64, 256, 1024, 2048]
HEAD_DIM = 128
WARMUP = 3
BF16 = torch.bfloat16
WORKSPACE_BYTES = 256 << 20


class Unavailable(Exception):
    """FlashInfer cannot run here without compiling (or cannot be imported at all)."""


def fail_unavailable(msg):
    print(f"flashinfer_baseline: {msg}", file=sys.stderr)
    sys.exit(2)


def import_flashinfer():
    try:
        import flashinfer  # noqa: F401
        import flashinfer.cascade  # noqa: F401
        import flashinfer.decode  # noqa: F401
        import flashinfer.prefill  # noqa: F401
        from flashinfer.jit.core import MissingJITCacheError
    except Exception as e:  # an ImportError, or anything a broken install raises at import
        fail_unavailable(f"cannot import flashinfer ({type(e).__name__}: {e}); put the prepared "
                         f"package on PYTHONPATH (expected at {FI_SITE})")
    return flashinfer, MissingJITCacheError


def load_modules(fi, missing_error, required, optional):
    """Loads the kernel modules the sections use: `required` and `optional` are prefill backends
    (the decode and merge modules are always required). A missing required module ends the run
    (it would need compiling); a missing optional one is left out. Returns the prefill backends
    that loaded."""
    args = (BF16, BF16, BF16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False)
    loaders = [("decode", True, lambda: fi.decode.get_batch_decode_module(*args)),
               ("cascade merge", True, lambda: fi.cascade.get_cascade_module())]
    for b in required + [b for b in optional if b not in required]:
        loaders.append((f"prefill {b}", b in required,
                        lambda b=b: fi.prefill.get_batch_prefill_module(b, *args, False)))
    loaded = []
    for name, needed, load in loaders:
        try:
            load()
        except missing_error as e:
            what = getattr(e, "spec", None) and e.spec.name or e
            if needed:
                raise Unavailable(f"the {name} kernel module is not prepared for this GPU and would need "
                                  f"compiling: {what}") from None
            print(f"note: the {name} kernel module is not prepared; its rows are left out")
            continue
        except Exception as e:
            raise Unavailable(f"loading the {name} kernel module failed: {type(e).__name__}: {e}") from None
        if name.startswith("prefill "):
            loaded.append(name.split()[1])
    return loaded


# ---------------------------------------------------------------------------------------------
# Timing and ceilings


def timed_calls(fns, flush, sleep_cycles=50_000_000):
    """Runs fns[i] for each i, each between its own events, after one flush; seconds each."""
    flush()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    torch.cuda._sleep(sleep_cycles)  # keeps the GPU busy while Python queues the calls
    for fn, (a, b) in zip(fns, events):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in events]


def timed_flushed(fn, reps, flush, sleep_cycles=4_000_000):
    """Runs fn reps times, the L2 flushed before each run (outside the timed span); seconds each."""
    times = []
    for _ in range(reps):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)  # Python queues the run's launches meanwhile
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return times


def read_bandwidth(flush, iters=20):
    """Best of two torch reductions (sum, amax) over a buffer of up to 4 GB: bytes per second."""
    free, _ = torch.cuda.mem_get_info()
    n = min(4 << 30, free // 4) // 4
    buf = torch.rand(n, device="cuda", dtype=torch.float32) + 0.5
    best = 0.0
    for op in (torch.sum, torch.amax):
        for _ in range(3):
            op(buf)
        t = statistics.median(timed_calls([lambda op=op: op(buf)] * iters, flush))
        best = max(best, buf.numel() * 4 / t)
    bytes_ = buf.numel() * 4
    del buf
    torch.cuda.empty_cache()
    return best, bytes_


def gemm_rate(iters=20):
    """bf16 GEMM rate of torch.matmul (cuBLAS) at 8192³: FLOP/s and seconds."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=BF16)
    b = torch.randn(n, n, device="cuda", dtype=BF16)
    for _ in range(3):
        torch.matmul(a, b)
    t = statistics.median(timed_calls([lambda: torch.matmul(a, b)] * iters, lambda: None))
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * n * n * n / t, t


# ---------------------------------------------------------------------------------------------
# Data


class Rng:
    def __init__(self, seed):
        self.gen = torch.Generator(device="cuda")
        self.gen.manual_seed(seed)
        self.cpu = torch.Generator()
        self.cpu.manual_seed(seed)

    def uniform(self, *shape, scale=1.0):
        """Uniform in [-scale, scale), bf16 generated in place (no fp32 temporaries)."""
        t = torch.rand(*shape, device="cuda", generator=self.gen, dtype=BF16)
        return t.mul_(2 * scale).sub_(scale)

    def perm(self, n):
        return torch.randperm(n, generator=self.cpu).to(device="cuda", dtype=torch.int32)


def pages_for(tokens, page_size):
    return (tokens + page_size - 1) // page_size


def paged_table(lengths, page_size, rng):
    """Page tables for requests of the given lengths over a shuffled pool: indptr, indices,
    last_page_len (int32 on the GPU) and the pool's page count."""
    counts = [pages_for(n, page_size) for n in lengths]
    total = sum(counts)
    indptr = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(lengths, counts)], dtype=torch.int32).cuda()
    return indptr, rng.perm(total), last, total


def gather_tokens(cache, indices, n_tokens):
    """The first n_tokens tokens of the pages `indices` of an NHD cache: (n_tokens, kv_heads, d)."""
    return cache[indices.long()].flatten(0, 1)[:n_tokens]


def reference_attention(q, k, v, causal_offset=None):
    """float32 softmax(q·kᵀ/√d)·v. q (n, heads, d), k/v (m, kv_heads, d). With causal_offset,
    row i sees keys [0, causal_offset + i]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    rep = heads // kv_heads
    qf = q.float().transpose(0, 1)  # heads, n, d
    kf = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # heads, m, d
    vf = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = qf @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        rows = torch.arange(n, device=q.device)[:, None] + causal_offset
        cols = torch.arange(m, device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).transpose(0, 1)  # n, heads, d


# ---------------------------------------------------------------------------------------------
# FlashInfer calls


def workspace():
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")


def decode_wrapper(fi, ws, indptr, indices, last, heads, kv_heads, page_size):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    w.plan(indptr, indices, last, heads, kv_heads, HEAD_DIM, page_size, q_data_type=BF16, kv_data_type=BF16)
    return w


def prefill_wrapper(fi, ws, backend, qo_indptr, indptr, indices, last, heads, kv_heads, page_size):
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(qo_indptr, indptr, indices, last, heads, kv_heads, HEAD_DIM, page_size, causal=True,
           q_data_type=BF16, kv_data_type=BF16)
    return w


def cascade_wrapper(fi, ws, B, prefix_pages, suffix_indptr, suffix_pages, prefix_last, suffix_last, heads,
                    kv_heads, page_size):
    w = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    qo = [torch.tensor([0, B], dtype=torch.int32, device="cuda"),
          torch.arange(B + 1, dtype=torch.int32, device="cuda")]
    kv_indptr = [torch.tensor([0, prefix_pages.numel()], dtype=torch.int32, device="cuda"), suffix_indptr]
    w.plan(qo, kv_indptr, [prefix_pages, suffix_pages], [prefix_last, suffix_last], heads, kv_heads, HEAD_DIM,
           page_size, causal=False, q_data_type=BF16, kv_data_type=BF16)
    return w


# ---------------------------------------------------------------------------------------------
# Checks against a float reference (small, odd shapes; before any timing)


class Checks:
    """Results per path (a key such as ("prefill", "fa3", 16)): a path whose check fails, or
    raises, is reported and never timed, and the run's exit status becomes 1."""

    def __init__(self):
        self.rows = []
        self.failed = {}  # key -> why

    def record(self, key, what, out, ref, tol):
        err = (out.float() - ref).abs().max().item()
        scale = ref.abs().max().item()
        good = math.isfinite(err) and err <= tol
        if not good:
            self.failed.setdefault(key, f"{what}: max|err| {err:.2e} > {tol:.0e}")
        print(f"check {what:<44} max|err| {err:.2e} (max|ref| {scale:.2e}, tol {tol:.0e}) "
              f"{'ok' if good else 'FAILED'}", flush=True)
        self.rows.append({"what": what, "max_abs_err": err, "max_abs_ref": scale, "tol": tol, "ok": good})

    def guard(self, key, what, fn, missing_error):
        """Runs one path's check; an exception (other than a missing module) fails the path."""
        try:
            fn()
        except missing_error:
            raise
        except Exception as e:  # FlashInfer refusing a configuration, for instance
            self.failed.setdefault(key, f"{what}: {type(e).__name__}: {e}")
            print(f"check {what:<44} FAILED: {type(e).__name__}: {e}", flush=True)
            torch.cuda.empty_cache()

    def passed(self, key):
        return key not in self.failed


def check_decode(fi, ws, checks, page_sizes, missing_error):
    for name, heads, kv_heads in DECODE_KINDS:
        for ps in page_sizes:
            checks.guard(("decode", ps), f"decode p{ps} {name}",
                         lambda: check_decode_path(fi, ws, checks, name, heads, kv_heads, ps), missing_error)


def check_decode_path(fi, ws, checks, name, heads, kv_heads, ps):
    lengths = [1, 37, 1000, 2049]  # a single key, partial last pages, a split-worthy context
    rng = Rng(11 + ps + kv_heads)
    indptr, indices, last, total = paged_table(lengths, ps, rng)
    k = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    v = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    q = rng.uniform(len(lengths), heads, HEAD_DIM, scale=4.0)
    out = decode_wrapper(fi, ws, indptr, indices, last, heads, kv_heads, ps).run(q, (k, v))
    for r, n in enumerate(lengths):
        pages = indices[indptr[r]:indptr[r + 1]]
        ref = reference_attention(q[r:r + 1], gather_tokens(k, pages, n), gather_tokens(v, pages, n))
        checks.record(("decode", ps), f"decode p{ps} {name} ctx {n}", out[r:r + 1], ref, 1e-2)


def check_prefill(fi, ws, checks, page_sizes, backends, missing_error):
    for name, heads, kv_heads in DECODE_KINDS:
        for backend in backends:
            for ps in page_sizes:
                checks.guard(("prefill", backend, ps), f"prefill {backend} p{ps} {name}",
                             lambda: check_prefill_path(fi, ws, checks, name, heads, kv_heads, backend, ps),
                             missing_error)


def check_prefill_path(fi, ws, checks, name, heads, kv_heads, backend, ps):
    lengths = [300, 517, 64]
    rng = Rng(23 + ps + kv_heads)
    indptr, indices, last, total = paged_table(lengths, ps, rng)
    k = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    v = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    qo = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    q = rng.uniform(sum(lengths), heads, HEAD_DIM, scale=4.0)
    out = prefill_wrapper(fi, ws, backend, qo, indptr, indices, last, heads, kv_heads, ps).run(q, (k, v))
    for r, n in enumerate(lengths):
        pages = indices[indptr[r]:indptr[r + 1]]
        rows = slice(int(qo[r]), int(qo[r + 1]))
        ref = reference_attention(q[rows], gather_tokens(k, pages, n), gather_tokens(v, pages, n), causal_offset=0)
        checks.record(("prefill", backend, ps), f"prefill {backend} p{ps} {name} chunk {n}", out[rows], ref, 1e-2)


def check_cascade(fi, ws, checks, page_sizes, missing_error):
    for model, heads, kv_heads in CASCADE_MODELS:
        for ps in page_sizes:
            checks.guard(("cascade", ps), f"cascade p{ps} {model}",
                         lambda: check_cascade_path(fi, ws, checks, model, heads, kv_heads, ps), missing_error)


def check_cascade_path(fi, ws, checks, model, heads, kv_heads, ps):
    B, S = 5, 37  # S: a partial last page of each row's own keys
    P = 1000 - 1000 % ps
    case = CascadeCase(fi, ws, Rng(31 + ps + kv_heads), B, P, S, heads, kv_heads, ps)
    out = case.run_cascade()
    plain = case.run_plain()
    for r in range(B):
        k = torch.cat([gather_tokens(case.k, case.prefix_pages, P), gather_tokens(case.k, case.suffix_pages_of(r), S)])
        v = torch.cat([gather_tokens(case.v, case.prefix_pages, P), gather_tokens(case.v, case.suffix_pages_of(r), S)])
        ref = reference_attention(case.q[r:r + 1], k, v)
        checks.record(("cascade", ps), f"cascade p{ps} {model} row {r}", out[r:r + 1], ref, 1e-2)
        checks.record(("cascade", ps), f"plain decode p{ps} {model} row {r}", plain[r:r + 1], ref, 1e-2)


# ---------------------------------------------------------------------------------------------
# Sections


def decode_section(fi, ws, args, checks, errors, flush, bw, l2_bytes, budget):
    batches, ctxs = ([1, 64, 256], [1024, 4096]) if args.quick else (DECODE_BATCHES, DECODE_CTXS)
    rows = []
    print("\n== decode (BatchDecodeWithPagedKVCacheWrapper, shuffled pages) ==")
    print(f"{'kind':<11} {'batch':>6} {'ctx':>6} {'splits':>6} {'time_us':>10} {'GB/s':>8} {'%peak':>6}")
    for name, heads, kv_heads in DECODE_KINDS:
        for ps in args.page_sizes:
            kind = f"fi_p{ps}_{name}"
            if not checks.passed(("decode", ps)):
                print(f"{kind:<11} skipped: its check FAILED")
                continue
            for b in batches:
                for c in ctxs:
                    kv_bytes = 2 * b * c * kv_heads * HEAD_DIM * 2
                    if kv_bytes * 1.05 > budget:
                        print(f"{kind:<11} {b:>6} {c:>6}   skipped: KV {kv_bytes / 1e9:.1f} GB > 60% of free memory")
                        continue
                    try:
                        row = run_decode_shape(fi, ws, kind, heads, kv_heads, ps, b, c, args.iters, l2_bytes, flush)
                    except torch.cuda.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        print(f"{kind:<11} {b:>6} {c:>6}   skipped: out of memory")
                        continue
                    except Exception as e:
                        report_error(errors, f"{kind} batch {b} ctx {c}", e)
                        continue
                    row["pct_peak"] = 100.0 * row["GBps"] / (bw * 1e-9)
                    flag = "" if row["finite"] else "  NON-FINITE OUTPUT"
                    print(f"{kind:<11} {b:>6} {c:>6} {'-':>6} {row['time_us']:>10.1f} {row['GBps']:>8.0f} "
                          f"{row['pct_peak']:>6.1f}{flag}", flush=True)
                    rows.append(row)
    return rows


def run_decode_shape(fi, ws, kind, heads, kv_heads, ps, batch, ctx, iters, l2_bytes, flush):
    kv_bytes = 2 * batch * ctx * kv_heads * HEAD_DIM * 2
    rot = max(1, min(WARMUP + iters, int(3 * l2_bytes / kv_bytes) + 1))
    rng = Rng(batch * 100003 + ctx + kv_heads + 7 * ps)
    indptr, indices, last, total = paged_table([ctx] * batch, ps, rng)
    q = rng.uniform(batch, heads, HEAD_DIM)
    kvs = [(rng.uniform(total, ps, kv_heads, HEAD_DIM), rng.uniform(total, ps, kv_heads, HEAD_DIM))
           for _ in range(rot)]
    w = decode_wrapper(fi, ws, indptr, indices, last, heads, kv_heads, ps)
    out = None

    def call(i):
        nonlocal out
        out = w.run(q, kvs[i % rot])

    for i in range(WARMUP):
        call(i)
    times = timed_calls([lambda i=i: call(WARMUP + i) for i in range(iters)], flush)
    finite = bool(torch.isfinite(out).all().item())
    del kvs, q, out, w
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"kind": kind, "heads": heads, "kv_heads": kv_heads, "head_dim": HEAD_DIM, "page_size": ps,
            "batch": batch, "ctx": ctx, "splits": None, "time_us": t * 1e6, "GBps": kv_bytes / t * 1e-9,
            "finite": finite}


def prefill_section(fi, ws, args, checks, errors, gemm_flops):
    chunks = [512, 4096] if args.quick else PREFILL_CHUNKS
    reps = max(10, args.reps)
    rows = []
    print("\n== prefill (BatchPrefillWithPagedKVCacheWrapper, causal, fresh chunks, shuffled pages) ==")
    print(f"{'kind':<16} {'chunk':>6} {'batch':>6} {'time_ms':>10} {'TFLOP/s':>9} {'%gemm':>7}")
    for name, heads, kv_heads in [("gqa", 32, 8), ("mha", 32, 32)]:
        for backend in args.backends:
            for ps in args.page_sizes:
                kind = f"fi_{backend}_p{ps}_{name}"
                if not checks.passed(("prefill", backend, ps)):
                    print(f"{kind:<16} skipped: its check FAILED")
                    continue
                for chunk in chunks:
                    try:
                        row = run_prefill_shape(fi, ws, kind, backend, ps, heads, kv_heads, chunk, reps)
                    except Exception as e:
                        report_error(errors, f"{kind} chunk {chunk}", e)
                        continue
                    row["pct_gemm"] = 100.0 * row["tflops"] * 1e12 / gemm_flops
                    flag = "" if row["finite"] else "  NON-FINITE OUTPUT"
                    print(f"{kind:<16} {chunk:>6} {row['batch']:>6} {row['time_ms']:>10.3f} {row['tflops']:>9.1f} "
                          f"{row['pct_gemm']:>7.1f}{flag}", flush=True)
                    rows.append(row)
    return rows


def run_prefill_shape(fi, ws, kind, backend, ps, heads, kv_heads, chunk, reps):
    batch = PREFILL_TOKENS // chunk
    rng = Rng(chunk + kv_heads + ps)
    indptr, indices, last, total = paged_table([chunk] * batch, ps, rng)
    qo = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * chunk
    q = rng.uniform(PREFILL_TOKENS, heads, HEAD_DIM)
    k = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    v = rng.uniform(total, ps, kv_heads, HEAD_DIM)
    w = prefill_wrapper(fi, ws, backend, qo, indptr, indices, last, heads, kv_heads, ps)
    out = None

    def call():
        nonlocal out
        out = w.run(q, (k, v))

    for _ in range(WARMUP):
        call()
    t = statistics.median(timed_calls([call] * reps, lambda: None))
    finite = bool(torch.isfinite(out).all().item())
    flops = 4.0 * HEAD_DIM * heads * batch * (chunk * (chunk + 1) / 2.0)
    del q, k, v, w, out
    torch.cuda.empty_cache()
    return {"kind": kind, "backend": backend, "page_size": ps, "heads": heads, "kv_heads": kv_heads, "chunk": chunk,
            "batch": batch, "time_ms": t * 1e3, "tflops": flops / t / 1e12, "finite": finite}


def report_error(errors, what, e):
    """A configuration FlashInfer refused or failed on: printed, kept for the JSON, exit status 1.
    A module that would need compiling is not such an error: it ends the run (status 2)."""
    if type(e).__name__ == "MissingJITCacheError":
        raise e
    msg = f"{what}: {type(e).__name__}: {e}"
    print(f"error: {msg}", flush=True)
    errors.append(msg)
    torch.cuda.empty_cache()


class CascadeCase:
    """One cascade configuration: a pool of P + B·S keys in shuffled pages, q, both wrappers."""

    def __init__(self, fi, ws, rng, B, P, S, heads, kv_heads, ps):
        self.B, self.P, self.S, self.ps = B, P, S, ps
        np_, ns = pages_for(P, ps), pages_for(S, ps)
        total = np_ + B * ns
        perm = rng.perm(total)
        self.prefix_pages = perm[:np_].contiguous()
        self.suffix_pages = perm[np_:].contiguous()
        self.ns = ns
        self.k = rng.uniform(total, ps, kv_heads, HEAD_DIM)
        self.v = rng.uniform(total, ps, kv_heads, HEAD_DIM)
        self.q = rng.uniform(B, heads, HEAD_DIM, scale=4.0)  # scores of std ≈ 0.8, as the tandem bench
        prefix_last = torch.tensor([P - (np_ - 1) * ps], dtype=torch.int32, device="cuda")
        suffix_last = torch.full((B,), S - (ns - 1) * ps, dtype=torch.int32, device="cuda")
        suffix_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * ns
        # plain: every row's prefix pages then its own pages (a partial last prefix page would sit
        # mid-context: P must fill whole pages).
        if P % ps != 0:
            raise ValueError(f"cascade: prefix {P} is not a multiple of the page size {ps}")
        plain_indices = torch.cat([self.prefix_pages.repeat(B, 1), self.suffix_pages.view(B, ns)], 1).flatten()
        plain_indptr = torch.arange(B + 1, dtype=torch.int32, device="cuda") * (np_ + ns)
        self.plain = decode_wrapper(fi, ws, plain_indptr, plain_indices.contiguous(), suffix_last, heads,
                                    kv_heads, ps)
        self.cascade = cascade_wrapper(fi, ws, B, self.prefix_pages, suffix_indptr, self.suffix_pages,
                                       prefix_last, suffix_last, heads, kv_heads, ps)

    def suffix_pages_of(self, r):
        return self.suffix_pages[r * self.ns:(r + 1) * self.ns]

    def run_plain(self):
        return self.plain.run(self.q, (self.k, self.v))

    def run_cascade(self):
        return self.cascade.run(self.q, (self.k, self.v))


def cascade_section(fi, ws, args, checks, errors, flush, budget):
    if args.quick:
        batches, prefixes, suffixes = [64, 256], [4096, 32768], [64]
    else:
        batches, prefixes, suffixes = CASCADE_BATCHES, CASCADE_PREFIXES, CASCADE_SUFFIXES
    reps = max(3, args.cascade_reps)
    rows = []
    ok = True
    print("\n== cascade (MultiLevelCascadeAttentionWrapper, 2 levels, against the decode wrapper; L2 flushed "
          "before each run) ==")
    print(f"{'model':<9} {'ps':>3} {'B':>4} {'P':>6} {'S':>5} | {'plain_us':>9} {'GB/s':>6} | {'casc_us':>9} "
          f"{'speedup':>7} | {'max|d|':>8} {'rel':>8}")
    for model, heads, kv_heads in CASCADE_MODELS:
        for ps in args.page_sizes:
            if not checks.passed(("cascade", ps)):
                print(f"{model:<9} {ps:>3} skipped: its check FAILED")
                continue
            for B in batches:
                for P in prefixes:
                    for S in suffixes:
                        kv_bytes = 2 * (P + B * S) * kv_heads * HEAD_DIM * 2
                        if kv_bytes * 1.05 > budget:
                            print(f"{model:<9} {ps:>3} {B:>4} {P:>6} {S:>5}   skipped: {kv_bytes / 1e9:.1f} GB > 60% "
                                  "of free memory")
                            continue
                        try:
                            row = run_cascade_config(fi, ws, model, heads, kv_heads, ps, B, P, S, reps, flush)
                        except torch.cuda.OutOfMemoryError:
                            torch.cuda.empty_cache()
                            print(f"{model:<9} {ps:>3} {B:>4} {P:>6} {S:>5}   skipped: out of memory")
                            continue
                        except Exception as e:
                            report_error(errors, f"cascade {model} p{ps} B {B} P {P} S {S}", e)
                            continue
                        ok &= row["ok"]
                        print(f"{model:<9} {ps:>3} {B:>4} {P:>6} {S:>5} | {row['plain_us']:>9.1f} "
                              f"{row['plain_GBps']:>6.0f} | {row['cascade_us']:>9.1f} {row['speedup']:>6.2f}x | "
                              f"{row['max_abs_diff']:>8.1e} {row['rel_diff']:>8.1e}"
                              f"{'' if row['ok'] else '  MISMATCH'}", flush=True)
                        rows.append(row)
    return rows, ok


def run_cascade_config(fi, ws, model, heads, kv_heads, ps, B, P, S, reps, flush):
    case = CascadeCase(fi, ws, Rng(B * 7919 + P + S + kv_heads + ps), B, P, S, heads, kv_heads, ps)
    for _ in range(2):
        case.run_plain()
        case.run_cascade()
    plain_out = case.run_plain().float()
    casc_out = case.run_cascade().float()
    diff = (plain_out - casc_out).abs().max().item()
    rel = diff / max(plain_out.abs().max().item(), 1e-30)
    del plain_out, casc_out
    plain_t = statistics.median(timed_flushed(case.run_plain, reps, flush))
    casc_t = statistics.median(timed_flushed(case.run_cascade, reps, flush))
    del case
    torch.cuda.empty_cache()
    read_bytes = 2.0 * B * (P + S) * kv_heads * HEAD_DIM * 2  # every row's K and V
    return {"model": model, "heads": heads, "kv_heads": kv_heads, "page_size": ps, "B": B, "P": P, "S": S,
            "plain_us": plain_t * 1e6, "plain_GBps": read_bytes / plain_t * 1e-9, "cascade_us": casc_t * 1e6,
            "speedup": plain_t / casc_t, "max_abs_diff": diff, "rel_diff": rel,
            "ok": math.isfinite(diff) and rel <= 2e-2}


# ---------------------------------------------------------------------------------------------


def parse_list(text, allowed=None):
    items = [x.strip() for x in text.split(",") if x.strip()]
    if allowed is not None:
        for x in items:
            if x not in allowed:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(allowed)}")
    return items


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a handful of shapes per section (under a minute)")
    ap.add_argument("--sections", default="decode,prefill,cascade",
                    type=lambda s: parse_list(s, ["decode", "prefill", "cascade"]))
    ap.add_argument("--page-sizes", default="1,16", type=lambda s: [int(x) for x in parse_list(s)])
    ap.add_argument("--backends", default=None, type=lambda s: parse_list(s, PREFILL_BACKENDS),
                    help="prefill backends (fa3: FlashInfer's default on sm_90); default: fa3, and fa2 "
                         "where its kernels are prepared")
    ap.add_argument("--iters", type=int, default=30, help="decode: timed calls per shape")
    ap.add_argument("--reps", type=int, default=20, help="prefill: timed runs per configuration")
    ap.add_argument("--cascade-reps", type=int, default=10, help="cascade: timed runs per configuration")
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args()
    args.iters = max(5, args.iters)
    if any(ps < 1 for ps in args.page_sizes):
        ap.error("--page-sizes: each page size must be >= 1")
    if args.quick:
        args.iters = min(args.iters, 10)
        args.reps = min(args.reps, 5)
        args.cascade_reps = min(args.cascade_reps, 5)
    # FlashInfer writes each module's generated sources under its workspace even when the module
    # itself is loaded from the prepared copy: a temporary folder, set before flashinfer is imported.
    workspace_dir = tempfile.mkdtemp(prefix="flashinfer-ws-")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = workspace_dir
    try:
        return run(args)
    except Unavailable as e:
        fail_unavailable(str(e))
    finally:
        shutil.rmtree(workspace_dir, ignore_errors=True)


def run(args):
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device")
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        raise Unavailable(f"the prepared kernels are for sm_90a (H100/H200); this GPU is sm_{cap[0]}{cap[1]}")
    fi, missing_error = import_flashinfer()
    wanted = list(args.backends or ["fa3"]) if "prefill" in args.sections else []
    optional = ["fa2"] if args.backends is None and "prefill" in args.sections else []
    required = wanted + (["fa3"] if "cascade" in args.sections and "fa3" not in wanted else [])
    # (the cascade wrapper's levels take FlashInfer's default backend, fa3 on sm_90)
    loaded = load_modules(fi, missing_error, required, optional)
    args.backends = [b for b in PREFILL_BACKENDS if b in loaded and (b in wanted or b in optional)]
    try:
        return measure(fi, args, missing_error)
    except missing_error as e:  # a module nobody loaded up front (a path this script did not foresee)
        raise Unavailable(f"a kernel module would need compiling: {e}") from None


def measure(fi, args, missing_error):
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    flush_buf = torch.empty(max(4 * l2_bytes, 256 << 20), dtype=torch.uint8, device="cuda")

    def flush():
        flush_buf.random_(0, 255)

    ws = workspace()
    checks = Checks()
    print(f"device: {props.name} ({props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"flashinfer {fi.__version__})")
    if "decode" in args.sections:
        check_decode(fi, ws, checks, args.page_sizes, missing_error)
    if "prefill" in args.sections:
        check_prefill(fi, ws, checks, args.page_sizes, args.backends, missing_error)
    if "cascade" in args.sections:
        check_cascade(fi, ws, checks, args.page_sizes, missing_error)
    for key, why in checks.failed.items():
        print(f"CHECK FAILED, not timed: {' '.join(map(str, key))}: {why}", file=sys.stderr, flush=True)

    bw, bw_bytes = read_bandwidth(flush)
    gemm_flops, gemm_t = gemm_rate()
    free, _ = torch.cuda.mem_get_info()
    budget = 0.6 * free
    print(f"read bandwidth (best of sum/amax over {bw_bytes / 1e9:.1f} GB): {bw * 1e-9:.0f} GB/s")
    print(f"bf16 GEMM 8192^3 (torch.matmul): {gemm_t * 1e3:.3f} ms, {gemm_flops / 1e12:.1f} TFLOP/s")
    result = {"device": props.name, "torch": torch.__version__, "flashinfer": fi.__version__,
              "read_bandwidth_GBps": bw * 1e-9, "gemm_tflops": gemm_flops / 1e12, "iters": args.iters,
              "reps": args.reps, "cascade_reps": args.cascade_reps, "page_sizes": args.page_sizes,
              "checks": checks.rows, "failed_checks": {" ".join(map(str, k)): v for k, v in checks.failed.items()},
              "errors": []}
    status = 1 if checks.failed else 0
    if "decode" in args.sections:
        result["decode"] = decode_section(fi, ws, args, checks, result["errors"], flush, bw, l2_bytes, budget)
        status |= 0 if all(r["finite"] for r in result["decode"]) else 1
    if "prefill" in args.sections:
        result["prefill"] = prefill_section(fi, ws, args, checks, result["errors"], gemm_flops)
        status |= 0 if all(r["finite"] for r in result["prefill"]) else 1
    if "cascade" in args.sections:
        result["cascade"], ok = cascade_section(fi, ws, args, checks, result["errors"], flush, budget)
        status |= 0 if ok else 1
    status |= 1 if result["errors"] else 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    for key, why in checks.failed.items():
        print(f"CHECK FAILED, not timed: {' '.join(map(str, key))}: {why}", file=sys.stderr)
    for e in result["errors"]:
        print(f"ERROR: {e}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
