"""Request bodies of the local rollout server: reading them under its limits, and the 400 / 413
answers to the ones it refuses.

* ``--max-request-mb`` / ``--max-weight-update-mb``: :class:`BodyLimit`, a 413 before the body is
  read (weight-update paths, :data:`WEIGHT_UPDATE_PATHS`, have the larger limit);
* ``--max-json-depth``: :func:`json_depth_exceeds` on the bytes before parsing, a 400
  (:class:`TooDeep`);
* :func:`parse_json`: the body parsed as SGLang 0.5.23 parses every body (``ORJSONRequest``:
  orjson), so what orjson refuses is a 400 here too, never a 500 further on: bytes that are not
  UTF-8, a string holding a lone surrogate (``"\\udcff"``), ``NaN`` / ``Infinity`` and numbers
  that overflow a double; an integer outside [-2^63, 2^64) becomes a float, as orjson makes it
  (then a contract 400 wherever an integer is expected);
* :func:`error_response`: a refused body's 400 in the shape SGLang answers that kind of error;
* :func:`json_response` / :func:`render_json`: answers rendered as SGLang renders them (its
  ``SGLangORJSONResponse``, ``dumps_json``): a non-finite float (a NaN or -inf log-prob) is
  ``null``, never a 500 while rendering.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse

from pipeline.local import protocol as proto
from pipeline.local.args import DEFAULT_MAX_JSON_DEPTH

WEIGHT_UPDATE_PATHS = frozenset({"/update_weights_from_tensor", "/update_weights_from_distributed"})
"""Paths whose bodies may carry weights (base64 safetensors buckets, per-tensor name / dtype /
shape lists): limited by --max-weight-update-mb instead of --max-request-mb."""


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (what orjson writes: ``null``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def render_json(content: Any) -> bytes:
    """JSON bytes of an answer as SGLang 0.5.23 renders it (``utils/json_response.dumps_json``,
    orjson): NaN and +-inf are ``null`` (a log-prob of -inf, weights gone NaN), the rest as
    Starlette's JSONResponse writes it."""
    try:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float somewhere (rare: walk only then)
        text = json.dumps(_finite(content), ensure_ascii=False, allow_nan=False,
                          separators=(",", ":"))
    return text.encode("utf-8")


class SGLangJSONResponse(JSONResponse):
    """A JSON answer rendered by :func:`render_json` (non-finite floats as ``null``)."""

    def render(self, content: Any) -> bytes:
        return render_json(content)


def json_response(content: Any, status: int = 200) -> JSONResponse:
    return SGLangJSONResponse(content=content, status_code=status)


class TooDeep(ValueError):
    """A JSON body nested deeper than ``--max-json-depth`` (HTTP 400)."""


_BRACKETS_ONLY = bytes(c for c in range(256) if c not in b"[]{}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays / objects deeper than ``limit`` (checked on the
    bytes, before parsing: nothing recursive runs on them). Linear, in bounded extra memory."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # cannot be deeper (every weight-update body: a few brackets)
    if b"\\" in raw:  # escapes: strings matched properly
        outside = _JSON_STRING.sub(b"", raw)
    else:  # every quote opens or closes a string
        outside = b"".join(raw.split(b'"')[0::2])
    brackets = outside.translate(None, _BRACKETS_ONLY)
    depth, step = 0, 1 << 20
    for start in range(0, len(brackets), step):
        a = np.frombuffer(brackets, np.uint8, count=min(step, len(brackets) - start),
                          offset=start)
        running = np.cumsum(np.where((a == 91) | (a == 123), 1, -1)) + depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


_I64_MIN, _U64_MAX = -(1 << 63), (1 << 64) - 1
_LONG_DIGITS = re.compile(rb"\d{19}")  # an integer this long may be outside [-2^63, 2^64)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _orjson_int(text: str):
    """orjson's integers: beyond [-2^63, 2^64) it parses a float."""
    value = int(text)
    return value if _I64_MIN <= value <= _U64_MAX else float(text)


def _orjson_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise proto.ParseError(f"JSON decode error: number {text[:40]} is infinity when parsed "
                               "as double")
    return value


def _refuse_constant(name: str):
    raise proto.ParseError(f"JSON decode error: {name} is not a JSON value")


def _lone_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` (a key or a value, at any depth) holds a lone surrogate."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return False


def parse_json(raw: bytes) -> Any:
    """``raw`` parsed as SGLang 0.5.23 parses a body (orjson): a :class:`proto.ParseError` (its
    400 for a body that does not parse) for what orjson refuses, ints beyond [-2^63, 2^64) as
    floats. Linear; the slower checks run only when the bytes could need them."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise proto.ParseError(f"JSON decode error: the body is not valid UTF-8 ({err})") from None
    try:
        body = json.loads(text, parse_float=_orjson_float, parse_constant=_refuse_constant,
                          **({"parse_int": _orjson_int} if _LONG_DIGITS.search(raw) else {}))
    except json.JSONDecodeError as err:
        raise proto.ParseError(f"JSON decode error: {err}") from None
    if _SURROGATE_ESCAPE.search(raw) and _lone_surrogate(body):
        raise proto.ParseError("JSON decode error: a string holds a lone surrogate (an "
                               "unpaired \\ud800-\\udfff escape), which is not valid UTF-8")
    return body


async def read_body(request, *, required: bool = False) -> dict:
    """The request's JSON object ({} for an empty body unless ``required``): a
    :class:`proto.ParseError` for a body that is not a JSON object, :class:`TooDeep` past
    ``--max-json-depth`` (``app.state.max_json_depth``, checked on the bytes first)."""
    raw = await request.body()
    if not raw.strip():
        if required:
            raise proto.ParseError("a JSON body is required")
        return {}
    limit = getattr(request.app.state, "max_json_depth", DEFAULT_MAX_JSON_DEPTH)
    if json_depth_exceeds(raw, limit):
        raise TooDeep(f"There was an error parsing the body: JSON nested deeper than this "
                      f"server's --max-json-depth {limit}")
    try:
        body = parse_json(raw)
    except RecursionError:  # only with a --max-json-depth near Python's recursion limit
        raise TooDeep(f"There was an error parsing the body: JSON nested too deeply "
                      f"(--max-json-depth {limit})") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise proto.ParseError("the request body must be a JSON object")
    return body


def error_response(err: Exception) -> JSONResponse:
    """The 400 answer to a refused body, in the shape SGLang gives that kind of error."""
    if isinstance(err, TooDeep):  # SGLang: FastAPI's HTTPException(400) for a body
        return json_response(proto.http_error_body(400, str(err)), 400)  # json.loads cannot parse
    if isinstance(err, proto.ParseError):
        return json_response(proto.parse_error_body(str(err)), 400)
    if isinstance(err, proto.ContractError):
        return json_response(proto.contract_error_body(str(err)), 400)
    return json_response(proto.value_error_body(str(err)), 400)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over its path's limit is a 413, decided before the body is
    read: from ``Content-Length`` at once, and for a chunked body as soon as the bytes received
    pass the limit (the rest is never read; the connection is closed). Weight-update paths
    (:data:`WEIGHT_UPDATE_PATHS`) have their own, larger limit."""

    def __init__(self, app, max_bytes: int, max_weight_bytes: int):
        self.app = app
        self.max_bytes, self.max_weight_bytes = int(max_bytes), int(max_weight_bytes)

    def _limit(self, path: str) -> tuple[int, str]:
        if path in WEIGHT_UPDATE_PATHS:
            return self.max_weight_bytes, "--max-weight-update-mb"
        return self.max_bytes, "--max-request-mb"

    @staticmethod
    async def _refuse(send, size: str, limit: int, flag: str) -> None:
        body = json.dumps(proto.http_error_body(413, (
            f"Request body too large: {size} bytes, over this server's limit of {limit} bytes "
            f"for this path ({flag} {limit >> 20})"))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self._limit(scope.get("path", ""))
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None:
            try:
                too_large = int(declared) > limit
            except ValueError:
                too_large = False  # the server (h11 / httptools) refuses it itself
            if too_large:
                return await self._refuse(send, declared.decode(), limit, flag)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._refuse(send, f"more than {limit}", limit, flag)
