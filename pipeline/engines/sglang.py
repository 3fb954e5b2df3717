"""SGLang behind the engine seam (:mod:`pipeline.engines.base`): the existing client's wire
(:class:`pipeline.generation.client.SGLangWire`), SGLang 0.5.23's control calls, the three
transports of :mod:`pipeline.weights` and the embedded cluster of ``megatron-gspo serve``
processes behind the sglang-router. Nothing here changes what those do; it names them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from pipeline.engines.base import PAUSE_MODES
from pipeline.generation import client as rollout
from pipeline.servers.cluster import LocalRolloutCluster
from pipeline.weights.disk import DiskTransport
from pipeline.weights.distributed import DistributedTransport
from pipeline.weights.tensor import TensorTransport

LOCAL_SERVER = "megatron-gspo local rollout server"  # its /server_info "implementation"
EXTENSIONS_KEY = "megatron_gspo_extensions"  # /server_info: the extensions a local server offers
EXTENSIONS_HEADER = "X-Megatron-Gspo-Extensions"  # a request's negotiated extensions


def offered_extensions(info: dict) -> set[str]:
    """The extensions a server's ``/server_info`` offers (none unless it is the local server)."""
    if info.get("implementation") != LOCAL_SERVER:
        return set()
    return {str(e) for e in (info.get(EXTENSIONS_KEY) or [])}


class SGLangControl:
    """SGLang 0.5.23's control calls (``docs/sglang_protocol.md``)."""

    pause_modes = PAUSE_MODES

    def extensions(self, info: dict) -> set[str]:
        return offered_extensions(info)

    def pause(self, url: str, mode: str, *, timeout_s: float) -> None:
        rollout.control(url, "/pause_generation", {"mode": mode}, timeout_s=timeout_s)

    def resume(self, url: str, *, timeout_s: float) -> None:
        rollout.control(url, "/continue_generation", {}, timeout_s=timeout_s)

    def after_update(self, url: str, mode: str, *, timeout_s: float) -> None:
        # abort and retract alike: the radix cache holds KV of the old weights (0.5.23 lets a
        # paused engine flush with retracted requests waiting; they are recomputed on continue)
        rollout.flush_cache(url, timeout_s=timeout_s)

    def set_version(self, url: str, version: str, *, timeout_s: float) -> None:
        # the version changes only once every bucket is in, and the label aborts nothing
        rollout.control(url, "/update_weight_version",
                        {"new_version": version, "abort_all_requests": False},
                        timeout_s=timeout_s)

    def weight_version(self, url: str, *, timeout_s: float) -> Optional[str]:
        info = rollout.control(url, "/model_info", method="GET", timeout_s=timeout_s) or {}
        return info.get("weight_version")

    def server_info(self, url: str, *, timeout_s: float) -> dict:
        info = rollout.control(url, "/server_info", method="GET", timeout_s=timeout_s)
        return info if isinstance(info, dict) else {}

    def liveness_path(self, paused: bool) -> str:
        # SGLang's /health generates a token, which waits while paused; /model_info does not
        return "/model_info" if paused else "/health"


class SGLangEngine:
    """SGLang (and the project's own server, which speaks its protocol)."""

    name = "sglang"
    wire = rollout.SGLANG_WIRE
    control = SGLangControl()

    def check(self, cfg, *, on_gpu: bool) -> None:
        """Nothing beyond the config's own checks."""

    def make_transport(self, pusher, transport: str, *, shared_dir=None, keep_versions: int = 1,
                       group_name: str = "megatron_gspo_weights", master_address=None,
                       backend=None, **_: Any):
        if transport == "disk":
            return DiskTransport(pusher, shared_dir=shared_dir, keep_versions=keep_versions,
                                 spare_name=group_name)
        if transport == "tensor":
            return TensorTransport(pusher)
        if transport == "distributed":
            return DistributedTransport(pusher, master_address=master_address,
                                        group_name=group_name, backend=backend)
        raise ValueError(f"rollout.weight_sync.transport {transport!r}: expected 'disk', "
                         "'tensor' or 'distributed'")

    def cluster(self, cfg, model_path: str, *, log_dir: Path,
                weights_dir: Path) -> LocalRolloutCluster:
        """``rollout.num_servers`` local rollout servers (``megatron-gspo serve``, SGLang's
        protocol) behind the sglang-router, with the flags the config asks for."""
        r = cfg.rollout
        # deterministic: one request at a time, and no prefix cache (which server cached what
        # depends on the history of the run; a resumed run starts with empty caches)
        server_args = (["--max-running-requests", "1", "--disable-radix-cache"]
                       if r.deterministic else [])
        server_args += ["--device", r.local_server_device]
        if r.weight_sync.transport == "tensor":  # SGLang's pickled payloads, loopback
            server_args.append("--allow-pickled-tensors")
        if r.quantization:  # FP8 rollouts: the servers compute with FP8 weights
            server_args += ["--quantization", r.quantization]
        if cfg.gspo.routing_replay == "rollout":  # the rollouts ask for routed experts
            server_args.append("--enable-return-routed-experts")
        # update_weights_from_disk reads only the disk sync's directory (and the served model)
        server_args += ["--weight-roots", str(weights_dir)]
        return LocalRolloutCluster(model_path, r.num_servers, log_dir=log_dir,
                                   random_seed=cfg.run.seed, server_args=server_args)


SGLANG = SGLangEngine()
