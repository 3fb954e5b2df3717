"""The client side of SGLang 0.5.23's rules that needs no server: per-token weight versions read
as SGLang's own code writes them, the pusher's settings from the config (its timeout), and the
layouts that can never sync refused by ``megatron-gspo config`` naming the field.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_client_sglang_rules.py``
"""

from __future__ import annotations

import pytest

from launch.cli import main
from launch.rl_session import weight_pusher_options
from megatron_gspo.config import ConfigError, config_from_dict, load_config
from pipeline.generation.client import weight_version_spans
from pipeline.generation.version import from_wire
# SGLang's own srt/utils/weight_versions.py from the wheel, and the meta_info it builds
from tests.rollout.test_server_conformance import sglang_meta, sglang_weight_versions  # noqa: F401

RECIPE_235B = "launch/configs/qwen3_235b_a22b.yaml"


@pytest.mark.parametrize("events, current, n", [
    ([], "1", 7),                         # one version throughout
    ([("1", 3)], "2", 10),                # a retract push after 3 tokens
    ([("1", 0)], "2", 5),                 # the push before the first token
    ([("1", 2), ("2", 2), ("3", 6)], "4", 9),  # two pushes at the same token count
    ([("1", 4)], "2", 4),                 # aborted at the push: the last span is empty
    ([("1", 3)], "2", 0),                 # aborted in the queue: no output
    ([("default", 3)], "1", 5),           # the server's initial label: no version
])
def test_weight_versions_are_read_as_sglang_writes_them(sglang_weight_versions, events,
                                                        current, n):
    meta = sglang_meta(sglang_weight_versions, events, current, n)
    spans = weight_version_spans(meta, n)
    # every output token has the version SGLang recorded for it, in order, no empty span
    per_token = [v for v, start, end in spans for _ in range(start, end)]
    expected = []
    for s in meta["weight_versions"]:
        expected += [from_wire(s["version"])] * (s["end"] - s["start"])
    assert per_token == expected and len(per_token) == n
    assert all(end > start for _, start, end in spans)


def test_weight_versions_absent_and_malformed():
    # a server before 0.5.23: one span of weight_version
    assert weight_version_spans({"weight_version": "7"}, 4) == [(7, 0, 4)]
    assert weight_version_spans({"weight_version": "default"}, 2) == [(None, 0, 2)]
    assert weight_version_spans({"weight_version": "7"}, 0) == []
    for bad in ([{"version": "a", "start": 0, "end": 2}],                     # short of 3
                [{"version": "a", "start": 1, "end": 3}],                     # a gap first
                [{"version": "a", "start": 0, "end": 2}, {"version": "b", "start": 1, "end": 3}]):
        with pytest.raises(ValueError, match="do not tile the 3 output tokens"):
            weight_version_spans({"weight_versions": bad}, 3)


def test_the_pusher_takes_the_configured_timeout(tmp_path):
    """Defect 7: every weight-sync call is bounded by rollout.request_timeout_s (it was a fixed
    600 s whatever the config said)."""
    cfg = config_from_dict({"rollout": {"request_timeout_s": 1800.0,
                                        "weight_sync": {"transport": "tensor", "verify": False}}})
    options = weight_pusher_options(cfg.rollout, tmp_path)
    assert options["timeout_s"] == 1800.0
    assert options["transport"] == "tensor" and options["verify"] is False
    assert options["shared_dir"] == str(tmp_path / "weights")
    assert config_from_dict({}).rollout.weight_sync.verify == "auto"  # never an error vs SGLang


def test_the_235b_recipe_passes_config(capsys):
    """Its paths are placeholders here: notes, not errors; nothing else is said against it."""
    assert main(["config", "--config", RECIPE_235B]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("# note:")]
    assert notes and all("does not exist on this machine" in n or "router_url" in n
                         for n in notes), notes
    assert "rollout:\n" in out and "# layout: world 64" in out


@pytest.mark.parametrize("sets, field", [
    (["rollout.weight_sync.transport=distributed", "rollout.enable_dp_attention=false"],
     "rollout.dp_size"),
    (["rollout.weight_sync.transport=tensor", "rollout.enable_dp_attention=false"],
     "rollout.dp_size"),
    (["rollout.enable_dp_attention=true", "rollout.dp_size=1"], "rollout.enable_dp_attention"),
])
def test_a_layout_that_cannot_sync_is_refused_by_config(sets, field, capsys):
    args = ["config", "--config", RECIPE_235B] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{field}:" in err, err


def test_dp_attention_servers_sync_with_every_transport():
    """Defect 2: SGLang restricts only data-parallel REPLICAS (dp_size > 1 without dp-attention)
    to disk updates; dp-attention servers take every transport."""
    for transport in ("disk", "tensor", "distributed"):
        cfg = load_config(RECIPE_235B, overrides=[f"rollout.weight_sync.transport={transport}"])
        assert cfg.rollout.enable_dp_attention and cfg.rollout.dp_size == 4
    replicas = config_from_dict({"rollout": {"tp_size": 8, "dp_size": 4,
                                             "weight_sync": {"transport": "disk"}}})
    assert replicas.rollout.dp_size == 4
    with pytest.raises(ConfigError, match="rollout.dp_size: 4 data-parallel replicas"):
        config_from_dict({"rollout": {"tp_size": 8, "dp_size": 4,
                                       "weight_sync": {"transport": "distributed"}}})
