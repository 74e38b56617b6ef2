#!/usr/bin/env bash
# Start a single-node SLURM cluster (munged + slurmctld + slurmd) with 4 fake GPUs.
# Usage: start.sh STATE_DIR
# Writes /etc/slurm/slurm.conf and /etc/slurm/gres.conf (tagged with a marker);
# everything else (state, spool, logs, pids, munge key/socket, fake devices) lives in STATE_DIR.
set -euo pipefail

MARKER="# written-by: mixquant tools/slurm-local/start.sh"
CONF=/etc/slurm/slurm.conf
GRES=/etc/slurm/gres.conf

die() { echo "slurm-local/start.sh: $*" >&2; exit 1; }

[ $# -eq 1 ] || die "usage: start.sh STATE_DIR"
[ "$(id -u)" -eq 0 ] || die "must run as root (daemons run as root, config goes to /etc/slurm)"
for b in sbatch sinfo slurmctld slurmd munged; do
  command -v "$b" >/dev/null 2>&1 || die "$b not found; run tools/slurm-local/install.sh first"
done

for f in "$CONF" "$GRES"; do
  if [ -e "$f" ] && ! grep -qxF "$MARKER" "$f"; then
    die "$f exists and was not written by this script; refusing to overwrite"
  fi
done

mkdir -p "$1"
STATE=$(cd "$1" && pwd -P)
chmod 700 "$STATE"

# proc_is PID COMM: PID is a live (non-zombie) process named COMM. Zombies matter here:
# when PID 1 does not reap, a stopped daemon lingers as <defunct> with the same name.
proc_is() {
  local st
  [ "$(cat /proc/"$1"/comm 2>/dev/null)" = "$2" ] || return 1
  st=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' /proc/"$1"/stat 2>/dev/null) || return 1
  [ "$st" != Z ] && [ "$st" != X ]
}

pid_alive() {  # pid_alive PIDFILE COMM
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1" 2>/dev/null) || return 1
  [[ "$p" =~ ^[0-9]+$ ]] || return 1
  proc_is "$p" "$2"
}

if pid_alive "$STATE/slurmctld.pid" slurmctld || pid_alive "$STATE/slurmd.pid" slurmd || pid_alive "$STATE/munged.pid" munged; then
  die "daemons from $STATE are already running; run stop.sh $STATE first"
fi

NODE=$(hostname -s)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS, which the numerics profile pins
MEM_KB=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
REALMEM=$(( MEM_KB * 9 / 10 / 1024 ))

mkdir -p "$STATE/ctld" "$STATE/spool" "$STATE/log" "$STATE/munge" "$STATE/dev"
rm -f "$STATE"/log/*.log
for i in 0 1 2 3; do ln -sfn /dev/null "$STATE/dev/nvidia$i"; done

# munge: own daemon, own socket, own key (copy of the system key, or a fresh one).
chmod 700 "$STATE/munge"
if [ ! -s "$STATE/munge/munge.key" ]; then
  if [ -r /etc/munge/munge.key ]; then
    cp /etc/munge/munge.key "$STATE/munge/munge.key"
  elif command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile="$STATE/munge/munge.key" >/dev/null
  else
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1 count=1024 status=none
  fi
fi
chown root:root "$STATE/munge/munge.key"
chmod 400 "$STATE/munge/munge.key"
MUNGE_SOCK="$STATE/munge/munge.socket"

mkdir -p /etc/slurm
cat > "$CONF.tmp.$$" <<CONFEOF
$MARKER
# state dir: $STATE
ClusterName=slurmlocal
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
SwitchType=switch/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,default_queue_depth=100,bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
# a laptop or CI runner is slower than the nodes the cost model sizes jobs for: let jobs overrun
OverTimeLimit=UNLIMITED
Waittime=0
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$REALMEM Gres=gpu:4 State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONFEOF
cat > "$GRES.tmp.$$" <<GRESEOF
$MARKER
AutoDetect=off
NodeName=$NODE Name=gpu File=$STATE/dev/nvidia[0-3]
GRESEOF
mv -f "$CONF.tmp.$$" "$CONF"
mv -f "$GRES.tmp.$$" "$GRES"
chmod 644 "$CONF" "$GRES"

show_logs() {
  local f
  for f in "$STATE/munge/munged.log" "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log"; do
    [ -e "$f" ] && { echo "--- tail $f" >&2; tail -n 20 "$f" >&2; }
  done
}
wait_pid() {  # wait_pid PIDFILE COMM NAME
  local i
  for i in $(seq 1 100); do pid_alive "$1" "$2" && return 0; sleep 0.1; done
  show_logs; die "$3 did not start (no live pid in $1)"
}

# All daemons fork and write their own pid files.
rm -f "$STATE"/*.pid
munged --force --socket="$MUNGE_SOCK" --key-file="$STATE/munge/munge.key" \
  --pid-file="$STATE/munged.pid" --log-file="$STATE/munge/munged.log" \
  --seed-file="$STATE/munge/munged.seed" </dev/null >/dev/null 2>&1 \
  || { show_logs; die "munged failed to start"; }
wait_pid "$STATE/munged.pid" munged munged

slurmctld -c -f "$CONF" </dev/null >/dev/null 2>&1 || { show_logs; die "slurmctld failed to start"; }
wait_pid "$STATE/slurmctld.pid" slurmctld slurmctld

slurmd -f "$CONF" </dev/null >/dev/null 2>&1 || { show_logs; die "slurmd failed to start"; }
wait_pid "$STATE/slurmd.pid" slurmd slurmd

deadline=$(( $(date +%s) + 60 ))
state=""
while :; do
  state=$(sinfo -h -o %T 2>/dev/null | head -n1 || true)
  [ "$state" = "idle" ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    show_logs
    die "node $NODE not idle after 60 s (state: '${state:-none}')"
  fi
  sleep 0.5
done
echo "slurm-local: node $NODE idle (CPUs=$CPUS RealMemory=${REALMEM}M gpu:4 fake), partition 'local', state in $STATE"
