"""What a rank checkpoints of its own: the sharded state of the model and the optimizer
(Megatron's ``sharded_state_dict``), the bytes it writes, and its RNG states (plain tensors and
numbers, so that loading them needs no pickle: ``weights_only``).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                      is_main_replica)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    bit_generator, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                        "gauss": gauss},
             "numpy": {"bit_generator": bit_generator,
                       "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def module_of(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose state-dict keys carry ``module.``)."""
    return getattr(chunk, "module", chunk)


def sharded_state(model_chunks: list, optimizer, *, is_loading: bool) -> dict:
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        model_sd[key] = module_of(chunk).sharded_state_dict()
    state = dict(model_sd)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def state_bytes(state) -> int:
    """Bytes this rank writes for ``state``: the main replicas of its sharded tensors (and of the
    tensors its factories shard); pickled objects and metadata come on top (small)."""
    total = 0
    todo = [state]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            data = item.data
            if isinstance(data, torch.Tensor) and is_main_replica(item.replica_id):
                total += data.numel() * data.element_size()
    return total
