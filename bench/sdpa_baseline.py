#!/usr/bin/env python3
"""torch scaled_dot_product_attention baseline for decode attention (bench/decode_attention_bench).

Same shapes and row format as the C++ benchmark: q (B, H, 1, D), k/v (B, Hkv, L, D) bf16 on CUDA,
GQA through enable_gqa=True (K/V are not expanded, so the bytes an ideal kernel reads are the same
as for tandem). KV is contiguous per request here (SDPA has no slot table), which favours SDPA.
GB/s counts the K and V bytes only. %peak is against the read bandwidth measured here by a sum over
a 2+ GB buffer. Timing: fresh random data per shape, L2 flushed, the launches queued behind a
sleep kernel (so Python launch overhead is not timed), one pair of CUDA events per call, median.

    python3 bench/sdpa_baseline.py [--quick] [--iters N] [--json PATH]

Rows: kind batch ctx splits time_us GB/s %peak (kind sdpa_mha / sdpa_gqa; splits "-").
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

KINDS = [("sdpa_mha", 32, 32, 128), ("sdpa_gqa", 32, 8, 128)]
BATCHES = [1, 8, 64, 256, 512]
CTXS = [128, 1024, 4096, 16384, 32768]
WARMUP = 3


def timed_calls(fns, flush):
    """Runs fns[i] for each i, each between its own events, after a flush; returns seconds each."""
    flush()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    torch.cuda._sleep(50_000_000)  # keeps the GPU busy while Python queues the calls
    for fn, (a, b) in zip(fns, events):
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in events]


def read_bandwidth(flush, iters=20):
    free, _ = torch.cuda.mem_get_info()
    n = min(4 << 30, free // 4) // 4  # float32 elements, up to 4 GB
    buf = torch.rand(n, device="cuda", dtype=torch.float32) + 0.5
    for _ in range(3):
        buf.sum()
    times = timed_calls([lambda: buf.sum()] * iters, flush)
    bytes_ = buf.numel() * 4
    del buf
    torch.cuda.empty_cache()
    return bytes_ / statistics.median(times), bytes_


def run_shape(name, heads, kv_heads, d, batch, ctx, iters, l2_bytes, flush):
    kv_bytes = 2 * batch * ctx * kv_heads * d * 2
    # Several K/V copies when small, so that consecutive calls do not find their KV in L2.
    rot = max(1, min(WARMUP + iters, int(3 * l2_bytes / kv_bytes) + 1))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(batch * 100003 + ctx + kv_heads)

    def rand(*shape):  # uniform in [-1, 1), generated in bf16 without fp32 temporaries
        return torch.rand(*shape, device="cuda", generator=gen, dtype=torch.bfloat16).mul_(2).sub_(1)

    q = rand(batch, heads, 1, d)
    kvs = [(rand(batch, kv_heads, ctx, d), rand(batch, kv_heads, ctx, d)) for _ in range(rot)]
    gqa = heads != kv_heads
    out = None

    def call(i):
        nonlocal out
        k, v = kvs[i % rot]
        if gqa:
            out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v)

    for i in range(WARMUP):
        call(i)
    times = timed_calls([lambda i=i: call(WARMUP + i) for i in range(iters)], flush)
    finite = bool(torch.isfinite(out).all().item())
    del kvs, q, out
    torch.cuda.empty_cache()
    t = statistics.median(times)
    return {"kind": name, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "batch": batch, "ctx": ctx,
            "splits": None, "time_us": t * 1e6, "GBps": kv_bytes / t * 1e-9, "finite": finite}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small subset of shapes")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="also write the results as JSON to this path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    iters = max(5, args.iters)
    batches, ctxs = (([1, 64, 256], [1024, 4096]) if args.quick else (BATCHES, CTXS))

    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    flush_buf = torch.empty(max(4 * l2_bytes, 256 << 20), dtype=torch.uint8, device="cuda")

    def flush():
        flush_buf.random_(0, 255)

    bw, bw_bytes = read_bandwidth(flush)
    free, _ = torch.cuda.mem_get_info()
    budget = 0.6 * free
    print(f"device: {props.name} ({props.multi_processor_count} SMs, torch {torch.__version__}, {free / 1e9:.1f} GB free)")
    print(f"read bandwidth (sum over {bw_bytes / 1e9:.1f} GB): {bw * 1e-9:.0f} GB/s")
    print(f"{'kind':<8} {'batch':>6} {'ctx':>6} {'splits':>6} {'time_us':>10} {'GB/s':>8} {'%peak':>6}")
    rows = []
    for name, heads, kv_heads, d in KINDS:
        for b in batches:
            for c in ctxs:
                kv_bytes = 2 * b * c * kv_heads * d * 2
                if kv_bytes * 1.05 > budget:
                    print(f"{name:<8} {b:>6} {c:>6}   skipped: KV {kv_bytes / 1e9:.1f} GB > 60% of free memory")
                    continue
                try:
                    row = run_shape(name, heads, kv_heads, d, b, c, iters, l2_bytes, flush)
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    print(f"{name:<8} {b:>6} {c:>6}   skipped: out of memory")
                    continue
                row["pct_peak"] = 100.0 * row["GBps"] / (bw * 1e-9)
                flag = "" if row["finite"] else "  NON-FINITE OUTPUT"
                print(f"{name:<8} {b:>6} {c:>6} {'-':>6} {row['time_us']:>10.1f} {row['GBps']:>8.0f} "
                      f"{row['pct_peak']:>6.1f}{flag}", flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "read_bandwidth_GBps": bw * 1e-9,
                       "iters": iters, "rows": rows}, f, indent=2)
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
