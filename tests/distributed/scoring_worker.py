"""Spawned-rank side of tests/distributed/test_scoring_layouts.py (importable for spawn)."""

from __future__ import annotations


def run_score(rank, world_size, cfg_dict, batch, temperature):
    return run_scores(rank, world_size, {"only": cfg_dict}, batch, temperature)["only"]


def run_scores(rank, world_size, cfg_dicts, batch, temperature):
    """Each layout of ``cfg_dicts`` in turn (one spawn): name -> this rank's scored tensor."""
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.train import rl_trainer

    out = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = config_from_dict(cfg_dict)
        pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
        trainer = rl_trainer.RLTrainer(cfg, pg)
        out[name] = trainer.score_log_probs(batch, temperature=temperature)
        parallel.destroy_model_parallel()
    return out
