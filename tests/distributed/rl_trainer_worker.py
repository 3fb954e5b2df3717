"""Spawned-rank side of tests/distributed/test_rl_trainer_layouts.py (importable for spawn).

Each rank builds ``RLTrainer`` under one parallel layout (its layout-independent initialisation),
runs ``train_rollout`` on the given rollout batch (the same on every rank, as the loop broadcasts
it), and returns the reduced metrics, its pieces of the weights before and after, in HF
coordinates, and what ``reduce_metrics`` was given on this rank (recorded, not replaced).
"""

from __future__ import annotations


def run_train_rollout(rank, world_size, cfg_dict, batch, step, scatter=False):
    """``train_rollout`` of ``batch`` on every rank; ``scatter``: only rank 0 holds the routed
    experts and ``scatter_routed_experts`` sends each rank its rows first (as the loop does)."""
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.hf import rank_pieces
    from megatron_gspo.train import rl_trainer
    from megatron_gspo.train.metric_reduction import is_metric_rank

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = rl_trainer.RLTrainer(cfg, pg)
    before = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cfg.model, pg)]

    reduce_inputs = []
    real_reduce = rl_trainer.reduce_metrics

    def recording_reduce(per_microbatch, pg_collection):
        reduce_inputs.append([{k: float(v) for k, v in m.items()} for m in per_microbatch])
        return real_reduce(per_microbatch, pg_collection)

    received = None
    if scatter:
        batch = dict(batch)
        if rank != 0:
            del batch["routed_experts"]
        trainer.scatter_routed_experts(batch, step)
        received = (batch["routed_rows"].tolist(), batch["routed_experts"].clone())
    units = []  # the loss units (num_units_global) of each mini-batch's update
    real_step = rl_trainer.train_step

    def recording_step(*args, num_units_global, **kwargs):
        units.append(num_units_global)
        return real_step(*args, num_units_global=num_units_global, **kwargs)

    rl_trainer.reduce_metrics = recording_reduce
    rl_trainer.train_step = recording_step
    try:
        metrics = trainer.train_rollout(batch, step)
    finally:
        rl_trainer.reduce_metrics = real_reduce
        rl_trainer.train_step = real_step
    after = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cfg.model, pg)]
    out = {"metrics": metrics, "before": before, "weights": after,
           "is_metric_rank": is_metric_rank(pg),
           # [forward-only pass, updates]: this rank's micro-batch metric dicts
           "reduce_inputs": reduce_inputs, "received": received, "units": units}
    parallel.destroy_model_parallel()
    return out


def run_train_rollouts(rank, world_size, cfg_dicts, batch, step, scatter=False):
    """``run_train_rollout`` for several configurations (the same layout) in one spawn."""
    return [run_train_rollout(rank, world_size, cfg, batch, step, scatter) for cfg in cfg_dicts]
