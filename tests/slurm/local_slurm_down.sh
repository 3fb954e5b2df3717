#!/usr/bin/env bash
# local_slurm_down.sh - stop what local_slurm_up.sh started (same LOCAL_SLURM_DIR), by PID file only.
#   1. cancels every job of that cluster and waits for the steps to end;
#   2. stops the slurmd's, slurmctld and the private munged (TERM, KILL after 15 s), each only when
#      its PID file names a live process of that name: nothing else on the machine is touched;
#   3. removes the /etc/hosts line that up added for this directory.
# Logs and state stay in $LOCAL_SLURM_DIR for post-mortems; LOCAL_SLURM_PURGE=1 deletes it too.
# Safe to run twice.
set -uo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

DIR="${LOCAL_SLURM_DIR:-/tmp/local_slurm}"
PURGE="${LOCAL_SLURM_PURGE:-0}"
CONF="$DIR/etc/slurm.conf"
export SLURM_CONF="$CONF"

log() { printf '[local_slurm_down] %s\n' "$*" >&2; }

case "$DIR" in /?*) ;; *) log "ERROR: LOCAL_SLURM_DIR must be an absolute path, got '$DIR'"; exit 1;; esac

alive() {  # alive PIDFILE COMM: print the pid when PIDFILE names a live (non-zombie) COMM
    local pid
    [ -s "$1" ] || return 1
    pid="$( { tr -dc 0-9 < "$1"; } 2>/dev/null )"
    [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
    grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null && return 1
    echo "$pid"
}

stop() {  # stop PIDFILE COMM
    local pid
    pid="$(alive "$1" "$2")" || { rm -f "$1"; return 0; }
    log "stopping $2 (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do
        alive "$1" "$2" >/dev/null || break
        sleep 0.1
    done
    if alive "$1" "$2" >/dev/null; then
        log "$2 (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.2
    fi
    rm -f "$1"
}

# 1. cancel the jobs while the controller still answers
if [ -f "$CONF" ] && alive "$DIR/run/slurmctld.pid" slurmctld >/dev/null &&
   timeout 10 scontrol ping 2>/dev/null | grep -q 'is UP'; then
    jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null | sed 's/[+_].*//' | sort -u | tr '\n' ' ')"
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 300); do   # up to 30 s; the KillWait of slurm.conf bounds a step's end
            [ -z "$(timeout 5 squeue -h -o '%i' 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
fi

# 2. the daemons, compute side first
for pidfile in "$DIR"/run/slurmd-*.pid; do
    [ -e "$pidfile" ] && stop "$pidfile" slurmd
done
stop "$DIR/run/slurmctld.pid" slurmctld
stop "$DIR/munge-run/munged.pid" munged

# report (never kill by name) step daemons still working in our spool directory
left=""
for proc in /proc/[0-9]*; do
    [ "$(cat "$proc/comm" 2>/dev/null)" = slurmstepd ] || continue
    case "$(readlink "$proc/cwd" 2>/dev/null)" in "$DIR"/*) left="$left ${proc#/proc/}";; esac
done
[ -n "$left" ] && log "WARNING: slurmstepd still running from $DIR:$left"

# 3. the /etc/hosts line tagged with this directory
TAG="# local_slurm:$DIR"
not_ours() { awk -v tag="$TAG" 'length($0) < length(tag) || substr($0, length($0) - length(tag) + 1) != tag'; }
if [ -f /etc/hosts ] && [ "$(not_ours < /etc/hosts | wc -l)" != "$(wc -l < /etc/hosts)" ]; then
    tmp="$(mktemp)"
    not_ours < /etc/hosts > "$tmp"
    cat "$tmp" > /etc/hosts   # in place: /etc/hosts may be a bind mount
    rm -f "$tmp"
    log "removed the local_slurm line from /etc/hosts"
fi

if [ "$PURGE" = 1 ] && [ -d "$DIR" ] && [ "$DIR" != / ]; then
    rm -rf "${DIR:?}"
    log "purged $DIR"
fi
log "done"
