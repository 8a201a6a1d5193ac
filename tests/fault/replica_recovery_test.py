#!/usr/bin/env python3
"""Recovery in deployments with compute replicas: a lost replica among several, and a lost memory
rank while a replica runs, cost a delay; every request completes with the tokens of a fault-free run.

Real processes: `tandem serve --deploy` on the CPU over UCX on 127.0.0.1 (two memory ranks,
launch.heartbeat_s 0.5, launch.step_timeout_s 2; tests/fault/compute_loss_test.py's deployment).
Cases, each bounded in time:
  * compute.ranks 3 (pipeline.mode fixed, and rotational), one replica killed (kill -9), or
    stopped (SIGSTOP; fixed: found silent after a step deadline) under a stream of requests: compute rank 0 gives it up, releases the other replica (which exits with
    status 0, and the launcher goes on), runs the step in flight again and every micro-batch from
    then on; every request gets the tokens the same requests got one by one before the fault
    (greedy and seeded sampling); /metrics counts tandem:compute_ranks_lost_total 1;
  * compute.ranks 2, memory rank 1 killed under a stream of requests: compute rank 0 releases the
    replica (exit status 0), runs the step again without the rank and recomputes its requests on
    the survivor; the same tokens; tandem:memory_ranks_lost_total 1. The launcher restarts the
    rank and compute rank 0 takes it back (launch.restart_memory_ranks, launch.rejoin_probe_s).
Usage: replica_recovery_test.py path/to/tandem
"""
import os
import signal
import sys
import tempfile
import threading
import time

from compute_loss_test import REQUESTS, STEP_TIMEOUT_S, Deployment
from fault_util import bad, failures, signal_all, wait_for

# A kill is seen at once (the transport reports the disconnect), a stopped replica after a step
# deadline and a heartbeat's allowance; the rest is slack for a loaded 2-core machine.
LOSS_BOUND_S = 2 * STEP_TIMEOUT_S + 15


def lose_rank(tmp, name, compute_ranks, mode, victim, given_up, metric, released, sig=signal.SIGKILL):
    """`victim` killed (or stopped: `sig`) under load; `given_up` is compute-0's log line for it,
    `metric` the counter that must read 1, `released` the replicas that must exit cleanly."""
    d = Deployment(tmp, name, compute_ranks=compute_ranks, mode=mode, batches=max(2, compute_ranks))
    try:
        if d.url is None:
            return
        expect = [d.tokens(p, e) for p, e in REQUESTS]  # one by one, before any fault
        if not all(isinstance(t, list) and len(t) == 40 for t in expect):
            bad(f"{name}: the fault-free requests failed: {expect[:1]}")
            return
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
        took = wait_for(lambda: given_up in d.log("compute-0"), LOSS_BOUND_S)
        before = done[0]
        more = wait_for(lambda: done[0] >= before + 6, LOSS_BOUND_S)
        stop[0] = True
        for t in threads:
            t.join(90)
        print(f"{name}: {victim} given up after {'%.1f s' % took if took is not None else 'never'}; "
              f"{done[0]} requests in {time.time() - start:.1f} s, {len(wrong)} with other tokens; "
              f"steps rerun {d.metric('steps_rerun_total')}", flush=True)
        if took is None:
            bad(f"{name}: compute-0 did not log {given_up!r} within {LOSS_BOUND_S} s: {d.log('compute-0')[-800:]}")
        if more is None:
            bad(f"{name}: requests stopped completing after the loss: {d.err()[-600:]}")
        if any(t.is_alive() for t in threads):
            bad(f"{name}: a client still waits 90 s after the load stopped")
        for i, got in wrong[:3]:
            bad(f"{name}: request {i} got {got}, fault-free {expect[i]}")
        if d.metric(metric) != 1:
            bad(f"{name}: tandem:{metric} is {d.metric(metric)}, not 1")
        if not d.metric("steps_rerun_total"):
            bad(f"{name}: tandem:steps_rerun_total is {d.metric('steps_rerun_total')}, not at least 1")
        if d.proc.poll() is not None:
            bad(f"{name}: the deployment ended after the loss: {d.err()[-600:]}")
        for rank in released:
            if wait_for(lambda: not d.rank_pids(rank), 15) is None:
                bad(f"{name}: {rank} was not released: still running")
            if f"tandem launch: {rank} (pid" not in d.err() or "exited cleanly" not in d.err():
                bad(f"{name}: the launcher does not report {rank}'s clean exit: {d.err()[-600:]}")
            if "released by compute rank 0" not in d.log(rank):
                bad(f"{name}: {rank}'s log does not say it was released: {d.last_line(rank)}")
        for rank in ("memory-0", "memory-1"):
            if rank != victim and not d.rank_pids(rank):
                bad(f"{name}: {rank} exited after the loss: {d.last_line(rank)}")
    finally:
        d.stop()


def main():
    start = time.time()
    keep = os.environ.get("TANDEM_KEEP_RUN")  # a directory to keep the runs (and their logs) in
    with tempfile.TemporaryDirectory(prefix="tandem-replicarecovery-") as scratch:
        tmp = tempfile.mkdtemp(prefix="tandem-replicarecovery-", dir=keep) if keep else scratch
        cases = [
            lambda t: lose_rank(t, "replica-killed-3-fixed", 3, "fixed", "compute-2", "giving up compute rank 2",
                                "compute_ranks_lost_total", ["compute-1"]),
            lambda t: lose_rank(t, "replica-killed-3-rotational", 3, "rotational", "compute-1",
                                "giving up compute rank 1", "compute_ranks_lost_total", ["compute-2"]),
            lambda t: lose_rank(t, "replica-stopped-3-fixed", 3, "fixed", "compute-1", "giving up compute rank 1",
                                "compute_ranks_lost_total", ["compute-2"], sig=signal.SIGSTOP),
            lambda t: lose_rank(t, "memory-killed-with-replica", 2, "fixed", "memory-1", "giving up memory rank 1",
                                "memory_ranks_lost_total", ["compute-1"]),
        ]
        only = os.environ.get("TANDEM_FAULT_CASE")  # a case's index, to run it alone
        for k, case in enumerate(cases):
            if only is None or int(only) == k:
                case(tmp)
    print(f"{len(failures)} failure(s) in {time.time() - start:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
