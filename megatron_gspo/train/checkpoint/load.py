"""Loading a checkpoint (:func:`load_checkpoint`): verified, vetted (no pickle but checkpoint
metadata), and, when it was written under another parallel layout, resharded
(:func:`_load_resharded`: the optimizer's tensors requested under the keys the writer stored them
under, the step count and the param groups' settings carried over).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.optimizer.optimizer import param_group_identifier_keys

from megatron_gspo import mcore_compat
from megatron_gspo.collectives import all_gather
from megatron_gspo.dcp_metadata import UnsafeCheckpointError, check_torch_dist
from megatron_gspo.train.checkpoint.manifest import (CheckpointError, read_manifest, say,
                                                     verified, verify_checkpoint)
from megatron_gspo.train.checkpoint.records import (describe_layout, layout_of, optimizer_refusal,
                                                    resume_refusal)
from megatron_gspo.train.checkpoint.run_state import RUN_STATE, read_run_state
from megatron_gspo.train.checkpoint.state import (is_distributed_optimizer, module_of,
                                                  restore_torch_adam_step, set_rng_state,
                                                  sharded_state)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


_RESHARDED = "optimizer_resharded"
"""Where :func:`_load_resharded` puts this layout's optimizer tensors in the state it loads (a
key of its own: the checkpoint's common state keeps its ``optimizer`` entry, in the writer's
nesting)."""
_CHAINED_PREFIX = re.compile(r"^chained_\d+\.")
"""The prefix ChainedOptimizer puts on its sub-optimizers' tensor keys (the sub-optimizer's
index: which one holds a parameter depends on the layout, e.g. expert weights have their own with
EP > 1)."""


def _sharded_leaves(tree) -> list:
    """The ShardedBase leaves of a nested dict / list, in a fixed order (``_with_leaves``'s)."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _sharded_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _sharded_leaves(value)]
    return [tree] if isinstance(tree, ShardedBase) else []


def _with_leaves(tree, leaves):
    """``tree`` with its ShardedBase leaves replaced by ``next(leaves)`` (in ``_sharded_leaves``'s
    order) and its LocalNonpersistentObjects unwrapped: a plain state dict."""
    if isinstance(tree, dict):
        return {key: _with_leaves(value, leaves) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_leaves(value, leaves) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_with_leaves(value, leaves) for value in tree)
    if isinstance(tree, ShardedBase):
        return next(leaves)
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    return tree


def _optimizer_dicts(tree) -> list[dict]:
    """The torch-style optimizer state dicts (those with ``param_groups``) inside a Megatron
    optimizer's state dict: the dict itself (FP32), its ``optimizer`` entry (mixed precision,
    distributed), one per sub-optimizer of a ChainedOptimizer."""
    if not isinstance(tree, dict):
        return []
    if isinstance(tree.get("param_groups"), list):
        return [tree]
    return [d for value in tree.values() for d in _optimizer_dicts(value)]


def _group_id(group: dict, keys: Sequence[str]) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def _carry_over(current: dict, written: Any) -> None:
    """Into ``current`` (this layout's optimizer state dict): the step count and the param-group
    settings (betas, eps, ...; the LR schedule sets lr and weight decay after the load) of the
    checkpoint's common optimizer state ``written``, whatever its nesting. Param groups match by
    Megatron's identifiers (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); a group whose
    expert-parallel flag has no counterpart (expert weights are a group of their own only with
    EP > 1) takes the settings of the one that matches the rest."""
    ids = param_group_identifier_keys
    written_dicts = _optimizer_dicts(written)
    groups = [g for d in written_dicts for g in d["param_groups"]]
    steps = [d["state"]["common_step"] for d in written_dicts
             if isinstance(d.get("state"), dict) and "common_step" in d["state"]]
    steps += [g["step"] for g in groups if g.get("step") is not None]
    step = steps[0] if steps else None
    loose = [k for k in ids if k != "is_expert_parallel"]
    own = {"params", *ids, *(f"pre_{k}" for k in ids)}  # what this layout's group keeps
    for d in _optimizer_dicts(current):
        for group in d["param_groups"]:
            match = (next((g for g in groups if _group_id(g, ids) == _group_id(group, ids)), None)
                     or next((g for g in groups if _group_id(g, loose) == _group_id(group, loose)),
                             None))
            if match is not None:
                group.update({k: v for k, v in match.items() if k not in own})
            if step is not None and "step" in group:  # the distributed optimizer's place
                number = step.item() if isinstance(step, torch.Tensor) else step
                group["step"] = int(number) if isinstance(group["step"], int) else float(number)
        if step is not None and isinstance(d.get("state"), dict):  # FP32 / mixed precision
            d["state"]["common_step"] = (step.clone() if isinstance(step, torch.Tensor)
                                         else torch.tensor(float(step)))


def _load_resharded(path: Path, state: dict, optimizer, load_kwargs: dict) -> dict:
    """Load ``state`` (this layout's :func:`sharded_state`) from a checkpoint written under
    another layout; the optimizer's state is loaded into ``optimizer`` here, the returned dict
    holds the model chunks' state.

    The optimizer's tensors are this layout's (Megatron's ``sharded_state_dict`` of this
    optimizer: Adam moments, main params, by model parameter); each is requested under the key
    the checkpoint stored it under (the same key but for the sub-optimizer prefix, looked up in
    the checkpoint's tensor metadata). The step count and the param groups' settings come from the
    checkpoint's common state (:func:`_carry_over`), in whatever nesting the writer had."""
    request = {key: value for key, value in state.items() if key != "optimizer"}
    leaves = []
    if optimizer is not None:
        saved = {}
        for key in dist_checkpointing.load_tensors_metadata(str(path / "model_optim")):
            rest = _CHAINED_PREFIX.sub("", key, count=1)
            saved.setdefault(rest, key[: len(key) - len(rest)])
        leaves = _sharded_leaves(state["optimizer"])
        renamed = {}
        for i, leaf in enumerate(leaves):
            rest = _CHAINED_PREFIX.sub("", leaf.key, count=1)
            prefix = saved.get(rest)
            if prefix is None:  # a factory's key: the checkpoint holds what it was built into
                prefix = next((saved[k] for k in saved if k.startswith(rest)), None)
            if prefix is None:
                raise CheckpointError(f"checkpoint {path}: no optimizer state for {rest} (saved "
                                      "without an optimizer, or by another model)")
            renamed[str(i)] = replace(leaf, key=prefix + rest)
        request[_RESHARDED] = renamed
    loaded = dist_checkpointing.load(request, str(path / "model_optim"), **load_kwargs)
    if optimizer is not None:
        tensors = iter(loaded[_RESHARDED][str(i)] for i in range(len(leaves)))
        optimizer_state = _with_leaves(state["optimizer"], tensors)
        _carry_over(optimizer_state, loaded.get("optimizer"))
        with torch.no_grad():  # see load_checkpoint
            optimizer.load_state_dict(optimizer_state)
        restore_torch_adam_step(optimizer)
    return loaded


def _layout_changed(path: Path, manifest: dict, layout: dict, state: dict) -> bool:
    """Whether the checkpoint was written under another layout than ``layout``. Checkpoints
    without a layout record (written before manifests had one): when the world size differs, or
    when any rank's optimizer tensors are missing from the checkpoint under their keys (the
    sub-optimizer nesting differs); collective."""
    written = manifest.get("layout")
    if isinstance(written, dict):
        return written != layout
    if manifest.get("world_size", layout["world_size"]) != layout["world_size"]:
        return True
    if "optimizer" not in state:
        return False

    saved = set(dist_checkpointing.load_tensors_metadata(str(path / "model_optim")))
    missing = any(leaf.key not in saved and not any(k.startswith(leaf.key) for k in saved)
                  for leaf in _sharded_leaves(state["optimizer"]))
    return any(all_gather(missing, None))


def load_checkpoint(path: str | Path, model_chunks: list, optimizer, *,
                    restore_rng: bool = True, scheduler=None,
                    model_config=None) -> dict[str, Any]:
    """Collective: load model, optimizer, this rank's RNG and (given ``scheduler``) the LR
    schedule's position; returns the run state (with step).

    The checkpoint is verified first (:func:`verify_checkpoint`); a damaged or partial one is a
    :class:`CheckpointError` naming the file, as is a missing RNG file of this rank when
    ``restore_rng`` under the layout that wrote it (the resume would not be exact).
    ``model_config`` (this run's ModelConfig): a checkpoint of another model is a
    :class:`CheckpointError` naming the fields (:func:`resume_refusal`). A checkpoint written
    under another parallel layout is resharded (the module docstring); the RNG states then start
    fresh, said in one line."""
    path = Path(path)
    # Every rank passes the same path, so every rank takes the same branch (verification is
    # collective).
    problems = [] if verified(path) else verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:10]))
    manifest = read_manifest(path)
    if RUN_STATE not in manifest["files"]:
        raise CheckpointError(f"{path}: not a training checkpoint (no {RUN_STATE})")
    layout = layout_of(model_chunks)
    if model_config is not None:
        refusal = resume_refusal(path, manifest, model_config, layout["tensor"])
        if refusal is not None:
            raise CheckpointError(refusal)
    if optimizer is not None:
        refusal = optimizer_refusal(path, manifest, is_distributed_optimizer(optimizer), layout)
        if refusal is not None:
            raise CheckpointError(refusal)
    scheduler_path = path / "scheduler.json"
    if scheduler is not None and "scheduler.json" not in manifest["files"]:
        raise CheckpointError(f"{scheduler_path}: missing; this checkpoint has no LR schedule "
                              "state to resume from")
    # Megatron unpickles .metadata and the byte items without restriction: vet them first
    # (allow-listed metadata classes, weights_only byte items); a refusal names the file
    try:
        check_torch_dist(path / "model_optim")
    except (UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(f"checkpoint {path} refused: {err}") from None
    state = sharded_state(model_chunks, optimizer, is_loading=True)
    resharding = _layout_changed(path, manifest, layout, state)
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if restore_rng and not resharding and rank_file.name not in manifest["files"]:
        raise CheckpointError(
            f"{rank_file}: missing: the checkpoint holds the RNG states of "
            f"{manifest.get('world_size', '?')} ranks and this run has {dist.get_world_size()}; "
            "without this rank's states the resumed run would not draw the random numbers the "
            "uninterrupted run would have")
    if resharding:
        say(f"resume: {path.name} (step {manifest.get('step', '?')}) was written under layout "
             f"{describe_layout(manifest.get('layout'), manifest.get('world_size', '?'))}; "
             f"resuming it under layout {describe_layout(layout)}: model and optimizer state "
             "resharded, the RNG streams start fresh (per-rank states do not map to another "
             "layout; dropout is 0 and the data position is in run_state.json)")
    stack = manifest.get("stack")  # absent in checkpoints of earlier versions of this project
    written_by = stack.get("megatron_core") if isinstance(stack, dict) else None
    running = mcore_compat.stack()["megatron_core"]
    load_kwargs = mcore_compat.dist_load_kwargs(path / "model_optim")
    try:
        if resharding:
            loaded = _load_resharded(path, state, optimizer, load_kwargs)
        else:
            loaded = dist_checkpointing.load(state, str(path / "model_optim"), **load_kwargs)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with both versions when they differ
        if written_by is None or written_by == running:
            raise
        raise CheckpointError(
            f"checkpoint {path} was written with megatron-core {written_by} and does not load "
            f"with megatron-core {running} ({type(err).__name__}: {str(err)[:300]}); resume it "
            f"on the stack that wrote it (megatron_gspo/mcore_compat.py)") from err
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        module_of(chunk).load_state_dict(loaded[key], strict=True)
    if optimizer is not None and not resharding:
        # no autograd: with float32 parameters the distributed optimizer's main parameters are
        # views of the model's (leaves that require grad), which Megatron's
        # load_parameter_state_from_dp_reshardable copies into in place
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        restore_torch_adam_step(optimizer)
    if scheduler is not None:
        # After the optimizer (whose state restores the param groups' old lr): the scheduler then
        # sets the lr of the restored position. Megatron's load ADDS the saved step count to the
        # current one, so the position is reset first: loading replaces it.
        scheduler.num_steps = 0
        scheduler.load_state_dict(_read_json(scheduler_path))
    if restore_rng and not resharding:
        try:
            rng = torch.load(rank_file, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the file matched its checksum: a format issue
            raise CheckpointError(f"{rank_file}: unreadable RNG states ({type(err).__name__}: "
                                  f"{err})") from None
        set_rng_state(rng)
    return read_run_state(path, manifest, tensors=dist.get_rank() == 0)
