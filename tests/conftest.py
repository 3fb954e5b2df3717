"""Fixtures shared by several test directories.

``sft_policy``: one cold-start SFT policy (a Hugging Face directory) per session, the starting point
of every GSPO run in the tests (tests/e2e, tests/slurm). About 90 s on a busy 2-core CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiers import EXTENDED, SLOW

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    # The registry's warnings that are benign only without CUDA (pyproject.toml lists the others):
    # on a GPU machine a missing Transformer Engine shows in the summary (pipeline/observe/benign_warnings.py).
    from pipeline.observe import benign_warnings

    if not benign_warnings.showing_everything() and not benign_warnings.cuda_machine():
        for line in benign_warnings.pytest_filters(only_without_cuda=True):
            config.addinivalue_line("filterwarnings", line)


# The tests that touch Megatron-Core and run on both supported stacks (megatron_gspo/mcore_compat.py):
# marked ``mcore`` here, in one place; .ci/run runs ``pytest -m mcore`` on the Python 3.12 stack
# (megatron-core 0.19.2) after the full suite on the default one. Node-id prefixes.
MCORE_SUBSET = (
    "tests/unit/test_model_config.py",                # the policy's Megatron config
    "tests/unit/test_cpu_compat.py",                  # the CPU accommodations still apply / needed
    "tests/unit/test_benign_warnings.py",             # Megatron's notices silenced, others loud
    # gradients equal to the single process: one data-, one tensor+expert-, one pipeline-parallel
    # case (all of them on the default stack; CI's time)
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[DP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[TP2xEP2xETP2]",
    "tests/distributed/test_layouts.py::test_one_step_matches_single_process[PP2]",
    "tests/distributed/test_logprobs.py",             # log-probs against transformers' Qwen3-MoE
    "tests/distributed/test_checkpoint.py",           # save / resume exactly, across layouts
    "tests/distributed/test_convert.py",              # HF <-> Megatron round trip, resharding
    "tests/unit/test_te_spec_extra_state.py",         # the TE spec's _extra_state keys (0.19 only)
    # RouterReplay: bit-equal replay, the update it changes, replay under TP2xEP2 (SP slices)
    "tests/distributed/test_routing_replay.py::test_replay_of_unchanged_routing_is_bit_equal",
    "tests/distributed/test_routing_replay.py::test_replayed_gates_differ_exactly_where_expert_sets_differ",
    "tests/distributed/test_routing_replay.py::test_replay_changes_the_update",
    "tests/distributed/test_routing_replay.py::test_replay_under_expert_and_tensor_parallelism[TP2xEP2]",
    "tests/distributed/test_resume_new_layout.py",    # resume resharded under another layout
    # a GSPO run end to end: two steps of the 30B recipe's settings against SGLang-conformant
    # servers (the reward-rises run, 3.5 min with its SFT policy, stays on the default stack)
    "tests/e2e/test_recipes_train.py::test_recipe_trains_two_steps_against_sglang_conformant_servers[qwen3_30b_a3b]",
    "tests/e2e/test_console.py::test_two_rank_sft_console_is_rank_0_without_third_party_warnings",
)


def pytest_runtest_logreport(report) -> None:
    # MGSPO_TEST_TIMES=FILE appends "nodeid<TAB>phase<TAB>seconds<TAB>outcome" per test phase as the
    # run goes (what the tiers in pyproject.toml were sized from; kept even if the run is cut short)
    path = os.environ.get("MGSPO_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\n")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if _listed(item.nodeid, MCORE_SUBSET):
            item.add_marker(pytest.mark.mcore)
        if _listed(item.nodeid, SLOW):
            item.add_marker(pytest.mark.slow)  # the fast tier leaves it out (tests/tiers.py)
        if _listed(item.nodeid, EXTENDED):
            item.add_marker(pytest.mark.extended)  # out of the README's suite (tests/tiers.py)
        # the tiers out of the README's suite are out of the fast tier too: `-m "not slow"`
        # replaces pyproject.toml's `-m` (addopts), which is what leaves them out of the suite
        if any(item.get_closest_marker(tier) for tier in OUTSIDE_THE_SUITE):
            item.add_marker(pytest.mark.slow)


OUTSIDE_THE_SUITE = ("extended", "bridge", "vllm")
"""The markers pyproject.toml's addopts leaves out of the README's suite."""


def _listed(nodeid: str, prefixes: tuple[str, ...]) -> bool:
    """``nodeid`` is one of ``prefixes``: a file, a test function (any of its parameters) or a case."""
    return any(nodeid == p or nodeid.startswith((p + "::", p + "[")) for p in prefixes)


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    # the config's own number of steps (the demo's SFT policy)
    args = ["sft", "--config", "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={out}",
            "--set", "run.eval_interval=0", "--set", "run.log_interval=100"]
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f"megatron-gspo {' '.join(args)} exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    return out / "hf"
