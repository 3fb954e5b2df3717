"""Rank-side functions of the ``bridge`` tier (tests/bridge/test_bridge_interop.py), run on gloo
ranks by ``bench.spawn.run_on_ranks`` in the Megatron-Bridge environment (launch/envs/bridge.sh).

* :func:`bridge_import`: Bridge's ``AutoBridge.import_ckpt`` (HF -> Megatron), one rank.
* :func:`train_from`: the project's RL trainer starts from ``run.init_from`` under a layout, takes
  one GSPO step (``train_rollout``) and saves the model with ``save_model``; it returns its pieces of
  the weights (HF coordinates) before and after the step.
* :func:`bridge_export`: Bridge's ``AutoBridge.export_ckpt`` (Megatron -> HF) of several
  checkpoints, one rank. ``export_ckpt`` makes its own one-rank gloo group
  (``temporary_distributed_context``), so the harness's group is put down around it.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf import rank_pieces
from megatron_gspo.hf.mcore_checkpoint import save_model
from megatron_gspo.train.rl_trainer import RLTrainer
from tests.bridge import bridge_shim


def bridge_import(rank, world_size, conversions: dict[str, str]) -> None:
    """``conversions``: HF directory -> Megatron checkpoint root to write."""
    bridge_shim.import_bridge()
    bridge_shim.prepare_rank()
    from megatron.bridge import AutoBridge

    with bridge_shim.local_spec_everywhere():
        for hf_dir, out in conversions.items():
            AutoBridge.import_ckpt(hf_dir, out, torch_dtype=torch.float32)


def train_from(rank, world_size, cfg_dict: dict, batch: dict, step: int, save_root: str,
               hf_config_dir: str) -> dict:
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg, init_hf_dir=cfg.run.init_from)
    before = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cfg.model, pg)]
    metrics = trainer.train_rollout(batch, step)
    after = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(trainer.gpt, cfg.model, pg)]
    save_model(trainer.gpt, save_root, hf_config_dir=hf_config_dir, model=cfg.model)
    parallel.destroy_model_parallel()
    return {"before": before, "weights": after, "metrics": metrics}


def bridge_export(rank, world_size, exports: list[tuple[str, str, str]]) -> None:
    """``exports``: (HF model directory of the bridge, Megatron checkpoint root, HF output directory)."""
    bridge_shim.import_bridge()
    bridge_shim.prepare_rank()
    from megatron.bridge import AutoBridge

    bridges = {hf_dir: AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.float32)
               for hf_dir, _, _ in exports}
    dist.destroy_process_group()
    try:
        with bridge_shim.local_spec_everywhere():
            for hf_dir, root, out in exports:
                bridges[hf_dir].export_ckpt(root, out, show_progress=False)
    finally:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
