"""The GPU path of issue 12 in one script: one GPU, CUDA + NCCL (world size 1), a few minutes.

    python bench/gpu_smoke.py                 # on a machine with one CUDA GPU
    python bench/gpu_smoke.py --device cpu    # the same checks on CPU / gloo (what the tests run)
    python bench/gpu_smoke.py --only sft_bf16_distributed_optimizer --only converted_checkpoint

Prints one line per check, ``PASS <check> (<seconds> s): <what it saw>`` or ``FAIL <check>:
<why>``, and ends with ``gpu_smoke: N/M checks passed on <device>``; exit status 0 iff all
passed. The checks, in order (each uses the project's real code paths, nothing re-implemented):

  environment                    torch / CUDA / device / megatron-core, the default process
                                 group's backend (cpu:gloo,cuda:nccl on a GPU)
  sft_bf16_distributed_optimizer SFTTrainer steps in bf16 with Megatron's distributed optimizer
                                 (CPU: float32 and the plain optimizer: Megatron's bf16 and
                                 distributed optimizers wrap CUDA tensors only); the loss falls
                                 and the parameters live on the device
  rl_train_rollout               RLTrainer.train_rollout on a real rollout batch: the trainer's
                                 initial weights exported, one local rollout server started from
                                 them with its model on the device (--device), and
                                 pipeline.sources.batch.rollout_phase samples and scores it
  checkpoint_exact_resume        RLTrainer.save, then a second trainer .load: its weights equal
                                 the saved ones bit for bit, and one more update from each gives
                                 bit-identical weights (torch deterministic algorithms on; on
                                 CUDA: within the noise of the non-deterministic kernels it names)
  converted_checkpoint           a tiny transformers Qwen3-MoE converted on the CPU
                                 (hf_to_mcore), loaded into the policy on the device: its
                                 log-probs equal transformers' (float32, 1e-4)
  train_command                  ``megatron-gspo train`` (local rollout server on the device, disk weight
                                 sync, 2 steps, a checkpoint each step), then ``--resume`` to a
                                 third step

What it does not cover: Transformer Engine (too large to carry: the local spec runs), SGLang
itself (the project's own rollout server answers SGLang's protocol, with its model on the same
GPU as the trainer: ``--device cuda``, ``rollout.local_server_device``), more than one GPU.

Preparing a machine without a package index (its Python 3.12 has torch and nothing else that
the checks need): on a machine with an index, fetch the exact wheel closure and copy it over::

    python bench/gpu_smoke.py --download bench/wheels     # CPython 3.12, manylinux x86_64
    # optional: --device-has freeze.txt (`pip list --format=freeze` on the GPU machine) leaves
    # out what that machine has as well; without it, torch and torch's own closure are left out

``--download`` resolves DEPENDENCIES (the project's ranges) with pip's resolver for that Python
and platform (``pip install --dry-run --report``: metadata only), drops torch's closure,
downloads those wheels (``pip download --no-deps``) and writes ``requirements.lock``
(``name==version --hash=sha256:...``). On the GPU machine the script installs from that directory
only (``pip install --no-index --no-deps --require-hashes --find-links DIR -r ...``; the
distributions the machine lacks, or all of them into ``--install-target DIR``) when a module does
not import; ``--install-only`` stops after that. Results of a GPU run belong in
docs/performance.md.

On CUDA, ``checkpoint_exact_resume`` names the kernels that are not deterministic (those PyTorch
warns about under ``use_deterministic_algorithms(True, warn_only=True)``, and
CUDA_NONDETERMINISTIC); if one more update is not bitwise, it compares with a second trainer
loaded from the same checkpoint (the kernels' noise) instead of failing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]

# module -> requirement (the project's ranges, pyproject.toml); the runtime dependencies that the
# checks import, and the serve extra (the local rollout server and the router)
DEPENDENCIES = {
    "megatron.core": "megatron-core==0.16.1",
    "yaml": "pyyaml>=6.0,<7",
    "transformers": "transformers>=4.57,<6",
    "tokenizers": "tokenizers",
    "safetensors": "safetensors>=0.5,<1",
    "numpy": "numpy>=1.26,<3",
    "psutil": "psutil>=5.9,<8",
    "tqdm": "tqdm>=4.66,<5",
    "math_verify": "math-verify>=0.8,<1",
    "aiohttp": "aiohttp>=3.9,<4",
    "tensorboard": "tensorboard>=2.16,<3",
    "fastapi": "fastapi>=0.110,<1",
    "uvicorn": "uvicorn>=0.29,<1",
    "sglang_router": "sglang-router==0.3.2",
}

# The wheel closure ``--download`` fetches: CPython 3.12 on linux x86_64, manylinux wheels only
# (the GPU image's Python; its glibc is at least 2.28), without what the GPU machine has already:
# torch and everything torch requires (its own dependency closure, read from the resolution).
PYTHON_VERSION = "3.12"
PLATFORMS = ([f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])
DEVICE_HAS = ("torch",)
LOCK = "requirements.lock"
"""In the wheel directory: ``name==version --hash=sha256:...`` per wheel, the exact closure."""


def _canonical(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _target_environment(python_version: str) -> dict:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython", "implementation_version": f"{python_version}.0",
            "platform_python_implementation": "CPython", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_release": "", "platform_version": "", "extra": ""}


def _requires(requires_dist, env: dict, extras=()) -> list[tuple[str, frozenset]]:
    """(canonical name, extras) of the requirements that apply in ``env`` with ``extras`` of
    the requiring distribution (torch asks for ``cuda-toolkit[cublas, ...]``, whose wheels come
    in through those extras' markers)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement
    out = []
    for line in requires_dist or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**env, "extra": extra})
                                     for extra in ("", *extras)):
            out.append((_canonical(req.name), frozenset(_canonical(e) for e in req.extras)))
    return out


def _pip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"gpu_smoke: pip {args[0]} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _platform_args(python_version: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def download_closure(dest: Path, *, python_version: str = PYTHON_VERSION,
                     device_has: Optional[Path] = None) -> list[tuple[str, str, int]]:
    """Resolve the dependency closure of :data:`DEPENDENCIES` for CPython ``python_version``
    on manylinux x86_64 (``pip install --dry-run --report``: the wheels' metadata, nothing
    installed), leave out torch and its own closure (and the distributions named in
    ``device_has``, a ``pip list --format=freeze`` of the GPU machine), download exactly those
    wheels (``pip download --no-deps``) into ``dest`` and write ``dest/requirements.lock``
    with their sha256. Returns [(name, version, bytes)]."""
    import hashlib

    dest.mkdir(parents=True, exist_ok=True)
    platform = _platform_args(python_version)
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_resolve_") as tmp:
        report = Path(tmp) / "report.json"
        _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
             "--target", str(Path(tmp) / "target"), *platform, *DEPENDENCIES.values())
        resolved = json.loads(report.read_text())["install"]
    env = _target_environment(python_version)
    items = {_canonical(i["metadata"]["name"]): i["metadata"] for i in resolved}
    excluded, seen = set(), set()
    todo = [(d, frozenset()) for d in DEVICE_HAS if d in items]
    while todo:  # torch's own closure: what the GPU machine's torch came with
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        excluded.add(name)
        todo += [(dep, dep_extras) for dep, dep_extras in
                 _requires(items[name].get("requires_dist"), env, extras) if dep in items]
    if device_has is not None:
        for line in device_has.read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                excluded.add(_canonical(line.split("==")[0].split(" @ ")[0].strip()))
    wanted = sorted((items[n]["name"], items[n]["version"]) for n in items if n not in excluded)
    _pip("download", "--no-deps", "--quiet", "-d", str(dest), *platform,
         *[f"{name}=={version}" for name, version in wanted])
    files = {}
    for wheel in dest.glob("*.whl"):
        parts = wheel.name.split("-")
        files[(_canonical(parts[0]), parts[1])] = wheel
    lines = [f"# gpu_smoke --download: CPython {python_version}, manylinux x86_64 wheels; "
             f"install with: pip install --no-index --no-deps --require-hashes --find-links "
             f"DIR -r {LOCK}",
             "# left out (the GPU machine has them, torch's closure"
             + (f" and {device_has.name}" if device_has else "") + "): "
             + " ".join(f"{items[n]['name']}=={items[n]['version']}" for n in sorted(excluded)
                        if n in items)]
    out = []
    for name, version in wanted:
        wheel = files.get((_canonical(name), version))
        if wheel is None:
            raise SystemExit(f"gpu_smoke: pip download did not fetch {name}=={version}")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        lines.append(f"{name}=={version} --hash=sha256:{digest}")
        out.append((name, version, wheel.stat().st_size))
    (dest / LOCK).write_text("\n".join(lines) + "\n")
    return out


def missing_modules() -> list[str]:
    import importlib.util

    out = []
    for module in DEPENDENCIES:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is absent
            found = False
        if not found:
            out.append(module)
    return out


def install_missing(wheels: Path, target: Optional[Path] = None) -> list[str]:
    """When a dependency does not import: install the wheel directory's exact closure
    (``requirements.lock``, written by ``--download``) from that directory only, ``--no-index
    --no-deps --require-hashes``: into ``target`` all of it, else the distributions this Python
    does not have (the ones it has, torch's among them, stay as they are). Returns the
    ``name==version`` installed."""
    import importlib.metadata

    missing = missing_modules()
    if not missing:
        return []
    lock = wheels / LOCK
    if not lock.is_file():
        raise SystemExit(f"gpu_smoke: missing {', '.join(DEPENDENCIES[m] for m in missing)} and no "
                         f"{lock} (run `python bench/gpu_smoke.py --download {wheels}` on a machine "
                         "with a package index, then copy the directory here)")
    wanted = []
    for line in lock.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name = line.split("==")[0]
        if target is None:
            try:
                importlib.metadata.distribution(name)
                continue  # this Python has it
            except importlib.metadata.PackageNotFoundError:
                pass
        wanted.append(line)
    if not wanted:
        return []
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_install_") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("\n".join(wanted) + "\n")
        args = ["install", "--no-index", "--no-deps", "--require-hashes", "--find-links",
                str(wheels), "-r", str(req)]
        if target is not None:
            args += ["--target", str(target)]
        _pip(*args)
    return [line.split(" ")[0] for line in wanted]


# ----------------------------------------------------------------------------------------------
# Shared pieces


def tiny_model(**overrides) -> dict:
    """A byte-level Qwen3-style MoE big enough to exercise the kernels, small enough for a CPU."""
    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 head_dim=32, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64,
                 vocab_size=256, make_vocab_size_divisible_by=8, max_position_embeddings=64,
                 rope_theta=10000.0)
    model.update(overrides)
    return model


def optimizer_classes(optimizer) -> str:
    """The class names of Megatron's optimizer: ``get_megatron_optimizer`` (megatron-core 0.16.1)
    returns a ``ChainedOptimizer`` over one optimizer per parameter group kind (dense / expert),
    each a ``DistributedOptimizer`` with ``use_distributed_optimizer``:
    "ChainedOptimizer[DistributedOptimizer, DistributedOptimizer]" -> its inner classes, joined
    with " + "; a single optimizer's own class name otherwise."""
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        return type(optimizer).__name__
    return " + ".join(optimizer_classes(o) for o in inner) or type(optimizer).__name__


def spread_reward(prompt, response_ids, response_text) -> float:
    """A reward that differs between the samples of a group (a function of the sampled ids)."""
    return float(sum(response_ids) % 7) / 6.0


# What in this check's path is not deterministic on CUDA, from reading the code it runs (local
# spec, one GPU, torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG
# set). Deterministic under those settings, so NOT listed: the MoE token dispatch's index_add_
# (megatron.core.transformer.moe.moe_utils.unpermute picks it over scatter_add_ when deterministic
# algorithms are on), index_select / gather backward, the log-prob kernel's scatter_add_
# (megatron_gspo/loss/logprobs.py), embedding backward, cuBLAS GEMMs (fixed workspace), and no
# NCCL reduction at world size 1.
CUDA_NONDETERMINISTIC = {
    "sdpa_flash_backward": "scaled_dot_product_attention's flash / memory-efficient backward "
                           "(megatron_gspo/model/attention.py _sdpa_causal): atomic adds into dQ; "
                           "PyTorch keeps the non-deterministic kernel with warn_only=True",
}


def _is_nondeterminism(message: str) -> bool:
    m = message.lower()
    return ("deterministic" in m and ("does not have a deterministic implementation" in m
                                      or "non-deterministic algorithm" in m
                                      or "nondeterministic" in m))


def _kernel_of(message: str) -> str:
    """The op PyTorch names in its warning ("<op> does not have a deterministic implementation,
    ..." / "Flash attention defaults to a non-deterministic algorithm. ...")."""
    first = message.strip().splitlines()[0] if message.strip() else message
    for cut in (" does not have a deterministic implementation", " defaults to a non-deterministic"):
        if cut in first:
            return first.split(cut)[0].strip()
    return first[:120]


def nondeterministic_kernels(warned: set, cuda: bool) -> str:
    """The kernels PyTorch warned about in this run, then (CUDA) the ones known from the code."""
    parts = [f"warned by PyTorch: {', '.join(sorted(warned))}"] if warned else []
    if cuda:
        parts.append("known in this path: " + "; ".join(CUDA_NONDETERMINISTIC.values()))
    return " | ".join(parts) or "none"


def _max_abs_diff(x: dict, y: dict) -> float:
    return max(float((x[n].double() - y[n].double()).abs().max()) for n in x)


class Smoke:
    """The checks; ``device`` is "cuda" or "cpu"."""

    def __init__(self, device: str, work: Path):
        self.device, self.work = device, work
        self.cuda = device == "cuda"
        self.rl_trainer = None  # made by rl_train_rollout, reused by checkpoint_exact_resume
        self.rl_batch = None

    # -- helpers ---------------------------------------------------------------------------
    def initialize(self, cfg):
        from megatron_gspo import parallel

        return parallel.initialize(cfg.parallel, seed=cfg.run.seed)

    def rl_config(self, run_dir: Path):
        from megatron_gspo.config import config_from_dict

        return config_from_dict({
            "model": tiny_model(params_dtype="bfloat16" if self.cuda else "float32"),
            "optim": {"lr": 1e-3, "use_distributed_optimizer": self.cuda, "adam_beta2": 0.98},
            "gspo": {"group_size": 4, "updates_per_rollout": 2},
            "rollout": {"max_new_tokens": 6, "deterministic": True},
            "run": {"seed": 11, "output_dir": str(run_dir), "global_batch_size": 16,
                    "micro_batch_size": 4, "seq_length": 16, "num_steps": 4},
            "data": {"task": "addition", "digits": 2, "num_eval_prompts": 8},
            # a random policy never adds correctly: every group's rewards would be equal and the
            # update zero; this reward spreads them (bench/gpu_smoke.py:spread_reward)
            "reward": {"kind": "function", "function": f"{Path(__file__).resolve()}:spread_reward"}})

    def check_device(self, module) -> str:
        where = next(module.parameters()).device.type
        if where != self.device:
            raise AssertionError(f"parameters on {where}, expected {self.device}")
        return where

    # -- the checks ------------------------------------------------------------------------
    def environment(self) -> str:
        import megatron.core
        import torch
        import torch.distributed as dist

        from megatron_gspo.model.gpt import transformer_engine_available
        from megatron_gspo.parallel import default_backend

        backend = dist.get_backend()
        expected = default_backend(self.cuda)
        if backend != expected:
            raise AssertionError(f"default group backend {backend!r}, expected {expected!r}")
        where = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if self.cuda
                 else "CPU")
        return (f"{where}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
                f"Transformer Engine {'yes' if transformer_engine_available() else 'no (local spec)'}, "
                f"default group {backend}")

    def sft_bf16_distributed_optimizer(self) -> str:
        from megatron_gspo import parallel
        from megatron_gspo.config import config_from_dict
        from megatron_gspo.train.sft import SFTTrainer
        from pipeline.scoring.tasks import PAD_ID

        # Megatron's bf16 optimizers wrap CUDA tensors only: float32 on CPU
        dtype = "bfloat16" if self.cuda else "float32"
        cfg = config_from_dict({
            "model": tiny_model(params_dtype=dtype),
            "optim": {"lr": 3e-3, "use_distributed_optimizer": self.cuda, "adam_beta2": 0.98},
            "run": {"seed": 3, "global_batch_size": 16, "micro_batch_size": 8, "seq_length": 16,
                    "num_steps": 12, "output_dir": str(self.work / "sft")}})
        pg = self.initialize(cfg)
        trainer = SFTTrainer(cfg, pg, pad_id=PAD_ID)
        self.check_device(trainer.gpt)
        optimizer = optimizer_classes(trainer.state.optimizer)
        if self.cuda and not all(name == "DistributedOptimizer" for name in optimizer.split(" + ")):
            raise AssertionError(f"optimizer {optimizer}, expected Megatron's DistributedOptimizer")
        pairs = []
        for i in range(16):
            a, b = (7 * i) % 50, (13 * i + 5) % 50
            pairs.append((list(f"{a}+{b}=".encode()), list(f"{a + b}\n".encode())))
        losses = [trainer.train_batch(pairs)["loss"] for _ in range(cfg.run.num_steps)]
        parallel.destroy_model_parallel()
        if not all(l == l for l in losses) or not losses[-1] < 0.7 * losses[0]:
            raise AssertionError(f"the loss did not fall: {losses}")
        return (f"{cfg.run.num_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                f"{dtype} weights, {optimizer}")

    def rl_train_rollout(self) -> str:
        import math

        from megatron_gspo.hf.export import export_hf_dir
        from megatron_gspo.train.rl_trainer import RLTrainer
        from pipeline.context import LoopContext
        from pipeline.signals import StopFlag
        from pipeline.sources.batch import rollout_phase
        from pipeline.scoring.data import PromptSampler, build_datasets
        from pipeline.observe.metrics import MetricsLogger
        from pipeline.scoring.rewards import build_reward
        from pipeline.generation.client import RolloutClient, http_json
        from pipeline.servers.cluster import LocalRolloutCluster
        from pipeline.scoring.tasks import write_byte_tokenizer

        run_dir = self.work / "rl"
        cfg = self.rl_config(run_dir)
        pg = self.initialize(cfg)
        trainer = RLTrainer(cfg, pg)
        self.check_device(trainer.gpt)
        hf_dir = export_hf_dir(trainer.gpt, cfg.model, pg, run_dir / "init_hf")
        write_byte_tokenizer(hf_dir)
        train_set, _ = build_datasets(cfg.data, seed=cfg.run.seed)
        with LocalRolloutCluster(hf_dir, 1, log_dir=run_dir / "logs", random_seed=cfg.run.seed,
                                 router=False, server_args=["--max-running-requests", "1",
                                                            "--device", self.device]) as cluster:
            client = RolloutClient(server_urls=list(cluster.server_urls))
            info = http_json("GET", cluster.server_urls[0] + "/server_info")[1]
            if info.get("device") != self.device:
                raise AssertionError(f"the rollout server runs on {info.get('device')}, "
                                     f"expected {self.device}")
            ctx = LoopContext(
                cfg=cfg, run_dir=str(run_dir), logger=MetricsLogger(run_dir, enabled=False),
                stop=StopFlag(), sampler=PromptSampler(train_set, seed=cfg.run.seed),
                reward_fn=build_reward(cfg.reward, cfg.data), client=client,
                decode=train_set.encoder.decode, stop_token_ids=[train_set.encoder.eos_id])
            batch, rollout_metrics = rollout_phase(ctx, 1)
        self.rl_batch = {k: v.clone() for k, v in batch.items()}
        metrics = trainer.train_rollout(batch, 1)
        for key in ("grad_norm", "entropy_mean", "rollout_trainer_logprob_abs_diff"):
            if not math.isfinite(float(metrics.get(key, float("nan")))):
                raise AssertionError(f"metric {key} = {metrics.get(key)}")
        if metrics["grad_norm"] <= 0:
            raise AssertionError("no gradient reached the optimizer")
        self.rl_trainer = trainer
        return (f"rollout server on {self.device}, {batch['tokens'].shape[0]} sampled rows, reward {rollout_metrics['reward_mean']:.3f}, "
                f"grad_norm {metrics['grad_norm']:.3g}, rollout/trainer |dlogp| "
                f"{metrics['rollout_trainer_logprob_abs_diff']:.2e}")

    def checkpoint_exact_resume(self) -> str:
        """The loaded weights equal the saved ones bit for bit, and one more update from each is
        bitwise on CPU. On CUDA some kernels of this path are not deterministic even with
        ``torch.use_deterministic_algorithms(True, warn_only=True)`` (PyTorch warns for each, and
        this check names them): then a second trainer loaded from the same checkpoint measures
        that kernel noise, and the saved-vs-loaded difference must be within it (a resume defect,
        e.g. the optimizer state not restored, gives a difference of the size of the update
        while two identical loaded states agree)."""
        import torch

        from megatron_gspo.train.rl_trainer import RLTrainer

        if self.rl_trainer is None:
            raise AssertionError("needs rl_train_rollout's trainer (run it first)")
        a = self.rl_trainer
        cfg, pg = a.cfg, a.pg
        path = a.save(self.work / "ckpt", 1, {"note": "gpu_smoke"})
        b = RLTrainer(cfg, pg)  # random weights of the same seed, a fresh optimizer
        state = b.load(path)
        if state.get("note") != "gpu_smoke":
            raise AssertionError(f"run state not restored: {state}")

        def weights(trainer):
            return {n: p.detach().clone() for n, p in trainer.gpt.named_parameters()}

        differ = [n for n, t in weights(a).items() if not torch.equal(t, weights(b)[n])]
        if differ:
            raise AssertionError(f"loaded weights differ from the saved ones: {differ[:3]}")
        saved = weights(a)
        kernels: set[str] = set()
        for trainer in (a, b):
            kernels |= self._update_once(trainer)
        wa, wb = weights(a), weights(b)
        worst = _max_abs_diff(wa, wb)
        named = nondeterministic_kernels(kernels, self.cuda)
        if worst == 0.0:
            return (f"{len(wa)} tensors bitwise after load and after one more update "
                    f"({path.name})" + (f"; PyTorch named non-deterministic kernels: {named}"
                                        if kernels else ""))
        if not self.cuda:
            raise AssertionError(f"one more update from the saved and the loaded state differs by "
                                 f"up to {worst:.3e} (optimizer state or RNG not restored, or a "
                                 "nondeterministic kernel)")
        # CUDA: the same update from the same loaded state once more: the kernels' own noise
        c = RLTrainer(cfg, pg)
        c.load(path)
        kernels |= self._update_once(c)
        noise = _max_abs_diff(wb, weights(c))
        update = _max_abs_diff(saved, wa)
        named = nondeterministic_kernels(kernels, self.cuda)
        if noise == 0.0 or worst > 10 * noise:
            raise AssertionError(
                f"one more update from the saved and the loaded state differs by up to {worst:.3e} "
                f"(the update itself: {update:.3e}) while two trainers loaded from the same "
                f"checkpoint differ by {noise:.3e} (the kernels' noise): the resume is not exact "
                f"(optimizer state or RNG not restored). Non-deterministic kernels: {named}")
        return (f"{len(wa)} tensors bitwise after load; one more update not bitwise on CUDA: "
                f"saved vs loaded {worst:.2e}, loaded vs loaded again {noise:.2e} (the same "
                f"order: kernel noise, not the resume; the update itself {update:.2e}). "
                f"Non-deterministic kernels: {named}")

    def _update_once(self, trainer) -> set[str]:
        """One update on the saved rollout batch; the kernels PyTorch warned about (with
        ``use_deterministic_algorithms(True, warn_only=True)``: those without a deterministic
        implementation)."""
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_rollout({k: v.clone() for k, v in self.rl_batch.items()}, 2)
        return {_kernel_of(str(w.message)) for w in caught if _is_nondeterminism(str(w.message))}

    def converted_checkpoint(self) -> str:
        import torch

        from megatron_gspo import parallel
        from megatron_gspo.config import ParallelConfig, config_from_dict
        from megatron_gspo.hf.convert import hf_to_mcore
        from megatron_gspo.hf.hf_config import model_config_from_hf
        from megatron_gspo.hf.mcore_checkpoint import load_model
        from megatron_gspo.model import gpt as policy
        from megatron_gspo.train.rl_loss import make_log_prob_fn
        from megatron_gspo.train.train_step import build_train_state, forward_backward
        from bench.hf_tiny import build_hf_model, hf_log_probs, random_batch, save_hf_model

        hf_model = build_hf_model("gqa2_untied", seed=5)
        hf_dir = save_hf_model(hf_model, self.work / "convert" / "hf")
        hf_to_mcore(hf_dir, self.work / "convert" / "mcore", progress=False)  # on the CPU
        model_cfg = model_config_from_hf(str(hf_dir))
        cfg = config_from_dict({"model": {f: getattr(model_cfg, f) for f in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
            "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "norm_topk_prob",
            "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings")}})
        pg = parallel.initialize(ParallelConfig(), seed=1)
        gpt = policy.build_model(cfg.model, cfg.parallel, pg)
        self.check_device(gpt)
        load_model(gpt, self.work / "convert" / "mcore")
        state = build_train_state(gpt, cfg, pg)
        batch = random_batch(cfg.model.vocab_size)
        mb = {k: v.clone() for k, v in batch.items()}
        forward_backward(state, [mb], make_log_prob_fn(cfg.model, pg), num_units_global=1,
                         forward_only=True)
        ours = mb["old_log_probs"].double().cpu()
        reference = hf_log_probs(hf_model, batch)
        parallel.destroy_model_parallel()
        err = float((ours - reference).abs().max())
        if not err <= 1e-4:
            raise AssertionError(f"max |log p - log p_transformers| = {err:.2e} > 1e-4")
        return f"converted on CPU, loaded on {self.device}: max |dlogp| vs transformers {err:.1e}"

    def train_command(self) -> str:
        run_dir = self.work / "train"
        base = [sys.executable, "-m", "launch.cli", "train", "--config", "launch/configs/tiny_cpu.yaml",
                "--nproc", "1", "--set", f"run.output_dir={run_dir}", "--set", "parallel.expert=1",
                "--set", "rollout.num_servers=1", "--set", "rollout.weight_sync.transport=disk",
                "--set", "run.global_batch_size=32", "--set", "run.eval_interval=0",
                "--set", "run.save_interval=1", "--set", "rollout.deterministic=true"]
        base += ["--set", f"rollout.local_server_device={self.device}"]
        if self.cuda:
            base += ["--set", "model.params_dtype=bfloat16",
                     "--set", "optim.use_distributed_optimizer=true"]
        # a fresh world of its own: not this process's rank variables (its port is taken)
        env = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        for steps, extra in ((2, []), (3, ["--resume"])):
            proc = subprocess.run([*base, "--set", f"run.num_steps={steps}", *extra], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise AssertionError(f"train (steps {steps} {extra}) exited {proc.returncode}:\n"
                                     f"{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = sorted({r["step"] for r in records if "train/grad_norm" in r})
        if steps != [1, 2, 3]:
            raise AssertionError(f"trained steps {steps}, expected [1, 2, 3]")
        syncs = [r for r in records if any(k.startswith("sync/") for k in r)]
        if len(syncs) < 3:
            raise AssertionError(f"{len(syncs)} weight syncs recorded, expected one per step")
        if "resumed from" not in proc.stdout + proc.stderr:
            raise AssertionError("the second run did not say it resumed")
        return (f"2 steps + checkpoints, --resume to step 3; disk weight sync every step to the "
                f"local server on {self.device}")


CHECKS = ["environment", "sft_bf16_distributed_optimizer", "rl_train_rollout",
          "checkpoint_exact_resume", "converted_checkpoint", "train_command"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", action="append", choices=CHECKS,
                        help="run only these checks (repeatable; default: all, in order)")
    parser.add_argument("--wheels", type=Path, default=Path(__file__).resolve().parent / "wheels",
                        help="directory of wheels to install missing dependencies from "
                             "(default: bench/wheels)")
    parser.add_argument("--list-missing", action="store_true",
                        help="print the distributions whose modules do not import, and exit")
    parser.add_argument("--download", type=Path, default=None, metavar="DIR",
                        help=f"on a machine with a package index: fetch the exact wheel closure "
                             f"for CPython {PYTHON_VERSION} / manylinux x86_64 (without torch and "
                             f"its dependencies) into DIR with DIR/{LOCK}, and exit")
    parser.add_argument("--device-has", type=Path, default=None, metavar="FILE",
                        help="with --download: also leave out the distributions in FILE (`pip "
                             "list --format=freeze` on the GPU machine)")
    parser.add_argument("--install-target", type=Path, default=None, metavar="DIR",
                        help="install the wheels into DIR (pip --target; put on sys.path and "
                             "PYTHONPATH) instead of this Python's environment")
    parser.add_argument("--install-only", action="store_true",
                        help="install what is missing from --wheels, and exit")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where the checks write (default: a temporary directory)")
    args = parser.parse_args(argv)
    if args.download is not None:
        wheels = download_closure(args.download, device_has=args.device_has)
        total = sum(size for _, _, size in wheels)
        print("\n".join(f"{name}=={version}  {size / 2**20:.2f} MiB"
                        for name, version, size in wheels))
        print(f"gpu_smoke: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.download} "
              f"({LOCK}); on the GPU machine: python bench/gpu_smoke.py --wheels "
              f"{args.download}", flush=True)
        return 0
    if args.install_target is not None:
        target = str(args.install_target.resolve())
        sys.path.insert(0, target)  # this process, and the servers / ranks it starts
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (target, os.environ.get("PYTHONPATH", "")) if p)
    if args.list_missing:
        print("\n".join(DEPENDENCIES[m] for m in missing_modules()) or "(nothing missing)")
        return 0
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    installed = install_missing(args.wheels, args.install_target)
    if installed:
        print(f"installed from {args.wheels}: {', '.join(installed)}", flush=True)
    if args.install_only:
        return 0
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (use --device cpu for the CPU run)", file=sys.stderr)
        return 2
    torch.use_deterministic_algorithms(True, warn_only=True)
    from pipeline.observe import benign_warnings
    from megatron_gspo import parallel

    benign_warnings.apply()
    parallel.init_distributed()
    passed, selected = 0, args.only or CHECKS
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        work = args.work_dir or Path(tmp)
        smoke = Smoke(args.device, work)
        for name in CHECKS:
            if name not in selected:
                continue
            start = time.monotonic()
            try:
                detail = getattr(smoke, name)()
                passed += 1
                print(f"PASS {name} ({time.monotonic() - start:.1f} s): {detail}", flush=True)
            except Exception as err:  # noqa: BLE001 - every check reports, the next one runs
                last = traceback.format_exception(err)[-1].strip()
                print(f"FAIL {name} ({time.monotonic() - start:.1f} s): {last}", flush=True)
                traceback.print_exc()
        parallel.destroy()
    print(f"gpu_smoke: {passed}/{len(selected)} checks passed on {args.device}", flush=True)
    return 0 if passed == len(selected) else 1


if __name__ == "__main__":
    sys.exit(main())
