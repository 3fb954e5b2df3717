"""The vLLM rollout servers of a ``launch slurm`` job (``rollout.engine: vllm``, ``--server vllm``).

The job places, starts, health-checks, logs and stops them exactly as it does SGLang servers
(``launch.slurm``: server ``i`` listens on ``MGSPO_SERVER_PORT0 + 2 i``, seeds ``run.seed + i``,
``<log dir>/server-task<t>.log``, the same ``/health`` wait, the same stop and requeue). What
differs, rendered here:

* the command line: ``pipeline.engines.vllm.server_args`` (vLLM 0.32's own flags, checked with
  its parser: tests/slurm/test_vllm_cli.py) run by ``${MGSPO_VLLM_PYTHON:-$MGSPO_PYTHON}``
  (vLLM pins its own torch: the GPU image installs it in a virtual environment of its own,
  ``slurm/Dockerfile``), with the environment it needs (``VLLM_SERVER_DEV_MODE=1`` ...) exported
  in the task;
* the worker extension (``pipeline.engines.vllm.worker_extension``) is imported by vLLM's
  interpreter from ``$MGSPO_REPO``, a directory holding the project's ``pipeline`` package and
  nothing else of a Python environment: the source checkout ``launch slurm`` runs from (rendered),
  or, in a container, the image's copy (``ENV MGSPO_REPO=/opt/megatron-gspo`` in
  ``slurm/Dockerfile``);
* GPUs: with ``--gpu-binding node`` server ``k`` of a node gets ``CUDA_VISIBLE_DEVICES`` = its
  ``rollout.tp_size`` GPUs from ``k x tp`` (vLLM has no ``--base-gpu-id``); with ``task`` the
  site's binding is used as it is;
* no router: sglang-router 0.3.2 cannot route vLLM's token-in/token-out generate (404 on
  ``/inference/v1/generate``, 422 on token-id ``/v1/completions``: measured with both real
  programs, docs/rollout.md "vLLM servers"); the trainer gets the servers' list
  (``--set rollout.server_urls=[...]``) and its client routes over them itself, sticky for
  multi-turn, retrying elsewhere when one dies;
* a server spanning nodes (``rollout.tp_size`` > ``--gpus-per-node``) is refused: vLLM's
  multi-node start (``--nnodes``/``--node-rank`` with ``--headless`` followers) is ``vllm serve``'s,
  not the API-server module's this project starts (the CPU build's ``vllm`` script is broken).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from megatron_gspo.config import Config, ConfigError
from pipeline.engines.vllm import server_args as sa
from pipeline.engines.vllm.client import SERVER_FLAGS

ROOT = Path(__file__).resolve().parents[1]
PYTHON = '"${MGSPO_VLLM_PYTHON:-$MGSPO_PYTHON}"'
DEFAULT_HEALTH_TIMEOUT_S = {"cuda": 1800, "cpu": 600}
"""The wait for every vLLM server's ``/health``: a GPU server loads its checkpoint and captures
CUDA graphs; the CPU build takes 60-120 s of imports alone on a busy machine."""


def check_layout(cfg: Config, *, gpus_per_node: int) -> None:
    """What a job of vLLM servers cannot be (ConfigError naming the field or option)."""
    if cfg.rollout.engine != "vllm":
        raise ConfigError(f"--server vllm: the trainer speaks rollout.engine "
                          f"{cfg.rollout.engine}'s API; set rollout.engine: vllm")
    tp = cfg.rollout.tp_size
    if gpus_per_node == 0 and tp != 1:
        raise ConfigError(f"rollout.tp_size: {tp}: vLLM servers on CPU machines "
                          "(--gpus-per-node 0) run one process each; set it to 1")
    if gpus_per_node and tp > gpus_per_node:
        raise ConfigError(f"rollout.tp_size: {tp} > --gpus-per-node {gpus_per_node}: a vLLM "
                          "server spanning nodes is not supported by launch slurm (vLLM starts "
                          "those with vllm serve --headless followers); use rollout.tp_size <= "
                          f"{gpus_per_node}")
    sa.check_supported(cfg, "cuda" if gpus_per_node else "cpu")


def repo_export(container: bool) -> str:
    """The job's ``MGSPO_REPO`` line (module docstring): in a container the image's; else this
    source checkout's, unless the submitting environment names one."""
    if container:
        return ("# MGSPO_REPO: the project's source directory in the image (slurm/Dockerfile "
                "sets it); vLLM imports its worker extension from there")
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "pipeline").is_dir():
        raise ConfigError(f"--env MGSPO_REPO=DIR: required: {ROOT} is no source checkout of the "
                          "project, and vLLM's interpreter imports the project's worker "
                          "extension from DIR/pipeline (put nothing else of an environment there)")
    return f"export MGSPO_REPO=${{MGSPO_REPO:-{shlex.quote(str(ROOT))}}}"


def server_command(cfg: Config, *, gpus_per_node: int, gpu_binding: str) -> str:
    """The ``bash -c`` body every vLLM server task runs (one task per server); $-variables
    expand in the task."""
    device: sa.Device = "cuda" if gpus_per_node else "cpu"
    lines = ["i=$SLURM_PROCID"]
    env = sa.server_env(cfg, device=device, repo_root=sa.Shell("$MGSPO_REPO"))
    for name, value in env.items():
        if name == "PYTHONPATH":  # the repository first, the task's own path after it
            lines.append('export PYTHONPATH="$MGSPO_REPO${PYTHONPATH:+:$PYTHONPATH}"')
        else:
            lines.append(f"export {name}={shlex.quote(value)}")
    tp = cfg.rollout.tp_size
    if gpus_per_node and gpu_binding == "node":
        first = f"$((SLURM_LOCALID * {tp}))"
        lines.append(f"export CUDA_VISIBLE_DEVICES=$(seq -s, {first} $(({first} + {tp - 1})))")
    argv = sa.server_argv(cfg, model_path=sa.Shell('"$MGSPO_MODEL_PATH"'),
                          port=sa.Shell("$((MGSPO_SERVER_PORT0 + 2 * i))"),
                          seed=sa.Shell(f"$(({cfg.run.seed} + i))"), device=device,
                          extra=SERVER_FLAGS)
    lines.append("exec " + sa.shell_command(sa.command(sa.Shell(PYTHON), argv)))
    return "; ".join(lines)
