"""Issue 37 item 1 (acceptance): GSPO trains through weight syncs that pause the servers longer
than the router's health checks tolerate, in every ``rollout.async`` mode.

Run: ``.venv/bin/python -m pytest -q -m extended tests/reliability/test_long_sync_pause.py``

The parts are real: ``megatron-gspo train`` (2 gloo ranks, real Megatron-Core, the tiny CPU
recipe from its seeded initialisation, 3 steps, the disk weight sync) against the project's local
server behind the real sglang-router 0.3.2, both started here as a user starts them for
``rollout.mode: external``:

* the server answers ``/health`` as SGLang 0.5.23 does by default
  (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` true: a one-token generation, which waits while
  the server is paused) and every weight update holds its engine :data:`UPDATE_DELAY_S`
  (``--fault-update-delay-s``: a long disk reload), so every sync pauses it longer than one
  health-check interval;
* the router checks every :data:`ROUTER_ARGS` second with a 1 s timeout, marks a worker
  unhealthy at its first failed check and healthy again after 13 passing ones: it drops the
  server during every sync and re-admits it 12-13 s after ``continue_generation``, longer than
  the client's old budget (5 attempts, 4-11 s of backoff), as sglang-router's defaults do at
  cluster scale (60 s checks, 2 successes: up to 120 s).

On the code before issue 37 each mode ends with ``gave up after 5 attempts; last: No available
workers (all circuits open or unhealthy)`` at the first rollout after a sync. Now every run
finishes (exit 0, steps 1-3 logged) and says that it waited for the router, bounded by
``rollout.router.readmit_timeout_s``.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_gspo.config import load_config
from megatron_gspo.hf.export import hf_config_dict
from pipeline.scoring.tasks import write_byte_tokenizer
from pipeline.servers.cluster import LocalRolloutCluster
from tests.reliability.conftest import CONFIG, ROOT, clean_env, megatron_gspo

UPDATE_DELAY_S = 2.5
ROUTER_ARGS = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "13",
               "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5",
               "--retry-max-retries", "3", "--worker-startup-timeout-secs", "120")
STEPS = 3


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One local server behind the real router (module docstring), shared by the three runs:
    each run's disk sync writes below its ``--weight-roots`` (``rollout.weight_sync.dir``).
    The served directory has the tiny recipe's architecture (random weights: each run's first
    sync replaces them) and the byte tokenizer the router loads."""
    base = tmp_path_factory.mktemp("long_sync_pause")
    served = base / "hf"
    torch.manual_seed(0)
    model = load_config(ROOT / CONFIG).model
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_config_dict(model))).save_pretrained(served)
    write_byte_tokenizer(served)
    weights = base / "weights"
    weights.mkdir()
    with pytest.MonkeyPatch.context() as env:
        # SGLang's default: /health generates (the launchers' own servers get it false)
        env.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        with LocalRolloutCluster(served, 1, log_dir=base / "logs", router_args=ROUTER_ARGS,
                                 server_args=["--weight-roots", str(weights),
                                              "--fault-update-delay-s", str(UPDATE_DELAY_S)]
                                 ) as cluster:
            yield cluster, weights


@pytest.mark.slow  # and in the extended tier (tests/tiers.py)
@pytest.mark.parametrize("mode", ["off", "one_step", "full"])
def test_gspo_trains_through_syncs_that_outlast_the_routers_health_checks(mode, servers,
                                                                          tmp_path):
    cluster, weights = servers
    run_dir = tmp_path / "run"
    sets = [f"run.output_dir={run_dir}", f"run.num_steps={STEPS}", "run.global_batch_size=16",
            "run.micro_batch_size=4", "run.eval_interval=0", "run.save_interval=0",
            "rollout.mode=external", f"rollout.router_url={cluster.router_url}",
            f"rollout.async={mode}", "rollout.weight_sync.transport=disk",
            f"rollout.weight_sync.dir={weights / mode}"]
    proc = megatron_gspo("train", "--config", CONFIG, *[a for s in sets for a in ("--set", s)],
                         timeout=900, env=clean_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), out[-3000:]
    # the router did drop the server during the syncs, and the run waited for it
    assert "unhealthy during the pause" in out or "answers 503 No available workers" in out, \
        out[-5000:]
    assert max(r["sync/router_readmit_s"] for r in steps) > 5.0, [
        r["sync/router_readmit_s"] for r in steps]
    assert min(r["sync/paused_s"] for r in steps) >= UPDATE_DELAY_S
