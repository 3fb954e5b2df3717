"""A batch source's state as ``run_state.json`` holds it: the one tensor part (``rollout.async:
one_step``'s finished batch, :data:`pipeline.sources.base.BUFFER_KEY`) as base64 safetensors text.

A source's ``state()`` keeps the batch as tensors (the step guard takes one at every step's
begin); :func:`checkpoint_json` encodes it only when a checkpoint is written.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from safetensors.torch import load, save

from pipeline.sources.base import BUFFER_KEY


def checkpoint_json(state: dict) -> dict:
    """A source's ``BatchSource.state()`` as ``run_state.json`` holds it: a finished batch's
    tensors as text (:func:`encode_batch`); the rest is JSON-able as it is."""
    if state.get(BUFFER_KEY) is None:
        return dict(state)
    buffer = state[BUFFER_KEY]
    return {**state, BUFFER_KEY: {**buffer, "batch": encode_batch(buffer["batch"])}}


def encode_batch(batch: dict[str, Any]) -> str:
    """A batch of tensors as base64 safetensors (bit-exact; JSON-safe)."""
    bad = [k for k, v in batch.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"rollout batch entries {bad} are not tensors")
    tensors = {k: v.contiguous() for k, v in batch.items()}
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_batch(text: str) -> dict[str, torch.Tensor]:
    """:func:`encode_batch`'s text back to the tensors."""
    return load(base64.b64decode(text))
