"""Issue 38, item 3: a server that refuses a ``distributed`` update without joining its broadcast.

The trainer's side of ``/update_weights_from_distributed`` is a broadcast on the update group; a
server that answers 400 before it receives (here: a dtype it does not know, as a trainer and a
server of different versions could disagree on) never joins that broadcast. Before the fix the
trainer waited in it for the group's timeout (``rollout.request_timeout_s``, 600 s by default).
Now the sync fails at once with the server's message, the groups are closed on both sides, and
the next push makes them again and succeeds.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from pipeline.servers.cluster import LocalRolloutCluster
from pipeline.weights import transport as wt
from pipeline.weights.push import WeightPusher, WeightPushError
from pipeline.weights.transport import weights_checksum
from pipeline.generation.client import http_json
from tests.reliability.loop_fakes import init_world_of_one
from tests.rollout.tiny import make_model_dir
from tests.reliability.test_dead_server import TensorStream

TIMEOUT_S = 60.0  # the group's timeout: the old code waited this long


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("refused")
    model = make_model_dir(base / "model")
    with LocalRolloutCluster(model, 1, log_dir=base / "logs") as cluster:
        yield cluster, cluster.server_urls[0].rstrip("/")


def weights(model_path: str, seed: int) -> dict:
    base = load_file(str(Path(model_path) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}


def test_a_refused_broadcast_update_fails_at_once_and_the_next_push_works(server, monkeypatch):
    cluster, url = server
    made = init_world_of_one()
    pusher = WeightPusher([url], transport="distributed", verify=True, timeout_s=TIMEOUT_S)
    try:
        first = weights(cluster.model_path, 1)
        pusher.push(TensorStream(first), "1")  # the groups exist: the refusal is mid-session
        real = wt.dtype_name
        monkeypatch.setattr(wt, "dtype_name", lambda dtype: "float7")
        t0 = time.monotonic()
        with pytest.raises(WeightPushError) as err:
            pusher.push(TensorStream(weights(cluster.model_path, 2)), "2")
        took = time.monotonic() - t0
        text = str(err.value)
        assert took < 20, f"the refused push took {took:.0f} s (the group's timeout: {TIMEOUT_S:.0f})"
        assert url in text and "/update_weights_from_distributed" in text, text
        assert "HTTP 400" in text and "float7" in text, text
        assert "generation resumed on every server" in text, text
        monkeypatch.setattr(wt, "dtype_name", real)
        third = weights(cluster.model_path, 3)
        stats = pusher.push(TensorStream(third), "3")  # new groups on both sides
        assert stats.verified_buckets == stats.num_buckets > 0
        got = http_json("POST", url + "/weights_checker", {"action": "checksum"})[1]
        assert got["checksum"] == weights_checksum(third.items())
        assert http_json("GET", url + "/model_info")[1]["weight_version"] == "3"
    finally:
        pusher.close()
        if made:
            dist.destroy_process_group()
