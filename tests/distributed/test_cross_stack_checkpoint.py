"""A checkpoint written under one supported stack resumes under the other, exactly, and starts a
run there (``run.init_from``).

The stacks (megatron_gspo/mcore_compat.py): Python 3.11 + megatron-core 0.16.1 (``.venv``) and
Python 3.12 + megatron-core 0.19.2 (``.venv312``; README "Two stacks"). The test runs from either and
drives the other stack's interpreter as a subprocess: ``MGSPO_OTHER_STACK_PYTHON`` names it, else the
repository's other virtual environment. Without it the test is skipped with that reason (.ci/run
installs both stacks, so CI runs it).

Each direction: stack A takes a step, checkpoints (torch_dist) and takes two more; stack B resumes
from the checkpoint into a fresh, perturbed model and takes the same two steps: its weights must
equal A's uninterrupted run bit for bit (model, Adam moments, LR schedule position and RNG all
came through). Stack B also loads, as ``run.init_from`` does, the model A saved with ``save_model``
after step 0 (the Megatron-LM / Bridge layout: a root with its tracker file) and the training
checkpoint's ``model_optim``: both must give A's weights at the checkpoint bit for bit. Under
megatron-core 0.16 a 0.19-written checkpoint keeps its common state inside the DCP files
(``mcore_compat.dist_load_kwargs``), and a training checkpoint's common state (the optimizer's
param groups) is not the model's (``mcore_checkpoint.load_model`` leaves it out): before issue 35
``init_from`` failed on both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo import mcore_compat

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
OTHER_ENV = "MGSPO_OTHER_STACK_PYTHON"


def _version_of(python: str) -> str | None:
    proc = subprocess.run([python, "-c", "from importlib.metadata import version; "
                           "print(version('megatron-core'))"], capture_output=True, text=True,
                          timeout=60)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _other_python() -> tuple[str, str]:
    default = ROOT / (".venv312" if sys.version_info[:2] == (3, 11) else ".venv") / "bin" / "python"
    python = os.environ.get(OTHER_ENV) or str(default)
    if not Path(python).exists():
        pytest.skip(f"the other stack is not installed ({python} missing; set {OTHER_ENV} or create "
                    "it as the README's 'Two stacks' section says)")
    version = _version_of(python)
    here = mcore_compat.stack()["megatron_core"]
    if version is None or version == here:
        pytest.skip(f"{python} has megatron-core {version}, not the other stack's (this one: {here})")
    return python, version


def _run(python: str, mode: str, run_dir: Path, out: Path) -> dict:
    proc = subprocess.run([python, "-m", "tests.distributed.cross_stack_worker", mode, str(run_dir),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{python} {mode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("direction", ["this_then_other", "other_then_this"])
def test_checkpoint_of_one_stack_resumes_exactly_on_the_other(tmp_path, direction):
    other, other_version = _other_python()
    writer, reader = (sys.executable, other) if direction == "this_then_other" else (other, sys.executable)
    run_dir = tmp_path / "run"
    written = _run(writer, "save", run_dir, tmp_path / "continuous.pt")
    manifest = json.loads(next((run_dir / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["stack"]["megatron_core"] == written["megatron_core"]
    resumed = _run(reader, "resume", run_dir, tmp_path / "resumed.pt")
    assert {written["megatron_core"], resumed["megatron_core"]} == {
        mcore_compat.stack()["megatron_core"], other_version}
    started = _run(reader, "init_from", run_dir, tmp_path / "init_from.pt")
    assert started["megatron_core"] == resumed["megatron_core"]
    for source in ("model", "model_optim"):
        for name, tensor in written["at_checkpoint"].items():
            assert torch.equal(tensor, started[source][name]), (
                f"run.init_from {source} written by megatron-core {written['megatron_core']}, "
                f"loaded by {started['megatron_core']}: {name} differs")
    assert written["weights"].keys() == resumed["weights"].keys()
    for name, tensor in written["weights"].items():
        assert torch.equal(tensor, resumed["weights"][name]), (
            f"{name}: written by megatron-core {written['megatron_core']}, resumed by "
            f"{resumed['megatron_core']}: max |diff| "
            f"{(tensor - resumed['weights'][name]).abs().max().item():.3e}")
