"""The registry of benign third-party warnings (pipeline/observe/benign_warnings.py): well formed, applied to the
real warnings of Megatron and uvicorn, loud where it must be, and the same list pytest uses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
import warnings
from pathlib import Path

import pytest

from pipeline.observe import benign_warnings
from pipeline.observe.benign_warnings import REGISTRY, SHOW_ENV

ROOT = Path(__file__).resolve().parents[2]
# A warning as Python prints it: "<file>:<line>: <Category>: <message>"
WARNING_LINE = re.compile(r"^\S+:\d+: (\w*Warning): (.*)$", re.M)


def run_py(code: str, *, show: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != SHOW_ENV}
    if show:
        env[SHOW_ENV] = "1"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_entry_is_well_formed():
    seen = set()
    for entry in REGISTRY:
        re.compile(entry.message)
        re.compile(entry.module)
        assert entry.category is None or issubclass(entry.category, Warning), entry
        assert len(entry.reason) > 60, f"{entry.message}: say why it is benign"
        assert (entry.message, entry.module) not in seen, f"duplicate entry {entry.message}"
        seen.add((entry.message, entry.module))
    # a missing Transformer Engine / Apex is benign only without CUDA
    apex_and_te = [e for e in REGISTRY if "Apex" in e.message or "Transformer Engine" in e.message]
    assert apex_and_te and all(e.only_without_cuda for e in apex_and_te)


def test_pyproject_filterwarnings_are_the_registry_and_nothing_blanket():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    filters = ini["filterwarnings"]
    assert filters == benign_warnings.pytest_filters(only_without_cuda=False)
    for line in filters:
        action, message, category, module = line.split(":")
        assert action == "ignore" and message and category and module, f"not scoped: {line}"


# Importing these modules makes megatron-core 0.16.1 print its Transformer Engine / Apex notices.
MEGATRON_IMPORTS = """
    import megatron.core.optimizer
    import megatron.core.models.gpt.gpt_layer_specs
"""


def test_megatrons_import_time_notices_are_silenced_without_cuda():
    quiet = run_py("from pipeline.observe import benign_warnings\nbenign_warnings.apply(cuda=False)\n"
                   + textwrap.dedent(MEGATRON_IMPORTS))
    assert quiet.returncode == 0, quiet.stderr
    assert WARNING_LINE.findall(quiet.stderr) == [], quiet.stderr
    # the same imports without the registry: the notices exist (so the check above means something)
    loud = run_py("from pipeline.observe import benign_warnings\nbenign_warnings.apply(cuda=False)\n"
                  + textwrap.dedent(MEGATRON_IMPORTS), show=True)
    messages = [m for _, m in WARNING_LINE.findall(loud.stderr)]
    assert any(m.startswith("Apex is not installed") for m in messages), loud.stderr
    assert any(m.startswith("Transformer Engine and Apex are not installed") for m in messages)


def test_on_a_gpu_machine_a_missing_transformer_engine_stays_loud():
    out = run_py("from pipeline.observe import benign_warnings\nbenign_warnings.apply(cuda=True)\n"
                 + textwrap.dedent(MEGATRON_IMPORTS))
    messages = [m for _, m in WARNING_LINE.findall(out.stderr)]
    assert any(m.startswith("Transformer Engine and Apex are not installed") for m in messages), out.stderr
    assert any(m.startswith("Apex is not installed") for m in messages)


def test_other_warnings_still_show():
    out = run_py("""
        import warnings
        from pipeline.observe import benign_warnings
        benign_warnings.apply(cuda=False)
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "ours.py", 1, module="megatron_gspo.model.norm")   # not Megatron's
        warnings.warn_explicit("something new in megatron", UserWarning, "x.py", 2,
                               module="megatron.core.models.backends")            # not listed
    """)
    messages = [m for _, m in WARNING_LINE.findall(out.stderr)]
    assert messages == ["Apex is not installed. Falling back to Torch Norm", "something new in megatron"]


def test_log_records_are_filtered_by_logger_and_message():
    code = """
        import logging
        from pipeline.observe import benign_warnings
        logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
        benign_warnings.apply(cuda=False)
        benign_warnings.apply(cuda=False)      # idempotent: one filter per entry
        log = logging.getLogger("uvicorn.error")
        assert len(log.filters) == 1, log.filters
        log.warning("Invalid HTTP request received.")
        log.warning("something else")
        log.error("Invalid HTTP request received.")      # above WARNING: never filtered
        logging.getLogger("other").warning("Invalid HTTP request received.")
    """
    quiet = run_py(code).stderr.splitlines()
    assert quiet == ["uvicorn.error WARNING something else",
                     "uvicorn.error ERROR Invalid HTTP request received.",
                     "other WARNING Invalid HTTP request received."], quiet
    loud = run_py(code.replace("assert len(log.filters) == 1, log.filters", ""), show=True)
    assert "uvicorn.error WARNING Invalid HTTP request received." in loud.stderr.splitlines()


def test_the_switch_turns_everything_off(monkeypatch):
    monkeypatch.setenv(SHOW_ENV, "1")
    with warnings.catch_warnings():
        assert benign_warnings.apply(cuda=False) == []
    monkeypatch.setenv(SHOW_ENV, "0")
    with warnings.catch_warnings():
        assert len(benign_warnings.apply(cuda=False)) == len(REGISTRY)
        assert len(benign_warnings.apply(cuda=True)) == sum(not e.only_without_cuda for e in REGISTRY)


def test_cuda_machine_agrees_with_torch_and_skips_the_import_on_a_cpu_build():
    import torch

    assert benign_warnings.cuda_machine() == torch.cuda.is_available()
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        out = run_py("""
            import sys
            from pipeline.observe import benign_warnings
            print(benign_warnings.cuda_machine(), "torch" in sys.modules)
        """)
        assert out.stdout.split() == ["False", "False"], out.stderr


def test_the_project_never_calls_the_collective_whose_deprecation_is_silenced():
    """The all_gather_into_tensor FutureWarning is silenced because only Megatron calls it."""
    calls = []
    for package in ("megatron_gspo", "pipeline", "launch"):
        for path in (ROOT / package).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"all_gather_into_tensor\s*\(", line):
                    calls.append(f"{path.relative_to(ROOT)}:{number}")
    assert calls == [], f"call torch.distributed.all_gather_single instead: {calls}"


@pytest.mark.parametrize("entry", [e for e in REGISTRY if e.category is not None],
                         ids=lambda e: e.message[:40])
def test_each_warning_entry_silences_a_matching_warning(entry):
    # Build a message the regex matches by undoing its escapes (every entry is a literal prefix).
    message = re.sub(r"\\(.)", r"\1", entry.message) + " (rest of the message)"
    module = re.sub(r"\\(.)", r"\1", entry.module).rstrip(".") + ".some_module"
    assert re.match(entry.message, message, re.I) and re.match(entry.module, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        benign_warnings.apply(cuda=False)
        warnings.warn_explicit(message, entry.category, "x.py", 1, module=module)
    assert caught == []
