#!/usr/bin/env python3
"""Compares two `tandem generate --json --logprobs` outputs: the same requests, finish reasons and
token ids, and log-probabilities within a tolerance. For runs whose numerics may differ in the last
bits (pipelined micro-batches run the linear layers over fewer rows at a time, and a GEMM's
rounding can depend on its row count).

Usage: compare_results.py A.json B.json TOLERANCE   (exit 0 when they match, 1 with the first
difference on stderr)"""
import json
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    a_path, b_path, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with open(a_path) as fa, open(b_path) as fb:
        a = [json.loads(line) for line in fa if line.strip()]
        b = [json.loads(line) for line in fb if line.strip()]
    if len(a) != len(b):
        sys.exit(f"{len(a)} results in {a_path} but {len(b)} in {b_path}")
    worst = 0.0
    for i, (x, y) in enumerate(zip(a, b)):
        for key in ("index", "finish_reason", "token_ids"):
            if x.get(key) != y.get(key):
                sys.exit(f"result {i}: {key} {x.get(key)} != {y.get(key)}")
        lx, ly = x.get("logprobs", []), y.get("logprobs", [])
        if len(lx) != len(ly):
            sys.exit(f"result {i}: {len(lx)} logprobs != {len(ly)}")
        for t, (p, q) in enumerate(zip(lx, ly)):
            worst = max(worst, abs(p - q))
            if abs(p - q) > tol:
                sys.exit(f"result {i} token {t}: logprob {p} vs {q} differs by more than {tol}")
    print(f"{len(a)} results: same tokens, max |logprob difference| {worst:.3g}")


if __name__ == "__main__":
    main()
