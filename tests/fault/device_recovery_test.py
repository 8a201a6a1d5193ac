#!/usr/bin/env python3
"""Losing a memory rank on the device path costs a delay, not a request (launch.recover_memory_ranks).

Real processes on one GPU: `tandem generate --deploy` starts compute rank 0 and 2 or 3 memory ranks,
every one on cuda:0, over the p2p transport (each step enqueued whole, device-side waits; between
processes on one GPU, interprocess events), with or without a compute replica (pipeline.mode fixed),
and in one case 4 compute ranks under pipeline.mode rotational.
While the requests decode, one memory rank is killed (SIGKILL) or stopped (SIGSTOP, found silent
after launch.step_timeout_s), or a replica is killed. Compute rank 0 discards the step, every
surviving rank drains and resets its device path, and the step runs again without the rank; a lost
memory rank's requests are recomputed on the others, and a lost replica's micro-batches run on the
compute ranks left (rotational: the ring of residual streams closes over it, its neighbours connected
to each other, the other replicas kept). In the "restarted and rejoined" cases the
launcher restarts the killed rank (launch.rejoin_probe_s 0.2) and compute rank 0 takes it back on
the device path (the probe's connection carries p2p's doorbells and buffer handles; a compute
replica connects to the new process first): requests admitted after the rejoin run attention there
(the new process's bye counts steps with rows). Under memory.partition head every
rank holds KV heads of every request: the step in flight is discarded and dropped, every request
goes back to the queue, and the survivors split the KV heads again (new device buffers, fresh
buffer ids; a compute replica takes the new split too); with a restart, the new process rejoins
through another split. Every request must complete, with the tokens of
a fault-free run of the same deployment up to bf16 rounding: log-probabilities as the fault-free
run's until a request's tokens part from its tokens, and a greedy request may part only at a near
tie (the recomputed requests are prefilled, and every step after the loss has other rows, so the
GEMMs round differently). How many part is not bounded: the preset's random weights give nearly
flat logits, near ties at most positions (11 of 16 requests parted at one in a run on an H200).
Each case is bounded in time.
With TANDEM_FAULT_TRANSPORT=nccl the same deployments run over the nccl transport, every rank still
on one GPU (TANDEM_NCCL_SHARE_GPU=1: each process is a host of its own to NCCL, whose transfers then
go over sockets on loopback), for the cases nccl recovers: a memory rank's loss, its restart and
rejoin (the new process's communicators are set up between steps, before compute rank 0 and the
replicas take it), and a replica's loss under pipeline.mode fixed; no rotational ring made anew (it
needs a communicator between ranks that had none). There every rank aborts only the lost rank's
communicators and its step runs through, so the healthy ranks' communicators stay in step for the
rerun.
Usage: device_recovery_test.py path/to/tandem   (exit 77, skipped, without a GPU)
Environment: TANDEM_FAULT_CASE (see main), TANDEM_FAULT_TRANSPORT (p2p, or nccl),
TANDEM_FAULT_CHECKSUMS (transport.checksums: auto, true or false; true runs nccl's with payload
checksums), TANDEM_FAULT_MEMORY_DEVICE (cuda:0; cuda:1 puts the memory ranks on a second GPU, the cases without
a replica, and nccl then needs no shared-GPU setting),
TANDEM_FAULT_KEEP_LOGS=DIR (each case's rank logs kept in DIR/case-N), TANDEM_FAULT_LOG_LINES (lines
of each log printed for a failed case, 15).
"""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_util import bad, failures, pids, print_logs  # noqa: E402

TANDEM = sys.argv[1]
MODEL = "small"  # a preset (random weights): 12 layers
TIE_GAP = 0.05   # log-probabilities this close are a near tie (bf16 rounding moves them by ~1e-2)
TRANSPORT = os.environ.get("TANDEM_FAULT_TRANSPORT", "p2p")
MEMORY_DEVICE = os.environ.get("TANDEM_FAULT_MEMORY_DEVICE", "cuda:0")  # cuda:1: across two GPUs
CHECKSUMS = os.environ.get("TANDEM_FAULT_CHECKSUMS", "auto")  # transport.checksums


def have_gpu():
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def prompts(path, n=16):
    rng = random.Random(11)
    with open(path, "w") as f:
        for i in range(n):
            # nccl between processes of one GPU moves every transfer over loopback sockets: shorter runs.
            tokens = rng.randrange(600, 900) if TRANSPORT == "p2p" else rng.randrange(200, 300)
            req = {"prompt_ids": [rng.randrange(1, 30000) for _ in range(rng.randrange(4, 60))],
                   "max_tokens": tokens}
            if i % 4 == 3:  # seeded sampling: the same counter-based draws after recomputation
                req.update({"temperature": 0.8, "top_p": 0.9, "seed": 100 + i})
            f.write(json.dumps(req) + "\n")


def deployment(tmp, ranks, step_timeout, compute_ranks=1, batch=16, partition="request"):
    path = os.path.join(tmp, f"deploy-{ranks}-{compute_ranks}-{batch}-{partition}.yaml")
    # With a replica: pipeline.mode fixed, micro-batch j on compute rank j % 2. "head-pingpong": the
    # head partition with two micro-batches in flight and q-first layers.
    pipeline = "pipeline:\n  mode: fixed\n  batches: 2\n" if compute_ranks > 1 else ""
    if partition == "head-pingpong":
        partition, pipeline = "head", "pipeline:\n  mode: pingpong\n  batches: 2\n  q_first: true\n"
    if partition == "rotational":  # a micro-batch per compute rank and one more (the Lamina layout)
        partition, pipeline = "request", f"pipeline:\n  mode: rotational\n  batches: {compute_ranks + 1}\n"
    with open(path, "w") as f:
        f.write(f"model:\n  path: {MODEL}\ncompute:\n  device: cuda:0\n  ranks: {compute_ranks}\n"
                f"memory:\n  ranks: {ranks}\n  devices: {MEMORY_DEVICE}\n  partition: {partition}\ntransport:\n  kind: {TRANSPORT}\n  checksums: {CHECKSUMS}\n{pipeline}"
                f"scheduler:\n  max_batch_size: {batch}\n  max_tokens_per_step: 256\nkv:\n  capacity_tokens: 16384\n"
                f"launch:\n  run_dir: {tmp}/run\n  step_timeout_s: {step_timeout}\n  rejoin_probe_s: 0.2\n")
    return path


def run(tmp, ranks, step_timeout, compute_ranks=1, victim=None, sig=None, delay=None, bound=240, batch=16,
        partition="request"):
    """Runs the requests through a deployment; with `victim` ("memory-N" or "compute-N"), sends `sig`
    to that rank `delay` seconds after compute-0 is ready. Returns (rc, stdout, stderr, seconds,
    seconds run after the signal). The default delay: 1.5 s; on nccl 5 s, after the communicators'
    set-up, which the first step starts (a rank lost within it is not recovered: see the docstring)."""
    if delay is None:
        delay = 1.5 if TRANSPORT == "p2p" else 5.0
    cmd = [TANDEM, "generate", "--deploy", deployment(tmp, ranks, step_timeout, compute_ranks, batch, partition),
           "--prompts-file",
           os.path.join(tmp, "prompts.jsonl"), "--json", "--logprobs", "--ignore-eos"]
    start = time.time()
    out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
    signalled_at, stopped = None, []
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        while proc.poll() is None and time.time() - start < bound:
            if victim is not None and signalled_at is None and "compute-0 ready" in open(err_path).read():
                time.sleep(delay)
                kind, n = victim.split("-")
                found = pids(f"memory --rank {n} .*{tmp}" if kind == "memory" else f"compute --replica {n} .*{tmp}")
                if not found:
                    bad(f"{victim} not found to signal")
                    signalled_at = time.time()
                    continue
                for pid in found:
                    os.kill(pid, sig)
                if sig == signal.SIGSTOP:
                    stopped = found
                signalled_at = time.time()
            time.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            bad(f"{' '.join(cmd)} still running after {bound} s")
        proc.wait()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if victim is not None and signalled_at is None:
        bad("the fault was never injected (the deployment never said it was ready)")
    after = time.time() - signalled_at if signalled_at else 0.0
    return proc.returncode, open(out_path).read(), open(err_path).read(), time.time() - start, after


def compare(got_text, want_text, name):
    """Tokens as the fault-free run's up to near ties; prints and returns the figures."""
    got, want = got_text.strip().splitlines(), want_text.strip().splitlines()
    if len(got) != len(want):
        bad(f"{name}: {len(got)} results, expected {len(want)}")
        return
    parted, max_diff = 0, 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = json.loads(g), json.loads(w)
        if len(g["token_ids"]) != len(w["token_ids"]):
            bad(f"{name}: request {i} has {len(g['token_ids'])} tokens, expected {len(w['token_ids'])}")
            continue
        k = 0
        while k < len(w["token_ids"]) and g["token_ids"][k] == w["token_ids"][k]:
            max_diff = max(max_diff, abs(g["logprobs"][k] - w["logprobs"][k]))
            k += 1
        if k == len(w["token_ids"]):
            continue
        parted += 1
        gap = abs(g["logprobs"][k] - w["logprobs"][k])
        sampled = i % 4 == 3  # as prompts() made them
        # A sampled request may part wherever its log-probabilities agreed up to then (rounding
        # moves the draw's boundaries); a greedy one only at a near tie.
        if not sampled and gap >= TIE_GAP:
            bad(f"{name}: request {i} parts at token {k} ({g['token_ids'][k]} vs {w['token_ids'][k]}, "
                f"log-probabilities {g['logprobs'][k]:.4f} vs {w['logprobs'][k]:.4f}): not a near tie")
    if max_diff > TIE_GAP:
        bad(f"{name}: log-probabilities differ by up to {max_diff:.4f} before any token differs")
    print(f"{name}: {parted} of {len(want)} requests parted at a near tie, max |logprob difference| "
          f"{max_diff:.4f} before", flush=True)


def stamp_of(line):
    """The time of a log line (they start with the local time to the millisecond)."""
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + float(line[19:23])


def keep_logs(tmp, case):
    """With TANDEM_FAULT_KEEP_LOGS=DIR, the case's rank logs are copied to DIR/case-N/."""
    keep = os.environ.get("TANDEM_FAULT_KEEP_LOGS")
    latest = os.path.join(tmp, "run", "latest")
    if keep and os.path.isdir(latest):
        shutil.copytree(latest, os.path.join(keep, f"case-{case}"), dirs_exist_ok=True)


def main():
    if not have_gpu():
        print("skipped: no GPU (nvidia-smi -L failed)")
        sys.exit(77)
    if TRANSPORT not in ("p2p", "nccl"):
        bad(f"TANDEM_FAULT_TRANSPORT={TRANSPORT}: p2p or nccl")
        sys.exit(1)
    if TRANSPORT == "nccl" and MEMORY_DEVICE == "cuda:0":  # every process on cuda:0 (the ranks inherit these)
        os.environ["TANDEM_NCCL_SHARE_GPU"] = "1"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="tandem-devrec-") as tmp:
        prompts(os.path.join(tmp, "prompts.jsonl"))
        # (name, memory ranks, compute ranks, victim, signal, launch.step_timeout_s, what compute-0 logs,
        #  scheduler.max_batch_size: 8 leaves half the requests waiting, to be placed after a rejoin,
        #  memory.partition)
        cases = [("SIGKILL of memory rank 1 of 2", 2, 1, "memory-1", signal.SIGKILL, 20, "memory rank 1 (", 16,
                  "request"),
                 ("SIGSTOP of memory rank 0 of 3", 3, 1, "memory-0", signal.SIGSTOP, 3, "memory rank 0 (", 16,
                  "request"),
                 ("SIGKILL of memory rank 1 of 2, with a compute replica", 2, 2, "memory-1", signal.SIGKILL, 20,
                  "memory rank 1 (", 16, "request"),
                 ("SIGKILL of the compute replica", 2, 2, "compute-1", signal.SIGKILL, 20, "giving up compute rank 1",
                  16, "request"),
                 ("pipeline.mode rotational over 4 compute ranks: SIGKILL of compute replica 2", 2, 4, "compute-2",
                  signal.SIGKILL, 20, "giving up compute rank 2", 16, "rotational"),
                 ("SIGKILL of memory rank 1 of 2, restarted and rejoined", 2, 1, "memory-1", signal.SIGKILL, 20,
                  "memory rank 1 (", 8, "request"),
                 ("SIGKILL of memory rank 1 of 2, with a compute replica, restarted and rejoined", 2, 2, "memory-1",
                  signal.SIGKILL, 20, "memory rank 1 (", 8, "request"),
                 ("memory.partition head: SIGKILL of memory rank 1 of 3", 3, 1, "memory-1", signal.SIGKILL, 20,
                  "memory rank 1 (", 16, "head"),
                 ("memory.partition head: SIGKILL of memory rank 1 of 2, restarted and rejoined", 2, 1, "memory-1",
                  signal.SIGKILL, 20, "memory rank 1 (", 8, "head"),
                 ("memory.partition head, pingpong and q-first: SIGSTOP of memory rank 0 of 3", 3, 1, "memory-0",
                  signal.SIGSTOP, 3, "memory rank 0 (", 16, "head-pingpong"),
                 ("memory.partition head: SIGKILL of memory rank 1 of 3, with a compute replica", 3, 2, "memory-1",
                  signal.SIGKILL, 20, "memory rank 1 (", 16, "head"),
                 ("memory.partition head: SIGKILL of memory rank 1 of 2, with a compute replica, restarted and "
                  "rejoined", 2, 2, "memory-1", signal.SIGKILL, 20, "memory rank 1 (", 8, "head")]
        # TANDEM_FAULT_CASE: "rejoin" runs the request partition's rejoin cases, "replicas" those with a
        # compute replica, "head" the head partition's cases, "=NAME" the case of that name; any other
        # text the cases whose name has it.
        only = os.environ.get("TANDEM_FAULT_CASE")
        if only == "rejoin":
            cases = [c for c in cases if "rejoined" in c[0] and c[8] == "request"]
        elif only == "replicas":
            cases = [c for c in cases if c[2] > 1]
        elif only == "head":
            cases = [c for c in cases if c[8].startswith("head")]
        elif only and only.startswith("="):  # "=NAME": that case alone
            cases = [c for c in cases if c[0] == only[1:]]
        elif only not in (None, "", "all"):
            cases = [c for c in cases if only in c[0]]  # any other text: the cases whose name holds it
        if TRANSPORT == "nccl":  # a memory rank's loss and rejoin, a replica's loss under pipeline.mode fixed
            cases = [c for c in cases if c[8] != "rotational"]
        if MEMORY_DEVICE != "cuda:0":  # the memory ranks on another GPU; replicas would want GPUs of their own
            cases = [c for c in cases if c[2] == 1]
        print(f"transport {TRANSPORT}, transport.checksums {CHECKSUMS}: {len(cases)} case(s)", flush=True)
        want_of = {}
        for case, (name, ranks, compute_ranks, victim, sig, timeout, lost, batch, partition) in enumerate(cases):
            key = (ranks, compute_ranks, timeout, batch, partition)
            if key not in want_of:
                rc, want, err, secs, _ = run(tmp, ranks, timeout, compute_ranks, batch=batch, partition=partition)
                print(f"fault-free, {compute_ranks} compute + {ranks} memory ranks, memory.partition {partition}: "
                      f"exit {rc} after {secs:.1f} s", flush=True)
                if rc != 0:
                    bad(f"fault-free run with {compute_ranks} compute + {ranks} memory ranks ({partition}) failed: "
                        f"{err[-800:]}")
                    print_logs(tmp)
                    continue
                want_of[key] = want
            want = want_of[key]
            rc, got, err, secs, after = run(tmp, ranks, timeout, compute_ranks, victim, sig, batch=batch,
                                            partition=partition)
            signalled = time.time() - after if after else 0.0
            keep_logs(tmp, case)
            with open(os.path.join(tmp, "run", "latest", "compute-0.log")) as f:
                log = f.read()
            print(f"{name}: exit {rc} after {secs:.1f} s ({after:.1f} s after the signal)", flush=True)
            # The step run again (request partition), or the heads split again (head partition).
            recovered = "hold the KV heads now" if partition.startswith("head") else "runs again"
            for line in log.splitlines():
                if ("giving up" in line or "runs again" in line or "discards it" in line or "is dropped" in line or
                        "hold the KV heads now" in line):
                    print("  compute-0:", line[-300:], flush=True)
                if recovered in line and after:
                    print(f"{name}: {recovered} {stamp_of(line) - signalled:.2f} s after the signal", flush=True)
            if rc != 0:
                bad(f"{name}: generate failed: {err[-1200:]}")
                print_logs(tmp)
                continue
            if lost not in log:
                bad(f"{name}: compute-0 did not log the loss of {victim} (did the signal land after the last "
                    f"step?): {log[-1200:]}")
                continue
            if partition == "request" and victim.startswith("memory") and (
                    "is lost;" not in log or "runs again without it" not in log or
                    "go back to the queue to be recomputed" not in log):
                bad(f"{name}: compute-0 did not log the rerun and the requeued requests: {log[-1200:]}")
            if partition.startswith("head"):
                survivors = ranks - 1
                if ("is dropped: under memory.partition head" not in log or
                        f"the KV heads are split again over {survivors} memory rank(s)" not in log or
                        f"{survivors} memory rank(s) hold the KV heads now" not in log):
                    bad(f"{name}: compute-0 did not log the dropped step and the heads split over {survivors}: "
                        f"{log[-1200:]}")
                memory_logs = ""
                for m in range(ranks):
                    if m != int(victim.split("-")[1]):
                        with open(os.path.join(tmp, "run", "latest", f"memory-{m}.log")) as f:
                            memory_logs += f.read()
                if "re-partitioned by compute rank 0" not in memory_logs:
                    bad(f"{name}: no surviving memory rank logged its re-partition")
                if compute_ranks > 1:
                    with open(os.path.join(tmp, "run", "latest", "compute-1.log")) as f:
                        if f"the KV heads over {survivors} memory rank(s)" not in f.read():
                            bad(f"{name}: the replica did not log the head split over {survivors} ranks")
            if victim.startswith("compute") and compute_ranks == 2 and (
                    "runs again, and compute rank 0 runs every micro-batch" not in log):
                bad(f"{name}: compute-0 did not log the rerun on compute rank 0: {log[-1200:]}")
            if victim.startswith("compute") and compute_ranks > 2:
                # The other replicas kept (none released), the ring closed over the lost one (its
                # neighbours connected to each other on the device path).
                gave_up = [line for line in log.splitlines() if "giving up compute rank" in line]
                if (not gave_up or f"{compute_ranks - 1} compute ranks run the micro-batches" not in gave_up[0] or
                        "released" in gave_up[0]):
                    bad(f"{name}: compute-0 did not keep the other replicas: {gave_up[:1]} {log[-1200:]}")
                if partition == "rotational" and "the ring goes from compute rank 1" not in log:
                    bad(f"{name}: compute-0 did not log the ring made anew: {log[-1200:]}")
            if "rejoined" in name:
                rejoin = [line for line in log.splitlines() if ") rejoined (" in line]
                with open(os.path.join(tmp, "run", "latest", "memory-1.log")) as f:
                    byes = re.findall(r"memory rank 1: bye after \d+ steps \((\d+) with rows here\)", f.read())
                print(f"{name}: {rejoin[0][-200:] if rejoin else 'no rejoin'}; the new process's bye: "
                      f"{byes[-1] if byes else '?'} steps with rows", flush=True)
                if rejoin and after:
                    print(f"{name}: rejoined {stamp_of(rejoin[0]) - signalled:.2f} s after the signal", flush=True)
                if not rejoin:
                    bad(f"{name}: compute-0 did not take the restarted rank back: {log[-1200:]}\n{err[-600:]}")
                elif compute_ranks > 1 and (
                        f"every one of the {compute_ranks - 1} compute replica(s) connected" not in rejoin[0]):
                    bad(f"{name}: compute-0 took the rank back without the replicas connected: {rejoin[0][-300:]}")
                elif not byes or int(byes[-1]) == 0:
                    bad(f"{name}: the restarted memory rank 1 ran no steps with rows")
                if "memory-1 restarted (pid" not in err:
                    bad(f"{name}: the launcher did not report the restart: {err[-600:]}")
                if partition.startswith("head") and f"{ranks} memory rank(s) hold the KV heads now" not in log:
                    bad(f"{name}: the heads were not split over {ranks} ranks again after the rejoin")
            compare(got, want, name)
    print(f"{len(failures)} failure(s)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
