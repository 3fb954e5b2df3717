"""SGLang's ``/generate`` contract on the local rollout server's side: parse, validate, answer.

Follows SGLang 0.5.23's ``/generate`` contract (``docs/sglang_protocol.md``):

* unknown top-level keys are ignored; unknown ``sampling_params`` keys and wrong JSON types are a
  *contract* violation (400 ``{"error": "<string>"}``, serde's wording);
* bad values (ranges, an empty input, a duplicate rid, a prompt that is too long) are a
  :class:`ValueError` (400 ``{"error": {"message": ...}}``);
* a body that is not a JSON object is a parse error (400 ``{"object": "error", ...}``).

Sampling features the local server does not implement (penalties, grammars, logit bias, ...) are
accepted at their default values and rejected with a ValueError otherwise, so a request never
silently samples from a different distribution than the one it asked for.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

# Every sampling_params key of the 0.5.23 schema (sglang.api.v1.SamplingParams), in its order.
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)
# Known keys the local server does not implement: accepted only at these (default) values.
_UNSUPPORTED_DEFAULTS = {
    "stop_regex": (None, [], ""), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None, {}),
    "custom_params": (None,), "beam_width": (None, 0, 1), "watermark": (None,), "choice": (None, []),
}
GREEDY_EPS = 1e-6  # SGLang: temperature in [0, 1e-6) means greedy (top_k = 1)


class ContractError(ValueError):
    """The body violates SGLang's JSON contract (HTTP 400 ``{"error": "<message>"}``)."""


class ParseError(ValueError):
    """The body is not a JSON object at all (HTTP 400, the pydantic error shape)."""


def _type_error(value: Any, expected: str) -> ContractError:
    if value is None:
        shown = "null"
    elif isinstance(value, bool):
        shown = f"boolean `{str(value).lower()}`"
    elif isinstance(value, int):
        shown = f"integer `{value}`"
    elif isinstance(value, float):
        shown = f"floating point `{value}`"
    elif isinstance(value, str):
        shown = f'string "{value}"'
    else:
        shown = "sequence" if isinstance(value, list) else "map"
    return ContractError(f"invalid type: {shown}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(d: dict, key: str, default: Optional[int]) -> Optional[int]:
    v = d.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise _type_error(v, "i64")
    return v


def _float(d: dict, key: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(v, "f64")
    return float(v)


def _bool(d: dict, key: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(v, "a boolean")
    return v


def _int_list(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(x) for x in v):
        raise _type_error(v if not isinstance(v, list) else next(x for x in v if not _is_int(x)),
                          what)
    return list(v)


@dataclass
class Sampling:
    """Validated sampling parameters of one request (SGLang semantics)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def parse_sampling(d: Any) -> Sampling:
    """One ``sampling_params`` object -> :class:`Sampling` (ContractError / ValueError)."""
    if d is None:
        return Sampling()
    if not isinstance(d, dict):
        raise _type_error(d, "struct SamplingParams")
    unknown = [k for k in d if k not in SAMPLING_KEYS]
    if unknown:
        expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
        raise ContractError(f"unknown field `{unknown[0]}`, expected one of {expected}")
    stop = d.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise _type_error(stop, "a string or a list of strings")
    stop_ids = d.get("stop_token_ids")
    s = Sampling(
        max_new_tokens=_int(d, "max_new_tokens", 128),
        temperature=_float(d, "temperature", 1.0),
        top_p=_float(d, "top_p", 1.0),
        top_k=_int(d, "top_k", -1),
        min_p=_float(d, "min_p", 0.0),
        stop=stops,
        stop_token_ids=[] if stop_ids is None else _int_list(stop_ids, "i64"),
        ignore_eos=_bool(d, "ignore_eos", False),
        skip_special_tokens=_bool(d, "skip_special_tokens", True),
        spaces_between_special_tokens=_bool(d, "spaces_between_special_tokens", True),
        no_stop_trim=_bool(d, "no_stop_trim", False),
        n=_int(d, "n", 1),
        sampling_seed=_int(d, "sampling_seed", None),
    )
    _int(d, "stream_interval", None)
    for key, allowed in _UNSUPPORTED_DEFAULTS.items():
        if key in d and d[key] not in allowed:
            raise ValueError(f"sampling_params.{key}={d[key]!r} is not supported by the local "
                             "rollout server (only its default)")
    # Ranges, with SGLang's messages where it has them.
    if s.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {s.temperature}.")
    if not 0 < s.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}.")
    if s.top_k == 0 or s.top_k < -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {s.top_k}.")
    if not 0 <= s.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {s.min_p}.")
    if s.n < 1:
        raise ValueError(f"n must be at least 1, got {s.n}.")
    if len(s.stop) > 32:
        raise ValueError(f"stop: at most 32 stop strings, got {len(s.stop)}.")
    if s.temperature < GREEDY_EPS:  # SGLang: greedy means top_k = 1 at temperature 1
        s.temperature, s.top_k = 1.0, 1
    return s


@dataclass
class ItemSpec:
    """One prompt of a (possibly batched) /generate call, before ``n`` expansion."""

    rid: str
    input_ids: Optional[list[int]]
    text: Optional[str]
    sampling: Sampling
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int


@dataclass
class GenerateCall:
    items: list[ItemSpec]
    is_batch: bool  # the response is a JSON array
    stream: bool
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    return_routed_experts: bool = False
    """One value for every item (SGLang's ``GenerateReqInput`` copies it to each)."""
    routed_experts_start_len: int = 0
    """Routed experts cover positions ``[start, seqlen - 1)`` (checked against each prompt's
    length by :func:`check_routed_experts_start_len`)."""


def _per_item(value: Any, n_items: int, name: str, is_batch: bool, parse) -> list:
    if is_batch and isinstance(value, list):
        if len(value) != n_items:
            raise ValueError(f"{name}: a list must have one entry per batch item ({n_items}), "
                             f"got {len(value)}")
        return [parse(v) for v in value]
    return [parse(value)] * n_items


def parse_generate(body: Any) -> GenerateCall:
    """A /generate body -> :class:`GenerateCall` (ParseError, ContractError or ValueError)."""
    if not isinstance(body, dict):
        raise ParseError("the request body must be a JSON object (GenerateReqInput)")
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise ValueError("input_embeds is not supported by the local rollout server")
    if text is not None:
        if isinstance(text, str):
            texts, is_batch = [text], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, is_batch = list(text), True
        else:
            raise _type_error(text, "a string or a list of strings")
        prompts: list = [None] * len(texts)
    elif input_ids is not None:
        if not isinstance(input_ids, list):
            raise _type_error(input_ids, "a list of token ids or a list of lists")
        if input_ids and all(isinstance(x, list) for x in input_ids):
            prompts, is_batch = [_int_list(x, "i64") for x in input_ids], True
        else:
            prompts, is_batch = [_int_list(input_ids, "i64")], False
        texts = [None] * len(prompts)
        for p in prompts:
            if not p:
                raise ValueError("input_ids cannot be empty.")
    else:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    n_items = len(prompts)
    if n_items == 0:
        raise ValueError("input_ids cannot be empty.")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _type_error(stream, "a boolean")

    samplings = _per_item(body.get("sampling_params"), n_items, "sampling_params", is_batch,
                          parse_sampling)
    if isinstance(body.get("sampling_params"), list) and not is_batch:
        raise ValueError("sampling_params: a list needs a batch of inputs")
    if len({s.n for s in samplings}) > 1:
        raise ValueError("all sampling_params of a batch must have the same n")
    n = samplings[0].n
    for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
        if n > 1 and isinstance(body.get(key), list):
            raise ValueError(f"{key} cannot be a list when n > 1")
    return_lp = _per_item(body.get("return_logprob"), n_items, "return_logprob", is_batch,
                          lambda v: _bool({"v": v}, "v", False))
    start_len = _per_item(body.get("logprob_start_len"), n_items, "logprob_start_len", is_batch,
                          lambda v: _int({"v": v}, "v", -1))
    top_num = _per_item(body.get("top_logprobs_num"), n_items, "top_logprobs_num", is_batch,
                        lambda v: _int({"v": v}, "v", 0))
    if body.get("token_ids_logprob") is not None:
        raise ValueError("token_ids_logprob is not supported by the local rollout server")
    # Not in SGLang's schema module: its Python dataclass takes the value as it is (truthy).
    return_routed = bool(body.get("return_routed_experts", False))
    if "routed_experts_start_len" in body and not _is_int(body["routed_experts_start_len"]):
        raise _type_error(body["routed_experts_start_len"], "i64")  # the schema's i64
    routed_start = int(body.get("routed_experts_start_len", 0))
    if return_routed and routed_start < 0:  # SGLang's Scheduler message (0.5.23)
        raise ValueError(f"recv_req.routed_experts_start_len={routed_start} is lower than 0. "
                         "Please use a non-negative routed_experts_start_len.")

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n_items)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n_items)] if is_batch else [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n_items:
            raise ValueError(f"rid: a list must have one entry per batch item ({n_items}), "
                             f"got {len(rid)}")
        rids = list(rid)
    else:
        raise _type_error(rid, "a string or a list of strings")

    items = [ItemSpec(rid=rids[i], input_ids=prompts[i], text=texts[i], sampling=samplings[i],
                      return_logprob=return_lp[i], logprob_start_len=start_len[i],
                      top_logprobs_num=top_num[i]) for i in range(n_items)]
    return GenerateCall(
        items=items, is_batch=is_batch or n > 1, stream=bool(stream),
        return_text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
        return_prompt_token_ids=_bool(body, "return_prompt_token_ids", False),
        return_routed_experts=return_routed, routed_experts_start_len=routed_start)


def check_routed_experts_start_len(call: GenerateCall, prompt_len: int) -> None:
    """SGLang's Scheduler check of one request (a ValueError, HTTP 400): the start of the
    returned routed experts lies within the prompt."""
    if call.return_routed_experts and call.routed_experts_start_len > prompt_len:
        raise ValueError(f"recv_req.routed_experts_start_len={call.routed_experts_start_len} is "
                         f"higher than the number of input tokens len(req.origin_input_ids)="
                         f"{prompt_len}. Please use a smaller routed_experts_start_len.")


# --- error bodies (§1.3) -------------------------------------------------------------------------

def contract_error_body(message: str) -> dict:
    return {"error": message}


def value_error_body(message: str) -> dict:
    return {"error": {"message": message}}


def parse_error_body(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None,
            "code": 400}


def http_error_body(status: int, message: str) -> dict:
    """SGLang's answer to an ``HTTPException`` (its handler in http_server.py: ``ErrorResponse``
    with ``type`` the status code as a string)."""
    return {"object": "error", "message": message, "type": str(status), "param": None,
            "code": status}


# --- the control routes' answers ------------------------------------------------------------------

PROTOCOL_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this server follows
IMPLEMENTATION = "megatron-gspo local rollout server"
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n")
# SGLang 0.5.23's answers (entrypoints/http_server.py, scheduler_components/flush_wrapper.py,
# scheduler_components/weight_updater.py), checked against the wheel by
# tests/rollout/test_server_conformance.py
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_BUSY = "Another flush_cache is already in progress."
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache.")
SESSION_ALREADY_OPEN = ("a weight-update session is already open; call end_weight_update() "
                        "first")
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = "{} must run between begin_weight_update() and end_weight_update()"

EXTENSIONS = ("checksums", "delta", "timings")
"""This server's extensions of SGLang's protocol, offered in ``/server_info``
(``megatron_gspo_extensions``) unless started with ``--no-extensions``."""
EXTENSIONS_HEADER = "X-Megatron-Gspo-Extensions"
"""A request's negotiated extensions (comma-separated); without it a request is plain SGLang."""


# --- finish reasons (§1.4) ------------------------------------------------------------------------

def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_stop(matched) -> dict:
    return {"type": "stop", "matched": matched}


def finish_abort_running() -> dict:
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def finish_abort_queued() -> dict:
    return {"type": "abort", "message": "Abort in waiting queue"}


# --- control-plane request bodies (SGLang 0.5.23's io_struct classes) ----------------------------

REQUIRED = object()
"""Marks a field without a default (a request without it is a 400)."""

BASE_REQ_FIELDS = {"rid": None, "http_worker_ipc": None}
"""``io_struct.BaseReq``'s fields, inherited by every request class below."""

CONTROL_REQUESTS: dict[str, dict[str, Any]] = {
    # class name in srt/managers/io_struct.py -> {field: SGLang's default}
    "UpdateWeightFromDiskReqInput": {
        "model_path": REQUIRED, "load_format": None, "abort_all_requests": False,
        "weight_version": None, "is_async": False, "torch_empty_cache": False,
        "keep_pause": False, "recapture_cuda_graph": False, "token_step": 0,
        "flush_cache": True, "manifest": None},
    "UpdateWeightsFromDistributedReqInput": {
        "names": REQUIRED, "dtypes": REQUIRED, "shapes": REQUIRED,
        "group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
        "weight_version": None, "load_format": None, "selector": "all",
        "torch_empty_cache": False},
    "UpdateWeightsFromTensorReqInput": {
        "serialized_named_tensors": REQUIRED, "load_format": None, "flush_cache": True,
        "abort_all_requests": False, "weight_version": None, "selector": "all",
        "torch_empty_cache": False},
    "UpdateWeightVersionReqInput": {"new_version": REQUIRED, "abort_all_requests": True},
    "BeginWeightUpdateReqInput": {"selector": "all"},
    "EndWeightUpdateReqInput": {},
    "PauseGenerationReqInput": {"mode": "abort"},
    "ContinueGenerationReqInput": {"torch_empty_cache": True},
    "InitWeightsUpdateGroupReqInput": {
        "master_address": REQUIRED, "master_port": REQUIRED, "rank_offset": REQUIRED,
        "world_size": REQUIRED, "group_name": "weight_update_group", "backend": "nccl"},
    "DestroyWeightsUpdateGroupReqInput": {"group_name": "weight_update_group"},
}

_LITERALS = {"selector": ("target", "draft", "all"), "mode": ("abort", "retract", "in_place")}
_BOOLS = {"abort_all_requests", "is_async", "torch_empty_cache", "keep_pause",
          "recapture_cuda_graph", "flush_cache"}
_INTS = {"token_step", "master_port", "rank_offset", "world_size"}
_STRS = {"model_path", "group_name", "new_version", "master_address", "backend"}
_OPT_STRS = {"load_format", "weight_version", "rid", "http_worker_ipc"}


def parse_control(body: dict, cls: str) -> dict:
    """``body`` validated as SGLang validates the JSON of ``io_struct.<cls>``: unknown fields
    ignored (``extra_behavior="ignore"``), defaults filled in, a missing required field or a
    value of the wrong type a :class:`ParseError` (SGLang's 400 ``RequestValidationError``)."""
    spec = {**BASE_REQ_FIELDS, **CONTROL_REQUESTS[cls]}
    out: dict[str, Any] = {}
    for name, default in spec.items():
        if name not in body:
            if default is REQUIRED:
                raise ParseError(f"1 validation error for {cls}\n{name}\n  Field required")
            out[name] = default
            continue
        v = body[name]
        bad = None
        if name in _LITERALS and v not in _LITERALS[name]:
            bad = "one of " + ", ".join(repr(x) for x in _LITERALS[name])
        elif name in _BOOLS and not (isinstance(v, bool) or (_is_int(v) and v in (0, 1))):
            bad = "a valid boolean"
        elif name in _INTS and not _is_int(v):
            bad = "a valid integer"
        elif name in _STRS and not isinstance(v, str):
            bad = "a valid string"
        elif name in _OPT_STRS and v is not None and not isinstance(v, str):
            bad = "a valid string or null"
        elif name == "manifest" and v is not None and not isinstance(v, dict):
            bad = "a valid dictionary or null"
        elif name in ("names", "dtypes") and not (
                isinstance(v, list) and all(isinstance(x, str) for x in v)):
            bad = "a list of strings"
        elif name == "shapes" and not (isinstance(v, list) and all(
                isinstance(s, list) and all(_is_int(d) for d in s) for s in v)):
            bad = "a list of lists of integers"
        elif name == "serialized_named_tensors" and not (
                isinstance(v, list) and all(isinstance(x, str) for x in v)):
            bad = "a list of base64 strings"
        if bad is not None:
            raise ParseError(f"1 validation error for {cls}\n{name}\n  Input should be {bad}")
        out[name] = bool(v) if name in _BOOLS else v
    return out
