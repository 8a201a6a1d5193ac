#!/usr/bin/env python3
"""bench/mooncake_bench on a tiny trace it writes: four conversations of three turns, each turn's
hash_ids extending the previous turn's, interleaved so that a KV pool of one request's context
evicts a conversation's blocks before its next turn. The three modes must give the same tokens;
recompute reuses nothing, tiers restore evicted blocks and reuse more prompt tokens than the
pool-only prefix cache, and never more than a perfect cache could.
Usage: mooncake_bench_test.py path/to/mooncake_bench"""
import json
import os
import subprocess
import sys
import tempfile


def main():
    bench = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.jsonl")
        rows = []
        next_id = 1
        history = {c: [0] for c in range(4)}  # id 0: a system prompt every conversation shares
        for turn in range(3):
            for c in range(4):
                history[c] = history[c] + list(range(next_id, next_id + 2))
                next_id += 2
                ids = history[c]
                rows.append({"timestamp": 100 * len(rows), "input_length": 512 * (len(ids) - 1) + 200,
                             "output_length": 30, "hash_ids": ids})
        with open(trace, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        out = os.path.join(tmp, "out.json")
        cmd = [bench, "--trace", trace, "--requests", "12", "--model", "tiny-gqa", "--block-tokens", "16",
               "--max-output", "2", "--time-scale", "0", "--max-batch", "1", "--kv-tokens", "128",
               "--step-tokens", "128", "--json", out]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stdout}\n{p.stderr}")
        j = json.load(open(out))
        m = j["modes"]
        failures = []
        if not j["tokens_identical"]:
            failures.append("tokens differ between modes")
        if j["shape"]["requests"] != 12:
            failures.append(f"requests {j['shape']['requests']}, expected 12")
        for mode in ("recompute", "prefix", "tiers"):
            if "error" in m[mode]:
                failures.append(f"{mode}: {m[mode]['error']}")
        if not failures:
            if m["recompute"]["reused_tokens"] != 0:
                failures.append(f"recompute reused {m['recompute']['reused_tokens']} tokens")
            if m["tiers"]["tiers"]["restored_blocks"] <= 0:
                failures.append("tiers restored no block")
            if m["tiers"]["reused_tokens"] <= m["prefix"]["reused_tokens"]:
                failures.append(f"tiers reused {m['tiers']['reused_tokens']} tokens, prefix "
                                f"{m['prefix']['reused_tokens']}: tiers should reuse more")
            if m["tiers"]["reused_tokens"] > j["shape"]["reusable_tokens"]:
                failures.append(f"tiers reused {m['tiers']['reused_tokens']} tokens, more than a perfect "
                                f"cache's {j['shape']['reusable_tokens']}")
            for mode in ("recompute", "prefix", "tiers"):
                total = m[mode]["prefilled_tokens"] + m[mode]["reused_tokens"]
                if total != j["shape"]["prompt_tokens"]:
                    failures.append(f"{mode}: prefilled + reused = {total}, prompts hold "
                                    f"{j['shape']['prompt_tokens']} tokens")
        # A bad flag fails with one line naming it.
        p = subprocess.run([bench, "--trace", trace, "--modes", "recompute,cache"], capture_output=True,
                           text=True, timeout=60)
        if p.returncode == 0 or "--modes" not in p.stderr:
            failures.append(f"--modes cache: expected a failure naming --modes, got {p.returncode}: {p.stderr}")
        if failures:
            print(p.stdout)
            sys.exit("FAIL: " + "; ".join(failures))
        print(f"ok: tiers reused {m['tiers']['reused_tokens']} prompt tokens, prefix "
              f"{m['prefix']['reused_tokens']}, a perfect cache {j['shape']['reusable_tokens']}")


if __name__ == "__main__":
    main()
