"""The checks that need several sections: called by :meth:`Config.__post_init__
<megatron_gspo.config.root.Config.__post_init__>` (every file is checked when it is loaded),
except :func:`validate_sft_context_parallel` (the SFT trainer's); the check that needs the world
size, ``validate_data_parallel``, is in :mod:`megatron_gspo.config.root` beside ``Config``. Each
message names the fields."""

from __future__ import annotations

from megatron_gspo.config.checks import ConfigError, require
from megatron_gspo.config.data import REWARD_KINDS, DataConfig, RewardConfig
from megatron_gspo.config.gspo import GSPOConfig
from megatron_gspo.config.model import ModelConfig, ParallelConfig, pipeline_stage_layers
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.run import OptimConfig, RunSettings


def validate_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Check that every parallel size divides what it splits; the error names both fields."""
    tp, ep = parallel.tensor, parallel.expert
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


def validate_parallel_optim(parallel: ParallelConfig, optim: OptimConfig) -> None:
    require(not (parallel.overlap_param_gather and not optim.use_distributed_optimizer),
            "parallel.overlap_param_gather: needs optim.use_distributed_optimizer: true (it "
            "overlaps the distributed optimizer's parameter all-gather)")


def validate_routing_replay(gspo: GSPOConfig, model: ModelConfig) -> None:
    """Replay sets each router's experts before a micro-batch's forward; a recompute in the
    backward would re-run the router against the next micro-batch's experts."""
    if gspo.routing_replay == "none":
        return
    recomputes_router = model.recompute_granularity == "full" or (
        model.recompute_granularity == "selective" and "moe" in (model.recompute_modules or []))
    require(not recomputes_router,
            f"gspo.routing_replay: {gspo.routing_replay} is not supported with activation "
            "recompute that re-runs the router (model.recompute_granularity full, or selective "
            "with 'moe' in model.recompute_modules); use core_attn / moe_act or no recompute")


def validate_data_reward(data: DataConfig, reward: RewardConfig) -> None:
    """The reward must fit the prompts: files need an explicit kind, labels where it reads them."""
    require(not (reward.kind is None and data.train_path is not None),
            f"reward.kind: required with data.train_path (one of {', '.join(REWARD_KINDS)})")
    require(not (reward.kind in ("exact_match", "math", "addition", "carry_addition",
                                 "tool_addition")
                 and data.task is None and data.label_key is None),
            f"data.label_key: reward.kind {reward.kind!r} compares with a label; set the label field")
    require(not (reward.kind in ("addition", "carry_addition", "tool_addition")
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
    require(gbs % g == 0,
            f"run.global_batch_size: {gbs} is not a multiple of gspo.group_size {g}")
    require(gbs % k == 0,
            f"run.global_batch_size: {gbs} does not split into gspo.updates_per_rollout = {k} "
            "mini-batches")
    require((gbs // k) % mbs == 0,
            f"run.global_batch_size: a mini-batch of {gbs} / gspo.updates_per_rollout {k} = "
            f"{gbs // k} sequences is not a multiple of run.micro_batch_size {mbs}")


def validate_schedule(optim: OptimConfig, run: RunSettings) -> None:
    """Megatron's scheduler needs the warmup to end before the run does."""
    require(optim.warmup_steps < run.num_steps,
            f"optim.warmup_steps: {optim.warmup_steps} must be < run.num_steps {run.num_steps} "
            "(the warmup has to end before the run)")


def validate_sft_context_parallel(parallel: ParallelConfig) -> None:
    """SFT's rows are not split over context-parallel ranks (the RL trainer's are: zigzag rows or
    packed sequences, ``train.batching``); called by the SFT trainer."""
    require(parallel.context == 1,
            f"parallel.context: {parallel.context}: SFT does not split its rows over "
            "context-parallel ranks (GSPO training does); run SFT with parallel.context 1")


def validate_weight_sync(rollout: RolloutConfig, model: ModelConfig) -> None:
    """A delta sync compares bf16 bits: the wire dtype must be bfloat16."""
    wire = rollout.weight_sync.dtype or model.params_dtype
    require(not rollout.weight_sync.delta or wire == "bfloat16",
            "rollout.weight_sync.delta: needs bf16 weights on the wire "
            f"(rollout.weight_sync.dtype resolves to {wire}); set rollout.weight_sync.dtype: "
            "bfloat16")


def validate_quantization(rollout: RolloutConfig, gspo: GSPOConfig) -> None:
    """FP8 rollouts, bf16 training (``rollout.quantization``): the rollout log-probs come from
    FP8 weights, the trainer's from its own; the behaviour weight (``gspo.mismatch_correction``,
    truncated importance sampling) corrects for that only in the decoupled objective
    (``gspo.old_logprobs: recompute``), and is on there by default. The bypass form (pi_old = the
    FP8 rollout's log-probs) is refused unless the correction is turned off explicitly. The FP8
    wire format is not a bf16 delta."""
    if rollout.quantization is None:
        return
    require(not (gspo.old_logprobs == "rollout" and gspo.mismatch_correction is None),
            f"rollout.quantization: {rollout.quantization} rollouts sample from FP8 weights, so "
            "their log-probs differ from the trainer's; the behaviour weight that corrects for "
            "that (gspo.mismatch_correction, truncated importance sampling) needs "
            "gspo.old_logprobs: recompute (the default); or set gspo.mismatch_correction: false "
            "to take the FP8 log-probs as pi_old uncorrected")
    require(not rollout.weight_sync.delta,
            f"rollout.weight_sync.delta: not with rollout.quantization {rollout.quantization} "
            "(the servers receive FP8 blocks and their scales, not bf16 bits to compare)")


def quantization_note(rollout: RolloutConfig, gspo: GSPOConfig) -> str | None:
    """What ``config`` and ``train`` say about ``rollout.quantization`` (None: unset)."""
    if rollout.quantization is None:
        return None
    if gspo.uses_behaviour_weight():
        return (f"rollout.quantization {rollout.quantization}: the rollout/trainer log-prob "
                "mismatch of FP8 rollouts is corrected by the behaviour weight "
                f"(gspo.mismatch_correction on, truncated at gspo.mismatch_cap "
                f"{gspo.mismatch_cap:g})")
    return (f"rollout.quantization {rollout.quantization}: gspo.mismatch_correction is off: the "
            "FP8 rollouts' log-prob mismatch is not corrected")


MAX_STALENESS = 16
"""The largest rollout.max_staleness (the staleness study, docs/async.md, goes to 4)."""
SAMPLE_BYTES_PER_TOKEN = 112
"""Rank 0's memory per token of a buffered sample, as Python lists: prompt and output ids
(36 B each), the output log-prob (32 B) and mask (8 B)."""


def validate_staleness(rollout: RolloutConfig, run: RunSettings, gspo: GSPOConfig,
                       model: ModelConfig) -> None:
    """``rollout.async: full`` admits up to (eta + 1) x run.global_batch_size samples ahead of the
    trainer (``pipeline.sources.stream.admission_limit``), all held on rank 0 while in flight or
    buffered: eta is bounded by :data:`MAX_STALENESS`, whatever the mode (a later run may switch
    to full), and the message states the samples, the memory and the requests it implies."""
    eta = rollout.max_staleness
    if eta <= MAX_STALENESS:
        return
    samples = (eta + 1) * run.global_batch_size
    tokens = run.seq_length + 1
    per_token = SAMPLE_BYTES_PER_TOKEN
    routes = ""
    if gspo.routing_replay == "rollout":  # int32 [tokens, layers, top-k] per sample
        per_token += 4 * model.num_layers * model.moe_router_topk
        routes = " with their routed experts"
    gib = samples * tokens * per_token / 2 ** 30
    require(False,
            f"rollout.max_staleness: {eta} is above {MAX_STALENESS}: rollout.async full admits up "
            f"to (eta + 1) x run.global_batch_size = {samples:,} samples ahead of the trainer, "
            f"up to run.seq_length + 1 = {tokens} tokens each{routes}: ~{gib:,.1f} GiB on rank 0, "
            f"and min(that, rollout.max_concurrency {rollout.max_concurrency}) requests in "
            "flight; the samples would also be trained up to eta versions stale. Lower it (1 "
            "overlaps one step's rollout with training; the staleness study in docs/async.md "
            "goes to 4)")
