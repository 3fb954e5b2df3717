"""Issue 22, item 12: a tampered checkpoint must not run code on ``--resume``.

A real checkpoint of the tiny policy (one gloo rank, saved by ``save_checkpoint``), then copies of
it tampered the way the probe did, with the manifest entry updated so verification passes:

* ``model_optim/.metadata`` replaced by a pickle that calls ``os.system`` (the probe's ran a
  command: torch's ``FileSystemReader.read_metadata`` is a bare ``pickle.load``);
* ``.metadata`` left to torch's own classes but one byte item (``_extra_state``) pointed at a
  new ``.distcp`` holding a ``torch.save`` that calls ``os.system`` (Megatron's planner loads
  byte items with ``torch.load`` with ``weights_only`` off).

``load_checkpoint`` (what ``--resume`` calls) refuses both with a ``CheckpointError`` naming the
file, the command never runs, and the untampered checkpoint still loads; the HF converter's
reader (``McoreCheckpoint``) refuses the tampered ``.metadata`` too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from megatron_gspo.train import checkpoint as ckpt
from tests.distributed.layouts import tiny_config
from bench.spawn import run_on_ranks


class _RunsACommand:
    """Unpickled, it runs ``touch MARKER``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _set_manifest_entry(step_dir: Path, name: str) -> None:
    manifest_path = step_dir / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    data = (step_dir / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _tamper_metadata(src: Path, dst: Path, marker: Path) -> None:
    shutil.copytree(src, dst)
    (dst / "model_optim" / ".metadata").write_bytes(pickle.dumps(_RunsACommand(str(marker))))
    _set_manifest_entry(dst, "model_optim/.metadata")


def _tamper_byte_item(src: Path, dst: Path, marker: Path) -> str:
    """Point the first byte item at a new file holding a command; returns the item's key."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    shutil.copytree(src, dst)
    meta_path = dst / "model_optim" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())  # this test's own, untampered file
    key = next(k for k, md in metadata.state_dict_metadata.items()
               if isinstance(md, BytesStorageMetadata))
    buf = io.BytesIO()
    torch.save(_RunsACommand(str(marker)), buf)
    (dst / "model_optim" / "__9_0.distcp").write_bytes(buf.getvalue())
    for index, info in metadata.storage_data.items():
        if index.fqn == key:
            info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(buf.getvalue())
    meta_path.write_bytes(pickle.dumps(metadata))
    for name in ("model_optim/.metadata", "model_optim/__9_0.distcp"):
        _set_manifest_entry(dst, name)
    return key


def _tamper_worker(rank, world, cfg_dict, run_dir):
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from tests.distributed.test_checkpoint import _fresh, _step

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    _, state = _fresh(cfg, pg)
    _step(state, cfg, pg, 1)
    good = ckpt.save_checkpoint(run_dir, 1, state.model, state.optimizer, {"sampler": {"index": 8}})
    root = ckpt.checkpoint_root(run_dir)
    marker = Path(run_dir) / "command_ran"
    _tamper_metadata(good, root / "step_000002", marker)
    byte_key = _tamper_byte_item(good, root / "step_000003", marker)
    out = {"byte_key": byte_key, "problems": {}, "load": {}}
    for name in ("step_000002", "step_000003"):
        out["problems"][name] = ckpt.verify_checkpoint(root / name)  # the manifest matches
        try:
            ckpt.load_checkpoint(root / name, state.model, state.optimizer)
            out["load"][name] = "loaded"
        except BaseException as err:  # noqa: BLE001 - torch raises CheckpointException(BaseException)
            out["load"][name] = f"{type(err).__name__}: {err}"
    _, fresh = _fresh(cfg, pg)
    try:
        out["good"] = ckpt.load_checkpoint(good, fresh.model, fresh.optimizer)
    except BaseException as err:  # noqa: BLE001 - torch raises CheckpointException(BaseException)
        out["good"] = f"{type(err).__name__}: {err}"
    out["marker"] = marker.exists()
    parallel.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def tampered(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tamper")
    result = run_on_ranks(1, _tamper_worker, (tiny_config({}), str(run_dir)), timeout_s=600)[0]
    return result, run_dir


def test_a_metadata_pickle_that_runs_a_command_is_refused(tampered):
    out, run_dir = tampered
    assert out["problems"]["step_000002"] == []  # the manifest entry was updated: it passes
    said = out["load"]["step_000002"]
    assert said.startswith("CheckpointError"), said
    assert "step_000002/model_optim/.metadata" in said and "posix.system" in said, said
    assert not out["marker"] and not (run_dir / "command_ran").exists()


def test_a_byte_item_that_runs_a_command_is_refused(tampered):
    out, run_dir = tampered
    assert out["problems"]["step_000003"] == []
    said = out["load"]["step_000003"]
    assert said.startswith("CheckpointError"), said
    assert "step_000003/model_optim/__9_0.distcp" in said and out["byte_key"] in said, said
    assert "weights_only" in said, said
    assert not (run_dir / "command_ran").exists()


def test_the_untampered_checkpoint_still_loads(tampered):
    out, _ = tampered
    assert out["good"] == {"step": 1, "sampler": {"index": 8}}


def test_the_converters_reader_refuses_the_tampered_metadata(tampered):
    from megatron_gspo.hf.mcore_checkpoint import McoreCheckpoint
    from megatron_gspo.hf.safetensors_io import CheckpointError

    _, run_dir = tampered
    root = ckpt.checkpoint_root(run_dir)
    with pytest.raises(CheckpointError, match=r"step_000002/model_optim/\.metadata: refused"):
        McoreCheckpoint(root / "step_000002" / "model_optim")
    assert not (run_dir / "command_ran").exists()
    opened = McoreCheckpoint(root / "step_000001" / "model_optim")  # the intact one opens
    assert opened.tensors
