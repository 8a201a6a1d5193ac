#!/usr/bin/env python3
"""Plots of `tandem bench` results (bench.json, schema tandem-bench/1; loadgen/report.h).

    .cache/venv/bin/python bench/plot_bench.py OUT/bench.json [MORE.json ...] [--out DIR] [--labels A,B]

Writes into DIR (default: the first file's directory):
  latency_cdf.png         CDFs of TTFT, TPOT and end-to-end latency, one line per run of every file
  throughput_vs_rate.png  output tokens/s and goodput (requests/s within the SLO) against the offered
                          rate (runs without a rate are plotted at their measured request rate)
  cost_vs_latency.png     output tokens per dollar against median and p90 TPOT (priced runs only)
Several files (e.g. colocated and a deployment on the same trace) share the axes, labelled by
--labels or by each file's target. Needs matplotlib (scripts/install_deps.sh puts it in .cache/venv).
Exits 77 when matplotlib is missing, 1 on a bad file.
"""
import argparse
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot_bench: {path}: {e}")
    if data.get("schema") != "tandem-bench/1":
        sys.exit(f"plot_bench: {path}: not a tandem bench result (schema {data.get('schema')!r})")
    return data


def cdf(values):
    xs = sorted(values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", help="directory for the PNGs (default: the first file's)")
    ap.add_argument("--labels", help="comma-separated label per file")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_bench: matplotlib is not installed (scripts/install_deps.sh puts it in .cache/venv)",
              file=sys.stderr)
        sys.exit(77)
    results = [load(p) for p in args.files]
    labels = args.labels.split(",") if args.labels else [r["target"] for r in results]
    if len(labels) != len(results):
        sys.exit("plot_bench: --labels needs one label per file")
    out = args.out or os.path.dirname(os.path.abspath(args.files[0]))
    os.makedirs(out, exist_ok=True)
    written = []

    # Latency CDFs.
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r, label in zip(results, labels):
        for run in r["runs"]:
            reqs = [q for q in run["requests"] if q["e2e"] is not None]
            name = f"{label}: {run['label']}" if len(results) > 1 or len(r["runs"]) > 1 else run["label"]
            for ax, key in zip(axes, ("ttft", "tpot", "e2e")):
                vals = [q[key] * 1e3 for q in reqs if q[key] is not None]
                if vals:
                    xs, ys = cdf(vals)
                    ax.step(xs, ys, where="post", label=name)
    for ax, title in zip(axes, ("time to first token", "time per output token", "end-to-end latency")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{results[0]['workload']['name']} ({results[0]['model']})", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "latency_cdf.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Throughput against offered rate.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax2 = ax.twinx()
    for r, label in zip(results, labels):
        runs = r["runs"]
        xs = [run["arrivals"]["rate"] or run["metrics"]["request_throughput"] for run in runs]
        order = sorted(range(len(runs)), key=lambda i: xs[i])
        ax.plot([xs[i] for i in order], [runs[i]["metrics"]["output_throughput"] for i in order], "o-",
                label=f"{label}: output tok/s")
        if any(r["slo"][k] > 0 for k in ("ttft_s", "tpot_s", "e2e_s")):
            ax2.plot([xs[i] for i in order], [runs[i]["metrics"]["goodput"] for i in order], "s--",
                     label=f"{label}: goodput req/s")
    ax.set_xlabel("offered rate, requests/s (measured rate where none was set)")
    ax.set_ylabel("output tokens/s")
    ax2.set_ylabel("goodput, requests/s within the SLO")
    ax.grid(alpha=0.3)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="upper left")
    fig.tight_layout()
    path = os.path.join(out, "throughput_vs_rate.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    # Tokens per dollar against latency.
    priced = [(r, label) for r, label in zip(results, labels) if r["cost"]["priced"]]
    if priced:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r, label in priced:
            usd_h = r["cost"]["usd_per_hour"]
            pts = [(run["metrics"]["tpot"]["median"] * 1e3, run["metrics"]["tpot"]["p90"] * 1e3,
                    run["metrics"]["output_throughput"] * 3600 / usd_h / 1e6, run["label"]) for run in r["runs"]]
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=f"{label} (median TPOT)")
            ax.plot([p[1] for p in pts], [p[2] for p in pts], "x:", label=f"{label} (p90 TPOT)")
            for p in pts:
                ax.annotate(p[3], (p[0], p[2]), fontsize=7)
        dates = sorted({r["cost"]["price_table_date"] for r, _ in priced})
        ax.set_xlabel("time per output token, ms")
        ax.set_ylabel("million output tokens per dollar")
        ax.set_title(f"prices: {', '.join(r['cost']['devices'] for r, _ in priced)}\n(price table dated "
                     f"{', '.join(dates)})", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, "cost_vs_latency.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    else:
        print("plot_bench: no priced run (give tandem bench --compute-device); cost_vs_latency.png not drawn",
              file=sys.stderr)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
