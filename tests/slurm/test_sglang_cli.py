"""Issue 20, item 5: the command lines ``launch slurm`` renders for ``sglang.launch_server`` and
``sglang_router.launch_router`` are those programs' own.

Each server task's ``bash -c`` body of the rendered batch script is run by bash (its $-variables
expanded as in a task: SLURM_PROCID, SLURM_LOCALID, the port base, the rollout hosts) with the
program replaced by a script that records its argv; that argv is parsed by SGLang 0.5.23's own
``ServerArgs`` argparse definition, built from the sglang wheel (``tests/sglang_wheel.py``; no
CUDA code imported, see ``tests/slurm/sglang_cli.py``), and the router's by the installed
sglang-router's. A command line passes only if the parser takes it (an unknown flag, a renamed
one, an ambiguous abbreviation such as 0.5.23's ``--cuda-graph-max-bs`` or a bad value fails)
with every flag spelled exactly as registered (no abbreviation, no alias) and none of the
deprecated spellings (``--enable-dp-attention``); the parsed values are checked against the
config. Both shipped recipes (tests/slurm/recipe_inputs.py stand-ins) and several layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import fields, replace
from pathlib import Path
from typing import Optional

import pytest

from tests import sglang_wheel
from tests.slurm.test_recipes import RECIPES, _sets
from tests.slurm.test_render import GPU_OPTIONS, dry_run, srun_lines

WORKER = Path(__file__).resolve().with_name("sglang_cli.py")
SERVER, ROUTER = "sglang.launch_server", "sglang_router.launch_router"
HOSTS = [f"gpu-{n:03d}" for n in range(1, 17)]
PORT0 = 20010
ROUTER_PORT = 20000


class Programs:
    """The parsers of SGLang 0.5.23 and sglang-router, in a process of their own (the wheel's
    import stubs never reach this one)."""

    def __init__(self, wheel: Path, log: Path):
        self.log = log
        self._stderr = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(WORKER), str(wheel)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True)

    def parse(self, program: str, argv: list[str]) -> dict:
        """``{"error": None | message, "values": {dest: value}}``."""
        self.proc.stdin.write(json.dumps({"program": program, "argv": argv}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the parser process exited ({self.proc.wait()}):\n"
                               f"{self.log.read_text()[-3000:]}")
        answer = json.loads(line)
        if "skip" in answer:
            pytest.skip(answer["skip"])
        return answer

    def accepts(self, program: str, argv: list[str]) -> dict:
        answer = self.parse(program, argv)
        assert answer["error"] is None, (f"{program} refuses the rendered command line: "
                                         f"{answer['error']}\n  {' '.join(argv)}")
        return answer["values"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self._stderr.close()


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    wheel = sglang_wheel.wheel()  # skips without network and without a cached wheel
    progs = Programs(wheel, tmp_path_factory.mktemp("sglang-cli") / "parser.log")
    yield progs
    progs.close()


def task_argv(body: str, tmp_path: Path, *, procid: int = 0, localid: int = 0) -> tuple[str, list[str]]:
    """The program (``-m`` module) and argv that ``bash -c body`` execs in task ``procid``."""
    dump = tmp_path / "argv"
    recorder = tmp_path / "record-argv"
    recorder.write_text('#!/bin/sh\nprintf \'%s\\0\' "$@" > "$ARGV_DUMP"\n')
    recorder.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "ARGV_DUMP": str(dump), "MGSPO_SGLANG_PYTHON": str(recorder),
           "MGSPO_PYTHON": str(recorder), "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid),
           "MGSPO_SERVER_PORT0": str(PORT0), "MGSPO_ROLLOUT_HOSTS": " ".join(HOSTS) + " ",
           "MGSPO_MODEL_PATH": "/models/hf", "MGSPO_RUN_DIR": str(tmp_path),
           "ROUTER_PORT": str(ROUTER_PORT)}
    dump.unlink(missing_ok=True)
    subprocess.run(["bash", "-c", body], env=env, check=True, timeout=30)
    argv = [w.decode() for w in dump.read_bytes().split(b"\0")[:-1]]
    assert argv[0] == "-m", argv
    return argv[1], argv[2:]


def check_script(script: str, programs: Programs, tmp_path: Path, *, tasks: list[tuple[int, int]]):
    """Every given (SLURM_PROCID, SLURM_LOCALID) server task's and the router's command line;
    the servers' parsed values, in task order."""
    servers, router, _ = srun_lines(script)
    values = []
    for procid, localid in tasks:
        program, argv = task_argv(servers[-1], tmp_path, procid=procid, localid=localid)
        assert program == SERVER
        values.append(programs.accepts(SERVER, argv))
    program, argv = task_argv(router[-1], tmp_path)
    assert program == ROUTER
    got = programs.accepts(ROUTER, argv)
    assert (got["host"], got["port"], got["prometheus_port"]) == ("0.0.0.0", ROUTER_PORT,
                                                                  ROUTER_PORT + 2)
    return values


@pytest.mark.parametrize("name", list(RECIPES))
def test_shipped_recipes_render_sglangs_command_lines(name, programs, tmp_path, capsys):
    from launch.cli import main
    from megatron_gspo.config import load_config

    nodes, rollout_nodes, _, _, _ = RECIPES[name]
    config = f"launch/configs/{name}.yaml"
    assert main(["launch", "slurm", "--config", config, "--nodes", str(nodes), "--rollout-nodes",
                 str(rollout_nodes), "--gpus-per-node", "8", "--model-path", "/models/hf",
                 "--dry-run", *_sets(tmp_path, name)]) == 0
    script = capsys.readouterr().out
    rollout = load_config(config).rollout
    per_node = max(1, 8 // rollout.tp_size)
    tasks = [(0, 0), (1, 1 % per_node), (per_node + 1, 1 % per_node)]
    first, second, third = check_script(script, programs, tmp_path, tasks=tasks)
    assert first["model_path"] == "/models/hf" and first["host"] == "0.0.0.0"
    assert first["tp_size"] == rollout.tp_size
    assert first["mem_fraction_static"] == rollout.mem_fraction_static
    assert first["cuda_graph_max_bs_decode"] == rollout.cuda_graph_max_bs == 256
    if rollout.enable_dp_attention:  # the 235B recipe: 16-GPU servers over 2 nodes, DP attention
        assert first["attn_dp_size"] == rollout.dp_size == 4 and "dp_size" not in first
        assert first["ep_size"] == rollout.ep_size == 16
        assert (first["nnodes"], first["node_rank"], second["node_rank"]) == (2, 0, 1)
        assert first["dist_init_addr"] == second["dist_init_addr"] == f"gpu-001:{PORT0 + 1}"
        assert third["dist_init_addr"] == f"gpu-003:{PORT0 + 2 + 1}" and third["port"] == PORT0 + 2
    else:  # the 30B recipe: 4 servers of 2 GPUs per node
        assert "attn_dp_size" not in first and "dp_size" not in first
        assert [v["base_gpu_id"] for v in (first, second)] == [0, rollout.tp_size]
        assert [v["port"] for v in (first, second, third)] == [PORT0, PORT0 + 2, PORT0 + 2 * (per_node + 1)]
        assert [v["random_seed"] for v in (first, second)] == [1234, 1235]


def test_layouts_render_sglangs_command_lines(programs, tmp_path, capsys):
    """tp 4 (2 servers a node), DP attention with experts, one GPU per task, tp 16 over 2 nodes."""
    script = dry_run(capsys, tmp_path / "a", *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    a0, a1 = check_script(script, programs, tmp_path, tasks=[(0, 0), (1, 1)])
    assert (a0["tp_size"], a0["base_gpu_id"], a1["base_gpu_id"]) == (4, 0, 4)

    script = dry_run(capsys, tmp_path / "b", *GPU_OPTIONS, "--gpu-binding", "task",
                     sets=["rollout.tp_size=4", "rollout.ep_size=4", "rollout.enable_dp_attention=true",
                           "rollout.dp_size=2", "parallel.tensor=2", "parallel.sequence_parallel=true"])
    (b0,) = check_script(script, programs, tmp_path, tasks=[(3, 1)])
    assert (b0["tp_size"], b0["attn_dp_size"], b0["ep_size"], b0["base_gpu_id"]) == (4, 2, 4, 0)

    script = dry_run(capsys, tmp_path / "c", *GPU_OPTIONS, sets=["rollout.tp_size=16"])
    c0, c1 = check_script(script, programs, tmp_path, tasks=[(2, 0), (3, 0)])
    assert (c0["tp_size"], c0["nnodes"], c0["node_rank"], c1["node_rank"]) == (16, 2, 0, 1)
    assert c0["dist_init_addr"] == c1["dist_init_addr"] == f"gpu-003:{PORT0 + 2 + 1}"


def _rollout_like(rollout, **changes):
    """The config's rollout section with ``changes`` (no validation: a layout the config may not
    offer yet must still render SGLang's flags)."""
    values = {f.name: getattr(rollout, f.name) for f in fields(rollout)}
    return types.SimpleNamespace(**{**values, **changes})


def test_replicas_memory_saver_and_routed_experts_flags(programs, tmp_path):
    """``rollout.dp_size`` without DP attention (data-parallel replicas: ``--tp-size T/N --dp-size
    N``, the server still spanning rollout.tp_size GPUs), colocated servers'
    ``--enable-memory-saver``, routed-expert recording."""
    from launch.slurm import JobLayout, server_command
    from megatron_gspo.config import load_config

    rollout = load_config("launch/configs/qwen3_30b_a3b.yaml").rollout
    layout = JobLayout(colocated=False, train_nodes=2, train_tasks_per_node=8, rollout_nodes=1,
                       gpus_per_node=8, server="sglang", server_tp=4, server_tasks_per_node=2,
                       nodes_per_server=1, num_servers=2)
    replicas = _rollout_like(rollout, tp_size=4, dp_size=2, enable_dp_attention=False,
                             weight_sync=replace(rollout.weight_sync, transport="disk"))
    body = server_command(layout, 7, True, rollout=replicas, routed_experts=True)
    program, argv = task_argv(body, tmp_path, procid=1, localid=1)
    got = programs.accepts(program, argv)
    assert (got["tp_size"], got["dp_size"], got["base_gpu_id"]) == (2, 2, 4)  # GPUs 4..7
    assert "attn_dp_size" not in got
    assert got["enable_memory_saver"] is True and got["enable_return_routed_experts"] is True
    assert got["random_seed"] == 8


def test_fp8_rollouts_render_sglangs_quantization_flag(programs, tmp_path, capsys):
    """Issue 37, item 5: ``rollout.quantization: fp8`` renders ``--quantization fp8``, which
    SGLang 0.5.23's parser takes, for servers started from an FP8 checkpoint of the weight
    sync's layout; a bf16 one (SGLang would quantize it online and refuse every later update)
    is refused, naming --model-path."""
    from launch.cli import main
    from megatron_gspo.hf.fp8 import QUANTIZATION_CONFIG

    fp8_dir, bf16_dir = tmp_path / "fp8", tmp_path / "bf16"
    for directory, quant in ((fp8_dir, QUANTIZATION_CONFIG), (bf16_dir, None)):
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(
            {"model_type": "qwen3_moe", **({"quantization_config": quant} if quant else {})}))
    argv = ["launch", "slurm", "--config", "launch/configs/qwen3_30b_a3b.yaml", "--nodes", "2",
            "--rollout-nodes", "4", "--gpus-per-node", "8", "--dry-run",
            *_sets(tmp_path, "qwen3_30b_a3b"), "--set", "rollout.quantization=fp8"]
    assert main([*argv, "--model-path", str(fp8_dir)]) == 0
    script = capsys.readouterr().out
    (first,) = check_script(script, programs, tmp_path, tasks=[(0, 0)])
    assert first["quantization"] == "fp8"
    assert f"export MGSPO_MODEL_PATH={fp8_dir}" in script
    assert main([*argv, "--model-path", str(bf16_dir)]) == 2
    err = capsys.readouterr().err
    assert "--model-path: rollout.quantization fp8 starts the SGLang servers from an FP8 " \
           "checkpoint" in err and "megatron-gspo convert hf-to-fp8" in err


@pytest.mark.parametrize("argv, refusal", [
    (["--cuda-graph-max-bs", "256"], "ambiguous option: --cuda-graph-max-bs"),
    (["--cuda-graph-max", "256"], "ambiguous option"),
    (["--enable-dp-attention", "--dp-size", "4"], "--enable-dp-attention: deprecated"),
    (["--mem-fraction", "0.8"], "--mem-fraction: not one of the program's flags"),
    (["--data-parallel-size", "2"], "--data-parallel-size: an alias"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--tp-size", "two"], "invalid int value"),
])
def test_the_check_refuses_what_sglang_would_not_take(programs, argv, refusal):
    """The parser has teeth: the launcher's old spellings, abbreviations, aliases, unknown flags
    and bad values are refused (the first is what every server of both recipes died of)."""
    answer: dict = programs.parse(SERVER, ["--model-path", "/m", *argv])
    error: Optional[str] = answer["error"]
    assert error is not None and refusal in error, error
    assert programs.parse(ROUTER, ["--host", "0.0.0.0", "--prot", "1"])["error"]


def test_the_versions_checked_are_the_ones_the_image_installs():
    """The launcher renders for, this test parses with, and slurm/Dockerfile installs the same
    SGLang (and the router checked here is the image's)."""
    import re

    from launch.slurm import SGLANG_VERSION
    from tests.slurm.local_slurm import ROOT

    dockerfile = (ROOT / "slurm" / "Dockerfile").read_text()
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(SGLANG_VERSION)}$", dockerfile, re.M)
    assert SGLANG_VERSION == sglang_wheel.SGLANG_VERSION
    router = re.search(r"^ARG SGLANG_ROUTER_VERSION=(\S+)$", dockerfile, re.M).group(1)
    try:
        from importlib.metadata import version

        installed = version("sglang-router")
    except Exception:  # not installed: its command line is not checked here either
        pytest.skip("sglang-router is not installed")
    assert installed == router, (installed, router)
