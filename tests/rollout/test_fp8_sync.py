"""Issue 37, item 5: FP8 rollouts, bf16 training, end to end on the weight sync: the real
Megatron policy (EP2: two sending ranks) pushes by every transport with ``quantization="fp8"``
to two local servers started with ``--quantization fp8`` (tp_size 1 and 2) that run SGLang
0.5.23's own weight-update code (``FlattenedTensorBucket``, ``MultiprocessingSerializer``: the
float8_e4m3fn entries must pass them). Every TP rank of both servers then computes with the
dequantized FP8 blocks of the trainer's projections and its other weights exactly, and every
bucket's checksum (of the FP8 blocks and scales sent) is verified. In the extended tier
(tests/tiers.py): it starts servers and ranks.
"""

from __future__ import annotations

import pytest

from bench.spawn import run_on_ranks
from pipeline.generation.client import http_json
from tests.distributed.layouts import LAYOUTS
from tests.rollout import sync_worker
from tests.rollout.conftest import two_servers

TRANSPORTS = ["disk", "tensor", "distributed"]


@pytest.fixture(scope="module")
def fp8_servers(model_dir, sglang_subset, tmp_path_factory):
    shared = tmp_path_factory.mktemp("fp8_shared")
    with two_servers(model_dir, tmp_path_factory.mktemp("fp8_servers"),
                     ["--allow-pickled-tensors", "--weight-roots", str(shared),
                      "--quantization", "fp8"], pythonpath=sglang_subset) as urls:
        yield urls, shared


def test_every_transport_syncs_fp8_weights_to_fp8_servers(model_dir, fp8_servers):
    urls, shared = fp8_servers
    assert [http_json("GET", u + "/server_info")[1]["quantization"] for u in urls] == ["fp8"] * 2
    world, section = LAYOUTS["EP2"]
    report = run_on_ranks(world, sync_worker.run_fp8,
                          (section, str(model_dir), urls, TRANSPORTS, str(shared), 48 * 1024),
                          timeout_s=400)[0]
    assert [p["transport"] for p in report["pushes"]] == TRANSPORTS
    for push in report["pushes"]:
        stats = push["stats"]
        assert stats.num_buckets > 1 and stats.verified_buckets == stats.num_buckets, stats
        # 1 byte per projection element + 4 per scale block, the rest (fp32 here) as it is
        assert stats.wire_bytes == push["wire"] < stats.bytes
        assert push["servers"] == [[push["expected"]], [push["expected"]] * 2], push["transport"]
        assert push["expected"] != push["unquantized"]  # the rounding is there, and served
