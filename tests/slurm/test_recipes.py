"""The GPU recipes (launch/configs/qwen3_30b_a3b.yaml, qwen3_235b_a22b.yaml) pass ``config``,
``plan`` (fitting on 80 GB H100s) and ``launch slurm --dry-run`` with the flags a real cluster
needs. Their data, tokenizer and checkpoint paths are placeholders; the tests point them at tiny
stand-ins (tests/slurm/recipe_inputs.py) through ``--set``, which is also how a user would."""

from __future__ import annotations

import re
import subprocess

import pytest

from launch.cli import main
from tests.slurm.recipe_inputs import recipe_overrides
from tests.slurm.test_render import option, sbatch_components, srun_lines

# recipe -> (training nodes, rollout nodes, world size, servers, the server command's flags)
RECIPES = {
    "qwen3_30b_a3b": (2, 4, 16, 16, ["--tp-size 2", "--mem-fraction-static 0.85",
                                     "--cuda-graph-max-bs-decode 256"]),
    "qwen3_235b_a22b": (8, 8, 64, 4, ["--tp-size 16", "--ep-size 16", "--attn-dp-size 4",
                                      "--mem-fraction-static 0.8",
                                      "--cuda-graph-max-bs-decode 256", "--nnodes 2"]),
}


def _sets(tmp_path, name):
    return [a for s in recipe_overrides(tmp_path / "inputs") + [f"run.output_dir={tmp_path / 'run'}"]
            for a in ("--set", s)]


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_passes_config_plan_and_launch(name, tmp_path, capsys):
    nodes, rollout_nodes, world, servers, server_flags = RECIPES[name]
    config = f"launch/configs/{name}.yaml"
    sets = _sets(tmp_path, name)

    assert main(["config", "--config", config, "--world-size", str(world), *sets]) == 0
    out = capsys.readouterr().out
    assert f"# layout: world {world} = " in out

    assert main(["plan", "--config", config, "--world-size", str(world),
                 "--gpu-memory-gib", "80", *sets]) == 0
    verdict = capsys.readouterr().out.strip().splitlines()[-1]
    peak = float(re.match(r"fits: yes \(peak ([\d.]+) GiB of 80 GiB, stage \d+\)", verdict).group(1))
    assert 20 < peak < 72  # fits with headroom, and is a real load

    assert main(["launch", "slurm", "--config", config, "--nodes", str(nodes), "--rollout-nodes",
                 str(rollout_nodes), "--gpus-per-node", "8", "--model-path", "/models/hf",
                 "--env", "NCCL_IB_HCA=mlx5", "--dry-run", *sets]) == 0
    captured = capsys.readouterr()
    script = captured.out
    assert "# memory plan: fits: yes" in captured.err
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    rollout, train = sbatch_components(script)
    assert {"--gpus-per-node=8", "--exclusive", "--mem=0", f"--nodes={nodes}",
            "--ntasks-per-node=8"} <= set(train)
    assert f"NUM_SERVERS={servers} " in script
    assert "export NCCL_IB_HCA=mlx5\n" in script
    srv, _, trainer = srun_lines(script)
    for flag in server_flags:
        assert flag in srv[-1], (flag, srv[-1])
    export = option(trainer, "export")
    tp_or_cp = name == "qwen3_235b_a22b"  # TP 4 there, TP 1 / CP 1 in the 30B recipe
    assert ("CUDA_DEVICE_MAX_CONNECTIONS=1" in export) == tp_or_cp


def test_recipe_layouts_are_what_the_comments_say():
    from megatron_gspo.config import load_config, pipeline_stage_layers

    big = load_config("launch/configs/qwen3_235b_a22b.yaml")
    assert pipeline_stage_layers(big.model, big.parallel) == [24, 24, 24, 22]
    assert big.data.tokenizer_dir and big.reward.kind == "math" and big.run.init_from
    small = load_config("launch/configs/qwen3_30b_a3b.yaml")
    assert small.model.recompute_granularity == "full" and small.model.moe_router_dtype == "fp32"
    assert small.data.train_path.endswith(".jsonl") and small.data.apply_chat_template
