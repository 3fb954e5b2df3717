"""vLLM 0.32's generation and control API behind the engine seam (:mod:`pipeline.engines.base`).

**Generation** (:class:`VllmWire`, sent by ``pipeline.generation.client.RolloutClient``, which keeps
its retries, sticky servers, over-sampling and dead-server waits): one
``POST /inference/v1/generate`` per sample (the server needs ``--enable-scale-out``) with the
prompt's token ids, ``sampling_params`` in vLLM's names (``max_tokens``, ``seed``, ``logprobs: 0``
= the sampled token's log-prob, ``n: 1``: the client sends G requests with their own seeds, as for
SGLang), and ``request_id`` = the sample's rid, which vLLM names ``generate-tokens-<rid>``
(:func:`vllm_request_id`: what ``/abort_requests`` takes). The answer's choice gives
``token_ids``, ``logprobs.content[i].logprob``, ``finish_reason`` (``stop``, ``length``,
``abort``) and ``weight_versions``: spans ``{version, start, end}`` over the output tokens, the
label of ``/update_weight_version`` at the time each token was sampled, read into the same
:class:`~pipeline.generation.trajectory.Span` list as SGLang's.

**Log-probs**: the servers run with ``--logprobs-mode processed_logprobs`` (:data:`SERVER_FLAGS`):
the log-probs of the distribution sampled from, after temperature (vLLM's default is the raw
model's, before temperature). That is SGLang's ``output_token_logprobs`` where top-p and top-k
do not truncate (``rollout.top_p: 1``, ``rollout.top_k: -1``); with truncation vLLM renormalises
over the kept tokens, which SGLang does not (``pipeline.engines.choice`` refuses it).

**Control** (:class:`VllmControl`, ``VLLM_SERVER_DEV_MODE=1``): ``/pause?mode=`` (the pipeline's
``abort``: requests in flight come back with ``finish_reason: "abort"`` and their output so far;
``retract``: vLLM's ``keep``, the requests stay frozen on the server, and
``/reset_prefix_cache?reset_running_requests=true`` after the update preempts them, so they are
recomputed from their tokens under the new weights on ``/resume``, as SGLang's retract does;
vLLM's own ``keep`` and ``wait`` are passed through), ``/resume``, ``/update_weight_version``,
``/weight_info``, ``/reset_prefix_cache`` (the KV the old weights computed: after EVERY update,
else the prefix cache serves it), ``/server_info``. ``/health`` answers while paused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional

import torch

from pipeline.engines.vllm import routed_experts as vllm_routed
from pipeline.generation import client as rollout
from pipeline.generation.answers import Malformed
from pipeline.generation.trajectory import RolloutResult, Span
from pipeline.generation.version import from_wire

GENERATE_PATH = "/inference/v1/generate"
REQUEST_PREFIX = "generate-tokens-"
"""vLLM 0.32's serving prefixes the caller's ``request_id`` with this (``serve_tokens``)."""
SERVER_FLAGS = ("--logprobs-mode", "processed_logprobs")
"""Flags every vLLM rollout server needs beyond ``server_args.server_argv`` (module docstring)."""
PAUSE_MODES = ("abort", "retract", "keep", "wait")
"""The pipeline's two (``pipeline.engines.base.PAUSE_MODES``) and vLLM's own ``keep``/``wait``."""
VLLM_MODE = {"abort": "abort", "retract": "keep", "keep": "keep", "wait": "wait"}
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def vllm_request_id(rid: str) -> str:
    """The id vLLM gives the request the client sent as ``rid`` (``/abort_requests`` takes it)."""
    return REQUEST_PREFIX + rid


def sampling_json(sampling: rollout.SamplingParams) -> dict:
    """``client.SamplingParams`` (SGLang's names) in vLLM's ``SamplingParams`` names."""
    body = {"temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else 0,
            "max_tokens": sampling.max_new_tokens, "n": sampling.n,
            "stop_token_ids": [int(t) for t in sampling.stop_token_ids], "logprobs": 0,
            "skip_special_tokens": sampling.skip_special_tokens, "detokenize": False}
    if sampling.sampling_seed is not None:
        body["seed"] = int(sampling.sampling_seed) % (2 ** 63)
    return body


def parse_answer(body: dict, rid: str, prompt_ids: Sequence[int], url: str) -> RolloutResult:
    """One ``/inference/v1/generate`` answer (n = 1) -> the sample; :class:`Malformed` if its
    shape is not vLLM 0.32's."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or len(choices) != 1:
        raise Malformed(f"{rid}: expected one choice, got {str(body)[:500]}")
    choice = choices[0]
    ids = [int(t) for t in (choice.get("token_ids") or [])]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids) or any(int(c["token_id"]) != t for c, t in zip(content, ids)):
        raise Malformed(f"{rid}: {len(content)} log-probs for {len(ids)} output tokens")
    finish = FINISH.get(choice.get("finish_reason"))
    if finish is None:
        raise Malformed(f"{rid}: finish_reason {choice.get('finish_reason')!r}")
    spans = [Span(from_wire(str(s["version"])), int(s["start"]), int(s["end"]))
             for s in (choice.get("weight_versions") or [])]
    at = 0
    for span in spans:
        if span.start != at or span.end < span.start:
            raise Malformed(f"{rid}: weight_versions {choice.get('weight_versions')} do not "
                            f"tile the {len(ids)} output tokens")
        at = span.end
    if ids and at != len(ids):
        raise Malformed(f"{rid}: weight_versions {choice.get('weight_versions')} do not tile "
                        f"the {len(ids)} output tokens")
    usage = body.get("usage") or {}
    stop = choice.get("stop_reason")
    matched = stop if stop is not None else (ids[-1] if finish == "stop" and ids else None)
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return RolloutResult(
        rid=rid, prompt_ids=list(prompt_ids), output_ids=ids,
        output_logprobs=[float(c["logprob"]) for c in content], finish_reason=finish,
        matched_stop=matched, prompt_tokens=int(usage.get("prompt_tokens", len(prompt_ids))),
        completion_tokens=len(ids), weight_version=spans[-1].version if spans else None,
        server_url=url, weight_versions=[s for s in spans if s.end > s.start],
        cached_tokens=int(cached))


def collective_rpc(url: str, method: str, spec: Optional[dict] = None, *,
                   timeout_s: float) -> list:
    """``/collective_rpc`` of a worker-extension method with one JSON argument (``spec``: its
    ``spec`` keyword, a string over HTTP); every worker's answer, in rank order."""
    body = {"method": method, "kwargs": {"spec": json.dumps(spec or {})}, "timeout": timeout_s}
    answer = rollout.control(url, "/collective_rpc", body, timeout_s=timeout_s)
    return list((answer or {}).get("results") or [])


def describe_workers(url: str, *, timeout_s: float) -> Optional[list]:
    """Each worker's ``mgspo_describe`` (None: the server runs without the project's worker
    extension: vLLM answers 500 for an unknown method)."""
    try:
        return collective_rpc(url, "mgspo_describe", timeout_s=timeout_s)
    except rollout.RolloutError as err:
        if err.status is None:
            raise
        return None


class VllmWire:
    """vLLM's generation requests (``pipeline.engines.base.GenerationWire``)."""

    name, generate_path, health_path = "vllm", GENERATE_PATH, "/health"

    def payload(self, rid: str, input_ids: Sequence[int], sampling, *,
                return_routed_experts: bool = False) -> dict:
        params = sampling_json(sampling)
        if return_routed_experts:  # a server with --enable-return-routed-experts sends them on
            params["routed_experts_prompt_start"] = 0  # every answer; rows from position 0
        return {"request_id": rid, "token_ids": [int(t) for t in input_ids],
                "sampling_params": params, "output_mode": "tokens", "stream": False}

    async def read(self, raw: bytes, rid: str, prompt_ids: Sequence[int], url: str, *,
                   routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
        """``routed_experts=(num_layers, top_k)``: the choice's routed experts (routing replay
        ``rollout``, GPU servers: ``pipeline.engines.vllm.routed_experts``) into
        ``RolloutResult.routed_experts``, int32 ``[prompt + output - 1, L, K]``."""
        try:
            body = json.loads(raw)
            result = parse_answer(body, rid, prompt_ids, url)
            if routed_experts is not None:
                routed = vllm_routed.from_choice(
                    body["choices"][0], prompt_len=len(prompt_ids),
                    output_len=len(result.output_ids), num_layers=routed_experts[0],
                    top_k=routed_experts[1])
                result.routed_experts = None if routed is None else torch.from_numpy(routed)
            return result
        except (Malformed, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise rollout.RolloutError(url, 200, f"malformed answer: {err}") from None

    def abort_call(self, rid: Optional[str]) -> tuple[str, dict]:
        return "/abort_requests", ({"request_ids": [vllm_request_id(rid)]} if rid else {})


class VllmScorer:
    """The parity probes (``pipeline.engines.base.ProbeScorer``) through
    ``/inference/v1/generate``: ``token_ids`` = prompt + response, ``prompt_logprobs: 0`` (each
    input token's own log-prob, no alternatives), ``max_tokens: 1`` (vLLM's least; the one
    generated token is ignored). vLLM 0.32 answers ``prompt_logprobs``: ``None`` for the first
    input token, then one ``{token_id: {"logprob", "rank", "decoded_token"}}`` per input token,
    the raw (T = 1) ``log_softmax`` whatever ``--logprobs-mode`` (prompt tokens skip the sampling
    processors: ``GPUModelRunner._get_prompt_logprobs_dict``), ``-inf`` sent as -9999. Routed
    experts of a prefill are not asked for (the parity routing hook is SGLang's)."""

    def score_call(self, rid: str, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                   routed_experts: bool = False) -> tuple[str, dict]:
        if routed_experts:
            raise ValueError("parity routing hook: vLLM's scorer does not ask for the routed "
                             "experts of a prefill")
        return GENERATE_PATH, {
            "request_id": rid, "token_ids": [int(t) for t in [*prompt_ids, *response_ids]],
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                                "detokenize": False},
            "output_mode": "tokens", "stream": False}

    def read_scores(self, body: Any, prompt_ids: Sequence[int], response_ids: Sequence[int],
                    url: str) -> tuple[list[float], Any]:
        """The response tokens' entries of ``prompt_logprobs``, each keyed by its own token."""
        try:
            entries = body["prompt_logprobs"]
            total = len(prompt_ids) + len(response_ids)
            if not isinstance(entries, list) or len(entries) != total:
                raise ValueError(f"{len(entries) if isinstance(entries, list) else entries!r} "
                                 f"prompt_logprobs for {total} input tokens")
            values = []
            for position, token in enumerate(response_ids, start=len(prompt_ids)):
                entry, key = entries[position] or {}, str(int(token))
                if key not in entry:
                    raise ValueError(f"prompt_logprobs[{position}] scores {sorted(entry)}, not "
                                     f"the response token {key}")
                values.append(float(entry[key]["logprob"]))
        except (KeyError, TypeError, ValueError) as err:
            raise rollout.RolloutError(url, 200, f"malformed parity answer: {err}; body: "
                                                 f"{json.dumps(body)[:300]}") from None
        return values, None


class VllmControl:
    """vLLM 0.32's control calls (module docstring)."""

    pause_modes = PAUSE_MODES

    def pause(self, url: str, mode: str, *, timeout_s: float) -> None:
        if mode not in VLLM_MODE:
            raise ValueError(f"pause mode {mode!r}: expected one of {PAUSE_MODES}")
        # clear_cache=false: the cache is reset after the update (after_update), never twice
        rollout.control(url, f"/pause?mode={VLLM_MODE[mode]}&clear_cache=false",
                        timeout_s=timeout_s)

    def resume(self, url: str, *, timeout_s: float) -> None:
        rollout.control(url, "/resume", timeout_s=timeout_s)

    def is_paused(self, url: str, *, timeout_s: float = 10.0) -> bool:
        return bool(rollout.control(url, "/is_paused", method="GET",
                                    timeout_s=timeout_s)["is_paused"])

    def after_update(self, url: str, mode: str, *, timeout_s: float) -> None:
        self.reset_prefix_cache(url, running=VLLM_MODE.get(mode) == "keep", timeout_s=timeout_s)

    def reset_prefix_cache(self, url: str, *, running: bool, timeout_s: float) -> None:
        """``/reset_prefix_cache`` (``running``: preempt the requests that hold KV, recomputed
        later); its ``success: false`` (blocks still held) is a ``RolloutError``."""
        query = "?reset_running_requests=true" if running else ""
        rollout.control(url, "/reset_prefix_cache" + query, timeout_s=timeout_s)

    def set_version(self, url: str, version: str, *, timeout_s: float) -> None:
        rollout.control(url, "/update_weight_version", {"new_version": version},
                        timeout_s=timeout_s)

    def weight_version(self, url: str, *, timeout_s: float) -> Optional[str]:
        return (rollout.control(url, "/weight_info", method="GET", timeout_s=timeout_s)
                or {}).get("weight_version")

    def server_info(self, url: str, *, timeout_s: float) -> dict:
        """vLLM's ``/server_info`` (its config as one string) read into what the pusher asks,
        and whether the server runs the project's worker extension (``mgspo_describe``)."""
        info = rollout.control(url, "/server_info", method="GET", timeout_s=timeout_s) or {}
        config = str(info.get("vllm_config", "")) if isinstance(info, dict) else ""
        fields = dict(part.strip().split("=", 1) for part in config.split(", ") if "=" in part)
        workers = describe_workers(url, timeout_s=timeout_s)
        quantization = fields.get("quantization", "None")
        return {"implementation": "vllm", "tp_size": int(fields.get("tensor_parallel_size", 1)),
                "pp_size": int(fields.get("pipeline_parallel_size", 1)),
                "dp_size": int(fields.get("data_parallel_size", 1)),
                "worker_extension": workers is not None, "workers": workers,
                "quantization": None if quantization == "None" else quantization}

    def extensions(self, info: dict) -> set[str]:
        """Checksums where the server runs the project's worker extension (its gloo and disk
        loads answer the checksum of what they received)."""
        return {"checksums"} if info.get("worker_extension") else set()

    def liveness_path(self, paused: bool) -> str:
        return "/health"  # vLLM's /health answers while paused
