"""The Megatron side of the RL loop: one object per training rank that owns the policy.

``RLTrainer.train_rollout(batch, step)`` is the GSPO update of one rollout batch:

1. the global batch (every rank holds the same one, broadcast by the loop) is cut into
   k = ``gspo.updates_per_rollout`` mini-batches (a seeded permutation of its rows, then contiguous
   slices), each mini-batch into this data-parallel rank's micro-batches;
2. log pi_old is recomputed by Megatron for EVERY mini-batch before the first update (forward only;
   with ``gspo.old_logprobs: rollout`` the rollout engine's log-probs are used instead and the
   sequence-level mismatch weight of gspo_math.md applies), together with the policy's entropy;
3. k optimizer steps, each the gradient of ``(1/N_j) sum_i loss_i`` over mini-batch j
   (``train_step`` documents the scaling contract).

Metrics come back already reduced over all ranks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.model import gpt as policy
from megatron_gspo.config import Config
from megatron_gspo.train.rl_loss import count_sequences, make_gspo_loss_fn
from megatron_gspo.train.train_step import (build_train_state, forward_backward, global_unit_count,
                                      train_step)
from megatron_gspo.train.batching import select_rows, split_for_rank

# Metric reduction over micro-batches and ranks: *_min -> min, *_max -> max, the rest are means
# weighted by the number of sequences (GSPO metrics are per-sequence means).
_SKIP = {"loss_sum"}


def _is_metric_rank(pg) -> bool:
    return (pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0 and pg.cp.rank() == 0)


def reduce_metrics(per_microbatch: list[dict], pg, *, weight_key: str = "num_sequences") -> dict:
    """Reduce per-micro-batch metric dicts of the last pipeline stage to global values.

    Collective over the world: every rank must call it (ranks without metrics pass []).
    """
    local: dict[str, list] = {}
    if _is_metric_rank(pg):
        for m in per_microbatch:
            w = float(m.get(weight_key, 1.0))
            for key, value in m.items():
                if key in _SKIP:
                    continue
                local.setdefault(key, []).append((float(value), w))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, list] = {}
    for part in gathered:
        for key, values in part.items():
            merged.setdefault(key, []).extend(values)
    out = {}
    for key, values in merged.items():
        if key.endswith("_min"):
            out[key] = min(v for v, _ in values)
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in values)
        elif key in (weight_key, "num_tokens"):
            out[key] = sum(v for v, _ in values)
        else:
            total = sum(w for _, w in values)
            out[key] = sum(v * w for v, w in values) / total if total > 0 else 0.0
    return out


def is_mcore_checkpoint(path: str | Path) -> bool:
    """A torch_dist directory (its ``.metadata`` file) rather than a Hugging Face one."""
    return (Path(path) / ".metadata").is_file()


class RLTrainer:
    """Owns this rank's policy stage, its optimizer and the GSPO update."""

    def __init__(self, cfg: Config, pg_collection, *, init_hf_dir: Optional[str] = None):
        self.cfg = cfg
        self.pg = pg_collection
        self.gpt = policy.build_model(cfg.model, cfg.parallel, pg_collection)
        if init_hf_dir and is_mcore_checkpoint(init_hf_dir):
            self.load_mcore(init_hf_dir)
        elif init_hf_dir:
            self.load_hf(init_hf_dir)
        else:
            policy.init_weights(self.gpt, cfg.model, pg_collection, seed=cfg.run.seed)
        self.state = build_train_state(self.gpt, cfg, pg_collection)

    # ---------------------------------------------------------------------------------------
    def load_hf(self, hf_dir: str) -> None:
        """Load weights from a Hugging Face directory (checked against the model config first)."""
        from megatron_gspo.hf.hf_config import check_model_config
        from megatron_gspo.hf.safetensors_io import HFCheckpoint

        check_model_config(self.cfg.model, hf_dir)
        with HFCheckpoint(hf_dir) as ckpt:
            policy.load_hf_weights(self.gpt, self.cfg.model, self.pg, ckpt.read)

    def load_mcore(self, ckpt_dir: str) -> None:
        """Load a Megatron torch_dist checkpoint (``convert hf-to-mcore`` or a trainer checkpoint's
        ``model_optim``), under this run's layout whatever layout wrote it."""
        from megatron_gspo.hf.hf_config import check_model_config
        from megatron_gspo.hf.mcore_checkpoint import load_model

        hf_config = Path(ckpt_dir) / "hf_config"
        if hf_config.is_dir():
            check_model_config(self.cfg.model, hf_config)
        load_model(self.gpt, ckpt_dir)

    def _num_microbatches(self, rows: int) -> int:
        dp = self.pg.dp.size()
        mbs = self.cfg.run.micro_batch_size
        if rows % (dp * mbs) != 0:
            raise ValueError(f"a mini-batch of {rows} sequences does not split into data-parallel "
                             f"size {dp} x run.micro_batch_size {mbs}")
        return rows // (dp * mbs)

    def minibatches(self, batch: dict, step: int) -> list[list[dict]]:
        """This rank's micro-batches of each of the k mini-batches (layout-independent split)."""
        rows = batch["tokens"].shape[0]
        k = self.cfg.gspo.updates_per_rollout
        if rows % k != 0:
            raise ValueError(f"rollout batch of {rows} sequences does not split into "
                             f"gspo.updates_per_rollout = {k} mini-batches")
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 100_003 + step)
        order = torch.randperm(rows, generator=gen)
        size = rows // k
        out = []
        for j in range(k):
            mini = select_rows(batch, order[j * size:(j + 1) * size])
            out.append(split_for_rank(mini, self.pg.dp.rank(), self.pg.dp.size(),
                                      self._num_microbatches(size)))
        return out

    def _recompute_old_log_probs(self, minis: list[list[dict]]) -> dict:
        """Forward only: log pi_old and entropy for every micro-batch (stored in the dicts)."""
        temperature = self.cfg.rollout.temperature

        def loss_fn(logits, mb):
            with torch.no_grad():
                log_probs, entropy = policy.token_log_probs(
                    logits, mb["labels"], self.cfg.model, self.pg, temperature=temperature,
                    with_entropy=True)
            mask = mb["response_mask"]
            if self.cfg.gspo.old_logprobs == "recompute":
                mb["old_log_probs"] = log_probs.detach()
            else:
                mb["old_log_probs"] = mb["rollout_log_probs"]
            n_tok = mask.sum().clamp_min(1)
            diff = ((log_probs - mb["rollout_log_probs"]).abs() * mask).sum() / n_tok
            ent = (entropy * mask).sum() / n_tok
            return log_probs.new_zeros(()), {"num_sequences": float(count_sequences(mask)),
                                             "entropy_mean": float(ent),
                                             "rollout_trainer_logprob_abs_diff": float(diff)}

        collected = []
        for mbs in minis:
            collected += forward_backward(self.state, mbs, loss_fn, num_units_global=1,
                                          forward_only=True)
        return reduce_metrics(collected, self.pg)

    def train_rollout(self, batch: dict, step: int) -> dict:
        """The k GSPO updates of one rollout batch; returns reduced metrics."""
        start = time.monotonic()
        minis = self.minibatches(batch, step)
        old = self._recompute_old_log_probs(minis)
        loss_fn = make_gspo_loss_fn(self.cfg.model, self.cfg.gspo, self.pg,
                                    temperature=self.cfg.rollout.temperature)
        per_mb, grad_norms = [], []
        for mbs in minis:
            n_global = global_unit_count(
                sum(count_sequences(mb["response_mask"]) for mb in mbs), self.pg)
            if n_global == 0:
                continue
            out = train_step(self.state, mbs, loss_fn, num_units_global=n_global)
            per_mb += out["per_microbatch"]
            grad_norms.append(float(out["grad_norm"]) if out["grad_norm"] is not None else 0.0)
        metrics = reduce_metrics(per_mb, self.pg)
        metrics.update({f"old_{k}" if k == "num_sequences" else k: v for k, v in old.items()})
        metrics["grad_norm"] = max(grad_norms) if grad_norms else 0.0
        elapsed = time.monotonic() - start
        metrics["train_tokens_per_s"] = float(batch["tokens"].numel()) / max(elapsed, 1e-9)
        metrics["train_s"] = elapsed
        return metrics

    # ---------------------------------------------------------------------------------------
    def save(self, run_dir: str | Path, step: int, run_state: dict) -> Path:
        from megatron_gspo.train.checkpoint import save_checkpoint

        return save_checkpoint(run_dir, step, self.state.model, self.state.optimizer, run_state)

    def load(self, path: str | Path) -> dict:
        from megatron_gspo.train.checkpoint import load_checkpoint

        return load_checkpoint(path, self.state.model, self.state.optimizer)
