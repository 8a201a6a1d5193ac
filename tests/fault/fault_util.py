"""What the fault tests (tests/fault/*_test.py) share: failure bookkeeping, the processes of a run
found by their command lines, signals, and bounded waits."""
import os
import subprocess
import time

failures = []  # every bad() message; a test exits 1 when it is not empty


def bad(msg):
    print("FAIL:", msg, flush=True)
    failures.append(msg)


def pids(pattern):
    """The processes whose command line matches `pattern` (pgrep -f), this one excepted."""
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def signal_all(pid_list, sig):
    for pid in pid_list:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_for(cond, bound, poll=0.05):
    """Seconds until cond() held, or None if it did not within `bound` seconds."""
    start = time.time()
    while time.time() - start < bound:
        if cond():
            return time.time() - start
        time.sleep(poll)
    return None
