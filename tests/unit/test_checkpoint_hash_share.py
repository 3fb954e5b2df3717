"""Who checksums which checkpoint file (``megatron_gspo.train.checkpoint.manifest._my_share``): the
rank that wrote it, so that right after a save every byte is hashed from the writer's own page
cache and none is read back over the network; the metadata files on rank 0; every file exactly
once, also when a checkpoint of a larger world is verified by a smaller one."""

from __future__ import annotations

import pytest

from megatron_gspo.train.checkpoint import manifest

# the files of a 4-rank save (torch DCP's data files, two writer threads per rank; the RNG files)
NAMES = sorted([*(f"model_optim/__{r}_{i}.distcp" for r in range(4) for i in range(2)),
                *(f"rank_{r:05d}.pt" for r in range(4)), "model_optim/.metadata",
                "model_optim/common.pt", "model_optim/metadata.json", "run_state.json",
                "scheduler.json"])


def _shares(monkeypatch, world: int) -> list[list[str]]:
    out = []
    for rank in range(world):
        monkeypatch.setattr(manifest, "rank_world", lambda group=None, r=rank: (r, world))
        out.append(manifest._my_share(NAMES))
    return out


def test_each_rank_hashes_the_files_it_wrote(monkeypatch):
    shares = _shares(monkeypatch, 4)
    for rank, share in enumerate(shares):
        written = {n for n in NAMES if f"__{rank}_" in n or n == f"rank_{rank:05d}.pt"}
        meta = {n for n in NAMES if "__" not in n and not n.startswith("rank_")}
        assert set(share) == written | (meta if rank == 0 else set())
    assert manifest.writer_rank("model_optim/__13_1.distcp") == 13
    assert manifest.writer_rank("rank_00007.pt") == 7
    assert manifest.writer_rank("model_optim/common.pt") is None


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_file_is_hashed_exactly_once_in_any_world(monkeypatch, world):
    shares = _shares(monkeypatch, world)
    flat = [n for share in shares for n in share]
    assert sorted(flat) == NAMES
