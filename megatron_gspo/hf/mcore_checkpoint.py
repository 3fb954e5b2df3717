"""Megatron ``torch_dist`` checkpoints of the Qwen3-MoE policy: keys, streaming write, region read.

A ``torch_dist`` checkpoint (what ``megatron.core.dist_checkpointing.save`` writes) is a PyTorch
Distributed Checkpoint (DCP) directory plus two Megatron files::

    .metadata        pickled DCP Metadata: per key the GLOBAL shape, dtype and stored chunks
    __0_0.distcp     stored chunks (torch.save'd tensors), byte ranges listed in .metadata
    common.pt        Megatron's non-sharded state ({} for a model)
    metadata.json    {"sharded_backend": "torch_dist", ...}; written last, marks completeness

Keys are Megatron's *sharded* keys (``gpt.sharded_state_dict()``), which describe global tensors,
so the same checkpoint loads under any TP / PP / EP / ETP layout (DCP reads the overlap of every
stored chunk with every rank's shard). In megatron-core 0.16 the decoder keys are stacked over
layers (a leading layer axis), experts over a second axis, and the expert ``linear_fc1`` is stored
as ``[gate; up]`` of the full intermediate size whatever the TP degree (``apply_swiglu_sharded_factory``).

Keys by layer spec (checked against ``gpt.sharded_state_dict()`` under several layouts in
``tests/distributed/test_convert.py``; TE-spec keys read from megatron-core 0.16.1 sources:
``gpt_layer_specs.get_gpt_layer_local_spec`` / ``..._with_transformer_engine_spec``,
``experts.TEGroupedMLP.sharded_state_dict``, ``extensions.transformer_engine.TEGroupedLinear``):

============================================  ============================  =======================
tensor                                        local spec (CPU)              TE spec (GPU)
============================================  ============================  =======================
input RMSNorm [L, H]                          decoder.layers.self_attention.linear_qkv.layer_norm_weight (both)
pre-MLP RMSNorm [L, H]                        decoder.layers.mlp.linear_fc1.layer_norm_weight   decoder.layers.pre_mlp_layernorm.weight
experts fc1 [L, E, 2I, H] / fc2 [L, E, H, I]  decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight (both)
============================================  ============================  =======================

The one difference, the pre-MLP norm, is met twice: the converter writes the tensor under both
keys, so ``dist_checkpointing.load(gpt.sharded_state_dict(), dir)`` works with either spec, and
:func:`load_model` renames a missing key to its alias present in the checkpoint, so a checkpoint
that the trainer saved with one spec loads with the other. The linears' ``_extra_state`` objects
(FP8 metadata under TE, ``None`` in the local spec) are written as ``None`` for the local spec's
keys; :func:`load_model` leaves out any ``_extra_state`` the checkpoint does not have.

Memory: :func:`write_checkpoint` hands DCP one chunk at a time (a layer of a dense tensor, the
gate or up half of one expert's fc1, one expert's fc2, a block of vocabulary rows) through a
planner whose ``resolve_data`` builds the chunk on demand; :class:`McoreCheckpoint` reads any
region (one layer, one expert, a block of rows) and only the stored chunks that overlap it. Where
a chunk is one contiguous byte range of its source (most bytes: the experts), it is passed on as
a read-only memory map of that range rather than copied, so each byte is copied once, by the
write, as ``cp`` does.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import mmap
import os
import pickle
import shutil
import struct
import threading
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.utils.serialization import config as serialization_config

from megatron_gspo import mcore_compat
from megatron_gspo.config import ModelConfig
from megatron_gspo.dcp_metadata import SafeFileSystemReader, UnsafeCheckpointError
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.megatron_layout import HF_CONFIG_DIR
from megatron_gspo.hf.safetensors_io import CheckpointError

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
# The same tensor under the other layer spec's key (both directions).
KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": ("decoder.layers.pre_mlp_layernorm.weight",),
    "decoder.layers.pre_mlp_layernorm.weight": ("decoder.layers.mlp.linear_fc1.layer_norm_weight",),
}


@dataclass(frozen=True)
class Entry:
    """One checkpoint tensor: its sharded key and the Megatron parameter it stores.

    ``param`` is the local-spec parameter name at TP = EP = PP = 1 with ``{layer}`` / ``{expert}``
    placeholders, ``shape`` that parameter's shape; the global shape prepends the layer axis
    (``per_layer``) and the expert axis (``per_expert``).
    """

    key: str
    param: str
    shape: tuple[int, ...]
    per_layer: bool = False
    per_expert: bool = False
    is_vocab: bool = False
    aliases: tuple[str, ...] = ()
    row_splits: int = 1
    """Store each layer / expert as this many equal row blocks (expert fc1: 2, gate and up, as
    Megatron's own save stores it; each block is one contiguous range of the HF file)."""

    def global_shape(self, model: ModelConfig) -> tuple[int, ...]:
        return ((model.num_layers,) if self.per_layer else ()) + (
            (model.num_experts,) if self.per_expert else ()) + self.shape

    @property
    def num_lead(self) -> int:
        return int(self.per_layer) + int(self.per_expert)


def checkpoint_entries(model: ModelConfig, padded_vocab: int) -> list[Entry]:
    """Every tensor of the policy's checkpoint, in a stable order (embedding, layers, head)."""
    H, d, E, I = model.hidden_size, model.head_dim, model.num_experts, model.moe_ffn_hidden_size
    n_h, n_g = model.num_attention_heads, model.num_query_groups

    def layer(key: str, param: str, shape: tuple, **kw) -> Entry:
        return Entry(f"decoder.layers.{key}", f"decoder.layers.{{layer}}.{param}", shape,
                     per_layer=True, **kw)

    entries = [
        Entry("embedding.word_embeddings.weight", "embedding.word_embeddings.weight",
              (padded_vocab, H), is_vocab=True),
        layer("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", (H,)),
        layer("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight",
              ((n_h + 2 * n_g) * d, H)),
        layer("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight", (d,)),
        layer("self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight", (d,)),
        layer("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", (H, n_h * d)),
        layer("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight", (H,),
              aliases=KEY_ALIASES["decoder.layers.mlp.linear_fc1.layer_norm_weight"]),
        layer("mlp.router.weight", "mlp.router.weight", (E, H)),
        layer("mlp.experts.experts.linear_fc1.weight",
              "mlp.experts.local_experts.{expert}.linear_fc1.weight", (2 * I, H), per_expert=True,
              row_splits=2),
        layer("mlp.experts.experts.linear_fc2.weight",
              "mlp.experts.local_experts.{expert}.linear_fc2.weight", (H, I), per_expert=True),
        Entry("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", (H,)),
    ]
    if not model.tie_word_embeddings:
        entries.append(Entry("output_layer.weight", "output_layer.weight", (padded_vocab, H),
                             is_vocab=True))
    return entries


TE_NORMS = ("decoder.layers.self_attention.q_layernorm", "decoder.layers.self_attention.k_layernorm",
            "decoder.layers.pre_mlp_layernorm", "decoder.final_layernorm")
"""The norms that are Transformer Engine modules (``TENorm``, whose ``_extra_state`` Megatron
stores) under the TE layer spec only; the local spec's are torch norms without extra state. The
TE spec's linears have the same ``_extra_state`` keys as the local spec's. Checked against the TE
spec megatron-core builds in tests/unit/test_te_spec_extra_state.py."""


def te_norm_extra_state_keys(model: ModelConfig) -> list[str]:
    """Unique keys of the TE spec's norm ``_extra_state`` objects (:data:`TE_NORMS`): per layer on
    the layer axis, ``shard_{layer}_{L}``; the final norm's one object ``shard_0_1``."""
    L = model.num_layers
    keys = []
    for module in TE_NORMS:
        if module.startswith("decoder.layers."):
            keys += [f"{module}._extra_state/shard_{layer}_{L}" for layer in range(L)]
        else:
            keys.append(f"{module}._extra_state/shard_0_1")
    return keys


def extra_state_keys(model: ModelConfig) -> list[str]:
    """Unique keys of every ``_extra_state`` sharded object either layer spec asks for (layout
    independent: the object grid is the layer axis, and layer x expert for experts): the linears'
    (both specs) and the TE spec's norms (:func:`te_norm_extra_state_keys`). Each is stored as
    None, as Megatron's local spec stores its own; Megatron-LM and Bridge load with a strictness
    under which a missing object is an error, and TE takes None as "no FP8 metadata"."""
    L, E = model.num_layers, model.num_experts
    keys = te_norm_extra_state_keys(model)
    for layer in range(L):
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj"):
            keys.append(f"decoder.layers.{module}._extra_state/shard_{layer}_{L}")
        for expert in range(E):
            for fc in (1, 2):
                keys.append(f"decoder.layers.mlp.experts.experts.linear_fc{fc}._extra_state/"
                            f"shard_{layer}.{expert}_{L}.{E}")
    return keys


@dataclass(frozen=True)
class Chunk:
    """One stored piece of an entry: a layer (and expert) of it, or a block of vocabulary rows."""

    entry: Entry
    layer: Optional[int] = None
    expert: Optional[int] = None
    rows: Optional[tuple[int, int]] = None  # row block of the entry's parameter (vocab entries)

    @property
    def param_name(self) -> str:
        return self.entry.param.format(layer=self.layer, expert=self.expert)

    @property
    def param_shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the chunk's data without the leading layer / expert axes."""
        if self.rows is None:
            return self.entry.shape
        return (self.rows[1] - self.rows[0], *self.entry.shape[1:])

    @property
    def offsets(self) -> tuple[int, ...]:
        lead = tuple(i for i in (self.layer, self.expert) if i is not None)
        rest = [0] * len(self.entry.shape)
        if self.rows is not None:
            rest[0] = self.rows[0]
        return lead + tuple(rest)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (1,) * self.entry.num_lead + self.local_shape


def layer_chunks(entry: Entry, layer: Optional[int] = None, expert: Optional[int] = None
                 ) -> list[Chunk]:
    """The chunks of one layer (and expert) of a non-vocabulary entry: ``row_splits`` row blocks."""
    if entry.row_splits == 1:
        return [Chunk(entry, layer=layer, expert=expert)]
    block = entry.shape[0] // entry.row_splits
    return [Chunk(entry, layer=layer, expert=expert, rows=(start, start + block))
            for start in range(0, entry.shape[0], block)]


def iter_chunks(entry: Entry, model: ModelConfig, *, vocab_block_rows: int,
                rows_limit: Optional[int] = None) -> Iterable[Chunk]:
    """The chunks of ``entry``: per layer, per (layer, expert), or vocabulary row blocks up to
    ``rows_limit`` (default: all padded rows)."""
    if entry.is_vocab:
        total = entry.shape[0] if rows_limit is None else rows_limit
        for start in range(0, total, vocab_block_rows):
            yield Chunk(entry, rows=(start, min(start + vocab_block_rows, total)))
    elif entry.per_expert:
        for layer in range(model.num_layers):
            for expert in range(model.num_experts):
                yield from layer_chunks(entry, layer, expert)
    elif entry.per_layer:
        for layer in range(model.num_layers):
            yield from layer_chunks(entry, layer)
    else:
        yield from layer_chunks(entry)


# ----------------------------------------------------------------------------------------------
# Writing


@dataclass
class TensorWrite:
    """One chunk to write: the global tensor's key, shape and dtype, where the chunk sits, and a
    function that builds the chunk's data (called once, when DCP writes it)."""

    key: str
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


class _StreamingSavePlanner(SavePlanner):
    """A DCP SavePlanner whose data is produced on demand, one write item at a time.

    DCP's FileSystemWriter asks ``resolve_data`` for each item just before writing it (serially
    with one writer thread), so at most one chunk (per writer thread) is in memory. The global
    plan is built with DCP's own ``create_default_global_save_plan``; DCP's overlap validation
    (quadratic in the number of chunks of a key: L x E chunks per expert key) is replaced by
    :func:`_check_tiling`, which the chunk construction makes linear.
    """

    def __init__(self, tensors: Sequence[TensorWrite], objects: dict[str, bytes],
                 on_written: Optional[Callable[[int], None]] = None):
        self._producers: dict = {}
        self._objects = objects
        self._on_written = on_written
        items = []
        for key, data in objects.items():
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        for t in tensors:
            index = MetadataIndex(t.key, torch.Size(t.offsets))
            if index in self._producers:
                raise ValueError(f"{t.key}: two chunks at offsets {t.offsets}")
            self._producers[index] = t
            items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(t.offsets), sizes=torch.Size(t.sizes)),
                    properties=TensorProperties(dtype=t.dtype), size=torch.Size(t.global_shape))))
        self._items = items

    # SavePlanner interface (torch.distributed.checkpoint.planner.SavePlanner)
    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        return SavePlan(self._items)

    def create_global_plan(self, all_plans):
        global_plans, metadata = create_default_global_save_plan(all_plans)
        _check_tiling(metadata)
        return global_plans, metadata

    def finish_plan(self, new_plan):
        return new_plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        spec = self._producers[write_item.index]
        data = spec.produce()
        if tuple(data.shape) != tuple(spec.sizes) or data.dtype != spec.dtype:
            raise AssertionError(f"{spec.key} at {spec.offsets}: produced {tuple(data.shape)} "
                                 f"{data.dtype}, planned {spec.sizes} {spec.dtype}")
        if self._on_written is not None:
            self._on_written(data.numel() * data.element_size())
        return data.contiguous()


def _check_tiling(metadata) -> None:
    """Every tensor's chunks lie inside it, do not repeat, and their volumes add up to it."""
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        seen = set()
        volume = 0
        for chunk in md.chunks:
            if any(o < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, md.size)):
                raise AssertionError(f"{key}: chunk {chunk} outside {tuple(md.size)}")
            seen.add(tuple(chunk.offsets))
            volume += math.prod(chunk.sizes)
        if len(seen) != len(md.chunks) or volume != math.prod(md.size):
            raise AssertionError(f"{key}: chunks do not tile {tuple(md.size)}")


def none_object_bytes() -> bytes:
    """A ``ShardedObject`` holding None, serialised as Megatron's torch_dist strategy does."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


def write_checkpoint(out_dir: str | os.PathLike, tensors: Sequence[TensorWrite],
                     objects: dict[str, bytes], *, thread_count: int = 1, sync_files: bool = True,
                     on_written: Optional[Callable[[int], None]] = None,
                     common: Optional[dict] = None) -> None:
    """Write a Megatron torch_dist checkpoint from chunk producers (metadata.json last);
    ``common``: its common (non-sharded) state, in ``common.pt`` (both megatron-core versions
    read it; default ``{}``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # per_thread_copy_ahead=0: DCP resolves (produces) each chunk only after the previous one of
    # the same writer thread is written, also on a CUDA machine (where it would otherwise resolve
    # chunks ahead); producers may therefore reuse one output buffer per thread.
    writer = dcp.FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=thread_count,
                                  sync_files=sync_files, per_thread_copy_ahead=0)
    planner = _StreamingSavePlanner(tensors, objects, on_written)
    # torch.save computes a CRC32 of every record, which halves its write speed, and torch.load
    # never verifies it (a corrupted record loads silently either way): skip it while we write.

    compute_crc32 = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        serialization_config.save.compute_crc32 = compute_crc32
    torch.save(dict(common or {}), out_dir / "common.pt")
    (out_dir / "metadata.json").write_text(json.dumps(METADATA_JSON))


# ----------------------------------------------------------------------------------------------
# Reading


class _RegionLoadPlanner(LoadPlanner):
    """A DCP LoadPlanner that fills caller-owned tensors with regions of stored global tensors."""

    def __init__(self, requests: list[tuple[str, tuple, torch.Tensor]], chunk_index):
        self.requests = requests
        self.chunk_index = chunk_index

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self):
        items = []
        self.covered = [0] * len(self.requests)
        for i, (key, offsets, out) in enumerate(self.requests):
            local = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=out.shape)
            for item in create_read_items_for_chunk_list(key, self.chunk_index(key, offsets),
                                                         [local]):
                # dest_index.index is the position of the local chunk: point it at the request
                items.append(_with_dest(item, i))
                self.covered[i] += int(torch.Size(item.lengths).numel())
        return LoadPlan(items)

    def create_global_plan(self, plans):
        return plans

    def finish_plan(self, plan):
        return plan

    def load_bytes(self, read_item, value) -> None:  # pragma: no cover - tensors only
        raise AssertionError("region reads are for tensors")

    def resolve_tensor(self, read_item):
        out = self.requests[read_item.dest_index.index][2]
        return narrow_tensor_by_index(out, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        pass


def _with_dest(item, request_index: int):
    return dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index,
                                                                    index=request_index))


class McoreCheckpoint:
    """A torch_dist checkpoint opened for reading regions of its global tensors (``directory``:
    any layout :func:`megatron_layout.resolve` reads; ``self.directory`` is the torch_dist one).

    ``ckpt.read([(key, offsets, shape), ...])`` returns new tensors (stored dtype). Opening checks
    metadata.json, .metadata and that every data file it references exists and is long enough.
    """

    def __init__(self, directory: str | os.PathLike):
        # a Megatron-LM / Bridge root, an iteration directory or the flat layout
        self.directory = megatron_layout.resolve(directory)
        marker = self.directory / "metadata.json"
        if not marker.is_file():
            raise CheckpointError(f"{self.directory}: not a Megatron distributed checkpoint "
                                  "(no metadata.json; an interrupted save or conversion?)")
        try:
            backend = json.loads(marker.read_text()).get("sharded_backend")
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{marker}: not valid JSON: {err}") from None
        if backend != "torch_dist":
            raise CheckpointError(f"{marker}: sharded_backend {backend!r}, only 'torch_dist' is supported")
        if not (self.directory / ".metadata").is_file():
            raise CheckpointError(f"{self.directory}/.metadata: not found (incomplete checkpoint)")
        # torch's reader unpickles .metadata without restriction; this one resolves only the
        # classes checkpoint metadata is made of (megatron_gspo.dcp_metadata)
        self.reader = SafeFileSystemReader(self.directory)
        try:
            self.metadata = self.reader.read_metadata()
        except UnsafeCheckpointError as err:
            raise CheckpointError(str(err)) from None
        except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
            raise CheckpointError(f"{self.directory}/.metadata: unreadable ({err})") from None
        self._check_files()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.tensors = {k: md for k, md in self.metadata.state_dict_metadata.items()
                        if isinstance(md, TensorStorageMetadata)}
        self._chunks_by_lead: dict[str, dict[tuple, list]] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _check_files(self) -> None:
        needed: dict[str, int] = {}
        for info in (self.metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        problems = []
        for name, size in sorted(needed.items()):
            path = self.directory / name
            if not path.is_file():
                problems.append(f"{name}: missing")
            elif path.stat().st_size < size:
                problems.append(f"{name}: truncated ({path.stat().st_size} bytes, needs {size})")
        if problems:
            raise CheckpointError(f"{self.directory}: damaged checkpoint: " + "; ".join(problems))

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def present(self, key: str) -> Optional[str]:
        """``key`` or the first of its aliases that the checkpoint holds (None if neither)."""
        for candidate in (key, *KEY_ALIASES.get(key, ())):
            if candidate in self.tensors:
                return candidate
        return None

    def _storage_for(self, key: str, offsets: tuple):
        """The key's metadata restricted to chunks that can overlap a region starting at
        ``offsets`` (stored chunks of one layer / expert are indexed by their leading offsets, so
        a per-expert read does not scan all L x E chunks)."""
        md = self.tensors[key]
        index = self._chunks_by_lead.get(key)
        if index is None:
            index = {}
            for chunk in md.chunks:
                lead = tuple(o for o, s in zip(chunk.offsets[:2], chunk.sizes[:2]) if s == 1)
                # chunks whose two leading sizes are not both 1 go to the catch-all bucket
                bucket = tuple(chunk.offsets[:2]) if len(lead) == 2 and len(md.size) > 2 else None
                index.setdefault(bucket, []).append(chunk)
            self._chunks_by_lead[key] = index
        if set(index) == {None}:
            return md
        chunks = index.get(tuple(offsets[:2]), []) + index.get(None, [])
        return dataclasses.replace(md, chunks=chunks)

    def _handle(self, relative_path: str) -> int:
        fd = self._fds.get(relative_path)
        if fd is None:
            with self._lock:  # the export's reader thread and the caller may both ask
                fd = self._fds.get(relative_path)
                if fd is None:
                    fd = self._fds[relative_path] = os.open(self.directory / relative_path, os.O_RDONLY)
        return fd

    def _load_stored(self, index, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
        """One stored chunk (a torch.save'd tensor inside a data file): mapped in place when it is
        a plain contiguous tensor of the expected shape and dtype, else read with torch.load."""
        info = self.metadata.storage_data[index]
        fd = self._handle(info.relative_path)
        mapped = _map_saved_tensor(fd, info.offset, info.length, tuple(sizes), dtype)
        if mapped is not None:
            return mapped
        return torch.load(_FileSlice(fd, info.offset, info.length), map_location="cpu",
                          weights_only=True)

    def read(self, requests: Sequence[tuple[str, tuple, tuple]]) -> list[torch.Tensor]:
        """Read regions ``(key, offsets, shape)`` of stored global tensors into new tensors.

        A region that is exactly one stored chunk (the common case: we read by the chunks we
        write) is returned as loaded, without a copy; otherwise the overlaps of the stored chunks
        are copied into place (DCP's resharding arithmetic, ``create_read_items_for_chunk_list``).
        """
        outs = []
        for key, offsets, shape in requests:
            if key not in self.tensors:
                raise CheckpointError(f"{self.directory}: no tensor {key}")
            shape = torch.Size(shape)
            md = self._storage_for(key, offsets)
            items = create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=shape)])
            if sum(torch.Size(item.lengths).numel() for item in items) != shape.numel():
                raise CheckpointError(f"{self.directory}: {key} region at {tuple(offsets)} of shape "
                                      f"{tuple(shape)} is not fully stored")
            if any(self.metadata.storage_data[i.storage_index].transform_descriptors for i in items):
                outs.append(self._read_with_dcp(key, offsets, shape))
                continue
            if len(items) == 1 and tuple(md.chunks[items[0].storage_index.index].sizes) == tuple(shape):
                stored = self._load_stored(items[0].storage_index, shape, self.dtype(key))
                if stored.shape == shape and stored.dtype == self.dtype(key):
                    outs.append(stored)
                    continue
            out = torch.empty(shape, dtype=self.dtype(key))
            for item in items:
                sizes = md.chunks[item.storage_index.index].sizes
                stored = self._load_stored(item.storage_index, sizes, self.dtype(key))
                narrow_tensor_by_index(out, item.dest_offsets, item.lengths).copy_(
                    narrow_tensor_by_index(stored, item.storage_offsets, item.lengths))
            outs.append(out)
        return outs

    def _read_with_dcp(self, key: str, offsets: tuple, shape: torch.Size) -> torch.Tensor:
        """The general path through DCP's reader (stored chunks with storage transforms)."""
        out = torch.empty(shape, dtype=self.dtype(key))
        planner = _RegionLoadPlanner([(key, offsets, out)], self._storage_for)
        planner.set_up_planner({}, self.metadata, True)
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        plan = self.reader.prepare_global_plan([plan])[0]
        self.reader.read_data(plan, planner).wait()
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "McoreCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_STORAGE_DTYPES = {"BFloat16Storage": torch.bfloat16, "FloatStorage": torch.float32,
                   "HalfStorage": torch.float16, "DoubleStorage": torch.float64}


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads a torch.save'd tensor's ``data.pkl`` without touching its data: returns
    ``(persistent storage id, storage_offset, size, stride)``; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid  # ("storage", dtype, key, location, numel)


def _map_saved_tensor(fd: int, offset: int, length: int, sizes: tuple, dtype: torch.dtype
                      ) -> Optional[torch.Tensor]:
    """A read-only memory map of the data of a torch.save'd tensor stored at [offset, offset +
    length) of ``fd``, when it is a plain contiguous tensor of ``sizes`` and ``dtype`` (else None).

    torch.save writes a zip archive whose data record is stored uncompressed; DCP data files are
    such archives back to back. Mapping the record (instead of torch.load into a new tensor) leaves
    the export one copy per byte, the write, as cp. Any surprise in the archive returns None, and
    the caller falls back to torch.load.
    """
    def record_start(record: zipfile.ZipInfo) -> int:
        # the record's bytes follow its local header (30 bytes, then name and extra field);
        # read directly, since torch.save may leave the CRC-32 fields zero (see write_checkpoint)
        header = os.pread(fd, 30, offset + record.header_offset)
        if header[:4] != b"PK\x03\x04" or record.compress_type != zipfile.ZIP_STORED:
            raise ValueError("not a stored zip record")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        return offset + record.header_offset + 30 + name_length + extra_length

    try:
        with zipfile.ZipFile(_FileSlice(fd, offset, length)) as archive:
            pickled = archive.getinfo(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
            meta = os.pread(fd, pickled.file_size, record_start(pickled))
            storage, storage_offset, size, stride = _TensorRecordUnpickler(io.BytesIO(meta)).load()
            _, storage_dtype, key, _, numel = storage
            record = archive.getinfo(f"{pickled.filename[:-len('data.pkl')]}data/{key}")
        contiguous = tuple(math.prod(size[i + 1:]) for i in range(len(size)))
        if (storage_dtype != dtype or size != tuple(sizes) or stride != contiguous
                or record.file_size != numel * dtype.itemsize
                or storage_offset + math.prod(size) > numel):
            return None
        start = record_start(record) + storage_offset * dtype.itemsize
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError,
            TypeError, struct.error, EOFError):
        return None
    nbytes = math.prod(size) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(size, dtype=dtype)
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, nbytes + start - aligned, flags=mmap.MAP_SHARED |
                        getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ, offset=aligned)
    with warnings.catch_warnings():  # "The given buffer is not writable": read-only by design
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize,
                                offset=start - aligned)
    return flat.view(size)


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + length) of an open file descriptor,
    read with ``os.preadv`` (no shared file position, so views of one file can be used from
    several threads)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self._fd, self._offset, self._length, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        size = max(0, min(len(view), self._length - self._pos))
        done = 0
        while done < size:
            n = os.preadv(self._fd, [view[done:size]], self._offset + self._pos + done)
            if n == 0:
                raise CheckpointError("checkpoint data file is shorter than its metadata says")
            done += n
        self._pos += done
        return done


# ----------------------------------------------------------------------------------------------
# The trainer's side: load and save a policy model chunk


def load_model(gpt, ckpt_dir: str | os.PathLike, *, strict: bool = True) -> None:
    """Load a torch_dist checkpoint into this rank's model chunk (any layout, either layer spec).

    ``ckpt_dir``: any layout :func:`megatron_layout.resolve` reads (a Megatron-LM / Bridge root,
    an iteration directory, the flat layout), written by either supported megatron-core version
    (0.19 keeps the common state inside the DCP files: ``mcore_compat.dist_load_kwargs``). Keys
    missing from the checkpoint are renamed to their :data:`KEY_ALIASES` alias when the checkpoint
    has it, and ``_extra_state`` objects the checkpoint lacks are left out (set to None). The
    checkpoint's common state (``iteration``, ``checkpoint_version``, ``args``, ...) is not the
    model's and is left out of the model's state.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    while hasattr(gpt, "module"):
        gpt = gpt.module
    ckpt_dir = megatron_layout.resolve(ckpt_dir)
    ckpt = McoreCheckpoint(ckpt_dir)
    stored = set(ckpt.metadata.state_dict_metadata)
    sharded = gpt.sharded_state_dict()
    absent_extra = []
    for name, value in list(sharded.items()):
        if isinstance(value, ShardedObject):
            if value.unique_key not in stored and name.endswith("_extra_state"):
                absent_extra.append(name)
                del sharded[name]
        elif getattr(value, "key", None) is not None and value.key not in stored:
            alias = ckpt.present(value.key)
            if alias is not None:
                value.key = alias
    state = dist_checkpointing.load(sharded, str(ckpt_dir), **mcore_compat.dist_load_kwargs(ckpt_dir))
    state = {name: value for name, value in state.items() if name in sharded}
    for name in absent_extra:
        state[name] = None
    gpt.load_state_dict(state, strict=strict)


def save_model(gpt, ckpt_dir: str | os.PathLike, *, hf_config_dir: Optional[str | os.PathLike] = None,
               model: Optional[ModelConfig] = None, iteration: int = 0) -> Path:
    """Save this rank's model chunk with Megatron's dist_checkpointing (collective over all ranks)
    in the layout Megatron-LM and Bridge load (:mod:`megatron_gspo.hf.megatron_layout`):
    ``ckpt_dir/iter_%07d/`` with the common state Megatron-LM reads and the TE spec's norm
    ``_extra_state`` objects (None) the local spec does not have, then the tracker file. Rank 0
    copies config.json and the tokenizer files from ``hf_config_dir`` into ``hf_config/`` and,
    given ``model``, writes Bridge's ``run_config.yaml``. Returns the iteration directory."""
    from megatron.core import dist_checkpointing

    while hasattr(gpt, "module"):
        gpt = gpt.module
    root = Path(ckpt_dir)
    ckpt_dir = root / megatron_layout.iteration_dir_name(iteration)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = gpt.sharded_state_dict()
    state.update(_te_norm_objects(state))
    state.update(megatron_layout.common_state(iteration))
    dist_checkpointing.save(state, str(ckpt_dir))
    if dist.get_rank() == 0:
        if hf_config_dir is not None:
            copy_hf_files(Path(hf_config_dir), ckpt_dir / HF_CONFIG_DIR)
        if model is not None:
            bf16 = any(p.dtype == torch.bfloat16 for p in gpt.parameters())
            recorded = ckpt_dir / HF_CONFIG_DIR if hf_config_dir is not None else None
            megatron_layout.write_run_config(ckpt_dir, megatron_layout.run_config(
                model, bf16=bf16, hf_config_dir=recorded))
        megatron_layout.write_tracker(root, iteration)
    dist.barrier()
    return ckpt_dir


def _te_norm_objects(state: dict) -> dict:
    """None ``_extra_state`` objects for the TE spec's norms (:data:`TE_NORMS`) that ``state`` (a
    model chunk's sharded state dict) lacks: each takes the layer offset and replica id of a
    sharded entry of the same layer (the attention's ``linear_qkv`` extra state; the final norm's
    weight), so exactly one rank writes each, as Megatron's own objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for name, value in state.items():
        if isinstance(value, ShardedObject) and value.key == (
                "decoder.layers.self_attention.linear_qkv._extra_state"):
            for module in TE_NORMS[:3]:
                key = f"{module}._extra_state"
                local = name.replace("self_attention.linear_qkv._extra_state",
                                     key.removeprefix("decoder.layers."))
                if local not in state:
                    out[local] = ShardedObject(key, None, value.global_shape, value.global_offset,
                                               replica_id=value.replica_id)
        elif name == "decoder.final_layernorm.weight" and (
                "decoder.final_layernorm._extra_state" not in state):
            out["decoder.final_layernorm._extra_state"] = ShardedObject(
                "decoder.final_layernorm._extra_state", None, (1,), (0,), replica_id=value.replica_id)
    return out


HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                 "tokenizer.model", "chat_template.jinja", "chat_template.json")
"""Files besides the weights that a Hugging Face model directory carries along."""


def copy_hf_files(source: Path, target: Path, names: Iterable[str] = HF_SIDE_FILES) -> list[str]:
    """Copy the side files present in ``source`` to ``target``; returns the names copied."""
    target.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
            copied.append(name)
    return copied
