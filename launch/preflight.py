"""Everything that can be checked before a run starts, checked before it starts.

``megatron-gspo config``, ``launch slurm``, ``sft`` and ``train`` call :func:`check` before they
start a rank, a server or a job; an error is ONE message naming the field or file (a
``ConfigError``, ``DataError``, ``RewardError`` or ``RunDirLocked``: exit status 2). What the file
alone decides (types, ranges, divisibility of the batch by the group size and by
``gspo.updates_per_rollout``, ...) was checked when it was loaded (``megatron_gspo.config``);
this module adds what needs the files, the world or the network:

========================================  ======  ======  ======  ============
check                                     config  train   sft     launch slurm
========================================  ======  ======  ======  ============
data files exist and parse (every row)    yes*    yes     yes     yes
``run.init_from`` exists                   yes*    yes     yes     yes
data-parallel split of a mini-batch       yes     yes     yes     yes
longest prompt + rollout.max_new_tokens   yes     yes     -       yes
the same within a packed micro-batch      yes     yes     -       yes
longest prompt + label (SFT rows)         -       -       yes     -
reward function / service configured      yes     yes     -       yes
``tools``: each tool and the environment   yes     yes     -       yes
import
``tools.isolation``: one sandbox worker    yes     yes     -       - (the job's ``train``
starts shut in                                                    checks it on its node)
external router reachable (5 s)           note    yes     -       - (the job starts its own)
external servers usable by the engine     -       yes     -       - (the job starts its own)
(``rollout.server_urls``, vLLM: the
router's workers; 5-30 s each)
run directory writable (probed)           -       yes     yes     yes
run directory not locked by a live run    -       yes     yes     yes
``--resume``: the checkpoint's model       -       yes     yes     -
``--resume``: the checkpoint's rollout     -       yes     yes     -
mode (``rollout.async``)
``run.loggers`` trackers (wandb, mlflow):  -       yes     yes     -
package, directory writable, W&B online
has an API key, MLflow server answers (5 s)
GPU-only limits (``validate_rl``)          -       yes     -       -
weight sync ``tensor``: every rank and    note    yes     -       yes
server on one node (``weight_sync_reach``)
apex wgrad kernel (with CUDA, when         -       yes     yes     -
``model.gradient_accumulation_fusion``)
========================================  ======  ======  ======  ============

``config`` (``*``) only notes an unreachable external router and input paths that do not exist on this
machine (``# note:`` lines, exit 0; the length checks, which read those files, are then skipped):
the file it validates is often meant for ``launch slurm`` on a cluster, whose job starts the
router itself and whose file system holds the data (the shipped recipes name placeholders).

Lengths are measured on the actual prompts (every row of ``data.train_path`` / ``eval_path``
through the configured tokenizer; the synthetic tasks' longest prompt is ``2 * data.digits + 2``
bytes). A training row holds ``run.seq_length + 1`` tokens (``train.batching.rl_batch``).

In a rank started by this project's own launcher the check already ran (in the launcher) and is
skipped (``launch.rank_status.supervised``); ranks started by srun or a torchrun of the user's
run it themselves, every rank alike.
"""

from __future__ import annotations

import json
import netrc
import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlsplit
from urllib.request import url2pathname

import torch

from launch import local, rank_status, weight_sync_reach
from launch.rl_session import validate_rl
from launch.run_lock import check_free
from megatron_gspo.config import Config, ConfigError, quantization_note, validate_data_parallel
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.safetensors_io import CheckpointError
from megatron_gspo.parallel import derive_layout
from megatron_gspo.train.batching import pack_tokens
from pipeline.engines.vllm import probe as vllm_probe
from pipeline.generation.client import RolloutError, http_json, router_workers
from pipeline.generation.multiturn import check_tools
from pipeline.observe.trackers import (MLflowTracker, WandbTracker, build_trackers,
                                       check_installed)
from pipeline.scoring.data import DataError, build_datasets
from pipeline.scoring.rewards import build_reward
from pipeline.scoring.tasks import TASKS
from pipeline.sources.base import check_resume as check_source_resume

Program = Literal["config", "train", "sft", "launch slurm"]
ROUTER_TIMEOUT_S = 5.0
"""How long an external router gets to answer before the run is refused."""


def missing_inputs(cfg: Config) -> list[tuple[str, str]]:
    """(field, path) of every input path the configuration names that does not exist here:
    ``run.init_from``, ``data.train_path``, ``data.eval_path``, ``data.tokenizer_dir``."""
    named = [("run.init_from", cfg.run.init_from), ("data.train_path", cfg.data.train_path),
             ("data.eval_path", cfg.data.eval_path), ("data.tokenizer_dir", cfg.data.tokenizer_dir)]
    return [(f, p) for f, p in named if p and not Path(p).exists()]


def check(cfg: Config, *, program: Program, world_size: Optional[int],
          notes: Optional[list[str]] = None) -> None:
    """Raise the first input error of ``cfg`` for ``program`` (see the module docstring).
    ``world_size``: the ranks the run will have (None: unknown, the split is not checked).
    ``notes`` (``config`` only): input paths missing on this machine (a recipe's placeholders, a
    cluster's file system) are appended there instead of raised, and the checks that read them
    are skipped; every other program refuses them."""
    if program in ("train", "sft"):
        check_gradient_accumulation_fusion(cfg)
        check_trackers(cfg)  # where the ranks run; a Slurm job's image may differ
    if program == "train":
        said = check_nccl_versions(cfg)
        if said:
            print(said, flush=True)
    missing = missing_inputs(cfg) if notes is not None else []
    if missing:
        notes.extend(f"{field}: {path} does not exist on this machine (train and launch slurm "
                     "refuse it; the checks that read it were skipped)" for field, path in missing)
    if not missing:
        _check_init_from(cfg)
    if world_size is not None:
        validate_data_parallel(cfg, derive_layout(cfg.parallel, world_size).data)
    if program in ("train", "sft", "launch slurm"):
        check_writable(cfg.run.output_dir)
        check_free(cfg.run.output_dir)
    if program == "train":
        validate_rl(cfg)
        weight_sync_reach.check_world(cfg)
    if program == "config" and notes is not None and cfg.rollout.weight_sync.transport == "tensor":
        notes.append(weight_sync_reach.CONFIG_NOTE)
    note = quantization_note(cfg.rollout, cfg.gspo)
    if note and program == "config" and notes is not None:
        notes.append(note)
    elif note and program == "train":
        print(note, flush=True)
    if program == "sft":
        _check_sft_lengths(cfg)
        return
    if not missing:
        _check_rl_lengths(cfg)

    build_reward(cfg.reward, cfg.data)  # imports a reward function; RewardError names it
    if cfg.tools.enabled():
        try:
            # imports the tools and the environment; starts one worker where the tools will run
            check_tools(cfg.tools, probe=program != "launch slurm")
        except ValueError as err:
            raise ConfigError(str(err)) from err
    if program == "train" and cfg.rollout.mode == "external":
        check_external(cfg)


def before_ranks(cfg: Config, *, program: Program, world_size: int, resume: bool) -> None:
    """``train`` / ``sft``: :func:`check` unless this process is a rank whose launcher already
    ran it; inside ranks started by srun or torchrun the world is theirs (WORLD_SIZE /
    SLURM_NTASKS), not the one this command would start. Also refuses a run directory that
    holds checkpoints without ``--resume`` (the ranks refuse it too), and with ``--resume`` a
    checkpoint of another model (:func:`check_resume`)."""
    if rank_status.supervised():
        return
    if local.is_launched():
        world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", world_size)))
    check(cfg, program=program, world_size=world_size)
    run_dir = Path(cfg.run.output_dir)
    if not resume and (run_dir / "checkpoints" / "latest").exists():
        raise ConfigError(f"run.output_dir: {run_dir} already holds checkpoints; pass --resume "
                          "to continue that run or choose another run.output_dir")
    if resume:
        check_resume(cfg)


def check_resume(cfg: Config) -> None:
    """``--resume``: the checkpoint the ranks would start from (the newest whose manifest reads;
    the ranks verify its checksums, and check again) must hold this config's model: a changed
    model field (``megatron_gspo.train.checkpoint.model_changes``: sizes, experts, vocabulary,
    ...) or a vocabulary this tensor parallelism pads differently is a ``ConfigError`` naming the
    fields and both values. A changed parallel layout is fine (the ranks reshard the checkpoint
    and say so); no checkpoint, or one written before checkpoints recorded their model, passes.
    Its run state must be one this ``rollout.async`` resumes exactly
    (:func:`check_rollout_resume`)."""
    from megatron_gspo.train.checkpoint import (  # imports Megatron
        optimizer_refusal, resume_candidate, resume_refusal)

    found = resume_candidate(cfg.run.output_dir)
    if found is None:
        return
    path, manifest = found
    refusal = (resume_refusal(path, manifest, cfg.model, cfg.parallel.tensor)
               or optimizer_refusal(path, manifest, cfg.optim.use_distributed_optimizer))
    if refusal is not None:
        raise ConfigError(refusal)
    check_rollout_resume(cfg, path)


def check_rollout_resume(cfg: Config, checkpoint: Path) -> None:
    """``--resume``: the checkpoint's ``run_state.json`` must be one that ``rollout.async``
    resumes exactly (``pipeline.sources.base.resume_refusal``: e.g. a ``full`` stream's groups
    are refused by the other modes); a ``ConfigError`` naming both modes, before any rank
    starts. A checkpoint without a readable ``run_state.json`` is left to the ranks."""
    try:
        run_state = json.loads((checkpoint / "run_state.json").read_text())
    except (OSError, ValueError):
        return
    check_source_resume(run_state, cfg.rollout.async_)


def check_writable(run_dir: str | os.PathLike, *, field: str = "run.output_dir",
                   source: str = "") -> None:
    """``run.output_dir`` (or the directory ``field`` names; ``source``: where its value came
    from, e.g. `` (from WANDB_DIR)``) must be a directory this process can create files in (or
    one it can create): probed by creating and removing a file in it (or a directory in its
    nearest existing parent), since permission bits do not stop root and a read-only mount only
    shows when written to. Leaves nothing behind."""
    path = Path(run_dir)
    probe_in = path
    while not probe_in.exists():
        if probe_in.parent == probe_in:
            break
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        what = "is" if probe_in == path else f"is under {probe_in}, which is"
        raise ConfigError(f"{field}: {path}{source} {what} not a directory; choose another "
                          f"{field}")
    try:
        if probe_in == path:
            fd, name = tempfile.mkstemp(prefix=".write-probe-", dir=probe_in)
            os.close(fd)
            os.unlink(name)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=probe_in))
    except OSError as err:
        where = "" if probe_in == path else f" (it would be created in {probe_in})"
        raise ConfigError(f"{field}: {path}{source} is not writable{where}: "
                          f"{err.strerror or err}; choose a writable {field}") from None


TRACKER_TIMEOUT_S = 5.0
"""How long an MLflow tracking server gets to answer before the run is refused."""
WANDB_ONLINE_MODES = ("online", "run", "shared")
"""W&B modes that upload while the run goes (and need an API key)."""


def _origin(field: str, value: Optional[str], env: str) -> tuple[str, str]:
    """(the field to name, where its value came from) for a setting read from the field, else
    from the environment variable ``env``."""
    return (field, "") if value else (field, f" (from {env}, {field} unset)")


def check_trackers(cfg: Config) -> None:
    """``run.loggers``' W&B and MLflow, as far as they can be checked without opening a run
    (which would create one): each package imports (else the extra to install); the directory
    each writes to can be written; W&B online has an API key; an MLflow tracking server answers
    within :data:`TRACKER_TIMEOUT_S`. Each a ConfigError naming the field."""
    check_installed(cfg.run.loggers)
    run_dir = Path(cfg.run.output_dir)
    for tracker in build_trackers(cfg.run, run_dir):
        if isinstance(tracker, WandbTracker):
            _check_wandb(cfg, tracker, run_dir)
        elif isinstance(tracker, MLflowTracker):
            _check_mlflow(cfg, tracker, run_dir)


def _check_wandb(cfg: Config, tracker: WandbTracker, run_dir: Path) -> None:
    settings = cfg.run.wandb
    if tracker.dir != run_dir:  # run.output_dir is checked on its own
        check_writable(tracker.dir, field="run.wandb.dir",
                       source=_origin("run.wandb.dir", settings.dir, "WANDB_DIR")[1])
    mode = tracker.mode or os.environ.get("WANDB_MODE", "")
    if mode not in WANDB_ONLINE_MODES or wandb_api_key_found():
        return
    field, source = _origin("run.wandb.mode", settings.mode, "WANDB_MODE")
    raise ConfigError(
        f"{field}: {mode}{source} uploads while the run goes and needs a W&B API key, and none "
        "is set here (WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes); run `wandb "
        "login` or set WANDB_API_KEY where the ranks run, or set run.wandb.mode: offline (then "
        "`wandb sync` the run's wandb/ directory)")


def wandb_api_key_found(environ=None) -> bool:
    """Whether W&B would find an API key: ``WANDB_API_KEY`` (or an identity token file), else a
    netrc entry (``NETRC``, else ~/.netrc) for the host of ``WANDB_BASE_URL``
    (https://api.wandb.ai by default), as ``wandb login`` writes it."""
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _check_mlflow(cfg: Config, tracker: MLflowTracker, run_dir: Path) -> None:
    uri = tracker.tracking_uri
    field, source = _origin("run.mlflow.tracking_uri", cfg.run.mlflow.tracking_uri,
                            "MLFLOW_TRACKING_URI")
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):  # a file store: a directory
        path = Path(url2pathname(parts.path) if parts.scheme else uri)
        if path != (run_dir / "mlruns").resolve():  # run.output_dir is checked on its own
            check_writable(path, field=field, source=source)
    elif parts.scheme == "sqlite":  # sqlite:///relative.db, sqlite:////absolute.db
        database = Path(uri.split("://", 1)[1][1:] or ".")
        check_writable(database.parent, field=field, source=f" ({uri}){source}")
    elif parts.scheme in ("http", "https"):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=TRACKER_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            return  # it answered: a server is there (its API is MLflow's to judge)
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", None) or err
            raise ConfigError(
                f"{field}: {uri}{source} does not answer within {TRACKER_TIMEOUT_S:.0f} s "
                f"({reason}); start the MLflow tracking server first, fix the URI, or leave "
                "it unset for the offline file store in run.output_dir/mlruns") from None


GRAD_ACCUM_FUSION_MODULE = "fused_weight_gradient_mlp_cuda"
"""apex's CUDA extension that megatron-core's own linear layers (the output layer, which is not a
Transformer Engine module) call for ``gradient_accumulation_fusion``: megatron-core 0.16.1 imports
it in ``tensor_parallel/layers.py`` and raises in ``ColumnParallelLinear`` when it is missing,
i.e. only once the model is being built on every rank."""


def check_gradient_accumulation_fusion(cfg: Config) -> None:
    """``model.gradient_accumulation_fusion`` on a CUDA machine needs apex's
    ``fused_weight_gradient_mlp_cuda`` (without CUDA the field is refused as GPU-only when the
    model is built)."""
    if not cfg.model.gradient_accumulation_fusion:
        return

    if not torch.cuda.is_available():
        return
    try:
        __import__(GRAD_ACCUM_FUSION_MODULE)
    except ImportError as err:
        raise ConfigError(
            f"model.gradient_accumulation_fusion: true needs apex's {GRAD_ACCUM_FUSION_MODULE} "
            "CUDA extension (Megatron's output layer fuses its weight-gradient GEMM with it), "
            f"which does not import here ({err}); install apex with --cpp_ext --cuda_ext (in an "
            "apex checkout: APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation ., "
            "as slurm/Dockerfile does), or set model.gradient_accumulation_fusion: false") from None


NCCL_VERSION_CODE = ("import torch, sys; v = torch.cuda.nccl.version() if torch.cuda.is_available() "
                     "else None; sys.stdout.write('.'.join(map(str, v)) if v else 'none')")
"""What the SGLang interpreter runs to report the NCCL its torch bundles."""


def nccl_version_of(python: str, *, timeout_s: float = 120.0) -> Optional[str]:
    """The NCCL version (``"2.27.3"``) of the torch that ``python`` imports; None if that torch
    sees no CUDA. Raises ConfigError naming ``python`` when it cannot be asked."""
    try:
        proc = subprocess.run([python, "-c", NCCL_VERSION_CODE], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"MGSPO_SGLANG_PYTHON: {python}: cannot ask it for its NCCL version "
                          f"({type(err).__name__}: {err})") from None
    if proc.returncode != 0:
        raise ConfigError(f"MGSPO_SGLANG_PYTHON: {python}: asking it for its NCCL version failed "
                          f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    out = proc.stdout.strip()
    return None if out == "none" else out


def check_nccl_versions(cfg: Config, *, trainer_version: Optional[str] = None,
                        sglang_python: Optional[str] = None) -> Optional[str]:
    """``rollout.weight_sync.transport: distributed``: the trainer's and the SGLang servers' NCCL
    must match (major.minor): every update group has both in one communicator, and mismatched
    NCCL versions there fail or hang at its first init, after the servers have loaded. The servers' version is
    that of ``MGSPO_SGLANG_PYTHON``'s torch (the interpreter ``launch slurm`` starts SGLang with;
    slurm/Dockerfile gives SGLang its own environment). Returns a note (what was compared, or
    why nothing could be) for the console; raises ConfigError on a mismatch. ``trainer_version``
    / ``sglang_python``: this process's / the environment's when None."""
    if cfg.rollout.weight_sync.transport != "distributed":
        return None
    if trainer_version is None:
        if not torch.cuda.is_available():
            return None  # gloo on the CPU: no NCCL on either side
        trainer_version = ".".join(map(str, torch.cuda.nccl.version()))
    python = sglang_python or os.environ.get("MGSPO_SGLANG_PYTHON")
    if not python:
        return (f"weight sync: trainer NCCL {trainer_version}; the SGLang servers' NCCL is not "
                "checked (MGSPO_SGLANG_PYTHON is unset: it must be the same major.minor)")
    served = nccl_version_of(python)
    if served is None:
        return (f"weight sync: trainer NCCL {trainer_version}; {python}'s torch sees no CUDA here, "
                "its NCCL is not checked")
    if served.split(".")[:2] != trainer_version.split(".")[:2]:
        raise ConfigError(
            f"rollout.weight_sync.transport: distributed puts the trainer (NCCL {trainer_version}) "
            f"and the SGLang servers ({python}: NCCL {served}) in one NCCL communicator per "
            "update group, and NCCL versions that differ there fail or hang at its init; install "
            "the same nvidia-nccl version in both environments (pip install "
            f"nvidia-nccl-cu12=={trainer_version} in the SGLang one, or the other way round), or "
            "use rollout.weight_sync.transport: disk")
    return f"weight sync: NCCL {trainer_version} on the trainer, {served} on the SGLang servers"


def _check_init_from(cfg: Config) -> None:
    init = cfg.run.init_from
    if init is not None and not Path(init).exists():
        raise ConfigError(f"run.init_from: {init} does not exist (a Hugging Face directory or a "
                          "Megatron checkpoint; null starts from random weights)")
    if init is not None and megatron_layout.is_checkpoint(init):
        try:  # a Megatron-LM / Bridge root must name a checkpoint that is there
            megatron_layout.resolve(init)
        except CheckpointError as err:
            raise ConfigError(f"run.init_from: {err}") from None


def _scan(cfg: Config, *, sft: bool) -> Optional[tuple[int, str]]:
    """The longest row (prompt only, or prompt + label + end token with ``sft``) of the data
    files, as (tokens, "file:line"); None for a synthetic task."""
    if cfg.data.task is not None:
        return None

    longest: Optional[tuple[int, str]] = None
    for dataset in build_datasets(cfg.data, seed=cfg.run.seed):
        if dataset is None:
            continue
        encoder = dataset.encoder
        for i in range(len(dataset)):
            prompt = dataset[i]
            tokens = len(prompt.prompt_ids)
            if sft:
                if prompt.label is None:
                    raise DataError(f"{prompt.origin}: no label: SFT trains on data.label_key as "
                                    "the response")
                tokens += len(encoder.encode_text(prompt.label)) + 1
            if longest is None or tokens > longest[0]:
                longest = (tokens, prompt.origin)
    return longest


def _task_name(cfg: Config) -> str:
    return f"data.task {cfg.data.task} with data.digits {cfg.data.digits}"


def _check_rl_lengths(cfg: Config) -> None:
    new, length = cfg.rollout.max_new_tokens, cfg.run.seq_length
    if cfg.data.task is not None:
        tokens, where = 2 * cfg.data.digits + 2, _task_name(cfg)
    else:
        tokens, where = _scan(cfg, sft=False)
    if tokens + new > length + 1:
        raise ConfigError(
            f"run.seq_length: the longest prompt ({where}, {tokens} tokens) + "
            f"rollout.max_new_tokens {new} = {tokens + new} tokens do not fit a training row of "
            f"run.seq_length {length} + 1 tokens; raise run.seq_length to {tokens + new - 1} or "
            "lower rollout.max_new_tokens (or shorten the prompts)")
    _check_token_budget(cfg, tokens, where)


def _check_token_budget(cfg: Config, prompt_tokens: int, where: str) -> None:
    """``run.max_tokens_per_micro_batch`` must hold the longest sequence an update can see, once
    padded as a packed micro-batch pads it (``train.batching.plan_micro_batches`` refuses a
    longer one mid-run): prompt + response - 1 label positions (``train.batching.rl_batch``'s
    ``lengths``), at most run.seq_length."""
    budget = cfg.run.max_tokens_per_micro_batch
    if budget is None:
        return

    cp, tp, new = cfg.parallel.context, cfg.parallel.tensor, cfg.rollout.max_new_tokens
    longest = min(prompt_tokens + new - 1, cfg.run.seq_length)
    per_rank = pack_tokens([longest], cp, tp) // cp
    if per_rank > budget:
        padded = f", {per_rank} per context-parallel rank once padded for cp={cp}, tp={tp}" \
            if per_rank != longest else ""
        raise ConfigError(
            f"run.max_tokens_per_micro_batch: {budget} tokens cannot hold the longest sequence: "
            f"the longest prompt ({where}, {prompt_tokens} tokens) + rollout.max_new_tokens "
            f"{new} makes {longest} positions to train on (prompt + response - 1, at most "
            f"run.seq_length {cfg.run.seq_length}{padded}); raise "
            f"run.max_tokens_per_micro_batch to at least {per_rank} or lower "
            "rollout.max_new_tokens")


def _check_sft_lengths(cfg: Config) -> None:
    length = cfg.run.seq_length
    if cfg.data.task is not None:
        tokens = TASKS[cfg.data.task](digits=cfg.data.digits).max_length()
        where = _task_name(cfg)
    else:
        tokens, where = _scan(cfg, sft=True)
    if tokens > length + 1:
        raise ConfigError(
            f"run.seq_length: the longest SFT example ({where}: prompt + response + end token = "
            f"{tokens} tokens) does not fit a training row of run.seq_length {length} + 1 "
            f"tokens; raise run.seq_length to {tokens - 1}")


def check_reachable(urls: list[str], cfg: Config, *, field: str) -> Optional[str]:
    """SGLang servers named by ``rollout.server_urls``: each answers ``/health`` (any HTTP
    status) within :data:`ROUTER_TIMEOUT_S`; the message naming ``field``, or None."""
    for url in urls:
        try:
            http_json("GET", url.rstrip("/") + "/health", timeout_s=ROUTER_TIMEOUT_S)
        except RolloutError as err:
            return (f"{field}: {url} is not reachable within {ROUTER_TIMEOUT_S:.0f} s "
                    f"({err.message}); start the server first, or fix the URL")
    return None


SERVER_CHECKS = {"sglang": (check_reachable, False), "vllm": (vllm_probe.check_servers, True)}
"""Per ``rollout.engine``: what an external run checks of each server, and whether it also checks
the workers a router lists (vLLM's are used directly: ``pipeline.engines.vllm.probe``)."""

def check_external(cfg: Config) -> None:
    """``rollout.mode: external``: the router answers; the servers (``rollout.server_urls``, or
    the router's workers where the engine's check or the ``tensor`` transport needs them) pass
    the engine's check (:data:`SERVER_CHECKS`) and, with ``tensor``, share this node."""
    rollout = cfg.rollout
    if rollout.router_url:
        check_router(rollout.router_url)
    check, of_router_workers = SERVER_CHECKS[rollout.engine]
    tensor = rollout.weight_sync.transport == "tensor"
    if rollout.server_urls:
        field, urls = "rollout.server_urls", list(rollout.server_urls)
    elif of_router_workers or tensor:
        field = "rollout.router_url"
        try:
            urls = [w["url"] for w in router_workers(rollout.router_url)]
        except RolloutError as err:
            raise ConfigError(f"rollout.router_url: {rollout.router_url} does not list its "
                              f"workers ({err.message}), which rollout.engine "
                              f"{rollout.engine} / rollout.weight_sync.transport "
                              f"{rollout.weight_sync.transport} need") from None
        if not urls:
            raise ConfigError(f"rollout.router_url: {rollout.router_url} lists no workers")
    else:
        return
    if rollout.server_urls or of_router_workers:
        problem = check(urls, cfg, field=field)
        if problem:
            raise ConfigError(problem)
    if tensor:
        weight_sync_reach.check_servers(cfg, urls)


def check_router(url: str) -> None:
    """An external router must answer (any HTTP status) within :data:`ROUTER_TIMEOUT_S`."""
    try:
        http_json("GET", url.rstrip("/") + "/health", timeout_s=ROUTER_TIMEOUT_S)
    except RolloutError as err:
        raise ConfigError(f"rollout.router_url: {url} is not reachable within "
                          f"{ROUTER_TIMEOUT_S:.0f} s ({err.message}); start the router first, or "
                          "fix the URL") from None
