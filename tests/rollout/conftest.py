"""Fixtures of the rollout tests: SGLang's own code, a tiny model, an in-process server.

SGLang's code comes from the sglang 0.5.23 wheel (``tests/sglang_wheel.py``: fetched once with
``pip download --no-deps sglang==0.5.23`` into ``$MEGATRON_GSPO_CACHE``, default
``~/.cache/megatron-gspo``, and never installed, it needs CUDA-only packages):

* ``api_types``: its JSON schema module ``sglang/api/v1/api_types.py`` (needs only msgspec),
  loaded by path;
* ``sglang_subset``: a directory to put on ``PYTHONPATH`` that makes ``import sglang`` give
  SGLang's own weight-update pieces: ``sglang/srt/weight_sync/tensor_bucket.py`` as it is in the
  wheel, and ``sglang.srt.utils`` holding ``init_custom_process_group``,
  ``MultiprocessingSerializer``, ``SafeUnpickler`` and ``_safe_load_torch_storage`` cut out of
  ``sglang/srt/utils/common.py`` with ``ast`` (their source text unchanged; that module's other
  imports - triton, PIL, ... - are not needed by them and not importable here). The one
  substitution: ``pybase64`` (a faster drop-in of ``base64``, not installed) is ``base64``.

Without network access and without a cached wheel these tests are skipped with that reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
import zipfile
from argparse import Namespace
from pathlib import Path
from typing import Optional

import pytest

from tests.rollout.tiny import make_model_dir
from tests.sglang_wheel import SGLANG_VERSION, cache_dir, wheel

SCHEMA_MEMBER = "sglang/api/v1/api_types.py"
_wheel = wheel  # the name the rollout tests import


def _schema_path() -> Path:
    target = cache_dir() / f"sglang-{SGLANG_VERSION}-api_types.py"
    if target.is_file():
        return target
    with zipfile.ZipFile(_wheel()) as wheel:
        target.write_bytes(wheel.read(SCHEMA_MEMBER))
    return target


SUBSET_FROM_COMMON = ("torch_release", "init_custom_process_group", "MultiprocessingSerializer",
                      "_safe_load_torch_storage", "SafeUnpickler")
SUBSET_HEADER = '''"""SGLang {version}'s weight-update pieces, cut out of sglang/srt/utils/common.py of its
wheel by tests/rollout/conftest.py (source unchanged; pybase64 is base64)."""
import base64 as pybase64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler

import torch
from packaging import version as pkg_version

'''


def _cut(source: str, names: tuple[str, ...]) -> str:
    """The top-level definitions ``names`` of ``source``, verbatim, in the order given."""
    import ast

    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}
    for node in tree.body:
        targets = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in targets:
            if name in names and name not in found:
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                found[name] = "".join(lines[start - 1:node.end_lineno])
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(f"sglang {SGLANG_VERSION}: {missing} not found in utils/common.py")
    return "\n\n".join(found[n] for n in names) + "\n"


@pytest.fixture(scope="session")
def sglang_subset() -> Path:
    """A PYTHONPATH entry whose ``sglang`` package is SGLang's own weight-update code."""
    root = cache_dir() / f"sglang-{SGLANG_VERSION}-subset"
    marker = root / "sglang" / "srt" / "utils" / "__init__.py"
    if not marker.is_file():
        with zipfile.ZipFile(_wheel()) as wheel:
            common = wheel.read("sglang/srt/utils/common.py").decode()
            bucket = wheel.read("sglang/srt/weight_sync/tensor_bucket.py")
        tmp = root.with_name(root.name + ".tmp")
        for pkg in ("sglang", "sglang/srt", "sglang/srt/utils", "sglang/srt/weight_sync"):
            (tmp / pkg).mkdir(parents=True, exist_ok=True)
            (tmp / pkg / "__init__.py").write_text("")
        (tmp / "sglang/srt/weight_sync/tensor_bucket.py").write_bytes(bucket)
        (tmp / "sglang/srt/utils/__init__.py").write_text(
            SUBSET_HEADER.format(version=SGLANG_VERSION) + _cut(common, SUBSET_FROM_COMMON))
        tmp.rename(root)
    return root


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
        from pipeline.servers.cluster import free_port

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
        self.server.shutdown()


@pytest.fixture(scope="module")
def local_server(model_dir):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer(model_dir)
    yield server
    server.close()
    torch.set_num_threads(threads)


@contextlib.contextmanager
def two_servers(model_dir: Path, log_root: Path, server_args: list[str] = (),
                pythonpath: Optional[Path] = None):
    """Two local servers, ``--tp-size`` 1 and 2 (seeds 0 and 10), without a router; yields their
    URLs. ``pythonpath``: prepended to the servers' PYTHONPATH (SGLang's weight-update code cut
    from the wheel: the ``sglang_subset`` fixture)."""
    from pipeline.servers.cluster import LocalRolloutCluster

    old = os.environ.get("PYTHONPATH")
    if pythonpath is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [old])])
    clusters = []
    try:
        for i, extra in enumerate([[], ["--tp-size", "2"]]):
            cluster = LocalRolloutCluster(model_dir, 1, router=False, log_dir=log_root / f"logs{i}",
                                          random_seed=10 * i, server_args=[*server_args, *extra])
            clusters.append(cluster)
            cluster.start()
        yield [c.server_urls[0] for c in clusters]
    finally:
        for cluster in clusters:
            cluster.stop()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
