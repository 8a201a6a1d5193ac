#!/usr/bin/env python3
"""Losing a memory rank mid-decode costs a delay, not a request (launch.recover_memory_ranks).

Real processes: `tandem generate --deploy` starts compute rank 0 and N CPU memory ranks over UCX on
127.0.0.1 and runs a batch of requests; while they decode, one memory rank is killed (SIGKILL) or
stopped (SIGSTOP, found silent after launch.step_timeout_s), or, of four, two are killed one after
the other (the second loss recovered on the ranks left by the first). Every request must complete with the
same tokens and log-probabilities as the colocated engine (greedy and seeded sampling), and
compute rank 0 must log the loss and the requests it requeued. With recovery off the run must
fail, naming the lost rank, within a bound. Every case is bounded in time.
Usage: recovery_test.py path/to/tandem (a failed case prints the ends of the rank logs:
TANDEM_FAULT_LOG_LINES lines of each, 15 unless set)
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_util import bad, failures, print_logs  # noqa: E402

TANDEM = sys.argv[1]
MODEL = "small"  # the preset: slow enough on a CPU that a kill lands mid-decode


def prompts(path, n=8):
    rng = random.Random(7)
    with open(path, "w") as f:
        for i in range(n):
            req = {"prompt_ids": [rng.randrange(1, 30000) for _ in range(rng.randrange(4, 40))],
                   "max_tokens": rng.randrange(64, 128)}
            if i % 2:  # seeded sampling: the same counter-based randomness after recomputation
                req.update({"temperature": 0.8, "top_p": 0.9, "seed": 100 + i})
            f.write(json.dumps(req) + "\n")


def deployment(tmp, ranks, step_timeout, recover=True):
    path = os.path.join(tmp, f"deploy-{ranks}-{recover}.yaml")
    with open(path, "w") as f:
        f.write(f"model:\n  path: {MODEL}\ncompute:\n  device: cpu\nmemory:\n  ranks: {ranks}\n  devices: cpu\n"
                f"scheduler:\n  max_batch_size: 8\n  max_tokens_per_step: 64\nkv:\n  capacity_tokens: 2048\n"
                f"launch:\n  run_dir: {tmp}/run\n  step_timeout_s: {step_timeout}\n"
                f"  recover_memory_ranks: {'true' if recover else 'false'}\n")
    return path


def rank_pid(tmp, rank):
    """pid of `tandem memory --rank RANK` of this test's deployment (its config lives in TMP)."""
    out = subprocess.run(["pgrep", "-f", f"memory --rank {rank} .*{tmp}"], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split()]
    return pids[0] if pids else None


def run_with_fault(tmp, ranks, victim, sig, step_timeout, recover=True, delay=1.0, bound=300, then=()):
    """Runs the requests through a deployment, sends `sig` to memory rank `victim` once the
    deployment has run for `delay` seconds after it is ready, then SIGKILL to each (rank, seconds
    later) of `then` in turn; returns (rc, stdout, stderr, seconds)."""
    cmd = [TANDEM, "generate", "--deploy", deployment(tmp, ranks, step_timeout, recover), "--prompts-file",
           os.path.join(tmp, "prompts.jsonl"), "--json", "--logprobs", "--ignore-eos"]
    start = time.time()
    out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        sent, stopped = False, None
        while proc.poll() is None and time.time() - start < bound:
            if not sent and "compute-0 ready" in open(err_path).read():
                time.sleep(delay)
                pid = rank_pid(tmp, victim)
                if pid is None:
                    bad(f"memory rank {victim} not found to signal")
                else:
                    os.kill(pid, sig)
                    stopped = pid if sig == signal.SIGSTOP else None
                for rank, later in then:
                    time.sleep(later)
                    pid = rank_pid(tmp, rank)
                    if pid is None:
                        bad(f"memory rank {rank} not found to kill (the run ended first?)")
                    else:
                        os.kill(pid, signal.SIGKILL)
                sent = True
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            bad(f"{' '.join(cmd)} still running after {bound} s")
        proc.wait()
        if stopped:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not sent:
        bad("the fault was never injected (the deployment never said it was ready)")
    return proc.returncode, open(out_path).read(), open(err_path).read(), time.time() - start


def compute_log(tmp):
    with open(os.path.join(tmp, "run", "latest", "compute-0.log")) as f:
        return f.read()


def main():
    with tempfile.TemporaryDirectory(prefix="tandem-recovery-") as tmp:
        prompts(os.path.join(tmp, "prompts.jsonl"))
        reference = subprocess.run(
            [TANDEM, "generate", "--model", MODEL, "--device", "cpu", "--prompts-file",
             os.path.join(tmp, "prompts.jsonl"), "--json", "--logprobs", "--ignore-eos", "--set",
             "scheduler.max_batch_size=8", "--set", "scheduler.max_tokens_per_step=64"],
            capture_output=True, text=True, timeout=300)
        if reference.returncode != 0:
            bad(f"colocated run failed: {reference.stderr[-400:]}")
            return
        expect = reference.stdout

        def same(out):
            got, want = out.strip().splitlines(), expect.strip().splitlines()
            if len(got) != len(want):
                return f"{len(got)} results, expected {len(want)}"
            for i, (g, w) in enumerate(zip(got, want)):
                g, w = json.loads(g), json.loads(w)
                if g["token_ids"] != w["token_ids"]:
                    return f"request {i}: tokens {g['token_ids']} != {w['token_ids']}"
                if any(abs(a - b) > 1e-3 for a, b in zip(g["logprobs"], w["logprobs"])):
                    return f"request {i}: log-probabilities differ"
            return None

        # (name, memory ranks, victim, signal, launch.step_timeout_s, later kills: (rank, seconds after))
        cases = [("SIGKILL of memory rank 1 of 2", 2, 1, signal.SIGKILL, 20, ()),
                 ("SIGKILL of memory rank 0 of 3", 3, 0, signal.SIGKILL, 20, ()),
                 ("SIGSTOP of memory rank 2 of 3", 3, 2, signal.SIGSTOP, 3, ()),
                 ("SIGKILL of memory rank 3 of 4, then of memory rank 1", 4, 3, signal.SIGKILL, 20, ((1, 1.5),))]
        for name, ranks, victim, sig, timeout, then in cases:
            rc, out, err, secs = run_with_fault(tmp, ranks, victim, sig, timeout, then=then)
            print(f"{name}: exit {rc} after {secs:.1f} s")
            if rc != 0:
                bad(f"{name}: generate failed: {err[-600:]}")
                print_logs(tmp)  # every rank's side: the compute rank's alone did not say why
                continue
            diff = same(out)
            if diff:
                bad(f"{name}: results differ from the colocated engine: {diff}")
            log = compute_log(tmp)
            for lost in [victim] + [rank for rank, _ in then]:
                if not any(f"memory rank {lost} (" in line and "is lost;" in line for line in log.splitlines()):
                    bad(f"{name}: compute-0 did not log the loss of memory rank {lost}: {log[-800:]}")
            if "go back to the queue to be recomputed" not in log:
                bad(f"{name}: compute-0 did not log the requeued requests")
            if "recovered" not in err:
                bad(f"{name}: generate's summary does not report the recovery: {err[-400:]}")

        # Recovery off: a clean failure naming the rank, bounded by the step timeout.
        rc, out, err, secs = run_with_fault(tmp, 2, 1, signal.SIGSTOP, 3, recover=False)
        print(f"recovery off, SIGSTOP of memory rank 1: exit {rc} after {secs:.1f} s")
        if rc == 0:
            bad("recovery off: a stopped memory rank did not fail the run")
        elif "memory rank 1" not in err and "memory-1" not in err:
            bad(f"recovery off: the error does not name memory rank 1: {err[-600:]}")
        if secs > 120:
            bad(f"recovery off: the failure took {secs:.0f} s")
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
