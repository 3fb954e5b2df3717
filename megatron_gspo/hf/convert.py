"""Hugging Face <-> Megatron ``torch_dist`` checkpoint conversion for Qwen3-MoE, streaming.

::

    hf_to_mcore("Qwen3-30B-A3B/", "ckpt/mcore", tensor=4, expert=8)     # HF -> Megatron
    mcore_to_hf("ckpt/mcore", "export/")                                # Megatron -> HF

(CLI: ``megatron-gspo convert hf-to-mcore|mcore-to-hf``, see ``launch/convert.py``.)

Both directions use the one name/layout mapping of :mod:`megatron_gspo.hf.mapping`
(``pieces_for``) at the trivial layout TP = EP = PP = 1: in a torch_dist checkpoint each key holds
the *global* tensor, which is what a TP = EP = PP = 1 rank holds locally, with the layer (and
expert) index as leading axes (:mod:`megatron_gspo.hf.mcore_checkpoint`). So

* ``linear_qkv`` is the GQA-interleaved ``[q_g; k_g; v_g]`` per group, ``linear_fc1`` of an expert
  is ``[gate; up]``, experts are numbered globally, the vocabulary rows are padded with zeros to
  ``padded_vocab_size(model, tp)`` (``--tp`` only sets this padding; the checkpoint loads under any
  layout because Megatron marks the vocabulary tensors ``allow_shape_mismatch``);
* tied embeddings have no ``output_layer.weight`` and no ``lm_head.weight``.

Memory is bounded by one chunk, not by the model: hf-to-mcore builds each stored chunk (one
layer of a dense tensor, one half of an expert's fc1, an expert's fc2, a block of vocabulary rows)
from just the safetensors bytes it needs, when DCP writes it; mcore-to-hf reads the same units
(a prefetch thread one or two units ahead) and writes safetensors shards tensor by tensor (row
block by row block for the vocabulary). Chunks that are one contiguous byte range of the source
are memory-mapped, not copied (see ``mcore_checkpoint``), so most bytes are copied once, by the
write; peak RSS is about 0.4-0.7 GiB whatever the model size (``bench/bench_convert.py``).
Before anything is written, config.json is checked against the weights (every mismatch listed in
one error) and the parallel sizes against the model.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterable, Optional

import torch
from tqdm import tqdm

from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig, padded_vocab_size, \
    validate_model_parallel
from megatron_gspo.hf.hf_config import (HFConfigError, load_hf_config, model_config_from_checkpoint,
                                        model_config_from_hf, unsupported_features)
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.mapping import Piece, RankLayout, hf_param_names, hf_param_shapes, pieces_for
from megatron_gspo.hf.mcore_checkpoint import (HF_CONFIG_DIR, HF_SIDE_FILES, Chunk, Entry,
                                            McoreCheckpoint, TensorWrite, checkpoint_entries,
                                            copy_hf_files, extra_state_keys, iter_chunks, layer_chunks,
                                            none_object_bytes, write_checkpoint)
from megatron_gspo.hf.safetensors_io import (INDEX_FILE, CheckpointError, HFCheckpoint, ShardWriter,
                                          parse_size, plan_shards, shard_file_names, write_index)

DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16}
VOCAB_BLOCK_BYTES = 64 * 2**20
"""Vocabulary tensors are streamed in row blocks of about this many bytes."""


@dataclass
class ConversionResult:
    out_dir: Path
    num_tensors: int  # chunks written (hf-to-mcore) or HF tensors written (mcore-to-hf)
    bytes_written: int  # tensor payload bytes
    seconds: float


def parse_dtype(name: str) -> Optional[torch.dtype]:
    """'auto' (keep each tensor's dtype) or a floating dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    assert step == 1
    return start, stop


def restrict_rows(pieces: Iterable[Piece], start: int, stop: int, num_rows: int) -> list[Piece]:
    """The pieces of rows ``[start, stop)`` of a local tensor with ``num_rows`` rows, in the
    coordinates of that row block (pieces whose first dims map rows one to one, as the vocab's do)."""
    out = []
    for piece in pieces:
        ls, le = _span(piece.local_index[0], num_rows)
        hs = piece.hf_index[0].start or 0
        lo, hi = max(ls, start), min(le, stop)
        if lo >= hi:
            continue
        out.append(Piece(piece.hf_name, (slice(hs + lo - ls, hs + hi - ls), *piece.hf_index[1:]),
                         (slice(lo - start, hi - start), *piece.local_index[1:])))
    return out


def _chunk_pieces(chunk: Chunk, model: ModelConfig, layout: RankLayout) -> list[Piece]:
    pieces = pieces_for(chunk.param_name, chunk.param_shape, model, layout)
    if chunk.rows is not None:
        pieces = restrict_rows(pieces, chunk.rows[0], chunk.rows[1], chunk.param_shape[0])
    return pieces


def _is_rows_only(index: tuple, shape: tuple) -> bool:
    """True when ``index`` selects whole trailing dims (only rows of dim 0 are sliced)."""
    return all(_span(s, n) == (0, n) for s, n in zip(index[1:], shape[1:]))


# ----------------------------------------------------------------------------------------------
# HF -> Megatron


class _BufferPool:
    """One reusable output buffer per (shape, dtype) and thread.

    DCP writes each chunk before it asks the same writer thread for the next one
    (``write_checkpoint`` disables read-ahead), so a buffer is free again when its shape comes
    round; reuse saves the page faults and zeroing of a fresh allocation per chunk.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get((shape, dtype))
        if buffer is None:
            buffer = buffers[(shape, dtype)] = torch.empty(shape, dtype=dtype)
        return buffer


def _produce_chunk(chunk: Chunk, pieces: list[Piece], dtype: torch.dtype, hf: HFCheckpoint,
                   pool: _BufferPool) -> torch.Tensor:
    """Build one stored chunk from the HF tensors (zeros where no HF row maps: vocab padding)."""
    shape = chunk.local_shape
    covered = sum(math.prod(_span(s, n)[1] - _span(s, n)[0] for s, n in zip(p.local_index, shape))
                  * math.prod(shape[len(p.local_index):]) for p in pieces)
    if len(pieces) == 1 and covered == math.prod(shape):
        piece, info = pieces[0], hf.info(pieces[0].hf_name)
        if info.dtype == dtype and info.shape and _is_rows_only(piece.hf_index, info.shape):
            # The chunk is one contiguous byte range of the HF file (an expert's gate, up or down,
            # a norm, the router, ...): hand DCP a read-only mapping of it, so the only copy is
            # the write itself, as in cp.
            return hf.map_rows(piece.hf_name, slice(*_span(piece.hf_index[0], info.shape[0]))
                               ).view(chunk.sizes)
    out = pool.get(tuple(chunk.sizes), dtype).view(shape)
    if covered != math.prod(shape):
        out.zero_()
    for piece in pieces:
        info = hf.info(piece.hf_name)
        rows = slice(*_span(piece.hf_index[0], info.shape[0])) if info.shape else None
        dest = out[piece.local_index]
        if _is_rows_only(piece.hf_index, info.shape) and dest.is_contiguous() and dest.dtype == info.dtype:
            hf.read_into(piece.hf_name, dest, rows)  # straight from the file into place
        else:
            dest.copy_(hf.read(piece.hf_name, rows)[(slice(None), *piece.hf_index[1:])])
    return out.view(chunk.sizes)


def _prepare_out_dir(out_dir: Path, overwrite: bool, marker: str | tuple[str, ...]) -> Path:
    out_dir = Path(out_dir)
    markers = (marker,) if isinstance(marker, str) else marker
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{out_dir}: exists and is not empty (pass --overwrite to replace "
                                  "a previous conversion)")
        if not any((out_dir / m).exists() for m in markers):
            raise CheckpointError(f"{out_dir}: not empty and does not look like a previous "
                                  f"conversion (no {' or '.join(markers)}); refusing to delete it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def check_parallel(model: ModelConfig, tensor: int = 1, pipeline: int = 1, expert: int = 1,
                   expert_tensor: Optional[int] = None) -> ParallelConfig:
    """The parallel sizes must divide what they split (heads, KV groups, layers, experts, FFN)."""
    try:
        parallel = ParallelConfig(tensor=tensor, pipeline=pipeline, expert=expert,
                                  expert_tensor=expert_tensor, sequence_parallel=tensor > 1)
        validate_model_parallel(model, parallel)
    except ConfigError as err:
        raise ConfigError(f"{err} (parallel.tensor is --tp, parallel.pipeline --pp, parallel.expert "
                          "--ep, parallel.expert_tensor --etp; model.* are config.json fields)") from None
    return parallel


def _vocab_block_rows(model: ModelConfig, itemsize: int, block_bytes: int) -> int:
    return max(1, block_bytes // (model.hidden_size * itemsize))


def _write_order(chunk: Chunk, entry_index: int, num_layers: int) -> tuple:
    """Layer-major order (embedding, layer 0 dense, layer 0 experts, ..., head), as HF files are."""
    layer = -1 if chunk.entry.is_vocab and chunk.entry.key.startswith("embedding") else (
        chunk.layer if chunk.layer is not None else num_layers)
    return (layer, -1 if chunk.expert is None else chunk.expert, entry_index,
            chunk.rows[0] if chunk.rows else 0)


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tensor: int = 1, pipeline: int = 1,
                expert: int = 1, expert_tensor: Optional[int] = None, dtype: str = "auto",
                progress: bool = True, overwrite: bool = False,
                thread_count: Optional[int] = None, sync_files: bool = True,
                vocab_block_bytes: int = VOCAB_BLOCK_BYTES
                ) -> ConversionResult:
    """Convert a Hugging Face Qwen3-MoE directory to a Megatron torch_dist checkpoint, in the
    layout Megatron-LM and Megatron-Bridge load (:mod:`megatron_gspo.hf.megatron_layout`):
    ``out_dir/iter_0000000/`` (the torch_dist files, the common state Megatron-LM reads, Bridge's
    ``run_config.yaml``, config.json and the tokenizer files in ``hf_config/`` for the way back),
    then the tracker ``out_dir/latest_checkpointed_iteration.txt``. Every ``_extra_state`` object
    either layer spec asks for is stored (as None).

    ``tensor`` etc. are checked against the model and ``tensor`` sets the vocabulary padding; the
    result loads under any layout. ``thread_count``: writer threads, each writing its
    own data file with one chunk in memory; None: :func:`auto_writer_threads` of the size.
    """
    start_time = time.perf_counter()
    target = parse_dtype(dtype)
    hf_dir = Path(hf_dir)
    with HFCheckpoint(hf_dir) as hf:
        model = model_config_from_checkpoint(hf_dir, hf.shapes())
        parallel = check_parallel(model, tensor, pipeline, expert, expert_tensor)
        out_dir = _prepare_out_dir(Path(out_dir), overwrite,
                                   marker=(megatron_layout.TRACKER, "metadata.json"))
        ckpt_dir = out_dir / megatron_layout.iteration_dir_name(0)
        layout = RankLayout(padded_vocab_size=padded_vocab_size(model, parallel.tensor))
        entries = checkpoint_entries(model, layout.padded_vocab_size)
        ordered = []
        for entry_index, entry in enumerate(entries):
            first = pieces_for(Chunk(entry, 0, 0).param_name, entry.shape, model, layout)[0]
            entry_dtype = target or hf.info(first.hf_name).dtype
            rows = _vocab_block_rows(model, entry_dtype.itemsize, vocab_block_bytes)
            for chunk in iter_chunks(entry, model, vocab_block_rows=rows):
                ordered.append((_write_order(chunk, entry_index, model.num_layers), chunk, entry_dtype))
        ordered.sort(key=lambda item: item[0])
        writes, pool = [], _BufferPool()
        for _, chunk, entry_dtype in ordered:
            produce = partial(_produce_chunk, chunk, _chunk_pieces(chunk, model, layout), entry_dtype,
                              hf, pool)
            for key in (chunk.entry.key, *chunk.entry.aliases):
                writes.append(TensorWrite(key, chunk.entry.global_shape(model), entry_dtype,
                                          chunk.offsets, chunk.sizes, produce))
        objects = dict.fromkeys(extra_state_keys(model), none_object_bytes())
        total = sum(math.prod(w.sizes) * w.dtype.itemsize for w in writes)
        if thread_count is None:
            thread_count = auto_writer_threads(total)
        elif thread_count < 1:
            raise ValueError(f"thread_count: must be >= 1, got {thread_count}")
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="hf-to-mcore",
                  disable=not progress, mininterval=0.5) as bar:
            write_checkpoint(ckpt_dir, writes, objects, thread_count=thread_count,
                             sync_files=sync_files, on_written=bar.update,
                             common=megatron_layout.common_state(0))
    copy_hf_files(hf_dir, ckpt_dir / HF_CONFIG_DIR)
    bf16 = any(w.dtype == torch.bfloat16 for w in writes)
    megatron_layout.write_run_config(ckpt_dir, megatron_layout.run_config(
        model, bf16=bf16, hf_config_dir=ckpt_dir / HF_CONFIG_DIR))
    megatron_layout.write_tracker(out_dir, 0)
    return ConversionResult(out_dir, len(writes), total, time.perf_counter() - start_time)


BYTES_PER_WRITER = 5 * 2**30
"""The data one writer thread of :func:`hf_to_mcore` writes, by default (HF's shard size)."""


def auto_writer_threads(total_bytes: int, cpu_count: Optional[int] = None) -> int:
    """Writer threads for a checkpoint of ``total_bytes``: one per :data:`BYTES_PER_WRITER`, at
    least 1 and at most 8 or the CPU count. One thread would write one 470 GB file at 235B, at one
    stream's speed; parallel file systems want several files and writers."""
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(8, cpus, math.ceil(total_bytes / BYTES_PER_WRITER)))


# ----------------------------------------------------------------------------------------------
# Megatron -> HF


def check_mcore_against_config(ckpt: McoreCheckpoint, model: ModelConfig, source: str
                               ) -> dict[str, str]:
    """Every checkpoint tensor the config implies must be there with its global shape (the
    vocabulary may be padded to any size >= vocab_size). Returns entry key -> stored key."""
    stored_rows = ckpt.shape("embedding.word_embeddings.weight")[0] if (
        "embedding.word_embeddings.weight" in ckpt.tensors) else model.vocab_size
    problems, present = [], {}
    for entry in checkpoint_entries(model, stored_rows):
        key = ckpt.present(entry.key)
        if key is None:
            problems.append(f"{entry.key}: missing")
            continue
        present[entry.key] = key
        want, have = entry.global_shape(model), ckpt.shape(key)
        if entry.is_vocab:
            if len(have) != 2 or have[0] < model.vocab_size or have[1] != want[1]:
                problems.append(f"{key}: {list(have)} in the checkpoint, config implies "
                                f"[>= {model.vocab_size}, {want[1]}]")
        elif have != want:
            problems.append(f"{key}: {list(have)} in the checkpoint, config implies {list(want)}")
    if model.tie_word_embeddings and "output_layer.weight" in ckpt.tensors:
        problems.append("tie_word_embeddings: true in config.json, but the checkpoint has an "
                        "untied output_layer.weight")
    if problems:
        raise HFConfigError(f"{ckpt.directory} does not match {source}:\n  - " + "\n  - ".join(problems))
    return present


class _ShardedOutput:
    """Writes HF tensors, in the planned order, into consecutive safetensors shards."""

    def __init__(self, out_dir: Path, entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int,
                 sync_files: bool):
        self.out_dir = out_dir
        self.shards = plan_shards(entries, max_bytes)
        self.names = shard_file_names(len(self.shards))
        self.weight_map = {name: file for file, shard in zip(self.names, self.shards)
                           for name, _, _ in shard}
        self.total_size = sum(math.prod(s) * d.itemsize for _, s, d in entries)
        self.sync_files = sync_files
        self._next = 0
        self._writer: Optional[ShardWriter] = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._writer is None or self._writer.complete:
            if self._writer is not None:
                self._writer.close(fsync=self.sync_files)
            self._writer = ShardWriter(self.out_dir / self.names[self._next], self.shards[self._next])
            self._next += 1
        self._writer.write(name, tensor)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close(fsync=self.sync_files)
        if self._next != len(self.shards):
            raise AssertionError(f"wrote {self._next} of {len(self.shards)} shards")
        write_index(self.out_dir, self.weight_map, self.total_size)


def _units(model: ModelConfig, entries: list[Entry], block_rows: dict[str, int]) -> list[list[Chunk]]:
    """Chunks read together, in HF file order: vocab row blocks, a layer's dense tensors, one
    expert of a layer, the final norm."""
    by_key = {e.key: e for e in entries}
    units: list[list[Chunk]] = []
    embed = by_key["embedding.word_embeddings.weight"]
    units += [[c] for c in iter_chunks(embed, model, vocab_block_rows=block_rows[embed.key],
                                       rows_limit=model.vocab_size)]
    dense = [e for e in entries if e.per_layer and not e.per_expert]
    experts = [e for e in entries if e.per_expert]
    for layer in range(model.num_layers):
        units.append([c for e in dense for c in layer_chunks(e, layer)])
        units += [[c for e in experts for c in layer_chunks(e, layer, x)]
                  for x in range(model.num_experts)]
    units.append(layer_chunks(by_key["decoder.final_layernorm.weight"]))
    if "output_layer.weight" in by_key:
        head = by_key["output_layer.weight"]
        units += [[c] for c in iter_chunks(head, model, vocab_block_rows=block_rows[head.key],
                                           rows_limit=model.vocab_size)]
    return units


def _hf_blocks(unit: list[Chunk], model: ModelConfig, layout: RankLayout, order: dict[str, int],
               shapes: dict[str, tuple]) -> list[tuple[str, tuple[int, int], list[tuple[int, Piece]]]]:
    """For each HF tensor a unit produces (in canonical order): its row range and the pieces,
    each tagged with the index of the chunk it comes from."""
    by_name: dict[str, list[tuple[int, Piece]]] = {}
    for i, chunk in enumerate(unit):
        for piece in _chunk_pieces(chunk, model, layout):
            by_name.setdefault(piece.hf_name, []).append((i, piece))
    blocks = []
    for name in sorted(by_name, key=order.__getitem__):
        spans = [_span(p.hf_index[0], shapes[name][0]) for _, p in by_name[name]]
        blocks.append((name, (min(s for s, _ in spans), max(e for _, e in spans)), by_name[name]))
    return blocks


def mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, *, hf_config: Optional[str | Path] = None,
                tokenizer: Optional[str | Path] = None, dtype: str = "auto",
                max_shard_size: str = "5GB", progress: bool = True, overwrite: bool = False,
                sync_files: bool = True, vocab_block_bytes: int = VOCAB_BLOCK_BYTES
                ) -> ConversionResult:
    """Convert a Megatron torch_dist checkpoint (converted or saved by the trainer, any layout it
    was saved under) to a Hugging Face directory: safetensors shards, index, config.json,
    generation config and tokenizer files.

    ``mcore_dir``: a Megatron-LM / Bridge root (its tracker file names the iteration), an
    iteration directory or this project's flat layout (:func:`megatron_layout.resolve`).
    ``hf_config``: config.json (or its directory); default: where the checkpoint records it
    (:func:`megatron_layout.find_hf_config`: ``hf_config/``, or the ``hf_model_id`` of Bridge's
    ``run_config.yaml`` when that is a local directory).
    ``tokenizer``: directory with the tokenizer files; default the config's directory.
    """
    start_time = time.perf_counter()
    target = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    mcore_dir = megatron_layout.resolve(mcore_dir)
    ckpt = McoreCheckpoint(mcore_dir)
    config_path = Path(hf_config) if hf_config is not None else megatron_layout.find_hf_config(mcore_dir)
    if config_path is None:
        raise CheckpointError(f"{mcore_dir}: records no Hugging Face config (no {HF_CONFIG_DIR}/"
                              f"config.json, no local hf_model_id in {megatron_layout.RUN_CONFIG}): "
                              "pass --hf-config with the model's config.json")
    config = load_hf_config(config_path)
    config_file = config_path / "config.json" if config_path.is_dir() else config_path
    problems = unsupported_features(config)
    if problems:
        raise HFConfigError(f"{config_file}: not a supported Qwen3-MoE config:\n  - " + "\n  - ".join(problems))
    model = model_config_from_hf(config)
    present = check_mcore_against_config(ckpt, model, str(config_file))

    entries = checkpoint_entries(model, ckpt.shape(present["embedding.word_embeddings.weight"])[0])
    out_dtype = {e.key: target or ckpt.dtype(present[e.key]) for e in entries}
    block_rows = {e.key: _vocab_block_rows(model, out_dtype[e.key].itemsize, vocab_block_bytes)
                  for e in entries if e.is_vocab}
    layout = RankLayout(padded_vocab_size=entries[0].shape[0])
    order = {name: i for i, name in enumerate(hf_param_names(model))}
    shapes = hf_param_shapes(model)
    units = _units(model, entries, block_rows)
    plans = [_hf_blocks(unit, model, layout, order, shapes) for unit in units]
    planned, seen = [], set()
    for unit, blocks in zip(units, plans):
        for name, _, tagged in blocks:
            if name not in seen:
                seen.add(name)
                planned.append((name, shapes[name], out_dtype[unit[tagged[0][0]].entry.key]))
    if seen != set(shapes):
        raise AssertionError(f"the export plan misses {sorted(set(shapes) - seen)[:5]}")

    out_dir = _prepare_out_dir(Path(out_dir), overwrite, marker=INDEX_FILE)
    output = _ShardedOutput(out_dir, planned, max_bytes, sync_files)

    def read_unit(unit: list[Chunk]) -> list[torch.Tensor]:
        local = ckpt.read([(present[c.entry.key], c.offsets, c.sizes) for c in unit])
        return [t.view(c.local_shape) for t, c in zip(local, unit)]

    with tqdm(total=output.total_size, unit="B", unit_scale=True, unit_divisor=1024,
              desc="mcore-to-hf", disable=not progress, mininterval=0.5) as bar, ckpt:
        for unit, blocks, local in zip(units, plans, _prefetched(read_unit, units)):
            for name, (r0, r1), tagged in blocks:
                block_shape = (r1 - r0, *shapes[name][1:])
                dtype_out = out_dtype[unit[tagged[0][0]].entry.key]
                block = _assemble(name, block_shape, r0, tagged, local, dtype_out, shapes[name])
                output.write(name, block)
                bar.update(block.numel() * block.element_size())
    output.close()

    side_source = Path(tokenizer) if tokenizer is not None else config_file.parent
    copy_hf_files(side_source, out_dir, [n for n in HF_SIDE_FILES if n != "config.json"])
    exported = dict(config)
    dtype_name = str(planned[0][2]).removeprefix("torch.")
    exported["dtype"] = dtype_name
    if "torch_dtype" in exported:
        exported["torch_dtype"] = dtype_name
    (out_dir / "config.json").write_text(json.dumps(exported, indent=2) + "\n")
    return ConversionResult(out_dir, len(planned), output.total_size, time.perf_counter() - start_time)


def _prefetched(read, units: list, depth: int = 2):
    """``read(unit)`` for every unit, in order, computed by a background thread up to ``depth``
    units ahead: reading the next unit overlaps with writing this one (both release the GIL)."""
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():  # the consumer may have stopped early (an error while writing)
            try:
                results.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def worker() -> None:
        try:
            for unit in units:
                if not put((True, read(unit))):
                    return
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
            put((False, err))

    thread = threading.Thread(target=worker, name="mcore-to-hf-reader", daemon=True)
    thread.start()
    try:
        for _ in units:
            ok, item = results.get()
            if not ok:
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


def _assemble(name: str, block_shape: tuple, row0: int, tagged: list[tuple[int, Piece]],
              local: list[torch.Tensor], dtype: torch.dtype, hf_shape: tuple) -> torch.Tensor:
    """Rows ``row0..`` of HF tensor ``name`` from the pieces of the unit's local tensors."""
    if len(tagged) == 1:
        i, piece = tagged[0]
        view = local[i][piece.local_index]
        if (tuple(view.shape) == block_shape and view.dtype == dtype and view.is_contiguous()
                and _is_rows_only(piece.hf_index, hf_shape)):
            return view  # written straight from the read buffer
    block = torch.empty(block_shape, dtype=dtype)
    covered = 0
    for i, piece in tagged:
        start, stop = _span(piece.hf_index[0], hf_shape[0])
        dest = block[(slice(start - row0, stop - row0), *piece.hf_index[1:])]
        dest.copy_(local[i][piece.local_index])
        covered += dest.numel()
    if covered != block.numel():
        raise AssertionError(f"{name}: the mapping covers {covered} of {block.numel()} elements")
    return block
