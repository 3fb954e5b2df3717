"""``megatron-gspo demo --task tools`` end to end on CPU, shortened, under ``rollout.async:
one_step``: cold-start SFT on tool-using trajectories, then GSPO on multi-turn trajectories (the
calculator ``pipeline.scoring.tasks:add`` run in the sandbox, its responses appended token-in /
token-out), 2 Megatron ranks (EP2), 2 local rollout servers behind the real router, step n+1's
rollout made while step n trains.

* the demo (its SFT shortened to 150 steps) ends with ``held-out reward: SFT <x> -> GSPO <y>`` then ``tool calls per trajectory:
  <z>``, and plots the tool calls and the end reasons;
* the policy calls the tool; every turn after the first finds its prefix in its server's cache
  (sticky sessions); the trainer's token count is exactly the trajectories' model tokens (the
  tool outputs are masked); every trained token after the first step is exactly one version
  stale (one_step), end reasons add up.

The same shortened demo under ``rollout.async: full`` (the extended tier): trajectories stream
across weight pushes, every token at most ``rollout.max_staleness`` versions stale.

The full demo (40 GSPO steps, reward rising) is measured in README.md and docs/tools.md.

Run: ``.venv/bin/python -m pytest -q tests/e2e/test_tools_demo.py``
"""

from __future__ import annotations

import re

import pytest

from pipeline.observe.metrics import read_metrics
from tests.e2e.conftest import ROOT, megatron_gspo


@pytest.mark.parametrize("mode", ["one_step", pytest.param("full", marks=pytest.mark.extended)])
def test_tools_demo_runs_multiturn_gspo_asynchronously(tmp_path, mode):
    out = tmp_path / "demo_tools"
    sft = tmp_path / "sft.yaml"  # the demo's SFT, shortened: 150 steps teach the call format
    text = (ROOT / "launch/configs/tiny_cpu_tools_sft.yaml").read_text()
    sft.write_text(text.replace("num_steps: 300", "num_steps: 150"))
    assert "num_steps: 150" in sft.read_text()
    proc = megatron_gspo("demo", "--task", "tools", "--out", str(out), "--sft-config", str(sft),
                         "--set", "run.num_steps=3", "--set", "run.eval_interval=3",
                         "--set", "run.save_interval=3", "--set", "run.global_batch_size=64",
                         "--set", "data.num_eval_prompts=16", "--set", f"rollout.async={mode}",
                         timeout=900)
    lines = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"held-out reward: SFT \d\.\d{3} -> GSPO \d\.\d{3}", lines[-2]), lines[-3:]
    calls = re.fullmatch(r"tool calls per trajectory: (\d+\.\d\d)", lines[-1])
    assert calls and float(calls.group(1)) > 0.5, lines[-1]
    plots = {p.name for p in (out / "gspo" / "plots").glob("*.png")}
    assert {"tool_calls.png", "end_reasons.png", "reward.png"} <= plots

    train = [r for r in read_metrics(out / "gspo") if "train/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["train/tool_calls/mean"] > 0.5 and r["train/num_turns/mean"] > 1.0
        assert r["train/cached_tokens_per_turn"] > 0  # sticky: the later turns hit the cache
        assert r["train/masked_tokens"] > 0
        assert r["train/num_tokens"] == r["train/trained_tokens"]  # the loss's tokens
        assert abs(sum(r[f"train/end_reason/{k}"] for k in
                       ("done", "max_turns", "max_tokens", "tool_error", "abort")) - 1) < 1e-9
        if mode == "one_step" and r["step"] > 1:
            assert r["train/staleness_mean"] == r["train/staleness_max"] == 1.0
        if mode == "full":  # the default rollout.max_staleness 1
            assert r["train/staleness_max"] <= 1.0 and r["train/requeued_stale"] == 0
    evals = [r for r in read_metrics(out / "gspo") if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 3] and evals[-1]["eval/tool_calls/mean"] > 0.5
