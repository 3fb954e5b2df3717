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
with our sequence-parallel-capable :class:`~megatron_gspo.model.norm.RMSNorm` and our core
attention (:class:`~megatron_gspo.model.attention.PackedCoreAttention`: packed sequences and
context parallelism, which Megatron's local ``DotProductAttention`` refuses).

Batch layouts (``forward_kwargs`` turns a micro-batch dict into the model's arguments): right-
padded rows ``[b, s]``, or one packed row ``[1, t]`` of several sequences (THD) described by
``cu_seqlens`` / ``cu_seqlens_padded``, passed to Megatron as ``PackedSeqParams``; under context
parallelism every rank holds its zigzag share (``megatron_gspo.train.batching``). RoPE positions
restart at every sequence: Megatron's THD RoPE reads them from ``cu_seqlens_q_padded`` and the CP
rank, as TE's attention does. The policy class (:func:`policy_model_class`) can run the output
layer on selected positions only (``logit_index``: the response tokens), so the prompt's logits
are never formed.

``build_transformer_config`` is the ONE place where Megatron's ``TransformerConfig`` is built.
"""

from __future__ import annotations

import copy
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                      get_gpt_layer_local_spec)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                           gather_from_sequence_parallel_region)
from megatron.core.transformer.transformer_block import (TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_gspo import mcore_compat
from megatron_gspo.mcore_compat import transformer_engine_available
from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig, padded_vocab_size
from megatron_gspo.hf.mapping import hf_param_shapes, shard_from_hf
from megatron_gspo.hf.rank_pieces import rank_layout, unwrap
from megatron_gspo.loss.logprobs import DEFAULT_CHUNK_SIZE, vocab_parallel_log_probs
from megatron_gspo.model.attention import PackedCoreAttention
from megatron_gspo.model.norm import RMSNorm


GPU_ONLY_MODEL_FIELDS = ("moe_permute_fusion", "gradient_accumulation_fusion", "apply_rope_fusion")
"""ModelConfig kernel switches that need Transformer Engine on a GPU (Megatron has no CPU path)."""


def check_kernel_support(model: ModelConfig, *, use_te: bool, on_gpu: bool) -> None:
    """Refuse a GPU-only kernel switch where it cannot run, naming the field (Megatron would fail
    later, deep inside a forward pass, or not at all on import)."""
    for name in GPU_ONLY_MODEL_FIELDS:
        if getattr(model, name) and not (on_gpu and use_te):
            where = "this machine has no GPU" if not on_gpu else "Transformer Engine is not installed"
            raise ConfigError(f"model.{name}: needs Transformer Engine on a GPU ({where}); set it "
                              "to false")
    modules = model.recompute_modules or [] if model.recompute_granularity == "selective" else []
    if "moe_act" in modules and not use_te:
        raise ConfigError("model.recompute_modules: moe_act needs Transformer Engine's grouped "
                          "experts (a GPU with TE); use layernorm / core_attn / moe here")
    if "layernorm" in modules and on_gpu and not use_te:
        # megatron-core 0.16.1: CheckpointWithoutOutput calls TE's FP8 state manager whether or
        # not FP8 is on (cpu_compat stands in for it on CPU only)
        raise ConfigError("model.recompute_modules: layernorm needs Transformer Engine on a GPU "
                          "(megatron-core 0.16.1 reads TE's FP8 state in that recompute); use "
                          "core_attn / moe, or full recompute")


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig, *,
                             use_te: Optional[bool] = None):
    """Map (ModelConfig, ParallelConfig) to Megatron's TransformerConfig (the only such mapping)."""
    use_te = transformer_engine_available() if use_te is None else use_te
    on_gpu = torch.cuda.is_available()
    check_kernel_support(model, use_te=use_te, on_gpu=on_gpu)
    recompute = {}
    if model.recompute_granularity is not None:
        recompute = dict(recompute_granularity=model.recompute_granularity,
                         recompute_method=model.recompute_method,
                         recompute_num_layers=model.recompute_num_layers)
        if model.recompute_modules is not None:
            recompute["recompute_modules"] = list(model.recompute_modules)
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
        moe_permute_fusion=model.moe_permute_fusion,
        moe_router_dtype=model.moe_router_dtype,
        # parallelism
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.expert_tensor_size(),
        context_parallel_size=parallel.context,
        cp_comm_type=parallel.cp_comm_type if parallel.context > 1 else None,
        sequence_parallel=parallel.sequence_parallel,
        # precision
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        # kernels: fused paths need CUDA (and TE / apex); the plain paths compute the same thing
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=model.gradient_accumulation_fusion,
        masked_softmax_fusion=on_gpu and use_te,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=model.apply_rope_fusion,
        persist_layer_norm=False,
        calculate_per_token_loss=False,
        # Packed micro-batches differ in length, and a CP rank holds 1/cp of a row: pipeline
        # stages exchange activation shapes before the activations instead of deriving them
        # from a fixed [seq_length, micro_batch_size].
        variable_seq_lengths=parallel.pipeline > 1,
        # activation recompute (Megatron's fields; checked by config.model.validate_recompute)
        **recompute,
        # no CUDA graphs, under the running Megatron's field name (mcore_compat, difference 1)
        **mcore_compat.no_cuda_graph_kwargs(),
    )


def build_layer_spec(config, *, use_te: bool, pp_rank: Optional[int] = None):
    """Megatron block spec for a Qwen3-MoE decoder on this machine: the layers of pipeline stage
    ``pp_rank`` (uneven stages included: Megatron's get_num_layers_to_build)."""
    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                          normalization="RMSNorm", pp_rank=pp_rank)

    layer = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                     qk_layernorm=True, normalization="RMSNorm")
    layer = copy.deepcopy(layer)
    sub = layer.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    sub.self_attention.submodules.q_layernorm = RMSNorm
    sub.self_attention.submodules.k_layernorm = RMSNorm
    sub.self_attention.submodules.core_attention = PackedCoreAttention
    num_local_layers = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_local_layers, layer_norm=RMSNorm)


def build_model(model: ModelConfig, parallel: ParallelConfig, pg_collection, *,
                use_te: Optional[bool] = None):
    """Build this rank's stage of the policy (a Megatron ``GPTModel``) on the local device."""
    use_te = transformer_engine_available() if use_te is None else use_te
    if use_te and not torch.cuda.is_available():
        raise RuntimeError("the Transformer Engine spec needs CUDA; this machine has none")
    config = build_transformer_config(model, parallel, use_te=use_te)
    pp_group = pg_collection.pp
    pp_rank, pp_size = pp_group.rank(), pp_group.size()
    gpt = policy_model_class()(
        config=config,
        transformer_layer_spec=build_layer_spec(config, use_te=use_te, pp_rank=pp_rank),
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


_POLICY_MODEL_CLASS = None


def policy_model_class():
    """``PolicyGPTModel``: Megatron's ``GPTModel`` whose output layer can run on selected
    positions only (defined on first use).

    ``forward(..., logit_index=idx_N)``: ``idx_N`` are flat positions into this rank's ``[b, s]``
    tokens (row-major; ``[1, t]`` for a packed row); the last stage then returns the
    vocab-parallel logits ``[N, V/tp]`` of those positions instead of ``[b, s, V/tp]``.
    Parameters, checkpoints and every other output are GPTModel's own.
    """
    global _POLICY_MODEL_CLASS
    if _POLICY_MODEL_CLASS is None:
        class PolicyGPTModel(GPTModel):
            _logit_index = None

            def forward(self, *args, logit_index=None, **kwargs):
                self._logit_index = logit_index
                try:
                    return super().forward(*args, **kwargs)
                finally:
                    self._logit_index = None

            def _postprocess(self, hidden_states, *args, **kwargs):
                index = self._logit_index
                if index is None or not self.post_process:
                    return super()._postprocess(hidden_states, *args, **kwargs)
                if self.mtp_process or kwargs.get("inference_context") is not None:
                    raise ValueError("logit_index: not supported with MTP or inference contexts")
                return selected_logits(self, hidden_states, index)

        PolicyGPTModel.__doc__ = policy_model_class.__doc__
        _POLICY_MODEL_CLASS = PolicyGPTModel
    return _POLICY_MODEL_CLASS


def selected_logits(gpt, hidden_SBH: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """The output layer on positions ``index_N`` of the final hidden states: ``[N, V/tp]``.

    Under sequence parallelism the hidden states are first gathered over the tensor-parallel
    group (backward: reduce-scatter, which also SUMS the vocab shards' partial input gradients);
    without it they enter the tensor-parallel region (backward: all-reduce), as in Megatron's
    ``ColumnParallelLinear``. The product with this rank's vocab shard of the output weight (or
    of the tied embedding) is then an ordinary matmul.
    """
    tp = gpt.pg_collection.tp
    if tp.size() > 1 and gpt.config.sequence_parallel:
        hidden_SBH = gather_from_sequence_parallel_region(
            hidden_SBH, tensor_parallel_output_grad=True, group=tp)
    elif tp.size() > 1:
        hidden_SBH = copy_to_tensor_model_parallel_region(hidden_SBH, group=tp)
    hidden_NH = hidden_SBH.transpose(0, 1).reshape(-1, hidden_SBH.shape[-1]).index_select(0, index_N)
    weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
              else gpt.output_layer.weight)
    return torch.matmul(hidden_NH, weight.t())


def forward_kwargs(batch: dict, pg_collection) -> dict:
    """Keyword arguments of the model for a micro-batch, beyond tokens and position ids.

    A packed micro-batch (``cu_seqlens_padded`` present; ``train.batching.pack_micro_batch``)
    becomes Megatron's ``PackedSeqParams`` (``qkv_format="thd"``; ``max_seqlen`` the longest
    padded sequence before the CP split, which Megatron's RoPE and TE expect); ``logit_index``
    (response positions) passes through to :func:`policy_model_class`'s forward.
    """
    kwargs = {}
    if "cu_seqlens_padded" in batch:
        cu = batch["cu_seqlens"].to(torch.int32)
        cu_padded = batch["cu_seqlens_padded"].to(torch.int32)
        max_seqlen = int((cu_padded[1:] - cu_padded[:-1]).max())
        kwargs["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
            cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
            cp_group=pg_collection.cp)
    if "logit_index" in batch:
        kwargs["logit_index"] = batch["logit_index"]
    return kwargs


def micro_batch_log_probs(logits, batch: dict, model: ModelConfig, pg_collection, *,
                          temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs (and entropy) of ``batch["labels"]``, in the micro-batch's layout.

    ``logits`` is the model's output for ``batch``: ``[b, s, V/tp]``, or ``[N, V/tp]`` at
    ``batch["logit_index"]``; then the result is 0 at every other position (which the response
    mask excludes) and gradients flow only into the computed positions.
    """
    labels = batch["labels"]
    if "logit_index" not in batch:
        return token_log_probs(logits, labels, model, pg_collection, temperature=temperature,
                               with_entropy=with_entropy)
    index_N = batch["logit_index"]
    lp_N, ent_N = token_log_probs(logits, labels.reshape(-1).index_select(0, index_N), model,
                                  pg_collection, temperature=temperature, with_entropy=with_entropy)

    def scatter(values_N):
        if values_N is None:
            return None
        return values_N.new_zeros(labels.numel()).index_put((index_N,), values_N).reshape(labels.shape)

    return scatter(lp_N), scatter(ent_N)


# ----------------------------------------------------------------------------------------------
# Weights from Hugging Face names (the mapping: hf/mapping.py; this rank's share: hf/rank_pieces.py)


@torch.no_grad()
def load_hf_weights(gpt, model: ModelConfig, pg_collection, get_hf) -> None:
    """Fill every local parameter from full HF tensors; ``get_hf(name)`` returns one tensor.

    Raises KeyError naming a Megatron parameter that has no HF counterpart.
    """
    gpt = unwrap(gpt)
    layout = rank_layout(gpt, model, pg_collection)
    for name, param in gpt.named_parameters():
        param.copy_(shard_from_hf(name, tuple(param.shape), get_hf, model, layout, param.dtype))


def token_log_probs(logits, target, model: ModelConfig, pg_collection, *, temperature: float = 1.0,
                    with_entropy: bool = False, chunk_size: Optional[int] = None):
    """Per-token log-probs (and entropy) of ``target`` from this rank's vocab-parallel logits.

    Columns of the padded vocabulary (ids >= model.vocab_size) are excluded, so the result is the
    log-softmax over the real vocabulary, as in Hugging Face and SGLang.
    """
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
