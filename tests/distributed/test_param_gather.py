"""With ``parallel.overlap_param_gather``, every reader of the weights gets the last step's.

Megatron's distributed optimizer updates only this rank's shard of each parameter at
``optimizer.step()``; with the overlap the other ranks' shards arrive in the NEXT forward's
pre-hooks. The weight sync, checkpoints and the HF export read the parameters between the step
and that forward (issue 37 item 2; by default ``gspo.routing_metrics`` runs a forward after the
last update that hides it, so it is off here). Two data-parallel ranks over gloo, the
distributed optimizer (CPU accommodation 9), overlapped gradient reduce and parameter gather.
After each of three steps one reader reads first (push / checkpoint / export); each must get
bit for bit what Megatron's own forced gather then gives. The test also checks its own
premise: right after each step the raw parameters were behind on some tensors. The trainer
loaded from the checkpoint then takes step 3 too: bit for bit the uninterrupted step 3.
"""

from __future__ import annotations

import pytest

from bench.spawn import run_on_ranks
from tests.distributed import param_gather_worker
from tests.distributed.layouts import tiny_config
from tests.distributed.test_rl_trainer_layouts import RUN, rollout_batch

PARALLEL = {"overlap_grad_reduce": True, "overlap_param_gather": True}
OPTIM = {"optimizer": "adam", "lr": 1e-2, "use_distributed_optimizer": True}
GSPO = {"routing_metrics": False, "updates_per_rollout": 2}


@pytest.fixture(scope="module")
def readers(tmp_path_factory):
    cfg = tiny_config(PARALLEL, optim=OPTIM, gspo=GSPO, run=RUN)
    return run_on_ranks(2, param_gather_worker.run,
                        (cfg, rollout_batch(), str(tmp_path_factory.mktemp("run"))),
                        timeout_s=300)


def test_push_checkpoint_and_export_read_the_last_steps_weights(readers):
    not_behind, stale = [], {}
    for rank, result in enumerate(readers):
        for reader in ("push", "checkpoint", "export"):
            if reader not in result:  # the export is read back on rank 0
                continue
            if not result[reader]["behind"]:
                not_behind.append((rank, reader))
            if result[reader]["stale"]:
                stale[(rank, reader)] = result[reader]["stale"][:3]
    assert not not_behind, ("no parameter was behind after the step: the test no longer sees "
                            f"the overlap: {not_behind}")
    assert not stale, f"these readers got the previous step's values: {stale}"
    assert readers[0]["push"]["sent"] > 0 and "export" in readers[0]


def test_distributed_optimizer_checkpoint_resumes_exactly(readers):
    """The distributed optimizer's checkpoint (Megatron's dp_reshardable state, loaded into a
    fresh torch Adam: checkpoint/state.py) gives a resumed step bit for bit the uninterrupted
    one's."""
    for rank, result in enumerate(readers):
        assert result["resumed_step"] == [], (rank, result["resumed_step"])
