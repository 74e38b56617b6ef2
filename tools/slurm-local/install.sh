#!/usr/bin/env bash
# Install Debian's SLURM (22.05) + munge packages for a local single-node cluster.
# Idempotent: exits immediately when sbatch, slurmctld, slurmd and munged are present.
set -euo pipefail

have_all() {
  local b
  for b in sbatch slurmctld slurmd munged; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || return 1
  done
}
have_all && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "slurm-local/install.sh: must run as root (or with passwordless sudo) to apt-get install slurm" >&2
    exit 1
  fi
fi

PKGS=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PKGS[@]}" >/tmp/slurm-local-apt.log 2>&1; then
  # Package lists may be stale/missing: update once, then retry.
  $SUDO apt-get update -q >>/tmp/slurm-local-apt.log 2>&1 || true
  if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>/tmp/slurm-local-apt.log 2>&1; then
    tail -n 20 /tmp/slurm-local-apt.log >&2
    echo "slurm-local/install.sh: apt-get install ${PKGS[*]} failed (log: /tmp/slurm-local-apt.log)" >&2
    exit 1
  fi
fi
have_all || { echo "slurm-local/install.sh: packages installed but binaries still missing" >&2; exit 1; }
echo "slurm-local: installed ${PKGS[*]}"
