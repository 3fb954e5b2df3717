"""The megatron-gspo command line: sub-commands, their --help, and frozen options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.cli import COMMAND_MODULES, build_parser, main

# Freeze the CLI: adding or removing an option is a deliberate change of this list.
EXPECTED_OPTIONS = {
    "demo": {"--task", "--engine", "--config", "--sft-config", "--out", "--set"},
    "train": {"--config", "--set", "--resume", "--nproc", "--ignore-memory-plan"},
    "sft": {"--config", "--set", "--resume", "--nproc"},
    "config": {"--config", "--set", "--world-size"},
    "plan": {"--config", "--set", "--world-size", "--gpu-memory-gib", "--spec", "--moe-imbalance",
             "--sync-assume"},
    "plot": {"--out"},
    "calibrate-eps": {"--config", "--set", "--target-clip-frac", "--rollouts", "--split", "--out",
                      "--nproc"},
    "serve": {"--model-path", "--model", "--host", "--port", "--random-seed", "--skip-tokenizer-init",
              "--weight-version", "--context-length", "--max-running-requests",
              "--max-prefill-tokens", "--dtype", "--quantization", "--log-level", "--cpu-threads",
              "--weight-update-timeout", "--tp-size", "--allow-pickled-tensors", "--max-n",
              "--max-queued-requests", "--weight-roots", "--enable-return-routed-experts",
              "--fault-perturb-weights", "--fault-update-delay-s", "--device", "--no-extensions",
              "--dp-size", "--data-parallel-size", "--attn-dp-size", "--attention-data-parallel-size",
              "--enable-dp-attention", "--enable-metrics", "--max-request-mb",
              "--max-weight-update-mb", "--max-json-depth", "--disable-radix-cache",
              "--radix-cache-max-tokens"},
    "launch slurm": {"--config", "--set", "--nodes", "--rollout-nodes", "--gpus-per-node",
                     "--ntasks-per-node", "--server", "--model-path", "--partition", "--account",
                     "--time", "--job-name", "--signal-before-s", "--health-timeout-s",
                     "--container-image", "--container-mounts", "--gpu-binding", "--env",
                     "--gpu-memory-gib", "--ignore-memory-plan", "--dry-run"},
}


def _subcommand(name: str):
    """The parser of ``name``; nested sub-commands are written with a space ("launch slurm")."""
    parser = build_parser()
    for word in name.split():
        action = next(a for a in parser._actions if a.choices and hasattr(a, "_name_parser_map"))
        parser = action.choices[word]
    return parser


def test_subcommands_and_their_options_are_frozen():
    for name, expected in EXPECTED_OPTIONS.items():
        sub = _subcommand(name)
        options = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
        assert options - {"--help"} == expected, name


def test_each_command_alone_builds_the_same_parser_as_the_full_one():
    """A named command imports only its own module (COMMAND_MODULES): the map covers every
    command and each one alone gets the options it has in the full parser."""
    full = next(a for a in build_parser()._actions if hasattr(a, "_name_parser_map")).choices
    assert set(COMMAND_MODULES) == set(full)
    for name, parser in full.items():
        alone = next(a for a in build_parser(name)._actions
                     if hasattr(a, "_name_parser_map")).choices
        assert list(alone) == [name]
        assert ({s for a in alone[name]._actions for s in a.option_strings}
                == {s for a in parser._actions for s in a.option_strings}), name


@pytest.mark.parametrize("command", sorted(EXPECTED_OPTIONS))
def test_help_explains_each_command(command):
    out = subprocess.run([sys.executable, "-m", "launch.cli", *command.split(), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert all(option in out.stdout for option in EXPECTED_OPTIONS[command])
    assert len(out.stdout.splitlines()) > 8


def test_config_command_prints_layout(capsys, tmp_path):
    from tests.slurm.recipe_inputs import recipe_overrides

    stand_ins = [a for s in recipe_overrides(tmp_path) for a in ("--set", s)]  # recipe placeholders
    assert main(["config", "--config", "launch/configs/qwen3_30b_a3b.yaml", "--world-size", "16",
                 *stand_ins]) == 0
    out = capsys.readouterr().out
    assert "world 16 = tensor 1 x context 1 x pipeline 2 x data 8" in out
    assert "padded vocabulary: 151936" in out


def test_bad_configuration_exits_2_naming_the_field(capsys):
    code = main(["config", "--config", "launch/configs/tiny_cpu.yaml", "--set", "parallel.expert=3"])
    assert code == 2
    assert "parallel.expert: 3 does not divide model.num_experts 8" in capsys.readouterr().err
    code = main(["config", "--config", "launch/configs/tiny_cpu.yaml", "--world-size", "3"])
    assert code == 2
    assert "WORLD_SIZE 3 is not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("args, said", [
    (["--tp-size", "0"], "--tp-size 0: must be >= 1"),  # was: taken as 1
    (["--dp-size", "0"], "--dp-size 0: must be >= 1"),
    (["--max-n", "-3"], "--max-n -3: must be >= 1"),  # was: a ValueError traceback
    (["--port", "70000"], "--port 70000: must be in 1 .. 65535"),
    (["--max-request-mb", "nan"], "--max-request-mb nan: must be a positive number"),
    (["--max-json-depth", "0"], "--max-json-depth 0: must be >= 1"),
    (["--weight-update-timeout", "0"], "--weight-update-timeout 0.0: must be a positive number"),
    (["--device", "tpu"], "--device 'tpu': expected cpu, cuda or cuda:N"),
    (["--allow-pickled-tensors", "--host", "0.0.0.0"], "--allow-pickled-tensors: only with"),
    (["--dp-size", "2", "--attn-dp-size", "2"], "--dp-size 2 with --attn-dp-size 2"),
    (["--tp-size", "2", "--attn-dp-size", "3"], "--attn-dp-size 3: tp_size 2 must be divisible"),
    (["--weight-roots", "/etc/hostname"], "--weight-roots /etc/hostname: not a directory"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("-") else None)
def test_bad_serve_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, said):
    (tmp_path / "config.json").write_text("{}")  # checked first: no model is loaded
    assert main(["serve", "--model-path", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatron-gspo serve: ") and said in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, said", [
    (["--model-path", "/nonexistent/model"], "--model-path /nonexistent/model: not a directory"),
    (["--model-path", "."], "--model-path .: no config.json in it"),
    (["--model-path", ".", "--tp-size", "two"], "argument --tp-size: invalid int value: 'two'"),
    ([], "the following arguments are required: --model-path"),
])
def test_bad_serve_model_path_and_argparse_errors_are_one_line(capsys, args, said):
    try:
        code = main(["serve", *args])
    except SystemExit as err:  # argparse's own errors
        code = err.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_the_server_itself_never_takes_tp_size_0_as_1():
    from argparse import Namespace

    from pipeline.local.server import LocalRolloutServer

    with pytest.raises(ValueError, match="--tp-size: must be >= 1, got 0"):
        LocalRolloutServer(Namespace(tp_size=0, host="127.0.0.1"))  # before any model loads
