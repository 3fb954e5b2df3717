"""Issue 37 item 7: the run state's tensors (a ``one_step`` run's next batch with its routing
replay tensor, the ``full`` stream's routed experts) go into ``run_state.safetensors`` beside
``run_state.json``, covered by the manifest, and come back bit for bit on resume.

A real checkpoint of the tiny policy (``save_checkpoint``, one gloo rank, as the loop calls it:
rank 0's source state with its tensors), then: the file is in the manifest and
``run_state.json`` holds placeholders (no base64: under 2 kB for a 128 KiB routing
tensor); ``load_checkpoint`` gives every tensor back bit for bit (dtype too); a changed byte and
a deleted file are ``CheckpointError``\\ s naming ``run_state.safetensors``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench.spawn import run_on_ranks
from tests.distributed.layouts import tiny_config


def _state() -> dict:
    gen = torch.Generator().manual_seed(3)
    batch = {"tokens": torch.randint(0, 250, (16, 16), generator=gen),
             "rollout_log_probs": torch.randn(16, 16, generator=gen),
             "response_mask": torch.rand(16, 16, generator=gen) > 0.5,
             # routing replay's [rows, T, layers, top-k], -1 where unknown
             "routed_experts": torch.randint(-1, 4, (16, 16, 2, 2), generator=gen,
                                             dtype=torch.int32).repeat(1, 1, 1, 32)}
    return {"sampler": {"index": 16},
            "rollout_buffer": {"step": 2, "batch": batch, "metrics": {"reward_mean": 0.25}}}


def _worker(rank, world, cfg_dict, run_dir):
    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.train import checkpoint as ckpt
    from tests.distributed.test_checkpoint import _fresh, _step

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    _, state = _fresh(cfg, pg)
    _step(state, cfg, pg, 0)
    path = ckpt.save_checkpoint(run_dir, 1, state.model, state.optimizer, _state())
    assert ckpt.verify_checkpoint(path) == []
    out = {"files": sorted(json.loads((path / ckpt.MANIFEST).read_text())["files"]),
           "json_bytes": (path / "run_state.json").stat().st_size,
           "json": (path / "run_state.json").read_text(),
           "loaded": ckpt.load_checkpoint(path, state.model, state.optimizer)}

    def load_error(where: Path) -> str:
        try:
            ckpt.load_checkpoint(where, state.model, state.optimizer)
        except ckpt.CheckpointError as err:
            return str(err)
        return "loaded"

    flipped = path.with_name("flipped")
    shutil.copytree(path, flipped)
    raw = bytearray((flipped / "run_state.safetensors").read_bytes())
    raw[-5] ^= 0x01  # a tensor byte, the size unchanged
    (flipped / "run_state.safetensors").write_bytes(bytes(raw))
    out["flipped"] = load_error(flipped)
    deleted = path.with_name("deleted")
    shutil.copytree(path, deleted)
    (deleted / "run_state.safetensors").unlink()
    out["deleted"] = load_error(deleted)
    parallel.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run_state")
    return run_on_ranks(1, _worker, (tiny_config({}), str(run_dir)), timeout_s=300)[0]


def test_the_tensors_are_a_file_of_the_manifest_not_text_in_the_json(saved):
    assert "run_state.safetensors" in saved["files"]
    routing_bytes = _state()["rollout_buffer"]["batch"]["routed_experts"].numel() * 4
    assert routing_bytes == 128 * 1024
    assert saved["json_bytes"] < 2000, saved["json"][:500]  # base64 would be 4/3 of the tensors
    assert '"__tensor__": "/rollout_buffer/batch/routed_experts"' in saved["json"]


def test_resume_gives_every_tensor_back_bit_for_bit(saved):
    want, got = _state(), saved["loaded"]
    assert got["step"] == 1 and got["sampler"] == want["sampler"]
    buffer = got["rollout_buffer"]
    assert buffer["step"] == 2 and buffer["metrics"] == {"reward_mean": 0.25}
    assert buffer["batch"].keys() == want["rollout_buffer"]["batch"].keys()
    for key, value in want["rollout_buffer"]["batch"].items():
        assert buffer["batch"][key].dtype == value.dtype and torch.equal(buffer["batch"][key], value)


def test_a_changed_or_missing_tensor_file_is_refused_naming_it(saved):
    assert "run_state.safetensors: sha256 differs" in saved["flipped"], saved["flipped"]
    assert "run_state.safetensors: missing" in saved["deleted"], saved["deleted"]
