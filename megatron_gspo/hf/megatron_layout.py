"""The checkpoint directory layout of Megatron-LM and Megatron-Bridge: found when reading, written
by ``convert hf-to-mcore`` and the trainer's model save.

Megatron-LM (``megatron/training/checkpointing.py``, read in the copy megatron-core 0.19.2 ships)
and Megatron-Bridge 0.6.2 (``training/checkpointing.py``, ``training/model_load_save.py``) keep a
checkpoint *root*::

    ROOT/latest_checkpointed_iteration.txt   "N" or "release" (get_checkpoint_tracker_filename)
    ROOT/iter_000000N/  or  ROOT/release/    the torch_dist directory (get_checkpoint_name)
        .metadata, __*_*.distcp, metadata.json
        common state: {"checkpoint_version": 3.0, "iteration": N, "content_metadata": {...}, ...}
        run_config.yaml                      Bridge only: its ConfigContainer (``model`` section)

How each tool reads a root (what the written layout must satisfy):

* Megatron-LM ``--load ROOT`` / ``--pretrained-checkpoint ROOT``: without the tracker file it
  prints "will not load any checkpoints and will start from random" and carries on (unless
  ``--exit-on-missing-checkpoint``); with it, ``read_metadata`` takes an integer or ``release``.
  From the common state it reads ``checkpoint_version`` (below 2.0, or absent = 0, it *reorders
  the QKV weights*: ``fix_query_key_value_ordering``), ``iteration`` (it exits without it unless
  ``--finetune`` or ``release``) and, when present, ``args`` (compared with the run's arguments).
  Without ``--finetune`` and ``release`` it also asks for the optimizer and RNG state, which a
  model-only checkpoint lacks: load it with ``--pretrained-checkpoint`` (which sets ``finetune``) or
  ``--load ... --finetune`` (or ``--no-load-optim --no-load-rng``).
* Bridge's ``load_megatron_model`` / ``export_ckpt``: the newest ``iter_*`` directory of the root
  (the tracker is not read; ``release`` is not found), whose ``run_config.yaml`` ``model`` section
  it instantiates into its model provider (``load_model_config``: without the file, or Megatron-LM
  ``args`` in the common state, "not in a supported format"). Its training load reads
  ``run_config.yaml``'s ``model.{tensor,pipeline}_model_parallel_size`` and
  ``checkpoint.{save_optim,save_rng,fully_parallel_save}``.

So a model checkpoint is written as ``ROOT/iter_0000000/`` with the tracker ``0``, the common
state Megatron-LM reads, and a ``run_config.yaml`` with the ``model`` (Bridge's
``GPTModelProvider`` with the Qwen3-MoE fields) and ``checkpoint`` sections (no optimizer, no RNG).
:func:`resolve` reads any of: such a root, an iteration directory, or the project's earlier flat
directory (the torch_dist files at the top).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_gspo.config import ModelConfig
from megatron_gspo.hf.safetensors_io import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's ``get_checkpoint_tracker_filename``; Bridge writes the same."""
RUN_CONFIG = "run_config.yaml"
"""Bridge's ``get_checkpoint_run_config_filename``: the run's ConfigContainer."""
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's current ``checkpoint_version`` (``generate_state_dict``); below 2.0 it reorders QKV."""
HF_CONFIG_DIR = "hf_config"
"""Sub-directory of a converted checkpoint holding config.json and the tokenizer files."""


def iteration_dir_name(iteration: Optional[int]) -> str:
    """``iter_%07d`` (Megatron-LM's ``get_checkpoint_name``), or ``release`` for None."""
    return "release" if iteration is None else f"iter_{iteration:07d}"


def is_torch_dist_dir(path: str | os.PathLike) -> bool:
    """A torch_dist directory itself (``metadata.json`` or ``.metadata`` at its top)."""
    path = Path(path)
    return (path / "metadata.json").is_file() or (path / ".metadata").is_file()


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A Megatron checkpoint in any layout :func:`resolve` reads (a root with a tracker file, an
    iteration directory, or a flat torch_dist directory), rather than a Hugging Face directory."""
    path = Path(path)
    return is_torch_dist_dir(path) or (path / TRACKER).is_file()


def read_tracker(root: str | os.PathLike) -> Optional[int]:
    """The iteration ``ROOT/latest_checkpointed_iteration.txt`` names (None: ``release``), read as
    Megatron-LM's ``read_metadata`` does; anything else is a :class:`CheckpointError`."""
    tracker = Path(root) / TRACKER
    text = tracker.read_text().strip()
    if text == "release":
        return None
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise CheckpointError(f"{tracker}: {text[:40]!r} is neither an iteration number nor "
                              "'release' (Megatron-LM's tracker file)")
    return iteration


def resolve(path: str | os.PathLike) -> Path:
    """The torch_dist directory that ``path`` names: ``path`` itself (an iteration directory or the
    project's flat layout), or, for a Megatron-LM / Bridge root, the directory its tracker file
    names. A clear :class:`CheckpointError` otherwise (a root without tracker lists its iterations)."""
    path = Path(path)
    if is_torch_dist_dir(path):
        return path
    if (path / TRACKER).is_file():
        target = path / iteration_dir_name(read_tracker(path))
        if not is_torch_dist_dir(target):
            raise CheckpointError(f"{path / TRACKER} names {target.name}, which is not a Megatron "
                                  "distributed checkpoint (no metadata.json; an interrupted save?)")
        return target
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    iterations = sorted(p.name for p in path.iterdir()
                        if p.is_dir() and (p.name.startswith("iter_") or p.name == "release"))
    if iterations:
        raise CheckpointError(f"{path}: no {TRACKER} to say which checkpoint is current; name one of "
                              f"{', '.join(iterations[-5:])} directly")
    raise CheckpointError(f"{path}: not a Megatron distributed checkpoint (no metadata.json, no "
                          f"{TRACKER}; an interrupted save or conversion?)")


def find_hf_config(ckpt_dir: str | os.PathLike) -> Optional[Path]:
    """Where the checkpoint records its Hugging Face config, or None: ``hf_config/`` beside the
    torch_dist files (this project's conversions and saves), else the ``model.hf_model_id`` of
    Bridge's ``run_config.yaml`` when it is a local directory with a config.json."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / HF_CONFIG_DIR / "config.json").is_file():
        return ckpt_dir / HF_CONFIG_DIR
    run_config = ckpt_dir / RUN_CONFIG
    if run_config.is_file():
        try:
            model = (yaml.safe_load(run_config.read_text()) or {}).get("model") or {}
        except yaml.YAMLError:
            return None  # Bridge writes tags safe_load refuses only in sections we do not read
        hf_id = model.get("hf_model_id") if isinstance(model, dict) else None
        if isinstance(hf_id, str) and (Path(hf_id) / "config.json").is_file():
            return Path(hf_id)
    return None


def common_state(iteration: int = 0) -> dict[str, Any]:
    """The common (non-sharded) state a model checkpoint carries for Megatron-LM and Bridge."""
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "content_metadata": {"singleton_local_shards": False}}


def run_config(model: ModelConfig, *, bf16: bool, hf_config_dir: Optional[Path] = None
               ) -> dict[str, Any]:
    """Bridge's ``run_config.yaml`` for a model-only checkpoint: the ``model`` section instantiates
    Bridge's ``GPTModelProvider`` with the Qwen3-MoE fields (as Bridge's Qwen3-MoE bridge sets
    them, ``models/qwen/qwen3_moe_bridge.py``; the rest keep the provider's defaults, among them its
    Transformer Engine layer spec), the ``checkpoint`` section says no optimizer and no RNG state."""
    provider: dict[str, Any] = {
        "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
        "num_layers": model.num_layers, "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.moe_ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups, "kv_channels": model.head_dim,
        "num_moe_experts": model.num_experts, "moe_router_topk": model.moe_router_topk,
        "moe_ffn_hidden_size": model.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not model.norm_topk_prob,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": model.moe_aux_loss_coeff,
        "moe_grouped_gemm": True, "moe_token_dispatcher_type": "alltoall",
        "vocab_size": model.vocab_size, "should_pad_vocab": False,
        "make_vocab_size_divisible_by": 1,
        "share_embeddings_and_output_weights": model.tie_word_embeddings,
        "position_embedding_type": "rope", "rotary_base": float(model.rope_theta),
        "seq_length": model.max_position_embeddings,
        "normalization": "RMSNorm", "layernorm_epsilon": model.rms_norm_eps,
        "qk_layernorm": True, "gated_linear_unit": True,
        "activation_func": {"_target_": "torch.nn.functional.silu", "_call_": False},
        "add_bias_linear": False, "add_qkv_bias": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "init_method_std": model.init_method_std,
        "bf16": bf16, "params_dtype": {"_target_": f"torch.{'bfloat16' if bf16 else 'float32'}",
                                       "_call_": False},
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
    }
    if hf_config_dir is not None:
        provider["hf_model_id"] = str(Path(hf_config_dir).resolve())
    return {"model": provider,
            "checkpoint": {"save_optim": False, "save_rng": False, "fully_parallel_save": False,
                           "ckpt_format": "torch_dist"}}


def write_run_config(ckpt_dir: Path, config: dict[str, Any]) -> None:
    (Path(ckpt_dir) / RUN_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))


def write_tracker(root: Path, iteration: Optional[int]) -> None:
    """``ROOT/latest_checkpointed_iteration.txt``: written last, after the iteration directory is
    complete (Megatron-LM writes it after the checkpoint too)."""
    (Path(root) / TRACKER).write_text("release" if iteration is None else str(iteration))
