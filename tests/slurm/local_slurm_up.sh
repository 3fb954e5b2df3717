#!/usr/bin/env bash
# local_slurm_up.sh - a throw-away Slurm cluster on this one machine, for tests/slurm/.
#
# One slurmctld and N slurmd "virtual nodes" (all on 127.0.0.1) with a private munged, every
# file under $LOCAL_SLURM_DIR. Run as root (Debian 12; no systemd needed). It
#   * installs slurmctld, slurmd, slurm-client and munge from Debian when they are missing;
#   * writes the munge key and slurm.conf under $LOCAL_SLURM_DIR;
#   * starts munged, slurmctld and N slurmd, waits until every node is idle;
#   * prints "export SLURM_CONF=..." on stdout (also in $LOCAL_SLURM_DIR/env.sh).
# Idempotent: when the daemons of an earlier call with the same settings still answer it only
# waits for idle nodes; otherwise it cancels that cluster's jobs, stops its leftover daemons (by
# PID file, never by name) and starts afresh. Stop with local_slurm_down.sh (same environment).
#
# Why several slurmd: the backfill scheduler, the only one that starts heterogeneous jobs,
# reserves whole nodes per component, so a het job needs one node per component. Debian's slurmd
# is built with MULTIPLE_SLURMD, so several may share one host (each with its own port).
#
# Settings (environment):
#   LOCAL_SLURM_DIR           work directory (absolute)                        [/tmp/local_slurm]
#   LOCAL_SLURM_NODES         number of virtual nodes                          [2]
#   LOCAL_SLURM_CPUS          CPUs advertised per node (may exceed the real)   [4]
#   LOCAL_SLURM_MEM_MB        RealMemory per node                              [2048]
#   LOCAL_SLURM_PREFIX        node name prefix: <prefix>1 .. <prefix>N          [node]
#   LOCAL_SLURM_PORT          slurmctld port; slurmd i listens on PORT + i      [16817]
#   LOCAL_SLURM_HOSTS         1: add "<this machine's address> <nodes>" to /etc/hosts when the
#                             names do not resolve (down removes the line)     [1]
#   LOCAL_SLURM_CRED_EXPIRE   AuthInfo cred_expire in s (min 5); also how long
#                             a requeued job waits before it may start again   [10]
#   LOCAL_SLURM_SLURMD_TIMEOUT  SlurmdTimeout in s                             [60]
#   LOCAL_SLURM_WAIT_S        how long to wait for the daemons / idle nodes    [60]
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"   # the daemons live in /usr/sbin

DIR="${LOCAL_SLURM_DIR:-/tmp/local_slurm}"
NODES="${LOCAL_SLURM_NODES:-2}"
CPUS="${LOCAL_SLURM_CPUS:-4}"
MEM_MB="${LOCAL_SLURM_MEM_MB:-2048}"
PREFIX="${LOCAL_SLURM_PREFIX:-node}"
CTLD_PORT="${LOCAL_SLURM_PORT:-16817}"
EDIT_HOSTS="${LOCAL_SLURM_HOSTS:-1}"
CRED_EXPIRE="${LOCAL_SLURM_CRED_EXPIRE:-10}"
SLURMD_TIMEOUT="${LOCAL_SLURM_SLURMD_TIMEOUT:-60}"
WAIT_S="${LOCAL_SLURM_WAIT_S:-60}"

T0=$(date +%s%N)
log() {
    local ms=$(( ($(date +%s%N) - T0) / 1000000 ))
    printf '[local_slurm_up %d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*" >&2
}
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts slurmd as root)"
case "$DIR" in /?*) ;; *) die "LOCAL_SLURM_DIR must be an absolute path, got '$DIR'";; esac
[ "$DIR" != / ] || die "LOCAL_SLURM_DIR must not be /"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "LOCAL_SLURM_NODES must be a positive integer, got '$NODES'"
[[ "$CTLD_PORT" =~ ^[0-9]+$ ]] || die "LOCAL_SLURM_PORT must be a port number, got '$CTLD_PORT'"
[ "$CRED_EXPIRE" -ge 5 ] || die "LOCAL_SLURM_CRED_EXPIRE must be >= 5 (Slurm's minimum), got $CRED_EXPIRE"

CONF="$DIR/etc/slurm.conf"
MUNGE_SOCKET="$DIR/munge-run/munge.socket"
MUNGED_PID="$DIR/munge-run/munged.pid"
CTLD_PID="$DIR/run/slurmctld.pid"
# slurmctld compares SlurmctldHost with the short host name ("localhost" is refused)
HOST="$(uname -n)"; HOST="${HOST%%.*}"
NODE_NAMES=(); for i in $(seq 1 "$NODES"); do NODE_NAMES+=("${PREFIX}${i}"); done
export SLURM_CONF="$CONF"

# ------------------------------------------------------------------------------ packages
install_packages() {
    local binary missing=0
    for binary in slurmctld slurmd slurmstepd sbatch srun scontrol sinfo squeue munged munge; do
        command -v "$binary" >/dev/null 2>&1 || missing=1
    done
    [ "$missing" = 0 ] && return 0
    log "installing Debian packages: slurmctld slurmd slurm-client munge"
    # The packages' maintainer scripts start the stock services through invoke-rc.d; a
    # temporary policy-rc.d (exit 101 = "not allowed") keeps them from doing so.
    local made_policy=0 rc=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          slurmctld slurmd slurm-client munge >/dev/null; } || rc=$?
    [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$rc" = 0 ] || die "apt-get failed with status $rc"
}
install_packages

# ------------------------------------------------------------------------------ helpers
# alive PIDFILE COMM: print the pid and succeed when PIDFILE names a live (non-zombie) COMM
alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$( { tr -dc 0-9 < "$1"; } 2>/dev/null )"   # the daemon may be removing it right now
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
    grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null && return 1
    echo "$pid"
}
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

wait_for() {  # wait_for WHAT CMD...: poll CMD every 0.2 s for up to WAIT_S seconds
    local what="$1"; shift
    local deadline=$(( $(date +%s) + WAIT_S ))
    until "$@" >/dev/null 2>&1; do
        [ "$(date +%s)" -lt "$deadline" ] || { log "timed out after ${WAIT_S}s waiting for $what"; return 1; }
        sleep 0.2
    done
}
controller_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }
nodes_idle() {
    local states
    states="$(sinfo -h -N -o '%N %t' 2>/dev/null)" || return 1
    [ "$(printf '%s\n' "$states" | grep -c ' idle$')" = "$NODES" ]
}
daemons_alive() {
    alive "$MUNGED_PID" munged >/dev/null || return 1
    alive "$CTLD_PID" slurmctld >/dev/null || return 1
    local node
    for node in "${NODE_NAMES[@]}"; do alive "$(slurmd_pidfile "$node")" slurmd >/dev/null || return 1; done
}
dump_logs() {
    local f
    for f in "$DIR"/log/*.log "$DIR"/munge/munged.log; do
        [ -f "$f" ] || continue
        echo "----- $f (last 25 lines)" >&2
        tail -n 25 "$f" >&2
    done
}

# ------------------------------------------------------------------------------ already up?
SETTINGS="nodes=$NODES cpus=$CPUS mem=$MEM_MB prefix=$PREFIX port=$CTLD_PORT cred=$CRED_EXPIRE sdt=$SLURMD_TIMEOUT host=$HOST"
if [ -f "$CONF" ] && [ "$(cat "$DIR/etc/settings" 2>/dev/null)" = "$SETTINGS" ] && daemons_alive && controller_up; then
    log "the daemons of an earlier call are alive; waiting for idle nodes"
    wait_for "idle nodes" nodes_idle || { dump_logs; die "nodes not idle after ${WAIT_S}s"; }
    echo "export SLURM_CONF=$CONF"
    exit 0
fi

# Leftovers of an earlier call (partly dead, or other settings): cancel its jobs, stop its
# daemons by PID file, then start from a clean directory.
if [ -f "$CONF" ] && alive "$CTLD_PID" slurmctld >/dev/null && timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null | sed 's/[+_].*//' | sort -u | tr '\n' ' ')"
    if [ -n "${jobs// /}" ]; then
        log "cancelling the jobs of the earlier cluster: $jobs"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 300); do [ -z "$(timeout 5 squeue -h 2>/dev/null)" ] && break; sleep 0.1; done
    fi
fi
for pidfile in "$DIR"/run/slurmd-*.pid "$CTLD_PID" "$MUNGED_PID"; do
    [ -e "$pidfile" ] || continue
    for comm in slurmd slurmctld munged; do
        if pid="$(alive "$pidfile" "$comm")"; then
            log "stopping leftover $comm (pid $pid)"
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 150); do alive "$pidfile" "$comm" >/dev/null || break; sleep 0.1; done
            if alive "$pidfile" "$comm" >/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
        fi
    done
done

# ------------------------------------------------------------------------------ directories
log "preparing $DIR (nodes ${NODE_NAMES[*]}, $CPUS CPUs each, controller port $CTLD_PORT)"
for sub in etc state spool log run munge munge-run; do rm -rf "${DIR:?}/$sub"; done
mkdir -p "$DIR"/{etc,state,spool,log,run,munge,munge-run}
# munged refuses a socket unless every directory above it is o+x; its key and seed stay private
chmod 755 "$DIR" "$DIR/munge-run"
chmod 700 "$DIR/munge"
# slurmd fails with "Domain socket directory ... No such file" unless its spool dir exists
for node in "${NODE_NAMES[@]}"; do mkdir -p "$DIR/spool/slurmd-$node"; done

# ------------------------------------------------------------------------------ munge
# A private munged with its own key and socket: a system munged is neither needed nor touched.
mungekey -c -k "$DIR/munge/munge.key" >/dev/null 2>&1 ||
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$DIR/munge/munge.key"
munged --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
       --log-file="$DIR/munge/munged.log" --pid-file="$MUNGED_PID" \
       --seed-file="$DIR/munge/munged.seed" || { dump_logs; die "munged failed to start"; }
munge_answers() { munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"; }
wait_for munged munge_answers || { dump_logs; die "munged does not answer"; }
log "munged up (pid $(cat "$MUNGED_PID"))"

# ------------------------------------------------------------------------------ node names
if [ "$EDIT_HOSTS" = 1 ]; then
    unresolved=()
    for node in "${NODE_NAMES[@]}"; do getent hosts "$node" >/dev/null 2>&1 || unresolved+=("$node"); done
    if [ "${#unresolved[@]}" -gt 0 ]; then
        # append in place (/etc/hosts may be a bind mount), tagged so that down removes only ours
        [ -s /etc/hosts ] && [ -n "$(tail -c1 /etc/hosts)" ] && echo >> /etc/hosts
        # this machine's routable address where it has one, as a real node's name resolves
        # (a multi-node run refuses a master address that is loopback); else 127.0.0.1
        addr=$(hostname -I 2>/dev/null | awk '{print $1}')
        addr=${addr:-127.0.0.1}
        printf '%s %s # local_slurm:%s\n' "$addr" "${unresolved[*]}" "$DIR" >> /etc/hosts
        log "added '$addr ${unresolved[*]}' to /etc/hosts"
    fi
fi

# ------------------------------------------------------------------------------ slurm.conf
{
cat <<EOF
# written by tests/slurm/local_slurm_up.sh
ClusterName=localtest
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire (minimum 5, default 120) is also the delay before a requeued job may start again
AuthInfo=socket=${MUNGE_SOCKET},cred_expire=${CRED_EXPIRE}
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool/slurmd-%n
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${DIR}/run/slurmd-%n.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# no cgroups: works in containers and VMs without a delegated cgroup tree
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no slurmdbd: finished jobs go to a text file (sacct -c reads it)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=${DIR}/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# the configured CPUs win over the detected ones (a node may advertise more than the machine has)
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# het jobs are started by the backfill scheduler only: run it every second (default 30 s), the
# main scheduler every 2 s (default 60 s) so that requeued jobs start again promptly
SchedulerParameters=bf_interval=1,sched_interval=2,bf_hetjob_immediate,bf_hetjob_prio=min
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
JobRequeue=1
# finished jobs stay visible to squeue -t all / scontrol show job for a day
MinJobAge=86400
KillWait=5
SlurmdTimeout=${SLURMD_TIMEOUT}
InactiveLimit=0
EOF
port=$CTLD_PORT
for node in "${NODE_NAMES[@]}"; do
    port=$((port + 1))
    echo "NodeName=$node NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
} > "$CONF"
echo "$SETTINGS" > "$DIR/etc/settings"
echo "export SLURM_CONF=$CONF" > "$DIR/env.sh"

# ------------------------------------------------------------------------------ daemons
# Each daemon forks into the background, writes its PID file and closes stdin/stdout/stderr,
# so "$(local_slurm_up.sh)" and pipes do not hang.
slurmctld -f "$CONF" || { dump_logs; die "slurmctld failed to start"; }
wait_for slurmctld controller_up || { dump_logs; die "slurmctld does not answer after ${WAIT_S}s"; }
log "slurmctld up (pid $(cat "$CTLD_PID"), port $CTLD_PORT)"
for node in "${NODE_NAMES[@]}"; do
    slurmd -f "$CONF" -N "$node" || { dump_logs; die "slurmd -N $node failed to start"; }
done
wait_for "idle nodes" nodes_idle || { sinfo -N -l >&2 || true; dump_logs; die "nodes not idle after ${WAIT_S}s"; }
log "all $NODES node(s) idle"
echo "export SLURM_CONF=$CONF"
