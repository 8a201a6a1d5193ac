#!/usr/bin/env python3
"""Checks a `tandem bench` result file against itself (bench_test.sh).

    check_bench_json.py bench.json N [--runs K] [--priced] [--slo] [--prefix-hits] [--sessions] [--interrupted]

Every run must list N requests; unless --interrupted every request must be complete (tokens as
many as its output tokens, in time order, after its arrival); the metrics must equal what the
per-request timings give (TTFT, TPOT, E2E statistics, token throughputs, goodput under the SLO);
a priced run's $ per million tokens must follow from its $/h and tokens/s, dated as
deploy/prices.yaml. Exits non-zero with the first mismatch.
"""
import argparse
import json
import math
import os
import re
import sys


def quantile(sorted_values, q):
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(len(sorted_values) - 1, lo + 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def close(a, b, what, rel=1e-6):
    if not math.isclose(a, b, rel_tol=rel, abs_tol=1e-9):
        sys.exit(f"{what}: {a} != {b}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("n", type=int)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--priced", action="store_true")
    ap.add_argument("--slo", action="store_true")
    ap.add_argument("--prefix-hits", action="store_true")
    ap.add_argument("--sessions", action="store_true")
    ap.add_argument("--interrupted", action="store_true")
    a = ap.parse_args()
    with open(a.file) as f:
        j = json.load(f)
    if j["schema"] != "tandem-bench/1":
        sys.exit("schema")
    if len(j["runs"]) != a.runs:
        sys.exit(f"{len(j['runs'])} runs, expected {a.runs}")
    if j["interrupted"] != a.interrupted:
        sys.exit(f"interrupted is {j['interrupted']}")
    if a.priced:
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "prices.yaml")
        date = re.search(r'^date:\s*"?([0-9-]+)"?', open(src).read(), re.M).group(1)
        if j["cost"]["price_table_date"] != date or not j["cost"]["usd_per_hour"] > 0:
            sys.exit(f"cost {j['cost']} (table date {date})")
    slo = j["slo"]
    for run in j["runs"]:
        reqs = run["requests"]
        m = run["metrics"]
        if len(reqs) != a.n or m["requests"] != a.n:
            sys.exit(f"{run['label']}: {len(reqs)} requests, expected {a.n}")
        done = [q for q in reqs if q["error"] == "" and q["end"] >= 0 and q["token_times"]]
        for q in reqs:
            t = q["token_times"]
            if t != sorted(t):
                sys.exit(f"request {q['index']}: token times out of order")
            if t and t[0] < q["arrival"] - 1e-9:
                sys.exit(f"request {q['index']}: first token before arrival")
        if a.interrupted:
            if not (m["unfinished"] > 0 and m["completed"] < a.n and any(q["token_times"] for q in reqs)):
                sys.exit(f"interrupted run: {m['completed']} completed, {m['unfinished']} unfinished")
        else:
            if len(done) != a.n:
                bad = [q for q in reqs if q not in done][:3]
                sys.exit(f"{run['label']}: {a.n - len(done)} requests incomplete: {bad}")
            for q in done:
                if len(q["token_times"]) != q["output_tokens"] or q["finish_reason"] != "length":
                    sys.exit(f"request {q['index']}: {len(q['token_times'])} token times, {q['output_tokens']} "
                             f"tokens, finish {q['finish_reason']}")
        if m["completed"] != len(done):
            sys.exit(f"completed {m['completed']} != {len(done)}")
        if not done:
            continue
        start = min(q["arrival"] for q in reqs if q["sent"] >= 0)
        duration = max(q["end"] for q in done) - start
        close(m["duration_s"], duration, "duration")
        out = sum(q["output_tokens"] for q in done)
        inp = sum(q["prompt_tokens"] for q in done)
        close(m["output_throughput"], out / duration, "output tok/s")
        close(m["input_throughput"], inp / duration, "input tok/s")
        close(m["request_throughput"], len(done) / duration, "requests/s")
        ttft = sorted(q["token_times"][0] - q["arrival"] for q in done)
        close(m["ttft"]["mean"], sum(ttft) / len(ttft), "TTFT mean")
        close(m["ttft"]["median"], quantile(ttft, 0.5), "TTFT median")
        close(m["ttft"]["p99"], quantile(ttft, 0.99), "TTFT p99")
        tp = {q["index"]: (q["token_times"][-1] - q["token_times"][0]) / (len(q["token_times"]) - 1)
              for q in done if len(q["token_times"]) > 1}
        tpot = sorted(tp.values())
        if tpot:
            close(m["tpot"]["mean"], sum(tpot) / len(tpot), "TPOT mean")
            close(m["tpot"]["p90"], quantile(tpot, 0.9), "TPOT p90")
        e2e = sorted(q["end"] - q["arrival"] for q in done)
        close(m["e2e"]["p90"], quantile(e2e, 0.9), "E2E p90")
        for q in done:
            close(q["ttft"], q["token_times"][0] - q["arrival"], f"request {q['index']} ttft")
        if a.slo:
            good = sum(1 for q in done
                       if (slo["ttft_s"] <= 0 or q["token_times"][0] - q["arrival"] <= slo["ttft_s"])
                       and (slo["tpot_s"] <= 0 or tp.get(q["index"], 0) <= slo["tpot_s"])
                       and (slo["e2e_s"] <= 0 or q["end"] - q["arrival"] <= slo["e2e_s"]))
            if good != m["good"]:
                sys.exit(f"good {m['good']} != {good}")
            close(m["goodput"], good / duration, "goodput")
        if a.priced:
            c = run["cost"]
            close(c["usd_per_million_output_tokens"], c["usd_per_hour"] / 3600 / m["output_throughput"] * 1e6, "$/M")
        if a.prefix_hits:
            cached = sum(q["cached_tokens"] for q in done)
            if not cached > 0:
                sys.exit(f"{run['label']}: no prefix hits")
            close(m["prefix_hit_rate"], cached / inp, "prefix hit rate")
        if a.sessions:
            by = {}
            for q in reqs:
                by.setdefault(q["session"], []).append(q)
            for s, turns in by.items():
                turns.sort(key=lambda q: q["turn"])
                for prev, q in zip(turns, turns[1:]):
                    if q["arrival"] < prev["end"] - 1e-9 or q["prompt_tokens"] <= prev["prompt_tokens"]:
                        sys.exit(f"session {s} turn {q['turn']}: arrival {q['arrival']} before {prev['end']} or "
                                 f"prompt {q['prompt_tokens']} <= {prev['prompt_tokens']}")
    print("ok")


if __name__ == "__main__":
    main()
