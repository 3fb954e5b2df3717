"""Memory planner: the predicted peak memory of a training rank, per pipeline stage, itemised.

``plan_memory(cfg, world_size, gpu_memory_gib)`` is pure arithmetic over the configuration (no
Megatron import, no device): it counts this rank's parameters exactly as Megatron shards them,
then adds what training keeps alive at its peak:

==========================  ==================================================================
weights                     parameters x bytes of ``model.params_dtype`` (twice with
                            ``gspo.kl_coef > 0``: the frozen reference policy)
gradients                   Megatron DDP's gradient buffer: fp32 (``grad_reduce_in_fp32``), all
                            parameters, also with the distributed optimizer
optimizer states            Adam m and v (fp32) plus an fp32 master copy for bf16 weights (SGD:
                            momentum); divided over data-parallel ranks with the distributed
                            optimizer (dense over data x context, experts over expert-data);
                            ``optim.optimizer_offload_fraction`` of it on the host with
                            ``optim.optimizer_cpu_offload``
activations / micro-batch   what autograd saves in one micro-batch's forward (per-token byte
                            counts below), with activation recompute applied
in-flight micro-batches     1F1B: stage s of p holds min(p - s, M) micro-batches' activations
recompute working set       the activations of one recompute chunk rebuilt during backward
logits + log-prob workspace last stage: the output logits, their gradient and the float32
                            chunk workspaces of ``loss.logprobs`` (RL: response positions only);
                            alive before the backward pass, the working set during it: the
                            larger of the two counts
communication & runtime     CUDA context, NCCL communicators and Megatron's MoE buffers (GPU);
                            nothing on CPU (gloo's buffers are negligible)
weight-sync gather buffers  GPU: two flat buckets per sending rank (``megatron_gspo.hf.gather``:
                            sized by the largest bucket the rank sends, at most
                            ``rollout.weight_sync.bucket_mb`` unless one tensor is larger), made
                            at the first sync and held for the whole run
==========================  ==================================================================

Besides the training ranks' GPU peak, the plan reports:

* host memory per rank: with ``optim.optimizer_cpu_offload`` Megatron's HybridDeviceOptimizer keeps,
  for the offloaded fraction of this rank's optimizer shard, an fp32 copy of the parameters, a
  (pinned) copy of their fp32 gradients and the Adam moments: 16 bytes per parameter with Adam
  (4 + 4 + 8). Without the gradient copy the estimate was 25% low (12 of 16 bytes); with
  ``gspo.routing_replay: rollout`` also the routed-experts tensor below;
* the routing-replay batch tensor (``gspo.routing_replay: rollout``): int16 ``[rollout samples,
  run.seq_length, layers, top-k]`` per step, built whole on rank 0 (``pipeline.sources.batch.rollout_phase``);
  each other rank receives only the rows it trains on, 1/dp of it
  (``RLTrainer.scatter_routed_experts``: raw bytes, no pickling); printed with its size also
  when replay is off;
* per rollout-server GPU (``rollout.weight_sync.transport: distributed``): the NCCL buffers of
  the weight update groups. ``pipeline.weights.distributed`` makes one update group per sending
  rank of the gather (:func:`update_group_count`: ``rollout.weight_sync.senders``: one per node and pipeline stage,
  per stage, or per source rank, ``parallel.pipeline x parallel.expert``), and every SGLang
  GPU joins each of them; each is estimated at ``NCCL_UPDATE_GROUP_BYTES`` (below). NCCL
  allocates them with cudaMalloc outside PyTorch's caching allocator, i.e. outside SGLang's
  ``mem_fraction_static`` (which covers its weights and KV-cache pool): they must fit in the
  remaining ``1 - mem_fraction_static`` of the GPU along with CUDA graphs and activations.

Per-token activation bytes (B = bytes of the parameter dtype, h hidden, a/g query/KV heads, d
head width, k experts per token, f expert FFN width, E experts; tensor-parallel sizes divide the
head and FFN dimensions, sequence parallelism the hidden-state tokens):

* ``spec="local"`` (Megatron's local spec with this project's RMSNorm and PackedCoreAttention,
  what runs on CPU): counted from the tensors autograd saves, measured with saved-tensor hooks on
  the tiny model in float32 and bfloat16 (``bench/bench_memory_plan.py``);
* ``spec="te"`` (Transformer Engine on GPUs: fused LayerNorm-Linear, flash attention saving q, k,
  v, out and the log-sum-exp, grouped experts): the same accounting for TE's saved tensors, as
  in docs/performance.md ("memory plan"); it cannot be measured without a GPU.

The planner is checked against peak RSS growth of tiny CPU runs (``bench/bench_memory_plan.py``,
numbers in docs/performance.md) and against published working layouts
(``tests/unit/test_memory_plan.py``). It is a plan, not a measurement: routing imbalance
(``moe_imbalance``), allocator fragmentation and NCCL's buffers are estimates.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo import rollout_plan
from megatron_gspo.config import Config, ConfigError, padded_vocab_size, pipeline_stage_layers
from megatron_gspo.parallel import derive_layout

GIB = float(1 << 30)

CUDA_CONTEXT_BYTES = 1.0 * GIB
"""CUDA context, cuBLAS / TE workspaces of one training process."""
NCCL_BYTES_PER_COMMUNICATOR = 0.25 * GIB
"""NCCL's buffers per communicator (channels x peers x buffer size; a few hundred MB at 8 GPUs
per node with NVLink and InfiniBand)."""
FRAGMENTATION = 0.05
"""The caching allocator's fragmentation, as a fraction of the dynamic (activation) memory."""
LOGPROB_CHUNK = 1024
"""Rows of one float32 chunk of the log-prob kernel (``loss.logprobs.DEFAULT_CHUNK_SIZE``)."""
MIB = float(1 << 20)
NCCL_BUFFSIZE = 4 * MIB
"""NCCL's per-connection buffer of its Simple protocol: ``NCCL_BUFFSIZE``, default 4194304 bytes
(NCCL's environment-variable documentation); the LL / LL128 buffers are smaller and not counted."""
NCCL_CHANNELS = 16
"""Channels NCCL opens per communicator: an assumption (it picks 2-32 from the topology,
``NCCL_MIN_NCHANNELS`` / ``NCCL_MAX_NCHANNELS``; on NVLink + InfiniBand nodes typically 16-32 for
large messages; 16 is what this estimate takes)."""
NCCL_UPDATE_GROUP_BYTES = NCCL_BUFFSIZE * NCCL_CHANNELS * 2
"""One weight-update communicator on one GPU: NCCL_BUFFSIZE x channels x 2 (a ring broadcast's
receive and send connection per channel): 128 MiB. An estimate, like NCCL_BYTES_PER_COMMUNICATOR
for the trainer's (larger: more peers and both directions)."""
ROUTED_EXPERT_BYTES = 2
"""int16: one routed expert id of the routing-replay tensor (``pipeline.generation.routed_experts``)."""


@dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    note: str = ""
    exclusive: bool = False
    """Alive at a different moment than the other exclusive items of the stage (the loss's logits
    before the backward pass, a recompute chunk during it): only the largest counts."""


@dataclass
class StagePlan:
    stage: int
    first_layer: int
    num_layers: int
    params_dense: int
    params_expert: int
    items: list[Item] = field(default_factory=list)

    @property
    def total(self) -> float:
        exclusive = [item.bytes for item in self.items if item.exclusive]
        return (sum(item.bytes for item in self.items if not item.exclusive)
                + max(exclusive, default=0.0))

    @property
    def params(self) -> int:
        return self.params_dense + self.params_expert


@dataclass
class MemoryPlan:
    describe_layout: str
    header: list[str]
    stages: list[StagePlan]
    gpu_memory_gib: float
    host_items: list[Item] = field(default_factory=list)
    """Host memory per training rank (not in the GPU peak)."""
    notes: list[str] = field(default_factory=list)
    """Lines after the stages: the routing-replay tensor, the rollout servers' GPUs."""

    @property
    def host_bytes(self) -> float:
        return sum(item.bytes for item in self.host_items)

    @property
    def peak(self) -> tuple[float, int]:
        worst = max(self.stages, key=lambda s: s.total)
        return worst.total, worst.stage

    @property
    def fits(self) -> bool:
        return self.peak[0] <= self.gpu_memory_gib * GIB

    def verdict(self) -> str:
        peak, stage = self.peak
        return (f"fits: {'yes' if self.fits else 'no'} (peak {peak / GIB:.1f} GiB of "
                f"{self.gpu_memory_gib:g} GiB, stage {stage})")

    def format(self) -> str:
        lines = [f"layout: {self.describe_layout}", *self.header]
        for s in self.stages:
            last = s.first_layer + s.num_layers - 1
            lines.append(f"stage {s.stage}: layers {s.first_layer}-{last} ({s.num_layers}), "
                         f"{s.params / 1e9:.3f} B parameters on this rank "
                         f"(dense {s.params_dense / 1e9:.3f} B, experts {s.params_expert / 1e9:.3f} B)")
            for item in s.items:
                note = f"  {item.note}" if item.note else ""
                mark = " *" if item.exclusive else ""
                lines.append(f"  {item.name + mark:<32s}{item.bytes / GIB:9.2f} GiB{note}")
            lines.append(f"  {'total (peak)':<32s}{s.total / GIB:9.2f} GiB  "
                         "(* not alive together: the larger counts)")
        if self.host_items:
            lines.append(f"host memory per rank: {self.host_bytes / GIB:.1f} GiB")
            for item in self.host_items:
                note = f"  {item.note}" if item.note else ""
                lines.append(f"  {item.name:<32s}{item.bytes / GIB:9.2f} GiB{note}")
        lines.extend(self.notes)
        lines.append(self.verdict())
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Parameters


def layer_params(cfg: Config) -> tuple[int, int]:
    """(dense, expert) parameters of ONE transformer layer on one rank (Megatron's shards)."""
    m, p = cfg.model, cfg.parallel
    tp, ep, etp = p.tensor, p.expert, p.expert_tensor_size()
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    qkv = h * (a + 2 * g) * d // tp
    proj = a * d * h // tp
    norms = 2 * h + 2 * d          # input / pre-MLP norms, per-head q / k norms (replicated)
    router = m.num_experts * h     # replicated over TP
    experts = (m.num_experts // ep) * 3 * h * m.moe_ffn_hidden_size // etp
    return qkv + proj + norms + router, experts


def stage_params(cfg: Config, stage: int) -> tuple[int, int]:
    """(dense, expert) parameters of one rank of pipeline stage ``stage``."""
    m, p = cfg.model, cfg.parallel
    layers = pipeline_stage_layers(m, p)[stage]
    dense, expert = layer_params(cfg)
    dense, expert = dense * layers, expert * layers
    vocab = padded_vocab_size(m, p.tensor) * m.hidden_size // p.tensor
    first, last = stage == 0, stage == p.pipeline - 1
    if first:
        dense += vocab
    if last:
        dense += m.hidden_size  # final norm
        # untied: the output layer; tied: a copy of the embedding on the last stage when the
        # first stage is another rank (Megatron keeps both in sync)
        if not m.tie_word_embeddings or not first:
            dense += vocab
    return dense, expert


# ----------------------------------------------------------------------------------------------
# Activations: bytes saved per token of one micro-batch (per layer unless said otherwise)


@dataclass(frozen=True)
class Shape:
    """What the per-token formulas need, with the parallel sizes folded in."""

    B: int            # bytes of the parameter dtype
    h: int
    a: float          # query heads on this rank
    g: float          # KV heads on this rank
    d: int
    k: int
    f: float          # expert FFN width on this rank
    E: int
    sp: int           # tokens of norm / residual tensors are divided by this (TP with SP)
    route: float      # routed tokens per local token on this rank: k x etp / tp x imbalance


def _shape(cfg: Config, moe_imbalance: float) -> Shape:
    m, p = cfg.model, cfg.parallel
    tp, etp = p.tensor, p.expert_tensor_size()
    B = 2 if m.params_dtype == "bfloat16" else 4
    return Shape(B=B, h=m.hidden_size, a=m.num_attention_heads / tp, g=m.num_query_groups / tp,
                 d=m.head_dim, k=m.moe_router_topk, f=m.moe_ffn_hidden_size / etp,
                 E=m.num_experts, sp=tp if p.sequence_parallel else 1,
                 route=m.moe_router_topk * etp / tp * moe_imbalance)


def _norm_bytes(n: float, groups: float, s: Shape, spec: str) -> float:
    """One RMSNorm over n features (``groups`` rows of it per token)."""
    if spec == "te":
        return n * s.B + 4 * groups          # TENorm: input and rstd
    # model/norm.py: x as float32 (x itself when float32), rstd, the normalised x in dtype
    return 4 * n + 4 * groups + s.B * n


def attention_bytes(s: Shape, spec: str) -> dict[str, float]:
    """Per token of the micro-batch (before SP): the attention half of one layer."""
    ad, gd = s.a * s.d, s.g * s.d
    if spec == "te":
        return {
            "input_norm": (2 * s.h * s.B + 4) / s.sp,   # fused LN-linear: input, rstd, ln_out
            "qkv": (ad + 2 * gd) * s.B,                  # held by the q/k norms and v
            "qk_norm": 4 * (s.a + s.g),                  # rstd
            "core_attn": (ad + gd + ad) * s.B + 4 * s.a,  # q, k after RoPE, out, lse
        }
    qkv_kept = (ad + 2 * gd) * 4 if s.B == 4 else 4 * gd   # fp32: k aliases the qkv output
    return {
        "input_norm": (_norm_bytes(s.h, 1, s, spec) + s.h * s.B) / s.sp,  # norm + qkv input
        "qkv": qkv_kept,
        "qk_norm": 4 * ad + 4 * s.a + s.B * ad + 4 * s.g + s.B * gd,
        "core_attn": (2 * ad + 2 * gd) * s.B + 4 * s.a + 16,  # q, k, v copy, out, lse, ranges
        "proj_input": ad * s.B,
    }


def moe_bytes(s: Shape, spec: str) -> dict[str, float]:
    """Per token of the micro-batch (before SP): the MoE half of one layer."""
    if spec == "te":
        routed = (2 * s.h + 3 * s.f) * s.B + 4      # permuted in, fc1 out, act out, fc2 out, prob
    else:
        routed = s.h * s.B + 6 * s.f * s.B + 4      # measured: fc1 in, 5f (SwiGLU), fc2 in, prob
    return {
        "pre_mlp_norm": (_norm_bytes(s.h, 1, s, spec) + s.h * s.B + 12 * s.k) / s.sp,
        "router": (5 * s.E + 8 * s.k) / s.sp,
        "experts": s.route * routed,
    }


def recompute_saving(model, s: Shape, spec: str, attn: dict, moe: dict) -> float:
    """Per token and layer: what selective recompute does not keep (Megatron's selective
    recompute of ``model.recompute_modules``)."""
    saved = 0.0
    modules = model.recompute_modules or ["core_attn"]
    if "core_attn" in modules:
        # the checkpoint keeps q, k, v (its inputs); linear_proj keeps the output. TE's flash
        # attention keeps nothing else but the log-sum-exp; the local kernel also an output copy
        saved += 4 * s.a + (s.a * s.d * s.B + 16 if spec == "local" else 0)
    if "layernorm" in modules:
        # the checkpoint keeps the norm's input and discards its output and internals; with TE
        # the input norm is fused into linear_qkv and only the pre-MLP norm is recomputed
        pre_mlp = moe["pre_mlp_norm"] - 12 * s.k / s.sp
        saved += pre_mlp - s.h * s.B / s.sp
        if spec == "local":
            saved += attn["input_norm"] - s.h * s.B / s.sp
    if "moe_act" in modules:     # the activation's output (fc2's input) is discarded
        saved += s.route * s.f * s.B
    if "moe" in modules:         # the MoE layer keeps only its input (the pre-MLP norm's output)
        saved += moe["router"] + moe["experts"]
    return max(saved, 0.0)


# ----------------------------------------------------------------------------------------------


def tokens_per_micro_batch(cfg: Config) -> tuple[int, int, str]:
    """(tokens per rank, rows of a padded micro-batch or 0 for packs, description)."""
    run, cp = cfg.run, cfg.parallel.context
    if run.max_tokens_per_micro_batch is not None:
        return (run.max_tokens_per_micro_batch, 0,
                f"{run.max_tokens_per_micro_batch} (run.max_tokens_per_micro_batch, packed)")
    tokens = run.micro_batch_size * run.seq_length // cp
    return (tokens, run.micro_batch_size,
            f"{tokens} (run.micro_batch_size {run.micro_batch_size} x run.seq_length "
            f"{run.seq_length} / context {cp})")


def micro_batches_per_step(cfg: Config, data_parallel: int) -> Optional[int]:
    """M of one optimizer step on a data-parallel rank (None when packing decides it)."""
    if cfg.run.max_tokens_per_micro_batch is not None:
        return None
    rows = cfg.run.global_batch_size // cfg.gspo.updates_per_rollout
    return max(1, rows // (data_parallel * cfg.run.micro_batch_size))


def _wire_bytes(cfg: Config) -> int:
    dtype = cfg.rollout.weight_sync.dtype or cfg.model.params_dtype
    return 2 if dtype == "bfloat16" else 4


def gather_buffer_bytes(cfg: Config, stage: int) -> tuple[float, float]:
    """(bytes of ONE of the two flat buffers a sending rank of ``stage`` holds, its largest HF
    tensor in bytes). ``hf.gather._buffer_pool`` sizes both to the largest bucket the rank sends:
    ``rollout.weight_sync.bucket_mb``, or a single larger tensor (a bucket holds at least one),
    at most everything the rank sends (its stage's tensors whole: TP shards gathered to it)."""
    m, p = cfg.model, cfg.parallel
    B = _wire_bytes(cfg)
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    largest = max(a * d * h, g * d * h, m.num_experts * h, m.moe_ffn_hidden_size * h)
    first, last = stage == 0, stage == p.pipeline - 1
    if first or (last and not m.tie_word_embeddings):
        largest = max(largest, m.vocab_size * h)  # embed_tokens / lm_head (HF: unpadded)
    dense, expert = stage_params(cfg, stage)
    sent = (dense * p.tensor + expert * p.expert_tensor_size()) * B
    bucket = cfg.rollout.weight_sync.bucket_mb * MIB
    return min(sent, max(bucket, largest * B)), largest * B


def routing_replay_bytes(cfg: Config) -> tuple[float, str]:
    """The routing-replay batch tensor of one step: int16 [samples, seq_length, layers, top-k]
    (``pipeline.generation.routed_experts.batch_routed_experts``; samples = the rollout batch's rows)."""
    m, run = cfg.model, cfg.run
    shape = (run.global_batch_size, run.seq_length, m.num_layers, m.moe_router_topk)
    n = ROUTED_EXPERT_BYTES
    for dim in shape:
        n *= dim
    return float(n), " x ".join(str(x) for x in shape)


GPUS_PER_NODE = 8
"""The planner's assumption for ``rollout.weight_sync.senders: node`` (H100 / H200 nodes)."""


def update_group_count(cfg: Config, world_size: Optional[int] = None, *,
                       mode: Optional[str] = None) -> int:
    """The weight-update groups every SGLang GPU joins with ``rollout.weight_sync.transport:
    distributed``: one per sending rank
    (``pipeline.weights.distributed.DistributedTransport._make_groups``), which
    ``rollout.weight_sync.senders`` chooses (``megatron_gspo.hf.gather.sender_ranks``):

    * ``rank``: ``hf.gather`` sends each HF tensor from the lowest rank holding it whole, else
      the lowest holding a piece of it. Per pipeline stage that is one rank for the dense tensors
      (the stage's lowest rank) and one per expert-parallel rank for the experts (each EP rank's
      experts whole with expert_tensor 1, else the lowest rank of its expert-TP group); the
      stage's lowest rank is also EP rank 0's, so ``pipeline x expert`` senders in all;
    * ``stage``: one per pipeline stage;
    * ``node``: one per node and stage: ``pipeline x ceil(ranks per stage / GPUS_PER_NODE)``
      (``world_size`` ranks; without it, as ``stage``).

    ``mode``: that setting instead of the configuration's (resolved)."""
    p = cfg.parallel
    mode = mode or cfg.rollout.weight_sync.resolved_senders()
    if mode == "stage" or (mode == "node" and world_size is None):
        return p.pipeline
    if mode == "node":
        per_stage = world_size // p.pipeline
        return p.pipeline * -(-per_stage // GPUS_PER_NODE)
    return p.pipeline * (p.expert if cfg.model.num_experts else 1)


def _check_sizes(world_size, gpu_memory_gib, moe_imbalance) -> None:
    """Refuse zero / negative / NaN / infinite sizes (and non-numbers), naming the
    ``megatron-gspo plan`` flag."""
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) \
            or world_size < 1:
        raise ConfigError(f"--world-size: must be a positive integer (training ranks), "
                          f"got {world_size!r}")
    for flag, value, low, what in (("--gpu-memory-gib", gpu_memory_gib, 0.0, "> 0 GiB"),
                                   ("--moe-imbalance", moe_imbalance, 1.0,
                                    ">= 1 (the hottest expert rank's load over the mean)")):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{flag}: must be a number {what}, got {value!r}")
        number = float(value)
        if not math.isfinite(number) or number < low or (low == 0.0 and number == 0.0):
            raise ConfigError(f"{flag}: must be a finite number {what}, got {value!r}")


def _communicators(layout) -> int:
    sizes = [layout.tensor, layout.context, layout.pipeline, layout.data, layout.expert,
             layout.expert_tensor, layout.expert_data, layout.world_size]
    return sum(1 for n in sizes if n > 1)


def _recompute(m, n_layers: int, layer_bytes: float, hidden_bytes: float,
               selective: float) -> tuple[float, float, str]:
    """(activation bytes kept per micro-batch on a stage of ``n_layers`` layers, the recompute
    working set, a note) under ``model.recompute_granularity`` / ``_method`` / ``_num_layers``."""
    full = n_layers * layer_bytes
    if m.recompute_granularity == "full":
        n = m.recompute_num_layers
        if m.recompute_method == "uniform":
            return ((n_layers // n) * hidden_bytes, n * layer_bytes,
                    f"full recompute, uniform, {n} layer(s) per chunk: chunk inputs only")
        recomputed = min(n, n_layers)
        return (recomputed * hidden_bytes + (n_layers - recomputed) * layer_bytes,
                layer_bytes if recomputed else 0.0,
                f"full recompute, block: {recomputed} of {n_layers} layers recomputed")
    if m.recompute_granularity == "selective":
        return (full - n_layers * selective, selective,
                f"selective recompute of {', '.join(m.recompute_modules or ['core_attn'])}")
    return full, 0.0, "no recompute"


def plan_memory(cfg: Config, world_size: int, gpu_memory_gib: float, *, spec: str = "te",
                device: str = "gpu", moe_imbalance: float = 1.0,
                sync_assumptions: Optional[rollout_plan.SyncAssumptions] = None) -> MemoryPlan:
    """The memory plan of every pipeline stage of ``cfg`` on ``world_size`` training ranks, with
    the rollout servers' lines after it (``megatron_gspo.rollout_plan``: their memory in bf16
    and FP8, the weight-sync pause of both transports under ``sync_assumptions``)."""
    if spec not in ("te", "local"):
        raise ValueError(f"spec: 'te' or 'local', got {spec!r}")
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device: 'gpu' or 'cpu', got {device!r}")
    _check_sizes(world_size, gpu_memory_gib, moe_imbalance)
    m, p, o = cfg.model, cfg.parallel, cfg.optim
    layout = derive_layout(p, world_size)
    stages_layers = pipeline_stage_layers(m, p)
    s = _shape(cfg, moe_imbalance)
    T, rows, tokens_note = tokens_per_micro_batch(cfg)
    M = micro_batches_per_step(cfg, layout.data)

    attn, moe = attention_bytes(s, spec), moe_bytes(s, spec)
    per_layer_token = sum(attn.values()) + sum(moe.values())
    layer_bytes = per_layer_token * T
    # RoPE's cos / sin tables, per layer and micro-batch (local spec: in the params dtype)
    rope = 4 * T * s.d * s.B if spec == "local" else 0
    layer_bytes += rope
    hidden_bytes = T * s.h * s.B / s.sp                      # a layer's input (residual stream)
    selective = recompute_saving(m, s, spec, attn, moe) * T if (
        m.recompute_granularity == "selective") else 0.0

    # logits: response positions in RL (logit_index), at most every token of the micro-batch
    vocab_local = padded_vocab_size(m, p.tensor) / p.tensor
    logit_rows = T if rows == 0 else min(T, rows * cfg.rollout.max_new_tokens // p.context)
    chunk = min(LOGPROB_CHUNK, logit_rows)
    workspaces = 2 if cfg.gspo.entropy_coef > 0 else 1
    logits_bytes = (2 * logit_rows * vocab_local * s.B            # logits and their gradient
                    + workspaces * chunk * vocab_local * 4)          # fp32 chunk workspace(s)

    # optimizer states per parameter (bytes) and where they are
    master = 4 if m.params_dtype == "bfloat16" else 0
    moments = 8 if o.optimizer == "adam" else 4
    per_param_state = master + moments
    dense_share = layout.data * layout.context if o.use_distributed_optimizer else 1
    expert_share = layout.expert_data if o.use_distributed_optimizer else 1
    on_host = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0

    header = [
        f"tokens per micro-batch per rank: {tokens_note}; "
        + (f"micro-batches per optimizer step: {M}" if M else
           "micro-batches per step: set by packing (at least one per pipeline stage assumed)"),
        f"activation bytes per token and layer ({spec} spec, {m.params_dtype}): "
        f"attention {sum(attn.values()):.0f}, MoE {sum(moe.values()):.0f}"
        + (f" (routed tokens x{moe_imbalance:g} for routing imbalance)" if moe_imbalance != 1 else ""),
    ]
    stages, host_offload = [], (0.0, 0.0, 0.0)
    first_layer = 0
    for stage, n_layers in enumerate(stages_layers):
        dense, expert = stage_params(cfg, stage)
        items = [Item(f"{'bf16' if s.B == 2 else 'fp32'} weights", (dense + expert) * s.B),
                 Item("fp32 gradients", (dense + expert) * 4.0, "(DDP buffer, grad_reduce_in_fp32)")]
        if cfg.gspo.kl_coef > 0:  # the frozen reference policy (rl_trainer._build_reference)
            items.append(Item("reference policy weights", (dense + expert) * s.B,
                              "(gspo.kl_coef > 0)"))
        state = per_param_state * (dense / dense_share + expert / expert_share)
        where = (f"distributed over {dense_share} (dense) / {expert_share} (experts) ranks"
                 if o.use_distributed_optimizer else "not distributed")
        if on_host:
            # HybridDeviceOptimizer: an fp32 host copy of each offloaded (master) parameter,
            # a pinned host copy of its fp32 gradient, and the moments, all on the host
            offloaded = (dense / dense_share + expert / expert_share) * on_host
            if offloaded > host_offload[0]:
                host_offload = (offloaded, offloaded * (4 + moments), offloaded * 4.0)
            where += f"; {on_host:.0%} offloaded to the host"
        items.append(Item("optimizer states", state * (1 - on_host),
                          f"({'adam m, v' if o.optimizer == 'adam' else 'sgd momentum'}"
                          f"{' + fp32 master' if master else ''}; {where})"))
        # activations of one micro-batch on this stage, and the recompute working set
        kept, working, note = _recompute(m, n_layers, layer_bytes, hidden_bytes, selective)
        if stage == 0:
            kept += T * 8  # token ids (int64) saved by the embedding
        if stage == p.pipeline - 1:  # the final norm and the output layer's input
            kept += T * (_norm_bytes(s.h, 1, s, spec) + s.h * s.B) / s.sp
        in_flight = min(p.pipeline - stage, M) if M else p.pipeline - stage
        items.append(Item("activations / micro-batch", kept,
                          f"({n_layers} layers x {layer_bytes / GIB:.3f} GiB without recompute; "
                          f"{note})"))
        items.append(Item(f"in-flight micro-batches: {in_flight}", kept * (in_flight - 1),
                          f"(1F1B: stage s holds min(pipeline - s, M) micro-batches; "
                          f"{in_flight - 1} more than the one above)"))
        items.append(Item("recompute working set", working,
                          "(one recompute chunk rebuilt in the backward pass)", exclusive=True))
        last = stage == p.pipeline - 1
        items.append(Item("logits + log-prob workspace", logits_bytes if last else 0.0,
                          f"({logit_rows} rows x {vocab_local:.0f} vocabulary: logits, their "
                          "gradient, fp32 chunks)" if last else "(last stage only)", exclusive=True))
        dynamic = kept * in_flight + max(working, logits_bytes if last else 0.0)
        comm = 0.0
        if device == "gpu":
            comm = (CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_COMMUNICATOR * _communicators(layout)
                    + FRAGMENTATION * dynamic)
            one, largest = gather_buffer_bytes(cfg, stage)
            items.append(Item("weight-sync gather buffers", 2 * one,
                              f"(2 x {one / MIB:.0f} MiB on a sending rank, held for the run: "
                              f"rollout.weight_sync.bucket_mb {cfg.rollout.weight_sync.bucket_mb}"
                              + (f", a {largest / MIB:.0f} MiB tensor" if largest > one * 0.999
                                 and largest > cfg.rollout.weight_sync.bucket_mb * MIB else "")
                              + ")"))
        items.append(Item("communication & runtime", comm,
                          f"(CUDA context, NCCL x{_communicators(layout)} communicators, "
                          f"{FRAGMENTATION:.0%} fragmentation)" if device == "gpu" else "(CPU)"))
        stages.append(StagePlan(stage=stage, first_layer=first_layer, num_layers=n_layers,
                                params_dense=dense, params_expert=expert, items=items))
        first_layer += n_layers
    host_items = []
    if host_offload[0]:
        n = host_offload[0]
        host_items += [
            Item("offloaded optimizer states", host_offload[1],
                 f"(fp32 parameter copy + {'adam m, v' if o.optimizer == 'adam' else 'sgd momentum'}"
                 f" of {n / 1e9:.3f} B parameters: {4 + moments} bytes each)"),
            Item("host gradient copy", host_offload[2],
                 "(fp32, pinned: HybridDeviceOptimizer copies the offloaded parameters' "
                 "gradients to the host each step)")]
    replay, shape = routing_replay_bytes(cfg)
    replay_on = cfg.gspo.routing_replay == "rollout"
    if replay_on:
        host_items.append(Item("routing-replay tensor", replay,
                               "(the whole batch's, on rank 0, which builds it and sends each "
                               "rank its rows: 1/dp of it on every other rank)"))
    notes = [f"routing replay (gspo.routing_replay rollout): int16 [{shape}] (samples x "
             f"seq_length x layers x top-k) = {replay / 1e9:.2f} GB ({replay / GIB:.2f} GiB) per "
             f"step, built on rank 0, which sends each training rank only its rows: "
             f"{replay / layout.data / 1e9:.2f} GB at data-parallel {layout.data}"
             + (" (on: in the host memory above)" if replay_on else
                f" (off here: routing_replay {cfg.gspo.routing_replay})")]
    notes += _rollout_server_notes(cfg, gpu_memory_gib, world_size)
    notes += rollout_plan.notes(cfg, gpu_memory_gib, world_size, sync_assumptions)
    return MemoryPlan(describe_layout=layout.describe(), header=header, stages=stages,
                      gpu_memory_gib=gpu_memory_gib, host_items=host_items, notes=notes)


def _rollout_server_notes(cfg: Config, gpu_memory_gib: float,
                          world_size: Optional[int] = None) -> list[str]:
    """Per server GPU: the weight-update groups' NCCL buffers (``rollout.weight_sync.transport:
    distributed``), outside the engine's share of the GPU (``rollout_plan.SERVER_BUDGETS``)."""
    r, p, sync = cfg.rollout, cfg.parallel, cfg.rollout.weight_sync
    b = rollout_plan.server_budget(cfg)
    if b.one_update_group:
        count, why = 1, f"{b.engine}'s weight-transfer engine: trainer rank 0 and every worker"
    else:
        # what distributed would use: auto resolves to node there
        mode = sync.resolved_senders() if sync.transport == "distributed" \
            or sync.senders != "auto" else "node"
        count = update_group_count(cfg, world_size, mode=mode)
        why = {"rank": f"one per sending rank: pipeline {p.pipeline} x expert "
                       f"{p.expert if cfg.model.num_experts else 1}",
               "stage": f"one per pipeline stage: {p.pipeline}",
               "node": f"one per node and pipeline stage, {GPUS_PER_NODE} GPUs per node"}[mode]
        why += f"; rollout.weight_sync.senders {sync.senders}"
    groups = NCCL_UPDATE_GROUP_BYTES * count
    estimate = (f"{count} update group(s) ({why}) x "
                f"{NCCL_UPDATE_GROUP_BYTES / MIB:.0f} MiB NCCL buffers (NCCL_BUFFSIZE "
                f"{NCCL_BUFFSIZE / MIB:.0f} MiB x {NCCL_CHANNELS} channels x 2) = "
                f"{groups / GIB:.2f} GiB")
    if sync.transport != "distributed":
        return [f"rollout-server GPU: no weight-update groups (weight_sync {sync.transport}); "
                f"weight_sync distributed would add {estimate} per {b.engine} GPU, outside "
                f"{b.flag}"]
    fraction, default = rollout_plan.server_fraction(cfg)
    left = f"{1 - fraction:.2f} x {gpu_memory_gib:g} GiB = {(1 - fraction) * gpu_memory_gib:.1f} GiB"
    if default:
        left += f" with {b.flag} {fraction:g}, {b.default_source}"
    if b.rest_holds:
        left += f", also for {b.rest_holds}"
    return [f"rollout-server GPU (weight_sync distributed, {r.tp_size} GPU(s) per server): "
            f"{estimate} per GPU, outside {b.engine}'s {b.flag} (what it leaves: {left})"]


class PlanDoesNotFit(ConfigError):
    """The layout cannot fit: the message carries the whole breakdown."""


def check_fits(cfg: Config, world_size: int, gpu_memory_gib: float, *, proceed: bool = False,
               flag: str = "--ignore-memory-plan", moe_imbalance: float = 1.0,
               spec: str = "te") -> MemoryPlan:
    """Run the plan; raise :class:`PlanDoesNotFit` (with the breakdown) unless it fits or
    ``proceed``. What ``train`` and ``launch slurm`` call before they start anything."""
    plan = plan_memory(cfg, world_size, gpu_memory_gib, moe_imbalance=moe_imbalance, spec=spec)
    if not plan.fits and not proceed:
        raise PlanDoesNotFit(
            f"the memory plan says this layout does not fit:\n{plan.format()}\n"
            "Reduce the memory (model.recompute_granularity, optim.optimizer_cpu_offload, "
            "optim.use_distributed_optimizer, run.max_tokens_per_micro_batch / "
            "run.micro_batch_size, more parallelism) or pass " + flag + " to start anyway")
    return plan
