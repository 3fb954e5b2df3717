"""Issue 36, item 4: ``launch slurm`` starts vLLM servers when ``rollout.engine: vllm``.

Placement, ports, seeds, logs, the ``/health`` wait, the stop and the requeue are the SGLang
job's (slurm/lib.sh); what differs: vLLM 0.32's command line and environment, no router (the
trainer gets ``rollout.server_urls``: sglang-router cannot route vLLM's token-in/token-out
generate), ``CUDA_VISIBLE_DEVICES`` per server instead of SGLang's ``--base-gpu-id``.

* fast tests (fake srun / scontrol / curl, tests/slurm/fakebin): the rendered job runs, starts no
  router, waits for every server's ``/health`` and hands the trainer the servers' list, which the
  trainer's config loader takes; the layouts vLLM servers cannot have exit 2 naming the option;
* ``vllm`` tier: each server task's ``bash -c`` body is run by bash as a task would (SLURM_PROCID,
  SLURM_LOCALID, the port base) with the interpreter replaced by a recorder of its argv and
  environment; the argv is parsed by vLLM 0.32's own parser (tests/engines/vllm_cli.py, in the
  vLLM environment: ~8 s for the module) and the values are checked against the config.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from launch.cli import main
from megatron_gspo.config import load_config
from pipeline.engines.vllm import server_args as sa
from tests.engines import vllm_env
from tests.engines.test_vllm_server_args import VllmParser
from tests.slurm.recipe_inputs import recipe_overrides
from tests.slurm.test_render import GPU_OPTIONS, _run_with_fakes, dry_run, srun_lines

TINY = "launch/configs/tiny_cpu.yaml"
PORT0 = 20010
VLLM = ["rollout.engine=vllm"]


@pytest.fixture(scope="module")
def vllm_parser(tmp_path_factory):
    parser = VllmParser(vllm_env.python(), tmp_path_factory.mktemp("vllm-cli") / "parser.log")
    yield parser
    parser.close()


def task(body: str, tmp_path: Path, *, procid: int = 0, localid: int = 0) -> tuple[list, dict]:
    """(argv after the interpreter, the environment) that ``bash -c body`` execs in a task."""
    dump, env_dump = tmp_path / "argv", tmp_path / "env"
    recorder = tmp_path / "record"
    recorder.write_text('#!/bin/sh\nprintf \'%s\\0\' "$@" > "$ARGV_DUMP"\nenv -0 > "$ENV_DUMP"\n')
    recorder.chmod(0o755)
    env = {"PATH": os.environ["PATH"], "ARGV_DUMP": str(dump), "ENV_DUMP": str(env_dump),
           "MGSPO_PYTHON": str(recorder), "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "MGSPO_SERVER_PORT0": str(PORT0),
           "MGSPO_MODEL_PATH": "/models/hf", "MGSPO_REPO": "/opt/megatron-gspo",
           "PYTHONPATH": "/site"}
    subprocess.run(["bash", "-c", body], env=env, check=True, timeout=30)
    argv = [w.decode() for w in dump.read_bytes().split(b"\0")[:-1]]
    environ = dict(w.decode().split("=", 1) for w in env_dump.read_bytes().split(b"\0") if w)
    assert argv[:2] == ["-m", sa.API_SERVER_MODULE], argv
    return argv[2:], environ


def server_body(script: str) -> str:
    (servers,) = [s for s in srun_lines(script) if "vllm.entrypoints" in s[-1]]
    return servers[-1]


def test_vllm_job_runs_without_a_router_and_hands_the_trainer_its_servers(capsys, tmp_path):
    run_dir = tmp_path / "run"
    script = dry_run(capsys, run_dir, *GPU_OPTIONS, sets=[*VLLM, "rollout.tp_size=4"])
    proc, calls = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no router: the trainer routes over them" in proc.stdout
    sruns = [c for c in calls if c["tool"] == "srun"]
    assert not any("sglang_router" in " ".join(s["command"]) for s in sruns)
    assert not any(c["tool"] == "curl" for c in calls)  # nothing registered anywhere
    (servers,) = [s for s in sruns if "vllm.entrypoints" in s["command"][-1]]
    (trainer,) = [s for s in sruns if "train" in s["command"]]
    assert sruns[-1] is trainer and servers["options"]["het-group"] == "0"
    port0 = 20000 + (4242 % 120) * 100 + 10
    urls = [f"http://gpu-00{1 + i // 2}:{port0 + 2 * i}" for i in range(8)]
    sets = [trainer["command"][i + 1] for i, w in enumerate(trainer["command"]) if w == "--set"]
    assert sets[-3:] == ["rollout.mode=external", "rollout.router_url=null",
                         "rollout.server_urls=" + json.dumps(urls, separators=(",", ":"))]
    cfg = load_config(TINY, [*VLLM, *sets[-3:]])  # what the trainer's loader makes of them
    assert cfg.rollout.server_urls == urls and cfg.rollout.router_url is None
    assert "MGSPO_REPO" not in servers["env"]  # a container: the image's (slurm/Dockerfile)
    logs = run_dir / "logs" / "4242-0"
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"server-task{t}.log" for t in range(8)] + [f"train-rank{r}.log" for r in range(64)])


def test_unhealthy_vllm_server_fails_the_job_naming_it(capsys, tmp_path):
    script = dry_run(capsys, tmp_path / "run", *GPU_OPTIONS, "--health-timeout-s", "3",
                     sets=[*VLLM, "rollout.tp_size=4"])
    port3 = 20000 + (4242 % 120) * 100 + 10 + 2 * 3
    proc, _ = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="8",
                              FAKE_UNHEALTHY_PORTS=str(port3))
    assert proc.returncode == 1
    assert f"ERROR: server 3 (task 3 on gpu-002) (http://gpu-002:{port3}) not healthy" in proc.stdout


def test_cpu_vllm_job_exports_this_checkout_as_the_worker_extensions_home(capsys, tmp_path):
    script = dry_run(capsys, tmp_path / "run", "--nodes", "2", "--rollout-nodes", "1",
                     "--model-path", "/m", config=TINY, sets=VLLM)
    root = Path(__file__).resolve().parents[2]
    assert f"export MGSPO_REPO=${{MGSPO_REPO:-{root}}}" in script
    assert "\nHEALTH_TIMEOUT_S=600\n" in script and "\nUSE_ROUTER=0 " in script


@pytest.mark.parametrize("options, sets, message", [
    (["--server", "vllm"], [], "--server vllm: the trainer speaks rollout.engine sglang's API"),
    (["--server", "sglang", "--gpus-per-node", "8"], VLLM, "--server sglang: rollout.engine "
                                                          "vllm needs vLLM servers"),
    (["--gpus-per-node", "4"], [*VLLM, "rollout.tp_size=8"],
     "rollout.tp_size: 8 > --gpus-per-node 4: a vLLM server spanning nodes is not supported"),
    ([], [*VLLM, "gspo.routing_replay=rollout"], "gspo.routing_replay: 'rollout' needs the "
                                                 "rollout servers' routed experts"),
    ([], [*VLLM, "rollout.dp_size=2", "rollout.tp_size=2", "rollout.weight_sync.transport=disk"],
     "rollout.tp_size: 2: vLLM servers on CPU machines"),
])
def test_layouts_vllm_servers_cannot_have_exit_2_naming_the_option(options, sets, message,
                                                                   capsys, tmp_path):
    argv = ["launch", "slurm", "--config", TINY, "--set", f"run.output_dir={tmp_path / 'r'}",
            *[a for s in sets for a in ("--set", s)], "--nodes", "2", "--rollout-nodes", "1",
            "--model-path", "/m", *options, "--dry-run"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.vllm
def test_gpu_server_tasks_run_vllms_own_command_line(vllm_parser, capsys, tmp_path):
    """The 30B recipe's layout with vLLM (4 servers of 2 GPUs a node, NCCL weight transfer):
    tasks 0 and 1 (one node, node binding) and 5 (task binding)."""
    sets = [*recipe_overrides(tmp_path / "inputs"), *VLLM]
    options = ["--nodes", "2", "--rollout-nodes", "2", "--gpus-per-node", "8",
               "--model-path", "/models/hf"]
    script = dry_run(capsys, tmp_path / "a", *options, config="launch/configs/qwen3_30b_a3b.yaml",
                     sets=sets)
    rollout = load_config("launch/configs/qwen3_30b_a3b.yaml", sets).rollout
    values, envs = [], []
    for procid, localid in ((0, 0), (1, 1)):
        argv, env = task(server_body(script), tmp_path, procid=procid, localid=localid)
        values.append(vllm_parser.accepts(argv))
        envs.append(env)
    first, second = values
    assert (first["port"], second["port"]) == (PORT0, PORT0 + 2)
    assert (first["seed"], second["seed"]) == (1234, 1235)
    assert first["model"] == "/models/hf" and first["host"] == "0.0.0.0"
    assert first["tensor_parallel_size"] == rollout.tp_size == 2
    assert first["gpu_memory_utilization"] == rollout.mem_fraction_static
    assert first["max_cudagraph_capture_size"] == rollout.cuda_graph_max_bs
    assert first["dtype"] == "bfloat16" and first["logprobs_mode"] == "processed_logprobs"
    assert first["worker_extension_cls"] == sa.WORKER_EXTENSION
    assert first["weight_transfer_config"] == "WeightTransferConfig(backend='nccl')"
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert envs[0]["VLLM_SERVER_DEV_MODE"] == "1"
    assert envs[0]["PYTHONPATH"] == "/opt/megatron-gspo:/site"

    script = dry_run(capsys, tmp_path / "b", *options, "--gpu-binding", "task",
                     config="launch/configs/qwen3_30b_a3b.yaml", sets=sets)
    argv, env = task(server_body(script), tmp_path, procid=5, localid=1)
    got = vllm_parser.accepts(argv)
    assert got["port"] == PORT0 + 10 and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.vllm
def test_cpu_and_routing_replay_server_tasks_run_vllms_own_command_line(vllm_parser, capsys,
                                                                        tmp_path):
    script = dry_run(capsys, tmp_path / "a", "--nodes", "2", "--rollout-nodes", "1",
                     "--model-path", "/m", config=TINY, sets=VLLM)
    argv, env = task(server_body(script), tmp_path, procid=1, localid=1)
    got = vllm_parser.accepts(argv)
    assert got["enforce_eager"] is True and got["dtype"] == "float32" and got["port"] == PORT0 + 2
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in env

    sets = [*recipe_overrides(tmp_path / "inputs"), *VLLM, "gspo.routing_replay=rollout",
            "model.recompute_granularity=selective", "model.recompute_method=null",
            "model.recompute_num_layers=null"]
    script = dry_run(capsys, tmp_path / "b", "--nodes", "2", "--rollout-nodes", "1",
                     "--gpus-per-node", "8", "--model-path", "/models/hf",
                     "--ignore-memory-plan",  # replay needs the recipe's full recompute off
                     config="launch/configs/qwen3_30b_a3b.yaml", sets=sets)
    argv, env = task(server_body(script), tmp_path)
    got = vllm_parser.accepts(argv)
    assert got["enable_return_routed_experts"] is True
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_the_vllm_checked_is_the_one_the_image_and_the_cpu_environment_install():
    """server_args renders for, the parser tier checks with, slurm/Dockerfile installs and
    launch/envs/vllm_cpu.sh pins the same vLLM release."""
    root = Path(__file__).resolve().parents[2]
    dockerfile = (root / "slurm" / "Dockerfile").read_text()
    assert f"\nARG VLLM_VERSION={sa.VLLM_VERSION}\n" in dockerfile
    assert "MGSPO_REPO=/opt/megatron-gspo" in dockerfile
    assert f"vllm-cpu=={sa.VLLM_VERSION}" in (root / "launch" / "envs" / "vllm_cpu.sh").read_text()
