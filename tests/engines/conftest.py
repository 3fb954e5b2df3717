"""The vLLM tier's shared server: ONE real vLLM 0.32 server per test session (a start costs
30-120 s on the 2-core machine, almost all imports), started from the vLLM environment
(``launch/envs/vllm_cpu.sh``; ``tests/engines/vllm_env.py`` finds it) by the project's own
``VllmCluster`` with the project's own command line (``pipeline.engines.vllm.server_args``), and
stopped at the end. The model is the tests' tiny Qwen3-MoE (``tests/rollout/tiny.py``) with
``head_dim`` 32, a head size vLLM's CPU attention runs, fp32."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from pipeline.engines.vllm.engine import VllmCluster
from tests.engines import vllm_env
from tests.rollout.tiny import make_model_dir

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "launch" / "configs" / "tiny_cpu.yaml")


def server_config():
    """The config the session server's command line is rendered from: the tiny model's 256
    positions, fp32 (``model.params_dtype``'s default)."""
    return load_config(TINY, ["model.max_position_embeddings=256"])


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("vllm_model"), seed=0, head_dim=32)


@pytest.fixture(scope="session")
def vllm_cluster(vllm_model, tmp_path_factory):
    """One vLLM server for the session (see the module docstring); its start time is printed."""
    python = vllm_env.python()  # skips the tier's tests when the environment is not built
    # 4 sequences at a time: a batch of 32 long requests runs in waves, so a pause or abort
    # always meets requests mid-decode and others queued (all 32 at once finish together)
    cluster = VllmCluster(server_config(), str(vllm_model), 1, python=python,
                          log_dir=tmp_path_factory.mktemp("vllm_logs"),
                          extra=("--max-num-seqs", "4"))
    t0 = time.perf_counter()
    cluster.start()
    print(f"vLLM server started in {time.perf_counter() - t0:.0f} s", flush=True)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def vllm_url(vllm_cluster) -> str:
    return vllm_cluster.server_urls[0]
