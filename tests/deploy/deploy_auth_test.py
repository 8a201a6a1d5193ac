#!/usr/bin/env python3
"""A running deployment against strangers, and where its processes listen.

Starts `tandem launch` (compute rank 0 serving the API, two memory ranks, all on 127.0.0.1), then
attacks memory rank 0's bootstrap port the way common/bootstrap/handshake.h says it must refuse:
a 16-byte garbage probe, a client without the secret (the public deployment id copied from the
server's hello, a made-up proof), a wrong HMAC (a proof computed with another secret under this
deployment's id), and a peer of another deployment (its own id and secret). Each must be logged by
the rank ("rejected the connection from ...: <reason>") and closed, and the deployment must go on
producing the colocated engine's tokens through its API. (A replayed handshake needs a genuine
one to record; ucx_transport_test replays one through a recording proxy.) Then every listening TCP
socket of the deployment's processes (read from /proc/net/tcp{,6} and /proc/PID/fd) must be bound
to the configured address 127.0.0.1: none on another interface, none on a wildcard.

The client side of the handshake is written here again from the header's description, in Python,
so the C++ implementation is also checked against its own specification.
Usage: deploy_auth_test.py path/to/tandem
"""
import hashlib
import hmac
import json
import os
import re
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

MAGIC = 0x42444E54  # "TNDB"
failures = []


def bad(msg):
    print("FAIL:", msg)
    failures.append(msg)


def deployment_id(secret):
    return hmac.new(secret, b"tandem deployment id", hashlib.sha256).digest()[:8]


def client_proof(secret, dep_id, nonce_s, payload):
    nonce_c = secrets.token_bytes(32)
    mac = hmac.new(secret, b"tandem/1 client" + dep_id + nonce_s + nonce_c + payload, hashlib.sha256).digest()
    return struct.pack("<IHH", MAGIC, 1, 2) + dep_id + nonce_c + struct.pack("<I", len(payload)) + mac + payload


def connect(addr):
    host, port = addr.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=20)
    s.settimeout(20)
    return s


def read_exactly(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def closed_by_rank(s):
    """The rank closes the connection (EOF or reset) within the socket's timeout."""
    try:
        while True:
            if not s.recv(256):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def attack(addr, name, make):
    s = connect(addr)
    hello = read_exactly(s, 48)
    if len(hello) != 48 or struct.unpack("<IHH", hello[:8]) != (MAGIC, 1, 1):
        bad(f"{name}: the rank's hello is not the documented 48-byte message: {hello.hex()}")
    data = make(hello)
    s.sendall(data)
    if not closed_by_rank(s):
        bad(f"{name}: the rank did not close the connection")
    s.close()


def main():
    tandem = os.path.realpath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="tandem-auth-test.")
    yaml = os.path.join(tmp, "deploy.yaml")
    with open(yaml, "w") as f:
        f.write(f"model:\n  path: tiny-gqa\ncompute:\n  device: cpu\nmemory:\n  ranks: 2\n  devices: cpu\n"
                f"  host: 127.0.0.1\nkv:\n  capacity_tokens: 4096\napi:\n  port: 0\n"
                f"launch:\n  run_dir: {tmp}/run\n  step_timeout_s: 20\n")
    err = open(os.path.join(tmp, "launch.err"), "w+")
    launcher = subprocess.Popen([tandem, "launch", yaml], stdout=subprocess.DEVNULL, stderr=err)
    try:
        text = ""
        deadline = time.time() + 120
        while "serving the API" not in text and time.time() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            err.seek(0)
            text = err.read()
        if "serving the API" not in text:
            print(text)
            bad("the deployment did not start")
            return
        memory0 = re.search(r"memory-0 listening on (\S+)", text).group(1)
        api = re.search(r"API (http://\S+/v1)", text).group(1)

        # The deployment's secret is in the run's directory (mode 0600, this user's).
        run = os.path.realpath(os.path.join(tmp, "run", "latest"))
        if oct(os.stat(os.path.join(run, "secret")).st_mode & 0o777) != "0o600":
            bad("the deployment secret is not mode 0600")
        with open(os.path.join(run, "secret")) as f:
            secret = bytes.fromhex(f.read().strip())
        dep_id = deployment_id(secret)

        attack(memory0, "garbage probe", lambda hello: b"\x5a" * 16)
        attack(memory0, "no secret",
               lambda hello: struct.pack("<IHH", MAGIC, 1, 2) + hello[8:16] + b"\x11" * 32 + struct.pack("<I", 4)
               + b"\x22" * 32 + b"ucx!")
        attack(memory0, "wrong HMAC", lambda hello: client_proof(secrets.token_bytes(32), dep_id, hello[16:48], b"x"))
        other = secrets.token_bytes(32)
        attack(memory0, "other deployment", lambda hello: client_proof(other, deployment_id(other), hello[16:48], b"x"))

        # Logged by the rank, one line per connection, naming the reason.
        time.sleep(0.5)
        with open(os.path.join(run, "memory-0.log")) as f:
            log = f.read()
        for reason in ["not a tandem handshake", "wrong HMAC", "wrong HMAC", "a peer of another deployment"]:
            if reason not in log:
                bad(f"memory-0's log does not say \"{reason}\"")
        if log.count("rejected the connection from 127.0.0.1:") != 4:
            bad(f"memory-0 logged {log.count('rejected the connection from')} rejections, expected 4:\n{log}")

        # The deployment still runs and gives the colocated engine's tokens.
        prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12]]
        for ids in prompts:
            req = urllib.request.Request(api + "/completions", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "tandem", "prompt": ids, "max_tokens": 10,
                                                          "temperature": 0}).encode())
            got = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["token_ids"]
            ref = subprocess.run([tandem, "generate", "--model", "tiny-gqa", "--prompt-ids",
                                  ",".join(map(str, ids)), "--max-tokens", "10", "--json"],
                                 capture_output=True, text=True, check=True)
            want = json.loads(ref.stdout)["token_ids"]
            if got != want:
                bad(f"tokens after the attacks {got} differ from the colocated engine's {want}")

        # Listening sockets of the deployment's processes: only on 127.0.0.1.
        children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        if len(children) != 3:
            bad(f"expected 3 rank processes, found {children}")
        inodes = {}
        for pid in children:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        listeners = []
        for table, v6 in [("/proc/net/tcp", False), ("/proc/net/tcp6", True)]:
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] != "0A" or cols[9] not in inodes:
                        continue
                    addr_hex, port_hex = cols[1].split(":")
                    if v6:
                        addr = socket.inet_ntop(socket.AF_INET6, b"".join(
                            struct.pack("<I", int(addr_hex[i:i + 8], 16)) for i in range(0, 32, 8)))
                    else:
                        addr = socket.inet_ntoa(struct.pack("<I", int(addr_hex, 16)))
                    listeners.append((inodes[cols[9]], addr, int(port_hex, 16)))
        if len(listeners) < 3:
            bad(f"found only {listeners} listening: the check saw too little")
        for pid, addr, port in listeners:
            if addr != "127.0.0.1":
                bad(f"pid {pid} listens on {addr}:{port}, not on the configured 127.0.0.1")
        print(f"{len(listeners)} listening sockets of the deployment: {sorted(listeners)}")
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            bad("the launcher did not stop within 60 s of SIGTERM")
        latest = os.path.join(tmp, "run", "latest")
        if os.path.isdir(latest) and os.path.exists(os.path.join(latest, "secret")):
            bad("the deployment secret is still there after the run ended")
        subprocess.run(["rm", "-rf", tmp])
    if not failures:
        print("deploy auth test passed")


if __name__ == "__main__":
    main()
    sys.exit(1 if failures else 0)
