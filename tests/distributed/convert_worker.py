"""Spawned-rank side of the conversion tests (importable for the spawn start method).

One call runs every checkpoint of every case under one parallel layout: build the policy, load the
checkpoint with :func:`megatron_gspo.hf.mcore_checkpoint.load_model`, run the batch through
Megatron's schedule and return, from the last stage's first TP rank, the per-token log-probs and
the full logits (gathered over TP, padded vocabulary removed). Optionally the loaded model is
saved again with Megatron's own ``dist_checkpointing.save`` (the trainer's format).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.model import gpt as policy

from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo import parallel
from megatron_gspo.config import ParallelConfig
from megatron_gspo.hf.mcore_checkpoint import load_model, save_model


def forward_last_stage(gpt, batch: dict):
    """Last-stage vocab-parallel logits of one micro-batch through Megatron's schedule (None on
    other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured = {}

    def loss_func(output_tensor):
        captured["logits"] = output_tensor.detach()
        return output_tensor.sum() * 0.0, torch.ones((), dtype=torch.int), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model(mb["tokens"], mb["position_ids"], None), loss_func

    rows, seq = batch["tokens"].shape
    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]),
                                    model=[gpt], num_microbatches=1, seq_length=seq,
                                    micro_batch_size=rows, forward_only=True)
    return captured.get("logits")


def run_checkpoints(rank, world_size, parallel_section: dict, cases: dict, batch: dict,
                    save_dirs: dict):
    """``cases``: name -> {"hf_config": dir, "checkpoints": {label: mcore dir}}. Returns, on the
    reporting rank, name -> label -> {"log_probs", "logits"}; ``save_dirs``: name -> dir to save
    the model loaded from the first checkpoint to."""
    par = ParallelConfig(**parallel_section)
    pg = parallel.initialize(par)
    is_reporter = pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0 and pg.dp.rank() == 0
    results = {}
    for name, case in cases.items():
        model_cfg = model_config_from_hf(case["hf_config"])
        gpt = policy.build_model(model_cfg, par, pg).eval()
        results[name] = {}
        for i, (label, ckpt_dir) in enumerate(case["checkpoints"].items()):
            with torch.no_grad():
                for param in gpt.parameters():
                    param.fill_(float("nan"))  # a tensor the load misses cannot pass unnoticed
            load_model(gpt, ckpt_dir)
            logits = forward_last_stage(gpt, batch)
            if logits is not None:
                log_probs, _ = policy.token_log_probs(logits, batch["labels"], model_cfg, pg)
                gathered = [torch.empty_like(logits) for _ in range(pg.tp.size())]
                dist.all_gather(gathered, logits.contiguous(), group=pg.tp)
                full = torch.cat(gathered, dim=-1)[..., :model_cfg.vocab_size]
                if is_reporter:
                    results[name][label] = {"log_probs": log_probs, "logits": full}
            if i == 0 and name in save_dirs:
                save_model(gpt, save_dirs[name], hf_config_dir=case["hf_config"], model=model_cfg)
        del gpt
    parallel.destroy_model_parallel()
    return results if is_reporter else None
