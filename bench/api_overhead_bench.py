#!/usr/bin/env python3
"""What the HTTP API costs: the same requests through `tandem serve` (all at once, streamed) and
through `tandem generate` in process, on the same model and device; prints generated tokens/s of
both, the ratio, and the API's time to first token (median, p90).

Standard library only (http.client, threads), so it runs on the GPU machines as they are.
Usage: api_overhead_bench.py --tandem build/tandem --model small [--device cpu] [--requests 64]
                             [--prompt-tokens 128] [--max-tokens 64] [--json out.json]
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, a.vocab) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
    tmp = tempfile.mkdtemp(prefix="tandem-api-bench-")
    common = ["--set", f"scheduler.max_batch_size={a.requests}", "--set", "scheduler.max_tokens_per_step=4096",
              "--set", f"kv.capacity_tokens={a.requests * (a.prompt_tokens + a.max_tokens) + 1024}"]

    # In process: tandem generate, all requests submitted at once.
    path = os.path.join(tmp, "prompts.jsonl")
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p, "max_tokens": a.max_tokens, "ignore_eos": True}) + "\n")
    out = subprocess.run([a.tandem, "generate", "--model", a.model, "--device", a.device, "--prompts-file", path,
                          "--json", "--log-level", "warn"] + common, capture_output=True, text=True, check=True)
    m = re.search(r"\+ (\d+) generated tokens in ([0-9.]+) s", out.stderr)
    local_tokens, local_s = int(m.group(1)), float(m.group(2))

    # Through the API: the same requests, concurrently, streamed.
    ready = os.path.join(tmp, "ready")
    server = subprocess.Popen([a.tandem, "serve", "--model", a.model, "--device", a.device, "--ready-file", ready,
                               "--set", "api.port=0", "--log-level", "warn"] + common,
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "serve.log"), "w"))
    try:
        for _ in range(1200):
            if os.path.exists(ready) and open(ready).read().strip():
                break
            if server.poll() is not None:
                sys.exit("tandem serve exited: " + open(os.path.join(tmp, "serve.log")).read()[-2000:])
            time.sleep(0.1)
        host, port = open(ready).read().strip().split("//")[1].split(":")
        ttft, tokens = [None] * a.requests, [0] * a.requests
        barrier = threading.Barrier(a.requests + 1)

        def one(i):
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            body = json.dumps({"model": "tandem", "prompt": prompts[i], "max_tokens": a.max_tokens, "stream": True,
                               "ignore_eos": True, "temperature": 0})
            barrier.wait()
            t0 = time.monotonic()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                n = sum(len(c.get("token_ids", [])) for c in json.loads(line[6:])["choices"])
                if n and ttft[i] is None:
                    ttft[i] = time.monotonic() - t0
                tokens[i] += n
            conn.close()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(a.requests)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.monotonic()
        for t in threads:
            t.join()
        api_s = time.monotonic() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    api_tokens = sum(tokens)
    local_tps, api_tps = local_tokens / local_s, api_tokens / api_s
    t = sorted(x for x in ttft if x is not None)
    row = {"model": a.model, "device": a.device, "requests": a.requests, "prompt_tokens": a.prompt_tokens,
           "max_tokens": a.max_tokens, "in_process_tok_s": local_tps, "api_tok_s": api_tps,
           "api_over_in_process": api_tps / local_tps, "api_ttft_median_s": statistics.median(t),
           "api_ttft_p90_s": t[int(0.9 * (len(t) - 1))]}
    print(f"{a.requests} requests x ({a.prompt_tokens} prompt + {a.max_tokens} generated) tokens, model {a.model}, "
          f"device {a.device}")
    print(f"in process (tandem generate): {local_tokens} tokens in {local_s:.2f} s = {local_tps:.0f} tok/s")
    print(f"through the API (streamed):   {api_tokens} tokens in {api_s:.2f} s = {api_tps:.0f} tok/s "
          f"({100 * (api_tps / local_tps - 1):+.1f}%); TTFT median {1e3 * row['api_ttft_median_s']:.1f} ms, "
          f"p90 {1e3 * row['api_ttft_p90_s']:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
