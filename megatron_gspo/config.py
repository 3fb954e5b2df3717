"""Typed run configuration: one dataclass per concern, loaded from YAML with ``--set`` overrides.

A YAML file has up to nine sections, each a dataclass below::

    model:    ModelConfig      the Qwen3-MoE architecture
    parallel: ParallelConfig   tensor / pipeline / expert / context parallel sizes
    gspo:     GSPOConfig       the loss and the RL step (see docs/gspo_math.md)
    rollout:  RolloutConfig    sampling and the rollout servers
    optim:    OptimConfig      optimizer and learning-rate schedule
    run:      RunSettings      seed, steps, batch sizes, output, logging
    data:     DataConfig       prompts: a synthetic task, or JSONL / Parquet files
    reward:   RewardConfig     how responses are scored (built-ins, a function, an HTTP service)
    parity:   ParityConfig     the parity watchdog: servers vs trainer after every weight sync

``load_config(path, overrides=["gspo.eps_high=5e-4"])`` returns a validated :class:`Config`.
Unknown keys are rejected with their full path, values are type-checked, and every invalid value
raises :class:`ConfigError` naming the field and the fix. Nothing is rewritten silently: derived
values (padded vocabulary, data-parallel size) are computed by functions, never stored back.

Every check that the file alone decides runs here, in ``Config.__post_init__`` (one section's
fields in that section's ``__post_init__``, cross-section ones in the ``validate_*`` functions it
calls), so ``megatron-gspo config``, ``launch slurm``, ``sft`` and ``train`` accept and reject the
same files with the same message. The one check that needs the world size (the data-parallel
split of a batch) is :func:`validate_data_parallel`, called where the world is known.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml

from megatron_gspo.errors import InputError
from megatron_gspo.loss.variants import (SEQUENCE_RANGE, SPECS, CispoParams, GmpoParams,
                                         SapoParams, Variant)
from megatron_gspo.yaml_load import MAX_SHOWN, YAMLLoadError, shown
from megatron_gspo.yaml_load import load as load_yaml


class ConfigError(ValueError, InputError):
    """An invalid configuration; the message names the field (``section.key``) and the fix."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


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
            _require(getattr(self, name) >= 1, f"model.{name}: must be >= 1, got {getattr(self, name)}")
        _require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_query_groups: {self.num_query_groups} does not divide "
            f"model.num_attention_heads {self.num_attention_heads}",
        )
        _require(
            self.moe_router_topk <= self.num_experts,
            f"model.moe_router_topk: {self.moe_router_topk} exceeds model.num_experts {self.num_experts}",
        )
        _require(self.rope_theta > 0, f"model.rope_theta: must be > 0, got {self.rope_theta}")
        _require(self.rms_norm_eps > 0, f"model.rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        _require(self.moe_aux_loss_coeff >= 0,
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
    forward pass (needs optim.use_distributed_optimizer and overlap_grad_reduce)."""
    distributed_timeout_minutes: int = 60
    """Timeout of every training process group (NCCL's watchdog on GPUs): the longest a
    collective may wait, e.g. for a slow rank's checkpoint write."""
    control_timeout_minutes: int = 480
    """Timeout of the host-side control group (gloo, whole world) that carries rank 0's rollout
    batches and stop flags: ranks 1..N wait in it during rollouts, evaluations and disk syncs."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context", "distributed_timeout_minutes",
                     "control_timeout_minutes"):
            _require(getattr(self, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"parallel.{name}: must be >= 1, got {value}")
            _require(value is None or self.pipeline > 1,
                     f"parallel.{name}: only with parallel.pipeline > 1 (got pipeline 1)")
        _require(not (self.overlap_param_gather and not self.overlap_grad_reduce),
                 "parallel.overlap_param_gather: needs parallel.overlap_grad_reduce: true "
                 "(Megatron overlaps the gather only together with the reduce)")
        _require(self.expert_tensor is None or self.expert_tensor >= 1,
                 f"parallel.expert_tensor: must be >= 1, got {self.expert_tensor}")
        # Megatron marks expert weights as expert-parallel (reduced over the expert-data-parallel
        # group) only when expert > 1. With expert == 1 they are reduced like dense weights, over
        # the data-parallel group, which does not contain the other tensor-parallel ranks: with
        # expert_tensor < tensor their gradients (each TP rank sees other tokens) are never summed.
        _require(
            not (self.expert == 1 and self.expert_tensor_size() != self.tensor),
            f"parallel.expert_tensor: {self.expert_tensor} must equal parallel.tensor "
            f"{self.tensor} when parallel.expert is 1 (or leave it unset): Megatron would not "
            "sum the expert gradients over the tensor-parallel ranks",
        )
        _require(
            not (self.tensor > 1 and not self.sequence_parallel),
            f"parallel.sequence_parallel: must be true when parallel.tensor is {self.tensor} "
            "(Megatron requires sequence parallelism for MoE with tensor parallelism)",
        )

    def expert_tensor_size(self) -> int:
        """Effective expert tensor-parallel size (``expert_tensor`` or, when unset, ``tensor``)."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor


@dataclass(kw_only=True, slots=True)
class GSPOConfig:
    """The loss and the RL step (docs/gspo_math.md)."""

    # the flat keys of the variants' parameters before they got sections of their own
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "cispo_eps_low": "cispo.eps_low", "cispo_eps_high": "cispo.eps_high",
        "sapo_tau_pos": "sapo.tau_pos", "sapo_tau_neg": "sapo.tau_neg",
        "gmpo_log_eps_low": "gmpo.log_eps_low", "gmpo_log_eps_high": "gmpo.log_eps_high"}

    variant: Variant = "gspo"
    """One of ``megatron_gspo.loss.variants.VARIANTS`` (names and meaning in that registry)."""
    eps_low: float = 3e-4
    """Sequence clip range, low side (paper: 3e-4)."""
    eps_high: float = 4e-4
    """Sequence clip range, high side (paper: 4e-4)."""
    token_eps_low: float = 0.2
    """Token clip range, low side, for the variants that clip the per-token ratio w_it (grpo,
    seq_ratio_token_clip: ``variants.TOKEN_RATIO_CLIP_VARIANTS``); the others use eps_low."""
    token_eps_high: float = 0.28
    """Token clip range, high side (see token_eps_low)."""
    cispo: CispoParams = field(default_factory=CispoParams)
    """cispo's own clip range of the IS weight: ``gspo.cispo.eps_low`` (in (0, 1]; 1.0, the
    default: no lower bound) and ``gspo.cispo.eps_high`` (4.0) (``variants.CispoParams``)."""
    sapo: SapoParams = field(default_factory=SapoParams)
    """sapo's gate temperatures: ``gspo.sapo.tau_pos`` (1.0) and ``gspo.sapo.tau_neg`` (1.05)
    (``variants.SapoParams``)."""
    gmpo: GmpoParams = field(default_factory=GmpoParams)
    """gmpo's own clip range in log space: ``gspo.gmpo.log_eps_low`` and ``gspo.gmpo.log_eps_high``
    (0.4 / 0.4) (``variants.GmpoParams``)."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    normalize_std: bool = True
    """Divide advantages by the group's population std (False = Dr.GRPO)."""
    leave_one_out: bool = False
    """Baseline each response by the mean of the other G-1 rewards."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to a frozen reference policy, per sequence the token-mean of
    exp(ref - lp) - (ref - lp) - 1. With kl_coef > 0 the RL trainer keeps a second, frozen copy of
    the initial policy (run.init_from, or the run.seed initialisation) in the same parallel layout
    (its weights' memory once more) and computes its log-probs with Megatron for every rollout
    batch. 0: no reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (per sequence the token-mean entropy of the policy)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where log pi_old of the ratio s_i comes from: the objective under staleness
    (docs/gspo_math.md, "The objective under staleness"). ``recompute``: the DECOUPLED form;
    pi_old is the proximal policy, the trainer's weights at the start of the step, recomputed by
    Megatron (a forward pass per rollout batch), and the behaviour weight m_i (mismatch_correction)
    corrects for the policy the tokens were sampled with (the rollout engine's numerics and, with
    asynchronous rollout, older weight versions). ``rollout``: the BYPASS form; the rollout
    engine's recorded per-token log-probs are pi_old (the ratio is taken against the behaviour
    policy, no separate weight)."""
    mismatch_correction: Optional[bool] = None
    """Multiply each sequence's objective by the behaviour weight
    m_i = min(exp(mean_t(log pi_old - log pi_rollout)), mismatch_cap), detached, from the rollout's
    per-token log-probs (each token's from the weights that sampled it). None (default): on with
    old_logprobs: recompute (the decoupled objective), off with rollout (there pi_old IS the
    rollout's log-probs and the weight would be 1). true needs old_logprobs: recompute; false with
    recompute clips against the proximal policy and ignores the behaviour policy."""
    mismatch_cap: float = 2.0
    """C, the truncation of the behaviour weight m_i (>= 1; an upper cap only, as truncated IS).
    m_i is a geometric mean over tokens like s_i, so its spread does not grow with the length: at
    2.0 a sequence is truncated only when its mean per-token log-ratio exceeds ln 2 = 0.69, far
    beyond what the engine's numerics or a few versions of staleness give at normal learning
    rates, and no sequence weighs more than twice an on-policy one (also the default cap of verl's
    and slime's truncated importance sampling, which they apply per token)."""
    updates_per_rollout: int = 1
    """k: optimizer steps (mini-batches) per rollout batch."""
    dynamic_sampling: bool = False
    """Drop zero-std groups and sample more prompts to fill the batch."""
    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Routing replay of the MoE routers (docs/routing.md; Megatron-Core's RouterReplay):
    ``none``: every forward routes by its own router; ``old`` (R2): the training forwards of a
    step use the top-k experts recorded in the old-log-prob forward of the same tokens;
    ``rollout`` (R3): the old-log-prob forward and the training forwards use the experts the
    rollout servers routed each token to (the batch's ``routed_experts``; SGLang's
    ``return_routed_experts``). Not with activation recompute that re-runs the router
    (model.recompute_granularity full, or selective with ``moe``)."""
    routing_metrics: bool = True
    """After the last update of each rollout batch, one forward-only pass over the batch for
    ``routing_change_frac*`` (top-k expert sets of the old vs the updated policy) and
    ``token_log_ratio_var`` / ``seq_log_ratio_var`` (docs/routing.md); false skips that pass (one
    forward per step less) and those metrics."""

    def __post_init__(self) -> None:
        for name in ("eps_low", "eps_high", "token_eps_low", "token_eps_high"):
            value = getattr(self, name)
            _require(0 < value < 1, f"gspo.{name}: must be in (0, 1), got {value}")
        _require(0 < self.cispo.eps_low <= 1,
                 f"gspo.cispo.eps_low: must be in (0, 1] (1: no lower bound), got {self.cispo.eps_low}")
        for section, name in (("cispo", "eps_high"), ("sapo", "tau_pos"), ("sapo", "tau_neg"),
                              ("gmpo", "log_eps_low"), ("gmpo", "log_eps_high")):
            value = getattr(getattr(self, section), name)
            _require(value > 0 and math.isfinite(value), f"gspo.{section}.{name}: must be > 0, got {value}")
        _require(self.group_size >= 2,
                 f"gspo.group_size: must be >= 2 for group-relative advantages, got {self.group_size}")
        _require(self.kl_coef >= 0, f"gspo.kl_coef: must be >= 0, got {self.kl_coef}")
        _require(self.mismatch_cap >= 1, f"gspo.mismatch_cap: must be >= 1, got {self.mismatch_cap}")
        _require(not (self.mismatch_correction and self.old_logprobs == "rollout"),
                 "gspo.mismatch_correction: true needs gspo.old_logprobs: recompute (with the "
                 "rollout's log-probs as pi_old, the bypass form, the weight is always 1); leave it "
                 "unset or set it to false")
        _require(self.updates_per_rollout >= 1,
                 f"gspo.updates_per_rollout: must be >= 1, got {self.updates_per_rollout}")

    def uses_behaviour_weight(self) -> bool:
        """Whether the loss multiplies J_i by the behaviour weight m_i (mismatch_correction, None
        resolved by old_logprobs: on for recompute, off for rollout)."""
        if self.mismatch_correction is None:
            return self.old_logprobs == "recompute"
        return self.mismatch_correction

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) for the configured variant: the token range for the variants that
        clip the per-token ratio w_it, the sequence range for the others (gspo_token included:
        its tokens' ratios have the value s_i); cispo's and gmpo's own, from their sections
        (gmpo: log space); sapo has no clip (the sequence range is returned and unused)."""
        values = []
        for dotted in SPECS[self.variant].eps_fields or SEQUENCE_RANGE:  # e.g. "cispo.eps_low"
            value = self
            for name in dotted.split("."):
                value = getattr(value, name)
            values.append(value)
        return values[0], values[1]

    def variant_params(self) -> Any:
        """``gspo_loss``'s ``params`` for the configured variant: the section named after it when
        the registry gives the variant a params class (``VariantSpec.params``: sapo's), else None."""
        return None if SPECS[self.variant].params is None else getattr(self, self.variant)


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """The section ``rollout.weight_sync``: how the trainer's weights reach the rollout servers
    after each training phase (``pipeline.weights.push``)."""

    transport: Literal["disk", "tensor", "distributed"] = "disk"
    """safetensors shards on a shared filesystem, written by every sending rank in parallel
    (``disk``: ``pipeline.weights.disk``); SGLang's update_weights_from_tensor with CUDA-IPC /
    shared-memory handles, for servers on the trainer's node (``tensor``; the local server needs
    --allow-pickled-tensors); or a broadcast group per sending rank with every GPU of every
    server, flattened buckets (``distributed``: NCCL on GPUs, gloo on CPU)."""
    senders: Literal["auto", "rank", "node", "stage"] = "auto"
    """Which training ranks send the weights (``megatron_gspo.hf.gather.sender_ranks``): ``rank``:
    every rank that holds a tensor whole (or a TP group's first rank) sends its own (pipeline x
    expert senders; the disk transport's shards are written by all of them in parallel);
    ``node``: one rank per node and pipeline stage sends what its node's ranks of that stage hold
    (moved to it inside the node first); ``stage``: one rank per pipeline stage (slime's choice).
    With ``transport: distributed`` each sender is one NCCL update group that every
    rollout-server GPU joins, its buffers outside SGLang's mem_fraction_static (``megatron-gspo
    plan`` counts them): fewer senders, fewer groups. ``auto``: ``node`` for ``distributed``,
    ``rank`` for ``disk`` and ``tensor`` (:meth:`resolved_senders`)."""
    dir: Optional[str] = None
    """Shared directory for the disk transport (default: <run.output_dir>/weights)."""
    bucket_mb: int = 512
    """Upper bound of one weight bucket in MiB (each sending rank holds two buckets)."""
    dtype: Optional[Literal["bfloat16", "float32"]] = None
    """The dtype of the weights on the wire (the servers cast to their own); null: the
    parameters' dtype (model.params_dtype)."""
    master_address: Optional[str] = None
    """distributed: the address the servers reach a sending rank's broadcast group at; null: the
    address of that rank's own network interface that routes to the first server (right on
    every node). Set it only when that route is not the one the servers can use back."""
    verify: bool | Literal["auto"] = "auto"
    """After every sync, compare each bucket's checksum reported by the servers (every TP rank)
    with the trainer's; a mismatch fails the sync. Checksums are an extension that only the
    project's local rollout server offers (negotiated through its ``/server_info``; real SGLang
    has none): ``auto`` verifies wherever every server offers it and says once that it cannot
    otherwise; ``true`` requires it (an error against SGLang); ``false`` never verifies."""
    delta: bool = False
    """bf16 delta sync: send, per tensor, only the elements whose bf16 bits changed since the last
    sync (int32 index + value) when that is smaller, with a full sync every full_every syncs and
    whenever a server's weight version is not the last one sent. Needs dtype: bfloat16 (or bf16
    parameters), the tensor or distributed transport and the local rollout server (an extension
    negotiated through its ``/server_info``; SGLang has no delta format, so the first sync to an
    SGLang server stops with an error naming this field). Costs one bf16 copy of the weights on
    the sending ranks."""
    full_every: int = 10
    """K: with delta, every K-th sync sends every tensor in full."""

    FORMER_SCALAR: ClassVar[str] = "transport"
    """The field that ``rollout.weight_sync: <plain value>`` used to set (refused, naming it)."""

    def resolved_senders(self) -> str:
        """``senders`` with ``auto`` resolved."""
        if self.senders != "auto":
            return self.senders
        return "node" if self.transport == "distributed" else "rank"

    def __post_init__(self) -> None:
        _require(self.bucket_mb >= 1,
                 f"rollout.weight_sync.bucket_mb: must be >= 1, got {self.bucket_mb}")
        _require(self.full_every >= 1,
                 f"rollout.weight_sync.full_every: must be >= 1, got {self.full_every}")
        _require(not self.delta or self.transport in ("tensor", "distributed"),
                 "rollout.weight_sync.delta: needs rollout.weight_sync.transport tensor or "
                 f"distributed (got {self.transport}: a disk sync rewrites whole shards)")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Sampling parameters and where the rollout servers are."""

    mode: Literal["embedded", "external"] = "embedded"
    """embedded: the run starts local rollout servers and the router; external: use router_url."""
    router_url: Optional[str] = None
    num_servers: int = 2
    tp_size: int = 1
    """Tensor-parallel size of one SGLang server (its --tp-size); a server larger than a node spans
    tp_size / GPUs-per-node nodes. The Slurm launcher derives the server count from it."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 32
    colocated: bool = False
    """The rollout servers share the training GPUs: their memory (weights, KV cache) is released
    before each training phase and resumed after it (SGLang's release/resume_memory_occupation;
    start SGLang with --enable-memory-saver). Required by `launch slurm --rollout-nodes 0`."""
    local_server_device: str = "cpu"
    """Embedded mode: where the project's local rollout servers run their model (their
    ``--device``): cpu, or cuda[:N] to share the trainer's GPU (what bench/gpu_smoke.py runs on
    one GPU). SGLang servers (external mode, ``launch slurm``) choose their own GPUs."""
    deterministic: bool = False
    """Batch-invariant rollouts: each local server decodes one request at a time and keeps no
    prefix cache (--disable-radix-cache: a cache hit's prefill differs from a cold one in the
    last bits), so a sample depends only on its prompt, seed and the weights (slower; what an
    exact resume comparison needs). SGLang's counterpart is --enable-deterministic-inference."""
    eval_samples_per_prompt: int = 4
    """n: samples per held-out prompt; pass@1 is averaged over them."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How the weights reach the servers after each training phase (the section
    ``rollout.weight_sync``)."""
    max_concurrency: int = 512
    """Requests the trainer's rollout client keeps in flight at once (to the router, or to the
    servers directly). Keep it at least the rollout batch (prompts x group_size, capped by the
    servers' combined --max-running-requests): below that a server idles while requests wait in
    the client and the step takes a second wave of decoding (64 for 128 samples of ~150 tokens on
    2 local servers: 3.4 s instead of 2.6 s, docs/performance.md)."""
    request_timeout_s: float = 600.0
    """Bound of one HTTP request to a rollout server or the router: a /generate request, and
    every call of a weight sync (pause, each bucket's update, a disk reload - which every SGLang
    TP rank reads whole, minutes at 235B - flush, continue)."""
    min_servers: int = 1
    """The run goes on while at least this many rollout servers are alive: a server that dies is
    dropped from the router and the weight sync (embedded mode: restarted, synced to the current
    weights, then back in the router; ``pipeline.servers.pool``); with fewer left the run stops
    with an error."""
    outage_timeout_s: float = 300.0
    """How long a rollout waits for a live server when every one is gone (embedded: restarting;
    external: until the router has a worker again); then the run stops naming each server and
    why it is gone. A stop signal ends the wait at once."""
    # -- SGLang server flags (the Slurm launcher passes them; names as SGLang spells them) --
    mem_fraction_static: Optional[float] = None
    """SGLang --mem-fraction-static: the share of GPU memory for weights and KV cache; null:
    SGLang's own default."""
    ep_size: int = 1
    """SGLang --ep-size: expert parallelism inside one server (divides rollout.tp_size)."""
    enable_dp_attention: bool = False
    """Data-parallel attention inside each server, rollout.dp_size attention groups (what large
    MoE servers use): SGLang 0.5.23's --attn-dp-size rollout.dp_size (its old spelling
    --enable-dp-attention --dp-size N resolves to the same). The server stays one data-parallel
    replica, so every rollout.weight_sync.transport works."""
    dp_size: int = 1
    """With enable_dp_attention: the attention data-parallel size (divides rollout.tp_size).
    Without it: SGLang --dp-size, data-parallel replicas inside one server (each replica
    tp_size / dp_size GPUs); SGLang updates such a server's weights only from disk, so
    rollout.weight_sync.transport tensor / distributed need dp_size 1."""
    cuda_graph_max_bs: Optional[int] = None
    """SGLang --cuda-graph-max-bs-decode: the largest decode batch captured in a CUDA graph."""
    async_: Literal["off", "one_step", "full"] = "off"
    """YAML key ``async`` (a Python keyword, hence the field's name): whether generation overlaps
    training (docs/async.md). ``off``: rollout, training, weight sync, one after the other.
    ``one_step``: step n+1's rollout runs (rank 0, a thread: ``pipeline.sources.one_step``) while step n
    trains, with the weights of step n-1; the weights are pushed once per step, after that
    rollout has finished; every sample is exactly one version stale, which the decoupled
    objective corrects (``gspo.old_logprobs: recompute`` with the behaviour weight). ``full``:
    generation never stops (``pipeline.sources.stream``): groups are admitted while at most
    rollout.max_staleness versions ahead of the trainer, the weights are pushed after every
    update with the servers paused in SGLang's ``retract`` mode (requests in flight continue
    under the new weights: partial rollouts), and each step trains the oldest complete groups.
    Not with rollout.colocated (the servers give their memory to training while it runs)."""
    max_staleness: int = 1
    """eta: the most weight versions between the policy that generated any token of a trained
    sample and the policy being trained. ``full`` admits groups so that no sample exceeds it and
    never trains one that would (re-queued, generated again under the new weights, counted);
    ``one_step`` is exactly 1 stale (needs >= 1); ``off`` is 0."""

    YAML_KEYS: ClassVar[dict] = {"async": "async_"}
    """YAML key -> field name, where the two differ."""
    MOVED_KEYS: ClassVar[dict] = {f"weight_sync_{name}": f"weight_sync.{name}" for name in (
        "senders", "dir", "bucket_mb", "dtype", "master_address", "verify", "delta", "full_every")}
    """Old YAML key -> its key now (refused, naming the new key)."""

    def __post_init__(self) -> None:
        _require(self.max_staleness >= 0,
                 f"rollout.max_staleness: must be >= 0, got {self.max_staleness}")
        _require(self.async_ != "one_step" or self.max_staleness >= 1,
                 f"rollout.max_staleness: {self.max_staleness} is below rollout.async one_step's "
                 "staleness (every sample is exactly 1 version stale); use async: off, or full")
        _require(self.async_ == "off" or not self.colocated,
                 f"rollout.async: {self.async_} needs the rollout servers on their own devices; "
                 "rollout.colocated servers release their memory while the trainer runs")
        _require(self.mode != "external" or bool(self.router_url),
                 "rollout.router_url: required when rollout.mode is 'external'")
        _require(self.num_servers >= 1, f"rollout.num_servers: must be >= 1, got {self.num_servers}")
        _require(self.tp_size >= 1, f"rollout.tp_size: must be >= 1, got {self.tp_size}")
        _require(re.fullmatch(r"cpu|cuda(:\d+)?", self.local_server_device) is not None,
                 f"rollout.local_server_device: {self.local_server_device!r} is not cpu, cuda or "
                 "cuda:N")
        _require(self.min_servers >= 1, f"rollout.min_servers: must be >= 1, got {self.min_servers}")
        _require(self.outage_timeout_s > 0,
                 f"rollout.outage_timeout_s: must be > 0, got {self.outage_timeout_s}")
        _require(self.mode != "embedded" or self.min_servers <= self.num_servers,
                 f"rollout.min_servers: {self.min_servers} exceeds rollout.num_servers "
                 f"{self.num_servers} (the embedded run's servers)")
        _require(self.temperature > 0, f"rollout.temperature: must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, f"rollout.top_k: must be -1 or >= 1, got {self.top_k}")
        _require(self.eval_samples_per_prompt >= 1,
                 f"rollout.eval_samples_per_prompt: must be >= 1, got {self.eval_samples_per_prompt}")
        _require(self.max_new_tokens >= 1,
                 f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        _require(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
                 f"rollout.mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("ep_size", "dp_size"):
            value = getattr(self, name)
            _require(value >= 1 and self.tp_size % value == 0,
                     f"rollout.{name}: {value} does not divide rollout.tp_size {self.tp_size}")
        _require(not self.enable_dp_attention or self.dp_size > 1,
                 "rollout.enable_dp_attention: needs rollout.dp_size > 1 (the number of attention "
                 f"data-parallel groups), got {self.dp_size}")
        transport = self.weight_sync.transport
        _require(self.enable_dp_attention or self.dp_size == 1 or transport == "disk",
                 f"rollout.dp_size: {self.dp_size} data-parallel replicas per server (no "
                 "rollout.enable_dp_attention): SGLang updates such servers only from disk, not "
                 f"with rollout.weight_sync.transport {transport} (its update_weights_from_"
                 "distributed / _tensor require dp_size 1); use rollout.weight_sync.transport: "
                 "disk, or set rollout.enable_dp_attention: true for data-parallel attention")
        _require(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
                 f"rollout.cuda_graph_max_bs: must be >= 1, got {self.cuda_graph_max_bs}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Megatron optimizer and learning-rate schedule.

    The schedule is Megatron-Core's ``OptimizerParamScheduler``, advanced once per optimizer step.
    It counts optimizer steps: a run has ``run.num_steps x gspo.updates_per_rollout`` of them in RL
    (k mini-batch updates per rollout batch), ``run.num_steps`` in SFT, and the decay spans all of
    them (Megatron's ``lr_decay_steps``); ``warmup_steps`` is counted in run steps and becomes
    ``warmup_steps x k`` optimizer steps in RL. Optimizer step j (from 0) uses
    ``lr(j)``: ``lr * j / W`` for ``j <= W`` (warmup, W optimizer steps; the first step at 0, as
    in Megatron), then ``min_lr + c(j) (lr - min_lr)`` with ``c = 1 - r`` (linear) or
    ``(1 + cos(pi r)) / 2`` (cosine), ``r = (j - W) / (D - W)``, D the optimizer steps of the run
    (so min_lr would be reached at step D, one after the last); constant keeps ``lr``.
    """

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    """Peak learning rate (after warmup; the whole run with lr_decay_style constant)."""
    min_lr: float = 0.0
    """Where linear / cosine decay is heading at the end of the run; must be 0 with constant."""
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 0
    """Linear warmup from 0 to lr over the first this many run steps (see the class docstring);
    must be < run.num_steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: keep lr, or decay it linearly / along a half cosine to min_lr."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed (ZeRO-1) optimizer; needs CUDA."""
    optimizer_cpu_offload: bool = False
    """Megatron's optimizer CPU offload (HybridDeviceOptimizer): optimizer_offload_fraction of the
    fp32 master weights and Adam moments live and are updated on the host (GPU only; needs the
    distributed optimizer)."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the optimizer state kept on the host."""
    use_precision_aware_optimizer: bool = False
    """Megatron's precision-aware optimizer (Transformer Engine's FusedAdam, or the offloaded
    optimizer): the optimizer reads bf16 weights and fp32 gradients directly (GPU only; adam and
    the distributed optimizer)."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        _require(self.clip_grad >= 0, f"optim.clip_grad: must be >= 0 (0 disables), got {self.clip_grad}")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        _require(self.min_lr == 0 or self.lr_decay_style != "constant",
                 f"optim.min_lr: {self.min_lr} is only used by a decaying schedule and "
                 "optim.lr_decay_style is 'constant'; set lr_decay_style linear or cosine, or "
                 "min_lr 0")
        _require(0 <= self.optimizer_offload_fraction <= 1,
                 f"optim.optimizer_offload_fraction: must be in [0, 1], got {self.optimizer_offload_fraction}")
        for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
            _require(not getattr(self, name) or self.use_distributed_optimizer,
                     f"optim.{name}: needs optim.use_distributed_optimizer: true (Megatron offers "
                     "it only inside the distributed optimizer)")
        _require(not self.use_precision_aware_optimizer or self.optimizer == "adam",
                 f"optim.use_precision_aware_optimizer: only with optim.optimizer adam, got "
                 f"{self.optimizer!r}")


LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "mlflow")
"""What ``run.loggers`` may list (``pipeline.observe.metrics`` and ``pipeline.observe.trackers``; docs/metrics.md)."""


def _require_name(value: Optional[str], path: str) -> None:
    _require(value is None or bool(value.strip()), f"{path}: empty; name it or leave it null")


@dataclass(kw_only=True, slots=True)
class WandbConfig:
    """Weights & Biases, when run.loggers lists wandb (``pipeline.observe.trackers.WandbTracker``)."""

    project: Optional[str] = None
    """W&B project; null: the WANDB_PROJECT environment variable, else "megatron-gspo"."""
    entity: Optional[str] = None
    """W&B team or user; null: WANDB_ENTITY, else the logged-in account's default entity."""
    mode: Optional[Literal["online", "offline"]] = None
    """online: upload while the run goes (needs `wandb login` and a network); offline: write
    the run under <dir>/wandb/offline-run-* for a later `wandb sync`. null: the WANDB_MODE
    environment variable when set (as verl and slime do), else offline: cluster nodes often
    have no internet, and an offline run never waits for a login or a network."""
    dir: Optional[str] = None
    """Where W&B writes (its wandb/ folder is made inside); null: WANDB_DIR, else
    run.output_dir."""

    def __post_init__(self) -> None:
        for name in ("project", "entity", "dir"):
            _require_name(getattr(self, name), f"run.wandb.{name}")


@dataclass(kw_only=True, slots=True)
class MLflowConfig:
    """MLflow, when run.loggers lists mlflow (``pipeline.observe.trackers.MLflowTracker``)."""

    tracking_uri: Optional[str] = None
    """Tracking store: a server (http://...), a database (sqlite:///...) or a directory
    (file:...); null: MLFLOW_TRACKING_URI, else the file store file:<run.output_dir>/mlruns
    (offline; `mlflow ui --backend-store-uri <run.output_dir>/mlruns` shows it)."""
    experiment: Optional[str] = None
    """Experiment name; null: MLFLOW_EXPERIMENT_NAME, else "megatron-gspo" (made if missing)."""

    def __post_init__(self) -> None:
        _require_name(self.tracking_uri, "run.mlflow.tracking_uri")
        _require_name(self.experiment, "run.mlflow.experiment")


@dataclass(kw_only=True, slots=True)
class RunSettings:
    """Seed, length, batch sizes, output and logging of one run."""

    seed: int = 1234
    output_dir: str = "runs/tiny"
    init_from: Optional[str] = None
    """The initial policy: a Hugging Face directory (e.g. the SFT result) or a Megatron torch_dist
    checkpoint (``megatron-gspo convert hf-to-mcore``; any layout); null: random weights from
    run.seed."""
    num_steps: int = 20
    micro_batch_size: int = 4
    """Sequences per micro-batch per data-parallel rank."""
    global_batch_size: int = 16
    """Sequences per step over all data-parallel ranks: one optimizer step in SFT; the rollout
    batch in RL (global_batch_size / gspo.group_size prompts), which gspo.updates_per_rollout
    splits into mini-batches."""
    seq_length: int = 64
    """Token positions of a training row (prompt + response, right-padded)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """RL updates (and their log-prob recompute): pack whole sequences, without padding, into
    micro-batches of at most this many tokens per GPU (per context-parallel rank; Megatron/slime's
    "max tokens per GPU"), passed to Megatron as packed sequences (THD), with the same number of
    micro-batches on every data-parallel rank and their token counts balanced (greedy LPT).
    run.micro_batch_size is then unused by RL (the batch checks still hold it, as one file serves
    SFT, which reads it, and RL: 1 always passes them). null: right-padded rows of run.seq_length,
    run.micro_batch_size per micro-batch. Must be at least the longest sequence (prompt +
    response) once padded for context parallelism. SFT always uses padded rows."""
    log_interval: int = 1
    """Print a progress line every this many steps (and at the last); metrics.jsonl and
    TensorBoard get every step."""
    save_interval: int = 0
    """Write a checkpoint (model, optimizer, LR schedule, RNG, data position) every this many
    steps and at the last step; ``--resume`` continues from the newest. RL also checkpoints on
    SIGTERM / SIGUSR1 and at the end when it is 0; SFT with 0 writes none (its result is the
    Hugging Face export). RL's last checkpoint is written before the final Hugging Face export
    (<output_dir>/hf): the disk must hold both, and a run that fails writing the checkpoint
    exports nothing."""
    eval_interval: int = 0
    """Evaluate on the held-out prompts every this many steps (and at the start and the end);
    0: RL never evaluates, SFT only at the start and the end."""
    keep_checkpoints: Optional[int] = None
    """After each checkpoint, delete all but the newest this many in <output_dir>/checkpoints
    (never the one the run resumed from); null: keep every checkpoint."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where rank 0 logs every step's metrics (docs/metrics.md): jsonl (<output_dir>/metrics.jsonl,
    required: plots, --resume and the parity checks read it), tensorboard (<output_dir>/tb),
    wandb (Weights & Biases, run.wandb; pip install 'megatron-gspo[wandb]') and mlflow (run.mlflow;
    pip install 'megatron-gspo[mlflow]'). W&B and MLflow get a step once no resumed run can
    redo it: at each checkpoint and at the end of the run; a resumed run continues the same W&B /
    MLflow run (ids in <output_dir>/trackers.json)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings (only with wandb in run.loggers)."""
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    """MLflow settings (only with mlflow in run.loggers)."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "micro_batch_size", "global_batch_size", "seq_length", "log_interval"):
            _require(getattr(self, name) >= 1, f"run.{name}: must be >= 1, got {getattr(self, name)}")
        _require(bool(self.output_dir.strip()),
                 "run.output_dir: empty; name the run directory (checkpoints, metrics, logs)")
        _require(self.init_from is None or bool(self.init_from.strip()),
                 "run.init_from: empty; name a Hugging Face directory or a Megatron checkpoint, "
                 "or null for random weights from run.seed")
        _require(self.global_batch_size % self.micro_batch_size == 0,
                 f"run.global_batch_size: {self.global_batch_size} is not a multiple of "
                 f"run.micro_batch_size {self.micro_batch_size}")
        _require(self.keep_checkpoints is None or self.keep_checkpoints >= 1,
                 f"run.keep_checkpoints: must be >= 1 (or null to keep all), got "
                 f"{self.keep_checkpoints}")
        _require(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
                 f"run.max_tokens_per_micro_batch: must be >= 1 (or null for padded rows), got "
                 f"{self.max_tokens_per_micro_batch}")
        validate_loggers(self)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from: a synthetic ``task`` (no files needed) or prompt files.

    Exactly one of ``task`` and ``train_path`` is set; a file run writes ``task: null``. The
    datasets are built by ``pipeline.scoring.data.build_datasets``.
    """

    task: Optional[Literal["addition", "carry_addition", "tool_addition"]] = "addition"
    """Synthetic task (byte-level tokens): "addition" = exact sums "a+b=" -> "c";
    "carry_addition" = the same sums with a digit-by-digit carry trace before the answer (long
    responses, ~10 tokens per column; the reward checks the final answer only);
    "tool_addition" = sums of two digits-digit numbers, the reference response a call of the
    calculator tool pipeline.scoring.tasks:add, its response and the answer (with tools.functions, the
    multi-turn demo: docs/tools.md); null with data.train_path."""
    digits: int = 2
    """addition: operands have up to this many digits; carry_addition: the number of columns is
    drawn from [ceil(digits / 4), digits] (digits 24: responses of 62-243 tokens);
    tool_addition: operands have exactly this many digits."""
    num_eval_prompts: Optional[int] = 64
    """Held-out prompts evaluated every run.eval_interval steps (and at the start and the end):
    the task's "eval" split, or the first this many rows of data.eval_path (null: all rows)."""
    train_path: Optional[str] = None
    """Training prompts: JSONL (one JSON object per line) or Parquet, one prompt per row."""
    eval_path: Optional[str] = None
    """Held-out prompts, same format and keys as train_path; without it a file run has no
    evaluation."""
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    """File format; auto: from the suffix (.jsonl / .ndjson / .json, .parquet)."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a string, or a list of chat messages {role, content}.
    Dotted paths reach into nested objects ("question.text")."""
    label_key: Optional[str] = "label"
    """Row field holding the reference answer (string or number; dotted allowed); null: no labels
    (only a reward.kind that needs none: function or http)."""
    tokenizer_dir: Optional[str] = None
    """Local Hugging Face tokenizer directory (read with local_files_only, never downloaded);
    null: byte-level tokens (id = UTF-8 byte), as the synthetic task uses."""
    apply_chat_template: bool = True
    """With tokenizer_dir: wrap each prompt in the tokenizer's chat template, with the generation
    prompt. Without it prompts are encoded as plain text."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch from (run.seed, epoch)."""
    skip_malformed: bool = False
    """Count and report malformed rows instead of stopping at the first one (never silent)."""

    def __post_init__(self) -> None:
        _require(1 <= self.digits <= 32, f"data.digits: must be in [1, 32], got {self.digits}")
        _require(self.num_eval_prompts is None or self.num_eval_prompts >= 1,
                 f"data.num_eval_prompts: must be >= 1 (or null for all rows of data.eval_path), "
                 f"got {self.num_eval_prompts}")
        _require((self.task is None) != (self.train_path is None),
                 "data.task: exactly one of data.task and data.train_path must be set "
                 f"(got task {self.task!r}, train_path {self.train_path!r}); "
                 "write task: null to train on a prompt file")
        if self.task is not None:
            _require(self.num_eval_prompts is not None,
                     f"data.num_eval_prompts: must be set for data.task {self.task!r}")
            for name in ("eval_path", "tokenizer_dir"):
                _require(getattr(self, name) is None,
                         f"data.{name}: only used with data.train_path (data.task {self.task!r} "
                         "generates its own byte-level prompts and eval split); unset it")
        _require(bool(self.prompt_key and self.prompt_key.strip(".")),
                 f"data.prompt_key: must name a field, got {self.prompt_key!r}")
        _require(self.label_key is None or bool(self.label_key.strip(".")),
                 f"data.label_key: must name a field or be null, got {self.label_key!r}")


RewardKind = Literal["exact_match", "math", "addition", "carry_addition", "tool_addition",
                     "function", "http"]
REWARD_KINDS: tuple[str, ...] = typing.get_args(RewardKind)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How a response is scored (``pipeline.scoring.rewards.build_reward``)."""

    kind: Optional[RewardKind] = None
    """exact_match: stripped response == label; math: equivalence through math-verify;
    addition: the synthetic task's exact match (up to the end token); carry_addition: exact
    match of the final segment (the answer after the carry trace); tool_addition: exact match
    of a trajectory's last model turn with the sum; function: reward.function;
    http: a reward service at reward.url. null: the reward of data.task (required with files)."""
    function: Optional[str] = None
    """kind function: "package.module:function" or "path/to/file.py:function", called as
    fn(prompt, response_ids, response_text) -> float, in a worker process of rank 0 (started
    once, kept for the run) with reward.timeout_s per sample; a stop signal abandons a call."""
    url: Optional[str] = None
    """kind http: the service's URL; POST a JSON list of {prompt, response, label, prompt_index,
    sample_index}, answered by {"rewards": [...]}."""
    timeout_s: float = 30.0
    """The deadline of a reward, in seconds. kind function: per sample; the function runs in a
    worker process (``pipeline.scoring.rewards.FunctionReward``), which is killed when a call passes the
    deadline, and the sample fails with a RewardError naming the function and the deadline
    (then on_error: "raise" stops the run, "zero" counts it as 0 in train/reward_failures).
    kind http: per request (each retry has its own). The built-in rewards have none (math
    bounds math-verify's work itself)."""
    max_retries: int = 2
    """kind http: further attempts after a connection error, timeout, 429 or 5xx answer."""
    batch_size: int = 64
    """kind http: samples per request."""
    on_error: Literal["raise", "zero"] = "raise"
    """An exception or a non-finite reward: raise (naming the sample) or count it as 0 and report
    it in the step's metrics."""

    def __post_init__(self) -> None:
        _require(self.kind != "function" or bool(self.function),
                 "reward.function: required when reward.kind is 'function' "
                 "(\"package.module:function\" or \"file.py:function\")")
        _require(self.function is None or ":" in self.function,
                 f"reward.function: expected \"module:function\", got {self.function!r}")
        _require(self.kind != "http" or bool(self.url),
                 "reward.url: required when reward.kind is 'http'")
        _require(self.url is None or self.url.startswith(("http://", "https://")),
                 f"reward.url: expected an http:// or https:// URL, got {self.url!r}")
        _require(self.timeout_s > 0, f"reward.timeout_s: must be > 0, got {self.timeout_s}")
        _require(self.max_retries >= 0, f"reward.max_retries: must be >= 0, got {self.max_retries}")
        _require(self.batch_size >= 1, f"reward.batch_size: must be >= 1, got {self.batch_size}")


@dataclass(kw_only=True, slots=True)
class ToolsConfig:
    """Multi-turn, tool-using rollouts (docs/tools.md): each training and evaluation sample is a
    trajectory of model turns and tool responses (``pipeline.generation.multiturn``), token-in / token-out,
    the loss over the model's tokens only. Empty ``functions`` and no ``environment``: one
    prompt, one response."""

    functions: list[str] = field(default_factory=list)
    """The tools, as "package.module:function" (the tool's name is the function's); each call
    runs fn(**arguments) out of process in the sandbox (``pipeline.tools.sandbox``)."""
    environment: Optional[str] = None
    """"package.module:Class" of a custom environment (``pipeline.generation.environment.Environment``),
    constructed for each trajectory as Class(executor=..., tool_format=...) (executor: the
    sandbox of tools.functions); null: ``ToolEnvironment`` (tool calls in, tool responses out,
    the first turn without a call ends the trajectory)."""
    format: Literal["qwen3", "plain"] = "qwen3"
    """How tool responses are appended (``pipeline.generation.tool_calls.FORMATS``): qwen3: Qwen3's chat
    template glue (<|im_start|>user <tool_response>... <|im_end|> and the generation prompt);
    plain: <tool_response>...</tool_response> only (a vocabulary without special tokens)."""
    max_turns: int = 4
    """Model turns per trajectory (end reason max_turns)."""
    max_tokens: Optional[int] = None
    """Output tokens per trajectory, the model's and the appended ones together (end reason
    max_tokens); null: run.seq_length + 1 - the prompt's length, so every trajectory fits."""
    max_tool_time_s: float = 30.0
    """Tool wall time per trajectory, all calls together; a call may not run past what is left,
    and when it is spent the trajectory ends (end reason tool_error)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one tool call (the call fails with error timeout, its worker process
    is killed and replaced; the trajectory goes on)."""
    memory_mb: int = 512
    """Memory one call may allocate: its worker's address-space limit (RLIMIT_AS) is what the
    worker maps after importing the tools plus this many MiB (error memory past it)."""
    output_bytes: int = 4096
    """The most bytes a call may print and return together (error output_limit past it)."""
    workers: int = 4
    """Sandbox worker processes on rank 0: tool calls that run at once."""

    def enabled(self) -> bool:
        return bool(self.functions) or self.environment is not None

    def __post_init__(self) -> None:
        for i, spec in enumerate(self.functions):
            _require(":" in spec and all(spec.split(":", 1)),
                     f"tools.functions[{i}]: expected \"package.module:function\", got {spec!r}")
        _require(self.environment is None or ":" in self.environment,
                 f"tools.environment: expected \"package.module:Class\", got {self.environment!r}")
        _require(self.max_turns >= 1, f"tools.max_turns: must be >= 1, got {self.max_turns}")
        _require(self.max_tokens is None or self.max_tokens >= 1,
                 f"tools.max_tokens: must be >= 1, got {self.max_tokens}")
        for name in ("max_tool_time_s", "timeout_s"):
            _require(getattr(self, name) > 0, f"tools.{name}: must be > 0, got {getattr(self, name)}")
        for name in ("memory_mb", "output_bytes", "workers"):
            _require(getattr(self, name) >= 1, f"tools.{name}: must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class ParityConfig:
    """The parity watchdog (docs/parity.md): after every weight sync, fixed probe sequences are
    scored by every rollout server and by the trainer, and the per-token log-prob gap is logged
    (``parity/*`` in metrics.jsonl); past ``max_gap_mean`` the weights are synced once more and
    checked again, and if the gap persists the run stops with an error naming the gap, the
    server and the threshold."""

    enabled: bool = False
    """Run the watchdog after every weight sync (the initial one included)."""
    num_probes: int = 8
    """Probe sequences: prompts drawn once with run.seed from the held-out prompts (the training
    prompts without them), each with a fixed response generated greedily (at most
    rollout.max_new_tokens tokens) by the servers at the first check, saved to
    <run.output_dir>/parity_probes.json and reused for the whole run (and on --resume)."""
    max_gap_mean: float = 0.05
    """Threshold on a server's mean per-token |log pi_server - log pi_trainer| over the probes'
    response tokens (natural log). fp32 on the CPU gives about 1e-7 (1e-3 is a safe CPU
    setting); bf16 GPU kernels are expected near 1e-2 (the default 0.05 is meant for GPUs; check
    it against a healthy run's parity/logprob_gap_mean)."""

    def __post_init__(self) -> None:
        _require(self.num_probes >= 1, f"parity.num_probes: must be >= 1, got {self.num_probes}")
        _require(math.isfinite(self.max_gap_mean) and self.max_gap_mean > 0,
                 f"parity.max_gap_mean: must be a positive number, got {self.max_gap_mean}")


@dataclass(kw_only=True, slots=True)
class Config:
    """The whole run: one field per YAML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunSettings = field(default_factory=RunSettings)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def __post_init__(self) -> None:
        validate_model_parallel(self.model, self.parallel)
        validate_parallel_optim(self.parallel, self.optim)
        validate_data_reward(self.data, self.reward)
        validate_batches(self.run, self.gspo)
        validate_schedule(self.optim, self.run)
        validate_weight_sync(self.rollout, self.model)
        validate_routing_replay(self.gspo, self.model)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Check that every parallel size divides what it splits; the error names both fields."""
    tp, pp, ep = parallel.tensor, parallel.pipeline, parallel.expert
    etp = parallel.expert_tensor_size()
    stage_error = None
    try:
        stages = pipeline_stage_layers(model, parallel)
    except ConfigError as err:
        stage_error, stages = str(err), None
    if stages is not None and model.recompute_method == "uniform":
        # Megatron checkpoints chunks [i, i + n) of each stage's layers and indexes past the
        # stage when n does not divide its layer count
        uneven = sorted({n for n in stages if n % model.recompute_num_layers})
        if uneven:
            stage_error = (f"model.recompute_num_layers: {model.recompute_num_layers} does not "
                           f"divide the {uneven} layers of a pipeline stage (recompute_method "
                           "uniform recomputes chunks of that many layers)")
    checks = [
        (model.num_query_groups % tp == 0,
         f"parallel.tensor: {tp} does not divide model.num_query_groups {model.num_query_groups}"),
        (model.num_attention_heads % tp == 0,
         f"parallel.tensor: {tp} does not divide model.num_attention_heads {model.num_attention_heads}"),
        (stage_error is None, stage_error),
        (model.num_experts % ep == 0,
         f"parallel.expert: {ep} does not divide model.num_experts {model.num_experts}"),
        (model.moe_ffn_hidden_size % etp == 0,
         f"parallel.expert_tensor: {etp} does not divide model.moe_ffn_hidden_size "
         f"{model.moe_ffn_hidden_size}"),
    ]
    errors = [message for ok, message in checks if not ok]
    if errors:
        raise ConfigError("; ".join(errors))


def pipeline_stage_layers(model: ModelConfig, parallel: ParallelConfig) -> list[int]:
    """Transformer layers on each pipeline stage (Megatron's uneven-stage rule: the first / last
    stage hold parallel.num_layers_in_{first,last}_pipeline_stage when set, the stages between
    share the rest evenly)."""
    pp, total = parallel.pipeline, model.num_layers
    first, last = (parallel.num_layers_in_first_pipeline_stage,
                   parallel.num_layers_in_last_pipeline_stage)
    if first is None and last is None:
        _require(total % pp == 0,
                 f"parallel.pipeline: {pp} does not divide model.num_layers {total} (or set "
                 "parallel.num_layers_in_first/last_pipeline_stage for uneven stages)")
        return [total // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = total - (first or 0) - (last or 0)
    fields = "parallel.num_layers_in_first_pipeline_stage / _last_pipeline_stage"
    _require(middle_layers >= 0, f"{fields}: {first} + {last} exceed model.num_layers {total}")
    _require(bool(middle_layers) == bool(middle_stages),
             f"{fields}: leave {middle_layers} layers for {middle_stages} middle stages of "
             f"parallel.pipeline {pp}; each stage needs at least one layer")
    _require(middle_stages == 0 or middle_layers % middle_stages == 0,
             f"{fields}: the {middle_layers} remaining layers do not split evenly over the "
             f"{middle_stages} other stages of parallel.pipeline {pp}")
    each = middle_layers // middle_stages if middle_stages else 0
    return ([first] if first is not None else []) + [each] * middle_stages + (
        [last] if last is not None else [])


def validate_parallel_optim(parallel: ParallelConfig, optim: OptimConfig) -> None:
    _require(not (parallel.overlap_param_gather and not optim.use_distributed_optimizer),
             "parallel.overlap_param_gather: needs optim.use_distributed_optimizer: true (it "
             "overlaps the distributed optimizer's parameter all-gather)")


def validate_recompute(model: ModelConfig) -> None:
    """Megatron's recompute rules, as ConfigErrors naming the field (and no silently ignored
    field: method / num_layers / modules need the granularity that reads them)."""
    g = model.recompute_granularity
    if g is None:
        for name in ("recompute_method", "recompute_num_layers", "recompute_modules"):
            _require(getattr(model, name) is None,
                     f"model.{name}: only with model.recompute_granularity (full or selective); "
                     "unset it or set the granularity")
        return
    if g == "full":
        _require(model.recompute_method is not None,
                 "model.recompute_method: required with model.recompute_granularity full "
                 "(uniform or block)")
        _require(model.recompute_num_layers is not None and model.recompute_num_layers >= 1,
                 f"model.recompute_num_layers: must be >= 1 with full recompute, got "
                 f"{model.recompute_num_layers}")
        _require(model.recompute_modules is None,
                 "model.recompute_modules: only with model.recompute_granularity selective")
        return
    _require(model.recompute_method is None and model.recompute_num_layers is None,
             "model.recompute_method / model.recompute_num_layers: only with "
             "model.recompute_granularity full (selective recomputes recompute_modules in every "
             "layer)")
    allowed = ("core_attn", "layernorm", "moe_act", "moe")
    bad = [m for m in (model.recompute_modules or []) if m not in allowed]
    _require(not bad, f"model.recompute_modules: {bad} not among {list(allowed)} (Qwen3-MoE has "
                      "no MLA, dense MLP or shared experts)")
    _require(model.recompute_modules is None or len(model.recompute_modules) > 0,
             "model.recompute_modules: empty; list at least one module or unset recompute")


def validate_loggers(run: RunSettings) -> None:
    """Known names, each once, jsonl among them; run.wandb / run.mlflow only with their logger."""
    choices = ", ".join(LOGGERS)
    for i, name in enumerate(run.loggers):
        _require(name in LOGGERS, f"run.loggers[{i}]: unknown logger {shown(name)} (choose from "
                                  f"{choices})")
        _require(name not in run.loggers[:i], f"run.loggers[{i}]: {name!r} is listed twice")
    _require("jsonl" in run.loggers,
             f"run.loggers: must include jsonl (got {run.loggers}): metrics.jsonl is what plots, "
             "--resume and the parity checks read")
    for name, default in (("wandb", WandbConfig()), ("mlflow", MLflowConfig())):
        _require(getattr(run, name) == default or name in run.loggers,
                 f"run.{name}: set, but run.loggers does not list {name}; add it to run.loggers "
                 f"or unset run.{name}")


def validate_routing_replay(gspo: GSPOConfig, model: ModelConfig) -> None:
    """Replay sets each router's experts before a micro-batch's forward; a recompute in the
    backward would re-run the router against the next micro-batch's experts."""
    if gspo.routing_replay == "none":
        return
    recomputes_router = model.recompute_granularity == "full" or (
        model.recompute_granularity == "selective" and "moe" in (model.recompute_modules or []))
    _require(not recomputes_router,
             f"gspo.routing_replay: {gspo.routing_replay} is not supported with activation "
             "recompute that re-runs the router (model.recompute_granularity full, or selective "
             "with 'moe' in model.recompute_modules); use core_attn / moe_act or no recompute")


def validate_data_reward(data: DataConfig, reward: RewardConfig) -> None:
    """The reward must fit the prompts: files need an explicit kind, labels where it reads them."""
    _require(not (reward.kind is None and data.train_path is not None),
             f"reward.kind: required with data.train_path (one of {', '.join(REWARD_KINDS)})")
    _require(not (reward.kind in ("exact_match", "math", "addition", "carry_addition",
                                  "tool_addition")
                  and data.task is None and data.label_key is None),
             f"data.label_key: reward.kind {reward.kind!r} compares with a label; set the label field")
    _require(not (reward.kind in ("addition", "carry_addition", "tool_addition")
                  and data.tokenizer_dir is not None),
             f"reward.kind: {reward.kind!r} reads byte-level responses; with data.tokenizer_dir "
             "use exact_match")


def validate_batches(run: RunSettings, gspo: GSPOConfig) -> None:
    """The rollout batch must split into groups and into k mini-batches of whole micro-batches.

    One file serves SFT and RL alike (``megatron-gspo config`` cannot know which will read it),
    so these hold for every config; SFT itself only splits run.global_batch_size into
    micro-batches.
    """
    g, gbs, k, mbs = gspo.group_size, run.global_batch_size, gspo.updates_per_rollout, run.micro_batch_size
    _require(gbs % g == 0,
             f"run.global_batch_size: {gbs} is not a multiple of gspo.group_size {g}")
    _require(gbs % k == 0,
             f"run.global_batch_size: {gbs} does not split into gspo.updates_per_rollout = {k} "
             "mini-batches")
    _require((gbs // k) % mbs == 0,
             f"run.global_batch_size: a mini-batch of {gbs} / gspo.updates_per_rollout {k} = "
             f"{gbs // k} sequences is not a multiple of run.micro_batch_size {mbs}")


def validate_schedule(optim: OptimConfig, run: RunSettings) -> None:
    """Megatron's scheduler needs the warmup to end before the run does."""
    _require(optim.warmup_steps < run.num_steps,
             f"optim.warmup_steps: {optim.warmup_steps} must be < run.num_steps {run.num_steps} "
             "(the warmup has to end before the run)")


def validate_sft_context_parallel(parallel: ParallelConfig) -> None:
    """SFT's rows are not split over context-parallel ranks (the RL trainer's are: zigzag rows or
    packed sequences, ``train.batching``); called by the SFT trainer."""
    _require(parallel.context == 1,
             f"parallel.context: {parallel.context}: SFT does not split its rows over "
             "context-parallel ranks (GSPO training does); run SFT with parallel.context 1")


def validate_weight_sync(rollout: RolloutConfig, model: ModelConfig) -> None:
    """A delta sync compares bf16 bits: the wire dtype must be bfloat16."""
    wire = rollout.weight_sync.dtype or model.params_dtype
    _require(not rollout.weight_sync.delta or wire == "bfloat16",
             "rollout.weight_sync.delta: needs bf16 weights on the wire "
             f"(rollout.weight_sync.dtype resolves to {wire}); set rollout.weight_sync.dtype: "
             "bfloat16")


def validate_data_parallel(cfg: Config, data_parallel_size: int) -> None:
    """The check that needs the world: a mini-batch (run.global_batch_size /
    gspo.updates_per_rollout rows) must split into data-parallel size x run.micro_batch_size rows.
    SFT, whose step is the whole global batch, applies the same rule, so that a file accepted for
    one program is accepted for the other (as in :func:`validate_batches`). Called by both
    trainers and by ``megatron-gspo config --world-size``; the message names the fields."""
    dp, mbs, k = data_parallel_size, cfg.run.micro_batch_size, cfg.gspo.updates_per_rollout
    gbs = cfg.run.global_batch_size
    _require((gbs // k) % (dp * mbs) == 0,
             f"run.global_batch_size: a mini-batch of {gbs} / gspo.updates_per_rollout {k} = "
             f"{gbs // k} sequences does not split into data-parallel size {dp} x "
             f"run.micro_batch_size {mbs}")


def padded_vocab_size(model: ModelConfig, tensor_parallel: int) -> int:
    """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tensor_parallel``."""
    multiple = model.make_vocab_size_divisible_by * tensor_parallel
    return int(math.ceil(model.vocab_size / multiple) * multiple)


# ----------------------------------------------------------------------------------------------
# Loading


def _yaml_key(cls: type, name: str) -> str:
    """The YAML key of field ``name`` (``YAML_KEYS`` maps the keys that are not field names)."""
    for key, field_name in getattr(cls, "YAML_KEYS", {}).items():
        if field_name == name:
            return key
    return name


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {_yaml_key(type(value), f.name): _to_plain(getattr(value, f.name))
                for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:
            value = "off"  # YAML 1.1 reads a bare off as false
        _require(isinstance(value, str) == all(isinstance(a, str) for a in allowed)
                 and value in allowed, f"{path}: {shown(value)} is not one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            _require(type(None) in options, f"{path}: must not be null")
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {shown(value)} does not match {tp}")
    if origin in (list, tuple):
        _require(isinstance(value, (list, tuple)), f"{path}: expected a list, got {shown(value)}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        _require(isinstance(value, bool), f"{path}: expected true or false, got {shown(value)}")
        return value
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool),
                 f"{path}: expected an integer, got {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string
                value = float(value)
            except ValueError:
                pass
        _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                 f"{path}: expected a number, got {shown(value)}")
        # no field means anything by inf or nan (YAML's .inf / .nan); they would pass the range
        # checks below or turn every loss into nan much later
        _require(math.isfinite(value), f"{path}: must be a finite number, got {shown(value)}")
        return float(value)
    if tp is str:
        _require(isinstance(value, str), f"{path}: expected a string, got {shown(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _key(key: Any) -> str:
    """A key of the input as an error message shows it (bounded, as every input value)."""
    return key if isinstance(key, str) and len(key) <= MAX_SHOWN else shown(key)


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    prefix = f"{path}." if path else ""
    former = getattr(cls, "FORMER_SCALAR", None)
    _require(isinstance(data, dict) or former is None or isinstance(data, (list, tuple)),
             f"{path}: {shown(data)} is a plain value, but {path} is a section now; write "
             f"{path}.{former}: {shown(data)}")
    _require(isinstance(data, dict), f"{path or 'config'}: expected a mapping, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    names = {_yaml_key(cls, f.name): f.name for f in dataclasses.fields(cls)}
    moved = [k for k in data if k in getattr(cls, "MOVED_KEYS", {})]
    if moved:  # ``MOVED_KEYS``: old key -> its new place, dotted, within the same section
        raise ConfigError("; ".join(f"{prefix}{k}: moved; write {prefix}{cls.MOVED_KEYS[k]}"
                                    for k in moved))
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError("; ".join(
            f"{prefix}{_key(k)}: unknown key (valid keys: {', '.join(sorted(names))})"
            for k in unknown))
    kwargs = {names[k]: _coerce(v, hints[names[k]], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"{path}: {err}") from err


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b=value`` override to the raw mapping (value parsed as YAML)."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: {key} is not a section")
    try:
        node[keys[-1]] = load_yaml(raw, f"--set {override!r}") if raw.strip() else ""
    except YAMLLoadError as err:
        raise ConfigError(str(err)) from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--set {override!r}: the value is not valid YAML ({problem}); quote it "
                          "to pass a string") from None


def config_from_dict(data: dict, overrides: Optional[list[str]] = None) -> Config:
    data = dict(data or {})
    for override in overrides or []:
        apply_override(data, override)
    return _build(Config, data, "")


def load_config(path: str | Path | None, overrides: Optional[list[str]] = None) -> Config:
    """Load a YAML file (or only defaults when ``path`` is None) and apply ``a.b=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = raw[:err.start].count(b"\n") + 1
            raise ConfigError(f"config file {path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                              f"offset {err.start}, line {line}); save it as UTF-8") from None
        try:
            data = load_yaml(text, f"config file {path}")
        except YAMLLoadError as err:
            raise ConfigError(str(err)) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path}: not valid YAML: {err}") from None
        if data is None:
            raise ConfigError(f"config file {path}: empty (no sections); write the sections to "
                              "set, or {} for every default")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of sections")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as err:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{err}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
