"""Issue 36: the engine seam (``pipeline/engines``) without a server: the vLLM wire's requests
and answers (vLLM 0.32's shapes), its control calls' mapping of the pipeline's pause modes, the
transports each engine offers and refuses, ``rollout.engine`` in the config, and the rule that
nothing outside ``pipeline/engines/choice.py`` and the config asks which engine runs. The real
vLLM is the ``vllm`` tier's (tests/engines)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ConfigError, load_config
from pipeline.engines.base import PAUSE_MODES
from pipeline.engines.choice import ENGINES, engine
from pipeline.engines.sglang import SGLANG
from pipeline.engines.vllm import client as vc
from pipeline.engines.vllm.engine import VLLM
from pipeline.engines.vllm.weights import NCCL_ON_CPU, VllmDiskTransport, VllmGlooTransport
from pipeline.generation.client import RolloutError, SamplingParams
from pipeline.generation.trajectory import Span
from pipeline.weights.disk import DiskTransport
from pipeline.weights.push import WeightPusher

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "launch" / "configs" / "tiny_cpu.yaml")


def answer(ids, logprobs=None, finish="length", spans=None, **extra) -> dict:
    logprobs = logprobs if logprobs is not None else [-1.0] * len(ids)
    spans = spans if spans is not None else [{"version": "3", "start": 0, "end": len(ids)}]
    return {"choices": [{"index": 0, "finish_reason": finish, "token_ids": ids,
                         "weight_versions": spans,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp}
                                                  for t, lp in zip(ids, logprobs)]}, **extra}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}}


def test_vllm_request_uses_vllms_names_and_the_samples_seed():
    sp = SamplingParams(temperature=0.7, max_new_tokens=9, stop_token_ids=[1], sampling_seed=2**63 + 5)
    body = VLLM.wire.payload("r1", [5, 6], sp)
    assert body["request_id"] == "r1" and body["token_ids"] == [5, 6]
    params = body["sampling_params"]
    assert params["max_tokens"] == 9 and params["temperature"] == 0.7 and params["n"] == 1
    assert params["logprobs"] == 0 and params["stop_token_ids"] == [1]
    assert params["top_k"] == 0  # vLLM's "whole vocabulary" (SGLang's -1)
    assert params["seed"] == 5  # within vLLM's int64 seed
    assert "seed" not in VLLM.wire.payload("r2", [5], SamplingParams())["sampling_params"]
    routed = VLLM.wire.payload("r3", [5], sp, return_routed_experts=True)["sampling_params"]
    assert routed["routed_experts_prompt_start"] == 0  # rows from position 0, as SGLang's


def test_vllm_answer_reads_ids_logprobs_finish_and_version_spans():
    raw = json.dumps(answer([7, 8, 9], [-0.5, -1.5, -2.5], finish="abort", spans=[
        {"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]))
    r = asyncio.run(VLLM.wire.read(raw.encode(), "r1", [1, 2, 3], "http://s"))
    assert r.output_ids == [7, 8, 9] and r.output_logprobs == [-0.5, -1.5, -2.5]
    assert r.finish_reason == "abort" and r.prompt_ids == [1, 2, 3]
    assert r.weight_versions == [Span(None, 0, 1), Span(4, 1, 3)] and r.weight_version == 4
    stop = asyncio.run(VLLM.wire.read(json.dumps(answer([7, 1], finish="stop")).encode(),
                                      "r2", [1], "http://s"))
    assert stop.finish_reason == "stop" and stop.matched_stop == 1


@pytest.mark.parametrize("broken", [
    answer([7, 8], [-1.0]),  # a log-prob missing
    answer([7, 8], spans=[{"version": "1", "start": 0, "end": 1}]),  # spans do not tile
    answer([7], finish="error"),
    {"choices": []},
])
def test_a_malformed_vllm_answer_is_a_rollout_error_naming_the_server(broken):
    with pytest.raises(RolloutError, match="http://s: HTTP 200"):
        asyncio.run(VLLM.wire.read(json.dumps(broken).encode(), "r", [1], "http://s"))


def test_abort_calls_name_vllms_request_ids():
    assert VLLM.wire.abort_call("g-p0-s1") == ("/abort_requests",
                                               {"request_ids": ["generate-tokens-g-p0-s1"]})
    assert VLLM.wire.abort_call(None) == ("/abort_requests", {})
    assert SGLANG.wire.abort_call(None) == ("/abort_request", {"abort_all": True})


def test_the_pipelines_pause_modes_map_onto_vllms(monkeypatch):
    calls = []
    monkeypatch.setattr(vc.rollout, "control",
                        lambda url, path, body=None, **kw: calls.append(path) or {"success": True})
    for mode in PAUSE_MODES + ("keep", "wait"):
        VLLM.control.pause("http://s", mode, timeout_s=5)
    assert calls == ["/pause?mode=abort&clear_cache=false", "/pause?mode=keep&clear_cache=false",
                     "/pause?mode=keep&clear_cache=false", "/pause?mode=wait&clear_cache=false"]
    calls.clear()
    VLLM.control.after_update("http://s", "retract", timeout_s=5)  # frozen requests recomputed
    VLLM.control.after_update("http://s", "abort", timeout_s=5)
    assert calls == ["/reset_prefix_cache?reset_running_requests=true", "/reset_prefix_cache"]
    with pytest.raises(ValueError, match="pause mode 'in_place'"):
        VLLM.control.pause("http://s", "in_place", timeout_s=5)


def test_each_engine_makes_its_own_transports(tmp_path):
    assert engine("sglang") is SGLANG and engine("vllm") is VLLM and set(ENGINES) == {"sglang", "vllm"}
    disk = WeightPusher(["http://s"], transport="disk", shared_dir=tmp_path, engine=VLLM)
    assert type(disk._transport) is VllmDiskTransport
    assert type(WeightPusher(["http://s"], transport="disk", shared_dir=tmp_path)._transport) \
        is DiskTransport  # SGLang's, the default
    if not torch.cuda.is_available():
        gloo = WeightPusher(["http://s"], transport="distributed", engine=VLLM)
        assert type(gloo._transport) is VllmGlooTransport
        with pytest.raises(ValueError) as err:
            WeightPusher(["http://s"], transport="distributed", backend="nccl", engine=VLLM)
        assert str(err.value) == NCCL_ON_CPU
    with pytest.raises(ValueError, match="CUDA IPC"):
        WeightPusher(["http://s"], transport="tensor", engine=VLLM)
    with pytest.raises(ValueError, match="pause_mode 'keep'"):
        WeightPusher(["http://s"], transport="disk", shared_dir=tmp_path, pause_mode="keep")


def test_a_vllm_server_without_the_worker_extension_is_refused_by_name(tmp_path):
    pusher = WeightPusher(["http://s"], transport="disk", shared_dir=tmp_path, engine=VLLM)
    with pytest.raises(ValueError, match="without the project's worker extension"):
        pusher._transport.check_server("http://s", {"worker_extension": False})
    assert VLLM.control.extensions({"worker_extension": True}) == {"checksums"}
    assert VLLM.control.extensions({"worker_extension": False}) == set()


@pytest.mark.parametrize("override, field", [
    ("rollout.engine=tgi", "rollout.engine"),
    ("rollout.top_p=0.9", "rollout.engine"),
    ("rollout.colocated=true", "rollout.colocated"),
    ("rollout.weight_sync.transport=tensor", "rollout.engine"),
])
def test_rollout_engine_is_validated_with_one_line_naming_the_field(override, field):
    sets = [override] if override.startswith("rollout.engine") else ["rollout.engine=vllm", override]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, sets)
    assert f"{field}:" in str(err.value) and "\n" not in str(err.value)
    assert load_config(TINY, []).rollout.engine == "sglang"


SLURM_LAUNCHER = ("launch/slurm.py", "launch/slurm_vllm.py")
"""The Slurm launcher renders each engine's server commands into the job script (issue 36 item
4): it asks which engine the config names, before any session exists."""


def test_nothing_outside_the_engines_choice_asks_which_engine_runs():
    """A new engine is an implementation behind the seam, never an ``if engine ==`` branch in the
    pipeline or the session (the Slurm launcher's job script aside)."""
    asks = re.compile(r"\bengine\s*[!=]=|rollout\.engine\s*(in|==|!=)")
    found = [f"{p.relative_to(ROOT)}:{n}" for top in ("pipeline", "launch")
             for p in (ROOT / top).rglob("*.py")
             if str(p.relative_to(ROOT)) not in SLURM_LAUNCHER
             for n, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []
