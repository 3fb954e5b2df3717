"""Issue 36: the vLLM server's command line (``pipeline.engines.vllm.server_args``) is vLLM 0.32's
own: every rendered argv is parsed by vLLM's parser in the vLLM environment's interpreter
(tests/engines/vllm_cli.py: ``make_arg_parser``, ``validate_parsed_serve_args``,
``AsyncEngineArgs.from_cli_args``; exact spellings, no aliases, nothing deprecated) and the
parsed values are checked against the config. The refusals and the environment are unit tests.

The parser tests are marked ``vllm`` (they start the vLLM environment's interpreter: ~8 s for the
module on the 2-core machine, most of it importing vLLM)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.rollout_plan import SERVER_BUDGETS
from pipeline.engines.vllm import server_args as sa
from tests.engines import vllm_env

WORKER = Path(__file__).resolve().with_name("vllm_cli.py")
TINY = "launch/configs/tiny_cpu.yaml"
RECIPE = "launch/configs/qwen3_30b_a3b.yaml"
REPLAY = ("gspo.routing_replay=rollout", "model.recompute_granularity=selective",
          "model.recompute_method=null", "model.recompute_num_layers=null")
"""Routing replay on the recipe: its full recompute re-runs the router, which replay refuses."""


class VllmParser:
    """vLLM's parser in a process of the vLLM environment (one per module)."""

    def __init__(self, python: Path, log: Path):
        self._stderr = log.open("w")
        self.log = log
        self.proc = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    def parse(self, argv: list[str]) -> dict:
        self.proc.stdin.write(json.dumps({"argv": argv}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the parser process exited ({self.proc.wait()}):\n"
                               f"{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def defaults(self, dests: list[str]) -> dict:
        """vLLM's engine arguments without any flag, by destination."""
        self.proc.stdin.write(json.dumps({"defaults": dests}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        assert answer["error"] is None, answer["error"]
        return answer["values"]

    def accepts(self, argv: list[str]) -> dict:
        answer = self.parse(argv)
        assert answer["error"] is None, (f"vLLM refuses the rendered command line: "
                                         f"{answer['error']}\n  {' '.join(argv)}")
        return answer["values"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self._stderr.close()


@pytest.fixture(scope="module")
def vllm_parser(tmp_path_factory):
    parser = VllmParser(vllm_env.python(), tmp_path_factory.mktemp("vllm-cli") / "parser.log")
    yield parser
    parser.close()


def _cfg(path: str, *sets: str):
    return load_config(path, list(sets))


@pytest.mark.vllm
def test_cpu_server_argv_is_vllms_own(vllm_parser):
    """The CPU server of the demo's config: the RL surface (scale-out generate, the worker
    extension), the trainer's dtype and length, eager mode, no NCCL weight transfer."""
    cfg = _cfg(TINY)
    argv = sa.server_argv(cfg, model_path="/models/tiny", host="127.0.0.1", port=8102, seed=7,
                          device="cpu")
    got = vllm_parser.accepts(argv)
    assert (got["model"], got["host"], got["port"], got["seed"]) == ("/models/tiny", "127.0.0.1",
                                                                     8102, 7)
    assert got["dtype"] == cfg.model.params_dtype == "float32"
    assert got["max_model_len"] == cfg.model.max_position_embeddings
    assert got["tensor_parallel_size"] == 1
    assert got["enable_scale_out"] is True and got["enforce_eager"] is True
    assert got["enable_chunked_prefill"] is False  # seeded + chunked kills the CPU engine
    assert got["worker_extension_cls"] == sa.WORKER_EXTENSION
    assert "weight_transfer_config" not in got and "enable_return_routed_experts" not in got
    bf16 = vllm_parser.accepts(sa.server_argv(cfg, model_path="/m", port=1, seed=0, device="cpu",
                                              dtype="bfloat16", max_model_len=256))
    assert (bf16["dtype"], bf16["max_model_len"]) == ("bfloat16", 256)


@pytest.mark.vllm
def test_gpu_server_argv_is_vllms_own(vllm_parser):
    """The 30B recipe's servers on GPUs: TP 2 with expert parallelism over it, the memory share,
    the CUDA-graph bound, vLLM's NCCL weight transfer, routed experts for routing replay, sleep
    mode for colocated servers; deterministic rollouts: one sequence, no prefix cache."""
    cfg = _cfg(RECIPE, "rollout.ep_size=2", *REPLAY)
    got = vllm_parser.accepts(sa.server_argv(cfg, model_path="/models/hf", port=20010, seed=1234,
                                             device="cuda"))
    assert got["tensor_parallel_size"] == cfg.rollout.tp_size == 2
    assert got["enable_expert_parallel"] is True
    assert got["dtype"] == "bfloat16"
    assert got["gpu_memory_utilization"] == cfg.rollout.mem_fraction_static == 0.85
    assert got["max_cudagraph_capture_size"] == cfg.rollout.cuda_graph_max_bs == 256
    assert got["weight_transfer_config"] == "WeightTransferConfig(backend='nccl')"
    assert got["enable_return_routed_experts"] is True
    assert "enforce_eager" not in got and "enable_sleep_mode" not in got
    env = sa.server_env(cfg, device="cuda", repo_root="/repo")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"

    cfg = _cfg(TINY, "rollout.deterministic=true", "rollout.colocated=true",
               "rollout.weight_sync.transport=disk")
    got = vllm_parser.accepts(sa.server_argv(cfg, model_path="/m", port=1, seed=0, device="cuda"))
    assert (got["max_num_seqs"], got["enable_prefix_caching"]) == (1, False)
    assert got["enable_sleep_mode"] is True and "weight_transfer_config" not in got


@pytest.mark.vllm
@pytest.mark.parametrize("argv, refusal", [
    (["-tp", "2"], "-tp: an alias"),
    (["--tensor-parallel", "2"], "--tensor-parallel: not one of vLLM's flags"),
    (["--weight-transfer-config", "{bad"], "--weight-transfer-config"),
    (["--dtype", "fp32"], "invalid choice"),
    (["--random-seed", "1"], "unrecognized arguments"),  # SGLang's spelling
])
def test_the_check_refuses_what_vllm_would_not_take(vllm_parser, argv, refusal):
    error = vllm_parser.parse(["--model", "/m", *argv])["error"]
    assert error is not None and refusal in error, error


def test_cpu_refuses_routing_replay_and_head_sizes_vllm_cannot_run():
    with pytest.raises(ConfigError, match=r"^gspo\.routing_replay: 'rollout' needs .* only on "
                                          r"GPUs .*Triton"):
        sa.server_argv(_cfg(TINY, "gspo.routing_replay=rollout"), model_path="/m", port=1,
                       seed=0, device="cpu")
    sa.check_supported(_cfg(TINY, "gspo.routing_replay=old"), "cpu")  # the trainer's own: fine
    cfg = _cfg(TINY)
    cfg = replace(cfg, model=replace(cfg.model, head_dim=24))
    with pytest.raises(ConfigError, match=r"^model\.head_dim: 24 is not a head size"):
        sa.check_supported(cfg, "cpu")
    sa.check_supported(cfg, "cuda")


def test_layouts_vllm_cannot_serve_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^rollout\.dp_size: 2 data-parallel ranks"):
        sa.check_supported(_cfg(RECIPE, "rollout.dp_size=2",
                                "rollout.weight_sync.transport=disk"), "cuda")
    with pytest.raises(ConfigError, match=r"^rollout\.ep_size: 2; .* 1 or rollout\.tp_size 4"):
        sa.check_supported(_cfg(RECIPE, "rollout.tp_size=4", "rollout.ep_size=2"), "cuda")
    with pytest.raises(ConfigError, match=r"^rollout\.deterministic: .*prefix cache"):
        sa.check_supported(_cfg(RECIPE, "rollout.deterministic=true", *REPLAY), "cuda")


def test_environment_and_shell_rendering(tmp_path):
    cfg = _cfg(TINY)
    env = sa.server_env(cfg, device="cpu", repo_root=tmp_path, host_ip="127.0.0.1",
                        pythonpath="/site")
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "PYTHONPATH": f"{tmp_path.resolve()}:/site", "VLLM_HOST_IP": "127.0.0.1",
                   "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert sa.server_env(_cfg(TINY, "rollout.deterministic=true"), device="cpu",
                         repo_root="/r", kv_cache_gib=0.5)["VLLM_CPU_KVCACHE_SPACE"] == "0.5"
    assert sa.server_env(_cfg(TINY, "rollout.deterministic=true"), device="cpu",
                         repo_root="/r")["VLLM_BATCH_INVARIANT"] == "1"
    words = sa.command(sa.Shell('"$PY"'), sa.server_argv(
        _cfg(RECIPE), model_path=sa.Shell('"$MODEL"'), port=sa.Shell("$((P0 + 2 * i))"),
        seed=sa.Shell("$((1234 + i))"), device="cuda"))
    line = sa.shell_command(words)
    assert line.startswith(f'"$PY" -m {sa.API_SERVER_MODULE} --model "$MODEL" --host 0.0.0.0 '
                           "--port $((P0 + 2 * i)) --seed $((1234 + i))")
    assert """--weight-transfer-config '{"backend": "nccl"}'""" in line


@pytest.mark.vllm
def test_the_memory_plans_vllm_default_share_is_vllms_own(vllm_parser):
    """``megatron-gspo plan`` with ``rollout.engine: vllm`` and no ``rollout.mem_fraction_static``
    (which renders no --gpu-memory-utilization) plans vLLM's own default share of the GPU."""
    cfg = _cfg(RECIPE, "rollout.engine=vllm", "rollout.mem_fraction_static=null")
    argv = sa.server_argv(cfg, model_path="/models/hf", port=20010, seed=1, device="cuda")
    assert "--gpu-memory-utilization" not in argv
    got = vllm_parser.defaults(["gpu_memory_utilization"])
    assert got["gpu_memory_utilization"] == SERVER_BUDGETS["vllm"].default
