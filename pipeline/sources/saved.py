"""A one_step batch as a checkpoint's run state gives it back (:func:`restored_batch`).

A source's ``state()`` keeps its batch as tensors, and so does the checkpoint: the trainer's
checkpoint writes every tensor of the run state, bit for bit, into ``run_state.safetensors``
beside ``run_state.json`` (``megatron_gspo.train.checkpoint.run_state``), and a resume reads
them back into place. Checkpoints written before that held a ``rollout.async: one_step`` batch
(:data:`pipeline.sources.base.BUFFER_KEY`) as base64 safetensors text inside ``run_state.json``;
they still resume (:func:`decode_batch`).
"""

from __future__ import annotations

import base64
from typing import Union

import torch
from safetensors.torch import load


def restored_batch(saved: Union[dict, str]) -> dict[str, torch.Tensor]:
    """A checkpoint's one_step batch: its tensors (as the checkpoint reads them back), or the
    base64 text of a checkpoint from before ``run_state.safetensors``."""
    if isinstance(saved, str):
        return decode_batch(saved)
    bad = [k for k, v in saved.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"the saved rollout batch's entries {bad} are not tensors (a checkpoint "
                        "whose run_state.safetensors was not read back)")
    return dict(saved)


def decode_batch(text: str) -> dict[str, torch.Tensor]:
    """The base64 safetensors text of an older checkpoint's batch back to its tensors."""
    return load(base64.b64decode(text))
