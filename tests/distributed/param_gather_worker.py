"""Spawned-rank side of tests/distributed/test_param_gather.py (importable for spawn).

Each rank trains the tiny policy with Megatron's distributed optimizer and
``parallel.overlap_param_gather`` and, after each of three steps, lets ONE reader of the weights
read first: the weight sync's bucket stream (what ``WeightPusher.push`` sends), a checkpoint
(loaded back into a second trainer) and the HF export of a run's end (``launch.rl_session``).
What the reader got is compared with the parameters after Megatron's own forced gather
(``start_param_sync(force_sync=True)``): step n's weights on every shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def _hf_tensors(gpt, model_cfg, pg) -> dict[str, torch.Tensor]:
    """This rank's parameters as full HF tensors (data parallel only: every rank holds them all)."""
    from megatron_gspo.hf.mapping import hf_param_shapes
    from megatron_gspo.hf.rank_pieces import local_hf_pieces

    full = {name: torch.full(shape, float("nan")) for name, shape in hf_param_shapes(model_cfg).items()}
    for piece, tensor in local_hf_pieces(gpt, model_cfg, pg):  # a fused q/k/v gives several
        full[piece.hf_name][piece.hf_index] = tensor
    assert not any(t.isnan().any() for t in full.values())
    return full


def _truth(trainer) -> dict[str, torch.Tensor]:
    """Step n's weights: Megatron's own synchronous gather, then this rank's parameters."""
    for chunk in trainer.state.model:
        chunk.start_param_sync(force_sync=True)
    return _hf_tensors(trainer.gpt, trainer.cfg.model, trainer.pg)


def _pushed(trainer, rank: int) -> dict[str, torch.Tensor]:
    """The bytes the weight sync sends: every bucket this rank is the source of."""
    out = {}
    for bucket in trainer.hf_buckets():
        if bucket.source == rank:
            out.update({n: t.clone() for n, t in bucket.named_tensors()})
    return out


def _differ(got: dict, want: dict) -> list[str]:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return sorted(n for n in want if not torch.equal(got[n], want[n]))


def run(rank, world_size, cfg_dict, batch, work_dir):
    """Returns, per reader: the tensors it got that are not step n's, and the tensors whose
    parameters were still behind right after the step (the test's precondition); and the
    tensors in which step 3 of the trainer resumed from step 2's checkpoint differs from the
    uninterrupted step 3 (the distributed optimizer's checkpoint restores its state exactly)."""
    from launch.rl_session import _export_policy
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.hf.safetensors_io import HFCheckpoint
    from megatron_gspo.train.rl_trainer import RLTrainer

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    out = {}

    def after_step(step: int) -> dict[str, torch.Tensor]:
        trainer.train_rollout(batch, step)
        return _hf_tensors(trainer.gpt, cfg.model, pg)  # raw parameters, before any reader

    raw = after_step(1)
    got = _pushed(trainer, rank)
    truth = _truth(trainer)
    out["push"] = {"stale": _differ(got, truth) if got else [], "behind": _differ(raw, truth),
                   "sent": len(got)}

    raw = after_step(2)
    path = trainer.save(work_dir, 2, {})
    truth = _truth(trainer)
    second = RLTrainer(cfg, pg)
    second.load(path)
    out["checkpoint"] = {"stale": _differ(_hf_tensors(second.gpt, cfg.model, pg), truth),
                         "behind": _differ(raw, truth)}

    raw = after_step(3)
    exported = _export_policy(trainer, cfg, Path(work_dir) / "hf")
    truth = _truth(trainer)
    second.train_rollout(batch, 3)  # the resumed trainer's step 3 is the uninterrupted one's
    out["resumed_step"] = _differ(_truth(second), truth)
    if rank == 0:
        files = HFCheckpoint(exported)
        got = {name: files.read(name) for name in truth}
        files.close()
        out["export"] = {"stale": _differ(got, truth), "behind": _differ(raw, truth)}
    dist.barrier()
    parallel.destroy_model_parallel()
    return out
