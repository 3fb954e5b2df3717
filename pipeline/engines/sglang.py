"""SGLang behind the engine seam (:mod:`pipeline.engines.base`): the existing client's wire
(:class:`pipeline.generation.client.SGLangWire`), SGLang 0.5.23's control calls, the parity
probes' scoring (:class:`SGLangScorer`), the three transports of :mod:`pipeline.weights` and the
embedded cluster of ``megatron-gspo serve`` processes behind the sglang-router."""

from __future__ import annotations

import json
from collections.abc import Sequence
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


class SGLangScorer:
    """The parity probes through SGLang's native ``/generate`` (docs/sglang_protocol.md):
    ``input_ids`` = prompt + response, ``max_new_tokens: 0`` (prefill only), ``return_logprob:
    true`` and ``logprob_start_len: len(prompt) - 1``. SGLang then answers
    ``input_token_logprobs`` for the input tokens from that position on, the first entry
    ``[None, token, ...]`` (SGLang never gives the token AT ``logprob_start_len`` a value) and then
    one ``[logprob, token, text]`` per response token: the raw (T = 1) ``log_softmax(logits)``,
    without temperature. With ``routed_experts``, SGLang's ``return_routed_experts``."""

    def score_call(self, rid: str, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                   routed_experts: bool = False) -> tuple[str, dict]:
        body = {"rid": rid, "input_ids": list(prompt_ids) + list(response_ids),
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
                "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1,
                "stream": False}
        if routed_experts:
            body["return_routed_experts"] = True
        return "/generate", body

    def read_scores(self, body: Any, prompt_ids: Sequence[int], response_ids: Sequence[int],
                    url: str) -> tuple[list[float], Any]:
        """The last ``len(response)`` entries of ``input_token_logprobs``, their token ids
        checked; ``meta_info.routed_experts`` when present."""
        if isinstance(body, list) and len(body) == 1:
            body = body[0]
        n = len(response_ids)
        try:
            entries = body["meta_info"]["input_token_logprobs"]
            if len(entries) < n:
                raise ValueError(f"{len(entries)} input_token_logprobs for {n} response tokens")
            tail = entries[len(entries) - n:]
            ids = [int(e[1]) for e in tail]
            if ids != list(response_ids):
                raise ValueError(f"input_token_logprobs token ids {ids} are not the response "
                                 f"{list(response_ids)}")
            values = [float(e[0]) for e in tail]
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise rollout.RolloutError(url, 200, f"malformed parity /generate answer: {err}; "
                                                 f"body: {json.dumps(body)[:300]}") from None
        return values, (body.get("meta_info") or {}).get("routed_experts")


class SGLangEngine:
    """SGLang (and the project's own server, which speaks its protocol)."""

    name = "sglang"
    wire = rollout.SGLANG_WIRE
    control = SGLangControl()
    scorer = SGLangScorer()

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
