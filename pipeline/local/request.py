"""One request of the local rollout server's engine (after ``n`` expansion), and its weight versions.

:class:`EngineRequest` is what the engine thread schedules, prefills and decodes; the two functions
build ``meta_info.weight_versions`` exactly as SGLang 0.5.23 does (the scheduler's
:func:`compute_weight_version_spans` at finish, the TokenizerManager's
:func:`add_weight_versions_to_meta_info` in the answer).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from pipeline.local.protocol import Sampling

QUEUE_FULL = "The request queue is full."  # SGLang's message (Scheduler._abort_on_queued_limit)


def compute_weight_version_spans(events: list[tuple[str, int]], current_version: str,
                                 num_output_tokens: int) -> list[dict]:
    """SGLang 0.5.23's ``compute_weight_version_spans`` (srt/utils/weight_versions.py), line for
    line: ``events`` are (old version, output tokens at the change); spans are dicts."""
    changes = list(events) + [(current_version, num_output_tokens)]
    spans: list[dict] = []
    for version, end in changes:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        start = spans[-1]["end"] if spans else 0
        spans.append({"version": version, "start": start, "end": end})
    return spans


def add_weight_versions_to_meta_info(meta_info: dict, spans: list[dict],
                                     num_output_tokens: int) -> None:
    """SGLang 0.5.23's ``add_weight_versions_to_meta_info`` (the TokenizerManager side)."""
    visible = [s for s in spans if s["start"] < num_output_tokens or s["start"] == 0]
    meta_info["weight_versions"] = [
        {"version": s["version"], "start": s["start"], "end": min(s["end"], num_output_tokens)}
        for s in visible]
    meta_info["weight_version"] = visible[-1]["version"]


class QueueFull(RuntimeError):
    """``submit`` would put more requests in the waiting queue than ``max_queued_requests``."""

    def __init__(self) -> None:
        super().__init__(QUEUE_FULL)


class EngineRequest:
    """One sample being generated (after ``n`` expansion)."""

    def __init__(self, rid: str, input_ids: list[int], sampling: Sampling, *,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, on_event: Optional[Callable[[str], None]] = None,
                 return_routed_experts: bool = False, routed_experts_start_len: int = 0):
        self.rid = rid
        self.input_ids = list(input_ids)
        self.sampling = sampling
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_routed_experts = return_routed_experts
        self.routed_experts_start_len = routed_experts_start_len
        self.routed: list[torch.Tensor] = []
        """Engine thread: int32 [positions, num_layers, top_k] chunks, in position order, of the
        experts each input token was routed to (with ``--enable-return-routed-experts``: for a
        request with ``return_routed_experts``, and for every request while the prefix cache is
        on; a cached prefix's chunk is the routes recorded when its KV was computed)."""
        self.on_event = on_event  # called from the engine thread: "token" or "finish"
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: Optional[list[Optional[float]]] = None
        self.input_top: Optional[list[Optional[list[tuple[float, int]]]]] = None
        self.finish: Optional[dict] = None
        self.was_running = False
        self.weight_version = ""
        self.weight_version_events: list[tuple[str, int]] = []
        """SGLang's ``req.weight_version_events``: (old version, output tokens then) recorded at
        each weight-version change while this request was live and had output."""
        self.weight_version_spans: list[dict] = []
        """At finish: SGLang's ``compute_weight_version_spans`` of the events (dicts
        ``version`` / ``start`` / ``end``, half-open over the output tokens)."""
        self.num_retractions = 0  # SGLang's req.retraction_count (pause mode "retract")
        self.cached_tokens = 0
        """``meta_info.cached_tokens``: prompt tokens whose KV came from the prefix cache at the
        request's first prefill (SGLang counts them once; a retracted request keeps the count)."""
        self.max_new_tokens = sampling.max_new_tokens
        self.created = time.time()
        self.e2e_latency = 0.0
        self.generator: Optional[torch.Generator] = None
        self._abort = False

    @property
    def finished(self) -> bool:
        return self.finish is not None
