"""Issue 22 item 6: ``--resume`` under another parallel layout.

A run takes step 0 under EP2, checkpoints, and takes steps 1 and 2 (the uninterrupted reference).
The checkpoint then resumes into a fresh, perturbed model under another layout (single process,
TP2, DP2, PP2) which takes the same steps 1 and 2: its weights must equal the reference to the
layout tests' tolerance (1e-5 relative, fp32). The Adam moments, the step count and the LR
schedule (warmup then cosine: the LR differs every step) must have come through: a resume that
drops the optimizer state ends up much further away. A checkpoint without a layout record
(written before manifests had one) is resharded as well (its optimizer keys do not match this
layout's). Resuming under another layout says so in one line, RNG streams starting fresh.

A changed model is refused before the ranks start (``launch.preflight.check_resume``), naming
the field and both values; so is a vocabulary the new tensor parallelism pads differently.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_gspo import parallel
from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import rank_pieces
from megatron_gspo.train import checkpoint as ckpt
from tests.distributed.layouts import LAYOUTS, assemble, max_rel_diff, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_checkpoint import _fresh, _step

TOLERANCE = 1e-5
SCHEDULE = {"optim": {"optimizer": "adam", "lr": 1e-3, "adam_eps": 1e-4, "clip_grad": 1.0,
                      "warmup_steps": 1, "lr_decay_style": "cosine", "min_lr": 1e-4},
            "run": {"num_steps": 4}}
WRITER = "EP2"
READERS_2 = ("TP2", "DP2", "PP2")  # resumed in the writer's spawn (world 2)


def _config(layout: str) -> dict:
    return tiny_config(LAYOUTS[layout][1], **SCHEDULE)


def _pieces(gpt, cfg, pg):
    return [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]


def _resume(layout: str, path: str, *, with_optimizer: bool = True) -> dict:
    """Under ``layout``: a fresh, perturbed model resumes from ``path`` and takes steps 1, 2."""
    cfg = config_from_dict(_config(layout))
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.5)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        run_state = ckpt.load_checkpoint(path, state.model,
                                         state.optimizer if with_optimizer else None,
                                         scheduler=state.scheduler, model_config=cfg.model)
    _step(state, cfg, pg, 1)
    _step(state, cfg, pg, 2)
    out = {"weights": _pieces(gpt, cfg, pg), "said": said.getvalue(), "run_state": run_state}
    parallel.destroy_model_parallel()
    return out


def _two_rank_worker(rank, world, run_dir):
    """The writer (EP2) and its uninterrupted run, then the resumes under the 2-rank layouts."""
    cfg = config_from_dict(_config(WRITER))
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    _step(state, cfg, pg, 0)
    path = ckpt.save_checkpoint(run_dir, 1, state.model, state.optimizer,
                                {"sampler": {"index": 8}}, scheduler=state.scheduler,
                                model_config=cfg.model)
    _step(state, cfg, pg, 1)
    _step(state, cfg, pg, 2)
    out = {"continuous": _pieces(gpt, cfg, pg), "path": str(path)}
    parallel.destroy_model_parallel()
    for layout in READERS_2:
        out[layout] = _resume(layout, str(path))
    out["DP2 without optimizer"] = _resume("DP2", str(path), with_optimizer=False)
    # the same checkpoint as one written before manifests recorded the layout
    old = Path(run_dir) / "unrecorded" / "checkpoints" / path.name
    if rank == 0:
        shutil.copytree(path, old)
        manifest = json.loads((old / ckpt.MANIFEST).read_text())
        del manifest["layout"], manifest["model"]
        (old / ckpt.MANIFEST).write_text(json.dumps(manifest))
    dist.barrier()
    out["TP2 unrecorded"] = _resume("TP2", str(old))
    return out


def _one_rank_worker(rank, world, path):
    return {"1": _resume("1", path)}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("new_layout")
    two = run_on_ranks(2, _two_rank_worker, (str(run_dir),), timeout_s=600)
    one = run_on_ranks(1, _one_rank_worker, (two[0]["path"],), timeout_s=300)
    shapes = hf_param_shapes(config_from_dict(_config(WRITER)).model)
    runs = {"continuous": assemble(two, "continuous", shapes)}
    said = {}
    for name in (*READERS_2, "DP2 without optimizer", "TP2 unrecorded"):
        runs[name] = assemble([r[name] for r in two], "weights", shapes)
        said[name] = two[0][name]["said"]
        assert two[0][name]["run_state"] == {"step": 1, "sampler": {"index": 8}}
    runs["1"] = assemble([one[0]["1"]], "weights", shapes)
    said["1"] = one[0]["1"]["said"]
    return runs, said, two[0]["path"]


def _worst(a: dict, b: dict) -> tuple[float, str]:
    return max((max_rel_diff(a[name], b[name]), name) for name in b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1", "TP2", "DP2", "PP2", "TP2 unrecorded"])
def test_resume_under_another_layout_continues_the_run(resumed, layout):
    runs, said, _ = resumed
    worst, name = _worst(runs[layout], runs["continuous"])
    assert worst <= TOLERANCE, f"EP2 -> {layout}: {name} differs by {worst:.2e} (relative)"
    lines = [line for line in said[layout].splitlines() if line.startswith("resume:")]
    assert len(lines) == 1, said[layout]  # one line (warnings of the libraries aside)
    line = lines[0]
    assert "step_000001 (step 1) was written under layout" in line, line
    assert "the RNG streams start fresh" in line, line
    written = ("an unrecorded layout of 2 ranks" if layout == "TP2 unrecorded" else
               "tensor 1, pipeline 1, expert 2, expert_tensor 1, context 1, data 2 (2 ranks)")
    assert f"written under layout {written}; resuming it under layout " in line, line


@pytest.mark.slow
def test_adam_state_came_through(resumed):
    runs, _, _ = resumed
    with_state, _ = _worst(runs["DP2"], runs["continuous"])
    without, _ = _worst(runs["DP2 without optimizer"], runs["continuous"])
    assert without > 100 * max(with_state, TOLERANCE), (with_state, without)


# ------------------------------------------------------------------------------------------------
# Refused before the ranks start


def _fake_checkpoint(run_dir: Path, cfg_dict: dict, layout: dict, step: int = 4) -> Path:
    """A checkpoint directory with just its manifest (what the preflight reads)."""
    cfg = config_from_dict(cfg_dict)
    path = ckpt.checkpoint_root(run_dir) / f"step_{step:06d}"
    path.mkdir(parents=True)
    manifest = {"format": ckpt.MANIFEST_FORMAT, "step": step, "world_size": layout["world_size"],
                "layout": layout, "files": {},
                "model": ckpt.model_record(cfg.model, layout["tensor"])}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    return path


EP2_LAYOUT = {"world_size": 2, "tensor": 1, "pipeline": 1, "context": 1, "expert": 2,
              "expert_tensor": 1, "data": 2, "num_layers_in_first_pipeline_stage": None,
              "num_layers_in_last_pipeline_stage": None}


def _run_config(tmp_path: Path, parallel_section: dict, model: dict | None = None) -> dict:
    cfg = tiny_config(parallel_section, model)
    cfg["run"] = {"output_dir": str(tmp_path / "x")}
    return cfg


def test_changed_model_is_refused_before_the_ranks_start(tmp_path):
    from launch import preflight

    path = _fake_checkpoint(tmp_path / "x", _run_config(tmp_path, {"expert": 2}), EP2_LAYOUT)
    changed = config_from_dict(_run_config(tmp_path, {"expert": 2}, {"num_experts": 8}))
    with pytest.raises(ConfigError) as err:
        preflight.check_resume(changed)
    assert str(err.value) == (
        f"--resume: checkpoint {path} was written with model.num_experts=4; this config has 8: "
        "a changed model cannot resume (start a new run, or init from the exported hf/ policy: "
        "run.init_from)")
    two = config_from_dict(_run_config(tmp_path, {}, {"hidden_size": 128,
                                                     "tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match=r"model\.hidden_size=64 and "
                       r"model\.tie_word_embeddings=false; this config has model\.hidden_size=128 "
                       r"and model\.tie_word_embeddings=true: a changed model"):
        preflight.check_resume(two)


def test_changed_layout_and_kernel_fields_pass_the_preflight(tmp_path):
    from launch import preflight

    _fake_checkpoint(tmp_path / "x", _run_config(tmp_path, {"expert": 2}), EP2_LAYOUT)
    for section in ({}, {"tensor": 2, "sequence_parallel": True}, {"pipeline": 2}):
        preflight.check_resume(config_from_dict(_run_config(tmp_path, section)))
    preflight.check_resume(config_from_dict(_run_config(
        tmp_path, {}, {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 1, "moe_aux_loss_coeff": 0.01})))
    # no checkpoint yet, or one written before checkpoints recorded their model: nothing to judge
    preflight.check_resume(config_from_dict(_run_config(tmp_path / "empty", {})))
    manifest_path = next(ckpt.checkpoint_root(tmp_path / "x").glob("step_*")) / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["model"]
    manifest_path.write_text(json.dumps(manifest))
    preflight.check_resume(config_from_dict(_run_config(tmp_path, {}, {"num_experts": 8})))


def test_vocabulary_padded_differently_is_refused_with_the_fix(tmp_path):
    from launch import preflight

    # vocabulary 260 padded to a multiple of 8 x TP 1: 264 rows; under TP 2 (multiple 16) 272
    model = {"vocab_size": 260, "make_vocab_size_divisible_by": 8}
    path = _fake_checkpoint(tmp_path / "x", _run_config(tmp_path, {}, model),
                            {**EP2_LAYOUT, "expert": 1, "data": 2})
    cfg = config_from_dict(_run_config(tmp_path, {"tensor": 2, "sequence_parallel": True}, model))
    with pytest.raises(ConfigError) as err:
        preflight.check_resume(cfg)
    assert str(err.value) == (
        f"--resume: checkpoint {path} holds a vocabulary padded to 264 rows "
        "(model.make_vocab_size_divisible_by 8 x parallel.tensor 1); this config pads it to 272 "
        "(model.make_vocab_size_divisible_by 8 x parallel.tensor 2): the embedding and output "
        "layer would not fit; set model.make_vocab_size_divisible_by: 4 to keep 264 rows")
    # with that divisor the same layout change passes
    fixed = config_from_dict(_run_config(tmp_path, {"tensor": 2, "sequence_parallel": True},
                                         {**model, "make_vocab_size_divisible_by": 4}))
    preflight.check_resume(fixed)


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_command_refuses_it_with_one_message_and_no_rank_started(tmp_path, capfd,
                                                                     monkeypatch, command):
    from launch import cli, local
    from megatron_gspo.config import load_config

    def started(*args, **kwargs):
        raise AssertionError("ranks were started: the changed model was not found before")

    monkeypatch.setattr(local, "ensure_ranks", started)
    config = "launch/configs/tiny_cpu.yaml" if command == "train" else \
        "launch/configs/tiny_cpu_sft.yaml"
    run_dir = tmp_path / "run"
    written = load_config(config, [f"run.output_dir={run_dir}"])
    path = ckpt.checkpoint_root(run_dir) / "step_000004"
    path.mkdir(parents=True)
    (path / ckpt.MANIFEST).write_text(json.dumps({
        "format": ckpt.MANIFEST_FORMAT, "step": 4, "files": {}, "world_size": 1,
        "model": ckpt.model_record(written.model, written.parallel.tensor)}))
    (ckpt.checkpoint_root(run_dir) / "latest").write_text(path.name)
    now = written.model.num_layers * 2
    code = cli.main([command, "--config", config, "--set", f"run.output_dir={run_dir}",
                     "--set", f"model.num_layers={now}", "--resume"])
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, (code, out[-2000:], err[-3000:])
    assert lines[0] == (f"megatron-gspo {command}: configuration error: --resume: checkpoint "
                        f"{path} was written with "
                        f"model.num_layers={written.model.num_layers}; this config has {now}: a "
                        "changed model cannot resume (start a new run, or init from the exported "
                        "hf/ policy: run.init_from)"), lines[0]
