"""The initial policy weights of a run (``run.init_from``), shared by the SFT and the RL trainer.

``run.init_from`` names a Hugging Face directory (e.g. an SFT result) or a Megatron torch_dist
checkpoint (``megatron-gspo convert hf-to-mcore``, a trainer checkpoint's ``model_optim``, a
Megatron-LM or Megatron-Bridge checkpoint root or one of its ``iter_*`` directories; written by
either supported megatron-core version), which loads under any parallel layout; unset, the weights are the layout-independent random
initialisation from ``run.seed``. Either way the model config is checked against the source first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from megatron_gspo.config import ModelConfig
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.hf_config import check_model_config
from megatron_gspo.hf.mcore_checkpoint import load_model
from megatron_gspo.hf.safetensors_io import HFCheckpoint
from megatron_gspo.model import gpt as policy


def is_mcore_checkpoint(path: str | Path) -> bool:
    """A Megatron checkpoint (a torch_dist directory, or a Megatron-LM / Bridge root with its
    tracker file) rather than a Hugging Face directory."""
    return megatron_layout.is_checkpoint(path)


def load_hf(gpt, model: ModelConfig, pg_collection, hf_dir: str | Path) -> None:
    """Load weights from a Hugging Face directory (checked against the model config first)."""
    check_model_config(model, hf_dir)
    with HFCheckpoint(hf_dir) as ckpt:
        policy.load_hf_weights(gpt, model, pg_collection, ckpt.read)


def load_mcore(gpt, model: ModelConfig, ckpt_dir: str | Path) -> None:
    """Load a Megatron torch_dist checkpoint under this run's layout, whatever layout wrote it
    (the Hugging Face config it records, when it records one, is checked against the model config
    first: :func:`megatron_layout.find_hf_config`)."""
    ckpt_dir = megatron_layout.resolve(ckpt_dir)
    hf_config = megatron_layout.find_hf_config(ckpt_dir)
    if hf_config is not None:
        check_model_config(model, hf_config)
    load_model(gpt, str(ckpt_dir))


def load_initial_weights(gpt, model: ModelConfig, pg_collection, init_from: Optional[str], *,
                         seed: int) -> None:
    """Fill ``gpt`` (an unwrapped model chunk) from ``init_from``, or from ``seed`` when it is None."""
    if init_from and is_mcore_checkpoint(init_from):
        load_mcore(gpt, model, init_from)
    elif init_from:
        load_hf(gpt, model, pg_collection, init_from)
    else:
        policy.init_weights(gpt, model, pg_collection, seed=seed)
