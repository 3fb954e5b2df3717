"""The sections about the rollout servers: ``rollout`` (:class:`RolloutConfig`, sampling and
where the servers are), its ``rollout.weight_sync`` (:class:`WeightSyncConfig`) and
``rollout.router`` (:class:`RouterConfig`), and ``parity`` (:class:`ParityConfig`, the
servers-vs-trainer watchdog after every weight sync)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional

from megatron_gspo.config.checks import require


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """The section ``rollout.weight_sync``: how the trainer's weights reach the rollout servers
    after each training phase (``pipeline.weights.push``)."""

    transport: Literal["disk", "tensor", "distributed"] = "disk"
    """safetensors shards on a shared filesystem, written by every sending rank in parallel
    (``disk``: ``pipeline.weights.disk``); SGLang's update_weights_from_tensor with CUDA-IPC /
    shared-memory handles, for servers on the trainer's node, every sending rank on that node
    too (``tensor``; the local server needs --allow-pickled-tensors; other placements are refused
    by ``launch slurm`` and ``train`` before they start: ``launch.weight_sync_reach``); or a broadcast group per sending rank with every GPU of every
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
        require(self.bucket_mb >= 1,
                f"rollout.weight_sync.bucket_mb: must be >= 1, got {self.bucket_mb}")
        require(self.full_every >= 1,
                f"rollout.weight_sync.full_every: must be >= 1, got {self.full_every}")
        require(not self.delta or self.transport in ("tensor", "distributed"),
                "rollout.weight_sync.delta: needs rollout.weight_sync.transport tensor or "
                f"distributed (got {self.transport}: a disk sync rewrites whole shards)")


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """The section ``rollout.router``: what the trainer's client allows the sglang-router in
    front of the servers (``rollout.router_url``, or the one an embedded run starts)."""

    readmit_timeout_s: float = 300.0
    """How long the router may take to route to the servers again after a weight sync paused
    them. SGLang's ``/health`` generates a token, which waits while a server is paused, so a
    router whose health checks run during a long sync marks every server unhealthy and, after
    ``continue_generation``, answers ``503 No available workers`` until its checks re-admit them
    (sglang-router's defaults: up to 2 x 60 s). Two waits use it: (1) after every weight sync
    rank 0 waits until the router lists every synced server healthy again (reported on the
    console, ``sync/router_readmit_s`` in the metrics); past this bound the run stops with an
    error naming the router; (2) a rollout request answered with that 503 while the servers
    answer is sent again, not counted as a failed attempt, once the router lists a healthy
    worker; it fails after this long (counted from its first such answer, or from the end of
    the weight sync's pause if that is later). The launchers' own servers keep answering
    ``/health`` while paused (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``), so with
    them neither wait happens (docs/rollout.md, "The router during a weight sync")."""

    def __post_init__(self) -> None:
        require(self.readmit_timeout_s > 0,
                f"rollout.router.readmit_timeout_s: must be > 0, got {self.readmit_timeout_s}")


MAX_CONCURRENCY = 8192
"""The largest rollout.max_concurrency: 8192 connections from rank 0 (the shipped 30B / 235B
recipes use 1024; SGLang servers run a few hundred requests each)."""


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Sampling parameters and where the rollout servers are."""

    mode: Literal["embedded", "external"] = "embedded"
    """embedded: the run starts local rollout servers and the router; external: the servers run
    already, reached through ``router_url`` or ``server_urls``."""
    engine: Literal["sglang", "vllm"] = "sglang"
    """The rollout servers' inference engine (``pipeline.engines``, chosen once where the session
    is built): ``sglang`` (SGLang's protocol; embedded mode starts the project's own server, which
    speaks it, behind the sglang-router) or ``vllm`` (vLLM 0.32's API, ``docs/vllm.md``;
    embedded mode starts vLLM servers from the environment ``launch/envs/vllm_cpu.sh`` builds,
    ``$MGSPO_VLLM_PYTHON`` or ``.venv-vllm``, one per rollout.num_servers, no router). With vllm:
    top_p 1 and top_k -1 (vLLM's log-probs renormalise over the tokens top-p/top-k keep; the
    trainer's do not), not colocated, no delta sync, no parity watchdog (all refused);
    routing replay ``rollout`` from GPU servers only (vLLM's routed experts need Model Runner V2,
    i.e. Triton: refused on the CPU)."""
    router_url: Optional[str] = None
    """External mode: the router in front of the servers (sglang-router, or another that lists
    its workers at ``GET /workers``); the weight sync reaches every worker it lists. With
    ``engine: vllm`` only that list is used: sglang-router 0.3.2 answers 404 to vLLM's
    ``/inference/v1/generate`` and 422 to a token-id prompt on ``/v1/completions``, so the client
    sends every request to the listed servers itself (docs/rollout.md, "vLLM servers: launch, external mode, routing replay")."""
    server_urls: Optional[list[str]] = None
    """External mode without a router: the rollout servers' base URLs (``http://host:port``);
    the client routes over them itself (what ``launch slurm`` passes for vLLM servers)."""
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
    router: RouterConfig = field(default_factory=RouterConfig)
    """What the client allows the router after a weight sync (the section ``rollout.router``)."""
    max_concurrency: int = 512
    """Requests the trainer's rollout client keeps in flight at once (to the router, or to the
    servers directly), over everything one rollout runs together: the whole batch in ``off`` and
    ``one_step``, every group of the stream in ``full``. Each is an open connection (a file
    descriptor) on rank 0; at most :data:`MAX_CONCURRENCY`. Keep it at least the rollout batch
    (prompts x group_size, capped by the servers' combined --max-running-requests): below that a
    server idles while requests wait in the client and the step takes a second wave of decoding
    (64 for 128 samples of ~150 tokens on 2 local servers: 3.4 s instead of 2.6 s,
    docs/performance.md)."""
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
    """The share of each server GPU the engine takes; null: the engine's own default. SGLang:
    --mem-fraction-static, the share for weights and KV cache. vLLM (rollout.engine vllm):
    --gpu-memory-utilization, the share for weights, activations, CUDA graphs and KV cache
    (default 0.92). ``megatron-gspo plan`` reads it in the engine's terms."""
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
    quantization: Optional[Literal["fp8"]] = None
    """FP8 rollouts, bf16 training: ``fp8`` runs the SGLang servers with block-wise FP8 weights
    (SGLang's ``--quantization fp8``: e4m3, one float32 scale per 128 x 128 block, dynamic
    activation scales; docs/rollout.md, "FP8 rollouts"). The trainer keeps training in
    model.params_dtype and quantizes at every weight sync (``megatron_gspo.hf.fp8``: the
    attention and expert projections; embedding, output layer, norms and router stay bf16), so
    the servers must start from an FP8 checkpoint of that layout (Qwen's -FP8 releases, or
    ``megatron-gspo convert hf-to-fp8``). The rollout/trainer log-prob mismatch this adds is what
    the behaviour weight (gspo.mismatch_correction, truncated importance sampling) corrects: on
    by default with gspo.old_logprobs: recompute; with gspo.old_logprobs: rollout it is refused
    unless gspo.mismatch_correction is set to false explicitly. The project's local server
    imitates it on the CPU by computing with the dequantized FP8 weights (weight rounding only;
    SGLang's FP8 kernels also quantize activations). Only ``fp8``: it is the one format of
    SGLang's --quantization choices that bf16 weights can be turned into at every sync and that
    SGLang 0.5.23 reloads in place (its online per-tensor FP8 of a bf16 checkpoint rebinds the
    parameters and refuses later updates). null: the servers run model.params_dtype."""
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
    ``one_step`` is exactly 1 stale (needs >= 1); ``off`` is 0. At most
    ``validate.MAX_STALENESS`` (16): ``full`` holds up to (eta + 1) x run.global_batch_size
    samples on rank 0 (``megatron-gspo config`` refuses more, stating that memory)."""

    YAML_KEYS: ClassVar[dict] = {"async": "async_"}
    """YAML key -> field name, where the two differ."""
    MOVED_KEYS: ClassVar[dict] = {f"weight_sync_{name}": f"weight_sync.{name}" for name in (
        "senders", "dir", "bucket_mb", "dtype", "master_address", "verify", "delta", "full_every")}
    """Old YAML key -> its key now (refused, naming the new key)."""

    def __post_init__(self) -> None:
        require(self.max_staleness >= 0,
                f"rollout.max_staleness: must be >= 0, got {self.max_staleness}")
        require(1 <= self.max_concurrency <= MAX_CONCURRENCY,
                f"rollout.max_concurrency: must be in [1, {MAX_CONCURRENCY}], got "
                f"{self.max_concurrency}: the requests rank 0 keeps in flight at once (the whole "
                "rollout, every group of a rollout.async full stream together), each an open "
                "connection and file descriptor there and a request the servers hold; more "
                "than the servers' combined --max-running-requests only queues")
        require(self.async_ != "one_step" or self.max_staleness >= 1,
                f"rollout.max_staleness: {self.max_staleness} is below rollout.async one_step's "
                "staleness (every sample is exactly 1 version stale); use async: off, or full")
        require(self.async_ == "off" or not self.colocated,
                f"rollout.async: {self.async_} needs the rollout servers on their own devices; "
                "rollout.colocated servers release their memory while the trainer runs")
        require(self.mode != "external" or bool(self.router_url) != bool(self.server_urls),
                "rollout.router_url: external mode needs exactly one of rollout.router_url (a "
                "router listing its workers) and rollout.server_urls (the servers themselves), "
                f"got {'both' if self.router_url else 'neither'}")
        require(self.mode == "external" or not self.server_urls,
                "rollout.server_urls: only with rollout.mode external (an embedded run starts "
                "its own servers)")
        for url in self.server_urls or []:
            require(re.fullmatch(r"https?://[^/\s:]+:\d+/?", url) is not None,
                    f"rollout.server_urls: {url!r} is not a server's base URL http://host:port")
        require(len(set(self.server_urls or [])) == len(self.server_urls or []),
                "rollout.server_urls: a server is listed twice")
        require(self.num_servers >= 1, f"rollout.num_servers: must be >= 1, got {self.num_servers}")
        require(self.tp_size >= 1, f"rollout.tp_size: must be >= 1, got {self.tp_size}")
        require(re.fullmatch(r"cpu|cuda(:\d+)?", self.local_server_device) is not None,
                f"rollout.local_server_device: {self.local_server_device!r} is not cpu, cuda or "
                "cuda:N")
        require(self.min_servers >= 1, f"rollout.min_servers: must be >= 1, got {self.min_servers}")
        require(self.outage_timeout_s > 0,
                f"rollout.outage_timeout_s: must be > 0, got {self.outage_timeout_s}")
        require(self.mode != "embedded" or self.min_servers <= self.num_servers,
                f"rollout.min_servers: {self.min_servers} exceeds rollout.num_servers "
                f"{self.num_servers} (the embedded run's servers)")
        require(self.temperature > 0, f"rollout.temperature: must be > 0, got {self.temperature}")
        require(0 < self.top_p <= 1, f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        require(self.top_k == -1 or self.top_k >= 1, f"rollout.top_k: must be -1 or >= 1, got {self.top_k}")
        require(self.engine in ("sglang", "vllm"),
                f"rollout.engine: {self.engine!r} is not sglang or vllm")
        require(self.engine != "vllm" or (self.top_p == 1 and self.top_k == -1),
                f"rollout.engine: vllm with rollout.top_p {self.top_p} / top_k {self.top_k}: "
                "vLLM's log-probs are renormalised over the tokens top-p/top-k keep, the "
                "trainer's are not; use top_p 1 and top_k -1 with vLLM")
        require(self.engine != "vllm" or not self.colocated,
                "rollout.colocated: not with rollout.engine vllm (the memory release around "
                "training is SGLang's release/resume_memory_occupation; vLLM's /sleep does "
                "nothing on the CPU)")
        require(self.engine != "vllm" or not self.weight_sync.delta,
                "rollout.weight_sync.delta: vLLM has no delta format; set it to false with "
                "rollout.engine vllm")
        require(self.engine != "vllm" or self.weight_sync.transport != "tensor",
                "rollout.engine: vllm has no 'tensor' weight sync (vLLM's is CUDA IPC); set "
                "rollout.weight_sync.transport to distributed or disk")
        require(self.eval_samples_per_prompt >= 1,
                f"rollout.eval_samples_per_prompt: must be >= 1, got {self.eval_samples_per_prompt}")
        require(self.max_new_tokens >= 1,
                f"rollout.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        require(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
                f"rollout.mem_fraction_static: must be in (0, 1), got {self.mem_fraction_static}")
        for name in ("ep_size", "dp_size"):
            value = getattr(self, name)
            require(value >= 1 and self.tp_size % value == 0,
                    f"rollout.{name}: {value} does not divide rollout.tp_size {self.tp_size}")
        require(not self.enable_dp_attention or self.dp_size > 1,
                "rollout.enable_dp_attention: needs rollout.dp_size > 1 (the number of attention "
                f"data-parallel groups), got {self.dp_size}")
        transport = self.weight_sync.transport
        require(self.enable_dp_attention or self.dp_size == 1 or transport == "disk",
                f"rollout.dp_size: {self.dp_size} data-parallel replicas per server (no "
                "rollout.enable_dp_attention): SGLang updates such servers only from disk, not "
                f"with rollout.weight_sync.transport {transport} (its update_weights_from_"
                "distributed / _tensor require dp_size 1); use rollout.weight_sync.transport: "
                "disk, or set rollout.enable_dp_attention: true for data-parallel attention")
        require(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
                f"rollout.cuda_graph_max_bs: must be >= 1, got {self.cuda_graph_max_bs}")


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
        require(self.num_probes >= 1, f"parity.num_probes: must be >= 1, got {self.num_probes}")
        require(math.isfinite(self.max_gap_mean) and self.max_gap_mean > 0,
                f"parity.max_gap_mean: must be a positive number, got {self.max_gap_mean}")
