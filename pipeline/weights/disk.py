"""The ``disk`` transport: safetensors shards on a filesystem the servers read.

Every source rank writes its own buckets, one shard each, in parallel, into the version's
directory (``weights_v{version}.tmp``); at the end rank 0 writes the index file, renames the
directory to ``weights_v{version}`` and asks every server to ``/update_weights_from_disk`` it.
The directory of the version retired after that (beyond ``keep_versions``) is kept as a spare
whose files the next push overwrites in place: on tmpfs their pages are reused, not allocated
and zeroed again (``transport.write_shard``). With ``verify``, each server reports a checksum per
shard file in its answer to the load.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from pipeline.generation import client as rollout
from pipeline.weights import transport as wt
from pipeline.weights.interface import Pusher, Transport
from pipeline.weights.stats import SyncStats


class DiskTransport(Transport):
    """``shared_dir``: where the versions' directories go; ``keep_versions``: how many of them
    stay; ``spare_name``: the spare directory's name (``.{spare_name}_spare``)."""

    supports_delta = False

    def __init__(self, pusher: Pusher, *, shared_dir: Optional[str | Path],
                 keep_versions: int, spare_name: str):
        if shared_dir is None:
            raise ValueError("transport 'disk' needs shared_dir (a filesystem the servers read)")
        super().__init__(pusher)
        self.shared_dir = Path(shared_dir)
        self.keep_versions = keep_versions
        self.spare_name = spare_name
        self._written: list[Path] = []
        self._spare: Optional[Path] = None  # a retired version's directory, to overwrite

    def version_dir(self, version: str, *, tmp: bool = False) -> Path:
        return self.shared_dir / (f"weights_v{version}" + (".tmp" if tmp else ""))

    def begin(self, version: str) -> None:
        tmp = self.version_dir(version, tmp=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if self._spare is not None and self._spare.is_dir():
            # The retired version's files are overwritten in place (wt.write_shard): their
            # pages are reused, not allocated and zeroed again on every push.
            self._spare.rename(tmp)
        else:
            tmp.mkdir(parents=True)
        self._spare = None

    def send(self, bucket, version: str, wire, wire_flat: torch.Tensor, extra: dict,
             entry: dict) -> None:
        entry["shard"] = f"model-{bucket.index + 1:05d}-of-{bucket.count:05d}.safetensors"
        layout, _ = wt.flat_layout([n for n, _ in wire], [t.dtype for _, t in wire],
                                   [t.shape for _, t in wire])
        wt.write_shard(self.version_dir(version, tmp=True) / entry["shard"], layout,
                       wire_flat.cpu())
        return None  # the servers answer at end(), when they load the directory

    def end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        p = self.pusher
        tmp, final = self.version_dir(version, tmp=True), self.version_dir(version)
        weight_map = {}
        for b, meta in buckets.items():
            names = meta.get("names") or stream.meta[b].names  # FP8: weights and scales
            weight_map.update({n: meta["shard"] for n in names})
        shards = set(weight_map.values())
        for leftover in tmp.iterdir():  # a recycled directory's files this push did not write
            if leftover.name not in shards:
                leftover.unlink()
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": stats.bytes}, "weight_map": weight_map}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        t0 = time.perf_counter()
        answers = p.each_server(lambda u: self.load(u, final, sorted(shards)))
        stats.phases["load_from_disk_s"] = time.perf_counter() - t0
        loads = [float(((a or {}).get("timings") or {}).get("load_s", 0.0)) for a in answers]
        if any(loads):
            stats.phases["server_load_s"] = max(loads)
        if p.verify_now:
            for url, answer in zip(p.server_urls, answers):
                per_file = (answer or {}).get("checksums") or {}
                for b, meta in buckets.items():
                    p.check(url, meta["shard"], {"checksums": per_file.get(meta["shard"])},
                            meta["checksum"])
            stats.verified_buckets = len(buckets)
        self._retire(final)

    def load(self, url: str, directory: Path, shards: list[str]) -> dict:
        """Make the server at ``url`` load ``directory`` (SGLang's ``/update_weights_from_disk``);
        its answer, with ``checksums`` ({shard: [per TP rank]}) where negotiated."""
        p = self.pusher
        body = {"model_path": str(directory), "flush_cache": False, "abort_all_requests": False}
        return rollout.control(url, "/update_weights_from_disk", body, timeout_s=p.timeout_s,
                               headers=p.headers(p.server_urls.index(url)))

    def _retire(self, final: Path) -> None:
        """Keep ``keep_versions`` directories; the first one retired becomes the spare."""
        self._written.append(final)
        while len(self._written) > self.keep_versions:
            retired = self._written.pop(0)
            if self._spare is None and retired.is_dir():  # kept for the next push's files
                self._spare = self.shared_dir / f".{self.spare_name}_spare"
                shutil.rmtree(self._spare, ignore_errors=True)
                retired.rename(self._spare)
            else:
                shutil.rmtree(retired, ignore_errors=True)

    def close(self) -> None:
        """Remove the spare directory (the versions written stay)."""
        if self._spare is not None:
            shutil.rmtree(self._spare, ignore_errors=True)
            self._spare = None
