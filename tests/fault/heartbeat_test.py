#!/usr/bin/env python3
"""Heartbeats find a rank that went silent while the deployment is idle (launch.heartbeat_s).

Real processes: `tandem serve --deploy` starts compute rank 0 (serving the API) and two CPU memory
ranks over UCX on 127.0.0.1, with launch.heartbeat_s 0.5 and launch.step_timeout_s 2. Cases, each
bounded in time:
  * recovery on, memory rank 1 stopped (SIGSTOP) while idle: compute rank 0's log names memory
    rank 1 (and not rank 0) as lost within the bound, and requests sent afterwards complete with
    the tokens the same requests got before the fault;
  * recovery off, memory rank 1 stopped while idle: the deployment ends on its own, naming memory
    rank 1 (memory rank 0 is told why before compute rank 0 exits);
  * compute rank 0 stopped while idle: both memory ranks exit on their own, each saying compute
    rank 0 went silent.
Usage: heartbeat_test.py path/to/tandem
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from fault_util import bad, failures, pids, signal_all, wait_for

TANDEM = sys.argv[1]
MODEL = "tiny-gqa"
HEARTBEAT_S, STEP_TIMEOUT_S = 0.5, 2
# Detection: a heartbeat unanswered for the step timeout, found at the next idle wake-up; the rest
# is slack for a loaded 2-core machine.
DETECT_BOUND_S = HEARTBEAT_S * 2 + STEP_TIMEOUT_S + 6


class Deployment:
    def __init__(self, tmp, name, recover):
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.yaml = os.path.join(self.dir, "deploy.yaml")
        with open(self.yaml, "w") as f:
            f.write(f"model:\n  path: {MODEL}\ncompute:\n  device: cpu\nmemory:\n  ranks: 2\n  devices: cpu\n"
                    f"scheduler:\n  max_batch_size: 4\n  max_tokens_per_step: 64\nkv:\n  capacity_tokens: 256\n"
                    f"launch:\n  run_dir: {self.dir}/run\n  step_timeout_s: {STEP_TIMEOUT_S}\n"
                    f"  heartbeat_s: {HEARTBEAT_S}\n  recover_memory_ranks: {'true' if recover else 'false'}\n"
                    f"  startup_timeout_s: 60\napi:\n  port: 0\n  served_model_name: hb\n")
        ready = os.path.join(self.dir, "ready")
        self.err_path = os.path.join(self.dir, "serve.err")
        self.proc = subprocess.Popen([TANDEM, "serve", "--deploy", self.yaml, "--ready-file", ready],
                                     stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"))
        self.url = None
        start = time.time()
        while time.time() - start < 60 and self.proc.poll() is None:
            if os.path.exists(ready) and open(ready).read().strip():
                self.url = open(ready).read().strip()
                break
            time.sleep(0.05)
        if self.url is None:
            bad(f"{name}: the deployment did not become ready: {self.err()[-600:]}")

    def err(self):
        return open(self.err_path).read()

    def log(self, rank):
        path = os.path.join(self.dir, "run", "latest", f"{rank}.log")
        return open(path).read() if os.path.exists(path) else ""

    def rank_pids(self, rank):
        if rank == "compute-0":
            return pids(f"compute --config .*{self.dir}")
        return pids(f"memory --rank {rank[len('memory-'):]} .*{self.dir}")

    def complete(self, prompt, **extra):
        """(HTTP status, body) of a completion of token ids `prompt`."""
        body = json.dumps({"model": "hb", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}).encode()
        req = urllib.request.Request(self.url + "/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def tokens(self, prompt, **extra):
        status, body = self.complete(prompt, **extra)
        if status != 200:
            bad(f"completion of {prompt}: HTTP {status}: {body}")
            return None
        return body["choices"][0]["token_ids"]

    def stop(self):
        """Ends the deployment, whatever state its ranks are in."""
        stopped = self.rank_pids("compute-0") + self.rank_pids("memory-0") + self.rank_pids("memory-1")
        signal_all(stopped, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        signal_all(stopped, signal.SIGKILL)


PROMPTS = [[5, 17, 99, 3, 250, 7], [40, 41, 42, 43]]


def recovery_on(tmp):
    d = Deployment(tmp, "recover", recover=True)
    try:
        if d.url is None:
            return
        before = [d.tokens(p) for p in PROMPTS] + [d.tokens(PROMPTS[0], temperature=0.8, seed=9)]
        victim = d.rank_pids("memory-1")
        if not victim:
            bad("recovery on: memory rank 1 not found")
            return
        signal_all(victim, signal.SIGSTOP)
        took = wait_for(lambda: "giving up memory rank 1 (" in d.log("compute-0"), DETECT_BOUND_S)
        log = d.log("compute-0")
        print(f"recovery on: memory rank 1 stopped while idle, given up after "
              f"{'%.1f s' % took if took is not None else 'never'}", flush=True)
        if took is None:
            bad(f"recovery on: compute-0 did not name memory rank 1 within {DETECT_BOUND_S} s: {log[-800:]}")
            return
        if "no answer to a heartbeat" not in log:
            bad(f"recovery on: the loss was not found by the heartbeat: {log[-800:]}")
        if "giving up memory rank 0" in log:
            bad(f"recovery on: memory rank 0 (healthy) was blamed: {log[-800:]}")
        after = [d.tokens(p) for p in PROMPTS] + [d.tokens(PROMPTS[0], temperature=0.8, seed=9)]
        if after != before:
            bad(f"recovery on: tokens after the loss {after} differ from before it {before}")
        if d.proc.poll() is not None:
            bad(f"recovery on: the deployment stopped: {d.err()[-600:]}")
    finally:
        d.stop()


def recovery_off(tmp):
    d = Deployment(tmp, "norecover", recover=False)
    try:
        if d.url is None:
            return
        if d.tokens(PROMPTS[0]) is None:
            return
        signal_all(d.rank_pids("memory-1"), signal.SIGSTOP)
        took = wait_for(lambda: d.proc.poll() is not None, DETECT_BOUND_S + 15)
        print(f"recovery off: memory rank 1 stopped while idle, deployment ended after "
              f"{'%.1f s' % took if took is not None else 'never'}", flush=True)
        if took is None:
            bad("recovery off: the deployment did not end after a memory rank went silent")
            return
        if d.proc.returncode == 0:
            bad("recovery off: the deployment ended with status 0")
        text = d.err() + d.log("compute-0")
        if "memory rank 1 (" not in text or "no answer to a heartbeat" not in text:
            bad(f"recovery off: the deployment's end does not name memory rank 1: {text[-800:]}")
        if "compute rank 0 stops the deployment: memory rank 1 (" not in d.log("memory-0"):
            bad(f"recovery off: memory rank 0 was not told why the deployment stops: {d.log('memory-0')[-600:]}")
    finally:
        d.stop()


def compute_silent(tmp):
    d = Deployment(tmp, "silentcompute", recover=True)
    try:
        if d.url is None:
            return
        if d.tokens(PROMPTS[1]) is None:
            return
        time.sleep(HEARTBEAT_S * 2)  # the memory ranks have had a heartbeat
        signal_all(d.rank_pids("compute-0"), signal.SIGSTOP)
        gone = lambda: not d.rank_pids("memory-0") and not d.rank_pids("memory-1")
        took = wait_for(gone, HEARTBEAT_S + STEP_TIMEOUT_S + 8)
        print(f"compute rank 0 stopped while idle: memory ranks exited after "
              f"{'%.1f s' % took if took is not None else 'never'}", flush=True)
        if took is None:
            bad("compute silent: the memory ranks did not exit")
        for m in ("memory-0", "memory-1"):
            if "compute rank 0 has been silent" not in d.log(m):
                bad(f"compute silent: {m} does not say compute rank 0 went silent: {d.log(m)[-600:]}")
    finally:
        d.stop()


def main():
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="tandem-heartbeat-") as tmp:
        for case in (recovery_on, recovery_off, compute_silent):
            case(tmp)
    print(f"{len(failures)} failure(s) in {time.time() - start:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
