#!/usr/bin/env python3
"""Losing compute rank 0 ends the deployment cleanly; losing a compute replica costs a delay.

Real processes: `tandem serve --deploy` on the CPU over UCX on 127.0.0.1, launch.heartbeat_s 0.5 and
launch.step_timeout_s 2. Cases, each bounded in time:
  * compute rank 0 killed (kill -9) under a stream of requests, with a compute replica
    (compute.ranks 2, pipeline.mode fixed) and two memory ranks: the launcher ends with a non-zero
    status naming compute-0, no rank is left running, and a rank that says why it stopped names
    compute rank 0;
  * compute rank 0 stopped (SIGSTOP) while idle, same deployment: the replica and both memory ranks
    exit on their own, each saying compute rank 0 went silent, and the launcher ends non-zero saying
    compute-0 is stopped; no rank is left;
  * the compute replica killed (kill -9) or stopped (SIGSTOP) under a stream of requests
    (launch.recover_compute_replicas on, the default; pipeline.mode fixed and rotational): compute
    rank 0 gives it up, the step in flight runs again, and every request completes with the tokens
    the same requests got one by one before the fault (greedy and seeded sampling), within a bound;
    compute-0's log names the replica and the rerun, /metrics counts it
    (tandem:compute_ranks_lost_total 1), and the deployment goes on;
  * with launch.recover_compute_replicas false, the compute replica killed under a stream of
    requests (pipeline.mode fixed): every request in flight is answered 503 with an error naming
    compute rank 1; the launcher ends non-zero naming compute-1;
  * every memory rank killed under a stream of requests (one compute rank, recovery on, no
    restarts): the requests in flight are answered 503 with an error saying every memory rank is
    lost, /health answers 503 with the same cause, and the deployment ends; no rank is left;
  * `generate --deploy` (a requests file) with the replica killed mid-run and recovery off: an error
    line naming compute rank 1 for every request, status 1, no rank left.
Usage: compute_loss_test.py path/to/tandem
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from fault_util import bad, completion_tokens, failures, pids, signal_all, wait_for

TANDEM = sys.argv[1]
HEARTBEAT_S, STEP_TIMEOUT_S = 0.5, 2
# A kill is seen at once (the transport reports the disconnect); a stopped compute rank 0 once its
# heartbeats' allowance (heartbeat + step timeout) has passed. The rest is slack for a loaded
# 2-core machine, and for the launcher's 10 s grace before it kills a rank that does not stop.
KILL_BOUND_S = 20
SILENT_BOUND_S = HEARTBEAT_S + STEP_TIMEOUT_S + 20
# A lost replica: found at once (kill -9) or after a step deadline and half of one more (SIGSTOP);
# the rest is slack for a loaded 2-core machine.
LOSS_BOUND_S = 2 * STEP_TIMEOUT_S + 15
# (prompt, extra request fields): greedy and seeded sampling.
REQUESTS = [([5 + i, 17, 99, 3, 250 - i, 7, 11 * i % 500 + 1], {"temperature": 0.8, "seed": i} if i % 2 else {})
            for i in range(6)]


class Deployment:
    def __init__(self, tmp, name, compute_ranks, extra="", mode="fixed", batches=2):
        self.name = name
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.yaml = os.path.join(self.dir, "deploy.yaml")
        pipeline = f"pipeline:\n  mode: {mode}\n  batches: {batches}\n" if compute_ranks > 1 else ""
        with open(self.yaml, "w") as f:
            f.write(f"model:\n  path: tiny-gqa\ncompute:\n  device: cpu\n  ranks: {compute_ranks}\n"
                    f"memory:\n  ranks: 2\n  devices: cpu\n{pipeline}"
                    f"scheduler:\n  max_batch_size: 4\n  max_tokens_per_step: 64\nkv:\n  capacity_tokens: 512\n"
                    f"launch:\n  run_dir: {self.dir}/run\n  step_timeout_s: {STEP_TIMEOUT_S}\n"
                    f"  heartbeat_s: {HEARTBEAT_S}\n  startup_timeout_s: 60\n{extra}"
                    f"api:\n  port: 0\n  served_model_name: cl\n")
        ready = os.path.join(self.dir, "ready")
        self.err_path = os.path.join(self.dir, "serve.err")
        self.proc = subprocess.Popen([TANDEM, "serve", "--deploy", self.yaml, "--ready-file", ready],
                                     stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"))
        self.url = None
        if wait_for(lambda: os.path.exists(ready) and open(ready).read().strip(), 60) is not None:
            self.url = open(ready).read().strip()
        else:
            bad(f"{name}: the deployment did not become ready: {self.err()[-600:]}")
        self.answers = []  # (status, body) of the first request of each client that did not get 200
        self.completed = 0
        self.stop_clients = False
        self.clients = []

    def err(self):
        return open(self.err_path).read()

    def expect_503s(self, cause):
        """Every client got an answer to its request in flight, and each was 503 saying `cause`."""
        if len(self.answers) != len(self.clients):
            bad(f"{self.name}: {len(self.clients) - len(self.answers)} client(s) got no answer")
        for status, body in self.answers:
            if status != 503 or cause not in body:
                bad(f"{self.name}: a request in flight was answered {status} {body[:300]}, not 503 saying {cause!r}")

    def log(self, rank):
        path = os.path.join(self.dir, "run", "latest", f"{rank}.log")
        return open(path).read() if os.path.exists(path) else ""

    def last_line(self, rank):
        lines = self.log(rank).strip().splitlines()
        return lines[-1] if lines else ""

    def rank_pids(self, rank):
        if rank == "compute-0":
            return pids(f"compute --config {self.dir}")
        if rank.startswith("compute-"):
            return pids(f"compute --replica {rank[len('compute-'):]} .*{self.dir}")
        return pids(f"memory --rank {rank[len('memory-'):]} .*{self.dir}")

    def tokens(self, prompt, extra):
        return completion_tokens(self.url, "cl", prompt, 40, extra)

    def metric(self, name):
        status, text = self.get("/metrics")
        m = re.search(rf"^tandem:{name}\{{[^}}]*\}} (\S+)$", text, re.M) if status == 200 else None
        return float(m.group(1)) if m else None

    def left_running(self):
        return pids(self.dir)

    def get(self, path):
        try:
            with urllib.request.urlopen(self.url.rsplit("/v1", 1)[0] + path, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return None, str(e)

    def client(self, i):
        n = 0
        while not self.stop_clients:
            n += 1
            body = json.dumps({"model": "cl", "prompt": [5, 17, 99, i, n % 50], "max_tokens": 100,
                               "temperature": 0}).encode()
            req = urllib.request.Request(self.url + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                    self.completed += 1
            except urllib.error.HTTPError as e:
                self.answers.append((e.code, e.read().decode()))
                return
            except OSError as e:  # the server went away without an answer
                self.answers.append((None, str(e)))
                return

    def start_clients(self, n=3):
        self.clients = [threading.Thread(target=self.client, args=(i,)) for i in range(n)]
        for t in self.clients:
            t.start()
        if wait_for(lambda: self.completed >= 5, 30) is None:
            bad(f"{self.name}: the requests do not complete: {self.err()[-600:]}")

    def end_clients(self):
        self.stop_clients = True
        for t in self.clients:
            t.join(70)

    def stop(self):
        """Ends the deployment, whatever state its ranks are in."""
        left = self.left_running()
        signal_all(left, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        signal_all(left, signal.SIGKILL)
        self.end_clients()

    def check_ended(self, bound, what):
        """The launcher ends non-zero within `bound` s, and no rank is left; returns its stderr."""
        took = wait_for(lambda: self.proc.poll() is not None, bound)
        print(f"{self.name}: {what}: launcher ended after {'%.1f s' % took if took is not None else 'never'}",
              flush=True)
        if took is None:
            bad(f"{self.name}: the launcher did not end within {bound} s of {what}")
            return self.err()
        if self.proc.returncode == 0:
            bad(f"{self.name}: the launcher ended with status 0 after {what}")
        if wait_for(lambda: not self.left_running(), 5) is None:
            bad(f"{self.name}: processes left running after the launcher ended: {self.left_running()}")
        return self.err()


def compute0_killed(tmp):
    d = Deployment(tmp, "compute0-killed", compute_ranks=2)
    try:
        if d.url is None:
            return
        d.start_clients()
        victim = d.rank_pids("compute-0")
        if not victim:
            bad("compute0-killed: compute-0 not found")
            return
        signal_all(victim, signal.SIGKILL)
        err = d.check_ended(KILL_BOUND_S, "kill -9 of compute-0")
        if f"compute-0 (pid {victim[0]}) was killed by signal 9" not in err:
            bad(f"compute0-killed: the launcher does not name compute-0: {err[-800:]}")
        for rank in ("compute-1", "memory-0", "memory-1"):
            line = d.last_line(rank)
            # A rank stopped by the launcher first says nothing; one that saw compute rank 0 go
            # names it.
            if line.startswith("tandem ") and "compute rank 0" not in line:
                bad(f"compute0-killed: {rank} stopped without naming compute rank 0: {line}")
    finally:
        d.stop()


def compute0_stopped(tmp):
    d = Deployment(tmp, "compute0-stopped", compute_ranks=2)
    try:
        if d.url is None:
            return
        status, _ = d.get("/health")
        if status != 200:
            bad(f"compute0-stopped: /health answered {status} before the fault")
        body = json.dumps({"model": "cl", "prompt": [40, 41, 42], "max_tokens": 8}).encode()
        urllib.request.urlopen(urllib.request.Request(d.url + "/completions", data=body,
                                                      headers={"Content-Type": "application/json"}),
                               timeout=30).read()
        time.sleep(HEARTBEAT_S * 3)  # every rank has had a heartbeat
        victim = d.rank_pids("compute-0")
        signal_all(victim, signal.SIGSTOP)
        others = ("compute-1", "memory-0", "memory-1")
        took = wait_for(lambda: not any(d.rank_pids(r) for r in others), SILENT_BOUND_S)
        print(f"compute0-stopped: the other ranks exited after "
              f"{'%.1f s' % took if took is not None else 'never'}", flush=True)
        if took is None:
            bad(f"compute0-stopped: ranks still running {SILENT_BOUND_S} s after compute-0 was stopped: "
                f"{[r for r in others if d.rank_pids(r)]}")
        for rank in others:
            if "compute rank 0 has been silent" not in d.last_line(rank):
                bad(f"compute0-stopped: {rank} does not say compute rank 0 went silent: {d.last_line(rank)}")
        err = d.check_ended(15, "the ranks leaving")
        if f"compute-0 (pid {victim[0]}) is stopped" not in err:
            bad(f"compute0-stopped: the launcher does not say compute-0 is stopped: {err[-800:]}")
    finally:
        d.stop()


def fault_under_load(d, name, victim, sig, given_up, bound=LOSS_BOUND_S):
    """Three clients send REQUESTS (whose fault-free tokens are taken one by one first); once some
    complete, `victim` (a rank's name) gets `sig`. Checks that compute-0 logs `given_up` within
    `bound` s, that requests go on completing, that no client hangs and that every request got its
    fault-free tokens. False when the fault-free requests failed (and nothing else ran)."""
    expect = [d.tokens(p, e) for p, e in REQUESTS]  # one by one, before any fault
    if not all(isinstance(t, list) and len(t) == 40 for t in expect):
        bad(f"{name}: the fault-free requests failed: {expect[:1]}")
        return False
    done, wrong, stop = [0], [], [False]
    lock = threading.Lock()

    def client(k):
        i = k
        while not stop[0]:
            got = d.tokens(*REQUESTS[i % len(REQUESTS)])
            with lock:
                done[0] += 1
                if got != expect[i % len(REQUESTS)]:
                    wrong.append((i % len(REQUESTS), got))
            i += 3

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    if wait_for(lambda: done[0] >= 3, 30) is None:
        bad(f"{name}: the requests do not complete: {d.err()[-600:]}")
    signal_all(d.rank_pids(victim), sig)
    start = time.time()
    took = wait_for(lambda: given_up in d.log("compute-0"), bound)
    before = done[0]
    more = wait_for(lambda: done[0] >= before + 6, bound)
    stop[0] = True
    for t in threads:
        t.join(90)
    print(f"{name}: {victim} given up after {'%.1f s' % took if took is not None else 'never'}; "
          f"{done[0]} requests in {time.time() - start:.1f} s, {len(wrong)} with other tokens; "
          f"steps rerun {d.metric('steps_rerun_total')}", flush=True)
    if took is None:
        bad(f"{name}: compute-0 did not log {given_up!r} within {bound} s: {d.log('compute-0')[-800:]}")
    if more is None:
        bad(f"{name}: requests stopped completing after the loss: {d.err()[-600:]}")
    if any(t.is_alive() for t in threads):
        bad(f"{name}: a client still waits 90 s after the load stopped")
    for i, got in wrong[:3]:
        bad(f"{name}: request {i} got {got}, fault-free {expect[i]}")
    return True


def replica_lost(tmp, mode, sig):
    """The replica killed or stopped under load: every request completes with the fault-free tokens."""
    how = "killed" if sig == signal.SIGKILL else "stopped"
    d = Deployment(tmp, f"replica-{how}-{mode}", compute_ranks=2, mode=mode)
    try:
        if d.url is None:
            return
        if not fault_under_load(d, d.name, "compute-1", sig, "giving up compute rank 1"):
            return
        if d.metric("compute_ranks_lost_total") != 1:
            bad(f"{d.name}: tandem:compute_ranks_lost_total is {d.metric('compute_ranks_lost_total')}, not 1")
        if d.proc.poll() is not None:
            bad(f"{d.name}: the deployment ended after the replica was lost: {d.err()[-600:]}")
        for rank in ("memory-0", "memory-1"):
            if not d.rank_pids(rank):
                bad(f"{d.name}: {rank} exited after the replica was lost: {d.last_line(rank)}")
    finally:
        d.stop()


def replica_killed(tmp, mode):
    d = Deployment(tmp, f"replica-killed-{mode}-norecovery", compute_ranks=2, mode=mode,
                   extra="  recover_compute_replicas: false\n")
    try:
        if d.url is None:
            return
        d.start_clients()
        victim = d.rank_pids("compute-1")
        signal_all(victim, signal.SIGKILL)
        err = d.check_ended(KILL_BOUND_S, "kill -9 of compute-1")
        d.end_clients()
        print(f"{d.name}: {d.completed} requests completed; then {[a[0] for a in d.answers]}", flush=True)
        d.expect_503s("compute rank 1")
        if f"compute-1 (pid {victim[0]}) was killed by signal 9" not in err:
            bad(f"{d.name}: the launcher does not name compute-1: {err[-800:]}")
    finally:
        d.stop()


def memory_ranks_lost(tmp):
    d = Deployment(tmp, "memory-lost", compute_ranks=1, extra="  restart_memory_ranks: 0\n")
    health = []
    try:
        if d.url is None:
            return
        d.start_clients()

        def poll_health():
            while d.proc.poll() is None and not d.stop_clients:
                status, body = d.get("/health")
                if status is None:
                    return
                health.append((status, body))
                time.sleep(0.02)

        poller = threading.Thread(target=poll_health)
        poller.start()
        signal_all(d.rank_pids("memory-0") + d.rank_pids("memory-1"), signal.SIGKILL)
        d.check_ended(KILL_BOUND_S, "kill -9 of both memory ranks")
        d.end_clients()
        poller.join(10)
        print(f"memory-lost: {d.completed} requests completed; then {[a[0] for a in d.answers]}; "
              f"/health said {sorted(set(s for s, _ in health))}", flush=True)
        d.expect_503s("every memory rank is lost")
        failed = [b for s, b in health if s == 503]
        if not failed or not all("every memory rank is lost" in json.loads(b)["error"]["message"] for b in failed):
            bad(f"memory-lost: /health did not answer 503 naming the cause: {health[-3:]}")
    finally:
        d.stop()


def requests_file_replica_killed(tmp):
    """`generate --deploy` with a replica killed mid-run: an error line per request, status 1."""
    run = os.path.join(tmp, "generate")
    os.makedirs(run)
    yaml = os.path.join(run, "deploy.yaml")
    with open(yaml, "w") as f:
        f.write(f"model:\n  path: tiny-gqa\ncompute:\n  device: cpu\n  ranks: 2\nmemory:\n  ranks: 2\n"
                f"  devices: cpu\npipeline:\n  mode: fixed\n  batches: 2\nscheduler:\n  max_batch_size: 4\n"
                f"  max_tokens_per_step: 64\nkv:\n  capacity_tokens: 2048\nlaunch:\n  run_dir: {run}/run\n"
                f"  step_timeout_s: {STEP_TIMEOUT_S}\n  heartbeat_s: {HEARTBEAT_S}\n  startup_timeout_s: 60\n"
                f"  recover_compute_replicas: false\n")
    prompts = os.path.join(run, "prompts.jsonl")
    n = 200  # long enough (some 20 s on a 2-core host) that the kill lands mid-run
    with open(prompts, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt_ids": [5, 17, i + 1], "max_tokens": 400}) + "\n")
    out_path, err_path = os.path.join(run, "out.jsonl"), os.path.join(run, "err.txt")
    proc = subprocess.Popen([TANDEM, "generate", "--deploy", yaml, "--prompts-file", prompts, "--json"],
                            stdout=open(out_path, "w"), stderr=open(err_path, "w"))
    try:
        log = os.path.join(run, "run", "latest", "compute-0.log")
        if wait_for(lambda: os.path.exists(log) and "ready on" in open(log).read(), 60) is None:
            bad(f"generate: compute-0 did not get ready: {open(err_path).read()[-600:]}")
            return
        time.sleep(1)
        victim = pids(f"compute --replica 1 .*{run}")
        if proc.poll() is not None or not victim:
            bad(f"generate: the run ended before the replica could be killed: {open(err_path).read()[-600:]}")
            return
        signal_all(victim, signal.SIGKILL)
        took = wait_for(lambda: proc.poll() is not None, KILL_BOUND_S)
        print(f"generate: kill -9 of compute-1: generate ended after "
              f"{'%.1f s' % took if took is not None else 'never'} with status {proc.returncode}", flush=True)
        if took is None:
            bad("generate: did not end after the replica was killed")
            return
        if proc.returncode == 0:
            bad("generate: ended with status 0 after the replica was killed")
        lines = [json.loads(line) for line in open(out_path) if line.strip()]
        if len(lines) != n or not all("compute rank 1" in line.get("error", "") for line in lines):
            bad(f"generate: expected {n} error lines naming compute rank 1, got {len(lines)}: {lines[:1]}")
        if wait_for(lambda: not pids(run), 5) is None:
            bad(f"generate: processes left running: {pids(run)}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        signal_all(pids(run), signal.SIGKILL)


def main():
    start = time.time()
    keep = os.environ.get("TANDEM_KEEP_RUN")  # a directory to keep the runs (and their logs) in
    with tempfile.TemporaryDirectory(prefix="tandem-computeloss-") as scratch:
        tmp = tempfile.mkdtemp(prefix="tandem-computeloss-", dir=keep) if keep else scratch
        cases = [compute0_killed, compute0_stopped, lambda t: replica_killed(t, "fixed"), memory_ranks_lost,
                 requests_file_replica_killed]
        cases += [lambda t, m=m, s=s: replica_lost(t, m, s) for m in ("fixed", "rotational")
                  for s in (signal.SIGKILL, signal.SIGSTOP)]
        only = os.environ.get("TANDEM_FAULT_CASE")  # a case's index, to run it alone
        for k, case in enumerate(cases):
            if only is None or int(only) == k:
                case(tmp)
    print(f"{len(failures)} failure(s) in {time.time() - start:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
