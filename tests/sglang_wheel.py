"""The sglang 0.5.23 wheel, for tests that read SGLang's own code without installing it (it needs
CUDA-only packages): fetched once with ``pip download --no-deps sglang==0.5.23`` into
``$MEGATRON_GSPO_CACHE/wheels`` (default ``~/.cache/megatron-gspo``). Without network access and
without a cached wheel, ``wheel()`` skips the calling test with that reason.

Used by tests/rollout/conftest.py (schema, weight-update code) and tests/slurm (SGLang's
``ServerArgs`` argparse definition, to check the command line ``launch slurm`` renders)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_GSPO_CACHE", Path.home() / ".cache" / "megatron-gspo"))


def wheel() -> Path:
    """The cached sglang wheel's path (downloaded on first use; the test is skipped if it cannot be)."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               f"sglang=={SGLANG_VERSION}", "-d", str(wheels)],
                              capture_output=True, text=True, timeout=600)
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            pytest.skip(f"cannot fetch the sglang {SGLANG_VERSION} wheel for its code "
                        f"(pip download failed: {proc.stderr.strip()[-300:]})")
    return found[0]


def read_member(member: str) -> bytes:
    """One file of the wheel, e.g. ``sglang/srt/server_args.py``."""
    with zipfile.ZipFile(wheel()) as whl:
        return whl.read(member)
