"""A complete Hugging Face directory from the live, sharded policy.

The full tensors come from the weight sync's gather (``megatron_gspo.hf.gather``): each HF tensor
is assembled on its source rank (the lowest rank that holds it whole, else the first of its TP
group), and **every source rank writes its own buckets** as safetensors shards, in parallel, into
the shared output directory. Nothing funnels through rank 0 (at 235B that would be one rank
receiving and writing ~470 GB): each rank receives only its TP peers' shards and writes about its
share of the model; memory is bounded by two buckets per source. Rank 0 then gathers the small
weight maps, names the shards ``model-NNNNN-of-MMMMM.safetensors`` (a rename each; the writer's rank stays in
each shard's metadata, ``rank``) and writes the index and config.json. Used to write the SFT result, the initial policy of the rollout servers
and the final policy of a GSPO run. The output directory must be one every rank sees (a shared
file system on a cluster, as for checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from safetensors.torch import save_file

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
    config.json [+ tokenizer files]); each source rank writes its own shards. Returns the
    directory on rank 0 (None elsewhere)."""
    from megatron_gspo.hf.gather import HFGather

    out_dir = Path(out_dir)
    rank = dist.get_rank()
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[tuple[int, str, dict[str, int]]] = []  # (bucket index, file, {name: bytes})
    stream = HFGather(model, bucket_bytes=bucket_bytes).buckets(gpt, pg_collection)
    for bucket in stream:
        if bucket.flat is None:  # another rank's bucket
            continue
        tensors = {n: t.cpu().contiguous() for n, t in bucket.named_tensors()}
        part = f"part-{bucket.index:05d}-rank{rank:05d}.safetensors"
        save_file(tensors, str(out_dir / part), metadata={"format": "pt", "rank": str(rank)})
        written.append((bucket.index, part,
                        {n: t.numel() * t.element_size() for n, t in tensors.items()}))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, written)
    if rank == 0:
        parts = sorted((w for ws in everyone for w in ws), key=lambda w: w[0])  # bucket order
        weight_map, total = {}, 0
        for i, (_, part, sizes) in enumerate(parts):
            shard = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            (out_dir / part).replace(out_dir / shard)
            for name, nbytes in sizes.items():
                weight_map[name] = shard
                total += nbytes
        for stale in out_dir.glob("model*.safetensors"):  # an earlier export's extra shards
            if stale.name not in weight_map.values():
                stale.unlink()
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=1))
        dtype = "bfloat16" if model.params_dtype == "bfloat16" else "float32"
        (out_dir / "config.json").write_text(json.dumps(hf_config_dict(model, dtype=dtype), indent=1))
        if tokenizer_dir:
            copy_tokenizer_files(tokenizer_dir, out_dir)
    dist.barrier()
    return out_dir if rank == 0 else None
