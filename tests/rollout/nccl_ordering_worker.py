"""Spawned training ranks of ``test_nccl_ordering`` (importable for spawn).

``run`` builds the real Megatron policy (EP2: two source ranks, whose buckets alternate), then
pushes it with transport ``distributed`` under :class:`tests.nccl_semantics.NcclSemantics`
(the update groups' broadcasts and the gather's point-to-point calls return before the data has
moved, as on NCCL; the gloo control group stays host-blocking, as ``cpu:gloo`` does on a GPU
machine), while every ``/update_weights_from_distributed`` request of bucket ``b`` to server
``i`` is held back ``http_delay_s`` when ``b + i`` is even: server 0 is slow for source 0's
buckets, server 1 for source 1's. A pusher that lets a request leave before every server has
answered the one before it lets the servers take the buckets in other orders than the
broadcasts': a server that takes bucket k+2 before k reads k's bytes under k+2's names, and two
servers that take two sources in opposite orders wait for each other.

Returns, on rank 0, per push: the pusher's outcome (stats or the error), the trainer's
whole-model checksum and every TP rank's checksum on every server; the deferred-call counts and
how many buckets rank 0 sent.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

UPDATE = "/update_weights_from_distributed"


def _delay_updates(rank: int, world_size: int, http_delay_s: float, server_urls: list[str]):
    """Wrap ``pipeline.generation.client.http_json`` (what ``rollout.control`` calls) in this rank."""
    from pipeline.generation import client as rollout
    original = rollout.http_json
    lock = threading.Lock()
    sent: dict[str, int] = {}  # server url -> this rank's update requests so far

    def delayed(method, url, body=None, **kwargs):
        if url.endswith(UPDATE):
            base = url[: -len(UPDATE)].rstrip("/")
            with lock:
                count = sent.get(base, 0)
                sent[base] = count + 1
            bucket = count * world_size + rank  # the sources take turns, bucket by bucket
            if (bucket + server_urls.index(base)) % 2 == 0:
                time.sleep(http_delay_s)
        return original(method, url, body, **kwargs)

    rollout.http_json = delayed
    return lambda: setattr(rollout, "http_json", original)


def run(rank: int, world_size: int, hf_dir: str, server_urls: list[str], bucket_bytes: int,
        pushes: int, stream_delay_s: float, http_delay_s: float, timeout_s: float):
    from megatron_gspo import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.hf.gather import HFGather
    from megatron_gspo.hf.hf_config import model_config_from_hf
    from megatron_gspo.model import gpt as policy
    from pipeline.weights.push import WeightPusher
    from tests.nccl_semantics import NcclSemantics
    from tests.rollout.sync_worker import _expected_checksum, _full_hf, _server_checksums

    par = ParallelConfig(expert=world_size)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes)
    control = dist.new_group(backend="gloo")
    pusher = WeightPusher(server_urls, transport="distributed", group=control,
                          timeout_s=timeout_s)
    report = {"pushes": [], "calls": {}, "sources": None, "my_buckets": 0}
    restore = _delay_updates(rank, world_size, http_delay_s, [u.rstrip("/") for u in server_urls])
    try:
        for k in range(pushes):
            policy.init_weights(gpt, model_cfg, pg, seed=900 + k)
            stream = gather.buckets(gpt, pg)
            report["sources"] = stream.sources
            report["my_buckets"] += sum(b.source == rank for b in stream.meta)
            t0 = time.perf_counter()
            semantics = NcclSemantics(delay_s=stream_delay_s, host_groups=[control])
            outcome = None
            try:
                with semantics:  # leaving it re-raises what a deferred call met
                    try:
                        outcome = pusher.push(stream, f"nccl-{k}")
                    except Exception as err:  # noqa: BLE001 - the test reports it
                        outcome = f"{type(err).__name__}: {err}"
            except Exception as err:  # the streams failed: the ranks' states may differ, stop
                raise RuntimeError(f"push {k}: the pusher's outcome: {outcome!r}; then {err}") \
                    from err
            if isinstance(outcome, str):  # failed alike on every rank (WeightPushError)
                report["pushes"].append({"outcome": outcome})
                break
            for name, n in semantics.calls.items():
                report["calls"][name] = report["calls"].get(name, 0) + n
            full = _full_hf(gpt, model_cfg, pg)
            servers = _server_checksums(server_urls) if rank == 0 else None
            report["pushes"].append({"outcome": outcome, "seconds": time.perf_counter() - t0,
                                     "expected": _expected_checksum(full) if rank == 0 else None,
                                     "servers": servers})
    finally:
        restore()
        pusher.close()
        parallel.destroy_model_parallel()
    return report
