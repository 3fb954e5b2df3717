"""issue 21 item 2: the trainer's and the SGLang servers' NCCL versions are compared before the
run starts (``launch.preflight.check_nccl_versions``), with ``MGSPO_SGLANG_PYTHON`` stood in for
by a script that answers as that interpreter would (the CPU has no NCCL of its own)."""

from __future__ import annotations

import os
import stat

import pytest

from launch.preflight import check_nccl_versions, nccl_version_of
from megatron_gspo.config import ConfigError, config_from_dict

DISTRIBUTED = config_from_dict({"rollout": {"weight_sync": {"transport": "distributed"}}})


def fake_python(tmp_path, answer: str, code: int = 0):
    """An executable that prints ``answer`` for any ``-c`` program, as SGLang's python would."""
    path = tmp_path / "sglang-python"
    path.write_text(f"#!/bin/sh\necho '{answer}'\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_mismatched_nccl_is_refused_naming_both_versions_and_the_field(tmp_path):
    python = fake_python(tmp_path, "2.21.5")
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.transport: distributed puts the "
                                          r"trainer \(NCCL 2\.27\.3\) and the SGLang servers "
                                          r"\(.*NCCL 2\.21\.5\)"):
        check_nccl_versions(DISTRIBUTED, trainer_version="2.27.3", sglang_python=python)


def test_a_matching_or_unknown_nccl_is_said_not_refused(tmp_path, monkeypatch):
    python = fake_python(tmp_path, "2.27.5")  # the same major.minor: one communicator works
    said = check_nccl_versions(DISTRIBUTED, trainer_version="2.27.3", sglang_python=python)
    assert said == "weight sync: NCCL 2.27.3 on the trainer, 2.27.5 on the SGLang servers"
    monkeypatch.delenv("MGSPO_SGLANG_PYTHON", raising=False)
    said = check_nccl_versions(DISTRIBUTED, trainer_version="2.27.3")
    assert "not checked (MGSPO_SGLANG_PYTHON is unset" in said
    no_cuda = fake_python(tmp_path, "none")
    assert "sees no CUDA" in check_nccl_versions(DISTRIBUTED, trainer_version="2.27.3",
                                                 sglang_python=no_cuda)
    # disk and tensor syncs put no server in a trainer's communicator
    assert check_nccl_versions(config_from_dict({}), trainer_version="2.27.3",
                               sglang_python=fake_python(tmp_path, "2.1.0")) is None


def test_an_interpreter_that_cannot_answer_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"MGSPO_SGLANG_PYTHON: .*sglang-python: asking it for "
                                          r"its NCCL version failed \(exit 3\)"):
        nccl_version_of(fake_python(tmp_path, "", code=3))
    with pytest.raises(ConfigError, match=r"MGSPO_SGLANG_PYTHON: /nonexistent/python: cannot ask"):
        nccl_version_of("/nonexistent/python")


def test_the_real_interpreter_answers_the_question():
    """The program the check runs, on this machine's own torch (no CUDA here: "none")."""
    import sys

    import torch

    got = nccl_version_of(sys.executable)
    assert got == (".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available()
                   else None)
    assert os.path.exists(sys.executable)
