"""One side of the cross-stack checkpoint test (test_cross_stack_checkpoint.py), run by the
interpreter of one stack: ``python -m tests.distributed.cross_stack_worker save|resume RUN_DIR OUT``.

* ``save``: two ranks (expert parallelism 2) take step 0, checkpoint, take steps 1 and 2;
  OUT gets the weights after step 2 (the uninterrupted run).
  It also saves the model after step 0 with ``save_model`` (RUN_DIR/model, the Megatron-LM /
  Bridge layout); OUT gets the weights at the checkpoint too.
* ``resume``: two ranks build a fresh, perturbed model, resume from RUN_DIR's checkpoint and take
  steps 1 and 2; OUT gets those weights.
* ``init_from``: two ranks build a fresh, perturbed model and load it as ``run.init_from`` does
  (``load_initial_weights``) from RUN_DIR/model and from the training checkpoint's model_optim;
  OUT gets both.

OUT (torch.save) also names the megatron-core version that ran.
"""

from __future__ import annotations

import sys

import torch

from megatron_gspo import mcore_compat, parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import rank_pieces
from megatron_gspo.hf.mcore_checkpoint import save_model
from megatron_gspo.train.initial_weights import load_initial_weights
from megatron_gspo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.distributed.layouts import assemble, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_checkpoint import _fresh, _step

CONFIG = tiny_config({"expert": 2})


def _worker(rank, world, cfg_dict, run_dir, mode):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    out = {}
    if mode == "init_from":
        for source in ("model", "model_optim"):
            with torch.no_grad():
                for p in gpt.parameters():
                    p.add_(0.5)
            path = (f"{run_dir}/model" if source == "model"
                    else str(latest_checkpoint(run_dir) / "model_optim"))
            load_initial_weights(gpt, cfg.model, pg, path, seed=0)
            out[source] = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]
        parallel.destroy_model_parallel()
        return out
    if mode == "save":
        _step(state, cfg, pg, 0)
        save_checkpoint(run_dir, 1, state.model, state.optimizer, {"sampler": {"index": 8}})
        save_model(gpt, f"{run_dir}/model", model=cfg.model)
        out["at_checkpoint"] = [(p, t.clone()) for p, t in
                                rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]
    else:
        with torch.no_grad():
            for p in gpt.parameters():
                p.add_(0.5)
        load_checkpoint(latest_checkpoint(run_dir), state.model, state.optimizer)
    _step(state, cfg, pg, 1)
    _step(state, cfg, pg, 2)
    out["weights"] = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]
    parallel.destroy_model_parallel()
    return out


def main(mode: str, run_dir: str, out: str) -> None:
    results = run_on_ranks(2, _worker, (CONFIG, run_dir, mode), timeout_s=300)
    shapes = hf_param_shapes(config_from_dict(CONFIG).model)
    torch.save({"megatron_core": mcore_compat.stack()["megatron_core"],
                **{key: assemble(results, key, shapes) for key in results[0]}}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
