"""Issue 38, item 8: the local rollout server answers every malformed ``/generate`` with a 400 in
one of SGLang's error shapes, never a 500, and keeps serving; an answer holding a non-finite
number is rendered as SGLang renders it.

The probe got a 500 for a ``text`` holding a lone surrogate (``"\\udcff"``: a ``TypeError`` in
the tokenizer) and for an answer holding a NaN (``Out of range float values are not JSON
compliant``). SGLang 0.5.23 (read from the wheel: ``http_server.py`` ``ORJSONRequest`` /
``SGLangORJSONResponse``, ``utils/json_response.py``) parses every body with orjson, which
refuses invalid UTF-8, lone surrogates, ``NaN`` / ``Infinity`` and numbers that overflow a double
(400, FastAPI's ``RequestValidationError``: ``{"object": "error", ...}``), makes an integer beyond
[-2^63, 2^64) a float (then its schema's contract 400), and renders answers with orjson, which
writes NaN and +-inf as ``null``.

Every field of the request (each top-level key the server reads and each ``sampling_params``
key) gets every kind of value (:data:`VALUES`); each answer must be 200 with strict JSON (no
``NaN`` token) or 400 with one of SGLang's three error bodies; the values no orjson body can hold
must be a 400 for every field; afterwards the server still generates. Then weights gone NaN:
the log-probs come back ``null`` (plain and streamed), and ``/get_weights_by_name`` too.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import urllib.error
import urllib.request

import pytest
import torch

from pipeline.local.protocol import SAMPLING_KEYS
from tests.rollout.conftest import InProcessServer
from tests.rollout.tiny import make_model_dir

# name -> raw JSON text of the value
VALUES = {
    "null": "null", "true": "true", "false": "false", "zero": "0", "minus_one": "-1",
    "minus_two": "-2", "big": "1000000", "i64_below": "-9223372036854775809",
    "u64_max": "18446744073709551615", "u64_over": "18446744073709551616",
    "huge_int": "1" + "0" * 40, "half": "0.5", "float": "1.5", "subnormal": "5e-324",
    "huge_float": "1e308", "negative_float": "-3.5",
    "overflow_float": "1e400", "nan": "NaN", "inf": "Infinity", "neg_inf": "-Infinity",
    "empty_str": '""', "str": '"abc"', "surrogate": '"\\udcff"',
    "surrogate_pair": '"\\ud83d\\ude00"',
    "nul_char": '"a\\u0000b"', "empty_list": "[]", "list_null": "[null]",
    "list_str": '["abc"]', "list_surrogate": '["a\\udcff"]', "list_huge": "[18446744073709551616]",
    "list_negative": "[-5]", "nested": "[[[1]]]", "empty_obj": "{}", "obj": '{"a": 1}',
    "obj_surrogate_key": '{"\\udcff": 1}',
}
# values no body orjson parses can hold: a 400 whatever the field
UNPARSABLE = ("surrogate", "list_surrogate", "obj_surrogate_key", "overflow_float", "nan", "inf",
              "neg_inf")
TOP_LEVEL = ("rid", "text", "input_ids", "stream", "sampling_params", "return_logprob",
             "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
             "return_text_in_logprobs", "return_prompt_token_ids", "return_routed_experts",
             "routed_experts_start_len", "input_embeds")


def body(sampling: str = '"max_new_tokens": 1', extra: str = "") -> bytes:
    """A /generate body (raw JSON text): ``sampling`` inside ``sampling_params``, ``extra``
    top-level keys after it (a repeated key: the last one counts, in orjson as in json)."""
    return ('{"input_ids": [5, 6, 7], "return_logprob": true, "sampling_params": {%s}%s}'
            % (sampling, extra)).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = InProcessServer(make_model_dir(tmp_path_factory.mktemp("malformed") / "model"),
                          max_running_requests=32, context_length=48)
    yield srv
    srv.close()
    torch.set_num_threads(threads)


def post_raw(server, path: str, raw: bytes, timeout_s: float = 60.0) -> tuple[int, bytes]:
    req = urllib.request.Request(server.url + path, data=raw, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def strict_json(raw: bytes):
    """JSON as a strict parser (orjson, SGLang's clients) reads it: no NaN / Infinity."""
    def refuse(name):
        raise ValueError(f"{name} in the answer")
    return json.loads(raw.decode("utf-8"), parse_constant=refuse)


def is_sglang_error(body) -> bool:
    """One of SGLang's three 400 bodies (docs/sglang_protocol.md, Errors)."""
    if not isinstance(body, dict):
        return False
    if set(body) == {"error"}:
        return isinstance(body["error"], str) or (
            isinstance(body["error"], dict) and isinstance(body["error"].get("message"), str))
    return body.get("object") == "error" and body.get("code") == 400 and "message" in body


def check_answer(status: int, raw: bytes, where: str) -> None:
    assert status in (200, 400), f"{where}: HTTP {status}: {raw[:300]!r}"
    if status == 400:
        assert is_sglang_error(strict_json(raw)), f"{where}: {raw[:300]!r}"
    elif raw.startswith(b"data: "):  # a stream: every chunk strict JSON
        for line in raw.decode().split("\n\n"):
            if line.strip() and line != "data: [DONE]":
                strict_json(line[len("data: "):].encode())
    else:
        strict_json(raw)


def generates(server) -> None:
    status, raw = post_raw(server, "/generate", body())
    assert status == 200, raw[:300]
    assert len(strict_json(raw)["output_ids"]) == 1
    assert server.server.engine.alive


def test_every_field_refuses_every_malformed_value_with_a_400(server):
    cases = []
    for field in TOP_LEVEL:
        for name, value in VALUES.items():
            cases.append((f"{field}={name}", body(extra=f', "{field}": {value}')))
    for key in SAMPLING_KEYS:
        for name, value in VALUES.items():
            sampling = (f'"max_new_tokens": {value}' if key == "max_new_tokens"
                        else f'"max_new_tokens": 1, "{key}": {value}')
            cases.append((f"sampling_params.{key}={name}", body(sampling)))
    cases.append(("text=invalid_utf8", b'{"text": "a\xffb", "sampling_params": {}}'))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda case: post_raw(server, "/generate", case[1]), cases))
    for (where, _), (status, raw) in zip(cases, answers):
        check_answer(status, raw, where)
        if where.split("=")[-1] in (*UNPARSABLE, "invalid_utf8"):  # SGLang: the body's 400
            assert status == 400 and strict_json(raw)["object"] == "error", \
                f"{where}: HTTP {status}: {raw[:300]!r}"
    # the case exactly, and a batch of texts with one bad
    for text in ('"\\udcff"', '["ok", "\\udcff"]'):
        status, raw = post_raw(server, "/generate", ('{"text": %s, "sampling_params": '
                                                     '{"max_new_tokens": 1}}' % text).encode())
        assert status == 400 and "lone surrogate" in strict_json(raw)["message"], raw
    generates(server)  # and it keeps serving


@pytest.fixture()
def nan_logits(server):
    """Weights gone NaN (lm_head row 7): every log-prob of every position is NaN."""
    eng = server.server.engine
    saved = eng.call(lambda: eng.weights.get("lm_head.weight")).result(30)
    eng.call(lambda: eng.weights.view("lm_head.weight")[7].fill_(float("nan"))).result(30)
    yield
    eng.call(lambda: eng.weights.view("lm_head.weight").copy_(saved)).result(30)


def test_non_finite_numbers_in_an_answer_are_null_as_in_sglang(server, nan_logits):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    status, raw = post_raw(server, "/generate", json.dumps(body).encode())
    assert status == 200, raw[:300]
    meta = strict_json(raw)["meta_info"]
    assert [e[0] for e in meta["output_token_logprobs"]] == [None, None], meta
    assert [e[0] for e in meta["input_token_logprobs"]] == [None, None, None], meta
    status, raw = post_raw(server, "/generate", json.dumps({**body, "stream": True}).encode())
    assert status == 200
    check_answer(status, raw, "stream")  # no NaN token in any chunk
    assert b"null" in raw and b"NaN" not in raw
    status, raw = post_raw(server, "/get_weights_by_name",
                           json.dumps({"name": "lm_head.weight", "truncate_size": 8}).encode())
    assert status == 200, raw[:300]
    rows = strict_json(raw)
    assert rows[7][0] is None and all(math.isfinite(v) for v in rows[6]), rows[7][:3]


def test_the_server_serves_after_the_nan_weights_are_gone(server):
    generates(server)
