"""``megatron-gspo launch slurm``: run a GSPO job on a Slurm cluster, rollout servers and trainers
in one job.

    # 4 rollout nodes (SGLang, --tp-size from rollout.tp_size) + 8 training nodes, 8 GPUs each
    megatron-gspo launch slurm --config launch/configs/qwen3_30b_a3b.yaml --nodes 8 \\
        --rollout-nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 \\
        --model-path /models/Qwen3-30B-A3B --container-image /images/megatron-gspo.sqsh \\
        --container-mounts /lustre:/lustre

    # CPU machines: local rollout servers (`megatron-gspo serve`) and gloo training ranks,
    # starting from the SFT policy (megatron-gspo sft writes runs/sft/hf)
    megatron-gspo launch slurm --config launch/configs/tiny_cpu.yaml --nodes 2 --rollout-nodes 1 \\
        --set run.init_from=runs/sft/hf

    # print the batch script, submit nothing
    megatron-gspo launch slurm --config X.yaml ... --dry-run

The batch script is rendered from the templates in ``slurm/`` (``disaggregated.sbatch``: a
heterogeneous job, rollout component then training component; ``colocated.sbatch`` with
``--rollout-nodes 0``: one component whose nodes host both) and ``slurm/lib.sh``, and submitted
with sbatch; the job id and the run directory are printed. The script holds resources and
environment only. The run's configuration, with the ``--set`` overrides applied and
``run.output_dir`` made absolute, is written to ``<run dir>/slurm/config.yaml`` and is the only
place with hyperparameters. The job:

* starts the rollout servers (SGLang with ``--gpus-per-node`` > 0, else ``megatron-gspo serve``;
  vLLM 0.32 with ``rollout.engine: vllm``, ``launch.slurm_vllm``), the router on the rollout
  component's first node, waits for every server's ``/health`` (bounded by
  ``--health-timeout-s``; an error names the server and shows the end of its log), and registers
  the servers with the router (``POST /workers``); vLLM servers get no router: the trainer gets
  their list (``rollout.server_urls``) and its client routes over them;
* runs ``megatron-gspo train --resume`` on every training rank (``srun``; ranks from
  SLURM_PROCID / SLURM_LOCALID, MASTER_ADDR = the training component's first node) against the
  router, then stops the servers; it exits non-zero if any component failed;
* is requeueable: SIGUSR1 ``--signal-before-s`` seconds before the time limit is forwarded to the
  trainer, which checkpoints; the job requeues itself and resumes in the same run directory
  (``scontrol requeue`` or a preemption works the same way through SIGTERM).

Logs: ``<run dir>/logs/slurm-<job id>.out`` (the batch script, appended across restarts) and
``<run dir>/logs/<job id>-<restart>/{router,server-task<t>,train-rank<r>}.log``.

Environment of the steps: ``--env NAME=VALUE`` exports NAME in every step (``--env NAME``: its
value in this shell). On GPUs the training ranks get
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless ``--env`` names that variable.
Nodes with several network interfaces: name the one the nodes reach each other on, for gloo
(the control group, CPU collectives) and NCCL alike, e.g.

    megatron-gspo launch slurm ... --env GLOO_SOCKET_IFNAME=ib0 --env NCCL_SOCKET_IFNAME=ib0

(``ip -br addr`` on a compute node lists them; without it gloo and NCCL pick an interface by
the hostname, which can be one the other nodes cannot reach). ``MASTER_ADDR`` (the training
component's first node) must resolve on that node to an address the others reach: a training
rank 0 whose hostname maps to a loopback address (127.0.1.1 in /etc/hosts, as on many images)
refuses to start a multi-node run, naming the fix.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from launch import slurm_vllm, weight_sync_reach
from launch.common import add_config_args, load_from_args
from megatron_gspo.config import (Config, ConfigError, dump_config, load_config,
                                  validate_data_parallel)
from megatron_gspo.hf import fp8, megatron_layout
from pipeline.local.health_env import LAUNCHER_ENV

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "slurm"
PREEMPTED_EXIT_STATUS = 75
"""The trainer's exit status after it checkpointed on SIGTERM / SIGUSR1 (EX_TEMPFAIL, "requeue
me"; ``pipeline.signals.PREEMPTED_EXIT_CODE``): the batch script requeues the job on it."""


@dataclass(frozen=True)
class JobLayout:
    """Where every process of the job runs (derived from the command line and the config)."""

    colocated: bool
    train_nodes: int
    train_tasks_per_node: int
    rollout_nodes: int
    """Nodes that host rollout servers (the training nodes themselves when colocated)."""
    gpus_per_node: int
    server: str
    """"sglang" (GPU), "vllm" (``rollout.engine: vllm``: GPU, or vLLM's CPU build;
    ``launch.slurm_vllm``) or "local" (``megatron-gspo serve``, CPU)."""
    server_tp: int
    server_tasks_per_node: int
    nodes_per_server: int
    num_servers: int

    @property
    def world_size(self) -> int:
        return self.train_nodes * self.train_tasks_per_node

    @property
    def uses_router(self) -> bool:
        """The job starts the sglang-router in front of its servers (not for vLLM's: the
        trainer's client routes over them, ``launch.slurm_vllm``)."""
        return self.server != "vllm"

    def describe(self) -> str:
        where = "on the training nodes" if self.colocated else f"on {self.rollout_nodes} node(s)"
        span = (f"{self.nodes_per_server} nodes each" if self.nodes_per_server > 1
                else f"{self.server_tasks_per_node} per node")
        tp = f", {self.server_tp} GPU(s) each" if self.gpus_per_node else ""
        router = ("router on the first rollout node" if self.uses_router
                  else "no router: the trainer's client routes over the servers")
        return (f"training: {self.train_nodes} node(s) x {self.train_tasks_per_node} rank(s) = "
                f"{self.world_size} ranks; rollout: {self.num_servers} {self.server} server(s) "
                f"{where} ({span}{tp}); {router}")


def plan_layout(cfg: Config, args: argparse.Namespace) -> JobLayout:
    """Check the command line against the config; errors name the option or field to change."""
    gpus = args.gpus_per_node
    for flag, value, minimum in (("--nodes", args.nodes, 1), ("--rollout-nodes", args.rollout_nodes, 0),
                                 ("--gpus-per-node", gpus, 0)):
        if value < minimum:
            raise ConfigError(f"{flag}: must be >= {minimum}, got {value}")
    server = args.server or ("vllm" if cfg.rollout.engine == "vllm"
                             else "sglang" if gpus > 0 else "local")
    if server == "sglang" and gpus == 0:
        raise ConfigError("--server sglang: SGLang servers need GPUs; set --gpus-per-node, or use "
                          "--server local (megatron-gspo serve) on CPU machines")
    if server == "vllm":
        slurm_vllm.check_layout(cfg, gpus_per_node=gpus)
    elif cfg.rollout.engine == "vllm":
        raise ConfigError(f"--server {server}: rollout.engine vllm needs vLLM servers (--server "
                          "vllm, the default with it)")
    colocated = args.rollout_nodes == 0
    rollout_nodes = args.nodes if colocated else args.rollout_nodes

    if args.ntasks_per_node is not None:
        if args.ntasks_per_node < 1:
            raise ConfigError(f"--ntasks-per-node: must be >= 1, got {args.ntasks_per_node}")
        tasks_per_node = args.ntasks_per_node
    elif gpus > 0:
        tasks_per_node = gpus
    else:  # CPU: the smallest world the parallel layout needs, spread over the training nodes
        from megatron_gspo.parallel import minimal_world_size
        tasks_per_node = max(1, math.ceil(minimal_world_size(cfg.parallel) / args.nodes))

    from megatron_gspo.parallel import derive_layout
    # raise naming every factor / field, before the job queues (the trainers check the same)
    validate_data_parallel(cfg, derive_layout(cfg.parallel, args.nodes * tasks_per_node).data)

    tp = cfg.rollout.tp_size
    if server in ("sglang", "vllm") and gpus > 0:
        if tp <= gpus:
            if gpus % tp:
                raise ConfigError(f"rollout.tp_size: {tp} does not divide --gpus-per-node {gpus}")
            per_node, nodes_per_server = gpus // tp, 1
            num_servers = rollout_nodes * per_node
        else:
            if tp % gpus:
                raise ConfigError(f"rollout.tp_size: {tp} is not a multiple of --gpus-per-node "
                                  f"{gpus} (a server spanning nodes uses whole nodes)")
            per_node, nodes_per_server = 1, tp // gpus
            if rollout_nodes % nodes_per_server:
                raise ConfigError(
                    f"--rollout-nodes: {rollout_nodes} is not a multiple of the {nodes_per_server} "
                    f"nodes one server spans (rollout.tp_size {tp} / --gpus-per-node {gpus})")
            num_servers = rollout_nodes // nodes_per_server
    else:
        if tp != 1:
            raise ConfigError(f"rollout.tp_size: {tp} needs SGLang servers on GPUs; the local "
                              "server (--server local) has no tensor parallelism, set it to 1")
        num_servers = cfg.rollout.num_servers
        if num_servers % rollout_nodes:
            raise ConfigError(f"rollout.num_servers: {num_servers} {server} servers do not spread "
                              f"evenly over {rollout_nodes} rollout node(s)")
        per_node, nodes_per_server = num_servers // rollout_nodes, 1
    return JobLayout(colocated=colocated, train_nodes=args.nodes, train_tasks_per_node=tasks_per_node,
                     rollout_nodes=rollout_nodes, gpus_per_node=gpus, server=server, server_tp=tp,
                     server_tasks_per_node=per_node, nodes_per_server=nodes_per_server,
                     num_servers=num_servers)


ROUTER_COMMAND = ('exec "${MGSPO_SGLANG_PYTHON:-$MGSPO_PYTHON}" -m sglang_router.launch_router '
                  "--host 0.0.0.0 --port $ROUTER_PORT "
                  "--prometheus-host 0.0.0.0 --prometheus-port $((ROUTER_PORT + 2))")
"""The router's ``bash -c`` body (sglang-router's own CLI; servers register through POST /workers)."""


SGLANG_VERSION = "0.5.23"
"""The SGLang release whose ``sglang.launch_server`` command line :func:`server_command` renders
(tests/slurm/test_sglang_cli.py parses it with that release's own ``ServerArgs`` parser)."""


def sglang_parallel_flags(tp_size: int, rollout) -> list[str]:
    """``--tp-size`` and the data-parallel flags of one server of ``tp_size`` GPUs
    (``rollout.tp_size``: every server spans that many GPUs, whatever its inner layout).

    * ``rollout.enable_dp_attention``: one replica whose attention runs in ``rollout.dp_size``
      data-parallel groups inside the TP group: ``--tp-size T --attn-dp-size N`` (SGLang 0.5.23's
      spelling; its deprecated ``--enable-dp-attention --dp-size N`` resolves to the same);
    * ``rollout.dp_size`` N > 1 without it: N data-parallel replicas of T / N GPUs each:
      ``--tp-size T/N --dp-size N`` (SGLang's world is dp_size x tp_size GPUs).
    """
    dp = rollout.dp_size if rollout is not None else 1
    if rollout is not None and rollout.enable_dp_attention:
        return [f"--tp-size {tp_size}", f"--attn-dp-size {dp}"]
    if dp > 1:
        if tp_size % dp:
            raise ConfigError(f"rollout.dp_size: {dp} replicas do not divide the server's "
                              f"rollout.tp_size {tp_size} GPUs")
        return [f"--tp-size {tp_size // dp}", f"--dp-size {dp}"]
    return [f"--tp-size {tp_size}"]


def sglang_flags(rollout) -> list[str]:
    """SGLang server flags from the config's rollout section (SGLang 0.5.23's own names; the
    parallel layout is :func:`sglang_parallel_flags`)."""
    flags = []
    if rollout.mem_fraction_static is not None:
        flags.append(f"--mem-fraction-static {rollout.mem_fraction_static:g}")
    if rollout.ep_size > 1:
        flags.append(f"--ep-size {rollout.ep_size}")
    if rollout.quantization is not None:  # FP8 rollouts: the servers' FP8 checkpoint and kernels
        flags.append(f"--quantization {rollout.quantization}")
    if rollout.cuda_graph_max_bs is not None:
        # 0.5.23 has one bound per phase; a bare --cuda-graph-max-bs is an ambiguous abbreviation
        # of --cuda-graph-max-bs-decode / -prefill there (argparse exits 2)
        flags.append(f"--cuda-graph-max-bs-decode {rollout.cuda_graph_max_bs}")
    return flags


def server_command(layout: JobLayout, seed: int, colocated: bool, *, rollout=None,
                   gpu_binding: str = "node", routed_experts: bool = False) -> str:
    """The body of ``bash -c`` that every server task runs; $-variables expand in the task.

    Server i is made of tasks i*K .. i*K+K-1 (K = nodes per server, one task per node then);
    its HTTP port is MGSPO_SERVER_PORT0 + 2 i, and + 2 i + 1 is its multi-node rendezvous port.
    ``gpu_binding`` "node": every task sees the node's GPUs (the server's first is
    SLURM_LOCALID x tp); "task": the site binds each task its own GPUs, numbered from 0.
    ``routed_experts``: the servers record and return routed experts
    (``--enable-return-routed-experts``, for ``gspo.routing_replay: rollout``).
    """
    k = layout.nodes_per_server
    index = f"$((SLURM_PROCID / {k}))" if k > 1 else "$SLURM_PROCID"
    lines = [f"i={index}"]
    port = "--port $((MGSPO_SERVER_PORT0 + 2 * i))"
    seed_arg = f"--random-seed $(({seed} + i))"
    if layout.server == "sglang":
        cmd = ['exec "${MGSPO_SGLANG_PYTHON:-$MGSPO_PYTHON}" -m sglang.launch_server --model-path "$MGSPO_MODEL_PATH"',
               *sglang_parallel_flags(layout.server_tp, rollout), "--host 0.0.0.0", port, seed_arg]
        if k > 1:
            lines.append("hosts=($MGSPO_ROLLOUT_HOSTS)")
            cmd += [f"--nnodes {k} --node-rank $((SLURM_PROCID % {k}))",
                    f"--dist-init-addr ${{hosts[$((i * {k}))]}}:$((MGSPO_SERVER_PORT0 + 2 * i + 1))"]
        elif gpu_binding == "node":
            cmd.append(f"--base-gpu-id $((SLURM_LOCALID * {layout.server_tp}))")
        else:
            cmd.append("--base-gpu-id 0")
        cmd += sglang_flags(rollout) if rollout is not None else []
        if colocated:
            cmd.append("--enable-memory-saver")  # the trainer releases/resumes server memory
        if routed_experts:
            cmd.append("--enable-return-routed-experts")
    else:
        # the local server loads weight updates only from its --weight-roots: the disk sync's
        # shared directory (rollout.weight_sync.dir, default <run dir>/weights)
        roots = (rollout.weight_sync.dir if rollout is not None and rollout.weight_sync.dir
                 else "$MGSPO_RUN_DIR/weights")
        cmd = ['exec "$MGSPO_PYTHON" -m launch.cli serve --model-path "$MGSPO_MODEL_PATH"',
               "--host 0.0.0.0", port, seed_arg, f'--weight-roots "{roots}"']
        if rollout is not None and rollout.quantization is not None:
            cmd.append(f"--quantization {rollout.quantization}")
        if routed_experts:
            cmd.append("--enable-return-routed-experts")
    lines.append(" ".join(cmd))
    return "; ".join(lines)


def _sbatch_lines(args: argparse.Namespace, layout: JobLayout, run_dir: Path, job_name: str,
                  workdir: Path) -> str:
    job = [f"--job-name={job_name}", f"--output={run_dir}/logs/slurm-%j.out", "--open-mode=append",
           f"--chdir={workdir}", "--requeue", f"--signal=B:USR1@{args.signal_before_s}"]

    def component(nodes: int, tasks_per_node: int) -> list[str]:
        lines = [f"--partition={args.partition}"] if args.partition else []
        lines += [f"--account={args.account}"] if args.account else []
        lines += [f"--time={args.time}"] if args.time else []
        lines += [f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
        if layout.gpus_per_node:
            # --exclusive does not always hand a task the node's memory; the 61 GB (30B) to
            # 470 GB (235B) checkpoint loads and the pinned host optimizer state need it
            lines += [f"--gpus-per-node={layout.gpus_per_node}", "--exclusive", "--mem=0"]
        return lines

    if layout.colocated:
        groups = [job + component(layout.train_nodes, layout.train_tasks_per_node)]
    else:
        groups = [job + component(layout.rollout_nodes, layout.server_tasks_per_node),
                  component(layout.train_nodes, layout.train_tasks_per_node)]
    blocks = ["\n".join(f"#SBATCH {shlex.quote(line)}" for line in group) for group in groups]
    return "\n#SBATCH hetjob\n".join(blocks)


def _container_options(args: argparse.Namespace, run_dir: Path, workdir: Path) -> str:
    if not args.container_image:
        if args.container_mounts:
            raise ConfigError("--container-mounts: only with --container-image")
        return ""
    mounts = [m for m in (args.container_mounts or "").split(",") if m]
    sources = [m.split(":")[0] for m in mounts]
    for needed in (workdir, run_dir):  # the job works in the submit dir and writes the run dir
        if not any(str(needed) == s or str(needed).startswith(s.rstrip("/") + "/") for s in sources):
            mounts.append(f"{needed}:{needed}")
            sources.append(str(needed))
    opts = [f"--container-image={args.container_image}", f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={workdir}"]
    return " ".join(shlex.quote(o) for o in opts)


def render(template_name: str, values: dict[str, str]) -> str:
    """Fill ``{{name}}`` placeholders; an unknown or leftover placeholder is an error."""
    text = (TEMPLATE_DIR / template_name).read_text()

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise KeyError(f"slurm/{template_name}: no value for {{{{{name}}}}}")
        return values[name]

    out = re.sub(r"\{\{(\w+)\}\}", fill, text)
    if "{{" in out:
        raise ValueError(f"slurm/{template_name}: malformed placeholder near "
                         f"{out[out.index('{{'):][:40]!r}")
    return out


def build_script(cfg: Config, args: argparse.Namespace, layout: JobLayout, run_dir: Path,
                 config_copy: Path, workdir: Path) -> str:
    gpus = layout.gpus_per_node
    python = "python" if args.container_image else sys.executable
    model_path = args.model_path or cfg.run.init_from
    if args.model_path is None and cfg.run.init_from and layout.server != "local" and (
            megatron_layout.is_checkpoint(cfg.run.init_from)):
        raise ConfigError("--model-path: required: run.init_from is a Megatron checkpoint, and the "
                          "SGLang servers start from the Hugging Face directory it was converted "
                          "from (the trainer sends them its weights before the first rollout)")
    if model_path is None:
        raise ConfigError("--model-path: required when run.init_from is not set: the Hugging Face "
                          "directory the rollout servers start from (the trainer sends them its "
                          "weights before the first rollout; the architecture must match the "
                          "config's model section)")
    if (workdir / Path(model_path).expanduser()).exists():  # a local path, not a hub id
        model_path = str((workdir / Path(model_path).expanduser()).resolve())
        check_fp8_model_path(cfg, layout, Path(model_path))
    q = shlex.quote
    common = f"--nodes={layout.rollout_nodes} --ntasks-per-node={layout.server_tasks_per_node} --distribution=block"
    values = {
        "config": q(str(config_copy)),
        "run_dir": q(str(run_dir)),
        "python": q(python),
        "model_path": q(model_path),
        "omp_num_threads": "1" if gpus == 0 else "8",
        "health_timeout_s": str(args.health_timeout_s or default_health_timeout_s(layout)),
        "num_servers": str(layout.num_servers),
        "server_tasks_per_node": str(layout.server_tasks_per_node),
        "nodes_per_server": str(layout.nodes_per_server),
        "signal_before_s": str(args.signal_before_s),
        "sbatch_header": _sbatch_lines(args, layout, run_dir, args.job_name or f"gspo-{run_dir.name}",
                                       workdir),
        "container_options": _container_options(args, run_dir, workdir),
        "server_srun_options": common + " --overlap",
        "server_command": q(slurm_vllm.server_command(cfg, gpus_per_node=gpus,
                                                      gpu_binding=args.gpu_binding)
                            if layout.server == "vllm" else
                            server_command(layout, cfg.run.seed, layout.colocated,
                                           rollout=cfg.rollout, gpu_binding=args.gpu_binding,
                                           routed_experts=cfg.gspo.routing_replay == "rollout")),
        "router_command": q(ROUTER_COMMAND),
        "use_router": "1" if layout.uses_router else "0",
        "repo_env": (slurm_vllm.repo_export(bool(args.container_image))
                     if layout.server == "vllm" else "# (MGSPO_REPO: only vLLM servers read it)"),
        "train_rollout_args": TRAIN_ROLLOUT_ARGS[layout.uses_router],
        "train_srun_options": (f"--nodes={layout.train_nodes} "
                               f"--ntasks-per-node={layout.train_tasks_per_node} --distribution=block"
                               + (" --gpus-per-task=1" if gpus and args.gpu_binding == "task" else "")),
        "server_gpu_options": (f" --gpus-per-task={min(layout.server_tp, gpus)}"
                               if gpus and args.gpu_binding == "task" else ""),
        "train_env": train_env(cfg, layout, args),
        "server_health_env": server_health_env(),
        "site_env": site_env(args.env),
        "train_args": " --ignore-memory-plan" if args.ignore_memory_plan else "",
        "lib": (TEMPLATE_DIR / "lib.sh").read_text().rstrip("\n"),
    }
    template = "colocated.sbatch" if layout.colocated else "disaggregated.sbatch"
    return render(template, values)


TRAIN_ROLLOUT_ARGS = {
    True: '--set rollout.mode=external --set rollout.router_url="$ROUTER_URL"',
    False: ("--set rollout.mode=external --set rollout.router_url=null "
            '--set rollout.server_urls="$SERVER_URLS_JSON"'),
}
"""How the trainer reaches the job's servers: through the router, or (vLLM) the servers' list
(``SERVER_URLS_JSON``, filled by slurm/lib.sh ``server_urls``)."""


def default_health_timeout_s(layout: JobLayout) -> int:
    """``--health-timeout-s`` unless given: SGLang and vLLM load checkpoints (and capture CUDA
    graphs) for many minutes; the local server starts in seconds."""
    if layout.server == "vllm":
        return slurm_vllm.DEFAULT_HEALTH_TIMEOUT_S["cuda" if layout.gpus_per_node else "cpu"]
    return 1800 if layout.server == "sglang" else 300


def check_fp8_model_path(cfg: Config, layout: JobLayout, model_path: Path) -> None:
    """``rollout.quantization: fp8`` with SGLang: the servers start from an FP8 checkpoint in the
    layout the weight sync sends (``megatron_gspo.hf.fp8``); a bf16 one would be quantized
    online per tensor, which SGLang 0.5.23 cannot reload (its parameters are replaced, their
    loaders lost). Checked where the directory is readable from here."""
    if cfg.rollout.quantization is None or layout.server != "sglang":
        return
    problem = fp8.checkpoint_problem(model_path)
    if problem:
        raise ConfigError(f"--model-path: rollout.quantization {cfg.rollout.quantization} starts "
                          f"the SGLang servers from an FP8 checkpoint, but {problem}; make one "
                          f"with megatron-gspo convert hf-to-fp8 --hf {model_path} --out DIR (or "
                          "use the model's published -FP8 release) and pass --model-path DIR")


def train_env(cfg: Config, layout: JobLayout, args: argparse.Namespace) -> str:
    """Extra ``VAR=value`` entries of the training step's ``--export`` (a leading comma)."""
    env = []
    if layout.gpus_per_node and (cfg.parallel.tensor > 1 or cfg.parallel.context > 1):
        # Hopper: one hardware queue keeps TP/CP communication kernels ordered before compute
        # (Megatron's requirement with TP or CP overlap; slime and verl set it too)
        env.append("CUDA_DEVICE_MAX_CONNECTIONS=1")
    if layout.gpus_per_node and args.gpu_binding == "task":
        env.append("LOCAL_RANK=0")  # each task sees only its own GPU, as device 0
    if layout.gpus_per_node and ALLOC_CONF_NAME not in _env_names(args.env):
        # the caching allocator grows segments in place instead of fragmenting the GPU memory
        # with the per-step variable-length micro-batches (set it with --env to choose another)
        env.append(f"{ALLOC_CONF_NAME}={TRAIN_ALLOC_CONF}")
    return "".join("," + e for e in env)


ALLOC_CONF_NAME = "PYTORCH_CUDA_ALLOC_CONF"
TRAIN_ALLOC_CONF = "expandable_segments:True"
"""The training ranks' ``PYTORCH_CUDA_ALLOC_CONF`` on GPUs, unless ``--env`` names the variable
(its value, exported in every step, is then the one the ranks see). Not the servers': SGLang
manages its own memory pools."""


def _env_names(entries: list[str]) -> set[str]:
    return {entry.partition("=")[0] for entry in entries}


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def server_health_env() -> str:
    """The servers' health-check environment (``pipeline.local.health_env.LAUNCHER_ENV``:
    ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``), each variable kept where the submitting
    environment or ``--env`` sets it: SGLang's ``/health`` then answers while a weight sync
    pauses the servers, so the router never drops them, however long the sync (a disk reload
    takes minutes at 235B); docs/rollout.md, "The router during a weight sync"."""
    lines = ["# SGLang's /health answers without generating a token: a generation waits while a weight",
             "# sync pauses the servers, and the router would drop them all (docs/rollout.md)"]
    lines += [f"export {name}=${{{name}:-{value}}}" for name, value in LAUNCHER_ENV.items()]
    return "\n".join(lines)


def site_env(entries: list[str]) -> str:
    """``export`` lines for ``--env NAME=VALUE`` (the value as given) and ``--env NAME`` (the
    value of NAME where ``launch slurm`` runs), e.g. NCCL_IB_HCA, NCCL_SOCKET_IFNAME."""
    lines = []
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not _ENV_NAME.match(name):
            raise ConfigError(f"--env {entry!r}: expected NAME=VALUE or NAME (a shell variable name)")
        if not sep:
            if name not in os.environ:
                raise ConfigError(f"--env {name}: not set in this environment; pass {name}=VALUE")
            value = os.environ[name]
        lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) if lines else "# (none: pass launch slurm --env NAME=VALUE)"


def add_parser(subparsers) -> None:
    launch = subparsers.choices.get("launch") if hasattr(subparsers, "choices") else None
    if launch is None:
        launch = subparsers.add_parser(
            "launch", help="launch a GSPO job on a cluster scheduler (slurm)",
            description="Launch a GSPO job on a cluster scheduler.")
        launch.add_subparsers(dest="launcher", metavar="SCHEDULER", required=True)
    launchers = next(a for a in launch._actions if isinstance(a, argparse._SubParsersAction))
    p = launchers.add_parser(
        "slurm", help="rollout servers and training ranks as one Slurm job (sbatch)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--nodes", type=int, default=1, help="training nodes (default 1)")
    p.add_argument("--rollout-nodes", type=int, default=1,
                   help="rollout-server nodes, a separate het-job component; 0 = colocated: the "
                        "servers share the training nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node; 0 = CPU machines (local servers, gloo ranks) (default 0)")
    p.add_argument("--ntasks-per-node", type=int, default=None,
                   help="training ranks per node (default: --gpus-per-node; on CPU the smallest "
                        "world the parallel layout needs, spread over --nodes)")
    p.add_argument("--server", choices=("sglang", "vllm", "local"), default=None,
                   help="rollout server: sglang (python -m sglang.launch_server, GPUs), vllm "
                        "(vLLM 0.32's API server; rollout.engine: vllm) or local (megatron-gspo "
                        "serve, CPU) (default: vllm with rollout.engine vllm, else sglang with "
                        "GPUs, else local)")
    p.add_argument("--model-path", default=None, metavar="DIR",
                   help="Hugging Face directory (or hub id) the rollout servers start from "
                        "(default: run.init_from)")
    p.add_argument("--partition", default=None, help="Slurm partition (every component)")
    p.add_argument("--account", default=None, help="Slurm account (every component)")
    p.add_argument("--time", default=None, metavar="T",
                   help="time limit per (re)start, e.g. 4:00:00 (default: the partition's)")
    p.add_argument("--job-name", default=None, help="default: gspo-<run dir name>")
    p.add_argument("--signal-before-s", type=int, default=300, metavar="S",
                   help="SIGUSR1 this many seconds before the time limit: checkpoint and requeue "
                        "(default 300)")
    p.add_argument("--health-timeout-s", type=int, default=None, metavar="S",
                   help="bound on the wait for servers and router to be healthy "
                        "(default 1800 for SGLang and vLLM on GPUs, 600 for vLLM on CPUs, 300 "
                        "for local servers)")
    p.add_argument("--container-image", default=None, metavar="IMG",
                   help="run every step in this container (pyxis/enroot srun flags)")
    p.add_argument("--container-mounts", default=None, metavar="SRC:DST[,...]",
                   help="container mounts; the run dir and working directory are added if "
                        "not covered")
    p.add_argument("--gpu-binding", choices=("node", "task"), default="node",
                   help="node: every task sees all GPUs of its node (training rank r uses GPU "
                        "SLURM_LOCALID); task: the site binds each task its own GPU(s) "
                        "(--gpus-per-task; every task's first GPU is device 0) (default node)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="export this variable in every step of the job (repeatable), e.g. "
                        "--env NCCL_IB_HCA=mlx5 --env GLOO_SOCKET_IFNAME=ib0 --env "
                        "NCCL_SOCKET_IFNAME=ib0 (the interface the nodes reach each other on, "
                        "for gloo and NCCL) or --env PYTORCH_CUDA_ALLOC_CONF=... (instead of the "
                        "training ranks' default expandable_segments:True); without =VALUE the "
                        "value is taken from this shell")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory of one training GPU for the memory plan (default 80: H100)")
    p.add_argument("--ignore-memory-plan", action="store_true",
                   help="submit (and train) even when the memory plan says the layout does not "
                        "fit (megatron-gspo plan shows the breakdown)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the batch script and submit nothing")
    p.set_defaults(func=main)


def _submit(script: str, script_path: Path) -> Optional[str]:
    script_path.write_text(script)
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True,
                              text=True, timeout=120)
    except FileNotFoundError:
        print("megatron-gspo launch slurm: sbatch not found (is Slurm installed, SLURM_CONF set?)",
              file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"megatron-gspo launch slurm: sbatch failed (status {proc.returncode}):\n"
              f"{proc.stderr.strip()}", file=sys.stderr)
        return None
    return proc.stdout.strip().split(";")[0]


def main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_from_args(args)
    layout = plan_layout(cfg, args)
    weight_sync_reach.check_job(cfg, colocated=layout.colocated, train_nodes=layout.train_nodes,
                                server=layout.server)
    from launch import preflight

    # what train and sft would find at the job's start, found before it queues (exit 2)
    preflight.check(cfg, program="launch slurm", world_size=layout.world_size)
    workdir = Path.cwd().resolve()
    if layout.colocated and layout.gpus_per_node:
        raise ConfigError(
            "--rollout-nodes 0: colocated servers and trainers on GPUs are not supported yet (the "
            "trainer keeps weights, gradients and optimizer state on the GPU while the servers "
            "generate, and NCCL refuses two ranks on one GPU); give the servers nodes of their "
            "own (--rollout-nodes M > 0). Colocated jobs run on CPU machines (--gpus-per-node 0)")
    if layout.gpus_per_node:
        from megatron_gspo.plan import check_fits

        # the same plan `megatron-gspo plan` prints; train re-checks on the real GPUs
        plan = check_fits(cfg, layout.world_size, args.gpu_memory_gib,
                          proceed=args.ignore_memory_plan)
        print(f"# memory plan: {plan.verdict()}", file=sys.stderr)
    if layout.colocated and not cfg.rollout.colocated:
        raise ConfigError("rollout.colocated: must be true with --rollout-nodes 0 (the servers "
                          "share the training GPUs and must release their memory while the "
                          "trainer runs): add --set rollout.colocated=true")
    run_dir = (workdir / cfg.run.output_dir).resolve()
    config_copy = run_dir / "slurm" / "config.yaml"
    script = build_script(cfg, args, layout, run_dir, config_copy, workdir)
    if args.dry_run:
        print(script, end="")
        print(f"# dry run: {layout.describe()}; nothing submitted", file=sys.stderr)
        return 0

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_copy.parent.mkdir(parents=True, exist_ok=True)
    # the job's config: the file with the --set overrides applied and an absolute output dir
    job_cfg = load_config(args.config, [*args.overrides, f"run.output_dir={run_dir}"])
    config_copy.write_text(dump_config(job_cfg))
    job_id = _submit(script, run_dir / "slurm" / "job.sbatch")
    if job_id is None:
        return 1
    print(f"submitted job {job_id}: {layout.describe()}")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        print(f"the run resumes from the newest checkpoint in {run_dir / 'checkpoints'}")
    print(f"run dir: {run_dir}")
    print(f"logs: {run_dir}/logs/slurm-{job_id}.out and {run_dir}/logs/{job_id}-<restart>/")
    return 0
