"""The weight-sync client against SGLang 0.5.23's rules, read from its wheel.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_client_conformance.py``

Two local servers (``--tp-size`` 1 and 2) started with ``--no-extensions``: they answer exactly
as SGLang does (no checksums, no delta, no timings; weight-update sessions, the flush and pause
rules enforced). Two EP2 training ranks push the real Megatron policy twice with every transport
and both pause modes the pusher allows, with the pusher's DEFAULT settings (``verify="auto"``),
while requests decode on the servers. Every HTTP call is recorded and checked against
``tests/sglang_rules.py`` (the wheel's ``http_server.py`` routes and ``io_struct.py`` fields):

* every path is one SGLang serves, with a method it accepts; every body field is a field of
  the endpoint's request class; no extension header or extension field reaches a server that
  offers none (defects 1 and 3 of the SGLang-rules issue: verify by default, no sessions);
* tensor / distributed updates only inside ``begin_weight_update`` ... ``end_weight_update``,
  disk updates outside a session; pause first and continue last; flush after the last update
  and before continue in both pause modes (defect 4: retract needs the flush too); the version
  label is set with ``abort_all_requests: false`` (SGLang's default aborts every request);
* every call carries the configured timeout (defect 7), every answer is a 200;
* the servers hold the trainer's weights bit for bit afterwards; requests in flight through a
  retract push finish, with ``weight_versions`` spans covering their tokens.
"""

from __future__ import annotations


import pytest

from pipeline.weights.push import EXTENSIONS_HEADER
from tests import sglang_rules
from bench.spawn import run_on_ranks
from tests.rollout import conformance_worker
from tests.rollout.conftest import two_servers

pytestmark = pytest.mark.slow

TRANSPORTS = ["disk", "tensor", "distributed"]
PAUSE_MODES = ["abort", "retract"]
TIMEOUT_S = 321.0  # not a default anywhere: every call must carry the configured one
UPDATES = {"disk": "/update_weights_from_disk", "tensor": "/update_weights_from_tensor",
           "distributed": "/update_weights_from_distributed"}
EXTENSION_FIELDS = {"delta", "return_checksums", "checksums", "timings"}


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def plain_servers(model_dir, sglang_subset, shared_root, tmp_path_factory):
    """Two local servers with their extensions off (SGLang's behaviour), tp_size 1 and 2."""
    with two_servers(model_dir, tmp_path_factory.mktemp("servers"),
                     ["--no-extensions", "--allow-pickled-tensors", "--weight-roots",
                      str(shared_root)], pythonpath=sglang_subset) as urls:
        yield urls


class _Reports(dict):
    """(transport, pause mode) -> every rank's report, each case run when first asked for (so
    that ``-k`` selects what runs)."""

    def __init__(self, model_dir, servers, shared_root):
        super().__init__()
        self._args = model_dir, servers, shared_root

    def __missing__(self, case):
        model_dir, servers, shared_root = self._args
        transport, mode = case
        self[case] = run_on_ranks(
            2, conformance_worker.push_recorded,
            (str(model_dir), servers, transport, mode, str(shared_root / f"{transport}-{mode}"),
             48 * 1024, TIMEOUT_S, 2, 200),
            timeout_s=180)
        return self[case]


@pytest.fixture(scope="module")
def reports(model_dir, plain_servers, shared_root):
    return _Reports(model_dir, plain_servers, shared_root)


CASES = [(t, m) for t in TRANSPORTS for m in PAUSE_MODES]
IDS = [f"{t}-{m}" for t, m in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_pushes_succeed_with_default_settings(reports, case):
    """Defect 1: the default verify setting never turns into an error against SGLang."""
    per_rank = reports[case]
    assert per_rank[0]["error"] is None, per_rank[0]["error"]
    assert len(per_rank[0]["pushes"]) == 2
    for report in per_rank:  # every rank's pieces, both servers, bit for bit
        for push in report["pushes"]:
            assert push["mismatched"] and all(v == [] for v in push["mismatched"].values())
            assert push["stats"].verified_buckets == 0  # nothing to verify with: said, not faked


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_call_is_sglangs(reports, case):
    routes, bodies = sglang_rules.routes(), sglang_rules.body_classes()
    assert reports[case][0]["calls"], "rank 0 recorded no call"
    for report in reports[case]:
        for call in report["calls"]:
            path = call["path"]
            assert path in routes, f"{path}: not a path SGLang 0.5.23 serves"
            assert call["method"] in routes[path], (path, call["method"], routes[path])
            assert EXTENSIONS_HEADER not in call["headers"], call  # nothing was negotiated
            assert call["timeout_s"] == TIMEOUT_S, (path, call["timeout_s"])
            assert call["status"] == 200, call
            if call["body"]:
                allowed = set(sglang_rules.fields(bodies[path]))
                assert set(call["body"]) <= allowed, (path, set(call["body"]) - allowed)
                assert not set(call["body"]) & EXTENSION_FIELDS, call
            if call["answer_keys"] is not None:
                assert not {"checksums", "timings"} & set(call["answer_keys"]), call


def _per_server(report_calls):
    by_server: dict[str, list[dict]] = {}
    for call in sorted(report_calls, key=lambda c: c["t"]):
        by_server.setdefault(call["server"], []).append(call)
    return by_server


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sessions_pause_flush_and_version(reports, case):
    """Defects 3 and 4, and version labels that abort nothing: per server, in time order over
    every rank's calls."""
    transport, mode = case
    calls = [c for report in reports[case] for c in report["calls"]]
    update = UPDATES[transport]
    # SGLang's defaults that the client must override: setting a version label aborts every
    # request, and every update flushes the cache (the client flushes once, after the last one)
    assert sglang_rules.fields("UpdateWeightVersionReqInput")["abort_all_requests"] == "True"
    assert sglang_rules.fields(sglang_rules.body_classes()[update])["flush_cache"] == "True"
    groups = {"/init_weights_update_group", "/destroy_weights_update_group"}
    for server, seq in _per_server(calls).items():
        made = [(c["path"], c["body"]["group_name"]) for c in seq if c["path"] in groups]
        # distributed: each sending rank's group is made once, before the first update, and
        # destroyed at close
        names = {name for _, name in made}
        assert (transport == "distributed") == bool(names), made
        assert sorted(made) == sorted((p, n) for p in groups for n in names), made
        if made:
            paths = [c["path"] for c in seq]
            assert paths.index("/init_weights_update_group") < paths.index(update)
            assert paths[-1] == "/destroy_weights_update_group", paths
        seq = [c for c in seq if c["path"] not in groups]
        paths = [c["path"] for c in seq]
        pushes = [i for i, p in enumerate(paths) if p == "/pause_generation"]
        assert len(pushes) == 2, paths
        for n, start in enumerate(pushes):
            end = pushes[n + 1] if n + 1 < len(pushes) else len(paths)
            one = seq[start:end]
            p = [c["path"] for c in one]
            assert one[0]["body"] == {"mode": mode}
            assert p[-1] == "/continue_generation", p
            ups = [i for i, x in enumerate(p) if x == update]
            assert ups, p
            flush = p.index("/flush_cache")
            assert ups[-1] < flush < len(p) - 1, p
            version = [c for c in one if c["path"] == "/update_weight_version"]
            assert len(version) == 1 and version[0]["body"]["abort_all_requests"] is False
            assert all(one[i]["body"]["flush_cache"] is False for i in ups)  # one flush, at the end
            if transport == "disk":
                assert "/begin_weight_update" not in p and "/end_weight_update" not in p
            else:
                begin, close = p.index("/begin_weight_update"), p.index("/end_weight_update")
                assert one[begin]["body"] == {"selector": "all"}
                assert begin < ups[0] and ups[-1] < close < flush, p
                assert p.count("/begin_weight_update") == p.count("/end_weight_update") == 1


def test_server_info_is_read_once_per_server(reports):
    calls = reports["disk", "abort"][0]["calls"]
    infos = [c["server"] for c in calls if c["path"] == "/server_info"]
    assert sorted(infos) == sorted(set(infos)) and len(infos) == 2, infos


@pytest.mark.parametrize("mode", PAUSE_MODES)
def test_requests_in_flight_through_a_push(reports, mode):
    """abort: the requests come back aborted; retract: they finish, their tokens labelled by
    the versions that generated them (``weight_versions``, half-open spans that tile them)."""
    generated = reports["distributed", mode][0]["generated"]
    assert len(generated) == 4
    for url, status, answer in generated:
        assert status == 200, answer
        meta = answer["meta_info"]
        spans = meta["weight_versions"]
        n = len(answer["output_ids"])
        assert spans[0]["start"] == 0 and spans[-1]["end"] == n
        assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        if mode == "abort":
            assert meta["finish_reason"]["type"] == "abort"
        else:
            assert meta["finish_reason"]["type"] == "length" and n == 200
            assert [s["version"] for s in spans][-1] == "v2"
            assert len(spans) == 2, spans  # started under v1, finished under v2
