"""Streaming safetensors I/O against the ``safetensors`` library, and its errors on damaged input.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_convert_io.py``
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_gspo.hf.safetensors_io import (CheckpointError, HFCheckpoint, ShardWriter, parse_size,
                                          plan_shards, read_header, shard_file_names, write_index)


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "b.f32": torch.randn(3, 4, 2, generator=gen),
        "c.f16": torch.randn(6, generator=gen).to(torch.float16),
        "d.i64": torch.arange(10, dtype=torch.int64).reshape(2, 5),
        "e.empty": torch.zeros(0, 3),
    }


def test_reader_matches_safetensors_library(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    with HFCheckpoint(tmp_path) as ckpt, safe_open(tmp_path / "model.safetensors", "pt") as ref:
        assert set(ckpt.shapes()) == set(ref.keys())
        for name in ref.keys():
            ours = ckpt.read(name)
            assert ours.dtype == ref.get_tensor(name).dtype and torch.equal(ours, ref.get_tensor(name))
        assert torch.equal(ckpt.read("a.bf16", rows=slice(2, 5)), tensors["a.bf16"][2:5])
        out = torch.empty(1, 4, 2)
        ckpt.read_into("b.f32", out, rows=slice(2, 3))
        assert torch.equal(out, tensors["b.f32"][2:3])


def test_writer_output_is_read_by_safetensors_library(tmp_path):
    tensors = _tensors()
    entries = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = ShardWriter(tmp_path / "x.safetensors", entries)
    for name, tensor in tensors.items():
        if name == "a.bf16":  # in row blocks
            writer.write(name, tensor[:3])
            writer.write(name, tensor[3:])
        else:
            writer.write(name, tensor)
    writer.close(fsync=False)
    with safe_open(tmp_path / "x.safetensors", "pt") as ref:
        assert ref.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(ref.get_tensor(name), tensor)


def test_writer_rejects_wrong_order_and_early_close(tmp_path):
    entries = [("x", (2, 2), torch.float32), ("y", (2,), torch.float32)]
    writer = ShardWriter(tmp_path / "w.safetensors", entries)
    with pytest.raises(ValueError, match="expected x"):
        writer.write("y", torch.zeros(2))
    writer.write("x", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="closed before y"):
        writer.close(fsync=False)


def test_sharded_index_and_plan(tmp_path):
    tensors = {f"t{i}": torch.full((4, 4), float(i)) for i in range(5)}  # 64 bytes each
    entries = [(n, (4, 4), torch.float32) for n in tensors]
    shards = plan_shards(entries, max_shard_bytes=130)
    assert [len(s) for s in shards] == [2, 2, 1]
    names = shard_file_names(len(shards))
    weight_map = {}
    for file, shard in zip(names, shards):
        writer = ShardWriter(tmp_path / file, shard)
        for name, _, _ in shard:
            writer.write(name, tensors[name])
            weight_map[name] = file
        writer.close(fsync=False)
    write_index(tmp_path, weight_map, 5 * 64)
    with HFCheckpoint(tmp_path) as ckpt:
        assert all(torch.equal(ckpt.read(n), t) for n, t in tensors.items())


def _sharded_dir(tmp_path):
    save_file({"x": torch.ones(4, 4)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"y": torch.ones(8, 8)}, tmp_path / "model-00002-of-00002.safetensors")
    write_index(tmp_path, {"x": "model-00001-of-00002.safetensors",
                           "y": "model-00002-of-00002.safetensors"}, 320)
    return tmp_path


def test_missing_shard_is_named(tmp_path):
    (_sharded_dir(tmp_path) / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing.*model-00002-of-00002.safetensors"):
        HFCheckpoint(tmp_path)


def test_truncated_file_is_named(tmp_path):
    path = _sharded_dir(tmp_path) / "model-00002-of-00002.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: truncated"):
        HFCheckpoint(tmp_path)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        HFCheckpoint(tmp_path)


def test_index_naming_a_tensor_its_shard_lacks(tmp_path):
    _sharded_dir(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["z"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"z \(in model-00001-of-00002.safetensors\)"):
        HFCheckpoint(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(tmp_path / "junk.safetensors")


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000
    with pytest.raises(ValueError, match="unknown unit"):
        parse_size("3XB")


def test_torch_save_records_are_mapped_in_place_or_fall_back(tmp_path):
    """The export maps a stored tensor's bytes instead of torch.load-ing them when the record is a
    plain contiguous tensor; anything else (here: a transposed one) goes through torch.load."""
    import os

    from megatron_gspo.hf.mcore_checkpoint import _map_saved_tensor
    from torch.utils.serialization import config as serialization_config

    plain = torch.randn(6, 5).to(torch.bfloat16)
    transposed = torch.randn(5, 6).t()  # stride (1, 6): not mapped
    path = tmp_path / "records.bin"
    spans = []
    with open(path, "wb") as f:
        for tensor, crc in ((plain, True), (plain, False), (transposed, True)):
            serialization_config.save.compute_crc32 = crc
            start = f.tell()
            torch.save(tensor, f)
            spans.append((start, f.tell() - start))
    serialization_config.save.compute_crc32 = True
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, length in spans[:2]:
            mapped = _map_saved_tensor(fd, start, length, (6, 5), torch.bfloat16)
            assert mapped is not None and torch.equal(mapped, plain)
        assert _map_saved_tensor(fd, *spans[0], (5, 6), torch.bfloat16) is None  # wrong shape
        assert _map_saved_tensor(fd, *spans[2], (6, 5), torch.float32) is None
    finally:
        os.close(fd)
