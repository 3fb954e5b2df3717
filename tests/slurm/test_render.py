"""``megatron-gspo launch slurm --dry-run``: the batch script for a GPU cluster, checked as text and
run end to end against fake srun / scontrol / curl (no Slurm, no GPU needed).

Layout under test: 4 rollout nodes + 8 training nodes, 8 GPUs each, rollout.tp_size 4
(2 SGLang servers per rollout node), pyxis container flags. The 30B recipe's checkpoint, data and
tokenizer paths point at tiny stand-ins (tests/slurm/recipe_inputs.py). Also: what a real cluster
needs (``--mem=0``, CUDA_DEVICE_MAX_CONNECTIONS with TP / CP, ``--env`` passthrough, SGLang's
memory / expert / data-parallel-attention / CUDA-graph flags, one-GPU-per-task sites), the
memory plan's refusal, and colocated GPU jobs refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch.cli import main
from tests.slurm.local_slurm import ROOT
from tests.slurm.recipe_inputs import recipe_overrides

FAKEBIN = Path(__file__).resolve().parent / "fakebin"
QWEN = "launch/configs/qwen3_30b_a3b.yaml"
GPU_OPTIONS = ["--nodes", "8", "--rollout-nodes", "4", "--gpus-per-node", "8",
               "--partition", "gpu", "--time", "04:00:00", "--account", "rl",
               "--model-path", "/lustre/models/Qwen3-30B-A3B",
               "--container-image", "/lustre/images/megatron-gspo.sqsh",
               "--container-mounts", "/lustre:/lustre"]


def dry_run(capsys, run_dir: Path, *options: str, config: str = QWEN, sets=()) -> str:
    if config == QWEN:  # the recipe's paths are placeholders: point them at stand-ins
        sets = [*recipe_overrides(run_dir.parent / f"{run_dir.name}-inputs"), *sets]
    argv = ["launch", "slurm", "--config", config, "--set", f"run.output_dir={run_dir}",
            *[a for s in sets for a in ("--set", s)], *options, "--dry-run"]
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def sbatch_components(script: str) -> list[list[str]]:
    """The #SBATCH options of each het-job component, in order."""
    components: list[list[str]] = [[]]
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1]
            if option == "hetjob":
                components.append([])
            else:
                components[-1].append(option)
    return components


def srun_lines(script: str) -> list[list[str]]:
    """Every srun command of the script, continuation lines joined, as shell words."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [shlex.split(line.strip().rstrip("&"), posix=True)
            for line in joined.splitlines() if line.strip().startswith("srun ")]


def option(words: list[str], name: str) -> str:
    values = [w.split("=", 1)[1] for w in words if w.startswith(f"--{name}=")]
    assert len(values) == 1, (name, words)
    return values[0]


def test_gpu_cluster_script(capsys, tmp_path):
    run_dir = tmp_path / "run"
    script = dry_run(capsys, run_dir, *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    assert not run_dir.exists(), "--dry-run must not write anything"
    assert script.startswith("#!/bin/bash\n")
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)

    # resources: the rollout component (2 servers of 4 GPUs per node) then the training one
    rollout, train = sbatch_components(script)
    for component in (rollout, train):
        assert {"--partition=gpu", "--time=04:00:00", "--account=rl", "--gpus-per-node=8",
                "--exclusive", "--mem=0"} <= set(component)
    assert {"--nodes=4", "--ntasks-per-node=2", "--requeue", "--signal=B:USR1@300",
            "--open-mode=append", f"--output={run_dir}/logs/slurm-%j.out",
            f"--chdir={ROOT}"} <= set(rollout)
    assert {"--nodes=8", "--ntasks-per-node=8"} <= set(train)
    assert "NUM_SERVERS=8 " in script

    servers, router, trainer = srun_lines(script)
    # servers: component 0, 2 tasks per node, SGLang with --tp-size from rollout.tp_size
    assert servers[:2] == ["srun", "--het-group=0"]
    assert {"--nodes=4", "--ntasks-per-node=2", "--distribution=block"} <= set(servers)
    body = servers[-1]
    assert servers[-3:-1] == ["bash", "-c"]
    assert "-m sglang.launch_server" in body and "--tp-size 4" in body
    assert "--base-gpu-id $((SLURM_LOCALID * 4))" in body and "--host 0.0.0.0" in body
    assert "--port $((MGSPO_SERVER_PORT0 + 2 * i))" in body and "i=$SLURM_PROCID" in body
    # SGLang's flags from the recipe's rollout section
    assert "--mem-fraction-static 0.85" in body and "--cuda-graph-max-bs-decode 256" in body
    assert "--ep-size" not in body and "dp-size" not in body and "--enable-dp-attention" not in body
    # router: one task on the rollout component's first node
    assert router[:2] == ["srun", "--het-group=0"]
    assert {"--nodes=1", "--ntasks=1", "--nodelist=$ROUTER_HOST", "--overlap"} <= set(router)
    assert router[-3:-1] == ["bash", "-c"] and "-m sglang_router.launch_router" in router[-1]
    assert "ROLLOUT_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_0\n" in script
    assert 'ROUTER_HOST=$(scontrol show hostnames "$ROLLOUT_NODELIST" | head -n 1)\n' in script
    # training: component 1, one task per GPU, MASTER_ADDR = its first node
    assert trainer[:2] == ["srun", "--het-group=1"]
    assert {"--nodes=8", "--ntasks-per-node=8", "--kill-on-bad-exit=0", "--wait=$TRAIN_WAIT_S"} <= set(trainer)
    assert option(trainer, "export") == ("ALL,MASTER_ADDR=$MASTER_ADDR,MASTER_PORT=$MASTER_PORT,"
                                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert "TRAIN_NODELIST=$SLURM_JOB_NODELIST_HET_GROUP_1\n" in script
    assert 'MASTER_ADDR=$(scontrol show hostnames "$TRAIN_NODELIST" | head -n 1)\n' in script
    tail = trainer[trainer.index("-m"):]
    assert tail == ["-m", "launch.cli", "train", "--config", "$MGSPO_CONFIG", "--resume",
                    "--set", "rollout.mode=external", "--set", "rollout.router_url=$ROUTER_URL"]
    # containers: every step, with the run dir and the working directory mounted
    for words in (servers, router, trainer):
        assert option(words, "container-image") == "/lustre/images/megatron-gspo.sqsh"
        mounts = option(words, "container-mounts").split(",")
        assert mounts[0] == "/lustre:/lustre" and f"{ROOT}:{ROOT}" in mounts
        assert option(words, "container-workdir") == str(ROOT)
    # environment only: no hyperparameter of the config appears in the script
    assert f"export MGSPO_CONFIG={run_dir}/slurm/config.yaml" in script
    assert re.findall(r"--set (\S+)", script) == ["rollout.mode=external",
                                                  'rollout.router_url="$ROUTER_URL"']
    for key in ("eps_low", "eps_high", "lr", "global_batch_size", "num_steps", "group_size"):
        assert not re.search(rf"\b{key}\b", script), key


def test_server_spanning_nodes_and_colocated_layouts(capsys, tmp_path):
    # tp 16 on 8-GPU nodes: each server spans 2 nodes (--nnodes / --node-rank / --dist-init-addr)
    script = dry_run(capsys, tmp_path / "a", *GPU_OPTIONS, sets=["rollout.tp_size=16"])
    servers = srun_lines(script)[0]
    assert {"--nodes=4", "--ntasks-per-node=1"} <= set(servers)
    assert "NUM_SERVERS=2 " in script and "NODES_PER_SERVER=2 " in script
    body = servers[-1]
    assert "i=$((SLURM_PROCID / 2))" in body and "--nnodes 2 --node-rank $((SLURM_PROCID % 2))" in body
    assert "--dist-init-addr ${hosts[$((i * 2))]}:$((MGSPO_SERVER_PORT0 + 2 * i + 1))" in body

    # colocated GPU jobs are refused (the trainer has no offload; NCCL: one rank per GPU)
    argv = ["launch", "slurm", "--config", QWEN, "--nodes", "2", "--rollout-nodes", "0",
            "--gpus-per-node", "8", "--model-path", "/m", "--dry-run",
            "--set", f"run.output_dir={tmp_path / 'b'}", "--set", "rollout.colocated=true",
            *[a for x in recipe_overrides(tmp_path / "b-inputs") for a in ("--set", x)]]
    assert main(argv) == 2
    assert ("--rollout-nodes 0: colocated servers and trainers on GPUs are not supported yet"
            in capsys.readouterr().err)

    # colocated on CPU machines: one component; servers, router and trainers overlap
    script = dry_run(capsys, tmp_path / "c", "--nodes", "2", "--rollout-nodes", "0",
                     "--model-path", "/m", config="launch/configs/tiny_cpu.yaml",
                     sets=["rollout.colocated=true"])
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    (component,) = sbatch_components(script)
    assert {"--nodes=2", "--ntasks-per-node=1"} <= set(component)
    assert not any(line.startswith(("--gpus", "--mem")) for line in component)
    servers, router, trainer = srun_lines(script)
    assert not any(w.startswith("--het-group") for w in servers + router + trainer)
    assert {"--ntasks-per-node=1", "--overlap"} <= set(servers) and "launch.cli serve" in servers[-1]
    assert {"--ntasks-per-node=1", "--overlap"} <= set(trainer)
    assert "ROLLOUT_NODELIST=$SLURM_JOB_NODELIST\n" in script


def test_cluster_environment_and_gpu_binding(capsys, tmp_path, monkeypatch):
    """TP > 1: CUDA_DEVICE_MAX_CONNECTIONS=1 for the trainers; --env passthrough; SGLang's
    expert / data-parallel-attention flags; sites that bind one GPU per task."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    script = dry_run(capsys, tmp_path / "run", *GPU_OPTIONS, "--env", "NCCL_IB_HCA=mlx5_0,mlx5_1",
                     "--env", "NCCL_SOCKET_IFNAME", "--gpu-binding", "task",
                     "--env", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=true",
                     sets=["rollout.tp_size=4", "rollout.ep_size=4", "rollout.enable_dp_attention=true",
                           "rollout.dp_size=2", "parallel.tensor=2", "parallel.sequence_parallel=true"])
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1\n" in script and "export NCCL_SOCKET_IFNAME=ib0\n" in script
    # the site's --env comes after the launcher's default (SGLang's /health switch)
    site = "export SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=true\n"
    assert script.index(HEALTH_ENV) < script.index(site)
    servers, _, trainer = srun_lines(script)
    assert option(trainer, "export") == ("ALL,MASTER_ADDR=$MASTER_ADDR,MASTER_PORT=$MASTER_PORT,"
                                         "CUDA_DEVICE_MAX_CONNECTIONS=1,LOCAL_RANK=0,"
                                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert option(trainer, "gpus-per-task") == "1" and option(servers, "gpus-per-task") == "4"
    body = servers[-1]
    assert "--base-gpu-id 0" in body and "SLURM_LOCALID" not in body
    # data-parallel attention: SGLang 0.5.23's --attn-dp-size (not the deprecated
    # --enable-dp-attention --dp-size N); the server keeps --tp-size rollout.tp_size
    assert "--ep-size 4" in body and "--tp-size 4 " in body and "--attn-dp-size 2" in body
    assert "--enable-dp-attention" not in body and "--dp-size" not in body
    # the default binding: every task sees the node's GPUs; TP 1 / CP 1: no connection limit
    script = dry_run(capsys, tmp_path / "run2", *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    servers, _, trainer = srun_lines(script)
    assert option(trainer, "export") == ("ALL,MASTER_ADDR=$MASTER_ADDR,MASTER_PORT=$MASTER_PORT,"
                                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert not any(w.startswith("--gpus-per-task") for w in servers + trainer)
    assert "# (none: pass launch slurm --env NAME=VALUE)" in script
    argv = ["launch", "slurm", "--config", QWEN, *GPU_OPTIONS, "--env", "NOT_SET_ANYWHERE_X",
            "--set", f"run.output_dir={tmp_path / 'r3'}", "--dry-run",
            *[a for x in recipe_overrides(tmp_path / "r3-inputs") for a in ("--set", x)]]
    monkeypatch.delenv("NOT_SET_ANYWHERE_X", raising=False)
    assert main(argv) == 2
    assert "--env NOT_SET_ANYWHERE_X: not set in this environment" in capsys.readouterr().err


def test_training_allocator_setting_and_network_interface_guidance(capsys, tmp_path, monkeypatch):
    """GPU training ranks get PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless --env names
    the variable (then the site's value, exported in every step, is the one they see); CPU jobs
    and the servers never get it. --help says how to pin gloo's and NCCL's interface."""
    ours = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    script = dry_run(capsys, tmp_path / "a", *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    servers, router, trainer = srun_lines(script)
    assert option(trainer, "export").split(",").count(ours) == 1
    assert "PYTORCH_CUDA_ALLOC_CONF" not in " ".join(servers + router)
    assert "export PYTORCH_CUDA_ALLOC_CONF" not in script
    for env, value in (("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512", "max_split_size_mb:512"),
                       ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
        script = dry_run(capsys, tmp_path / f"b{len(env)}", *GPU_OPTIONS, "--env", env,
                         sets=["rollout.tp_size=4"])
        (_, _, trainer) = srun_lines(script)
        assert "PYTORCH_CUDA_ALLOC_CONF" not in option(trainer, "export"), env
        assert f"export PYTORCH_CUDA_ALLOC_CONF={value}\n" in script, env
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    script = dry_run(capsys, tmp_path / "cpu", "--model-path", "/m",
                     config="launch/configs/tiny_cpu.yaml")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in script

    with pytest.raises(SystemExit) as exit_:
        main(["launch", "slurm", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--env GLOO_SOCKET_IFNAME=ib0 --env NCCL_SOCKET_IFNAME=ib0" in help_text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in help_text
    readme = " ".join((ROOT / "slurm" / "README.md").read_text().split())
    assert "GLOO_SOCKET_IFNAME" in readme and "PYTORCH_CUDA_ALLOC_CONF" in readme


HEALTH_ENV = ("export SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="
              "${SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION:-false}\n")


def test_servers_keep_answering_health_while_a_sync_pauses_them():
    """Issue 37 item 1: every step gets SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (SGLang's
    /health then answers without a generation, which would wait while the servers are paused
    and make the router drop them), unless the job's environment or --env sets it (the --env
    export comes later: test_cluster_environment_and_gpu_binding)."""
    env = subprocess.run(["bash", "-c", f"{HEALTH_ENV}echo $SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"],
                         capture_output=True, text=True, check=True,
                         env={"PATH": os.environ["PATH"]}).stdout
    assert env == "false\n"
    for template in ("disaggregated.sbatch", "colocated.sbatch"):  # both layouts, before --env's
        text = (ROOT / "slurm" / template).read_text()
        assert 0 <= text.index("{{server_health_env}}") < text.index("{{site_env}}"), template


def test_memory_plan_refuses_a_layout_that_does_not_fit(capsys, tmp_path):
    """No recompute and padded 10,240-token rows (the project's previous 30B layout): refused
    with the plan's breakdown; --ignore-memory-plan submits and passes the flag to train."""
    no_recompute = ["model.recompute_granularity=null", "model.recompute_method=null",
                    "model.recompute_num_layers=null", "run.max_tokens_per_micro_batch=null",
                    "rollout.tp_size=4"]
    inputs = [a for x in recipe_overrides(tmp_path / "inputs") for a in ("--set", x)]
    argv = ["launch", "slurm", "--config", QWEN, *GPU_OPTIONS, "--dry-run", *inputs,
            "--set", f"run.output_dir={tmp_path / 'run'}", *[a for x in no_recompute for a in ("--set", x)]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the memory plan says this layout does not fit" in err and "stage 0: layers 0-23" in err
    assert re.search(r"fits: no \(peak \d+\.\d GiB of 80 GiB, stage 0\)", err)
    assert main(argv + ["--ignore-memory-plan"]) == 0
    captured = capsys.readouterr()
    assert "# memory plan: fits: no" in captured.err
    (_, _, trainer) = srun_lines(captured.out)
    assert trainer[-1] == "--ignore-memory-plan"
    assert main(argv + ["--gpu-memory-gib", "141"]) == 0  # an H200 holds it
    capsys.readouterr()


def test_megatron_checkpoint_init_needs_the_hf_model_path(capsys, tmp_path):
    inputs = recipe_overrides(tmp_path / "inputs")
    (tmp_path / "inputs" / "mcore" / ".metadata").write_bytes(b"")  # a torch_dist directory
    options = [o for o in GPU_OPTIONS if o not in ("--model-path", "/lustre/models/Qwen3-30B-A3B")]
    argv = ["launch", "slurm", "--config", QWEN, *options, "--dry-run",
            "--set", f"run.output_dir={tmp_path / 'run'}", "--set", "rollout.tp_size=4",
            *[a for x in inputs for a in ("--set", x)]]
    assert main(argv) == 2
    assert "--model-path: required: run.init_from is a Megatron checkpoint" in capsys.readouterr().err
    # a Megatron-LM / Bridge root (its tracker file; hf-to-mcore's layout) is one too
    (tmp_path / "inputs" / "mcore" / ".metadata").unlink()
    (tmp_path / "inputs" / "mcore" / "iter_0000000").mkdir()
    (tmp_path / "inputs" / "mcore" / "iter_0000000" / ".metadata").write_bytes(b"")
    (tmp_path / "inputs" / "mcore" / "latest_checkpointed_iteration.txt").write_text("0")
    assert main(argv) == 2
    assert "--model-path: required: run.init_from is a Megatron checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("options, sets, message", [
    (["--gpus-per-node", "8", "--nodes", "2"], ["rollout.tp_size=3"],
     "rollout.tp_size: 3 does not divide --gpus-per-node 8"),
    (["--gpus-per-node", "8", "--nodes", "2", "--rollout-nodes", "3"], ["rollout.tp_size=16"],
     "--rollout-nodes: 3 is not a multiple of the 2 nodes one server spans"),
    (["--server", "sglang"], [], "--server sglang: SGLang servers need GPUs"),
    (["--gpus-per-node", "8", "--nodes", "1"], [], "WORLD_SIZE 8 is not divisible by"),
    ([], ["rollout.tp_size=2"], "rollout.tp_size: 2 needs SGLang servers on GPUs"),
    (["--rollout-nodes", "3"], [], "rollout.num_servers: 2 local servers do not spread evenly"),
    (["--container-mounts", "/a:/a"], [], "--container-mounts: only with --container-image"),
    # issue 37, item 3: CUDA-IPC / shared-memory handles open only on the node that made them
    (["--gpus-per-node", "8", "--nodes", "2", "--rollout-nodes", "4"],
     ["rollout.weight_sync.transport=tensor"], "rollout.weight_sync.transport: tensor cannot "
     "sync in a Slurm job: tensor passes the servers CUDA-IPC / shared-memory handles"),
    (["--nodes", "2", "--rollout-nodes", "0"], ["rollout.weight_sync.transport=tensor",
                                                 "rollout.colocated=true"],
     "with --rollout-nodes 0 the servers are spread over the 2 training nodes"),
    (["--nodes", "1", "--rollout-nodes", "0"], ["rollout.weight_sync.transport=tensor",
                                                 "rollout.colocated=true"],
     "the local server takes pickled handles only on 127.0.0.1"),
])
def test_bad_layouts_exit_2_naming_the_option(capsys, tmp_path, options, sets, message):
    config = QWEN if "--gpus-per-node" in options else "launch/configs/tiny_cpu.yaml"
    argv = ["launch", "slurm", "--config", config, "--set", f"run.output_dir={tmp_path}",
            "--model-path", "/m", *[a for s in sets for a in ("--set", s)], *options, "--dry-run"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_model_path_defaults_to_init_from(capsys, tmp_path):
    argv = ["launch", "slurm", "--config", "launch/configs/tiny_cpu.yaml", "--dry-run",
            "--set", f"run.output_dir={tmp_path}"]
    assert main(argv) == 2
    assert "--model-path: required when run.init_from is not set" in capsys.readouterr().err
    (tmp_path / "hf").mkdir()
    script = dry_run(capsys, tmp_path / "run", config="launch/configs/tiny_cpu.yaml",
                     sets=[f"run.init_from={tmp_path / 'hf'}"])
    assert f"export MGSPO_MODEL_PATH={tmp_path / 'hf'}" in script
    assert "-m launch.cli serve" in srun_lines(script)[0][-1]   # CPU: the local server


def _run_with_fakes(script: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    log = tmp_path / "fake.log"
    full_env = dict(os.environ, PATH=f"{FAKEBIN}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                    FAKE_SLURM_LOG=str(log), SLURM_JOB_ID="4242",
                    SLURM_JOB_NODELIST_HET_GROUP_0="gpu-[001-004]",
                    SLURM_JOB_NODELIST_HET_GROUP_1="gpu-[101-104,201-204]", **env)
    full_env.pop("SLURM_RESTART_COUNT", None)
    proc = subprocess.run(["bash", str(path)], env=full_env, capture_output=True, text=True,
                          timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def test_gpu_script_runs_the_job_against_fake_slurm(capsys, tmp_path):
    """The rendered script end to end with fake srun/scontrol/curl: the addresses it computes."""
    run_dir = tmp_path / "run"
    script = dry_run(capsys, run_dir, *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    proc, calls = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "megatron-gspo job: training complete" in proc.stdout
    sruns = [c for c in calls if c["tool"] == "srun"]   # servers and router start concurrently
    (servers,) = [s for s in sruns if "sglang.launch_server" in s["command"][-1]]
    (router,) = [s for s in sruns if "sglang_router.launch_router" in s["command"][-1]]
    (trainer,) = [s for s in sruns if "train" in s["command"]]
    assert [s["options"]["het-group"] for s in (servers, router, trainer)] == ["0", "0", "1"]
    assert sruns[-1] is trainer                           # training starts after both
    port0 = 20000 + (4242 % 120) * 100
    assert router["options"]["nodelist"] == "gpu-001"
    assert router["env"]["ROUTER_PORT"] == str(port0)
    assert "--port $ROUTER_PORT" in router["command"][-1]
    assert trainer["options"]["export"] == (f"ALL,MASTER_ADDR=gpu-101,MASTER_PORT={port0 + 1},"
                                            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert trainer["command"][-1] == f"rollout.router_url=http://gpu-001:{port0}"
    assert servers["env"]["MGSPO_ROLLOUT_HOSTS"].split() == ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]
    assert servers["env"]["MGSPO_SERVER_PORT0"] == str(port0 + 10)
    # SGLang's /health answers while a weight sync pauses the servers (no generation)
    assert servers["env"]["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    # every server registered with the router, at the host of its task (2 per node)
    registered = [json.loads(c["body"])["url"] for c in calls if c["tool"] == "curl"]
    assert registered == [f"http://gpu-00{1 + i // 2}:{port0 + 10 + 2 * i}" for i in range(8)]
    logs = run_dir / "logs" / "4242-0"
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        ["router.log"] + [f"server-task{t}.log" for t in range(8)] + [f"train-rank{r}.log" for r in range(64)])


def test_colocated_script_runs_the_job_against_fake_slurm(capsys, tmp_path):
    """A colocated CPU job (local servers and gloo trainers on the same two nodes)."""
    script = dry_run(capsys, tmp_path / "run", "--nodes", "2", "--rollout-nodes", "0",
                     "--model-path", "/m", config="launch/configs/tiny_cpu.yaml",
                     sets=["rollout.colocated=true"])
    proc, calls = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="2",
                                  SLURM_JOB_NODELIST="cpu-[007-008]")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sruns = [c for c in calls if c["tool"] == "srun"]
    (trainer,) = [s for s in sruns if "train" in s["command"]]
    assert all("het-group" not in s["options"] and "overlap" in s["options"] for s in sruns)
    port0 = 20000 + (4242 % 120) * 100
    assert trainer["options"]["export"] == f"ALL,MASTER_ADDR=cpu-007,MASTER_PORT={port0 + 1}"
    assert trainer["command"][-1] == f"rollout.router_url=http://cpu-007:{port0}"
    registered = [json.loads(c["body"])["url"] for c in calls if c["tool"] == "curl"]
    assert registered == [f"http://cpu-00{7 + i}:{port0 + 10 + 2 * i}" for i in range(2)]


def test_unhealthy_server_fails_the_job_naming_it(capsys, tmp_path):
    run_dir = tmp_path / "run"
    script = dry_run(capsys, run_dir, *GPU_OPTIONS, "--health-timeout-s", "3",
                     sets=["rollout.tp_size=4"])
    port5 = 20000 + (4242 % 120) * 100 + 10 + 2 * 5
    proc, calls = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="8",
                                  FAKE_UNHEALTHY_PORTS=str(port5))
    assert proc.returncode == 1
    out = proc.stdout
    assert f"ERROR: server 5 (task 5 on gpu-003) (http://gpu-003:{port5}) not healthy after 3s" in out
    assert "| fake task 5: starting bash -c" in out        # the end of that server's log
    assert "FAILED: the rollout servers or the router did not come up" in out
    assert not any(c["tool"] == "srun" and c["options"].get("het-group") == "1" for c in calls)


@pytest.mark.parametrize("status, requeued, final", [
    ("75", True, "megatron-gspo job: requeued"),
    ("3", False, "megatron-gspo job: FAILED: training exited with status 3"),
])
def test_trainer_exit_status_decides_requeue(capsys, tmp_path, status, requeued, final):
    script = dry_run(capsys, tmp_path / "run", *GPU_OPTIONS, sets=["rollout.tp_size=4"])
    proc, calls = _run_with_fakes(script, tmp_path, FAKE_NUM_SERVERS="8", FAKE_TRAIN_STATUS=status)
    assert final in proc.stdout
    assert proc.returncode == (0 if requeued else int(status))
    requeues = [c["args"] for c in calls if c["tool"] == "scontrol"]
    assert requeues == ([["requeue", "4242"]] if requeued else [])


def test_preempted_exit_status_matches_the_trainer():
    from launch.slurm import PREEMPTED_EXIT_STATUS
    from pipeline.signals import PREEMPTED_EXIT_CODE

    assert PREEMPTED_EXIT_STATUS == PREEMPTED_EXIT_CODE == 75
    assert '[ "$rc" = 75 ]' in (ROOT / "slurm" / "lib.sh").read_text()
