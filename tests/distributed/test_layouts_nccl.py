"""The training collectives under NCCL's semantics take the same step as the single process.

Run: ``.venv/bin/python -m pytest -q tests/distributed/test_layouts_nccl.py``

``test_layouts``' one SFT step (2 micro-batches, Adam with clipping) under TP2 (sequence
parallel), EP2 and PP2, with every collective and point-to-point call deferred by
:class:`tests.nccl_semantics.NcclSemantics` (``tests/distributed/nccl_layout_worker.py``): no
host-side ``wait()`` blocks, so a reduction whose result the code read before the data landed, or
a buffer reused before its collective finished, shows as a gradient or weight that differs from
the single-process run (1e-5 relative, fp32). The deferred calls are counted, so the test cannot
pass by deferring nothing.
"""

from __future__ import annotations

import pytest

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import nccl_layout_worker
from tests.distributed.layouts import LAYOUTS, assemble, tiny_config
from bench.spawn import run_on_ranks
# the single-process step (the ``reference`` fixture) and the comparison, as test_layouts has them
from tests.distributed.test_layouts import NUM_MICROBATCHES, assert_same_step, reference  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.extended]

DELAY_S = 0.002
EXPECTED_CALLS = {"TP2": "all_gather_single", "EP2": "all_to_all_single", "PP2": "send"}


@pytest.mark.parametrize("layout", ["TP2", "EP2", "PP2"])
def test_one_step_matches_single_process_under_nccl_semantics(layout, reference):
    weights, batch, _ = reference
    world, par = LAYOUTS[layout]
    cfg = tiny_config(par)
    per_rank = run_on_ranks(world, nccl_layout_worker.run_layout,
                            (cfg, weights, batch, [NUM_MICROBATCHES], "sft", DELAY_S),
                            timeout_s=300)
    calls = [c for _, c in per_rank]
    results = [outputs[0] for outputs, _ in per_rank]
    assert all(c.get(EXPECTED_CALLS[layout], 0) > 0 for c in calls), calls
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    loss = sum(r["loss_sum"] for r in results if r["counts_loss"]) / results[0]["num_units"]
    assert all(r["update_ok"] for r in results)
    grads, new_weights = assemble(results, "grads", shapes), assemble(results, "weights", shapes)
    assert_same_step(layout, (loss, grads, new_weights, results[0]["grad_norm"]), reference[2])
