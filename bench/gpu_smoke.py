"""The stack users run, on the one lent GPU, in one script: a few minutes, world size 1.

    python bench/gpu_smoke.py --fetch-wheels bench/wheels   # here (a package index): the wheels
    python bench/gpu_smoke.py --device cpu                  # here: the same checks on CPU / gloo

**The device command** (the device tool's ``run``; its machine has Python 3.12, torch 2.11 for
CUDA 13, no megatron-core, Transformer Engine, SGLang or vLLM, and no network)::

    run(carry=["bench/wheels"], timeout_s=540,
        command="python3 bench/gpu_smoke.py --wheels bench/wheels --install-target /tmp/gs_site")

It installs the carried closure (``bench/smoke_wheels.py``: megatron-core 0.19.2 and what the
project needs beyond torch, pinned by sha256, offline) into ``/tmp/gs_site``, then runs every
check. Results of a GPU run belong in docs/gpu_path.md.

Prints one line per check, ``PASS <check> (<seconds> s): <what it saw>``, ``SKIP <check>: <why>``
or ``FAIL <check>: <why>``, and ends with ``gpu_smoke: N/M checks passed on <device>`` (and the
skips); exit status 0 iff none failed. The checks, in order (each the project's real code path):

  environment                    torch / CUDA / device / megatron-core (0.19.2 on Python 3.12), the
                                 default group's backend (cpu:gloo,cuda:nccl on a GPU: NCCL at
                                 world size 1)
  sft_bf16_distributed_optimizer SFTTrainer steps in bf16 with Megatron's distributed optimizer,
                                 overlapped gradient reduce and parameter gather (CPU: float32,
                                 the same optimizer: docs/cpu_accommodations.md 9); the loss falls
  rl_update_and_weight_sync      the trainer's initial weights exported, the project's rollout
                                 server started from them on the same device; a rollout batch
                                 (pipeline.sources.batch.rollout_phase), one GSPO step of RLTrainer
                                 with THD packing (run.max_tokens_per_micro_batch), bf16, the
                                 distributed optimizer with overlap_param_gather and
                                 gspo.routing_metrics off (no forward after the last update); then
                                 the weight sync (WeightPusher, transport ``tensor``: CUDA-IPC
                                 handles on the same GPU; the server reports each bucket's
                                 checksum) and issue 37 item 2's check: the bytes pushed equal
                                 the weights after Megatron's forced parameter gather
  checkpoint_exact_resume        RLTrainer.save, then a second trainer .load: its weights equal
                                 the saved ones bit for bit, and one more update from each gives
                                 bit-identical weights (torch deterministic algorithms on; on
                                 CUDA: within the noise of the non-deterministic kernels it names)
  converted_checkpoint           a tiny transformers Qwen3-MoE converted on the CPU
                                 (hf_to_mcore), loaded into the policy on the device: its
                                 log-probs equal transformers' (float32, 1e-4)
  train_command                  ``megatron-gspo train`` (the command line: its own rollout server
                                 on the device and the sglang-router, disk weight sync, 2 steps,
                                 a checkpoint each step), then ``--resume`` to a third step;
                                 skipped, saying so, where sglang-router is not installed (its
                                 29 MiB wheel does not fit the device's 64 MiB carry with the rest)

**What one GPU cannot show, and where it is checked instead.** NCCL refuses two ranks of one
communicator on the same GPU ("Duplicate GPU detected"), so on one GPU neither the weight sync's
``distributed`` transport (an NCCL group of the trainer and the server's ranks) nor data
parallelism runs; the sync uses the ``tensor`` transport, the one for servers on the trainer's
node. At world size 1 every parameter shard is this rank's own, so the stale shards of item 2
cannot appear here: tests/distributed/test_param_gather.py shows them (and their fix) with two
data-parallel ranks over gloo. Not covered at all: Transformer Engine (not installed: the local
spec runs), SGLang itself (the project's own server answers its protocol).

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

# bench/ is on sys.path: the script's own directory (python bench/gpu_smoke.py), or the tests'
from smoke_wheels import (DEPENDENCIES, LOCK, OPTIONAL, PYTHON_VERSION, REQUIRED,  # noqa: F401
                          _canonical, carry_budget, download_closure, install_missing,
                          missing_modules)


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


class Skipped(Exception):
    """A check that cannot run on this machine, and why (not a failure)."""


OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}
"""Megatron DDP's overlaps, on in every check that trains (the distributed optimizer's)."""


class RecordedStream:
    """A ``BucketStream`` that keeps a copy of every tensor this rank sends (the bytes the
    weight sync pushes), otherwise the stream itself (the pusher sets its ``tensor_hook``)."""

    def __init__(self, stream):
        object.__setattr__(self, "_stream", stream)
        object.__setattr__(self, "sent", {})

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __setattr__(self, name, value):
        setattr(self._stream, name, value)

    def __len__(self) -> int:
        return len(self._stream)

    def __iter__(self):
        for bucket in self._stream:
            if bucket.flat is not None:
                self.sent.update({n: t.detach().cpu().clone() for n, t in bucket.named_tensors()})
            yield bucket


def hf_weights(trainer) -> dict:
    """The trainer's weights as full HF tensors (world size 1: this rank holds them all)."""
    from megatron_gspo.hf.gather import iter_full_hf_tensors

    out = {}
    for bucket in iter_full_hf_tensors(trainer.gpt, trainer.cfg.model, trainer.pg):
        out.update({name: t.clone() for name, t in bucket.items()})
    return out


class Smoke:
    """The checks; ``device`` is "cuda" or "cpu"."""

    def __init__(self, device: str, work: Path):
        self.device, self.work = device, work
        self.cuda = device == "cuda"
        self.rl_trainer = None  # made by rl_update_and_weight_sync, reused by checkpoint_exact_resume
        self.rl_batch = None

    # -- helpers ---------------------------------------------------------------------------
    def initialize(self, cfg):
        from megatron_gspo import parallel

        return parallel.initialize(cfg.parallel, seed=cfg.run.seed)

    def rl_config(self, run_dir: Path):
        from megatron_gspo.config import config_from_dict

        return config_from_dict({
            "model": tiny_model(params_dtype="bfloat16" if self.cuda else "float32"),
            "optim": {"lr": 1e-3, "use_distributed_optimizer": True, "adam_beta2": 0.98},
            "parallel": OVERLAP,
            # no forward after the last update: the weight sync reads what the step left
            "gspo": {"group_size": 4, "updates_per_rollout": 2, "routing_metrics": False},
            "rollout": {"max_new_tokens": 6, "deterministic": True},
            # THD: whole sequences packed under 48 tokens per micro-batch
            "run": {"seed": 11, "output_dir": str(run_dir), "global_batch_size": 16,
                    "micro_batch_size": 4, "seq_length": 16, "num_steps": 4,
                    "max_tokens_per_micro_batch": 48},
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

        # Megatron's bf16 optimizer needs CUDA: float32 on CPU (the same distributed optimizer)
        dtype = "bfloat16" if self.cuda else "float32"
        cfg = config_from_dict({
            "model": tiny_model(params_dtype=dtype),
            "optim": {"lr": 3e-3, "use_distributed_optimizer": True, "adam_beta2": 0.98},
            "parallel": OVERLAP,
            "run": {"seed": 3, "global_batch_size": 16, "micro_batch_size": 8, "seq_length": 16,
                    "num_steps": 12, "output_dir": str(self.work / "sft")}})
        pg = self.initialize(cfg)
        trainer = SFTTrainer(cfg, pg, pad_id=PAD_ID)
        self.check_device(trainer.gpt)
        optimizer = optimizer_classes(trainer.state.optimizer)
        if not all(name == "DistributedOptimizer" for name in optimizer.split(" + ")):
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
                f"{dtype} weights, {optimizer}, overlapped grad reduce / param gather")

    def rl_update_and_weight_sync(self) -> str:
        import math

        from megatron_gspo.hf.export import export_hf_dir
        from megatron_gspo.train.rl_trainer import RLTrainer
        from pipeline.scoring.tasks import write_byte_tokenizer
        from pipeline.servers.cluster import LocalRolloutCluster

        run_dir = self.work / "rl"
        cfg = self.rl_config(run_dir)
        pg = self.initialize(cfg)
        trainer = RLTrainer(cfg, pg)
        self.check_device(trainer.gpt)
        hf_dir = export_hf_dir(trainer.current_policy(), cfg.model, pg, run_dir / "init_hf")
        write_byte_tokenizer(hf_dir)
        server_args = ["--max-running-requests", "1", "--device", self.device,
                       "--allow-pickled-tensors"]  # the tensor transport's handles (loopback)
        with LocalRolloutCluster(hf_dir, 1, log_dir=run_dir / "logs", random_seed=cfg.run.seed,
                                 router=False, server_args=server_args) as cluster:
            batch, rollout_metrics = self._rollout(cfg, run_dir, cluster)
            self.rl_batch = {k: v.clone() for k, v in batch.items()}
            metrics = trainer.train_rollout(batch, 1)
            for key in ("grad_norm", "entropy_mean", "rollout_trainer_logprob_abs_diff"):
                if not math.isfinite(float(metrics.get(key, float("nan")))):
                    raise AssertionError(f"metric {key} = {metrics.get(key)}")
            if metrics["grad_norm"] <= 0:
                raise AssertionError("no gradient reached the optimizer")
            synced = self._sync_and_check(trainer, cluster)
        self.rl_trainer = trainer
        return (f"rollout server on {self.device}, {batch['tokens'].shape[0]} sampled rows "
                f"(packed: THD), reward {rollout_metrics['reward_mean']:.3f}, grad_norm "
                f"{metrics['grad_norm']:.3g}, rollout/trainer |dlogp| "
                f"{metrics['rollout_trainer_logprob_abs_diff']:.2e}; {synced}")

    def _rollout(self, cfg, run_dir: Path, cluster):
        """One rollout batch of the project's pipeline from the server (on ``self.device``)."""
        from pipeline.context import LoopContext
        from pipeline.generation.client import RolloutClient, http_json
        from pipeline.observe.metrics import MetricsLogger
        from pipeline.scoring.data import PromptSampler, build_datasets
        from pipeline.scoring.rewards import build_reward
        from pipeline.signals import StopFlag
        from pipeline.sources.batch import rollout_phase

        info = http_json("GET", cluster.server_urls[0] + "/server_info")[1]
        if info.get("device") != self.device:
            raise AssertionError(f"the rollout server runs on {info.get('device')}, "
                                 f"expected {self.device}")
        train_set, _ = build_datasets(cfg.data, seed=cfg.run.seed)
        ctx = LoopContext(
            cfg=cfg, run_dir=str(run_dir), logger=MetricsLogger(run_dir, enabled=False),
            stop=StopFlag(), sampler=PromptSampler(train_set, seed=cfg.run.seed),
            reward_fn=build_reward(cfg.reward, cfg.data),
            client=RolloutClient(server_urls=list(cluster.server_urls)),
            decode=train_set.encoder.decode, stop_token_ids=[train_set.encoder.eos_id])
        return rollout_phase(ctx, 1)

    def _sync_and_check(self, trainer, cluster) -> str:
        """The weight sync after the step (transport ``tensor``, checksums verified by the
        server), then issue 37 item 2: what it pushed is the step's weights, bit for bit."""
        import torch

        from pipeline.weights.push import WeightPusher

        before = hf_weights(trainer)  # the raw parameters, read before any gather
        pusher = WeightPusher(list(cluster.server_urls), transport="tensor", verify=True)
        try:
            stream = RecordedStream(trainer.hf_buckets())
            stats = pusher.push(stream, version="1")
        finally:
            pusher.close()
        for chunk in trainer.state.model:  # Megatron's own gather: the step's weights everywhere
            chunk.start_param_sync(force_sync=True)
        after = hf_weights(trainer)
        if stream.sent.keys() != after.keys():
            raise AssertionError(f"pushed {sorted(stream.sent)[:3]}..., the policy has "
                                 f"{sorted(after)[:3]}...")
        stale = [n for n in after if not torch.equal(stream.sent[n].to(after[n].dtype), after[n])]
        if stale:
            raise AssertionError(f"the weight sync pushed values other than the step's in "
                                 f"{len(stale)} tensors: {stale[:3]}")
        behind = sum(not torch.equal(before[n], after[n]) for n in after)
        return (f"weight sync (tensor transport, {stats.num_buckets} buckets, checksums "
                f"verified by the server): the {len(after)} pushed tensors are the step's "
                f"weights bit for bit ({behind} were behind before the gather; at world size 1 "
                "none can be: tests/distributed/test_param_gather.py shows it with 2 ranks)")

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
            raise AssertionError("needs rl_update_and_weight_sync's trainer (run it first)")
        a = self.rl_trainer
        cfg, pg = a.cfg, a.pg
        path = a.save(self.work / "ckpt", 1, {"note": "gpu_smoke"})
        b = RLTrainer(cfg, pg)  # random weights of the same seed, a fresh optimizer
        state = b.load(path)
        if state.get("note") != "gpu_smoke":
            raise AssertionError(f"run state not restored: {state}")

        def weights(trainer):  # the step's, on every shard (issue 37 item 2)
            return {n: p.detach().clone() for n, p in trainer.current_policy().named_parameters()}

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
        missing = missing_modules(OPTIONAL)
        if missing:
            raise Skipped(f"{', '.join(OPTIONAL[m] for m in missing)} not installed (the command "
                          "line's embedded router; not carried when over the 64 MiB budget)")
        run_dir = self.work / "train"
        base = [sys.executable, "-m", "launch.cli", "train", "--config", "launch/configs/tiny_cpu.yaml",
                "--nproc", "1", "--set", f"run.output_dir={run_dir}", "--set", "parallel.expert=1",
                "--set", "rollout.num_servers=1", "--set", "rollout.weight_sync.transport=disk",
                "--set", "run.global_batch_size=32", "--set", "run.eval_interval=0",
                "--set", "run.save_interval=1", "--set", "rollout.deterministic=true"]
        base += ["--set", f"rollout.local_server_device={self.device}",
                 "--set", "run.loggers=[jsonl]",  # tensorboard is not carried
                 "--set", "optim.use_distributed_optimizer=true",
                 "--set", "parallel.overlap_grad_reduce=true",
                 "--set", "parallel.overlap_param_gather=true",
                 "--set", "run.max_tokens_per_micro_batch=64"]
        if self.cuda:
            base += ["--set", "model.params_dtype=bfloat16"]
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


CHECKS = ["environment", "sft_bf16_distributed_optimizer", "rl_update_and_weight_sync",
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
    parser.add_argument("--fetch-wheels", "--download", dest="download", type=Path, default=None,
                        metavar="DIR",
                        help=f"on a machine with a package index: fetch the exact wheel closure "
                             f"for CPython {PYTHON_VERSION} / manylinux x86_64 (without torch and "
                             f"its dependencies; the optional ones only within the device's "
                             f"carry budget) into DIR with DIR/{LOCK}, and exit")
    parser.add_argument("--device-has", type=Path, default=None, metavar="FILE",
                        help="with --fetch-wheels: also leave out the distributions in FILE (`pip "
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
        budget = carry_budget()
        wheels, left_out = download_closure(args.download, device_has=args.device_has,
                                            budget=budget)
        total = sum(size for _, _, size in wheels)
        print("\n".join(f"{name}=={version}  {size / 2**20:.2f} MiB"
                        for name, version, size in wheels))
        if left_out:
            print(f"left out (over the {budget / 2**20:.1f} MiB the device carries beside the "
                  f"working tree): {', '.join(left_out)}")
        print(f"gpu_smoke: {len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.download} "
              f"({LOCK}); on the GPU machine: python3 bench/gpu_smoke.py --wheels "
              f"{args.download} --install-target /tmp/gs_site", flush=True)
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
    selected = args.only or CHECKS
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        verdicts = run_checks(Smoke(args.device, args.work_dir or Path(tmp)), selected)
        parallel.destroy()
    passed, skipped = verdicts.count("PASS"), verdicts.count("SKIP")
    print(f"gpu_smoke: {passed}/{len(selected)} checks passed on {args.device}"
          + (f", {skipped} skipped" if skipped else ""), flush=True)
    return 0 if "FAIL" not in verdicts else 1


def run_checks(smoke: Smoke, selected: list[str]) -> list[str]:
    """Each selected check in order, one line each; their verdicts."""
    verdicts = []
    for name in (c for c in CHECKS if c in selected):
        start = time.monotonic()
        try:
            detail = getattr(smoke, name)()
            verdicts.append("PASS")
            print(f"PASS {name} ({time.monotonic() - start:.1f} s): {detail}", flush=True)
        except Skipped as why:
            verdicts.append("SKIP")
            print(f"SKIP {name}: {why}", flush=True)
        except Exception as err:  # noqa: BLE001 - every check reports, the next one runs
            verdicts.append("FAIL")
            last = traceback.format_exception(err)[-1].strip()
            print(f"FAIL {name} ({time.monotonic() - start:.1f} s): {last}", flush=True)
            traceback.print_exc()
    return verdicts

if __name__ == "__main__":
    sys.exit(main())
