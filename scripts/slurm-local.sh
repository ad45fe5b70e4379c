#!/bin/bash
# slurm-local.sh: a real single-node Slurm on this machine, for tests and for trying multi-process
# jobs: munge + slurmctld + slurmd from Debian's slurm-wlm (22.05), all run as root with their own
# munge key, socket, config, state and logs in one state directory. Nothing is written outside it:
# /etc/slurm and any system munge or Slurm service are left alone; the Slurm commands find this
# cluster through SLURM_CONF.
#
#   scripts/slurm-local.sh start [STATE_DIR]   bring it up (idempotent); waits until the node is idle
#   scripts/slurm-local.sh status [STATE_DIR]  daemons and sinfo; exit 0 only when it is up
#   scripts/slurm-local.sh env [STATE_DIR]     print `export SLURM_CONF=...` (for eval)
#   scripts/slurm-local.sh stop [STATE_DIR]    cancel jobs, stop the daemons, remove STATE_DIR
#
# STATE_DIR defaults to $DDM_SLURM_DIR or /tmp/ddm-slurm. The ports default to 6817/6818 and can be
# moved with DDM_SLURM_CTLD_PORT / DDM_SLURM_D_PORT (another Slurm on this machine uses the same).
# Then, e.g.:  eval "$(scripts/slurm-local.sh env)"; srun -n 2 env | grep SLURM_PROCID
#
# Needs root (slurmd runs jobs as their users) and: apt-get install -y slurm-wlm munge
# The node is this host with what `slurmd -C` finds (CPUs, memory); one partition "local"; no
# accounting; process tracking by /proc (no cgroups); short timeouts.
set -euo pipefail

action=${1:-}
state=${2:-${DDM_SLURM_DIR:-/tmp/ddm-slurm}}
ctld_port=${DDM_SLURM_CTLD_PORT:-6817}
d_port=${DDM_SLURM_D_PORT:-6818}
conf=$state/slurm.conf
sock=$state/munge/munge.socket

say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

usage() {
  echo "usage: $0 start|stop|status|env [STATE_DIR]   (default STATE_DIR: /tmp/ddm-slurm)" >&2
  exit 2
}

check_prerequisites() {
  [ "$(id -u)" -eq 0 ] || die "must run as root (slurmd starts job steps as their users); try: sudo $0 $action"
  local missing=() pkgs=()
  for t in munged:munge mungekey:munge slurmctld:slurmctld slurmd:slurmd srun:slurm-client sinfo:slurm-client \
           scontrol:slurm-client; do
    if ! command -v "${t%%:*}" >/dev/null 2>&1 && [ ! -x "/usr/sbin/${t%%:*}" ]; then
      missing+=("${t%%:*}")
      pkgs+=("${t##*:}")
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    die "missing ${missing[*]} (Debian packages $(printf '%s\n' "${pkgs[@]}" | sort -u | tr '\n' ' ')); install with: apt-get install -y slurm-wlm munge"
  fi
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Kills the daemon whose pid file is $1 (TERM, then KILL after 10 s).
stop_pidfile() {
  local f=$1 pid
  pid_alive "$f" || return 0
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

write_config() {
  local node host
  host=$(hostname -s)
  # slurmd's own view of the hardware, so the node is never drained for a CPU or memory mismatch.
  node=$(/usr/sbin/slurmd -C | head -1)
  [[ $node == NodeName=* ]] || die "slurmd -C printed '$node', not a NodeName line"
  cat > "$conf" <<EOF
# Written by scripts/slurm-local.sh: a single-node cluster for tests. Removed by its stop.
ClusterName=ddmlocal
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/slurmctld.log
SlurmdLogFile=$state/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=5
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

node_state() { SLURM_CONF=$conf timeout 10 sinfo -h -N -o '%T' 2>/dev/null | head -1; }

start() {
  check_prerequisites
  if pid_alive "$state/slurmctld.pid" && pid_alive "$state/slurmd.pid" && pid_alive "$state/munge/munged.pid"; then
    case "$(node_state)" in
      idle*|mixed*|allocated*) say "already running ($state)"; print_env; return 0 ;;
    esac
  fi
  # Anything half-started before (a crashed start, a reboot left stale files) is stopped first.
  stop_daemons
  # munged serves its socket only from a directory every user can reach.
  local dir
  dir=$(dirname "$(realpath -m "$state")")
  while [ "$dir" != / ]; do
    if [ -d "$dir" ] && [ "$(( 0$(stat -c %a "$dir") & 1 ))" -eq 0 ]; then
      die "munged needs every directory above $state to be searchable by all users, and $dir is not (chmod o+x $dir, or use another STATE_DIR)"
    fi
    dir=$(dirname "$dir")
  done
  mkdir -p "$state/munge" "$state/ctld" "$state/d"
  chmod 755 "$state" "$state/munge"  # munged requires a socket directory all can search
  if [ ! -f "$state/munge/munge.key" ]; then
    mungekey -c -k "$state/munge/munge.key" >/dev/null
  fi
  chmod 600 "$state/munge/munge.key"
  munged --socket="$sock" --key-file="$state/munge/munge.key" --log-file="$state/munge/munged.log" \
         --pid-file="$state/munge/munged.pid" --seed-file="$state/munge/munged.seed" \
    || die "munged did not start; see $state/munge/munged.log"
  munge -S "$sock" -n | unmunge -S "$sock" >/dev/null || die "munge does not work; see $state/munge/munged.log"
  write_config
  if ss -ltn 2>/dev/null | grep -qE "[:.]($ctld_port|$d_port)\b"; then
    die "port $ctld_port or $d_port is already in use (another Slurm?); set DDM_SLURM_CTLD_PORT and DDM_SLURM_D_PORT"
  fi
  # -i: start clean, ignoring any state left in StateSaveLocation.
  /usr/sbin/slurmctld -f "$conf" -i || die "slurmctld did not start; see $state/slurmctld.log"
  /usr/sbin/slurmd -f "$conf" || die "slurmd did not start; see $state/slurmd.log"
  for _ in $(seq 150); do
    case "$(node_state)" in
      idle*) say "up: node $(hostname -s) idle, partition local ($state)"; print_env; return 0 ;;
    esac
    sleep 0.2
  done
  echo "--- sinfo:" >&2; SLURM_CONF=$conf sinfo -N -l >&2 || true
  echo "--- slurmctld.log (tail):" >&2; tail -5 "$state/slurmctld.log" >&2 || true
  echo "--- slurmd.log (tail):" >&2; tail -5 "$state/slurmd.log" >&2 || true
  die "the node did not become idle within 30 s (state: '$(node_state)'); see the logs in $state"
}

stop_daemons() {
  if pid_alive "$state/slurmctld.pid"; then
    SLURM_CONF=$conf timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
  fi
  stop_pidfile "$state/slurmd.pid"
  stop_pidfile "$state/slurmctld.pid"
  stop_pidfile "$state/munge/munged.pid"
}

stop() {
  [ "$(id -u)" -eq 0 ] || die "must run as root; try: sudo $0 stop"
  if [ ! -d "$state" ]; then say "not running ($state does not exist)"; return 0; fi
  [ -f "$conf" ] || [ -d "$state/munge" ] || die "$state does not look like a slurm-local state directory; not removing it"
  stop_daemons
  rm -rf "$state"
  say "stopped; removed $state"
}

status() {
  local ok=0
  for d in munge/munged slurmctld slurmd; do
    if pid_alive "$state/$d.pid"; then echo "${d##*/}: running (pid $(cat "$state/$d.pid"))"; else echo "${d##*/}: not running"; ok=1; fi
  done
  if [ $ok -eq 0 ]; then SLURM_CONF=$conf sinfo -N -l || ok=1; fi
  return $ok
}

print_env() { echo "export SLURM_CONF=$conf"; }

case "$action" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) print_env ;;
  *) usage ;;
esac
