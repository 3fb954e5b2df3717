"""The sections of the training run itself: ``optim`` (:class:`OptimConfig`, the optimizer and
learning-rate schedule) and ``run`` (:class:`RunSettings`: seed, steps, batch sizes, output and
the metric loggers, with ``run.wandb`` / ``run.mlflow``; :func:`validate_loggers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_gspo.config.checks import require
from megatron_gspo.config.yaml_load import shown


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
    """Megatron's distributed (ZeRO-1) optimizer (on a machine without CUDA: float32 only,
    docs/cpu_accommodations.md accommodation 9). Its checkpoints resume only under the parallel
    layout that wrote them, and only with this field true (train/checkpoint/state.py)."""
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
        require(self.lr > 0, f"optim.lr: must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr, f"optim.min_lr: must be in [0, optim.lr], got {self.min_lr}")
        require(self.clip_grad >= 0, f"optim.clip_grad: must be >= 0 (0 disables), got {self.clip_grad}")
        require(self.warmup_steps >= 0, f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        require(self.min_lr == 0 or self.lr_decay_style != "constant",
                f"optim.min_lr: {self.min_lr} is only used by a decaying schedule and "
                "optim.lr_decay_style is 'constant'; set lr_decay_style linear or cosine, or "
                "min_lr 0")
        require(0 <= self.optimizer_offload_fraction <= 1,
                f"optim.optimizer_offload_fraction: must be in [0, 1], got {self.optimizer_offload_fraction}")
        for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
            require(not getattr(self, name) or self.use_distributed_optimizer,
                    f"optim.{name}: needs optim.use_distributed_optimizer: true (Megatron offers "
                    "it only inside the distributed optimizer)")
        require(not self.use_precision_aware_optimizer or self.optimizer == "adam",
                f"optim.use_precision_aware_optimizer: only with optim.optimizer adam, got "
                f"{self.optimizer!r}")


LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "mlflow")
"""What ``run.loggers`` may list (``pipeline.observe.metrics`` and ``pipeline.observe.trackers``; docs/metrics.md)."""


def _require_name(value: Optional[str], path: str) -> None:
    require(value is None or bool(value.strip()), f"{path}: empty; name it or leave it null")


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
            require(getattr(self, name) >= 1, f"run.{name}: must be >= 1, got {getattr(self, name)}")
        require(bool(self.output_dir.strip()),
                "run.output_dir: empty; name the run directory (checkpoints, metrics, logs)")
        require(self.init_from is None or bool(self.init_from.strip()),
                "run.init_from: empty; name a Hugging Face directory or a Megatron checkpoint, "
                "or null for random weights from run.seed")
        require(self.global_batch_size % self.micro_batch_size == 0,
                f"run.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"run.micro_batch_size {self.micro_batch_size}")
        require(self.keep_checkpoints is None or self.keep_checkpoints >= 1,
                f"run.keep_checkpoints: must be >= 1 (or null to keep all), got "
                f"{self.keep_checkpoints}")
        require(self.max_tokens_per_micro_batch is None or self.max_tokens_per_micro_batch >= 1,
                f"run.max_tokens_per_micro_batch: must be >= 1 (or null for padded rows), got "
                f"{self.max_tokens_per_micro_batch}")
        validate_loggers(self)


def validate_loggers(run: RunSettings) -> None:
    """Known names, each once, jsonl among them; run.wandb / run.mlflow only with their logger."""
    choices = ", ".join(LOGGERS)
    for i, name in enumerate(run.loggers):
        require(name in LOGGERS, f"run.loggers[{i}]: unknown logger {shown(name)} (choose from "
                                 f"{choices})")
        require(name not in run.loggers[:i], f"run.loggers[{i}]: {name!r} is listed twice")
    require("jsonl" in run.loggers,
            f"run.loggers: must include jsonl (got {run.loggers}): metrics.jsonl is what plots, "
            "--resume and the parity checks read")
    for name, default in (("wandb", WandbConfig()), ("mlflow", MLflowConfig())):
        require(getattr(run, name) == default or name in run.loggers,
                f"run.{name}: set, but run.loggers does not list {name}; add it to run.loggers "
                f"or unset run.{name}")
