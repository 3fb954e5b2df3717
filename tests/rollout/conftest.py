"""Fixtures of the rollout tests: SGLang's own JSON schema, a tiny model, an in-process server.

SGLang's schema: ``sglang/api/v1/api_types.py`` from the sglang 0.5.23 wheel (it needs only
msgspec). The wheel is fetched once with ``pip download --no-deps sglang==0.5.23`` into
``$MEGATRON_GSPO_CACHE`` (default ``~/.cache/megatron-gspo``), never installed, and the module is
loaded by path. Without network access and without a cached wheel the schema tests are skipped
with that reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
import zipfile
from argparse import Namespace
from pathlib import Path

import pytest

from tests.rollout.tiny import make_model_dir

SGLANG_VERSION = "0.5.23"
SCHEMA_MEMBER = "sglang/api/v1/api_types.py"


def cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_GSPO_CACHE", Path.home() / ".cache" / "megatron-gspo"))


def _schema_path() -> Path:
    target = cache_dir() / f"sglang-{SGLANG_VERSION}-api_types.py"
    if target.is_file():
        return target
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               f"sglang=={SGLANG_VERSION}", "-d", str(wheels)],
                              capture_output=True, text=True, timeout=600)
        found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
        if not found:
            pytest.skip(f"cannot fetch the sglang {SGLANG_VERSION} wheel for its JSON schema "
                        f"(pip download failed: {proc.stderr.strip()[-300:]})")
    with zipfile.ZipFile(found[0]) as wheel:
        target.write_bytes(wheel.read(SCHEMA_MEMBER))
    return target


@pytest.fixture(scope="session")
def api_types():
    """SGLang 0.5.23's generated contract module (GenerateRequest, GenerateResponse, ...)."""
    path = _schema_path()
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_api_types"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("rollout") / "tiny_qwen3_moe")


class InProcessServer:
    """``megatron-gspo serve`` in this process: uvicorn in a thread (fast to start)."""

    def __init__(self, model_path: Path, **overrides):
        import argparse

        import uvicorn

        from launch.serve import add_arguments
        from pipeline.local.server import LocalRolloutServer
        from pipeline.servers import free_port

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args(["--model-path", str(model_path), "--port", str(free_port()),
                                  "--random-seed", "0"])
        for key, value in overrides.items():
            setattr(args, key, value)
        self.args: Namespace = args
        self.url = f"http://127.0.0.1:{args.port}"
        self.server = LocalRolloutServer(args)
        self.server.engine.start()
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1",
                                                      port=args.port, log_level="warning"))
        self._thread = threading.Thread(target=self._uvicorn.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process rollout server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self.server.engine.stop()


@pytest.fixture(scope="module")
def local_server(model_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer(model_dir)
    yield server
    server.close()
    torch.set_num_threads(threads)
