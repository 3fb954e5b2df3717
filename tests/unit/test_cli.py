"""The megatron-gspo command line: sub-commands, their --help, and frozen options."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.cli import build_parser, main

# Freeze the CLI: adding or removing an option is a deliberate change of this list.
EXPECTED_OPTIONS = {
    "sft": {"--config", "--set", "--nproc"},
    "config": {"--config", "--set", "--world-size"},
    "plot": {"--out"},
}


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_subcommands_and_their_options_are_frozen():
    subs = _subparsers()
    for name, expected in EXPECTED_OPTIONS.items():
        options = {s for a in subs[name]._actions for s in a.option_strings if s.startswith("--")}
        assert options - {"--help"} == expected, name


@pytest.mark.parametrize("command", sorted(EXPECTED_OPTIONS))
def test_help_explains_each_command(command):
    out = subprocess.run([sys.executable, "-m", "launch.cli", command, "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert all(option in out.stdout for option in EXPECTED_OPTIONS[command])
    assert len(out.stdout.splitlines()) > 8


def test_config_command_prints_layout(capsys):
    assert main(["config", "--config", "launch/configs/qwen3_30b_a3b.yaml", "--world-size", "16"]) == 0
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
