"""Issue 11, items 6 and 8 (checkpoints): damaged checkpoints on resume, the RNG file, rotation, a
full disk.

Real Megatron checkpoints (dist_checkpointing, torch_dist) of the tiny policy on 2 gloo ranks
(EP2), damaged the way the probe damaged them:

* the newest checkpoint's model shard truncated (the probe got a bare ``EOFError``): resume uses
  the previous one and says which file of which checkpoint is damaged; loading the damaged one
  directly is a ``CheckpointError`` naming the file;
* one byte of a rank's RNG file changed (same size): caught by the checksum;
* a damaged manifest (the probe's raw ``JSONDecodeError`` came from a truncated JSON file) and a
  directory without one (a partial save) are never used; with nothing intact left the error
  lists every checkpoint and what is wrong with it;
* a deleted per-rank RNG file (the probe: silently skipped, the resume not exact) is an error;
* ``keep`` rotation keeps the newest K and the one the run resumed from; stale ``.tmp`` go;
* a full disk (a real 16 MiB tmpfs where this machine lets root mount one, else the same
  conditions simulated): too little space is refused before writing, and a disk that fills up
  mid-save (torch.save's ``enforce fail at inline_container.cc`` of the probe) is reported as
  ENOSPC with the path, the space needed and the space free; no ``.tmp`` is left.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.hf import rank_pieces
from megatron_gspo.train import checkpoint as ckpt
from tests.distributed.layouts import assemble, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_checkpoint import _fresh, _step  # the same tiny SFT step
from tests.reliability.conftest import fill_disk as _fill


def _pieces(gpt, cfg, pg):
    return [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]


def _latest(run_dir) -> tuple[str, str]:
    """(name of the checkpoint resume picks or the error it raised, what rank 0 printed)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            picked = ckpt.latest_checkpoint(run_dir).name
        except ckpt.CheckpointError as e:
            picked = f"CheckpointError: {e}"
        except Exception as e:  # noqa: BLE001 - the probe's bare EOFError / JSONDecodeError
            picked = f"{type(e).__name__}: {e}"
    return picked, err.getvalue()


def _load_error(path, state) -> str:
    try:
        ckpt.load_checkpoint(path, state.model, state.optimizer)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "loaded"


def _damage_worker(rank, world, cfg_dict, run_dir):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    root = ckpt.checkpoint_root(run_dir)
    out = {}
    for step in (1, 2, 3):
        _step(state, cfg, pg, step)
        ckpt.save_checkpoint(run_dir, step, state.model, state.optimizer,
                             {"sampler": {"index": 8 * step}})
        if step == 1:
            out["at_step1"] = _pieces(gpt, cfg, pg)

    def on_rank0(fn):
        if rank == 0:
            fn()
        dist.barrier()

    # 1. the newest checkpoint's largest model shard truncated to half its size
    shard = max((root / "step_000003" / "model_optim").glob("*.distcp"),
                key=lambda p: p.stat().st_size)
    out["truncated"] = f"model_optim/{shard.name}"
    on_rank0(lambda: shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2]))
    out["after_truncation"] = _latest(run_dir)
    out["load_truncated"] = _load_error(root / "step_000003", state)
    # resuming from the fallback gives the weights of step 1? (step 2 first: still intact)
    gpt2, state2 = _fresh(cfg, pg)
    run_state = ckpt.load_checkpoint(root / "step_000001", state2.model, state2.optimizer)
    out["loaded_step1"] = _pieces(gpt2, cfg, pg)
    out["run_state1"] = run_state

    # 2. one byte of step 2's rank-1 RNG file changed, size unchanged
    rng_file = root / "step_000002" / "rank_00001.pt"

    def flip():
        raw = bytearray(rng_file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        rng_file.write_bytes(bytes(raw))
    on_rank0(flip)
    out["after_flip"] = _latest(run_dir)

    # 3. step 1's manifest truncated mid-JSON; a partial step_000004 (no manifest) beside them
    manifest = root / "step_000001" / ckpt.MANIFEST
    on_rank0(lambda: manifest.write_text(manifest.read_text()[:40]))
    on_rank0(lambda: shutil.copytree(root / "step_000002", root / "step_000004",
                                     ignore=shutil.ignore_patterns(ckpt.MANIFEST)))
    out["nothing_intact"] = _latest(run_dir)
    out["load_partial"] = _load_error(root / "step_000004", state)

    # 4. a deleted per-rank RNG file of an otherwise intact checkpoint
    _step(state, cfg, pg, 5)
    ckpt.save_checkpoint(run_dir, 5, state.model, state.optimizer, {"sampler": {"index": 40}})
    on_rank0(lambda: (root / "step_000005" / "rank_00001.pt").unlink())
    out["load_without_rng"] = _load_error(root / "step_000005", state)
    out["after_rng_deleted"] = _latest(run_dir)

    # 5. rotation: keep 2, the resumed-from checkpoint (step 1) protected; a stale .tmp goes
    rot_dir = Path(run_dir) / "rotation"
    on_rank0(lambda: (ckpt.checkpoint_root(rot_dir) / "step_000099.tmp").mkdir(parents=True))
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(rot_dir, step, state.model, state.optimizer, {}, keep=2,
                             protect=[ckpt.checkpoint_root(rot_dir) / "step_000001"])
    out["rotation"] = sorted(p.name for p in ckpt.checkpoint_root(rot_dir).iterdir())
    out["rotation_latest"] = _latest(rot_dir)[0]
    parallel.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def damage(tmp_path_factory):
    cfg = tiny_config({"expert": 2})
    run_dir = tmp_path_factory.mktemp("damage")
    results = run_on_ranks(2, _damage_worker, (cfg, str(run_dir)), timeout_s=600)
    return results, config_from_dict(cfg)


def test_truncated_model_shard_falls_back_to_the_previous_checkpoint(damage):
    results, cfg = damage
    out = results[0]
    picked, said = out["after_truncation"]
    assert picked == "step_000002", picked  # was: step_000003, then a bare EOFError on load
    assert "step_000003 is damaged" in said and out["truncated"] in said, said
    assert "bytes, the manifest says" in said and "resuming from" in said and "step_000002" in said
    assert out["load_truncated"].startswith("CheckpointError") and out["truncated"] in \
        out["load_truncated"], out["load_truncated"]
    # the fallback's contents load exactly (on both ranks)
    shapes = hf_param_shapes(cfg.model)
    saved, loaded = assemble(results, "at_step1", shapes), assemble(results, "loaded_step1", shapes)
    for name in shapes:
        assert torch.equal(saved[name], loaded[name]), name
    assert out["run_state1"] == {"step": 1, "sampler": {"index": 8}}


def test_changed_byte_of_an_rng_file_is_caught_by_the_checksum(damage):
    picked, said = damage[0][0]["after_flip"]
    assert picked == "step_000001", picked
    assert "rank_00001.pt: sha256 differs" in said and "step_000002 is damaged" in said, said


def test_damaged_manifest_and_partial_save_are_never_used(damage):
    out = damage[0][0]
    picked, _ = out["nothing_intact"]
    assert picked.startswith("CheckpointError: no intact checkpoint"), picked
    for what in ("step_000004: partial checkpoint: no manifest.json",
                 "step_000003 is damaged", "step_000002 is damaged",
                 "step_000001/manifest.json: damaged manifest"):
        assert what in picked, (what, picked)
    assert "JSONDecodeError" in picked  # named as the manifest's problem, not raised bare
    assert out["load_partial"].startswith("CheckpointError") and "partial" in out["load_partial"]


def test_missing_rng_file_is_an_error_not_skipped(damage):
    out = damage[0][0]
    assert out["load_without_rng"].startswith("CheckpointError"), out["load_without_rng"]
    assert "rank_00001.pt: missing" in out["load_without_rng"]
    picked, said = out["after_rng_deleted"]  # the resume would not be exact: not used
    assert picked.startswith("CheckpointError") and "step_000005 is damaged (rank_00001.pt: " \
        "missing" in picked, picked


def test_rotation_keeps_the_newest_and_the_resumed_one(damage):
    out = damage[0][0]
    kept = out["rotation"]
    assert kept == ["latest", "step_000001", "step_000003", "step_000004"], kept
    assert out["rotation_latest"] == "step_000004"


# ------------------------------------------------------------------------------------------------
# A full disk


def _disk_worker(rank, world, cfg_dict, run_dir, real):
    from megatron.core import dist_checkpointing

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    _step(state, cfg, pg, 0)
    disk = Path(run_dir)
    out = {}
    real_usage, real_save, real_torch_save = shutil.disk_usage, dist_checkpointing.save, torch.save

    def attempt(step):
        try:
            ckpt.save_checkpoint(run_dir, step, state.model, state.optimizer, {})
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"type": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e),
                    "filename": getattr(e, "filename", None)}
        return {"type": "saved"}

    # 1. less free space than the checkpoint needs: refused before anything is written
    if real:
        if rank == 0:
            _fill(disk, leave=256 << 10)
    else:  # simulated: the filesystem reports 256 KiB free
        shutil.disk_usage = lambda p: real_usage(p)._replace(free=256 << 10)
    dist.barrier()
    out["precheck"] = attempt(1)
    out["precheck_left"] = sorted(p.name for p in ckpt.checkpoint_root(run_dir).glob("*"))
    shutil.disk_usage = real_usage
    dist.barrier()
    if rank == 0 and real:
        (disk / "filler").unlink()
    dist.barrier()

    # 2. the disk fills up during the save (after the check passed): the RNG file's torch.save
    #    then fails the way the probe saw it (real), or the write raises ENOSPC (simulated)
    def no_space(obj, f, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    def save_then_fill(*args, **kwargs):
        result = real_save(*args, **kwargs)
        dist.barrier()
        if real and rank == 0:
            _fill(disk)
        elif not real:  # (Megatron's own torch.save of common.pt is done by now)
            torch.save = no_space
        dist.barrier()
        return result

    dist_checkpointing.save = save_then_fill
    try:
        out["midway"] = attempt(2)
    finally:
        dist_checkpointing.save, torch.save = real_save, real_torch_save
    out["midway_left"] = sorted(p.name for p in ckpt.checkpoint_root(run_dir).glob("*"))
    dist.barrier()
    if rank == 0 and real:
        (disk / "filler").unlink()
    dist.barrier()
    out["after_space_freed"] = attempt(3)
    parallel.destroy_model_parallel()
    return out


def test_full_disk_is_enospc_with_path_and_space_needed(small_disk):
    disk, real = small_disk
    cfg = tiny_config({"expert": 2})
    results = run_on_ranks(2, _disk_worker, (cfg, str(disk), real), timeout_s=600)
    for rank, out in enumerate(results):
        for case in ("precheck", "midway"):
            got = out[case]
            assert got["type"] == "CheckpointDiskFull" and got["errno"] == errno.ENOSPC, (rank, got)
            text = got["text"]
            assert "no space left on device writing" in text and str(disk) in text, text
            assert "needs about" in text and "MiB free" in text, text
            assert "inline_container" not in text and "enforce fail" not in text
        assert got["filename"] and str(disk) in got["filename"]
        assert out["precheck_left"] == [], out["precheck_left"]  # nothing written, nothing left
        assert not [n for n in out["midway_left"] if n.endswith(".tmp")], out["midway_left"]
        assert out["after_space_freed"] == {"type": "saved"}, out["after_space_freed"]
    latest = json.loads((disk / "checkpoints" / "step_000003" / ckpt.MANIFEST).read_text())
    assert latest["step"] == 3 and latest["world_size"] == 2
