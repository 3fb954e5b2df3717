"""Spawned-rank side of ``test_layouts_nccl``: ``layout_worker.run_layout`` under NCCL's rule.

Every collective and point-to-point call of every group is deferred by
:class:`tests.nccl_semantics.NcclSemantics` (``wait()`` does not block the host; the data lands
``delay_s`` later at the earliest, ordered only by its stream and by the tensors it touches), as
the training collectives on GPU tensors are. Returns ``run_layout``'s outputs and the counts of
deferred calls.
"""

from __future__ import annotations

from tests.distributed import layout_worker
from tests.nccl_semantics import NcclSemantics


def run_layout(rank, world_size, cfg_dict, hf_weights, batch, microbatch_counts, loss_kind,
               delay_s):
    with NcclSemantics(delay_s=delay_s) as semantics:
        outputs = layout_worker.run_layout(rank, world_size, cfg_dict, hf_weights, batch,
                                           microbatch_counts, loss_kind)
    return outputs, dict(semantics.calls)
