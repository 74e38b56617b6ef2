#!/usr/bin/env bash
# Stop the cluster started by start.sh STATE_DIR: cancel jobs, stop exactly the daemons whose
# PIDs are recorded in STATE_DIR, remove the /etc/slurm files carrying start.sh's marker.
# Usage: stop.sh STATE_DIR
set -uo pipefail

MARKER="# written-by: mixquant tools/slurm-local/start.sh"
die() { echo "slurm-local/stop.sh: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: stop.sh STATE_DIR"
[ -d "$1" ] || die "no such state dir: $1"
STATE=$(cd "$1" && pwd -P)

# proc_is PID COMM: PID is a live (non-zombie) process named COMM. Zombies matter here:
# when PID 1 does not reap, a stopped daemon lingers as <defunct> with the same name.
proc_is() {
  local st
  [ "$(cat /proc/"$1"/comm 2>/dev/null)" = "$2" ] || return 1
  st=$(sed -E 's/^[0-9]+ \(.*\) ([A-Za-z]).*/\1/' /proc/"$1"/stat 2>/dev/null) || return 1
  [ "$st" != Z ] && [ "$st" != X ]
}

pid_of() {  # pid_of PIDFILE COMM -> prints pid if that pid is alive and is COMM
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1" 2>/dev/null) || return 1
  [[ "$p" =~ ^[0-9]+$ ]] || return 1
  proc_is "$p" "$2" || return 1
  echo "$p"
}

stop_one() {  # stop_one PIDFILE COMM
  local p i
  p=$(pid_of "$1" "$2") || { rm -f "$1"; return 0; }
  kill -TERM "$p" 2>/dev/null
  for i in $(seq 1 100); do
    proc_is "$p" "$2" || { rm -f "$1"; return 0; }
    sleep 0.1
  done
  echo "slurm-local/stop.sh: $2 (pid $p) ignored SIGTERM for 10 s, sending SIGKILL" >&2
  kill -KILL "$p" 2>/dev/null
  sleep 0.2
  rm -f "$1"
}

# Cancel remaining jobs while the controller is still up, and give them a moment to end.
if pid_of "$STATE/slurmctld.pid" slurmctld >/dev/null; then
  scancel --full -u root >/dev/null 2>&1 || true
  scancel --full --user="$(id -un)" >/dev/null 2>&1 || true
  for i in $(seq 1 50); do
    [ -z "$(squeue -h -t RUNNING,COMPLETING,PENDING,CONFIGURING -o %i 2>/dev/null)" ] && break
    sleep 0.2
  done
fi

stop_one "$STATE/slurmd.pid" slurmd
stop_one "$STATE/slurmctld.pid" slurmctld
stop_one "$STATE/munged.pid" munged

for f in /etc/slurm/slurm.conf /etc/slurm/gres.conf; do
  if [ -f "$f" ] && grep -qxF "$MARKER" "$f"; then rm -f "$f"; fi
done
echo "slurm-local: stopped (state kept in $STATE)"
