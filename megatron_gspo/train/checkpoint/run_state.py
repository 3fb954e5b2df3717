"""The run state a checkpoint holds: ``run_state.json``, and its tensors in ``run_state.safetensors``.

The caller's run state (rank 0's: the step, the sampler's position, RL's next batch or the
``full`` stream's groups) may hold torch tensors anywhere in its dicts and lists: a
``rollout.async: one_step`` run's finished batch (tokens, log-probs, advantages and, with
``gspo.routing_replay: rollout``, its ``routed_experts``, int32 ``[rows, T, layers, top-k]``: about
2 GB at 30B), and the ``full`` stream's samples' routed experts. :func:`write_run_state` writes
them, bit for bit, into ``run_state.safetensors`` beside ``run_state.json``, which holds
``{"__tensor__": key}`` in their place (the key is their path in the state, JSON-pointer
style). The checkpoint's manifest covers the file as it covers every other, so a missing,
truncated or changed file is a ``CheckpointError`` naming it when the checkpoint is verified,
before anything is loaded (``manifest.verify_checkpoint``). :func:`read_run_state` puts the
tensors back; one that ``run_state.json`` refers to and the file (or the manifest) lacks is a
``CheckpointError`` naming the file and the key.

Only global rank 0 reads the tensors (the batch sources live there): the other ranks get the
placeholders, and no rank but 0 reads the file, which at 30B would be 2 GB per rank.

Checkpoints written before this file existed held the one_step batch as base64 safetensors text
inside ``run_state.json`` and the stream's routed experts as nested lists; they still load: the
sources read both forms (``pipeline.sources.saved.restored_batch``,
``pipeline.generation.trajectory.result_from_json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_gspo.train.checkpoint.manifest import CheckpointError

RUN_STATE = "run_state.json"
RUN_TENSORS = "run_state.safetensors"
MARK = "__tensor__"
"""The placeholder's only key: ``{"__tensor__": "<key in run_state.safetensors>"}``."""


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def split_tensors(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` with every tensor replaced by its placeholder, and the tensors by key."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().contiguous()
            return {MARK: path}
        if isinstance(value, dict):
            if MARK in value:
                raise ValueError(f"run state: {path or '/'} has a key {MARK!r} (reserved)")
            return {k: walk(v, f"{path}/{_escape(k)}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
        return value

    return walk(state, prefix), tensors


def join_tensors(state: Any, tensors: dict[str, torch.Tensor], *, source: str) -> Any:
    """:func:`split_tensors` undone: each placeholder replaced by its tensor from ``tensors``
    (read from ``source``, named in the error when a key is not there)."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {MARK}:
                key = value[MARK]
                if key not in tensors:
                    raise CheckpointError(f"{source}: has no tensor {key!r}, which "
                                          f"{RUN_STATE} refers to")
                return tensors[key]
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(state)


def has_placeholders(state: Any) -> bool:
    if isinstance(state, dict):
        return set(state) == {MARK} or any(has_placeholders(v) for v in state.values())
    if isinstance(state, list):
        return any(has_placeholders(v) for v in state)
    return False


def tensor_bytes(state: Any) -> int:
    """The bytes :func:`write_run_state` writes for ``state``'s tensors (the disk-space check)."""
    return sum(t.numel() * t.element_size() for t in split_tensors(state)[1].values())


def write_run_state(directory: Path, step: int, run_state: dict) -> None:
    """``run_state.json`` (``{"step": step, **run_state}`` with placeholders) and, when the state
    holds tensors, ``run_state.safetensors`` (written first; both before the manifest)."""
    state, tensors = split_tensors({"step": step, **run_state})
    if tensors:
        save_file(tensors, str(directory / RUN_TENSORS), metadata={"format": "pt"})
    (directory / RUN_STATE).write_text(json.dumps(state, indent=1))


def read_run_state(path: Path, manifest: dict, *, tensors: bool) -> dict[str, Any]:
    """The run state of checkpoint ``path`` (verified against ``manifest`` already); with
    ``tensors`` its tensors read back into place, else the placeholders left."""
    state_path = path / RUN_STATE
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{state_path}: unreadable ({type(err).__name__}: {err})") from None
    if not tensors or not has_placeholders(state):
        return state
    tensor_path = path / RUN_TENSORS
    if RUN_TENSORS not in manifest.get("files", {}):
        raise CheckpointError(f"{tensor_path}: not in the checkpoint's manifest, but "
                              f"{RUN_STATE} refers to tensors in it")
    try:
        loaded = load_file(str(tensor_path))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{tensor_path}: unreadable ({type(err).__name__}: {err})") from None
    return join_tensors(state, loaded, source=str(tensor_path))
