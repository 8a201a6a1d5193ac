#!/usr/bin/env bash
# tandem launch --slurm, for real: a single-host Slurm cluster made by this test (Debian's
# slurmctld and two slurmd daemons, nodes node1 and node2 on this machine, munge with a key of the
# test's own, every file under a temporary directory, private ports) runs deploy/slurm/tandem-het.sbatch
# as a heterogeneous job: het group 0 (node1) the launcher and compute rank 0, het group 1 (node2)
# two memory ranks started with srun. Its API must give the colocated engine's tokens, and
# cancelling the job must leave no rank behind.
# Usage: slurm_test.sh path/to/tandem. Exit 77 (skipped, with the reason) without root or Slurm.
set -uo pipefail
TANDEM=$(realpath "$1")
SRC=$(cd "$(dirname "$0")/../.." && pwd)
skip() { echo "SKIPPED: $*"; exit 77; }
[ "$(id -u)" = 0 ] || skip "needs root (slurmd runs jobs as any user; CI runs as root)"
for b in slurmctld slurmd munged sbatch srun scontrol; do
  command -v "$b" >/dev/null || [ -x "/usr/sbin/$b" ] || skip "no $b (Debian slurmctld, slurmd, slurm-client, munge; scripts/install_deps.sh)"
done
export PATH=$PATH:/usr/sbin

T=$(mktemp -d /tmp/tandem-slurm-test.XXXXXX)
chmod 755 "$T"
FAILED=0
bad() { echo "FAIL: $*"; FAILED=1; }
export SLURM_CONF=$T/slurm.conf
cleanup() {
  scancel --full "${JOB:-0}" 2>/dev/null
  for f in "$T"/slurmd-node1.pid "$T"/slurmd-node2.pid "$T"/slurmctld.pid "$T"/munge.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 1
  pkill -9 -f -- "$T/tandem" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT

mkdir -p "$T/spool" "$T/state" "$T/log" "$T/munge"
dd if=/dev/urandom of="$T/munge.key" bs=1024 count=1 2>/dev/null
chmod 600 "$T/munge.key"
munged --key-file="$T/munge.key" --socket="$T/munge/socket" --pid-file="$T/munge.pid" \
  --log-file="$T/log/munge.log" --seed-file="$T/munge.seed" -f || { echo "FAIL: munged did not start"; exit 1; }
# Below the usual ephemeral range (32768 and up), where the other tests' listeners on port 0 and
# their outgoing connections take ports: a daemon's fixed port taken there left a node down.
PORT=$((10000 + RANDOM % 20000))
HOST=$(hostname -s)
cat >"$T/slurm.conf" <<CFG
ClusterName=tandemtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
AuthType=auth/munge
AuthInfo=socket=$T/munge/socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool/%n
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd-%n.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
NodeName=node1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=2 RealMemory=1000
NodeName=node2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=2 RealMemory=1000
PartitionName=test Nodes=node[1-2] Default=YES MaxTime=10 State=UP
CFG
slurmctld -f "$T/slurm.conf" || { echo "FAIL: slurmctld did not start"; exit 1; }
slurmd -f "$T/slurm.conf" -N node1 && slurmd -f "$T/slurm.conf" -N node2 || { echo "FAIL: slurmd did not start"; exit 1; }
# Up to 60 s: a CI rehearsal on a 2-core host once saw node2 still not responding after 20 s.
for i in $(seq 300); do [ "$(sinfo -h -o %T -t idle 2>/dev/null | wc -l)" -ge 1 ] && [ "$(sinfo -h -N -t idle 2>/dev/null | wc -l)" = 2 ] && break; sleep 0.2; done
[ "$(sinfo -h -N -t idle | wc -l)" = 2 ] || { sinfo -N; tail -n 5 "$T"/log/*.log; echo "FAIL: the nodes are not idle"; exit 1; }

ln -s "$TANDEM" "$T/tandem"
cat >"$T/deploy.yaml" <<YAML
model:
  path: tiny-gqa
compute:
  device: cpu
scheduler:
  max_batch_size: 4
  max_tokens_per_step: 24
kv:
  capacity_tokens: 4096
api:
  port: 0
launch:
  run_dir: $T/run
  slurm_devices: cpu
  startup_timeout_s: 60
  step_timeout_s: 20
YAML
JOB=$(cd "$T" && TANDEM="$T/tandem" sbatch --parsable --export=ALL -o "$T/job.out" -e "$T/job.err" \
  "$SRC/deploy/slurm/tandem-het.sbatch" "$T/deploy.yaml")
[ -n "$JOB" ] || { echo "FAIL: sbatch"; exit 1; }
for i in $(seq 300); do grep -q "serving the API" "$T/job.err" 2>/dev/null && break; sleep 0.2; done
grep -q "serving the API" "$T/job.err" || { bad "the job did not start serving: $(tail -5 "$T/job.err" 2>/dev/null) $(squeue)"; exit 1; }
grep -q "memory-1 listening on 127.0.0.1:[0-9]* (cpu on node2 with srun)" "$T/job.err" \
  || bad "memory-1 not on node2: $(grep memory-1 "$T/job.err")"
# The memory ranks are steps of the het job's second component, on node2.
[ "$(squeue -h -s -o "%j %N" | grep -c "^tandem-memory node2$")" = 2 ] || bad "expected 2 srun steps of memory ranks on node2: $(squeue -s)"
API=$(grep -o "API http://[^ ;]*" "$T/job.err" | head -1 | cut -c5-)

for ids in "1,2,3" "7,8,9,10,11,12"; do
  got=$(python3 -c "
import json, sys, urllib.request
req = urllib.request.Request(sys.argv[1] + '/completions', method='POST', headers={'Content-Type': 'application/json'},
    data=json.dumps({'model': 'tandem', 'prompt': [int(x) for x in sys.argv[2].split(',')], 'max_tokens': 10, 'temperature': 0}).encode())
print(json.load(urllib.request.urlopen(req, timeout=60))['choices'][0]['token_ids'])" "$API" "$ids")
  want=$("$TANDEM" generate --model tiny-gqa --prompt-ids "$ids" --max-tokens 10 --json 2>/dev/null \
    | python3 -c "import json, sys; print(json.load(sys.stdin)['token_ids'])")
  [ -n "$got" ] && [ "$got" = "$want" ] || bad "prompt $ids: Slurm deployment gave $got, the colocated engine $want"
done

# Cancelling the job stops every rank.
scancel "$JOB"
for i in $(seq 150); do pgrep -f -- "$T/tandem" >/dev/null || break; sleep 0.2; done
pgrep -f -- "$T/tandem" >/dev/null && bad "ranks left after scancel: $(pgrep -af -- "$T/tandem")"
[ $FAILED = 0 ] && echo "slurm test passed"
exit $FAILED
