"""Typed run configuration: one dataclass per concern, loaded from YAML with ``--set`` overrides.

A YAML file has up to eight sections, each a dataclass below::

    model:    ModelConfig      the Qwen3-MoE architecture
    parallel: ParallelConfig   tensor / pipeline / expert / context parallel sizes
    gspo:     GSPOConfig       the loss and the RL step (see ../shared/docs/gspo_math.md)
    rollout:  RolloutConfig    sampling and the rollout servers
    optim:    OptimConfig      optimizer and learning-rate schedule
    run:      RunSettings      seed, steps, batch sizes, output, logging
    data:     DataConfig       prompts: a synthetic task, or JSONL / Parquet files
    reward:   RewardConfig     how responses are scored (built-ins, a function, an HTTP service)

``load_config(path, overrides=["gspo.eps_high=5e-4"])`` returns a validated :class:`Config`.
Unknown keys are rejected with their full path, values are type-checked, and every invalid value
raises :class:`ConfigError` naming the field and the fix. Nothing is rewritten silently: derived
values (padded vocabulary, data-parallel size) are computed by functions, never stored back.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    """An invalid configuration; the message names the field (``section.key``) and the fix."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A Qwen3-style MoE decoder (names follow Hugging Face's ``Qwen3MoeConfig``)."""

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
    sequence_parallel: bool = False
    """Required (true) when tensor > 1 with MoE: Megatron refuses MoE + TP without it."""

    def __post_init__(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context"):
            _require(getattr(self, name) >= 1, f"parallel.{name}: must be >= 1, got {getattr(self, name)}")
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


VARIANTS = ("gspo", "gspo_token", "grpo", "seq_ratio_token_clip", "token_ratio_seq_clip",
            "seq_ratio_unnormalized")


@dataclass(kw_only=True, slots=True)
class GSPOConfig:
    """The loss and the RL step (../shared/docs/gspo_math.md)."""

    variant: Literal["gspo", "gspo_token", "grpo", "seq_ratio_token_clip", "token_ratio_seq_clip",
                     "seq_ratio_unnormalized"] = "gspo"
    eps_low: float = 3e-4
    """Sequence clip range, low side (paper: 3e-4)."""
    eps_high: float = 4e-4
    """Sequence clip range, high side (paper: 4e-4)."""
    token_eps_low: float = 0.2
    """Token clip range for the token-clip variants (grpo, seq_ratio_token_clip)."""
    token_eps_high: float = 0.28
    group_size: int = 8
    """G: responses sampled per prompt."""
    normalize_std: bool = True
    """Divide advantages by the group's population std (False = Dr.GRPO)."""
    leave_one_out: bool = False
    """Baseline each response by the mean of the other G-1 rewards."""
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where log pi_old comes from: recomputed by Megatron, or the rollout engine's (with the
    sequence-level mismatch weight)."""
    mismatch_correction: bool = True
    """Weight each sequence by the truncated importance weight
    min(exp(mean_t(log pi_old_trainer - log pi_rollout)), mismatch_cap) (detached): corrects for
    the rollout engine sampling from a slightly different distribution than the trainer computes.
    Needs old_logprobs: recompute (with rollout log-probs as pi_old the weight is 1)."""
    mismatch_cap: float = 2.0
    """Cap of the sequence-level rollout/trainer truncated importance weight."""
    updates_per_rollout: int = 1
    """k: optimizer steps (mini-batches) per rollout batch."""
    dynamic_sampling: bool = False
    """Drop zero-std groups and sample more prompts to fill the batch."""

    def __post_init__(self) -> None:
        for name in ("eps_low", "eps_high", "token_eps_low", "token_eps_high"):
            value = getattr(self, name)
            _require(0 < value < 1, f"gspo.{name}: must be in (0, 1), got {value}")
        _require(self.group_size >= 2,
                 f"gspo.group_size: must be >= 2 for group-relative advantages, got {self.group_size}")
        _require(self.kl_coef >= 0, f"gspo.kl_coef: must be >= 0, got {self.kl_coef}")
        _require(self.mismatch_cap >= 1, f"gspo.mismatch_cap: must be >= 1, got {self.mismatch_cap}")
        _require(not (self.mismatch_correction and self.old_logprobs == "rollout"),
                 "gspo.mismatch_correction: needs gspo.old_logprobs: recompute (with the rollout's "
                 "log-probs as pi_old the weight is always 1); set it to false")
        _require(self.updates_per_rollout >= 1,
                 f"gspo.updates_per_rollout: must be >= 1, got {self.updates_per_rollout}")

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) for the configured variant: token ranges for token-clip variants."""
        if self.variant in ("grpo", "seq_ratio_token_clip"):
            return self.token_eps_low, self.token_eps_high
        return self.eps_low, self.eps_high


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
    deterministic: bool = False
    """Batch-invariant rollouts: each local server decodes one request at a time, so a sample
    depends only on its prompt, seed and the weights (slower; what an exact resume comparison
    needs). SGLang's counterpart is --enable-deterministic-inference."""
    eval_samples_per_prompt: int = 4
    """n: samples per held-out prompt; pass@1 is averaged over them."""
    weight_sync: Literal["disk", "tensor", "distributed"] = "disk"
    """How weights reach the servers after each training phase: safetensors on a shared
    filesystem, tensors in the request (colocated servers), or a broadcast group (NCCL on GPUs,
    gloo on CPU)."""
    weight_sync_dir: Optional[str] = None
    """Shared directory for disk sync (default: <run.output_dir>/weights)."""
    weight_sync_bucket_mb: int = 512
    """Upper bound of one weight bucket in MiB."""
    max_concurrency: int = 64
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        _require(self.mode != "external" or bool(self.router_url),
                 "rollout.router_url: required when rollout.mode is 'external'")
        _require(self.num_servers >= 1, f"rollout.num_servers: must be >= 1, got {self.num_servers}")
        _require(self.tp_size >= 1, f"rollout.tp_size: must be >= 1, got {self.tp_size}")
        _require(self.temperature > 0, f"rollout.temperature: must be > 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, f"rollout.top_k: must be -1 or >= 1, got {self.top_k}")
        _require(self.eval_samples_per_prompt >= 1,
                 f"rollout.eval_samples_per_prompt: must be >= 1, got {self.eval_samples_per_prompt}")
        _require(self.weight_sync_bucket_mb >= 1,
                 f"rollout.weight_sync_bucket_mb: must be >= 1, got {self.weight_sync_bucket_mb}")
        _require(self.max_new_tokens >= 1,
                 f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Megatron optimizer and learning-rate schedule."""

    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    use_distributed_optimizer: bool = False
    """Megatron's distributed (ZeRO-1) optimizer; needs CUDA."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        _require(self.clip_grad >= 0, f"optim.clip_grad: must be >= 0 (0 disables), got {self.clip_grad}")
        _require(self.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")


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
    log_interval: int = 1
    save_interval: int = 0
    eval_interval: int = 0

    def __post_init__(self) -> None:
        for name in ("num_steps", "micro_batch_size", "global_batch_size", "seq_length", "log_interval"):
            _require(getattr(self, name) >= 1, f"run.{name}: must be >= 1, got {getattr(self, name)}")
        _require(self.global_batch_size % self.micro_batch_size == 0,
                 f"run.global_batch_size: {self.global_batch_size} is not a multiple of "
                 f"run.micro_batch_size {self.micro_batch_size}")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where prompts come from: a synthetic ``task`` (no files needed) or prompt files.

    Exactly one of ``task`` and ``train_path`` is set; a file run writes ``task: null``. The
    datasets are built by ``pipeline.data.build_datasets``.
    """

    task: Optional[Literal["addition"]] = "addition"
    """Synthetic task: "addition" = exact sums "a+b=" -> "c" (byte-level tokens); null with
    data.train_path."""
    digits: int = 2
    """Addition operands have up to this many digits."""
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
        _require(1 <= self.digits <= 9, f"data.digits: must be in [1, 9], got {self.digits}")
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


REWARD_KINDS = ("exact_match", "math", "addition", "function", "http")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How a response is scored (``pipeline.rewards.build_reward``)."""

    kind: Optional[Literal["exact_match", "math", "addition", "function", "http"]] = None
    """exact_match: stripped response == label; math: equivalence through math-verify;
    addition: the synthetic task's exact match (up to the end token); function: reward.function;
    http: a reward service at reward.url. null: the reward of data.task (required with files)."""
    function: Optional[str] = None
    """kind function: "package.module:function" or "path/to/file.py:function", called as
    fn(prompt, response_ids, response_text) -> float."""
    url: Optional[str] = None
    """kind http: the service's URL; POST a JSON list of {prompt, response, label, prompt_index,
    sample_index}, answered by {"rewards": [...]}."""
    timeout_s: float = 30.0
    """kind http: seconds per request before it counts as failed."""
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

    def __post_init__(self) -> None:
        validate_model_parallel(self.model, self.parallel)
        validate_data_reward(self.data, self.reward)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _to_plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Check that every parallel size divides what it splits; the error names both fields."""
    tp, pp, ep = parallel.tensor, parallel.pipeline, parallel.expert
    etp = parallel.expert_tensor_size()
    checks = [
        (model.num_query_groups % tp == 0,
         f"parallel.tensor: {tp} does not divide model.num_query_groups {model.num_query_groups}"),
        (model.num_attention_heads % tp == 0,
         f"parallel.tensor: {tp} does not divide model.num_attention_heads {model.num_attention_heads}"),
        (model.num_layers % pp == 0,
         f"parallel.pipeline: {pp} does not divide model.num_layers {model.num_layers}"),
        (model.num_experts % ep == 0,
         f"parallel.expert: {ep} does not divide model.num_experts {model.num_experts}"),
        (model.moe_ffn_hidden_size % etp == 0,
         f"parallel.expert_tensor: {etp} does not divide model.moe_ffn_hidden_size "
         f"{model.moe_ffn_hidden_size}"),
    ]
    errors = [message for ok, message in checks if not ok]
    if errors:
        raise ConfigError("; ".join(errors))


def validate_data_reward(data: DataConfig, reward: RewardConfig) -> None:
    """The reward must fit the prompts: files need an explicit kind, labels where it reads them."""
    _require(not (reward.kind is None and data.train_path is not None),
             f"reward.kind: required with data.train_path (one of {', '.join(REWARD_KINDS)})")
    _require(not (reward.kind in ("exact_match", "math", "addition") and data.task is None
                  and data.label_key is None),
             f"data.label_key: reward.kind {reward.kind!r} compares with a label; set the label field")
    _require(not (reward.kind == "addition" and data.tokenizer_dir is not None),
             "reward.kind: 'addition' reads byte-level responses; with data.tokenizer_dir use "
             "exact_match")


def padded_vocab_size(model: ModelConfig, tensor_parallel: int) -> int:
    """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tensor_parallel``."""
    multiple = model.make_vocab_size_divisible_by * tensor_parallel
    return int(math.ceil(model.vocab_size / multiple) * multiple)


# ----------------------------------------------------------------------------------------------
# Loading


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
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
        _require(value in allowed, f"{path}: {value!r} is not one of {list(allowed)}")
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
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} does not match {tp}")
    if origin in (list, tuple):
        _require(isinstance(value, (list, tuple)), f"{path}: expected a list, got {value!r}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        _require(isinstance(value, bool), f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool),
                 f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string
                value = float(value)
            except ValueError:
                pass
        _require(isinstance(value, (int, float)) and not isinstance(value, bool),
                 f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        _require(isinstance(value, str), f"{path}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    prefix = f"{path}." if path else ""
    _require(isinstance(data, dict), f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError("; ".join(
            f"{prefix}{k}: unknown key (valid keys: {', '.join(sorted(names))})" for k in unknown))
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
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
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""


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
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path}: not valid YAML: {err}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of sections")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as err:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{err}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
