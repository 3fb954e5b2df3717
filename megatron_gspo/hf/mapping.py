"""Hugging Face <-> Megatron names and layouts for Qwen3-MoE, for one rank's shards.

The single mapping used by initialisation (``load_hf_into_model``), checkpoint conversion and the
rollout weight sync. Hugging Face names are the on-disk (safetensors) names, which
transformers 4 and 5 share: ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``.

Layouts (docs/hf_mapping.md; verified against transformers' logits in the tests):

* ``linear_qkv`` [(n_h + 2 n_g) d, H] is grouped: for each KV group g, its ``n_h/n_g`` query heads,
  then k_g, then v_g. TP rank r holds groups [r n_g/tp, (r+1) n_g/tp).
* expert ``linear_fc1`` [2I, H] is ``[gate; up]``; ETP rank r holds ``[gate_r; up_r]``.
  Local expert e on EP rank p is global expert ``p E/ep + e``.
* column-parallel weights split dim 0 over TP (qkv, vocab), row-parallel split dim 1 (o_proj,
  down_proj over ETP). Norms and the router are replicated.
* the vocabulary is padded to ``padded_vocab_size`` for TP: padded rows are zero on import and
  dropped on export. Layer ``i`` of pipeline stage s is global layer ``offset(s) + i``.

Shape legend: H hidden, V vocab, E experts, I expert intermediate, d head_dim, n_h heads,
n_g KV groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from megatron_gspo.config import ModelConfig


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits: the coordinates the mapping needs."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    layer_offset: int = 0
    padded_vocab_size: int = 0


@dataclass(frozen=True)
class Piece:
    """This shard's rows/columns ``local_index`` are the HF tensor ``hf_name``'s ``hf_index``."""

    hf_name: str
    hf_index: tuple  # tuple of slices into the full HF tensor
    local_index: tuple  # tuple of slices into the local Megatron shard


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")

_LAYER_SIMPLE = {
    # Megatron suffix (local and TE spec) -> HF suffix, replicated over TP
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def hf_param_names(model: ModelConfig) -> list[str]:
    """Every HF tensor name of the model, in a stable order."""
    names = ["model.embed_tokens.weight"]
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}."
        names += [p + s for s in ("input_layernorm.weight", "self_attn.q_proj.weight",
                                  "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                  "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                                  "self_attn.k_norm.weight", "post_attention_layernorm.weight",
                                  "mlp.gate.weight")]
        for e in range(model.num_experts):
            names += [f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
    names.append("model.norm.weight")
    if not model.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def hf_param_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full HF shapes of every tensor."""
    H, V, d, I = model.hidden_size, model.vocab_size, model.head_dim, model.moe_ffn_hidden_size
    n_h, n_g, E = model.num_attention_heads, model.num_query_groups, model.num_experts
    shapes = {}
    for name in hf_param_names(model):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (V, H)
        elif name.endswith(("layernorm.weight",)) or name == "model.norm.weight":
            shapes[name] = (H,)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            shapes[name] = (d,)
        elif name.endswith("q_proj.weight"):
            shapes[name] = (n_h * d, H)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            shapes[name] = (n_g * d, H)
        elif name.endswith("o_proj.weight"):
            shapes[name] = (H, n_h * d)
        elif name.endswith("mlp.gate.weight"):
            shapes[name] = (E, H)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            shapes[name] = (I, H)
        elif name.endswith("down_proj.weight"):
            shapes[name] = (H, I)
        else:  # pragma: no cover - hf_param_names and this table are written together
            raise KeyError(name)
    return shapes


def _all() -> tuple:
    return (slice(None),)


def pieces_for(local_name: str, local_shape: tuple[int, ...], model: ModelConfig,
               layout: RankLayout) -> list[Piece]:
    """The HF pieces that make up the local Megatron tensor ``local_name``.

    Raises KeyError for a name that is not part of a Qwen3-MoE policy.
    """
    V, d = model.vocab_size, model.head_dim
    if local_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf = "model.embed_tokens.weight" if (
            local_name.startswith("embedding") or model.tie_word_embeddings) else "lm_head.weight"
        rows = local_shape[0]
        start = layout.tp_rank * rows
        stop = min(start + rows, V)  # padded rows beyond V have no HF counterpart
        if stop <= start:
            return []
        return [Piece(hf, (slice(start, stop),), (slice(0, stop - start),))]
    if local_name == "decoder.final_layernorm.weight":
        return [Piece("model.norm.weight", _all(), _all())]

    match = _LAYER.match(local_name)
    if not match:
        raise KeyError(f"{local_name}: not a Qwen3-MoE Megatron parameter")
    layer = int(match.group(1)) + layout.layer_offset
    suffix = match.group(2)
    p = f"model.layers.{layer}."
    if suffix in _LAYER_SIMPLE:
        return [Piece(p + _LAYER_SIMPLE[suffix], _all(), _all())]

    if suffix == "self_attention.linear_qkv.weight":
        n_h, n_g = model.num_attention_heads, model.num_query_groups
        heads_per_group = n_h // n_g
        groups_per_rank = n_g // layout.tp_size
        rows_per_group = (heads_per_group + 2) * d
        pieces = []
        for local_g in range(groups_per_rank):
            g = layout.tp_rank * groups_per_rank + local_g
            base = local_g * rows_per_group
            q_rows = heads_per_group * d
            pieces += [
                Piece(p + "self_attn.q_proj.weight", (slice(g * q_rows, (g + 1) * q_rows),),
                      (slice(base, base + q_rows),)),
                Piece(p + "self_attn.k_proj.weight", (slice(g * d, (g + 1) * d),),
                      (slice(base + q_rows, base + q_rows + d),)),
                Piece(p + "self_attn.v_proj.weight", (slice(g * d, (g + 1) * d),),
                      (slice(base + q_rows + d, base + rows_per_group),)),
            ]
        return pieces
    if suffix == "self_attention.linear_proj.weight":
        cols = local_shape[1]
        start = layout.tp_rank * cols
        return [Piece(p + "self_attn.o_proj.weight", (slice(None), slice(start, start + cols)),
                      (slice(None), slice(None)))]

    expert = _LOCAL_EXPERT.match(suffix)
    if expert:
        local_e, fc = int(expert.group(1)), expert.group(2)
    else:
        grouped = _GROUPED_EXPERT.match(suffix)
        if not grouped:
            raise KeyError(f"{local_name}: not a Qwen3-MoE Megatron parameter")
        fc, local_e = grouped.group(1), int(grouped.group(2))
    num_local = model.num_experts // layout.ep_size
    e = layout.ep_rank * num_local + local_e
    ep = f"{p}mlp.experts.{e}."
    if fc == "1":
        rows = local_shape[0] // 2  # [gate_r; up_r]
        start = layout.etp_rank * rows
        return [
            Piece(ep + "gate_proj.weight", (slice(start, start + rows),), (slice(0, rows),)),
            Piece(ep + "up_proj.weight", (slice(start, start + rows),), (slice(rows, 2 * rows),)),
        ]
    cols = local_shape[1]
    start = layout.etp_rank * cols
    return [Piece(ep + "down_proj.weight", (slice(None), slice(start, start + cols)),
                  (slice(None), slice(None)))]


def shard_from_hf(local_name: str, local_shape: tuple[int, ...], get_hf: Callable[[str], torch.Tensor],
                  model: ModelConfig, layout: RankLayout, dtype: torch.dtype) -> torch.Tensor:
    """Build the local Megatron tensor from full HF tensors (padding rows are zero)."""
    out = torch.zeros(local_shape, dtype=dtype)
    for piece in pieces_for(local_name, local_shape, model, layout):
        out[piece.local_index] = get_hf(piece.hf_name)[piece.hf_index].to(dtype)
    return out


def iter_hf_pieces(named_tensors: Iterator[tuple[str, torch.Tensor]], model: ModelConfig,
                   layout: RankLayout) -> Iterator[tuple[Piece, torch.Tensor]]:
    """For each local tensor, yield (piece, the local sub-tensor that piece covers)."""
    for name, tensor in named_tensors:
        for piece in pieces_for(name, tuple(tensor.shape), model, layout):
            yield piece, tensor[piece.local_index]
