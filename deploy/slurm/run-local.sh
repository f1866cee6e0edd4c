#!/usr/bin/env bash
# The SLURM path end to end on this one machine: a one-node Slurm cluster on localhost
# (munged, slurmctld and slurmd of its own, all state in a fresh temporary folder), the
# real pdserve.sbatch submitted to it with 1 prefill + 1 decode CPU worker on the demo
# model, requests through the router (a prompt prefilled remotely among them), then
# scancel, a check that every process the job started is gone, and the daemons stopped.
# Exits non-zero on any failure; every wait is bounded. Run as root (the daemons run as
# root here, SlurmUser=root). Nothing is left outside the temporary folder, which is
# removed when the run passes.
#
#   deploy/slurm/run-local.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}  # NOTE: 2 shared cores; the first run builds kernels
STATE=$(mktemp -d /tmp/pdserve-slurm.XXXXXX)
NODE=$(hostname -s)
export SLURM_CONF=$STATE/slurm.conf

log() { echo "run-local: $*"; }
fail() { log "FAILED: $*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# wait_until WHAT TIMEOUT_S CMD...: run CMD every second until it succeeds, at most TIMEOUT_S.
wait_until() {
  local what=$1 timeout_s=$2
  shift 2
  local deadline=$((SECONDS + timeout_s))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$what not within ${timeout_s} s"
    sleep 1
  done
}

# Daemons this script started, stopped in reverse order on the way out.
DAEMON_NAMES=()
DAEMON_PIDS=()
start_daemon() {  # start_daemon NAME CMD...: CMD in the foreground mode, in the background
  local name=$1
  shift
  "$@" > "$STATE/$name.out" 2>&1 &
  DAEMON_NAMES+=("$name")
  DAEMON_PIDS+=("$!")
}
stop_daemons() {
  local i pid
  for ((i = ${#DAEMON_PIDS[@]} - 1; i >= 0; i--)); do
    pid=${DAEMON_PIDS[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "${DAEMON_NAMES[i]} did not stop within 30 s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
    else
      log "${DAEMON_NAMES[i]} stopped"
    fi
  done
}

JOB_ID=
finish() {
  local status=$?
  trap - EXIT
  if [[ -n $JOB_ID ]] && squeue -h -j "$JOB_ID" 2>/dev/null | grep -q .; then
    scancel "$JOB_ID" || true
    wait_until "job $JOB_ID to end after scancel" 120 job_gone || true
  fi
  stop_daemons
  if ((status == 0)); then
    rm -rf "$STATE"
    log "PASSED"
  else
    log "state, logs and the job's output kept in $STATE"
  fi
  exit "$status"
}
trap finish EXIT

job_gone() { ! squeue -h -j "$JOB_ID" 2>/dev/null | grep -q .; }
node_idle() { [[ $(sinfo -h -N -n "$NODE" -o %t) == idle ]]; }

[[ $(id -u) == 0 ]] || fail "run as root: munged, slurmctld and slurmd run as root here"
for tool in munged mungekey slurmctld slurmd sbatch sbcast squeue scancel sinfo pdserve python3; do
  command -v "$tool" >/dev/null || fail "$tool is not on PATH (apt-get install slurm-wlm munge)"
done

# 1. munge: a key and a socket of this cluster's own, so nothing in /etc is touched.
mkdir -m 700 "$STATE/munge"
mungekey --create --keyfile="$STATE/munge/munge.key"
start_daemon munged munged --foreground --force --key-file="$STATE/munge/munge.key" \
  --socket="$STATE/munge/munge.socket" --pid-file="$STATE/munge/munged.pid" \
  --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed"
wait_until "munged to answer" 30 test -S "$STATE/munge/munge.socket"

# 2. slurm.conf for one node: the CPUs and memory slurmd finds (less 1 GiB of headroom),
# no accounting, no cgroups (task/none, proctrack/linuxproc: slurmstepd tracks a step's
# processes by descent, which is how scancel reaches Ray's and Redis' processes).
read -r CPUS SOCKETS CORES THREADS MEMORY_MB < <(slurmd -C | head -1 | python3 -c '
import sys
fields = dict(kv.split("=", 1) for kv in sys.stdin.read().split())
print(fields["CPUs"], fields["SocketsPerBoard"], fields["CoresPerSocket"],
      fields["ThreadsPerCore"], fields["RealMemory"])')
mkdir -p "$STATE/slurmctld" "$STATE/slurmd"
cat > "$SLURM_CONF" <<EOF
ClusterName=pdserve-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE/munge/munge.socket
StateSaveLocation=$STATE/slurmctld
SlurmdSpoolDir=$STATE/slurmd
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS SocketsPerBoard=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS RealMemory=$((MEMORY_MB - 1024)) State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

log "state in $STATE; $(sinfo --version), node $NODE: $CPUS CPUs, $((MEMORY_MB - 1024)) MB"

# 3. The controller and the node daemon, in the foreground (so their pids are ours).
start_daemon slurmctld slurmctld -D
start_daemon slurmd slurmd -D
wait_until "node $NODE idle in sinfo" 60 node_idle
log "slurm up: $(sinfo -h -N -o '%N %P %t CPUs=%c memory=%mMB')"

# 4. The demo model (random weights, a real tokenizer).
pdserve make-demo-model "$STATE/model" > /dev/null
log "demo model in $STATE/model"

# The operator's environment hook (module load, a venv's activate) is sourced before every
# step on every node; this one records where, so the run shows it was.
cat > "$STATE/env-setup.sh" <<EOF
echo "\${SLURM_JOB_ID}.\${SLURM_STEP_ID:-batch} \$(hostname -s)" >> "$STATE/env-setup.log"
EOF
export PDSERVE_ENV_SETUP=$STATE/env-setup.sh

# 5. submit_job: the real sbatch script, one node, 1 prefill + 1 decode worker; every
# prompt of 16 tokens or more goes to the prefill worker (--disaggregation always), so the
# KV moves. Sets JOB_ID, JOB_OUT, URL and PORTS once the job prints its ready line.
# NOTE: free ports, and a free port for each Ray dashboard agent (default 52365): other
# Ray clusters may run on this shared machine.
submit_job() {
  PDSERVE_PORT=$(free_port) PDSERVE_GRPC_PORT=$(free_port) PDSERVE_RAY_PORT=$(free_port)
  PDSERVE_REDIS_PORT=$(free_port)
  PDSERVE_RAY_START_ARGS="--dashboard-agent-listen-port=$(free_port)"
  export PDSERVE_PORT PDSERVE_GRPC_PORT PDSERVE_RAY_PORT PDSERVE_REDIS_PORT PDSERVE_RAY_START_ARGS
  export PDSERVE_PREFILL_WORKERS=1 PDSERVE_DECODE_WORKERS=1
  PORTS=("$PDSERVE_PORT" "$PDSERVE_GRPC_PORT" "$PDSERVE_RAY_PORT" "$PDSERVE_REDIS_PORT")
  JOB_ID=$(sbatch --parsable --nodes=1 --output="$STATE/job-%j.out" --chdir="$STATE" \
    "$HERE/pdserve.sbatch" "$STATE/model" --served-model-name demo --dtype float32 \
    --max-model-len 512 --disaggregation always)
  JOB_OUT=$STATE/job-$JOB_ID.out
  log "submitted job $JOB_ID; waiting (at most ${READY_TIMEOUT_S} s) for its ready line"
  local start=$SECONDS deadline=$((SECONDS + READY_TIMEOUT_S))
  until URL=$(grep -oP '^pdserve ready at \K\S+' "$JOB_OUT" 2>/dev/null); do
    if job_gone || ((SECONDS >= deadline)); then
      tail -n 60 "$JOB_OUT" >&2 || true
      fail "job $JOB_ID printed no ready line (it ended, or not within ${READY_TIMEOUT_S} s)"
    fi
    sleep 1
  done
  log "job $JOB_ID: \"pdserve ready at $URL\" after $((SECONDS - start)) s"
}

# Requests: completions, chat, streamed chat; then the metrics that show the prompts were
# prefilled on the prefill worker and their KV pulled by the decode worker.
send_requests() {
  python3 - "$URL" <<'EOF'
import json
import re
import sys
import urllib.request

url = sys.argv[1]
prompt = " ".join(["the KV cache moves from the prefill worker to the decode worker"] * 4)
common = {"model": "demo", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def post(path, body):
    request = urllib.request.Request(url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=120)


with post("/v1/completions", {**common, "prompt": prompt}) as reply:
    usage = json.load(reply)["usage"]
assert usage["completion_tokens"] == 8, usage
print(f"run-local: /v1/completions 200, usage {usage}")

messages = [{"role": "user", "content": prompt}]
with post("/v1/chat/completions", {**common, "messages": messages}) as reply:
    usage = json.load(reply)["usage"]
assert usage["completion_tokens"] == 8, usage
print(f"run-local: /v1/chat/completions 200, usage {usage}")

chunks, usage, done = 0, None, False
body = {**common, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
with post("/v1/chat/completions", body) as reply:
    for line in reply:
        data = line.decode().strip().removeprefix("data: ")
        if data == "[DONE]":
            done = True
        elif data:
            event = json.loads(data)
            chunks += bool(event["choices"])
            usage = event.get("usage") or usage
assert done and usage["completion_tokens"] == 8, (done, usage)
print(f"run-local: streamed /v1/chat/completions 200, {chunks} chunks, [DONE], usage {usage}")

with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
    metrics = reply.read().decode()
remote = re.findall(r'^pdserve:prefill_path_total\{[^}]*path="remote"[^}]*\} (\S+)', metrics, re.M)
assert remote and float(remote[0]) >= 3, f"prefill_path remote: {remote}"
print(f"run-local: /metrics pdserve:prefill_path_total{{path=\"remote\"}} = {remote[0]}")
EOF
}

listeners() { ss -Hltn | awk '{print $4}' | grep -E ":($(IFS='|'; echo "${PORTS[*]}"))\$" || true; }
none_alive() {
  local pid
  for pid in "${PIDS[@]}"; do ! kill -0 "$pid" 2>/dev/null || return 1; done
}

# What the job runs: the processes Slurm tracks for it and the ports they listen on; the
# Redis password in a 0600 file and on no command line. Sets PIDS and JOB_DIR.
inspect_job() {
  mapfile -t PIDS < <(scontrol listpids "$JOB_ID" | awk 'NR > 1 {print $1}')
  local names
  names=$(for pid in "${PIDS[@]}"; do cat "/proc/$pid/comm" 2>/dev/null; done | sort | uniq -c | xargs)
  log "job $JOB_ID runs ${#PIDS[@]} processes: $names"
  for name in redis-server raylet gcs_server pdserve; do
    [[ $names == *" $name"* ]] || fail "no $name among the job's processes"
  done
  (($(listeners | wc -l) >= ${#PORTS[@]})) || fail "not all of ${PORTS[*]} listen: $(listeners | xargs)"
  JOB_DIR=/tmp/pdserve-$JOB_ID  # the node-local folder (PDSERVE_LOCAL_DIR's default)
  [[ $(stat -c %a "$JOB_DIR/redis-password") == 600 ]] || fail "the Redis password file is not 0600"
  if grep -lsF -- "$(cat "$JOB_DIR/redis-password")" /proc/[0-9]*/cmdline; then
    fail "the Redis password is on a command line"
  fi
  log "ports ${PORTS[*]} listen; the Redis password is in a 0600 file, on no command line"
  local hooked
  hooked=$(grep "^$JOB_ID\." "$STATE/env-setup.log" | cut -d' ' -f1 | sort -u | xargs)
  [[ $(wc -w <<< "$hooked") -ge 4 ]] || fail "PDSERVE_ENV_SETUP sourced only in: $hooked"
  log "PDSERVE_ENV_SETUP was sourced in the batch script and every step: $hooked"
}

# stop_job HOW SCANCEL_FLAGS...: scancel, then nothing of the job may be left.
stop_job() {
  local how=$1
  shift
  scancel "$@" "$JOB_ID"
  wait_until "job $JOB_ID to end after $how" 180 job_gone
  local ended=$SECONDS
  # NOTE: proctrack/linuxproc tracks a step's processes by descent: one orphaned by its
  # parent's death may exit a moment after the job has
  wait_until "the processes of job $JOB_ID to exit" 60 none_alive
  [[ -z $(listeners) ]] || fail "still listening after $how: $(listeners | xargs)"
  # NOTE: Ray's temp folder is inside it
  [[ ! -e $JOB_DIR ]] || fail "the job's node-local folder $JOB_DIR is left"
  log "job $JOB_ID ended after $how: none of its ${#PIDS[@]} processes is left (the last" \
      "$((SECONDS - ended)) s after the job), no port listens, its secrets folder is gone"
  log "the end of job $JOB_ID's output:"
  grep -E '^(pdserve|srun|slurmstepd)' "$JOB_OUT" | tail -n 14 | sed 's/^/    /'
  JOB_ID=
}

# 6. A job serves requests, then stops as the time limit's signal would stop it (the
# script's own trap: pdserve, then Ray, then Redis).
submit_job
send_requests
inspect_job
stop_job "scancel --batch --signal=TERM" --batch --signal=TERM
grep -q '^pdserve stopped' "$JOB_OUT" || fail "pdserve serve did not stop cleanly (no \"pdserve stopped\")"

# 7. A job cancelled outright, as an operator's plain scancel does (Slurm signals every
# step at once).
submit_job
inspect_job
stop_job scancel
