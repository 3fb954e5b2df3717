# slurm/lib.sh: the bash functions every job template shares. `megatron-gspo launch slurm`
# inlines this file into the rendered batch script, so a submitted (and requeued) job never reads
# files from the source tree. Needs bash >= 4.3, scontrol, and curl (or python3 as a fallback).
#
# Variables the template sets before these functions run:
#   MGSPO_RUN_DIR LOG_DIR NUM_SERVERS HEALTH_TIMEOUT_S ROUTER_URL USE_ROUTER
#   SERVER_URLS[] SERVER_LOGS[] SERVER_WHERE[] SERVER_URLS_JSON   (filled by server_urls)

log() { printf '%s [megatron-gspo job %s] %s\n' "$(date '+%F %T')" "${SLURM_JOB_ID:-?}" "$*"; }

# --- HTTP: curl when present, else python3's urllib ------------------------------------------
_http() {  # _http METHOD URL [JSON_BODY] -> prints the body; rc 0 only on a 2xx answer
    if command -v curl >/dev/null 2>&1; then
        if [ "$1" = GET ]; then
            curl -fsS -m 10 "$2"
        else
            local body='{}'
            [ $# -ge 3 ] && body=$3
            curl -fsS -m 30 -X "$1" -H 'Content-Type: application/json' -d "$body" "$2"
        fi
    else
        python3 - "$@" <<'PY'
import sys, urllib.request
method, url = sys.argv[1], sys.argv[2]
data = sys.argv[3].encode() if len(sys.argv) > 3 else (None if method == "GET" else b"{}")
req = urllib.request.Request(url, data=data, method=method,
                             headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=10 if method == "GET" else 30) as r:
        sys.stdout.write(r.read().decode(errors="replace"))
except Exception as e:  # non-2xx answers raise too
    sys.stderr.write(f"{url}: {e}\n"); sys.exit(1)
PY
    fi
}
http_ok() { _http GET "$1" >/dev/null 2>&1; }

tail_log() {  # tail_log FILE: the end of a log, indented, for error messages
    if [ -s "$1" ]; then tail -n "${2:-40}" "$1" | sed 's/^/    | /'; else echo "    | ($1 is empty or missing)"; fi
}

# --- signals ---------------------------------------------------------------------------------
# USR1 comes from `#SBATCH --signal=B:USR1@<s>` (time limit near) or `scancel --batch -s USR1`:
# we forward it to the trainer, which checkpoints, and requeue the job ourselves afterwards.
# TERM comes from scancel, `scontrol requeue` or a preemption (Slurm signals every step itself:
# the trainer checkpoints within KillWait), or from `scancel --signal=TERM --full`, which signals
# this script and its children (the srun processes) but not the steps' tasks. Either way we pass
# it on to the trainer's srun as SIGUSR1, which srun forwards to every task (the trainer stops on
# TERM and USR1 alike: checkpoint, exit 75); a SIGTERM to srun would make srun kill its tasks.
# We never requeue on a TERM: Slurm requeues a requeued or preempted job itself.
GOT_USR1=0
GOT_TERM=0
TRAIN_PID=""
on_usr1() {
    GOT_USR1=1
    log "SIGUSR1: asking the trainer to checkpoint and stop"
    [ -n "$TRAIN_PID" ] && kill -USR1 "$TRAIN_PID" 2>/dev/null
}
on_term() {
    GOT_TERM=1
    log "SIGTERM: the job is being cancelled, requeued or preempted; asking the trainer to checkpoint and stop"
    [ -n "$TRAIN_PID" ] && kill -USR1 "$TRAIN_PID" 2>/dev/null
}
trap on_usr1 USR1
trap on_term TERM INT

# srun answers a SIGTERM sent to srun itself ("srun: forcing job termination") with SIGKILL of
# all its tasks: it blocks SIGTERM, takes it with sigwait() and resets an inherited SIG_IGN, so
# neither `trap '' TERM` nor an exec wrapper keeps it from doing so. `scancel --signal=TERM
# --full` and a stop of the batch step's whole process tree send it that SIGTERM. The trainer's
# srun therefore runs with this preload (start_training: LD_PRELOAD for srun alone; it restores
# the caller's LD_PRELOAD before srun reads its environment, so the tasks never see it): its
# sigwait() leaves SIGTERM out of the set, srun never acts on a SIGTERM (it stays pending), and
# the script passes the stop on to the tasks as SIGUSR1 (on_term). Built at job start with cc;
# without a C compiler the job says so and such a SIGTERM kills the trainer without a checkpoint.
SRUN_KEEP_TERM=""
build_srun_keep_term() {
    local dir cc=${CC:-cc}
    command -v "$cc" >/dev/null 2>&1 || {
        log "WARNING: no C compiler ($cc): srun will answer a SIGTERM of its own (scancel --signal=TERM --full) by killing the trainer without a checkpoint"
        return 0
    }
    dir=$(mktemp -d "${TMPDIR:-/tmp}/megatron-gspo-srun.XXXXXX") || return 0
    SRUN_KEEP_TERM_DIR=$dir
    if "$cc" -shared -fPIC -O2 -o "$dir/srun_keep_term.so" -x c - -ldl 2>"$dir/cc.log" <<'C'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdlib.h>
/* megatron-gspo (slurm/lib.sh): srun without SIGTERM in its sigwait() set */
static int (*next_sigwait)(const sigset_t *, int *);
__attribute__((constructor)) static void restore_preload(void) {
    const char *before = getenv("MGSPO_LD_PRELOAD_BEFORE");
    if (!before) return;
    if (*before) setenv("LD_PRELOAD", before, 1); else unsetenv("LD_PRELOAD");
    unsetenv("MGSPO_LD_PRELOAD_BEFORE");
}
int sigwait(const sigset_t *set, int *sig) {
    sigset_t without_term = *set;
    sigdelset(&without_term, SIGTERM);
    if (!next_sigwait) next_sigwait = (int (*)(const sigset_t *, int *))dlsym(RTLD_NEXT, "sigwait");
    return next_sigwait(&without_term, sig);
}
C
    then
        SRUN_KEEP_TERM=$dir/srun_keep_term.so
    else
        log "WARNING: could not build the srun preload ($cc failed: $(tail -n 3 "$dir/cc.log" | tr '\n' ' ')); srun will answer a SIGTERM of its own by killing the trainer without a checkpoint"
    fi
}
cleanup_srun_keep_term() { [ -n "${SRUN_KEEP_TERM_DIR:-}" ] && rm -rf "$SRUN_KEEP_TERM_DIR"; return 0; }
trap cleanup_srun_keep_term EXIT

interrupted() { [ "$GOT_USR1" = 1 ] || [ "$GOT_TERM" = 1 ]; }

wait_pid() {  # wait_pid PID: its exit status; a trapped signal does not end the wait
    local rc
    while :; do
        wait "$1"; rc=$?
        # wait returns > 128 when a trapped signal interrupts it; the process may still run
        if [ "$rc" -gt 128 ] && kill -0 "$1" 2>/dev/null; then continue; fi
        return "$rc"
    done
}

# --- servers ----------------------------------------------------------------------------------
server_urls() {  # server_urls NODELIST TASKS_PER_NODE NODES_PER_SERVER PORT0: fill SERVER_* arrays
    local hosts i task node
    mapfile -t hosts < <(scontrol show hostnames "$1")
    SERVER_URLS=(); SERVER_LOGS=(); SERVER_WHERE=()
    for ((i = 0; i < NUM_SERVERS; i++)); do
        task=$((i * $3))                # the server's first task: it serves HTTP (node rank 0)
        node=$((task / $2))             # --distribution=block: task t runs on node t / tasks-per-node
        SERVER_URLS+=("http://${hosts[node]}:$(($4 + 2 * i))")
        SERVER_LOGS+=("$LOG_DIR/server-task$task.log")
        SERVER_WHERE+=("server $i (task $task on ${hosts[node]})")
    done
    # the list the trainer gets without a router (vLLM servers: rollout.server_urls)
    SERVER_URLS_JSON="[$(printf '"%s",' "${SERVER_URLS[@]}")"
    SERVER_URLS_JSON="${SERVER_URLS_JSON%,}]"
}

wait_servers_healthy() {  # wait_servers_healthy SERVERS_PID: every /health answers 200, bounded
    local deadline=$(($(date +%s) + HEALTH_TIMEOUT_S)) i pending
    while :; do
        pending=0
        for ((i = 0; i < NUM_SERVERS; i++)); do
            [ -n "${SERVER_READY[i]:-}" ] && continue
            if http_ok "${SERVER_URLS[i]}/health"; then
                SERVER_READY[i]=1
                log "${SERVER_WHERE[i]} healthy at ${SERVER_URLS[i]}"
            else
                pending=$((pending + 1))
            fi
        done
        [ "$pending" = 0 ] && return 0
        interrupted && return 2
        if ! kill -0 "$1" 2>/dev/null; then
            for ((i = 0; i < NUM_SERVERS; i++)); do
                [ -n "${SERVER_READY[i]:-}" ] && continue
                log "ERROR: ${SERVER_WHERE[i]} (${SERVER_URLS[i]}) exited before it was healthy; end of ${SERVER_LOGS[i]}:"
                tail_log "${SERVER_LOGS[i]}"
            done
            return 1
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            for ((i = 0; i < NUM_SERVERS; i++)); do
                [ -n "${SERVER_READY[i]:-}" ] && continue
                log "ERROR: ${SERVER_WHERE[i]} (${SERVER_URLS[i]}) not healthy after ${HEALTH_TIMEOUT_S}s; end of ${SERVER_LOGS[i]}:"
                tail_log "${SERVER_LOGS[i]}"
            done
            return 1
        fi
        sleep 2
    done
}

wait_router_healthy() {  # wait_router_healthy ROUTER_PID
    local deadline=$(($(date +%s) + HEALTH_TIMEOUT_S))
    until http_ok "$ROUTER_URL/health"; do
        interrupted && return 2
        if ! kill -0 "$1" 2>/dev/null || [ "$(date +%s)" -ge "$deadline" ]; then
            log "ERROR: router $ROUTER_URL not healthy (exited, or ${HEALTH_TIMEOUT_S}s passed); end of $LOG_DIR/router.log:"
            tail_log "$LOG_DIR/router.log"
            return 1
        fi
        sleep 1
    done
    log "router healthy at $ROUTER_URL"
}

register_workers() {  # POST /workers for every server, then wait until the router sees them healthy
    local i answer healthy deadline=$(($(date +%s) + HEALTH_TIMEOUT_S))
    for ((i = 0; i < NUM_SERVERS; i++)); do
        if ! answer=$(_http POST "$ROUTER_URL/workers" "{\"url\":\"${SERVER_URLS[i]}\",\"worker_type\":\"regular\"}" 2>&1); then
            log "ERROR: the router refused ${SERVER_WHERE[i]} (${SERVER_URLS[i]}): $answer"
            tail_log "$LOG_DIR/router.log"
            return 1
        fi
    done
    while :; do
        answer=$(_http GET "$ROUTER_URL/workers" 2>/dev/null)
        healthy=$(grep -o '"is_healthy": *true' <<<"$answer" | wc -l)
        [ "$healthy" -ge "$NUM_SERVERS" ] && break
        interrupted && return 2
        if [ "$(date +%s)" -ge "$deadline" ]; then
            log "ERROR: the router lists $healthy of $NUM_SERVERS healthy workers after ${HEALTH_TIMEOUT_S}s: $answer"
            tail_log "$LOG_DIR/router.log"
            return 1
        fi
        sleep 1
    done
    log "router $ROUTER_URL has $NUM_SERVERS healthy workers"
}

stop_step() {  # stop_step NAME PID: TERM the srun of a step, KILL it after 30 s
    local i
    kill -0 "$2" 2>/dev/null || return 0
    log "stopping the $1"
    kill -TERM "$2" 2>/dev/null
    for ((i = 0; i < 300; i++)); do kill -0 "$2" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$2" 2>/dev/null && { log "the $1 ignored SIGTERM for 30 s; killing it"; kill -KILL "$2" 2>/dev/null; }
    wait "$2" 2>/dev/null
    return 0
}

# --- the job: servers and router up, training, servers down, exit status ----------------------
# The template defines start_servers / start_router / start_training (each starts one srun step in
# the background and sets SERVERS_PID / ROUTER_PID / TRAIN_PID) and the variables listed above.
#
# The trainer's contract (launch/train.py): on SIGTERM or SIGUSR1 every rank finishes its step,
# saves a checkpoint and exits 75 (EX_TEMPFAIL, "requeue me"); 0 means the run is complete; any
# other status is a failure. `--resume` continues from the newest checkpoint in the run dir.
finish() {  # finish STATUS MESSAGE: stop the servers and exit
    stop_step "rollout servers" "${SERVERS_PID:-}"
    stop_step "router" "${ROUTER_PID:-}"
    log "$2"
    exit "$1"
}

requeue_self() {
    log "requeueing job $SLURM_JOB_ID; the restart resumes from the newest checkpoint in $MGSPO_RUN_DIR"
    stop_step "rollout servers" "${SERVERS_PID:-}"
    stop_step "router" "${ROUTER_PID:-}"
    if scontrol requeue "$SLURM_JOB_ID"; then
        log "megatron-gspo job: requeued"
        exit 0
    fi
    log "megatron-gspo job: ERROR: scontrol requeue $SLURM_JOB_ID failed; resubmit the same command to resume"
    exit 75
}

run_job() {
    local rc servers_rc=""
    mkdir -p "$LOG_DIR" || { log "ERROR: cannot create $LOG_DIR"; exit 1; }
    log "run dir $MGSPO_RUN_DIR, logs $LOG_DIR, restart ${SLURM_RESTART_COUNT:-0}"
    log "rollout nodes: $ROLLOUT_NODELIST; training nodes: $TRAIN_NODELIST (master $MASTER_ADDR:$MASTER_PORT)"
    server_urls "$ROLLOUT_NODELIST" "$SERVER_TASKS_PER_NODE" "$NODES_PER_SERVER" "$MGSPO_SERVER_PORT0"
    SERVER_READY=()

    start_servers
    if [ "$USE_ROUTER" = 1 ]; then
        start_router
        log "started $NUM_SERVERS rollout server(s) (${SERVER_URLS[*]}) and the router ($ROUTER_URL)"
        wait_router_healthy "$ROUTER_PID"; rc=$?
    else
        log "started $NUM_SERVERS rollout server(s) (${SERVER_URLS[*]}); no router: the trainer routes over them"
        rc=0
    fi
    [ "$rc" = 0 ] && { wait_servers_healthy "$SERVERS_PID"; rc=$?; }
    [ "$rc" = 0 ] && [ "$USE_ROUTER" = 1 ] && { register_workers; rc=$?; }
    if [ "$rc" != 0 ]; then
        [ "$GOT_USR1" = 1 ] && [ "$GOT_TERM" = 0 ] && requeue_self
        [ "$GOT_TERM" = 1 ] && finish 143 "megatron-gspo job: stopped by SIGTERM before training started"
        finish 1 "megatron-gspo job: FAILED: the rollout servers or the router did not come up (see above)"
    fi
    if interrupted; then   # a signal between the last check and here: do not start the trainer
        [ "$GOT_TERM" = 1 ] && finish 143 "megatron-gspo job: stopped by SIGTERM before training started"
        requeue_self
    fi

    log "starting training (logs $LOG_DIR/train-rank*.log)"
    build_srun_keep_term
    start_training
    wait_pid "$TRAIN_PID"; rc=$?
    TRAIN_PID=""
    log "training step exited with status $rc"
    if ! kill -0 "$SERVERS_PID" 2>/dev/null; then
        wait "$SERVERS_PID"; servers_rc=$?
    fi
    if [ "$GOT_TERM" = 1 ]; then
        # 75: the trainer checkpointed; the job says so too (Slurm requeues it if it is being
        # requeued or preempted; otherwise the same command resumes it)
        [ "$rc" = 75 ] && finish 75 "megatron-gspo job: stopped by SIGTERM after a checkpoint (exit 75: Slurm requeues the job if it is being requeued or preempted; otherwise submit the same command to resume)"
        # 137: the trainer was killed before it could save: srun turned a SIGTERM of its own into
        # SIGKILL of its tasks (no preload: no C compiler), or KillWait ran out; the newest
        # complete checkpoint is where the next start resumes
        [ "$rc" = 137 ] && finish 137 "megatron-gspo job: stopped by SIGTERM: the trainer was killed before it saved (srun without its preload turns a SIGTERM of its own into SIGKILL of its tasks, or KillWait ran out); the next start resumes from the newest complete checkpoint in $MGSPO_RUN_DIR/checkpoints"
        finish 143 "megatron-gspo job: stopped by SIGTERM (Slurm requeues the job if it is being requeued or preempted)"
    fi
    # 75: checkpointed on our SIGUSR1 (or on a signal sent to the step directly); > 128: a rank
    # was killed by the signal before its handler was installed, the last checkpoint is resumed
    if [ "$rc" = 75 ] || { [ "$GOT_USR1" = 1 ] && [ "$rc" -gt 128 ]; }; then
        requeue_self
    fi
    if [ "$rc" != 0 ]; then
        log "end of the rank logs:"
        for f in "$LOG_DIR"/train-rank*.log; do log "$f"; tail_log "$f" 20; done
        finish "$rc" "megatron-gspo job: FAILED: training exited with status $rc"
    fi
    if [ -n "$servers_rc" ]; then
        finish 1 "megatron-gspo job: FAILED: the rollout servers exited with status $servers_rc during training (see $LOG_DIR/server-task*.log)"
    fi
    if [ "$USE_ROUTER" = 1 ] && ! kill -0 "$ROUTER_PID" 2>/dev/null; then
        finish 1 "megatron-gspo job: FAILED: the router exited during training (see $LOG_DIR/router.log)"
    fi
    finish 0 "megatron-gspo job: training complete"
}
