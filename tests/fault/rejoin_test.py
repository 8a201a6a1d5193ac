#!/usr/bin/env python3
"""A lost memory rank is restarted by the launcher and rejoins (launch.restart_memory_ranks).

Real processes: `tandem serve --deploy` starts compute rank 0 (serving the API) and two CPU memory
ranks over UCX on 127.0.0.1 (launch.step_timeout_s 2, launch.rejoin_probe_s 0.2,
launch.restart_memory_ranks 2). Four clients keep sending completions (greedy and seeded
sampling) whose tokens must equal those of the same requests sent one by one before any fault.
  * kill -9 of memory rank 1 under that load: the launcher restarts it (a line per restart),
    compute rank 0 takes it back (its log, tandem:memory_ranks_rejoined_total 1), every request
    completes with the fault-free tokens, and the new process runs attention for requests placed
    on it after the rejoin (the steps with rows it logs at its bye);
  * SIGSTOP of the restarted rank under load, SIGCONT once compute rank 0 gave it up: nothing
    wedges; the old process leaves, is restarted a second time and rejoins, requests still get the
    same tokens;
  * with a compute replica (compute.ranks 2, pipeline.mode fixed, 2 micro-batches): kill -9 of memory
    rank 1 under load: the launcher restarts it, the replica connects to the new process (its log
    says so) before compute rank 0 takes the rank back (its log, tandem:memory_ranks_rejoined_total
    1), the replica is kept and goes on sampling micro-batches, every request completes with the
    fault-free tokens, and the new process runs attention for requests placed on it;
  * under the head partition (memory.partition head): kill -9 of memory rank 1 under load: memory
    rank 0 takes every KV head (its log says it was re-partitioned), the launcher restarts rank 1,
    compute rank 0 takes it back and the two split the heads again (every request in flight is
    recomputed each time), every request completes with the fault-free tokens, and the new process
    runs attention; the same with a compute replica, which takes each new split of the heads (its
    log) and is kept;
  * kill -9 of memory rank 1 with no restart (launch.restart_memory_ranks 0): compute rank 0 probes its
    address after 0.2 s, then waits twice as long after each probe nothing answers, and requests go
    on over rank 0; then the rank is started again by hand, with the command the launcher printed
    when it did not restart it (`tandem memory` with the same --rank, config and secret file, and
    --listen at the address the rank had, not the port 0 it was started on): compute rank 0
    takes it back (tandem:memory_ranks_rejoined_total 1), requests run on it with the fault-free
    tokens, and it leaves with the deployment.
Every wait is bounded. Usage: rejoin_test.py path/to/tandem
"""
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from fault_util import bad, completion_tokens, failures, pids, signal_all, wait_for

TANDEM = sys.argv[1]
MODEL = "tiny-gqa"
STEP_TIMEOUT_S = 2
BOUND_S = 25  # for each event awaited (a loss, a rejoin) on a loaded 2-core machine


# (prompt, extra request fields): greedy and seeded sampling.
REQUESTS = [([5 + i, 17, 99, 3, 250 - i, 7, 11 * i % 500 + 1], {"temperature": 0.8, "seed": i} if i % 2 else {})
            for i in range(8)]


class Deployment:
    def __init__(self, tmp, compute_ranks=1, partition="request", restarts=2, env=None):
        self.dir = os.path.join(tmp, f"rejoin-{compute_ranks}-{partition}-{restarts}")
        os.makedirs(self.dir)
        yaml = os.path.join(self.dir, "deploy.yaml")
        pipeline = "pipeline:\n  mode: fixed\n  batches: 2\n" if compute_ranks > 1 else ""
        with open(yaml, "w") as f:
            f.write(f"model:\n  path: {MODEL}\ncompute:\n  device: cpu\n  ranks: {compute_ranks}\n"
                    f"memory:\n  ranks: 2\n  devices: cpu\n  partition: {partition}\n{pipeline}"
                    f"scheduler:\n  max_batch_size: 4\n  max_tokens_per_step: 64\nkv:\n  capacity_tokens: 512\n"
                    f"launch:\n  run_dir: {self.dir}/run\n  step_timeout_s: {STEP_TIMEOUT_S}\n  heartbeat_s: 0.5\n"
                    f"  rejoin_probe_s: 0.2\n  restart_memory_ranks: {restarts}\n  startup_timeout_s: 60\n"
                    f"api:\n  port: 0\n  served_model_name: rj\n")
        ready = os.path.join(self.dir, "ready")
        self.err_path = os.path.join(self.dir, "serve.err")
        self.proc = subprocess.Popen([TANDEM, "serve", "--deploy", yaml, "--ready-file", ready],
                                     stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"),
                                     env=dict(os.environ, **(env or {})))
        self.url = None
        if wait_for(lambda: os.path.exists(ready) and open(ready).read().strip(), 60) is not None:
            self.url = open(ready).read().strip()
        else:
            bad(f"the deployment did not become ready: {self.err()[-600:]}")

    def err(self):
        return open(self.err_path).read()

    def log(self, rank):
        path = os.path.join(self.dir, "run", "latest", f"{rank}.log")
        return open(path).read() if os.path.exists(path) else ""

    def memory_pids(self, rank):
        return pids(f"memory --rank {rank} .*{self.dir}")

    def replica_pids(self):
        return pids(f"compute --replica 1 .*{self.dir}")

    def tokens(self, prompt, extra):
        return completion_tokens(self.url, "rj", prompt, 48, extra)

    def metric(self, name):
        with urllib.request.urlopen(self.url.rsplit("/v1", 1)[0] + "/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(rf"^tandem:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    def stop(self, spare=()):
        """SIGTERM to the launcher; then SIGKILL to every rank process left, except those in `spare`."""
        stopped = [p for p in (pids(f"compute --config .*{self.dir}") + self.replica_pids() + self.memory_pids(0) +
                               self.memory_pids(1)) if p not in spare]
        signal_all(stopped, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bad("the launcher did not stop within 30 s of SIGTERM")
                self.proc.kill()
                self.proc.wait()
        signal_all(stopped, signal.SIGKILL)


class Load:
    """Four clients sending REQUESTS round and round until stopped; each result is checked."""

    def __init__(self, d, expect, label):
        self.d, self.expect, self.label = d, expect, label
        self.done, self.wrong, self.stop_flag = 0, [], False
        self.lock = threading.Lock()
        # Daemons: an unexpected error of the test itself must end it, not leave it waiting on them.
        self.threads = [threading.Thread(target=self.run, args=(k,), daemon=True) for k in range(4)]
        for t in self.threads:
            t.start()

    def run(self, k):
        i = k
        while not self.stop_flag:
            prompt, extra = REQUESTS[i % len(REQUESTS)]
            got = self.d.tokens(prompt, extra)
            with self.lock:
                self.done += 1
                if got != self.expect[i % len(REQUESTS)]:
                    self.wrong.append((i % len(REQUESTS), got))
            i += 4

    def finish(self):
        self.stop_flag = True
        for t in self.threads:
            t.join(timeout=90)
        if any(t.is_alive() for t in self.threads):
            bad(f"{self.label}: a client is still waiting 90 s after the load stopped")
        print(f"{self.label}: {self.done} requests under load, {len(self.wrong)} with other tokens", flush=True)
        for i, got in self.wrong[:3]:
            bad(f"{self.label}: request {i} got {got}, fault-free {self.expect[i]}")


def fault_free(d):
    """The tokens of REQUESTS sent one at a time before any fault, or None (reported) if they fail or
    the deployment never became ready."""
    if d.url is None:
        return None
    expect = [d.tokens(p, e) for p, e in REQUESTS]
    if not all(isinstance(t, list) and len(t) == 48 for t in expect):
        bad(f"fault-free requests failed: {expect}")
        return None
    return expect


def spread(d):
    """Prompts no rank has cached, two at a time, so that placement by free KV reaches the rejoined
    rank (the requests of REQUESTS may all follow their cached prefixes to rank 0)."""
    for i in range(6):
        threads = [threading.Thread(target=d.tokens, args=([300 + 7 * i + k, 41, 42 + k, 9], {})) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def check_byes(d, label):
    """The bye of memory rank 1's last process: it ran steps with rows."""
    byes = re.findall(r"memory rank 1: bye after \d+ steps \((\d+) with rows here\)", d.log("memory-1"))
    print(f"{label}: memory rank 1's last process: {byes[-1] if byes else '?'} steps with rows", flush=True)
    if not byes or int(byes[-1]) == 0:
        bad(f"{label}: the restarted memory rank 1 ran no steps with rows: {d.log('memory-1')[-600:]}")


def kill_until_rejoined(d, label, rejoined, at_rejoin=lambda: None):
    """kill -9 of memory rank 1 while four clients send REQUESTS, until `rejoined()` (or BOUND_S);
    `at_rejoin()` runs then, and the load goes on a second more. Returns (fault-free tokens, what
    at_rejoin returned), or None when the case cannot go on (reported)."""
    expect = fault_free(d)
    if expect is None:
        return None
    load = Load(d, expect, label)
    time.sleep(1.0)
    victim = d.memory_pids(1)
    if not victim:
        bad(f"{label}: memory rank 1 not found")
        load.finish()
        return None
    start = time.time()
    signal_all(victim, signal.SIGKILL)
    took = wait_for(rejoined, BOUND_S)
    extra = at_rejoin() if took is not None else None  # (a deployment that stopped has no /metrics)
    time.sleep(1.0)  # requests placed on the rejoined rank
    load.finish()
    print(f"{label}: rejoined {'%.1f s' % took if took is not None else 'never'} after the kill; "
          f"{load.done} requests in {time.time() - start:.1f} s", flush=True)
    if took is None:
        bad(f"{label}: memory rank 1 did not rejoin within {BOUND_S} s: {d.log('compute-0')[-800:]}\n"
            f"{d.log('compute-1')[-600:]}\n{d.err()[-600:]}")
        return None
    return expect, extra


def with_replica(tmp):
    """kill -9 of memory rank 1 under load with a compute replica: the replica connects to the new
    process, the rank rejoins, and the replica goes on with it."""
    label = "kill -9 with a replica"
    d = Deployment(tmp, compute_ranks=2)
    try:
        if d.url is None:
            return
        done = kill_until_rejoined(d, label, lambda: re.search(r"memory rank 1 \(\S+\) rejoined", d.log("compute-0")),
                                   lambda: d.metric("replica_micro_batches_total"))
        if done is None:
            return
        expect, sampled = done
        if "memory-1 restarted (pid" not in d.err():
            bad(f"{label}: the launcher did not report the restart: {d.err()[-600:]}")
        if not re.search(r"compute rank 1: memory rank 1 \(\S+\) rejoined .*this rank is connected to it",
                         d.log("compute-1")):
            bad(f"{label}: the replica did not log its connection to the new process: {d.log('compute-1')[-600:]}")
        if "every one of the 1 compute replica(s) connected to it" not in d.log("compute-0"):
            bad(f"{label}: compute-0 does not say the replica connected: {d.log('compute-0')[-600:]}")
        for name, want in (("memory_ranks_rejoined_total", 1), ("memory_ranks_lost_total", 1),
                           ("compute_ranks_live", 2), ("compute_ranks_lost_total", 0)):
            if d.metric(name) != want:
                bad(f"{label}: tandem:{name} is {d.metric(name)}, not {want}")
        if not d.replica_pids() or d.proc.poll() is not None:
            bad(f"{label}: the replica or the deployment stopped: {d.err()[-600:]}")
        after = [d.tokens(p, e) for p, e in REQUESTS]
        if after != expect:
            bad(f"{label}: after the rejoin: tokens {after} differ from the fault-free {expect}")
        spread(d)
        if not (d.metric("replica_micro_batches_total") or 0) > (sampled or 0):
            bad(f"{label}: the replica sampled no micro-batch after the rejoin")
    finally:
        d.stop()
    check_byes(d, label)


def head_partition(tmp, compute_ranks=1):
    """kill -9 of memory rank 1 under load with memory.partition head: rank 0 takes every KV head,
    the restarted rank 1 rejoins and the two split them again; the fault-free tokens throughout.
    With a compute replica: it takes both splits and is kept."""
    label = "kill -9 under the head partition" + (" with a replica" if compute_ranks > 1 else "")
    d = Deployment(tmp, compute_ranks=compute_ranks, partition="head")
    try:
        if d.url is None:
            return
        done = kill_until_rejoined(d, label, lambda: re.search(r"memory rank 1 \(\S+\) rejoined", d.log("compute-0"))
                                   and "split again over 2 memory rank" in d.log("compute-0"))
        if done is None:
            return
        expect, _ = done
        log0 = d.log("compute-0")
        for want in ("split again over 1 memory rank", "memory rank 0: cpu, 512 KV tokens of KV heads [0, "):
            if want not in log0:
                bad(f"{label}: compute-0's log does not say {want!r}: {log0[-800:]}")
        if d.log("memory-0").count("re-partitioned by compute rank 0") < 2:
            bad(f"{label}: memory rank 0 was not re-partitioned twice (loss, rejoin): {d.log('memory-0')[-600:]}")
        for name, want in (("memory_ranks_rejoined_total", 1), ("memory_ranks_lost_total", 1)):
            if d.metric(name) != want:
                bad(f"{label}: tandem:{name} is {d.metric(name)}, not {want}")
        if compute_ranks > 1:
            log1 = d.log("compute-1")
            for want in ("the KV heads over 1 memory rank(s)", "the KV heads over 2 memory rank(s)"):
                if want not in log1:
                    bad(f"{label}: the replica's log does not say {want!r}: {log1[-800:]}")
            for name, want in (("compute_ranks_live", 2), ("compute_ranks_lost_total", 0)):
                if d.metric(name) != want:
                    bad(f"{label}: tandem:{name} is {d.metric(name)}, not {want}")
        if d.proc.poll() is not None:
            bad(f"{label}: the deployment stopped: {d.err()[-600:]}")
        after = [d.tokens(p, e) for p, e in REQUESTS]
        if after != expect:
            bad(f"{label}: after the rejoin: tokens {after} differ from the fault-free {expect}")
    finally:
        d.stop()
    check_byes(d, label)


def stays_away(tmp):
    """kill -9 of memory rank 1 with no restart (launch.restart_memory_ranks 0): compute rank 0 probes
    its address less and less often (the wait after a probe nothing answers doubles from
    launch.rejoin_probe_s), and requests go on on rank 0. Then memory rank 1 is started by hand with
    the command the launcher printed: it rejoins, takes requests, and leaves with the deployment."""
    label = "kill -9, not restarted"
    d = Deployment(tmp, restarts=0, env={"TANDEM_LOG_LEVEL": "debug"})  # a dropped probe is a debug line
    hand = None
    try:
        expect = fault_free(d)
        if expect is None:
            return
        victim = d.memory_pids(1)
        if not victim:
            bad(f"{label}: memory rank 1 not found")
            return
        signal_all(victim, signal.SIGKILL)
        if wait_for(lambda: "giving up memory rank 1 (" in d.log("compute-0"), BOUND_S) is None:
            bad(f"{label}: the killed rank was not given up within {BOUND_S} s: {d.log('compute-0')[-800:]}")
            return
        time.sleep(4.0)
        waits = []
        for m in re.finditer(r"memory rank 1 \(\S+\): rejoin probe dropped \(next in ([0-9.]+)(ms|s)\)",
                             d.log("compute-0")):
            waits.append(float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0))
        print(f"{label}: {len(waits)} probes in the 4 s after the loss, waits after them "
              f"{', '.join('%.1f s' % w for w in waits)}", flush=True)
        # 0.2, 0.4, 0.8, 1.6 s: at most 5 probes in 4 s (a probe refused at once: the rank is gone).
        if not 2 <= len(waits) <= 6 or any(abs(b - 2 * a) > 1e-6 for a, b in zip(waits, waits[1:])):
            bad(f"{label}: probe waits {waits}, expected 0.2 s doubling: {d.log('compute-0')[-800:]}")
        if [d.tokens(p, e) for p, e in REQUESTS] != expect:
            bad(f"{label}: tokens on memory rank 0 alone differ from the fault-free ones")
        if d.proc.poll() is not None:
            bad(f"{label}: the deployment stopped: {d.err()[-600:]}")
            return

        # Started again by hand with the command the launcher printed when it did not restart it.
        label = "restarted by hand"
        m = re.search(r"^tandem launch: memory-1: compute-0 takes back a new process of it started by hand: (.*)$",
                      d.err(), re.M)
        listen = re.search(r"memory-1 listening on (\S+)", d.err())
        if m is None or listen is None:
            bad(f"{label}: the launcher printed no command for memory-1, or no address: {d.err()[-600:]}")
            return
        argv = shlex.split(m.group(1))
        listens = argv[argv.index("--listen") + 1] if "--listen" in argv[:-1] else None
        if listens != listen.group(1):
            bad(f"{label}: the printed command listens on {listens}, not where memory-1 listened "
                f"({listen.group(1)}): {m.group(1)}")
        hand_log = os.path.join(d.dir, "memory-1.by-hand.log")
        start = time.time()
        hand = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(hand_log, "w"))
        took = wait_for(lambda: re.search(r"memory rank 1 \(\S+\) rejoined", d.log("compute-0")), BOUND_S)
        print(f"{label}: rejoined {'%.1f s' % took if took is not None else 'never'} after its start "
              f"({' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(argv[:6]))} ...)", flush=True)
        if took is None:
            bad(f"{label}: memory rank 1 did not rejoin within {BOUND_S} s: {d.log('compute-0')[-800:]}\n"
                f"{open(hand_log).read()[-600:]}")
            return
        if d.metric("memory_ranks_rejoined_total") != 1:
            bad(f"{label}: tandem:memory_ranks_rejoined_total is {d.metric('memory_ranks_rejoined_total')}, not 1")
        spread(d)
        if [d.tokens(p, e) for p, e in REQUESTS] != expect:
            bad(f"{label}: tokens differ from the fault-free ones after the rejoin")
        print(f"{label}: {time.time() - start:.1f} s from its start to the last request", flush=True)
    finally:
        d.stop(spare=[hand.pid] if hand else ())
        if hand is not None:
            # It leaves with the deployment: compute rank 0's bye, or its silence (heartbeats).
            try:
                hand.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bad(f"{label}: the memory rank started by hand was still running 30 s after the deployment "
                    f"stopped: {open(hand_log).read()[-600:]}")
                hand.kill()
                hand.wait()
            byes = re.findall(r"memory rank 1: bye after \d+ steps \((\d+) with rows here\)", open(hand_log).read())
            print(f"{label}: exit {hand.returncode}; {byes[-1] if byes else '?'} steps with rows", flush=True)
            if not byes or int(byes[-1]) == 0:
                bad(f"{label}: the process started by hand ran no steps with rows (or said no bye): "
                    f"{open(hand_log).read()[-600:]}")


def main():
    # "replica": only the case with a compute replica; "head": only the head partition's; "away": only
    # the rank that is not restarted.
    only = os.environ.get("TANDEM_FAULT_CASE")
    with tempfile.TemporaryDirectory(prefix="tandem-rejoin-") as tmp:
        if only in (None, "replica"):
            with_replica(tmp)
        if only in (None, "head"):
            head_partition(tmp)
            head_partition(tmp, compute_ranks=2)
        if only in (None, "away"):
            stays_away(tmp)
        if only is not None:
            print(f"{len(failures)} failure(s)")
            sys.exit(1 if failures else 0)
        d = Deployment(tmp)
        try:
            expect = fault_free(d)
            if expect is None:
                return

            # kill -9 under load: restarted by the launcher, taken back by compute rank 0.
            load = Load(d, expect, "kill -9")
            time.sleep(1.0)
            victim = d.memory_pids(1)
            if not victim:
                bad("memory rank 1 not found")
                load.finish()
                return
            signal_all(victim, signal.SIGKILL)
            took = wait_for(lambda: "rejoined" in d.log("compute-0"), BOUND_S)
            time.sleep(1.0)  # requests placed on the rejoined rank
            load.finish()
            print(f"kill -9 of memory rank 1: rejoined {'%.1f s' % took if took is not None else 'never'} after "
                  f"the kill", flush=True)
            if took is None:
                bad(f"memory rank 1 did not rejoin within {BOUND_S} s: {d.log('compute-0')[-800:]}\n{d.err()[-600:]}")
                return
            if "restarting it (restart 1 of 2)" not in d.err() or "memory-1 restarted (pid" not in d.err():
                bad(f"the launcher did not report the restart: {d.err()[-600:]}")
            if not re.search(r"memory rank 1 \(\S+\) rejoined", d.log("compute-0")):
                bad(f"compute-0 did not log the rejoin of memory rank 1: {d.log('compute-0')[-600:]}")
            if d.metric("memory_ranks_rejoined_total") != 1 or d.metric("memory_ranks_lost_total") != 1:
                bad(f"metrics: lost {d.metric('memory_ranks_lost_total')}, "
                    f"rejoined {d.metric('memory_ranks_rejoined_total')}; expected 1 and 1")
            # New requests after the rejoin: the restarted rank holds some of them.
            after = [d.tokens(p, e) for p, e in REQUESTS]
            if after != expect:
                bad(f"after the rejoin: tokens {after} differ from the fault-free {expect}")

            # SIGSTOP of the restarted rank under load, SIGCONT once it is given up.
            load = Load(d, expect, "SIGSTOP/SIGCONT")
            time.sleep(0.5)
            victim = d.memory_pids(1)
            signal_all(victim, signal.SIGSTOP)
            gave_up = wait_for(lambda: d.log("compute-0").count("giving up memory rank 1 (") >= 2, BOUND_S)
            signal_all(victim, signal.SIGCONT)
            again = wait_for(lambda: d.log("compute-0").count(") rejoined") >= 2, BOUND_S)
            load.finish()
            print(f"SIGSTOP of memory rank 1: given up after "
                  f"{'%.1f s' % gave_up if gave_up is not None else 'never'}, rejoined "
                  f"{'%.1f s after SIGCONT' % again if again is not None else 'never'}", flush=True)
            if gave_up is None:
                bad(f"the stopped rank was not given up within {BOUND_S} s: {d.log('compute-0')[-800:]}")
            elif again is None:
                bad(f"the continued rank did not leave and rejoin within {BOUND_S} s: "
                    f"{d.log('compute-0')[-800:]}\n{d.err()[-800:]}")
            if d.proc.poll() is not None:
                bad(f"the deployment stopped: {d.err()[-600:]}")
            if [d.tokens(p, e) for p, e in REQUESTS] != expect:
                bad("after the second rejoin: tokens differ from the fault-free ones")
            spread(d)
        finally:
            d.stop()
        check_byes(d, "one compute rank")
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
