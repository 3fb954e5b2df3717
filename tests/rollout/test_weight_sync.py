"""Weight sync from the real Megatron policy to local rollout servers that run SGLang's own code.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_weight_sync.py``

Two servers, the second with ``--tp-size 2`` (two group members at consecutive ranks, each
deserialising its own tensor entry), both with ``PYTHONPATH`` = SGLang 0.5.23's own
``init_custom_process_group``, ``MultiprocessingSerializer`` (``SafeUnpickler``) and
``FlattenedTensorBucket`` from the wheel (``conftest.sglang_subset``): a trainer whose store keys,
pickles or bucket layout differ from SGLang's fails here.

* log-prob agreement (EP2): the servers' ``output_token_logprobs`` against Megatron's
  recomputed ``token_log_probs`` on the same HF weights: max |diff| < 1e-4 in fp32;
* each transport (disk, tensor, distributed) from EP2 with 64 KiB buckets: every HF piece of
  every rank bit-equal on both servers, ``weight_version`` advanced, greedy outputs = Megatron's;
* every transport from DP2, TP2, EP2, PP2 and TP2xEP2: every bucket's checksum verified on every
  TP rank of both servers, and every TP rank's whole-model checksum = the trainer's weights;
* bf16 delta syncs (PP2, distributed and tensor): bit-exact server weights after each of N syncs;
* repeated disk pushes that overwrite the retired version's files in place (a changing number of
  shards): exact server weights and exactly the new shards on disk after each;
* the key mismatch that hung before: a group made the plain TCPStore way never meets SGLang's.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import sys

import pytest

from pipeline.generation.client import http_json
from tests.distributed.layouts import LAYOUTS
from bench.spawn import run_on_ranks
from tests.rollout import sync_worker
from tests.rollout.conftest import two_servers

TRANSPORTS = ["disk", "tensor", "distributed"]
LAYOUT_NAMES = ["DP2", "TP2", "EP2", "PP2", "TP2xEP2"]
SPREAD = {"EP2", "PP2", "TP2xEP2"}  # layouts whose buckets have more than one sending rank


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    """The disk transport's shared directory (the servers may load weights from it)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def servers(model_dir, sglang_subset, shared_root, tmp_path_factory):
    """Two local servers (tp_size 1 and 2) running SGLang's weight-update code."""
    with two_servers(model_dir, tmp_path_factory.mktemp("servers"),
                     ["--allow-pickled-tensors", "--weight-roots", str(shared_root)],
                     pythonpath=sglang_subset) as urls:
        yield urls


def test_servers_run_sglangs_own_weight_update_code(servers, sglang_subset):
    infos = [http_json("GET", u + "/server_info")[1] for u in servers]
    assert [i["tp_size"] for i in infos] == [1, 2]
    for info in infos:
        assert info["weight_sync_impl"] == f"sglang ({sglang_subset / 'sglang' / 'srt' / 'utils'})"
        assert info["allow_pickled_tensors"] is True


@pytest.fixture(scope="module")
def report(model_dir, servers, shared_root):
    per_rank = run_on_ranks(2, sync_worker.run,
                            (str(model_dir), servers, TRANSPORTS, str(shared_root / "ep2"),
                             64 * 1024), timeout_s=300)
    return per_rank[0]


def test_server_logprobs_match_megatron_recomputation(report):
    diffs = [r["max_abs_diff"] for r in report["logprobs"]]
    assert len(diffs) == 8 and {r["temperature"] for r in report["logprobs"]} == {1.0, 0.7}
    print(f"max |server - megatron| log-prob: {max(diffs):.3g}")
    assert max(diffs) < 1e-4


@pytest.mark.parametrize("index", range(len(TRANSPORTS)), ids=TRANSPORTS)
def test_sync_makes_servers_serve_the_new_weights(report, index):
    sync = report["syncs"][index]
    assert sync["transport"] == TRANSPORTS[index]
    stats = sync["stats"]
    assert stats.num_buckets > 1 and stats.num_tensors == 45 and stats.bytes > 0
    assert stats.verified_buckets == stats.num_buckets  # every bucket, every TP rank, both servers
    for per_rank in sync["mismatched"]:  # every rank's pieces, both servers, bit for bit
        assert per_rank and all(bad == [] for bad in per_rank.values()), per_rank
    assert all(v == (sync["version"], {sync["version"]}) for v in sync["versions"])
    for before, after in zip(sync["before"], sync["after"]):
        assert after == sync["expected"]  # Megatron's greedy tokens under the new weights
        assert after[0] != before


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_every_layout_syncs_checksum_verified(layout, model_dir, servers, shared_root):
    world, section = LAYOUTS[layout]
    report = run_on_ranks(world, sync_worker.run_layout,
                          (section, str(model_dir), servers, TRANSPORTS, str(shared_root / layout),
                           48 * 1024), timeout_s=400)[0]
    if layout in SPREAD:
        assert len(report["sources"]) > 1, report["sources"]  # no funnel through one rank
    else:
        assert report["sources"] == [0]
    assert [p["transport"] for p in report["pushes"]] == TRANSPORTS
    for push in report["pushes"]:
        stats = push["stats"]
        assert stats.num_buckets > 1 and stats.verified_buckets == stats.num_buckets, stats
        # every TP rank of both servers holds exactly the trainer's weights
        assert push["servers"] == [[push["expected"]], [push["expected"]] * 2], push["transport"]


@pytest.mark.parametrize("senders", ["node", "stage"])
def test_one_sender_per_node_or_stage_syncs_the_same_weights(senders, model_dir, servers,
                                                             shared_root):
    """rollout.weight_sync.senders node / stage: EP2 (two sending ranks, two update groups per
    server GPU with ``rank``) sends everything from rank 0 - one host, one stage - through one
    update group; every TP rank of both servers holds exactly the trainer's weights."""
    world, section = LAYOUTS["EP2"]
    report = run_on_ranks(world, sync_worker.run_layout,
                          (section, str(model_dir), servers, ["distributed"],
                           str(shared_root / f"senders_{senders}"), 48 * 1024, senders),
                          timeout_s=400)[0]
    assert report["sources"] == [0]
    (push,) = report["pushes"]
    stats = push["stats"]
    assert stats.num_buckets > 1 and stats.verified_buckets == stats.num_buckets, stats
    assert push["servers"] == [[push["expected"]], [push["expected"]] * 2]


def test_disk_pushes_overwrite_the_retired_version_in_place(model_dir, servers, shared_root):
    shared = shared_root / "recycled"
    shared.mkdir()
    sizes = [48 * 1024, 48 * 1024, 96 * 1024, 32 * 1024]  # fewer, then more shards than before
    report = run_on_ranks(1, sync_worker.run_disk_recycled,
                          (str(model_dir), servers, str(shared), sizes), timeout_s=300)[0]
    pushes, closed = report[:-1], report[-1]["after_close"]
    spare = ".megatron_gspo_weights_spare"
    for k, push in enumerate(pushes):
        stats = push["stats"]
        assert stats.num_buckets > 1 and stats.verified_buckets == stats.num_buckets, stats
        assert push["servers"] == [[push["expected"]], [push["expected"]] * 2], k
        assert push["files"] == sorted(push["indexed"] + ["model.safetensors.index.json"]), k
        # the kept version, and from the second push on the retired one kept as the spare
        assert push["listing"] == ([spare] if k else []) + [f"weights_vrecycled-{k}"], push
    assert len({len(p["indexed"]) for p in pushes}) == 3  # three different shard counts
    assert closed == ["weights_vrecycled-3"]


@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_bf16_delta_syncs_are_bit_exact(transport, model_dir, servers):
    syncs = run_on_ranks(2, sync_worker.run_delta,
                         ({"pipeline": 2}, str(model_dir), servers, transport, 5, 3, 48 * 1024),
                         timeout_s=400)[0]
    assert [s["stats"].delta for s in syncs] == [False, True, True, False, True]  # full every 3
    for s in syncs:
        stats = s["stats"]
        assert stats.verified_buckets == stats.num_buckets
        assert s["servers"] == [[s["expected"]], [s["expected"]] * 2]  # bit-exact, every TP rank
        if stats.delta:
            print(f"{transport} delta: {stats.wire_bytes} of {stats.bytes} bytes")
            assert stats.wire_bytes < stats.bytes / 2


def _sglang_side(subset: str, port: int, out) -> None:
    sys.path.insert(0, subset)
    from sglang.srt.utils import init_custom_process_group

    from pipeline.weights.transport import tcp_init_method

    try:
        init_custom_process_group(backend="gloo", init_method=tcp_init_method("127.0.0.1", port),
                                  world_size=2, rank=1, group_name="g",
                                  # counts from here, after the imports; the trainer side is
                                  # already waiting in the store, so 6 s is plenty to meet it
                                  timeout=datetime.timedelta(seconds=6))
        out.put("met")
    except Exception as err:  # noqa: BLE001 - the parent asserts on it
        out.put(f"{type(err).__name__}")


@pytest.mark.parametrize("trainer_side", ["plain_tcpstore", "ours"])
def test_group_keys_meet_sglangs(trainer_side, sglang_subset):
    """The trainer side made as before (a TCPStore + one PrefixStore + ProcessGroupGloo) never
    meets SGLang's side (its keys carry two more prefixes); ours does."""
    import torch.distributed as dist

    from pipeline.weights import transport as wt
    port = wt.free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_sglang_side, args=(str(sglang_subset), port, out))
    proc.start()
    # the plain group's wait for keys that never come (joining the store itself has 90 s)
    timeout = datetime.timedelta(seconds=5)
    try:
        if trainer_side == "ours":
            group = wt.new_update_group("127.0.0.1", port, 0, 2, group_name="g", timeout_s=90)
            wt.destroy_group(group)
        else:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=True,
                                  timeout=datetime.timedelta(seconds=90))
            store.set_timeout(timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            with pytest.raises(Exception):
                dist.ProcessGroupGloo(dist.PrefixStore("g", store), 0, 2, options)
        answer = out.get(timeout=60)
    finally:
        proc.join(30)
    if trainer_side == "ours":
        assert answer == "met"
    else:
        assert answer != "met", answer  # SGLang's side timed out waiting for keys never written


def test_pickled_tensors_only_on_loopback(model_dir):
    import argparse

    from launch.serve import add_arguments
    from pipeline.local.server import LocalRolloutServer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", str(model_dir), "--host", "0.0.0.0",
                              "--allow-pickled-tensors"])
    with pytest.raises(ValueError, match="127.0.0.1"):
        LocalRolloutServer(args)
