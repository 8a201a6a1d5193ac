"""What the fault tests (tests/fault/*_test.py) share: failure bookkeeping, the processes of a run
found by their command lines, signals, and bounded waits."""
import json
import os
import subprocess
import time
import urllib.error
import urllib.request

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


def print_logs(tmp):
    """The ends of the rank logs of the run in TMP/run/latest (what a failed case is read from;
    TANDEM_FAULT_LOG_LINES lines of each, 15 unless set)."""
    latest = os.path.join(tmp, "run", "latest")
    lines = int(os.environ.get("TANDEM_FAULT_LOG_LINES", "15"))
    for name in sorted(os.listdir(latest)) if os.path.isdir(latest) else []:
        if name.endswith(".log"):
            with open(os.path.join(latest, name), errors="replace") as f:
                print(f"--- {name} (end)\n" + "".join(f.readlines()[-lines:]), flush=True)


def completion_tokens(url, model, prompt, max_tokens, extra):
    """The token ids of a greedy /completions answer (EOS ignored; `extra` adds request fields), or
    a string saying why there are none (an HTTP error with its body, or the connection's error)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, **extra}).encode()
    req = urllib.request.Request(url + "/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["token_ids"]
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read()[:300]!r}"
    except OSError as e:
        return f"{e}"
