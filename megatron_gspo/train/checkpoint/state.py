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
from megatron.core.optimizer import distrib_optimizer
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


DISTRIBUTED_OPTIMIZER_SHARDING = "dp_reshardable"
"""How Megatron's distributed optimizer lays out its state in a checkpoint
(``metadata["distrib_optim_sharding_type"]`` of ``DistributedOptimizer.sharded_state_dict``;
other optimizers ignore it).

Megatron's default, ``fully_sharded_model_space``, cannot be saved at all: it builds
ShardedTensors with a ``flattened_range``, which ``ShardedTensor.validate_metadata_integrity``
refuses ("ShardedTensor.flattened_range is not supported"; megatron-core 0.16.1 and 0.19.2,
``dist_checkpointing/mapping.py``). ``fully_reshardable`` does not load into torch's Adam (the
optimizer without Apex or Transformer Engine): ``_set_main_param_and_optimizer_states`` asks
the checkpoint for Adam's ``step`` tensor, which that format leaves out (``KeyError: 'step'``, both
versions); it also all-gathers the unsharded optimizer state of the data-parallel group at each
save. ``dp_reshardable`` is Megatron-LM's default: every rank writes its own flat shards, no
exchange, and it loads on both optimizers; the price is that it follows the optimizer's
internal buffers, so such a checkpoint resumes only under the layout that wrote it
(``records.optimizer_refusal``)."""


def _prime_fresh_torch_adam(optimizer) -> None:
    """Megatron's ``DistributedOptimizer.state_dict()`` with torch's Adam reads the step count
    from every parameter's Adam state (``assert len(steps) == 1``), which torch creates at the
    first step; loading a checkpoint into a fresh optimizer asks for that state dict first
    (``sharded_state_dict(is_loading=True)``). Give each parameter the state of an Adam at step 0
    (zero moments, step 0); the load then overwrites all of it (the step count:
    :func:`restore_torch_adam_step`)."""
    for adam in _torch_adams_in_distributed_optimizer(optimizer):
        if len(adam.state) == 0:
            for group in adam.param_groups:
                for p in group["params"]:
                    adam.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}


def _torch_adams_in_distributed_optimizer(optimizer) -> list:
    """The torch ``Adam`` optimizers inside Megatron's distributed optimizer when neither Apex nor
    Transformer Engine is installed (``HAVE_APEX_OR_TE`` false: the CPU, a GPU without them);
    with either, the step count lives in the param groups and nothing here is needed."""
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, distrib_optimizer.DistributedOptimizer)
            and isinstance(getattr(opt, "optimizer", None), torch.optim.Adam)]


def restore_torch_adam_step(optimizer) -> None:
    """After ``optimizer.load_state_dict``: each parameter's Adam ``step`` from its param group.

    Megatron's ``load_state_dict`` (torch Adam) sets every state's ``step`` from the checkpoint's
    param groups, then ``load_parameter_state_from_dp_reshardable`` copies the bucket state's
    ``step`` over it, a ``LocalNonpersistentObject`` that holds the value this rank had when the
    load was requested (0 in a fresh optimizer): the resumed run's Adam would restart its bias
    correction. The param groups keep the checkpoint's step (``state_dict`` writes it there)."""
    for adam in _torch_adams_in_distributed_optimizer(optimizer):
        for group in adam.param_groups:
            if "step" in group:
                for p in group["params"]:
                    if "step" in adam.state.get(p, {}):
                        adam.state[p]["step"] = torch.tensor(float(group["step"]))


def is_distributed_optimizer(optimizer) -> bool:
    """Whether ``optimizer`` (Megatron's, possibly a ``ChainedOptimizer``) is the distributed one."""
    return any(isinstance(opt, distrib_optimizer.DistributedOptimizer)
               for opt in getattr(optimizer, "chained_optimizers", [optimizer]))


def sharded_state(model_chunks: list, optimizer, *, is_loading: bool) -> dict:
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        model_sd[key] = module_of(chunk).sharded_state_dict()
    state = dict(model_sd)
    if optimizer is not None:
        if is_loading:
            _prime_fresh_torch_adam(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": DISTRIBUTED_OPTIMIZER_SHARDING})
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
