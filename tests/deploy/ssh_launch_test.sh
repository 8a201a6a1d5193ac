#!/usr/bin/env bash
# tandem launch over ssh, for real: an OpenSSH server started by this test (its own host key,
# client key, known_hosts and config, on a private port) listens on 127.0.0.2 and 127.0.0.3, two
# "hosts" on this machine (all of 127.0.0.0/8 is loopback: distinct addresses to ssh to and bind,
# no setup, and nothing leaves the machine). 1 compute rank (this host) + 2 memory ranks (one per
# "host", started over ssh) must give the colocated engine's tokens; then no process may survive
# SIGKILL of the launcher, of a remote rank, or of an ssh connection.
# Usage: ssh_launch_test.sh path/to/tandem. Exit 77 (skipped, with the reason) without root or sshd.
set -uo pipefail
TANDEM=$(realpath "$1")
skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (an sshd that logs this user in; CI runs as root)"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
[ -x "$SSHD" ] || skip "no sshd (Debian openssh-server; scripts/install_deps.sh installs it)"
command -v ssh >/dev/null || skip "no ssh client (openssh-client)"

T=$(mktemp -d /tmp/tandem-ssh-test.XXXXXX)
FAILED=0
bad() { echo "FAIL: $*"; FAILED=1; }
LAUNCHER=""
cleanup() {
  [ -n "$LAUNCHER" ] && kill -9 "$LAUNCHER" 2>/dev/null
  [ -f "$T/sshd.pid" ] && kill "$(cat "$T/sshd.pid")" 2>/dev/null
  pkill -9 -f -- "$T/tandem-remote memory" 2>/dev/null  # only this test's ranks (their path names $T)
  rm -rf "$T"
}
trap cleanup EXIT

# ---- an sshd of our own ----
ssh-keygen -q -t ed25519 -N '' -f "$T/host_key" || bad "ssh-keygen host key"
ssh-keygen -q -t ed25519 -N '' -f "$T/client_key" || bad "ssh-keygen client key"
cp "$T/client_key.pub" "$T/authorized_keys"
chmod 700 "$T"
PORT=$((20000 + RANDOM % 20000))
mkdir -p /run/sshd  # sshd's privilege separation directory
cat >"$T/sshd_config" <<CFG
Port $PORT
ListenAddress 127.0.0.2
ListenAddress 127.0.0.3
HostKey $T/host_key
PidFile $T/sshd.pid
AuthorizedKeysFile $T/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
CFG
"$SSHD" -f "$T/sshd_config" -E "$T/sshd.log" || { cat "$T/sshd.log"; exit 1; }
for h in 127.0.0.2 127.0.0.3; do echo "[$h]:$PORT $(cat "$T/host_key.pub")"; done >"$T/known_hosts"
SSH="ssh -p $PORT -i $T/client_key -o BatchMode=yes -o IdentitiesOnly=yes -o UserKnownHostsFile=$T/known_hosts -o StrictHostKeyChecking=yes -o ConnectTimeout=10"
for i in $(seq 50); do $SSH 127.0.0.2 true 2>/dev/null && break; sleep 0.2; done
$SSH 127.0.0.3 true || { cat "$T/sshd.log"; echo "FAIL: cannot ssh to the test sshd"; exit 1; }

# The binary's path "on each host" is a setting: a link of our own, so the remote ranks'
# command lines name $T (and the cleanup above can find exactly them).
ln -s "$TANDEM" "$T/tandem-remote"
cat >"$T/ssh.yaml" <<YAML
model:
  path: tiny-gqa
compute:
  hosts:
    - {host: local, address: 127.0.0.1, devices: [cpu], device_type: test-cpu}
memory:
  hosts:
    - {host: 127.0.0.2, devices: [cpu], device_type: test-cpu-a, tandem: $T/tandem-remote}
    - {host: 127.0.0.3, address: 127.0.0.3, devices: [cpu], device_type: test-cpu-b, tandem: $T/tandem-remote}
scheduler:
  max_batch_size: 4
  max_tokens_per_step: 24
kv:
  capacity_tokens: 4096
launch:
  run_dir: $T/run
  ssh: "$SSH"
  startup_timeout_s: 60
  step_timeout_s: 20
  recover_memory_ranks: false  # a lost remote rank must bring the deployment down (recovery: tests/fault)
api:
  port: 0
YAML

"$TANDEM" config check --deploy "$T/ssh.yaml" >"$T/check" 2>&1 || bad "config check --deploy: $(tail -3 "$T/check")"
grep -q "memory-1: cpu on 127.0.0.3, device type test-cpu-b, interface 127.0.0.3" "$T/check" \
  || bad "config check does not print memory-1's placement: $(grep memory-1 "$T/check")"
grep -q "compute-0 <-> memory-0: ucx (this host <-> 127.0.0.2)" "$T/check" || bad "config check does not print the transport"

# ---- tokens: over ssh == colocated ----
printf '%s\n' '{"prompt_ids": [1, 150, 386], "max_tokens": 12}' '{"prompt_ids": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 9}' \
  '{"prompt_ids": [42], "max_tokens": 16, "temperature": 0.8, "seed": 7}' >"$T/prompts.jsonl"
"$TANDEM" generate --model tiny-gqa --prompts-file "$T/prompts.jsonl" --json >"$T/colocated.json" 2>"$T/colocated.err" \
  || bad "colocated generate failed: $(tail -3 "$T/colocated.err")"
timeout 120 "$TANDEM" generate --deploy "$T/ssh.yaml" --prompts-file "$T/prompts.jsonl" --json >"$T/ssh.json" 2>"$T/ssh.err" \
  || bad "generate --deploy over ssh failed: $(tail -5 "$T/ssh.err")"
cmp -s "$T/colocated.json" "$T/ssh.json" || bad "tokens over ssh differ from the colocated engine's: $(diff "$T/colocated.json" "$T/ssh.json" | head -5)"
[ "$(wc -l <"$T/ssh.json")" = 3 ] || bad "expected 3 results"
grep -q "memory-1 listening on 127.0.0.3:[0-9]* (cpu on 127.0.0.3 over ssh)" "$T/ssh.err" || bad "memory-1 not started on 127.0.0.3: $(grep memory-1 "$T/ssh.err")"
grep -q "memory-0 listening on 127.0.0.2:" "$T/ssh.err" || bad "memory-0 not on 127.0.0.2"
grep -q "memory rank 1 ready" "$T/run/latest/memory-1.log" 2>/dev/null || grep -q "memory" "$T/run/latest/memory-1.log" || bad "no log streamed for memory-1"
sleep 1
pgrep -f -- "$T/tandem-remote memory" >/dev/null && bad "remote ranks left after generate: $(pgrep -af -- "$T/tandem-remote memory")"

# ---- no orphans ----
remote_pids() { pgrep -f -- "$T/tandem-remote memory" | tr '\n' ' '; }
# Waits up to 20 s for no remote rank to be left; else reports $1.
expect_none_left() {
  for i in $(seq 100); do [ -z "$(remote_pids)" ] && return 0; sleep 0.2; done
  bad "$1: remote ranks still running: $(pgrep -af -- "$T/tandem-remote memory")"
  pkill -9 -f -- "$T/tandem-remote memory"
}
# Starts `tandem launch` (serving) and waits until it serves; sets LAUNCHER.
start_launch() {
  "$TANDEM" launch "$T/ssh.yaml" >"$T/launch.out" 2>"$T/launch.err" &
  LAUNCHER=$!
  for i in $(seq 300); do
    grep -q "serving the API" "$T/launch.err" && return 0
    kill -0 "$LAUNCHER" 2>/dev/null || break
    sleep 0.2
  done
  bad "launch did not start serving: $(tail -5 "$T/launch.err")"
}
# Waits up to 30 s for the launcher to exit; its status in LAUNCH_RC.
wait_launcher() {
  for i in $(seq 150); do kill -0 "$LAUNCHER" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$LAUNCHER" 2>/dev/null; then
    # What it was doing, for the record: its state and children, and what it last said.
    bad "$1: the launcher is still running (state $(awk '/^State/ {print $2}' "/proc/$LAUNCHER/status" 2>/dev/null)," \
      "children: $(ps --ppid "$LAUNCHER" -o pid=,stat=,args= 2>/dev/null | cut -c1-120 | tr '\n' ';'))" \
      "its last lines: $(tail -5 "$T/launch.err")"
    kill -9 "$LAUNCHER"
  fi
  wait "$LAUNCHER"; LAUNCH_RC=$?; LAUNCHER=""
}

# 1. SIGKILL of the launcher.
start_launch
[ "$(remote_pids | wc -w)" = 2 ] || bad "expected 2 remote ranks while serving, found: $(remote_pids)"
kill -9 "$LAUNCHER"; wait "$LAUNCHER" 2>/dev/null; LAUNCHER=""
expect_none_left "after SIGKILL of the launcher"
pgrep -f -- "$TANDEM compute.*$T" >/dev/null && bad "compute-0 survived the launcher's SIGKILL"

# 2. SIGKILL of a remote rank: the launcher names it and brings everything down (no recovery).
start_launch
victim=$(pgrep -f -- "$T/tandem-remote memory --rank 1" | head -1)
if [ -n "$victim" ]; then kill -9 "$victim"; else bad "memory-1's process not found: $(remote_pids)"; fi
wait_launcher "after SIGKILL of memory-1"
[ "$LAUNCH_RC" != 0 ] || bad "the launcher exited 0 after memory-1 was killed"
grep -q "memory-1 (pid [0-9]*) " "$T/launch.err" || bad "the launcher's message does not name memory-1: $(tail -3 "$T/launch.err")"
expect_none_left "after SIGKILL of memory-1"

# 3. The ssh connection of memory-0 killed (its client process).
start_launch
client=""
for i in $(seq 25); do
  client=$(pgrep -P "$LAUNCHER" -f -- " -T 127.0.0.2 exec " | head -1)
  [ -n "$client" ] && break
  sleep 0.2
done
if [ -n "$client" ]; then
  kill -9 "$client"
else
  bad "no ssh client to 127.0.0.2 among the launcher's children: $(ps --ppid "$LAUNCHER" -o pid=,args= | cut -c1-120 | tr '\n' ';')"
fi
wait_launcher "after killing memory-0's ssh connection"
grep -q "memory-0 (pid $client) was killed by signal 9" "$T/launch.err" || bad "the launcher's message does not name memory-0: $(tail -3 "$T/launch.err")"
expect_none_left "after killing memory-0's ssh connection"

[ $FAILED = 0 ] && echo "ssh launch test passed"
exit $FAILED
