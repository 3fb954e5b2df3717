"""``megatron-gspo calibrate-eps`` end to end: rollouts, one update, the range it prints.

From the demo's SFT policy (``sft_policy``, shared with the other e2e tests), one training rank
and one local rollout server: 2 rollout batches of 32, one update on a mini-batch of 16
(k = 2), s_i of the 48 other sequences. The written range keeps the configured eps_high/eps_low
ratio and is the smallest that clips at most floor(0.1 * 48) = 4 of those sequences, checked on
the (s_i, A_i) the report lists (4 unless identical responses tie; the math itself is tested on a
log-normal in tests/unit/test_clip_calibration.py); the config checks refuse a token-clip variant
and a setup where nothing is ever clipped, naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from launch.calibrate_eps import calibration_config
from megatron_gspo.config import ConfigError, load_config
from pipeline.servers.cluster import free_port
from tests.e2e.conftest import ROOT

CONFIG = "launch/configs/tiny_cpu.yaml"


def test_calibrate_eps_prints_and_writes_the_range(sft_policy, tmp_path):
    settings = [f"run.output_dir={tmp_path}", f"run.init_from={sft_policy}", "parallel.expert=1",
                "rollout.num_servers=1", "run.global_batch_size=32", "run.micro_batch_size=8",
                "gspo.updates_per_rollout=2", "gspo.dynamic_sampling=true"]
    args = ["calibrate-eps", "--config", CONFIG, "--rollouts", "2", "--target-clip-frac", "0.1"]
    for item in settings:
        args += ["--set", item]
    # one rank, started by this command itself: its own store port
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "calibrate_eps" / "calibration.json").read_text())
    assert report["num_sequences"] <= 48 and report["update_sequences"] == 16
    assert report["lr"] == pytest.approx(5e-4)  # optim.lr: no warmup
    assert report["eps_high"] / report["eps_low"] == pytest.approx(4e-4 / 3e-4)
    n = report["num_sequences"]
    s = torch.tensor(report["sequences"]["s"], dtype=torch.float64)
    adv = torch.tensor(report["sequences"]["advantage"], dtype=torch.float64)
    assert s.numel() == adv.numel() == n
    # the reported fraction is what GSPO clips under the printed range, and the range is the
    # smallest that clips at most floor(0.1 n): ANY smaller one (same eps_high / eps_low) clips
    # more. Ties (identical responses of a group) can make that fewer than floor(0.1 n).
    clipped = (((adv > 0) & (s > 1 + report["eps_high"])) | ((adv < 0) & (s < 1 - report["eps_low"])))
    assert report["clip_frac"] == pytest.approx(int(clipped.sum()) / n)
    assert int(clipped.sum()) <= int(0.1 * n)
    shrunk = 1 - 1e-9
    more = (((adv > 0) & (s > 1 + shrunk * report["eps_high"]))
            | ((adv < 0) & (s < 1 - shrunk * report["eps_low"])))
    assert int(more.sum()) > int(0.1 * n)
    quantiles = list(report["s_quantiles"].values())
    assert quantiles == sorted(quantiles) and quantiles[0] < 1 < quantiles[-1]
    assert f"gspo.eps_low: {report['eps_low']:.4g}" in proc.stdout


def test_calibration_refuses_what_it_cannot_calibrate():
    token_clip = load_config(CONFIG, ["gspo.variant=grpo"])
    with pytest.raises(ConfigError, match="gspo.variant: grpo clips the per-token ratio"):
        calibration_config(token_clip, "/tmp/x")
    for variant in ("cispo", "sapo", "gmpo"):  # ranges of their own, not the sequence range
        own = load_config(CONFIG, [f"gspo.variant={variant}"])
        with pytest.raises(ConfigError, match=f"gspo.variant: {variant} has a range of its own"):
            calibration_config(own, "/tmp/x")
    luspo = calibration_config(load_config(CONFIG, ["gspo.variant=luspo"]), "/tmp/x")
    assert luspo.gspo.variant == "luspo"  # GSPO's sequence range: calibrated as gspo's
    on_policy = load_config(CONFIG, ["gspo.updates_per_rollout=1"])
    with pytest.raises(ConfigError, match="gspo.updates_per_rollout: 1 .* nothing is ever clipped"):
        calibration_config(on_policy, "/tmp/x")
    cfg = calibration_config(load_config(CONFIG, ["optim.warmup_steps=5"]), "/tmp/x")
    assert cfg.gspo.updates_per_rollout == 1 and cfg.optim.warmup_steps == 0
    assert cfg.run.output_dir == "/tmp/x"
