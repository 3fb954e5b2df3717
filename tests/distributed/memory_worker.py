"""Spawned-rank side of the recompute / uneven-pipeline / overlap layout tests: several model
configurations under one parallel layout in one process (each spawn imports Megatron once).

Besides layout_worker's result, each configuration reports how often the submodules that
recompute targets ran forward (``forward_calls``: core_attention, input_layernorm, experts, summed
over this rank's layers), so a test can tell that a recompute mode really recomputed.
"""

from __future__ import annotations

from collections import Counter

from megatron_gspo.model import gpt as policy
from tests.distributed import layout_worker

COUNTED = ("core_attention", "input_layernorm", "experts")


def run_variants(rank, world_size, cfg_dicts: dict, hf_weights, batch, num_microbatches: int,
                 loss_kind: str = "sft"):
    """name -> this rank's result of layout_worker.run_layout, plus ``forward_calls``."""
    build = policy.build_model
    out = {}
    for name, cfg in cfg_dicts.items():
        counts: Counter = Counter()

        def build_and_count(*args, **kwargs):
            gpt = build(*args, **kwargs)
            for module_name, module in gpt.named_modules():
                leaf = module_name.rsplit(".", 1)[-1]
                if module_name.startswith("decoder.layers.") and leaf in COUNTED:
                    module.register_forward_hook(lambda *_, leaf=leaf: counts.update([leaf]))
            return gpt

        policy.build_model = build_and_count
        try:
            result = layout_worker.run_layout(rank, world_size, cfg, hf_weights, batch,
                                              [num_microbatches], loss_kind)[0]
        finally:
            policy.build_model = build
        result["forward_calls"] = dict(counts)
        out[name] = result
    return out
