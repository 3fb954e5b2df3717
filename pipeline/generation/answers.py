"""One ``/generate`` answer read and checked, with no torch and no HTTP client: what the rollout
client does with every answer (``pipeline.generation.client.parse_generate_response``), and what
its parse process runs (``pipeline.generation.parse_pool``), which must start light.

:func:`read_answer` turns SGLang 0.5.23's answer (``output_ids``, ``meta_info`` with
``finish_reason``, ``output_token_logprobs`` as ``[log-prob, token id, text]`` per output token,
``weight_version(s)``, ``routed_experts`` as base64 int32 when asked for) into an
:class:`Answer`: the token ids and log-probs as numpy arrays (compact to send between processes),
the weight-version spans checked to tile the output, the routed experts' bytes checked against
their shape. A malformed answer raises :class:`Malformed` with the message the client raises as a
``RolloutError`` (HTTP 200) naming the server.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from pipeline.generation.version import WeightVersion, from_wire

ROUTED_DTYPE = "<i4"
"""int32, little-endian: what SGLang's ``tensor.numpy().tobytes()`` writes on x86 and ARM."""


class Malformed(ValueError):
    """An answer the client refuses; ``str()`` is the whole message (rid and body included)."""


@dataclass
class Answer:
    output_ids: np.ndarray
    """int64 [output tokens]"""
    logprobs: np.ndarray
    """float64 [output tokens]: ``output_token_logprobs``' values"""
    kind: str
    matched: Any
    prompt_tokens: Optional[int]
    completion_tokens: Optional[int]
    weight_version: Optional[WeightVersion]
    spans: list[tuple[Optional[WeightVersion], int, int]]
    cached_tokens: int
    routed: Optional[bytes] = None
    """int32 routed experts, ``expected_rows x layers x top-k`` values (asked for, the request ran)."""


def expected_rows(prompt_len: int, output_len: int, start_len: int = 0) -> int:
    """Rows of routed experts SGLang returns: positions ``[start_len, prompt_len + output_len - 1)``."""
    seqlen = prompt_len + output_len
    return max(0, seqlen - 1 - min(start_len, seqlen - 1))


def routed_base64(text: Any) -> bytes:
    """The bytes of a ``routed_experts`` field (base64 text, as SGLang and vLLM both send it);
    ValueError naming the field if it is not a string of valid base64."""
    if not isinstance(text, str):
        raise ValueError(f"routed_experts must be a base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise ValueError(f"routed_experts is not base64: {err}") from None


def routed_bytes(text: Any, rows: int, num_layers: int, top_k: int) -> bytes:
    """SGLang's base64 ``routed_experts`` -> its int32 bytes; ValueError if the payload is not
    base64 of exactly ``rows x num_layers x top_k`` int32 values."""
    raw = routed_base64(text)
    want = rows * num_layers * top_k
    if len(raw) != 4 * want:
        raise ValueError(f"routed_experts holds {len(raw)} bytes; expected {rows} positions x "
                         f"{num_layers} layers x top-{top_k} int32 = {4 * want} bytes")
    return raw


def version_spans(meta: dict, num_output: int) -> list[tuple[Optional[WeightVersion], int, int]]:
    """``meta_info.weight_versions`` checked: (version, start, end) in order, tiling
    ``[0, num_output)`` (ValueError otherwise), labels read as versions; empty spans dropped.
    Absent (a server before 0.5.23): one span of ``meta_info.weight_version``."""
    raw = meta.get("weight_versions")
    if raw is None:
        return [(from_wire(meta.get("weight_version")), 0, num_output)] if num_output else []
    spans = [(from_wire(str(s["version"])), int(s["start"]), int(s["end"])) for s in raw]
    at = 0
    for _, start, end in spans:
        if start != at or end < start:
            raise ValueError(f"weight_versions {raw!r} do not tile the {num_output} output tokens")
        at = end
    if at != num_output and not (num_output == 0 and len(spans) <= 1):
        raise ValueError(f"weight_versions {raw!r} do not tile the {num_output} output tokens")
    return [s for s in spans if s[2] > s[1]]


def _check(body: Any, rid: str, prompt_len: int,
           routed_experts: Optional[tuple[int, int]]) -> Answer:
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    meta = body["meta_info"]
    ids = body["output_ids"]
    output_ids = np.fromiter((int(t) for t in ids), dtype=np.int64, count=len(ids))
    finish = meta["finish_reason"] or {}
    kind = finish.get("type")
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs") or []
    if len(entries) != len(output_ids):
        raise ValueError(f"{len(entries)} output_token_logprobs for {len(output_ids)} output ids")
    if len(entries) and not np.array_equal(
            np.fromiter((int(e[1]) for e in entries), dtype=np.int64, count=len(entries)),
            output_ids):
        raise ValueError("output_token_logprobs token ids differ from output_ids")
    missing = next((i for i, e in enumerate(entries) if e[0] is None), None)
    if missing is not None:  # SGLang renders a NaN / -inf as null (orjson)
        raise ValueError(f"output token {missing} has a null log-prob (a NaN or -inf on the "
                         "server: are its weights finite?)")
    logprobs = np.fromiter((float(e[0]) for e in entries), dtype=np.float64, count=len(entries))
    spans = version_spans(meta, len(output_ids))
    routed = None
    if routed_experts is not None:
        text = meta.get("routed_experts")
        if text is None and kind != "abort":  # a request aborted before it ran has none
            raise Malformed(f"rid {rid}: asked for return_routed_experts, but meta_info has no "
                            "routed_experts: start SGLang with --enable-return-routed-experts "
                            "(megatron-gspo serve: the same flag)")
        if text is not None:
            routed = routed_bytes(text, expected_rows(prompt_len, len(output_ids)),
                                  *routed_experts)
    prompt_tokens, completion_tokens = meta.get("prompt_tokens"), meta.get("completion_tokens")
    return Answer(
        output_ids=output_ids, logprobs=logprobs, kind=kind, matched=finish.get("matched"),
        prompt_tokens=None if prompt_tokens is None else int(prompt_tokens),
        completion_tokens=None if completion_tokens is None else int(completion_tokens),
        weight_version=from_wire(meta.get("weight_version")), spans=spans,
        cached_tokens=int(meta.get("cached_tokens") or 0), routed=routed)


def check_body(body: Any, rid: str, prompt_len: int,
               routed_experts: Optional[tuple[int, int]] = None) -> Answer:
    """A parsed answer checked (:class:`Malformed` naming the rid and the body otherwise).
    ``routed_experts=(num_layers, top_k)``: the request asked for them; their absence from a
    sample that ran is an error (SGLang omits them silently when the server was started without
    ``--enable-return-routed-experts``)."""
    try:
        return _check(body, rid, prompt_len, routed_experts)
    except Malformed:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise Malformed(f"malformed /generate response for rid {rid}: {err}; "
                        f"body: {json.dumps(body)[:500]}") from None


def read_answer(raw: bytes | str, rid: str, prompt_len: int,
                routed_experts: Optional[tuple[int, int]] = None) -> Answer:
    """An answer's JSON text (bytes as read off the socket, or str) read and checked."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        raise Malformed(f"not JSON: {text[:300]}") from None
    return check_body(body, rid, prompt_len, routed_experts)
