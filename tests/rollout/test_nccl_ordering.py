"""The distributed weight sync under NCCL's semantics: bucket order by construction, no hang.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_nccl_ordering.py``

Two local servers (``--tp-size`` 1 and 2), two EP2 training ranks (two source ranks, buckets
alternating between them) that push the real Megatron policy twice with transport
``distributed`` inside :class:`tests.nccl_semantics.NcclSemantics` (``work.wait()`` returns
before the data has moved, as on a GPU), while alternate update requests are held back on their
way to each server (``tests/rollout/nccl_ordering_worker.py``), so that a request that leaves
before the previous bucket's answers are in reaches a server out of order. Checked:

* every push succeeds, within a bound far below the HTTP timeout (no cross-source deadlock);
* afterwards every TP rank of both servers holds exactly the trainer's weights (whole-model
  checksums);
* the update groups' broadcasts were really deferred (EP2 moves nothing inside the trainer: each
  source holds its tensors whole).

The pusher of commit 8b25bf7 (up to 4 buckets in flight per source, relying on ``wait()``
blocking the host) fails here: the servers take buckets out of order (wrong weights, a size
mismatch, or two servers each waiting in the other source's broadcast until the timeout).
"""

from __future__ import annotations

import pytest

from bench.spawn import run_on_ranks
from tests.rollout import nccl_ordering_worker
from tests.rollout.conftest import two_servers

pytestmark = pytest.mark.slow

BUCKET_BYTES = 64 << 10
PUSHES = 2
HTTP_DELAY_S = 0.15
STREAM_DELAY_S = 0.02
TIMEOUT_S = 20.0  # each HTTP call and update-group operation: a deadlock ends in an error


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    with two_servers(model_dir, tmp_path_factory.mktemp("nccl_servers")) as urls:
        yield urls


@pytest.fixture(scope="module")
def report(model_dir, servers):
    return run_on_ranks(2, nccl_ordering_worker.run,
                        (str(model_dir), servers, BUCKET_BYTES, PUSHES, STREAM_DELAY_S,
                         HTTP_DELAY_S, TIMEOUT_S), timeout_s=240)[0]


def test_the_collectives_were_deferred(report):
    assert report["sources"] == [0, 1]
    # one deferred broadcast per bucket on the source's update group (the control group's
    # object broadcasts stay host-blocking, as gloo on CPU tensors does on a GPU machine)
    assert report["my_buckets"] > PUSHES
    assert report["calls"] == {"broadcast": report["my_buckets"]}


@pytest.mark.parametrize("k", range(PUSHES))
def test_servers_hold_the_trainers_weights_after_each_push(report, k):
    assert len(report["pushes"]) > k, report["pushes"][-1]["outcome"]  # an earlier push failed
    push = report["pushes"][k]
    assert not isinstance(push["outcome"], str), push["outcome"]
    assert push["seconds"] < TIMEOUT_S, push["seconds"]
    for server in push["servers"]:
        assert server == [push["expected"]] * len(server), (server, push["expected"])
