"""The weight sync into vLLM 0.32 servers: transports behind ``WeightPusher``
(:class:`pipeline.weights.interface.Transport`), which keeps for every engine the pause, the bucket
order (a bucket's request leaves only once every server answered the previous one; the sources
take turns), the checksums, the version label and the recovery (:mod:`pipeline.weights.push`).
After every update the pusher labels the version (``/update_weight_version``) and resets the
prefix cache (``VllmControl.after_update``): vLLM keeps serving the old weights' KV otherwise.

``rollout.weight_sync.transport`` with ``rollout.engine: vllm``:

* ``distributed``, gloo (the CPU; :class:`VllmGlooTransport`): the project's worker extension
  (:mod:`pipeline.engines.vllm.worker_extension`) joins one gloo update group per source rank
  (world ``1 + workers``; the same rendezvous as SGLang's update groups); per bucket,
  ``/collective_rpc mgspo_receive_bucket`` on every server and one broadcast of the flat bucket;
  every worker answers the checksum of what it received (checked against the trainer's). At the
  end ``mgspo_load_received``: one in-place reload of every tensor received, then the CPU MoE
  repack (vLLM 0.32 skips it on an update).
* ``distributed``, NCCL (GPUs; :class:`VllmNcclTransport`): vLLM's own weight-transfer engine
  (servers started with ``--weight-transfer-config '{"backend": "nccl"}'``):
  ``/init_weight_transfer_engine`` once (trainer rank 0 of world ``1 + workers``, vLLM's
  ``StatelessProcessGroup`` rendezvous, unpacked), ``/start_weight_update``, per bucket
  ``/update_weights`` with the bucket's names, dtypes and shapes and one broadcast per tensor in
  that order, ``/finish_weight_update``. Refused on the CPU: there vLLM answers
  ``/start_weight_update`` with 200 after a failed NCCL init and the next generate kills the
  engine (docs/vllm.md). One source rank only (vLLM's engine has one sender).
* ``disk`` (:class:`VllmDiskTransport`): the shards as for SGLang, then
  ``/collective_rpc mgspo_load_from_disk``: an in-place reload of the directory, the MoE repack,
  and per shard the checksum of the tensors the worker read.
* ``tensor``: none (vLLM's ``ipc`` engine is CUDA IPC; refused with the alternatives).
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Optional

import torch

from pipeline.engines.vllm.client import collective_rpc
from pipeline.generation import client as rollout
from pipeline.weights import transport as wt
from pipeline.weights.disk import DiskTransport
from pipeline.weights.distributed import DistributedTransport
from pipeline.weights.interface import Pusher, Transport
from pipeline.weights.stats import SyncStats

NCCL_ON_CPU = (
    "rollout.weight_sync.transport: distributed over NCCL into vLLM needs GPUs (vLLM's "
    "weight-transfer engine); on the CPU vLLM 0.32 answers /start_weight_update with 200 after "
    "its NCCL init failed and the next generate kills the server. Use the gloo broadcast through "
    "the project's worker extension (no backend on a CPU machine) or transport: disk")
NCCL_MODULE = "vllm.distributed.weight_transfer.nccl_common"
"""vLLM's trainer-side NCCL rendezvous (``trainer_init``); imported where the NCCL transport
connects, on GPU machines whose trainer environment has vLLM."""


def _need_extension(pusher: Pusher, url: str, info: dict) -> None:
    if not info.get("worker_extension"):
        raise ValueError(
            f"{url}: rollout.weight_sync.transport {pusher.transport}: the vLLM server runs "
            "without the project's worker extension (start it with --worker-extension-cls "
            "pipeline.engines.vllm.worker_extension.WeightSyncExtension, the repository on its "
            "PYTHONPATH and VLLM_SERVER_DEV_MODE=1: pipeline.engines.vllm.server_args)")


class VllmGlooTransport(DistributedTransport):
    """The gloo broadcast through the worker extension (module docstring). The update groups
    are :class:`DistributedTransport`'s (one per source rank, made one after the other, torn
    down when the servers change or a bucket is refused); the server side of every call is the
    extension's, reached through ``/collective_rpc``."""

    supports_delta = False

    def __init__(self, pusher: Pusher, *, master_address: Optional[str], group_name: str):
        Transport.__init__(self, pusher)
        self.session_open = False
        self.master_address = master_address
        self.group_name = group_name
        self.backend = "gloo"
        self._update_group = None
        self._group_made = False

    def check_server(self, url: str, info: dict) -> None:
        _need_extension(self.pusher, url, info)
        if int(info.get("dp_size") or 1) != 1 or int(info.get("pp_size") or 1) != 1:
            raise ValueError(f"{url}: rollout.weight_sync.transport distributed into vLLM: "
                             "servers with data or pipeline parallelism are not supported; "
                             "use transport: disk")

    def begin(self, version: str) -> None:
        # a push that failed half-way may have left received tensors: they are not loaded
        self.pusher.each_server(lambda u: collective_rpc(u, "mgspo_drop_received",
                                                         timeout_s=self.pusher.timeout_s))

    def _join_server(self, url: str, *, address: str, port: int, rank_offset: int, world: int,
                     name: str):
        """One server's side of joining the update group: the worker extension's
        ``mgspo_join_group`` (the group's making is DistributedTransport's)."""
        return collective_rpc(url, "mgspo_join_group",
                              {"address": address, "port": port, "rank_offset": rank_offset,
                               "world_size": world, "group_name": name,
                               "timeout_s": self.pusher.timeout_s},
                              timeout_s=self.pusher.timeout_s)

    def send(self, bucket, version: str, wire, wire_flat: torch.Tensor, extra: dict,
             entry: dict) -> list:
        p = self.pusher
        spec = {"group_name": self.my_group_name(), "names": [n for n, _ in wire],
                "dtypes": [wt.dtype_name(t.dtype) for _, t in wire],
                "shapes": [list(t.shape) for _, t in wire]}

        def receive(url: str) -> dict:  # every worker's checksum of what it received
            answers = collective_rpc(url, "mgspo_receive_bucket", spec, timeout_s=p.timeout_s)
            return {"checksums": [a["checksum"] for a in answers]}

        answers = [p.pool.submit(receive, u) for u in p.server_urls]
        work = wt.broadcast(self._update_group, wire_flat.cpu(), 0, async_op=True)
        self._await_broadcast(work, answers)
        return answers

    def end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        p = self.pusher
        t0 = time.perf_counter()
        answers = p.each_server(lambda u: collective_rpc(u, "mgspo_load_received",
                                                         timeout_s=p.timeout_s))
        stats.phases["load_s"] = time.perf_counter() - t0
        repacks = [float(a.get("repack_s", 0.0)) for w in answers for a in w if a]
        if repacks:
            stats.phases["server_repack_s"] = max(repacks)

    def recover(self, notes: list[str]) -> None:
        for url in self.pusher.server_urls:
            try:
                collective_rpc(url, "mgspo_drop_received", timeout_s=min(self.pusher.timeout_s, 60))
            except rollout.RolloutError as err:
                notes.append(f"dropping the received buckets failed: {err}")

    def _destroy_server_groups(self) -> None:
        p = self.pusher
        for url in p.server_urls:
            try:
                collective_rpc(url, "mgspo_destroy_group", {"group_name": self.my_group_name()},
                               timeout_s=p.timeout_s)
            except rollout.RolloutError:
                pass  # dead, or the group is gone already


class VllmDiskTransport(DiskTransport):
    """The shards on disk, loaded by the worker extension (module docstring)."""

    def check_server(self, url: str, info: dict) -> None:
        _need_extension(self.pusher, url, info)

    def load(self, url: str, directory: Path, shards: list[str]) -> dict:
        p = self.pusher
        answers = collective_rpc(url, "mgspo_load_from_disk",
                                 {"path": str(directory), "checksum_shards": shards},
                                 timeout_s=p.timeout_s)
        sums: dict[str, list] = {}
        for answer in answers:
            for shard, digest in (answer.get("checksums") or {}).items():
                sums.setdefault(shard, []).append(digest)
        load_s = max((float(a.get("reload_s", 0.0)) for a in answers), default=0.0)
        return {"checksums": sums, "timings": {"load_s": load_s}}


class VllmNcclTransport(Transport):
    """vLLM's own NCCL weight-transfer engine (module docstring), GPUs only."""

    supports_delta = False

    def __init__(self, pusher: Pusher, *, master_address: Optional[str]):
        if not torch.cuda.is_available():
            raise ValueError(NCCL_ON_CPU)
        super().__init__(pusher)
        self.master_address = master_address
        self._comm = None  # rank 0: vLLM's PyNcclCommunicator with every worker
        self._open = False

    def check_server(self, url: str, info: dict) -> None:
        if int(info.get("dp_size") or 1) != 1:
            raise ValueError(f"{url}: rollout.weight_sync.transport distributed: a vLLM server "
                             "with data parallelism; use transport: disk")

    def connect(self, sources: list[int], stats: SyncStats):
        if len(sources) != 1 or sources[0] != 0:
            raise ValueError(f"rollout.weight_sync.transport distributed into vLLM over NCCL: "
                             f"the buckets come from ranks {sources}; vLLM's weight-transfer "
                             "engine takes one sender (trainer rank 0): use transport: disk")
        if self._comm is None and torch.distributed.get_rank() == 0:
            t0 = time.perf_counter()
            self._comm = self._init_engine()
            stats.phases["init_groups_s"] = time.perf_counter() - t0
        return None

    def _init_engine(self):
        p = self.pusher
        address = self.master_address or wt.routable_address(p.server_urls[0])
        port = wt.free_port(address)
        world = 1 + sum(p.tp)
        offsets = [1 + sum(p.tp[:i]) for i in range(len(p.tp))]
        futures = [p.pool.submit(rollout.control, u, "/init_weight_transfer_engine",
                                 {"init_info": {"master_address": address, "master_port": port,
                                                "rank_offset": offsets[i], "world_size": world,
                                                "packed": False}}, timeout_s=p.timeout_s)
                   for i, u in enumerate(p.server_urls)]
        try:
            nccl = importlib.import_module(NCCL_MODULE)
            return nccl.trainer_init({"master_address": address, "master_port": port,
                                      "world_size": world})
        finally:
            for f in futures:
                f.result()

    def begin(self, version: str) -> None:
        p = self.pusher
        p.each_server(lambda u: rollout.control(u, "/start_weight_update", {},
                                                timeout_s=p.timeout_s))
        self._open = True

    def send(self, bucket, version: str, wire, wire_flat: torch.Tensor, extra: dict,
             entry: dict) -> list:
        p = self.pusher
        info = {"names": [n for n, _ in wire],
                "dtype_names": [str(t.dtype).split(".")[-1] for _, t in wire],
                "shapes": [list(t.shape) for _, t in wire]}
        answers = [p.pool.submit(rollout.control, u, "/update_weights", {"update_info": info},
                                 timeout_s=p.timeout_s) for u in p.server_urls]
        stream = torch.cuda.current_stream()
        for _, tensor in wire:  # vLLM's unpacked receive: one broadcast per tensor, in order
            self._comm.broadcast(tensor.cuda().contiguous(), src=0, stream=stream)
        stream.synchronize()
        return answers

    def end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        p = self.pusher
        p.each_server(lambda u: rollout.control(u, "/finish_weight_update",
                                                {"weight_version": version},
                                                timeout_s=p.timeout_s))
        self._open = False

    def recover(self, notes: list[str]) -> None:
        if not self._open:
            return
        self._open = False
        for url in self.pusher.server_urls:
            try:
                rollout.control(url, "/finish_weight_update", {},
                                timeout_s=min(self.pusher.timeout_s, 60))
            except rollout.RolloutError as err:
                notes.append(f"finishing the weight update failed: {err}")

    def reset(self) -> None:
        self._comm = None  # the next push initialises the engine again with the new servers

    def close(self) -> None:
        self._comm = None


def make_transport(pusher: Pusher, transport: str, *, shared_dir=None, keep_versions: int = 1,
                   group_name: str = "megatron_gspo_weights", master_address=None, backend=None,
                   **_) -> Transport:
    """The vLLM transport named ``transport`` (module docstring)."""
    if transport == "disk":
        return VllmDiskTransport(pusher, shared_dir=shared_dir, keep_versions=keep_versions,
                                 spare_name=group_name)
    if transport == "distributed":
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if chosen == "nccl":
            return VllmNcclTransport(pusher, master_address=master_address)
        return VllmGlooTransport(pusher, master_address=master_address, group_name=group_name)
    raise ValueError(f"rollout.weight_sync.transport {transport!r} with rollout.engine vllm: "
                     "expected 'distributed' or 'disk' (vLLM's tensor engine is CUDA IPC)")
