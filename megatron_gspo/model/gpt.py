"""The policy: Megatron-Core's ``GPTModel`` configured as a Qwen3-style MoE.

Qwen3-MoE in Megatron terms (every layer is an MoE layer, no shared expert, no biases):

* attention: GQA with an explicit ``kv_channels = head_dim`` (Qwen3's head_dim != hidden/heads),
  RMSNorm QK-norm per head applied before RoPE, rotate-half RoPE with base ``rope_theta``;
* MoE: softmax router over all experts, top-k, the k probabilities renormalised to sum to 1
  (``norm_topk_prob``; in Megatron ``moe_router_pre_softmax=False``: softmax over the top-k
  logits, which equals the renormalised top-k of the full softmax), SwiGLU experts
  (``linear_fc1 = [gate; up]``), optional load-balancing loss;
* RMSNorm everywhere, tied or untied embeddings, vocabulary padded for tensor parallelism.

Spec: Transformer Engine's when TE imports and CUDA is present; Megatron's local spec otherwise,
with our sequence-parallel-capable :class:`~megatron_gspo.model.norm.RMSNorm`.

``build_transformer_config`` is the ONE place where Megatron's ``TransformerConfig`` is built.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_gspo.config import ModelConfig, ParallelConfig, padded_vocab_size


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig, *,
                             use_te: Optional[bool] = None):
    """Map (ModelConfig, ParallelConfig) to Megatron's TransformerConfig (the only such mapping)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    use_te = transformer_engine_available() if use_te is None else use_te
    on_gpu = torch.cuda.is_available()
    bf16 = model.params_dtype == "bfloat16"
    params_dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        # architecture
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        # MoE
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=not model.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type=model.moe_token_dispatcher,
        moe_grouped_gemm=use_te,
        moe_permute_fusion=False,
        # parallelism
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor_size(),
        context_parallel_size=parallel.context,
        sequence_parallel=parallel.sequence_parallel,
        # precision
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        # kernels: fused paths need CUDA (and TE / apex); the plain paths compute the same thing
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=on_gpu and use_te,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=False,
    )


def build_layer_spec(config, *, use_te: bool):
    """Megatron block spec for a Qwen3-MoE decoder on this machine."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                          normalization="RMSNorm")
    from megatron_gspo.model.norm import RMSNorm

    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     qk_layernorm=True, normalization="RMSNorm")
    layer = copy.deepcopy(layer)
    sub = layer.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.submodules.q_layernorm = RMSNorm
    sub.self_attention.submodules.k_layernorm = RMSNorm
    num_local_layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=RMSNorm)


def build_model(model: ModelConfig, parallel: ParallelConfig, pg_collection, *,
                use_te: Optional[bool] = None):
    """Build this rank's stage of the policy (a Megatron ``GPTModel``) on the local device."""
    from megatron.core.models.gpt import GPTModel

    use_te = transformer_engine_available() if use_te is None else use_te
    if use_te and not torch.cuda.is_available():
        raise RuntimeError("the Transformer Engine spec needs CUDA; this machine has none")
    config = build_transformer_config(model, parallel, use_te=use_te)
    pp_group = pg_collection.pp
    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=build_layer_spec(config, use_te=use_te),
        vocab_size=padded_vocab_size(model, parallel.tensor),
        max_sequence_length=model.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(model.rope_theta),
        pg_collection=pg_collection,
    )
    if torch.cuda.is_available():
        gpt = gpt.cuda()
    return gpt


# ----------------------------------------------------------------------------------------------
# Weights in Hugging Face names (the mapping lives in hf_mapping.py)


def rank_layout(gpt, model: ModelConfig, pg_collection):
    """This rank's coordinates for the HF mapping, read from the process groups and the model."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_gspo.hf.mapping import RankLayout

    tp = pg_collection.tp
    return RankLayout(
        tp_rank=tp.rank(), tp_size=tp.size(),
        ep_rank=pg_collection.ep.rank(), ep_size=pg_collection.ep.size(),
        etp_rank=pg_collection.expt_tp.rank(), etp_size=pg_collection.expt_tp.size(),
        layer_offset=get_transformer_layer_offset(gpt.config, pp_rank=pg_collection.pp.rank()),
        padded_vocab_size=padded_vocab_size(model, tp.size()),
    )


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


@torch.no_grad()
def load_hf_weights(gpt, model: ModelConfig, pg_collection, get_hf) -> None:
    """Fill every local parameter from full HF tensors; ``get_hf(name)`` returns one tensor.

    Raises KeyError naming a Megatron parameter that has no HF counterpart.
    """
    from megatron_gspo.hf.mapping import shard_from_hf

    gpt = _unwrap(gpt)
    layout = rank_layout(gpt, model, pg_collection)
    for name, param in gpt.named_parameters():
        param.copy_(shard_from_hf(name, tuple(param.shape), get_hf, model, layout, param.dtype))


def local_hf_pieces(gpt, model: ModelConfig, pg_collection, *, tensors=None):
    """Yield (Piece, local sub-tensor) for every local parameter (or for ``tensors``: name->tensor,
    e.g. gradients) in HF names and coordinates."""
    from megatron_gspo.hf.mapping import iter_hf_pieces

    gpt = _unwrap(gpt)
    layout = rank_layout(gpt, model, pg_collection)
    named = tensors.items() if tensors is not None else (
        (n, p.detach()) for n, p in gpt.named_parameters())
    yield from iter_hf_pieces(named, model, layout)


def token_log_probs(logits, target, model: ModelConfig, pg_collection, *, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_size: Optional[int] = None):
    """Per-token log-probs (and entropy) of ``target`` from this rank's vocab-parallel logits.

    Columns of the padded vocabulary (ids >= model.vocab_size) are excluded, so the result is the
    log-softmax over the real vocabulary, as in Hugging Face and SGLang.
    """
    from megatron_gspo.loss.logprobs import DEFAULT_CHUNK_SIZE, vocab_parallel_log_probs

    tp = pg_collection.tp
    width = logits.shape[-1]
    vocab_start = tp.rank() * width
    real = max(0, min(width, model.vocab_size - vocab_start))
    if real < width:
        logits = logits[..., :real]
    return vocab_parallel_log_probs(
        logits, target, tp_group=tp if tp.size() > 1 else None, vocab_start=vocab_start,
        chunk_size=chunk_size or DEFAULT_CHUNK_SIZE, temperature=temperature,
        with_entropy=with_entropy)


def init_weights(gpt, model: ModelConfig, pg_collection, *, seed: int) -> None:
    """Layout-independent random initialisation: every full HF tensor is drawn from a generator
    seeded by (seed, name), then sliced to this rank's shard, so any parallel layout starts from
    the same weights (one full tensor in memory at a time). Norm weights start at 1; matrices are
    normal(0, init_method_std)."""
    import zlib

    from megatron_gspo.hf.mapping import hf_param_shapes

    shapes = hf_param_shapes(model)
    cache: dict[str, torch.Tensor] = {}

    def get_hf(name: str) -> torch.Tensor:
        if name not in cache:
            cache.clear()
            shape = shapes[name]
            if len(shape) == 1:
                cache[name] = torch.ones(shape)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                cache[name] = torch.randn(shape, generator=gen) * model.init_method_std
        return cache[name]

    load_hf_weights(gpt, model, pg_collection, get_hf)
