#!/usr/bin/env python3
"""Recovery in deployments with compute replicas: a lost replica among several, and a lost memory
rank while a replica runs, cost a delay; every request completes with the tokens of a fault-free run.

Real processes: `tandem serve --deploy` on the CPU over UCX on 127.0.0.1 (two memory ranks,
launch.heartbeat_s 0.5, launch.step_timeout_s 2; tests/fault/compute_loss_test.py's deployment).
Cases, each bounded in time:
  * compute.ranks 3, pipeline.mode fixed, one replica killed (kill -9), or stopped (SIGSTOP: found
    silent after a step deadline) under a stream of requests: compute rank 0 gives it up, keeps the
    other replica (its log says so; it keeps running; /metrics counts
    tandem:compute_replicas_kept_total and tandem:compute_ranks_live 2), and runs the step in flight
    again on the two compute ranks left, which share the micro-batches from then on;
  * pipeline.mode rotational, a replica killed or stopped: the others are kept as under fixed, and
    the ring of residual streams closes over the lost one (compute.ranks 3: compute rank 0 is one of
    its neighbours and hands to, or takes from, the other replica over its own connection;
    compute.ranks 4 with compute-2 killed: compute-1 connects to compute-3, its log naming its new
    successor);
  * compute.ranks 2, memory rank 1 killed under a stream of requests: compute rank 0 keeps the
    replica (the step discard tells it the rank is lost), runs the step again without the rank and
    recomputes its requests on the survivor; tandem:memory_ranks_lost_total 1;
  * the same with memory rank 1 stopped (SIGSTOP): whether or not compute rank 0 itself waits on it
    (its micro-batches may have no rows there: then only the replica does, and compute rank 0's wait
    for the replica's result passes its deadline), compute rank 0 heartbeats every replica and
    memory rank after the step's deadline, names and gives up memory rank 1, the one that does not
    answer (never memory rank 0), and goes on as for the kill.
Every request gets the tokens the same requests got one by one before the fault (greedy and seeded
sampling); the counter of the loss reads 1; the replicas kept go on sampling micro-batches
(tandem:replica_micro_batches_total grows over a few requests after the loss).
Usage: replica_recovery_test.py path/to/tandem
"""
import os
import signal
import sys
import tempfile
import threading
import time

from compute_loss_test import REQUESTS, Deployment, fault_under_load
from fault_util import bad, failures, wait_for


def lose_rank(tmp, name, compute_ranks, mode, victim, given_up, metric, kept=(), sig=signal.SIGKILL, logs=()):
    """`victim` killed (or stopped: `sig`) under load; `given_up` is compute-0's log line for it,
    `metric` the counter that must read 1, `kept` the replicas that must go on, `logs` (rank, text)
    pairs that must be in a rank's log."""
    d = Deployment(tmp, name, compute_ranks=compute_ranks, mode=mode, batches=max(2, compute_ranks))
    try:
        if d.url is None:
            return
        if not fault_under_load(d, name, victim, sig, given_up):
            return
        if d.metric(metric) != 1:
            bad(f"{name}: tandem:{metric} is {d.metric(metric)}, not 1")
        if not d.metric("steps_rerun_total"):
            bad(f"{name}: tandem:steps_rerun_total is {d.metric('steps_rerun_total')}, not at least 1")
        if d.proc.poll() is not None:
            bad(f"{name}: the deployment ended after the loss: {d.err()[-600:]}")
        for rank in kept:
            if not d.rank_pids(rank):
                bad(f"{name}: {rank} exited after the loss, not kept: {d.last_line(rank)}")
            if "kept by compute rank 0" not in d.log(rank):
                bad(f"{name}: {rank}'s log does not say it was kept: {d.last_line(rank)}")
            if f"tandem launch: {rank} (pid" in d.err():
                bad(f"{name}: the launcher reports {rank} gone: {d.err()[-600:]}")
        if kept:
            # The replicas kept still sample micro-batches: a few more requests after the loss, at
            # once (a step of one request is one micro-batch, compute rank 0's).
            before = d.metric("replica_micro_batches_total") or 0
            clients = [threading.Thread(target=d.tokens, args=r) for r in REQUESTS[:4]]
            for t in clients:
                t.start()
            for t in clients:
                t.join(60)
            after = d.metric("replica_micro_batches_total") or 0
            if after <= before:
                bad(f"{name}: no replica sampled a micro-batch after the loss "
                    f"(tandem:replica_micro_batches_total {before} then {after})")
            if not d.metric("compute_replicas_kept_total"):
                bad(f"{name}: tandem:compute_replicas_kept_total is {d.metric('compute_replicas_kept_total')}")
            live = compute_ranks - (1 if victim.startswith("compute-") else 0)
            if d.metric("compute_ranks_live") != live:
                bad(f"{name}: tandem:compute_ranks_live is {d.metric('compute_ranks_live')}, not {live}")
        for rank, text in logs:
            if text not in d.log(rank):
                bad(f"{name}: {rank}'s log does not say {text!r}: {d.log(rank)[-800:]}")
        for rank in ("memory-0", "memory-1"):
            if rank != victim and not d.rank_pids(rank):
                bad(f"{name}: {rank} exited after the loss: {d.last_line(rank)}")
        # Only the victim is blamed: never a healthy neighbour, nor a replica for a memory rank.
        for rank in ["memory-0", "memory-1"] + [f"compute-{c}" for c in range(1, compute_ranks)]:
            blamed = f"giving up {rank.split('-')[0]} rank {rank.split('-')[1]} ("
            if rank != victim and blamed in d.log("compute-0"):
                bad(f"{name}: compute-0 gave up {rank}, not only {victim}: {d.log('compute-0')[-800:]}")
    finally:
        d.stop()


def main():
    start = time.time()
    keep = os.environ.get("TANDEM_KEEP_RUN")  # a directory to keep the runs (and their logs) in
    with tempfile.TemporaryDirectory(prefix="tandem-replicarecovery-") as scratch:
        tmp = tempfile.mkdtemp(prefix="tandem-replicarecovery-", dir=keep) if keep else scratch
        cases = [
            lambda t: lose_rank(t, "replica-killed-3-fixed", 3, "fixed", "compute-2", "giving up compute rank 2",
                                "compute_ranks_lost_total", kept=["compute-1"]),
            lambda t: lose_rank(t, "replica-killed-3-rotational", 3, "rotational", "compute-1",
                                "giving up compute rank 1", "compute_ranks_lost_total", kept=["compute-2"],
                                logs=[("compute-2", "ring: from compute rank 0 to compute rank 0")]),
            lambda t: lose_rank(t, "replica-stopped-3-rotational", 3, "rotational", "compute-2",
                                "giving up compute rank 2", "compute_ranks_lost_total", kept=["compute-1"],
                                sig=signal.SIGSTOP),
            lambda t: lose_rank(t, "replica-killed-4-rotational", 4, "rotational", "compute-2",
                                "giving up compute rank 2", "compute_ranks_lost_total",
                                kept=["compute-1", "compute-3"],
                                logs=[("compute-1", "to compute rank 3 ("), ("compute-3", "ring: from compute rank 1 to"),
                                      ("compute-0", "the ring goes from compute rank 1")]),
            lambda t: lose_rank(t, "replica-stopped-3-fixed", 3, "fixed", "compute-1", "giving up compute rank 1",
                                "compute_ranks_lost_total", kept=["compute-2"], sig=signal.SIGSTOP),
            lambda t: lose_rank(t, "memory-killed-with-replica", 2, "fixed", "memory-1", "giving up memory rank 1",
                                "memory_ranks_lost_total", kept=["compute-1"]),
            lambda t: lose_rank(t, "memory-stopped-with-replica", 2, "fixed", "memory-1", "giving up memory rank 1",
                                "memory_ranks_lost_total", kept=["compute-1"], sig=signal.SIGSTOP),
        ]
        only = os.environ.get("TANDEM_FAULT_CASE")  # a case's index, to run it alone
        for k, case in enumerate(cases):
            if only is None or int(only) == k:
                case(tmp)
    print(f"{len(failures)} failure(s) in {time.time() - start:.1f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
