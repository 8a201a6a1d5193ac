#!/usr/bin/env python3
"""The load side of scripts/soak.sh: Poisson arrivals of streamed completions against a running
`tandem serve`, a share of them cancelled mid-stream (the client hangs up), every rank's RSS
sampled, and the soak's targets checked at the end.

Targets (exit 1 when one is missed): no stuck request (each completes or is cancelled within
--stuck-s); the p99 latency of completed requests in the last window within 10% of the first
window's (window = 5 minutes, or a third of the run when it is shorter than 15 minutes); no
memory growth after warm-up (the first window): every rank's RSS at the end at most
max(2%, 16 MiB) above its RSS at the end of warm-up.
Standard library only."""
import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.parse


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def descendants(root):
    """root and every process below it: the serve process, its compute rank and memory ranks."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(d))
        except OSError:
            continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def name_of(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        argv = [a.decode(errors="replace") for a in argv if a]
        if "memory" in argv:
            return "memory-" + argv[argv.index("--rank") + 1]
        if "compute" in argv:
            return "compute-0"
        return argv[1] if len(argv) > 1 else argv[0]
    except (OSError, IndexError, ValueError):
        return str(pid)


def p99(xs):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


class Soak:
    def __init__(self, a):
        self.a = a
        u = urllib.parse.urlparse(a.url)
        self.host, self.port = u.hostname, u.port
        self.lock = threading.Lock()
        self.done = []  # (start offset s, latency s, tokens)
        self.cancelled = 0
        self.errors = []
        self.inflight = {}  # id -> start time
        self.next_id = 0
        self.rng = random.Random(a.seed)

    def one(self, rid, prompt, max_tokens, cancel_after):
        start = time.monotonic()
        with self.lock:
            self.inflight[rid] = start
        body = json.dumps({"model": self.a.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        tokens = 0
        try:
            c = http.client.HTTPConnection(self.host, self.port, timeout=self.a.stuck_s)
            c.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {self.a.key}"})
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
            while True:
                line = r.readline()
                if not line:
                    raise RuntimeError("stream ended without [DONE]")
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                tokens += 1
                if cancel_after is not None and tokens >= cancel_after:
                    c.close()  # hang up: the server cancels the request
                    with self.lock:
                        self.cancelled += 1
                        del self.inflight[rid]
                    return
            c.close()
            with self.lock:
                self.done.append((start - self.t0, time.monotonic() - start, tokens))
                del self.inflight[rid]
        except Exception as e:  # noqa: BLE001 (every failure is counted and reported)
            with self.lock:
                self.errors.append(f"request {rid}: {e}")
                self.inflight.pop(rid, None)

    def run(self):
        a = self.a
        self.t0 = time.monotonic()
        end = self.t0 + a.duration_s
        samples = []  # (offset s, {name: rss KiB})
        next_sample = self.t0
        stuck = set()
        threads = []
        t = self.t0
        while True:
            t += self.rng.expovariate(a.rate)
            now = time.monotonic()
            while now < min(t, end):
                if now >= next_sample:
                    samples.append((now - self.t0, {f"{name_of(p)}": rss_kib(p) for p in descendants(a.pid)}))
                    next_sample += a.sample_s
                    with self.lock:
                        stuck |= {r for r, s in self.inflight.items() if now - s > a.stuck_s}
                time.sleep(min(0.05, max(0.0, min(t, end) - now)))
                now = time.monotonic()
            if now >= end:
                break
            rid = self.next_id
            self.next_id += 1
            prompt = [self.rng.randrange(1, 30000) for _ in range(self.rng.randint(4, a.max_prompt))]
            max_tokens = self.rng.randint(4, a.max_tokens)
            cancel = self.rng.randint(1, max_tokens) if self.rng.random() < a.cancel_share else None
            th = threading.Thread(target=self.one, args=(rid, prompt, max_tokens, cancel), daemon=True)
            th.start()
            threads.append(th)
            threads = [x for x in threads if x.is_alive()]
        drain_end = time.monotonic() + a.stuck_s
        for th in threads:
            th.join(max(0.0, drain_end - time.monotonic()))
        with self.lock:
            stuck |= set(self.inflight)
        samples.append((time.monotonic() - self.t0, {name_of(p): rss_kib(p) for p in descendants(a.pid)}))
        if a.samples_out:
            with open(a.samples_out, "w") as f:
                json.dump([{"s": round(s, 1), "rss_kib": m} for s, m in samples], f)
        return self.report(samples, stuck)

    def report(self, samples, stuck):
        a = self.a
        window = min(300.0, a.duration_s / 3)
        first = [lat for s, lat, _ in self.done if s < window]
        last = [lat for s, lat, _ in self.done if s >= a.duration_s - window]
        p_first, p_last = p99(first), p99(last)
        drift = (p_last / p_first - 1) if first and last else float("nan")
        # Memory: each rank's RSS at the end of warm-up (first sample at or after the window) and at
        # the end (median of the last three samples, against sampling noise).
        growth = {}
        warm = [m for s, m in samples if s >= window]
        if len(warm) >= 2:
            for name in warm[0]:
                base = warm[0].get(name)
                tail = [m.get(name) for m in warm[-3:] if m.get(name)]
                if base and tail:
                    growth[name] = (base, statistics.median(tail))
        print(f"soak: {a.duration_s / 60:.1f} min at {a.rate} requests/s, {len(self.done)} completed, "
              f"{self.cancelled} cancelled, {len(self.errors)} errors, {len(stuck)} stuck")
        print(f"soak: p99 latency first {window / 60:.1f} min {p_first * 1000:.0f} ms ({len(first)} requests), "
              f"last {window / 60:.1f} min {p_last * 1000:.0f} ms ({len(last)} requests), drift {drift * 100:+.1f}%")
        ok = True
        for name, (base, end) in sorted(growth.items()):
            grew = end - base
            limit = max(0.02 * base, 16 * 1024)
            print(f"soak: rss {name}: {base / 1024:.1f} MiB after warm-up, {end / 1024:.1f} MiB at the end "
                  f"({grew / 1024:+.1f} MiB, limit +{limit / 1024:.1f})")
            if grew > limit:
                ok = False
                print(f"soak: MISSED: {name} grew by {grew / 1024:.1f} MiB after warm-up")
        for e in self.errors[:10]:
            print("soak: error:", e)
        if self.errors:
            ok = False
            print(f"soak: MISSED: {len(self.errors)} requests failed")
        if stuck:
            ok = False
            print(f"soak: MISSED: {len(stuck)} requests stuck (no end within {a.stuck_s} s)")
        if not (drift <= 0.10):
            ok = False
            print(f"soak: MISSED: p99 drift {drift * 100:+.1f}% (target within 10%)")
        if not growth:
            ok = False
            print("soak: MISSED: too few memory samples after warm-up")
        print("soak: PASS" if ok else "soak: FAIL")
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--url", required=True, help="http://host:port of tandem serve")
    ap.add_argument("--pid", type=int, required=True, help="tandem serve's pid (its ranks are below it)")
    ap.add_argument("--key", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--duration-s", type=float, required=True)
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    ap.add_argument("--cancel-share", type=float, default=0.2, help="share of requests hung up mid-stream")
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stuck-s", type=float, default=60.0)
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--samples-out", help="write every RSS sample (seconds, KiB per process) here as JSON")
    sys.exit(Soak(ap.parse_args()).run())


if __name__ == "__main__":
    main()
