"""Issue 36, item 4 against a real vLLM 0.32 server (the CPU build), started as an embedded
``rollout.engine: vllm`` run starts it (``VllmCluster``: ``server_args``' command line, the
project's worker extension): the external-mode probe finds it usable, and a seeded batch larger
than one step's prefill budget does not kill it (vLLM 0.32 on the CPU dies of a chunked prefill
of a seeded request: ``server_args`` turns chunked prefill off there).

``vllm`` tier: one server for the module, ~45-120 s to start on the 2-core machine, ~10 s of
requests."""

from __future__ import annotations

import pytest

from megatron_gspo.config import load_config
from pipeline.engines.choice import engine as choose_engine
from pipeline.engines.vllm import probe
from pipeline.engines.vllm.engine import VllmCluster
from pipeline.generation.client import RolloutClient, SamplingParams
from tests.engines import vllm_env
from tests.rollout.tiny import make_model_dir

pytestmark = pytest.mark.vllm
CFG = load_config("launch/configs/tiny_cpu.yaml", ["rollout.engine=vllm"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    python = vllm_env.python()
    root = tmp_path_factory.mktemp("vllm-live")
    model = make_model_dir(root / "model", head_dim=32)  # a head size vLLM's CPU attention runs
    cluster = VllmCluster(CFG, str(model), 1, log_dir=root / "logs", python=python)
    cluster.start()
    yield cluster
    cluster.stop()


def test_a_server_started_by_the_project_passes_the_external_probe(server):
    assert probe.server_problems(server.server_urls[0], CFG) == []


def test_a_seeded_batch_over_the_prefill_budget_leaves_the_server_alive(server):
    """16 prompts x 8 seeded samples of 40 tokens: 5,120 prompt tokens, more than one step's
    2,048, so a prompt is cut at the budget when chunked prefill is on, and vLLM 0.32's CPU
    worker raises "CPU Generator does not use offset" (EngineDeadError, the server exits)."""
    client = RolloutClient(server_urls=server.server_urls, wire=choose_engine("vllm").wire,
                           max_attempts=1)
    prompts = [[2 + (7 * p + t) % 250 for t in range(40)] for p in range(16)]
    groups = client.generate_groups(prompts, 8, SamplingParams(max_new_tokens=4), seed=3)
    assert all(len(s.output_ids) >= 1 and s.finish_reason != "abort" for g in groups for s in g)
    assert server.server_alive(0)
    again = client.generate_groups(prompts[:1], 8, SamplingParams(max_new_tokens=4), seed=3)
    assert [s.output_ids for s in again[0]] == [s.output_ids for s in groups[0]]  # seeds hold
