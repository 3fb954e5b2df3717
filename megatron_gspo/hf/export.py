"""A complete Hugging Face directory from the live, sharded policy.

The full tensors come from the weight sync's gather (``gather.iter_full_hf_tensors``: every
region sent once to global rank 0, bucket by bucket, through the one HF mapping), so memory on rank
0 is bounded by a bucket, not the model. Used to write the SFT result, the initial policy of the
rollout servers and the final policy of a GSPO run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from megatron_gspo.config import ModelConfig


def hf_config_dict(model: ModelConfig, *, dtype: str = "float32") -> dict:
    """A transformers ``Qwen3MoeConfig`` config.json for ``model`` (both rope spellings)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "intermediate_size": model.moe_ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "norm_topk_prob": model.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
        "use_sliding_window": False,
        "initializer_range": model.init_method_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def copy_tokenizer_files(source: str | Path, target: Path) -> None:
    """The tokenizer and generation files of a Hugging Face directory (not its config.json)."""
    from megatron_gspo.hf.mcore_checkpoint import HF_SIDE_FILES, copy_hf_files

    copy_hf_files(Path(source), target, [n for n in HF_SIDE_FILES if n != "config.json"])


def export_hf_dir(gpt, model: ModelConfig, pg_collection, out_dir: str | Path, *,
                  tokenizer_dir: Optional[str | Path] = None,
                  bucket_bytes: int = 512 << 20) -> Optional[Path]:
    """Collective: write a transformers-loadable directory (safetensors shards + index +
    config.json [+ tokenizer files]) on rank 0. Returns the directory on rank 0."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    rank = dist.get_rank()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    from megatron_gspo.hf.gather import iter_full_hf_tensors

    for i, bucket in enumerate(iter_full_hf_tensors(gpt, model, pg_collection,
                                                    bucket_bytes=bucket_bytes)):
        if rank != 0:
            continue
        shard = f"model-{i + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in bucket.items()}, str(out_dir / shard),
                  metadata={"format": "pt"})
        for name, tensor in bucket.items():
            weight_map[name] = shard
            total += tensor.numel() * tensor.element_size()
    if rank == 0:
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        dtype = "bfloat16" if model.params_dtype == "bfloat16" else "float32"
        (out_dir / "config.json").write_text(json.dumps(hf_config_dict(model, dtype=dtype), indent=1))
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
    dist.barrier()
    return out_dir if rank == 0 else None
