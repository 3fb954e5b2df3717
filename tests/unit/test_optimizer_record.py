"""A checkpoint's optimizer record and the resumes it refuses (``records.optimizer_refusal``).

The distributed optimizer's checkpoint (Megatron's ``dp_reshardable`` state,
``checkpoint/state.py``) follows its buffers and the plain optimizer's follows the parameters:
neither converts into the other, and the distributed one resumes only under the layout that
wrote it. Each refusal is one message naming the field; everything else resumes."""

from __future__ import annotations

import re

import pytest

from megatron_gspo.train.checkpoint.records import optimizer_refusal
from megatron_gspo.train.checkpoint.state import DISTRIBUTED_OPTIMIZER_SHARDING

LAYOUT = {"world_size": 2, "tensor": 1, "pipeline": 1, "context": 1, "expert": 2,
          "expert_tensor": 1, "data": 2, "num_layers_in_first_pipeline_stage": None,
          "num_layers_in_last_pipeline_stage": None}
OTHER = {**LAYOUT, "expert": 1}
DIST = {"distributed": True, "sharding": DISTRIBUTED_OPTIMIZER_SHARDING}


def manifest(optimizer, layout=LAYOUT):
    out = {"layout": layout}
    if optimizer is not None:
        out["optimizer"] = optimizer
    return out


@pytest.mark.parametrize("written, now, message", [
    (DIST, False, r"holds the distributed optimizer's state \(optim\.use_distributed_optimizer: "
                  r"true\); this config has false: .* set optim\.use_distributed_optimizer: true"),
    ({"distributed": False}, True, r"holds the plain optimizer's state .* set "
                                   r"optim\.use_distributed_optimizer: false"),
    (None, True, r"holds the plain optimizer's state"),  # manifests before the record: plain
])
def test_the_optimizer_kind_must_match(written, now, message):
    refusal = optimizer_refusal("ckpt", manifest(written), now)
    assert refusal is not None and "\n" not in refusal
    assert re.search(message, refusal), refusal


def test_the_distributed_optimizers_state_resumes_only_under_its_layout():
    refusal = optimizer_refusal("ckpt", manifest(DIST), True, OTHER)
    assert refusal is not None and DISTRIBUTED_OPTIMIZER_SHARDING in refusal
    assert "expert 2" in refusal and "expert 1" in refusal
    assert optimizer_refusal("ckpt", manifest(DIST), True, LAYOUT) is None
    assert optimizer_refusal("ckpt", manifest(DIST), True) is None  # layout not known yet


def test_the_plain_optimizer_reshards_and_old_manifests_are_plain():
    assert optimizer_refusal("ckpt", manifest({"distributed": False}), False, OTHER) is None
    assert optimizer_refusal("ckpt", manifest(None), False, OTHER) is None
