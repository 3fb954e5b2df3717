"""The rollout servers' side of ``megatron-gspo plan``: what one server GPU holds, and the modelled
pause of one weight sync per step (a model, not a measurement: docs/performance.md, "The same
design on a GPU cluster").

**Server memory** (:func:`server_memory`), per server GPU: the weights it keeps (bf16, or FP8 with
``rollout.quantization: fp8``: ``megatron_gspo.hf.fp8``, 1 byte per element of the attention and
expert projections plus a float32 scale per 128 x 128 block), and what the engine's share of the
GPU leaves for the KV cache (bf16 K and V of every layer for the GPU's KV heads). Experts
divide over all ``rollout.tp_size`` GPUs of a server (TP or EP inside it), attention over the
attention TP group (``tp_size / dp_size`` with ``enable_dp_attention``: SGLang's
``use_attn_tp_group``), the embedding likewise, the output layer over the whole server. The share
is ``rollout.mem_fraction_static``, which each engine reads in its own terms
(:data:`SERVER_BUDGETS`, by ``rollout.engine``): SGLang's ``--mem-fraction-static`` holds the
weights and the KV cache, so the KV cache is what the weights leave of it; vLLM's
``--gpu-memory-utilization`` also holds the activation peak, the CUDA-graph estimate and the
non-torch memory that vLLM profiles when it starts, so the plan's KV cache is an upper bound there.

**Weight-sync pause** (:func:`sync_estimate`), from the bytes each link carries, for both
transports whatever the config chooses:

* ``distributed`` (``pipeline.weights.distributed``): every byte leaves the trainer through the
  NIC of one sending GPU at a time (each source's update group holds that one trainer GPU and
  every server GPU, and the sources take turns: an SGLang server takes one update at a time), at
  NCCL's broadcast bus bandwidth (busbw = algbw = S/t, bounded by the root's egress: nccl-tests
  doc/PERFORMANCE.md, "Broadcast"); plus one HTTP call and scheduler hop per bucket, and SGLang's
  per-tensor ``load_weights`` on every server GPU (each receives the whole bucket);
* ``disk`` (``pipeline.weights.disk``): the senders' nodes write every shard to the shared
  filesystem, then every SGLang TP rank walks every shard (0.5.23 ``update_weights_from_disk``:
  all files of the directory, mmap'd): each rollout node reads from the filesystem once what its
  ranks touch (the page cache serves the others), and each server process copies at least what
  it keeps to its GPU (overlapped with the node's read), then the same per-tensor load.

The bandwidths are parameters (:class:`SyncAssumptions`, each with its source; ``megatron-gspo
plan --sync-assume NAME=VALUE`` changes one) and the output states them. Published references for
comparison: :data:`REFERENCES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Optional

from megatron_gspo.config import Config, ConfigError
from megatron_gspo.hf.fp8 import BLOCK, served_bytes
from megatron_gspo.hf.mapping import hf_param_shapes

GIB = float(1 << 30)
MIB = float(1 << 20)
GB = 1e9
GPUS_PER_NODE = 8
"""GPUs per node the model assumes (H100 / H200 nodes), for the trainer and the servers."""

REFERENCES = (
    "NeMo-RL, Qwen3-30B-A3B (61 GB) on DGX H100, Megatron EP8xPP2 -> vLLM TP8xDP2, NCCL "
    "resharding (each generation GPU receives only its shard): 0.74-1.00 s per refit "
    "(github.com/NVIDIA-NeMo/RL/pull/2971); NeMo-RL's broadcast refit of Qwen3-235B: 13 s -> "
    "5.5 s with the gather overlapped (github.com/NVIDIA-NeMo/RL/pull/1379)")
"""Published refit times to compare the model with."""


@dataclass(frozen=True)
class ServerBudget:
    """How one rollout engine reads ``rollout.mem_fraction_static``: the share of each server GPU
    it takes when it starts."""

    engine: str
    """The engine's name in the plan's lines."""
    flag: str
    """The engine's flag that ``rollout.mem_fraction_static`` renders to."""
    default: float
    """The share when ``rollout.mem_fraction_static`` is unset."""
    default_source: str
    """Where :attr:`default` comes from."""
    holds: str
    """What the share holds."""
    rest_holds: str
    """What else of the engine's lives in the rest of the GPU, beside the weight-update groups."""
    kv_bound: str
    """Empty when the KV cache is what the weights leave of the share; else what more the engine
    takes from it before the KV cache (the plan's KV cache is then an upper bound)."""
    one_update_group: bool
    """With ``weight_sync.transport: distributed`` every server GPU joins one NCCL group (one
    sender); else one per sending trainer rank (``megatron_gspo.plan.update_group_count``)."""


SERVER_BUDGETS = {
    "sglang": ServerBudget(
        engine="SGLang", flag="mem_fraction_static", default=0.85,
        default_source="assumed: SGLang picks one from the GPU; the recipes set 0.85 / 0.8",
        holds="weights + KV cache", rest_holds="CUDA graphs and activations", kv_bound="",
        one_update_group=False),
    "vllm": ServerBudget(
        engine="vLLM", flag="gpu_memory_utilization", default=0.92,
        default_source="vLLM 0.32's default, CacheConfig.gpu_memory_utilization",
        holds="weights, activations, CUDA graphs, KV cache", rest_holds="",
        kv_bound="at most: less the activation peak, the CUDA-graph estimate and the non-torch "
                 "memory vLLM profiles when it starts",
        one_update_group=True),
}
"""By ``rollout.engine``. SGLang 0.5.23 (``ServerArgs.mem_fraction_static``): the static pool of
weights and KV cache; activations and CUDA graphs live in the rest. vLLM 0.32
(``Worker.determine_available_memory``, ``vllm/v1/worker/gpu_worker.py``): KV cache =
``gpu_memory_utilization`` x the GPU - (weights + profiled activation peak + non-torch memory) -
the CUDA-graph estimate (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, on by default); its NCCL
weight-transfer engine (``/init_weight_transfer_engine``, after that profile) is one group of
trainer rank 0 and every worker, outside the share."""


def server_budget(cfg: Config) -> ServerBudget:
    """The :class:`ServerBudget` of ``cfg.rollout.engine``."""
    return SERVER_BUDGETS[cfg.rollout.engine]


def server_fraction(cfg: Config) -> tuple[float, bool]:
    """(the share of each server GPU the engine takes, whether it is the engine's default)."""
    r = cfg.rollout
    if r.mem_fraction_static is not None:
        return r.mem_fraction_static, False
    return server_budget(cfg).default, True


@dataclass(frozen=True)
class SyncAssumptions:
    """The parameters of the weight-sync model (GB/s = 1e9 bytes per second)."""

    ib_gbps: float = 50.0
    """InfiniBand per GPU and direction: one 400 Gb/s port per GPU (rail-optimized compute fabric,
    each GPU through its own NIC: NVIDIA's HGX H100/H200 reference architecture, "Networking
    Physical Topologies"; 8 compute InfiniBand interfaces per DGX H100: the DGX BasePOD deployment
    guide)."""
    nccl_efficiency: float = 0.8
    """NCCL's large-message broadcast bus bandwidth as a fraction of the line rate (an assumption,
    as in docs/performance.md; measure it with nccl-tests' broadcast_perf on the cluster)."""
    fs_write_gbps: float = 5.0
    """Shared-filesystem write per training node (an assumption: the node's storage path is 2 x
    200 GbE = 50 GB/s of line rate in NVIDIA's HGX reference architecture, "Network Logical
    Architecture"; a parallel filesystem's per-client write is typically far below it)."""
    fs_read_gbps: float = 10.0
    """Shared-filesystem read per rollout node (an assumption, as above; NFS over one 25-100 GbE
    link is 3-12 GB/s at line rate: pass a lower value for it)."""
    h2d_gbps: float = 8.0
    """One server process's copy from the page cache (mmap'd pages, pageable memory) to its GPU
    (an assumption: PCIe Gen5 x16 is ~64 GB/s of line rate, pageable copies from mmap'd files
    reach a fraction of it per process)."""
    control_s_per_bucket: float = 0.003
    """One bucket's HTTP call, SGLang's tokenizer-manager -> scheduler hop and the NCCL launch
    (an assumption, as in docs/performance.md)."""
    load_s_per_tensor: float = 20e-6
    """SGLang's Python ``load_weights`` per HF tensor on each server GPU (an assumption, as in
    docs/performance.md; the local server measured ~100 us per tensor on this CPU)."""

    @classmethod
    def parse(cls, items: list[str]) -> "SyncAssumptions":
        """The defaults with ``NAME=VALUE`` items applied (``--sync-assume``); a ConfigError names
        the flag and the item otherwise."""
        names = {f.name for f in fields(cls)}
        values = {}
        for item in items:
            name, sep, value = item.partition("=")
            try:
                number = float(value)
            except ValueError:
                number = float("nan")
            if not sep or name not in names or not math.isfinite(number) or number <= 0:
                raise ConfigError(f"--sync-assume: {item!r}: expected NAME=VALUE with a positive "
                                  f"number, NAME one of {', '.join(sorted(names))}")
            values[name] = number
        return replace(cls(), **values)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name):g}" for f in fields(self))


@dataclass(frozen=True)
class Inventory:
    """The HF tensors of the model as the servers receive them."""

    tensors: int
    total: float
    experts: float
    attention: float
    """Per-layer non-expert tensors (projections, norms, router), all layers."""
    embed: float
    head: float
    """The output layer and the final norm."""


def inventory(cfg: Config, fp8: bool) -> Inventory:
    """The bytes of every HF tensor: FP8 (``megatron_gspo.hf.fp8.served_bytes``) when ``fp8``, else
    in the wire dtype (``rollout.weight_sync.dtype`` or the parameters')."""
    dtype = cfg.rollout.weight_sync.dtype or cfg.model.params_dtype
    dense = 2 if dtype == "bfloat16" else 4
    experts = attention = embed = head = 0.0
    shapes = hf_param_shapes(cfg.model)
    for name, shape in shapes.items():
        size = served_bytes(name, shape, dense) if fp8 else math.prod(shape) * dense
        if ".mlp.experts." in name:
            experts += size
        elif name.startswith("model.layers."):
            attention += size
        elif name == "model.embed_tokens.weight":
            embed += size
        else:
            head += size
    return Inventory(tensors=len(shapes), total=experts + attention + embed + head,
                     experts=experts, attention=attention, embed=embed, head=head)


@dataclass(frozen=True)
class ServerMemory:
    weights: float
    budget: float
    kv: float
    kv_tokens: int


def _attention_tp(cfg: Config) -> tuple[int, int]:
    """(GPUs one replica's experts / output layer divide over, its attention TP size)."""
    r = cfg.rollout
    if r.enable_dp_attention:
        return r.tp_size, r.tp_size // r.dp_size
    replica = r.tp_size // r.dp_size  # dp_size replicas of tp / dp GPUs (1 without dp)
    return replica, replica


def server_weights(cfg: Config, fp8: bool) -> float:
    """The weight bytes one server GPU keeps."""
    inv = inventory(cfg, fp8)
    replica_tp, attn_tp = _attention_tp(cfg)
    return (inv.experts / replica_tp + inv.attention / attn_tp + inv.embed / attn_tp
            + inv.head / replica_tp)


def server_memory(cfg: Config, gpu_memory_gib: float, fp8: bool) -> ServerMemory:
    """One server GPU: its weights, the engine's share of the GPU (:func:`server_fraction`), the
    KV cache the weights leave of it (an upper bound for vLLM: :data:`SERVER_BUDGETS`)."""
    m = cfg.model
    _, attn_tp = _attention_tp(cfg)
    weights = server_weights(cfg, fp8)
    fraction, _ = server_fraction(cfg)
    budget = fraction * gpu_memory_gib * GIB
    kv_heads = max(1, m.num_query_groups // attn_tp)
    per_token = 2 * m.num_layers * kv_heads * m.head_dim * 2  # K and V, bf16
    kv = max(0.0, budget - weights)
    return ServerMemory(weights=weights, budget=budget, kv=kv, kv_tokens=int(kv // per_token))


@dataclass(frozen=True)
class SyncEstimate:
    transport: str
    seconds: float
    terms: str


def _buckets(cfg: Config, total: float) -> int:
    return math.ceil(total / (cfg.rollout.weight_sync.bucket_mb * MIB))


def sync_estimate(cfg: Config, world_size: int, transport: str, a: SyncAssumptions,
                  fp8: bool) -> SyncEstimate:
    """The pause of one weight sync with ``transport`` (``distributed`` or ``disk``)."""
    inv = inventory(cfg, fp8)
    total, gb = inv.total, inv.total / GB
    load = inv.tensors * a.load_s_per_tensor
    load_how = f"load {load:.2f} s ({inv.tensors:,} tensors x {a.load_s_per_tensor * 1e6:g} us)"
    if transport == "distributed":
        buckets = _buckets(cfg, total)
        egress = total / (a.ib_gbps * a.nccl_efficiency * GB)
        control = buckets * a.control_s_per_bucket
        return SyncEstimate("distributed", egress + control + load, (
            f"sender egress {egress:.2f} s ({gb:.1f} GB through one sending GPU's NIC at a time, "
            f"{a.ib_gbps:g} GB/s x {a.nccl_efficiency:g}) + control {control:.2f} s ({buckets} "
            f"buckets of {cfg.rollout.weight_sync.bucket_mb} MiB x "
            f"{a.control_s_per_bucket * 1e3:g} ms) + {load_how}"))
    if transport != "disk":
        raise ValueError(f"transport: 'distributed' or 'disk', got {transport!r}")
    train_nodes = max(1, math.ceil(world_size / GPUS_PER_NODE))
    writers = cfg.parallel.pipeline if cfg.rollout.weight_sync.senders == "stage" else train_nodes
    writers = min(writers, train_nodes)
    write = total / (writers * a.fs_write_gbps * GB)
    r = cfg.rollout
    span = max(1, math.ceil(r.tp_size / GPUS_PER_NODE))  # nodes one server spans
    node_bytes = total if span == 1 or r.ep_size == 1 else total - inv.experts * (1 - 1 / span)
    read = node_bytes / (a.fs_read_gbps * GB)
    resident = server_weights(cfg, fp8)
    copy = resident / (a.h2d_gbps * GB)
    return SyncEstimate("disk", write + max(read, copy) + load, (
        f"write {write:.2f} s ({gb:.1f} GB by {writers} node(s) at {a.fs_write_gbps:g} GB/s each) "
        f"+ read {max(read, copy):.2f} s (each rollout node reads {node_bytes / GB:.1f} GB at "
        f"{a.fs_read_gbps:g} GB/s: {read:.2f} s; each server process copies the "
        f"{resident / GB:.1f} GB it keeps at {a.h2d_gbps:g} GB/s: {copy:.2f} s; overlapped) "
        f"+ {load_how}"))


def notes(cfg: Config, gpu_memory_gib: float, world_size: int,
          assumptions: Optional[SyncAssumptions] = None) -> list[str]:
    """The plan's lines for the rollout servers: memory per server GPU in bf16 and FP8 (in the
    terms of ``rollout.engine``), and the weight-sync pause of both transports (the configured one
    marked)."""
    a = assumptions or SyncAssumptions()
    r = cfg.rollout
    fp8_on = r.quantization == "fp8"
    b = server_budget(cfg)
    fraction, default = server_fraction(cfg)
    rollout_tokens = cfg.run.seq_length + 1
    source = f" ({b.default_source})" if default else " (rollout.mem_fraction_static)"
    lines = [f"server memory per {b.engine} GPU ({r.tp_size} GPU(s) per server; {b.flag} "
             f"{fraction:g}{source} of {gpu_memory_gib:g} GiB = {fraction * gpu_memory_gib:.1f} "
             f"GiB for {b.holds}):"]
    bound = f" {b.kv_bound}" if b.kv_bound else ""
    base = server_memory(cfg, gpu_memory_gib, fp8=False)
    for fp8 in (False, True):
        mem = server_memory(cfg, gpu_memory_gib, fp8)
        what = (f"served in fp8 (rollout.quantization fp8: e4m3, {BLOCK}x{BLOCK} blocks): weights"
                if fp8 else "served in bf16: weights")
        gain = f", x{mem.kv_tokens / base.kv_tokens:.2f} the bf16 KV" if fp8 and base.kv_tokens else ""
        mark = "  [this config]" if fp8 == fp8_on else ""
        lines.append(f"  {what} {mem.weights / GIB:.2f} GiB -> KV cache {mem.kv / GIB:.2f} GiB = "
                     f"{mem.kv_tokens:,} tokens ({mem.kv_tokens // rollout_tokens:,} sequences of "
                     f"run.seq_length + 1 = {rollout_tokens:,}{gain}){bound}{mark}")
    inv = inventory(cfg, fp8_on)
    lines.append(f"weight sync per step (a model, not a measurement; docs/performance.md): "
                 f"{inv.total / GB:.1f} GB {'fp8 + scales' if fp8_on else 'bf16'} on the wire, "
                 f"{inv.tensors:,} HF tensors:")
    for transport in ("distributed", "disk"):
        est = sync_estimate(cfg, world_size, transport, a, fp8_on)
        mark = "  [this config]" if transport == r.weight_sync.transport else ""
        lines.append(f"  {transport}: {est.seconds:.1f} s = {est.terms}{mark}")
    lines.append(f"  reference: {REFERENCES}")
    lines.append(f"  assumptions (plan --sync-assume NAME=VALUE): {a.describe()}")
    return lines
