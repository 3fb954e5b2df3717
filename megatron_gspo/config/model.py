"""The sections ``model`` (:class:`ModelConfig`, the Qwen3-MoE architecture and its
memory / kernel switches) and ``parallel`` (:class:`ParallelConfig`), and what they alone decide:
Megatron's recompute rules (:func:`validate_recompute`), the layers of each pipeline stage
(:func:`pipeline_stage_layers`) and the padded vocabulary (:func:`padded_vocab_size`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_gspo.config.checks import require


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A Qwen3-style MoE decoder. Field names are Megatron-Core's (``TransformerConfig``); each
    docstring names the Hugging Face ``Qwen3MoeConfig`` key it maps to where the two differ
    (``megatron_gspo.hf.hf_config`` converts between them)."""

    num_layers: int = 2
    """Transformer layers (HF ``num_hidden_layers``)."""
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Key/value heads for GQA (HF ``num_key_value_heads``)."""
    head_dim: int = 32
    """Per-head width; explicit, generally != hidden_size / num_attention_heads (Qwen3)."""
    num_experts: int = 4
    moe_router_topk: int = 2
    """Experts per token (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: int = 64
    """Expert intermediate width (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 (Qwen3: True)."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing loss coefficient; 0 (no aux loss) is the usual choice for RL."""
    vocab_size: int = 256
    make_vocab_size_divisible_by: int = 8
    """The embedding is padded to a multiple of this times the tensor-parallel size."""
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron's token dispatcher for expert parallelism."""
    # -- memory and kernels: Megatron TransformerConfig fields of the same name (model/gpt.py) --
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Dtype of the router's logits, softmax and top-k (Megatron ``moe_router_dtype``); fp32 as
    slime and verl run Qwen3-MoE. null: the parameters' dtype (bf16 routing)."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recompute: full (each recomputed layer keeps only its input) or selective (only
    recompute_modules); null: keep every activation."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """full recompute: uniform (every chunk of recompute_num_layers layers) or block (the first
    recompute_num_layers layers of each pipeline stage)."""
    recompute_num_layers: Optional[int] = None
    """full recompute: layers per recompute chunk (uniform) or per stage (block)."""
    recompute_modules: Optional[list[str]] = None
    """selective recompute: Megatron's submodule names (core_attn, layernorm, moe_act, moe, mlp);
    null: Megatron's default [core_attn]."""
    moe_permute_fusion: bool = False
    """Fused token permutation of the MoE dispatcher (Transformer Engine, GPU only)."""
    gradient_accumulation_fusion: bool = False
    """Fuse weight-gradient accumulation into the GEMM (Transformer Engine / APEX, GPU only)."""
    apply_rope_fusion: bool = False
    """Fused RoPE kernel (Transformer Engine, GPU only)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "head_dim", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                     "vocab_size", "make_vocab_size_divisible_by", "max_position_embeddings"):
            require(getattr(self, name) >= 1, f"model.{name}: must be >= 1, got {getattr(self, name)}")
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_query_groups: {self.num_query_groups} does not divide "
            f"model.num_attention_heads {self.num_attention_heads}",
        )
        require(
            self.moe_router_topk <= self.num_experts,
            f"model.moe_router_topk: {self.moe_router_topk} exceeds model.num_experts {self.num_experts}",
        )
        require(self.rope_theta > 0, f"model.rope_theta: must be > 0, got {self.rope_theta}")
        require(self.rms_norm_eps > 0, f"model.rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        require(self.moe_aux_loss_coeff >= 0,
                f"model.moe_aux_loss_coeff: must be >= 0, got {self.moe_aux_loss_coeff}")
        validate_recompute(self)


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Parallel degrees. Data parallelism is what the world size leaves over (derived, not set)."""

    tensor: int = 1
    pipeline: int = 1
    expert: int = 1
    expert_tensor: Optional[int] = None
    """Tensor parallelism inside each expert (Megatron ETP); None means parallel.tensor, as in
    Megatron. With expert == 1 it must equal tensor (see ``__post_init__``)."""
    context: int = 1
    """Context parallelism (GSPO training): every sequence's tokens are split over this many
    ranks in the zigzag layout (chunks r and 2 * context - 1 - r of each sequence on rank r), K/V
    all-gathered in attention, the sequence ratio made exact by one per-sequence all-reduce. SFT
    refuses it."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """How Transformer Engine's attention exchanges K/V under context parallelism (GPU, TE spec):
    p2p (ring, overlapped with compute), all_gather, or a2a (Ulysses-style all-to-all of heads).
    The local spec (no TE, e.g. CPU) always all-gathers K/V (model/attention.py)."""
    sequence_parallel: bool = False
    """Required (true) when tensor > 1 with MoE: Megatron refuses MoE + TP without it."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline stages (Megatron's field): layers on the first stage; the other stages
    share the rest evenly. null: every stage holds num_layers / pipeline."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline stages: layers on the last stage (which also holds the output layer)."""
    overlap_grad_reduce: bool = False
    """Megatron DDP: overlap the gradient reduce-scatter / all-reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Megatron DDP: overlap the distributed optimizer's parameter all-gather with the next
    forward pass (needs optim.use_distributed_optimizer and overlap_grad_reduce). The weight
    sync, checkpoints and the HF export force the gather before they read the weights
    (train_step.gather_params): between the updates of a step it overlaps, at the step's end
    it does not."""
    distributed_timeout_minutes: int = 60
    """Timeout of every training process group (NCCL's watchdog on GPUs): the longest a
    collective may wait, e.g. for a slow rank's checkpoint write."""
    control_timeout_minutes: int = 480
    """Timeout of the host-side control group (gloo, whole world) that carries rank 0's rollout
    batches and stop flags: ranks 1..N wait in it during rollouts, evaluations and disk syncs."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context", "distributed_timeout_minutes",
                     "control_timeout_minutes"):
            require(getattr(self, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"parallel.{name}: must be >= 1, got {value}")
            require(value is None or self.pipeline > 1,
                    f"parallel.{name}: only with parallel.pipeline > 1 (got pipeline 1)")
        require(not (self.overlap_param_gather and not self.overlap_grad_reduce),
                "parallel.overlap_param_gather: needs parallel.overlap_grad_reduce: true "
                "(Megatron overlaps the gather only together with the reduce)")
        require(self.expert_tensor is None or self.expert_tensor >= 1,
                f"parallel.expert_tensor: must be >= 1, got {self.expert_tensor}")
        # Megatron marks expert weights as expert-parallel (reduced over the expert-data-parallel
        # group) only when expert > 1. With expert == 1 they are reduced like dense weights, over
        # the data-parallel group, which does not contain the other tensor-parallel ranks: with
        # expert_tensor < tensor their gradients (each TP rank sees other tokens) are never summed.
        require(
            not (self.expert == 1 and self.expert_tensor_size() != self.tensor),
            f"parallel.expert_tensor: {self.expert_tensor} must equal parallel.tensor "
            f"{self.tensor} when parallel.expert is 1 (or leave it unset): Megatron would not "
            "sum the expert gradients over the tensor-parallel ranks",
        )
        require(
            not (self.tensor > 1 and not self.sequence_parallel),
            f"parallel.sequence_parallel: must be true when parallel.tensor is {self.tensor} "
            "(Megatron requires sequence parallelism for MoE with tensor parallelism)",
        )

    def expert_tensor_size(self) -> int:
        """Effective expert tensor-parallel size (``expert_tensor`` or, when unset, ``tensor``)."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor


def validate_recompute(model: ModelConfig) -> None:
    """Megatron's recompute rules, as ConfigErrors naming the field (and no silently ignored
    field: method / num_layers / modules need the granularity that reads them)."""
    g = model.recompute_granularity
    if g is None:
        for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            require(getattr(model, name) is None,
                    f"model.{name}: only with model.recompute_granularity (full or selective); "
                    "unset it or set the granularity")
        return
    if g == "full":
        require(model.recompute_method is not None,
                "model.recompute_method: required with model.recompute_granularity full "
                "(uniform or block)")
        require(model.recompute_num_layers is not None and model.recompute_num_layers >= 1,
                f"model.recompute_num_layers: must be >= 1 with full recompute, got "
                f"{model.recompute_num_layers}")
        require(model.recompute_modules is None,
                "model.recompute_modules: only with model.recompute_granularity selective")
        return
    require(model.recompute_method is None and model.recompute_num_layers is None,
            "model.recompute_method / model.recompute_num_layers: only with "
            "model.recompute_granularity full (selective recomputes recompute_modules in every "
            "layer)")
    allowed = ("core_attn", "layernorm", "moe_act", "moe")
    bad = [m for m in (model.recompute_modules or []) if m not in allowed]
    require(not bad, f"model.recompute_modules: {bad} not among {list(allowed)} (Qwen3-MoE has "
                     "no MLA, dense MLP or shared experts)")
    require(model.recompute_modules is None or len(model.recompute_modules) > 0,
            "model.recompute_modules: empty; list at least one module or unset recompute")


def pipeline_stage_layers(model: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """Transformer layers on each pipeline stage (Megatron's uneven-stage rule: the first / last
    stage hold parallel.num_layers_in_{first,last}_pipeline_stage when set, the stages between
    share the rest evenly)."""
    pp, total = parallel.pipeline, model.num_layers
    first, last = (parallel.num_layers_in_first_pipeline_stage,
                   parallel.num_layers_in_last_pipeline_stage)
    if first is None and last is None:
        require(total % pp == 0,
                f"parallel.pipeline: {pp} does not divide model.num_layers {total} (or set "
                "parallel.num_layers_in_first/last_pipeline_stage for uneven stages)")
        return [total // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = total - (first or 0) - (last or 0)
    fields = "parallel.num_layers_in_first_pipeline_stage / _last_pipeline_stage"
    require(middle_layers >= 0, f"{fields}: {first} + {last} exceed model.num_layers {total}")
    require(bool(middle_layers) == bool(middle_stages),
            f"{fields}: leave {middle_layers} layers for {middle_stages} middle stages of "
            f"parallel.pipeline {pp}; each stage needs at least one layer")
    require(middle_stages == 0 or middle_layers % middle_stages == 0,
            f"{fields}: the {middle_layers} remaining layers do not split evenly over the "
            f"{middle_stages} other stages of parallel.pipeline {pp}")
    each = middle_layers // middle_stages if middle_stages else 0
    return ([first] if first is not None else []) + [each] * middle_stages + (
        [last] if last is not None else [])


def padded_vocab_size(model: ModelConfig, tensor_parallel: int) -> int:
    """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tensor_parallel``."""
    multiple = model.make_vocab_size_divisible_by * tensor_parallel
    return int(math.ceil(model.vocab_size / multiple) * multiple)
