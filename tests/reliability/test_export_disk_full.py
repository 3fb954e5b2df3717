"""Issue 38, item 7: a full disk during the Hugging Face export is said as a checkpoint's.

The probe's export died with the safetensors library's raw ``SafetensorError ... I/O error``
traceback on one rank, while a full disk during a checkpoint is a ``CheckpointDiskFull`` naming
the path, the space needed and the space free. The real export (2 gloo ranks, EP2: rank 1 writes
its experts' shards itself) on the checkpoint test's ``small_disk`` (a real 16 MiB tmpfs where
this machine lets root mount one, else simulated):

* too little free space: refused before a byte is written (:class:`ExportDiskFull`, every rank);
* the disk filling up as rank 1 writes its first shard (real: the tmpfs filled, safetensors' own
  writer fails with its ``I/O error``; simulated: that error raised): the same message on every
  rank, no traceback of safetensors;
* either way the earlier export in ``hf/`` is left exactly as it was (the export is written into
  ``hf.tmp`` and renamed when complete; no ``hf.tmp`` is left), a checkpoint beside it is
  untouched, and once there is space the export works again.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from bench.spawn import run_on_ranks
from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.model import gpt as policy
from tests.distributed.layouts import tiny_config
from tests.reliability.conftest import fill_disk

pytestmark = pytest.mark.slow  # two Megatron ranks: ~20 s on the 2-core machine


def _snapshot(directory: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def _export_worker(rank, world, cfg_dict, disk, real):
    from safetensors import SafetensorError
    from safetensors.torch import save_file as real_save_file

    from megatron_gspo.hf import export

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=3)
    disk = Path(disk)
    out_dir = disk / "hf"
    out: dict = {}

    def attempt():
        try:
            export.export_hf_dir(gpt, cfg.model, pg, out_dir)
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"type": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e)}
        return {"type": "exported"}

    def state():  # between two barriers: no rank changes the disk meanwhile
        dist.barrier()
        seen = {"hf": _snapshot(out_dir), "ckpt": _snapshot(disk / "checkpoints"),
                "left": sorted(p.name for p in disk.iterdir())}
        dist.barrier()
        return seen

    if rank == 0:  # a checkpoint of the run beside the export: never touched
        (disk / "checkpoints").mkdir()
        (disk / "checkpoints" / "latest").write_text("step_000003")
    out["first"] = attempt()
    out["before"] = state()

    # 1. less free space than the export needs: refused before anything is written
    real_usage = shutil.disk_usage
    if real and rank == 0:
        fill_disk(disk, leave=256 << 10)
    elif not real:
        shutil.disk_usage = lambda p: real_usage(p)._replace(free=256 << 10)
    dist.barrier()
    out["precheck"] = attempt()
    shutil.disk_usage = real_usage
    if real and rank == 0:
        (disk / "filler").unlink()
    out["after_precheck"] = state()

    # 2. the disk fills up as rank 1 writes its first shard, through safetensors' own writer
    #    (simulated: the error that writer raises then)
    def full_then_save(tensors, path, metadata=None):
        if not real:
            raise SafetensorError("Error while serializing: I/O error: No space left on device "
                                  "(os error 28)")
        fill_disk(disk)
        return real_save_file(tensors, path, metadata=metadata)

    if rank == 1:
        export.save_file = full_then_save
    out["midway"] = attempt()
    export.save_file = real_save_file
    if real and rank == 1:
        (disk / "filler").unlink()
    out["after_midway"] = state()

    # 3. space again: exported
    out["again"] = attempt()
    out["end"] = state()
    parallel.destroy_model_parallel()
    return out


def test_full_disk_during_the_export_is_said_as_a_checkpoints_and_keeps_the_last(small_disk):
    disk, real = small_disk
    cfg = tiny_config({"expert": 2})
    results = run_on_ranks(2, _export_worker, (cfg, str(disk), real), timeout_s=240)
    for rank, out in enumerate(results):
        assert out["first"] == {"type": "exported"}, (rank, out["first"])
        for case in ("precheck", "midway"):
            got = out[case]
            assert got["type"] == "ExportDiskFull" and got["errno"] == errno.ENOSPC, (rank, got)
            text = got["text"]
            # the checkpoint's wording (megatron_gspo.disk_full), the path and both sizes
            assert ("Hugging Face export hf: no space left on device writing "
                    f"{disk}/hf.tmp") in text, text
            assert "this Hugging Face export needs about" in text and "MiB free" in text, text
            assert "checkpoints are kept" in text, text
            assert "SafetensorError" not in text and "I/O error" not in text, text
        for after in ("after_precheck", "after_midway"):  # the earlier export, as it was
            assert out[after] == out["before"], (rank, after, out[after], out["before"])
            assert "hf.tmp" not in out[after]["left"], out[after]["left"]
        assert out["again"] == {"type": "exported"}, (rank, out["again"])
        assert out["end"]["left"] == ["checkpoints", "hf"], out["end"]["left"]
        assert out["end"]["ckpt"] == out["before"]["ckpt"]
    assert "model.safetensors.index.json" in results[0]["end"]["hf"]
