"""The GSPO loop: rollout -> (release) -> train -> (resume) -> sync -> eval -> log -> save.

Every training rank runs :func:`run`. Global rank 0 talks to the rollout servers and the reward
function, builds the rollout batch and broadcasts it; then every rank trains on its share
(``trainer.train_rollout``), and every rank takes part in the weight sync. The trainer is passed in
(the Megatron side lives in ``megatron_gspo.train.rl_trainer``; this module imports no Megatron).

One step::

    prompts   = P prompts from the sampler (deterministic, part of the checkpoint)
    rollouts  = G samples per prompt from the servers (seeds: pipeline.rollout.rollout_seed)
    rewards   = reward(prompt, response) per sample; non-finite or failing -> error (or 0, counted)
    [dynamic sampling: drop groups whose rewards are all equal, sample more prompts]
    advantages= group-relative (docs/gspo_math.md)
    (release) = colocated servers give their memory back to training
    train     = k GSPO mini-batch updates on Megatron
    (resume)  = colocated servers take their weight memory back
    sync      = weights -> every rollout server, weight_version = step (then the KV cache back)
    parity    = with parity.enabled: servers' and trainer's log-probs of fixed probes compared
                (past the threshold: sync once more, check again, else stop; pipeline/parity.py)
    eval      = every run.eval_interval steps: mean reward and pass@1 over n samples per prompt
    log       = metrics.jsonl / TensorBoard / one progress line
    save      = every run.save_interval steps, at the last step, and on SIGTERM / SIGINT / SIGUSR1
                (then stop)

What a failure or a stop signal does is decided in one place, :class:`StepGuard`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_gspo.config import Config
from megatron_gspo.loss.advantages import group_advantages, is_zero_std_group
from megatron_gspo.train.batching import rl_batch
from pipeline.metrics import MetricsLogger
from pipeline.producer import BUFFER_KEY, RolloutProducer, decode_batch, encode_batch

if TYPE_CHECKING:
    from pipeline.data import Prompt, PromptSampler
    from pipeline.rewards import RewardFn
    from pipeline.rollout import RolloutClient, RolloutResult
    from pipeline.parity import ParityWatchdog
    from pipeline.server_pool import ServerPool
    from pipeline.weight_push import WeightPusher

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM / SIGINT / SIGUSR1 after saving a checkpoint (EX_TEMPFAIL):
"requeue me". A finished run exits 0, a failed one with another non-zero status."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The signals a training rank checkpoints and stops on (:class:`StopFlag`)."""

MAX_DYNAMIC_SAMPLING_ROUNDS = 8
"""Extra rounds of prompts dynamic sampling may draw in one step before it tops the batch up
with zero-std groups."""


class Trainer(Protocol):
    def train_rollout(self, batch: dict, step: int) -> dict: ...

    def hf_buckets(self) -> Any:
        """Collective: the policy as full HF tensor buckets (every rank iterates them)."""

    def save(self, run_dir: str, step: int, run_state: dict) -> Any: ...


@dataclass
class StopFlag:
    """Set by SIGTERM / SIGINT / SIGUSR1: finish the current step, save, exit with
    PREEMPTED_EXIT_CODE. SIGINT (Ctrl-C; what torchrun passes on from the launcher) counts as a
    stop request too: the checkpoint is written first. A second signal changes nothing (the stop
    is under way; SIGKILL aborts it)."""

    signum: Optional[int] = None
    group: Any = None
    """The group of the all-reduce: the host-side control group (gloo); None: the default."""
    _previous: dict = field(default_factory=dict)
    _stopping: bool = False
    """Some rank was signalled (``any_rank``): this one is stopping too."""

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Give the stop signals back to the handlers ``install`` replaced - unless a stop was
        requested: that process is on its way out with its checkpoint written, and the signals
        stay ignored, so that a late one (torchrun stops the ranks that are still tidying up
        once the first has exited) cannot kill it before it exits with PREEMPTED_EXIT_CODE."""
        stopping = self.signum is not None or self._stopping
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, signal.SIG_IGN if stopping else handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:  # the first one names the stop
            self.signum = signum

    def any_rank(self) -> bool:
        """True on every rank if any rank was signalled (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._stopping = self._stopping or bool(flag.item())
        return bool(flag.item())


@dataclass(kw_only=True)
class LoopContext:
    """What the loop needs besides the trainer; built by ``launch.rl_session.RLSession``.

    The fields marked "rank 0" are used on global rank 0 only (None / empty elsewhere)."""

    cfg: Config
    run_dir: str
    logger: MetricsLogger
    """Rank 0 writes; the other ranks hold a disabled logger."""
    stop: StopFlag
    weights: Optional[WeightPusher] = None
    """Every rank: pushes the trainer's HF buckets to every rollout server."""
    control_group: Optional[dist.ProcessGroup] = None
    """gloo, long timeout: rank 0's broadcasts (None: the default group)."""
    sampler: Optional[PromptSampler] = None
    """Rank 0: the training prompts; its state is checkpointed (the data position)."""
    eval_prompts: list[Prompt] = field(default_factory=list)
    """Rank 0: the held-out prompts."""
    reward_fn: Optional[RewardFn] = None
    """Rank 0."""
    client: Optional[RolloutClient] = None
    """Rank 0: /generate through the router (or straight to the servers)."""
    decode: Optional[Callable[[Sequence[int]], str]] = None
    """Rank 0: token ids -> text, for the reward function."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Rank 0: extra stop tokens of every request."""
    server_urls: list[str] = field(default_factory=list)
    """Rank 0: every rollout server (release / resume of colocated servers' memory)."""
    servers: Optional[ServerPool] = None
    """Rank 0: which servers are alive (``pipeline.server_pool``): checked before every weight
    sync, dead ones dropped and (embedded) restarted. None: every server, always."""
    parity: Optional[ParityWatchdog] = None
    """Every rank, with parity.enabled: the watchdog run after every weight sync
    (:func:`check_parity`); rank 0's holds the probe prompts."""
    rollout_buffer: Optional[dict] = None
    """Rank 0, ``rollout.async: one_step`` resumed: the next step's finished batch, from the
    checkpoint (``pipeline.producer``)."""


# ------------------------------------------------------------------------------------------------
# The phases (rank 0 unless said otherwise)


def rollout_phase(ctx: LoopContext, step: int) -> tuple[dict, dict]:
    """Rank 0: prompts -> samples -> rewards -> advantages -> the training batch and metrics."""
    cfg = ctx.cfg
    num_prompts = cfg.run.global_batch_size // cfg.gspo.group_size
    start = time.monotonic()
    prompts = ctx.sampler.next_batch(num_prompts)
    groups = _generate_groups(ctx, prompts, step, 0)
    rewards, failures = _score(ctx, prompts, groups)
    metrics: dict[str, float] = {}
    all_rewards = torch.tensor(rewards, dtype=torch.float64)
    zero_std = is_zero_std_group(all_rewards, cfg.gspo.group_size)
    metrics["zero_std_group_frac"] = float(zero_std.float().mean())
    metrics["reward_mean"] = float(all_rewards.mean())
    metrics["reward_std"] = float(all_rewards.std(unbiased=False))
    if cfg.gspo.dynamic_sampling:
        prompts, groups, rewards, rounds = _fill_with_informative_groups(
            ctx, step, prompts, groups, rewards, zero_std, num_prompts)
        metrics["dynamic_sampling_rounds"] = rounds
    gen_s = time.monotonic() - start
    outputs = [list(r.output_ids) for group in groups for r in group]
    logprobs = [list(r.output_logprobs) for group in groups for r in group]
    prompt_ids = [p.prompt_ids for p, group in zip(prompts, groups) for _ in group]
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), cfg.gspo.group_size,
                                  normalize_std=cfg.gspo.normalize_std,
                                  leave_one_out=cfg.gspo.leave_one_out)
    from pipeline.tasks import PAD_ID

    batch = rl_batch(prompt_ids, outputs, logprobs, advantages, cfg.run.seq_length, PAD_ID)
    shape = _routed_experts_shape(cfg)
    if shape is not None:  # routing replay "rollout": the experts the servers routed each token to
        from pipeline.routed_experts import batch_routed_experts

        batch["routed_experts"] = batch_routed_experts(
            prompt_ids, outputs, [r.routed_experts for group in groups for r in group],
            cfg.run.seq_length, *shape)
    lengths = torch.tensor([len(o) for o in outputs], dtype=torch.float64)
    finish = [r.finish_reason for group in groups for r in group]
    metrics.update(staleness_metrics([r for group in groups for r in group], trained=step - 1))
    metrics.update({
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": sum(f == "length" for f in finish) / len(finish),
        "reward_failures": failures,
        "rollout_s": gen_s,
        "rollout_tokens_per_s": float(lengths.sum()) / max(gen_s, 1e-9),
    })
    return batch, metrics


def staleness_metrics(results: Sequence[RolloutResult], trained: int) -> dict[str, float]:
    """Per-token staleness of a batch: versions between the policy that generated each output
    token (``meta_info.weight_versions``; the loop labels the weights after step k with ``k``)
    and the policy being trained (``trained``: the weights at the start of the step). Tokens
    whose version is not a step number (a server's initial label) are not counted."""
    ages = []
    for r in results:
        for version, start, end in r.weight_versions:
            if version.lstrip("-").isdigit():
                ages += [trained - int(version)] * (end - start)
    if not ages:
        return {}
    t = torch.tensor(ages, dtype=torch.float64)
    out = {"staleness_mean": float(t.mean()), "staleness_max": float(t.max())}
    for k in range(3):  # the histogram's first bins: fraction of tokens k versions old
        out[f"staleness_frac_{k}"] = float((t == k).double().mean())
    out["staleness_frac_3plus"] = float((t >= 3).double().mean())
    return out


def _routed_experts_shape(cfg: Config) -> Optional[tuple[int, int]]:
    """(layers, top-k) of the routed experts the training rollouts ask the servers for: with
    ``gspo.routing_replay: rollout`` only (evaluation never asks)."""
    if cfg.gspo.routing_replay != "rollout":
        return None
    return cfg.model.num_layers, cfg.model.moe_router_topk


def _generate_groups(ctx: LoopContext, prompts: list[Prompt], step: int,
                     round_: int) -> list[list[RolloutResult]]:
    from pipeline.rollout import rollout_seed, sampling_params

    cfg = ctx.cfg
    shape = _routed_experts_shape(cfg)
    extra = {"routed_experts": shape} if shape is not None else {}
    return ctx.client.generate_groups([p.prompt_ids for p in prompts], cfg.gspo.group_size,
                                      sampling_params(cfg.rollout, ctx.stop_token_ids),
                                      seed=rollout_seed(cfg.run.seed, step, round_), **extra)


def _score(ctx: LoopContext, prompts: list[Prompt],
           groups: list[list[RolloutResult]]) -> tuple[list[float], int]:
    """Rewards of every sample, prompt-major; returns (rewards, number of failures counted as 0)."""
    from pipeline.rewards import RewardSample, compute_rewards

    samples = [RewardSample(prompt=prompt, sample_index=s_i, response_ids=list(result.output_ids),
                            response_text=ctx.decode(result.output_ids))
               for prompt, group in zip(prompts, groups) for s_i, result in enumerate(group)]
    result = compute_rewards(ctx.reward_fn, samples, on_error=ctx.cfg.reward.on_error)
    return list(result.rewards), result.num_failures


def _fill_with_informative_groups(ctx: LoopContext, step: int, prompts: list[Prompt],
                                  groups: list[list[RolloutResult]], rewards: list[float],
                                  zero_std: torch.Tensor, num_prompts: int,
                                  max_rounds: int = MAX_DYNAMIC_SAMPLING_ROUNDS):
    """Dynamic sampling: keep groups with reward variance, sample more prompts until P remain.

    Returns (prompts, groups, rewards, rounds) of the batch: at most ``max_rounds`` extra rounds,
    then zero-std groups of the first round fill what is still missing."""
    G = ctx.cfg.gspo.group_size
    chosen_prompts: list[Prompt] = []
    chosen_groups: list[list[RolloutResult]] = []
    chosen_rewards: list[float] = []

    def choose(prompt: Prompt, group: list[RolloutResult], group_rewards: list[float]) -> None:
        chosen_prompts.append(prompt)
        chosen_groups.append(group)
        chosen_rewards.extend(group_rewards)

    for i in range(len(prompts)):
        if not bool(zero_std[i]):
            choose(prompts[i], groups[i], rewards[i * G:(i + 1) * G])
    rounds = 0
    while len(chosen_prompts) < num_prompts and rounds < max_rounds:
        rounds += 1
        more = ctx.sampler.next_batch(num_prompts)
        more_groups = _generate_groups(ctx, more, step, rounds)
        more_rewards, _ = _score(ctx, more, more_groups)
        more_zero_std = is_zero_std_group(torch.tensor(more_rewards, dtype=torch.float64), G)
        for i in range(len(more)):
            if not bool(more_zero_std[i]) and len(chosen_prompts) < num_prompts:
                choose(more[i], more_groups[i], more_rewards[i * G:(i + 1) * G])
    for i in range(len(prompts)):  # not enough informative groups: top up with zero-std ones
        if bool(zero_std[i]) and len(chosen_prompts) < num_prompts:
            choose(prompts[i], groups[i], rewards[i * G:(i + 1) * G])
    return chosen_prompts, chosen_groups, chosen_rewards, rounds


def evaluate(ctx: LoopContext, step: int) -> dict:
    """Rank 0: mean reward and pass@1 (fraction of correct samples) over n samples per prompt."""
    from pipeline.rollout import eval_seed, sampling_params

    cfg = ctx.cfg
    groups = ctx.client.generate_groups([p.prompt_ids for p in ctx.eval_prompts],
                                        cfg.rollout.eval_samples_per_prompt,
                                        sampling_params(cfg.rollout, ctx.stop_token_ids),
                                        seed=eval_seed(cfg.run.seed))
    rewards, _ = _score(ctx, ctx.eval_prompts, groups)
    r = torch.tensor(rewards, dtype=torch.float64)
    per_prompt = r.view(len(ctx.eval_prompts), -1).mean(1)
    se = float(per_prompt.std() / len(per_prompt) ** 0.5) if len(per_prompt) > 1 else 0.0
    # reward_se: the standard error of reward_mean over the prompts (each prompt's mean)
    return {"eval/reward_mean": float(r.mean()), "eval/reward_se": se,
            "eval/pass_at_1": float((r >= 1.0).double().mean())}


def _release_servers(ctx: LoopContext) -> None:
    from pipeline.rollout import control

    for url in ctx.server_urls:
        control(url, "/release_memory_occupation", {"tags": None}, timeout_s=120.0)


def _resume_servers(ctx: LoopContext, tags: list[str]) -> None:
    from pipeline.rollout import control

    for url in ctx.server_urls:
        control(url, "/resume_memory_occupation", {"tags": tags}, timeout_s=120.0)


MAX_SYNC_ATTEMPTS = 3
"""Weight pushes tried in one sync when servers die during it (each retry has fewer servers)."""


def sync_weights(ctx: LoopContext, trainer: Trainer, version: str) -> dict:
    """Every rank: the trainer's HF buckets, pushed to every rollout server by the pusher.

    With a server pool (``ctx.servers``, rank 0) the servers are checked first: the dead ones
    are dropped (and restarted in embedded mode, then included here: a restarted server gets
    these weights before it re-enters the router); a push that fails because a server died
    meanwhile is made again to the servers left."""
    from pipeline.weight_push import WeightPushError

    pool = _sync_members(ctx)
    for attempt in range(MAX_SYNC_ATTEMPTS):
        try:
            stats = ctx.weights.push(trainer.hf_buckets(), version)
        except WeightPushError:  # raised on every rank alike: all of them retry or none
            if pool is None or attempt + 1 == MAX_SYNC_ATTEMPTS:
                raise
            before, pool = pool, _sync_members(ctx)
            if pool["events"] == before["events"]:  # no server died: another failure
                raise
            continue
        if pool is not None:
            _pool_call(ctx, lambda: ctx.servers.admit())
        return stats.metrics()
    raise AssertionError("unreachable")


def check_parity(ctx: LoopContext, trainer: Trainer, version: str) -> dict:
    """Every rank, after a weight sync: the parity watchdog's ``parity/*`` metrics ({} without
    one). Past ``parity.max_gap_mean``: one more sync of the same weights, checked again; still
    past it: :class:`pipeline.parity.ParityError` on every rank alike."""
    if ctx.parity is None:
        return {}
    first = _parity_once(ctx, trainer)
    if not first.failed:
        return first.metrics()
    if dist.get_rank() == 0:
        print(f"parity watchdog: {first.describe()}; syncing the weights again", flush=True)
    sync_weights(ctx, trainer, version)
    second = _parity_once(ctx, trainer)
    if second.failed:
        from pipeline.parity import ParityError

        raise ParityError(f"{second.describe()}, also after syncing the weights again (before: "
                          f"{first.worst()[1]['mean']:.3g}); the servers do not serve the "
                          "trainer's policy - see docs/parity.md")
    return {**second.metrics(), "parity/resyncs": 1}


def _parity_once(ctx: LoopContext, trainer: Trainer):
    """Collective: rank 0 has every server score the probes, every rank compares (the trainer
    scores them: a collective)."""
    status, served = _on_main(ctx, lambda: ctx.parity.server_scores(
        ctx.server_urls, ctx.client, ctx.stop_token_ids))
    if status != "ok":
        raise RuntimeError(f"parity probes: {served}")
    return ctx.parity.compare(served, trainer)


def _pool_call(ctx: LoopContext, fn):
    """``fn()`` on rank 0, its result on every rank; an error there raised on every rank alike."""
    status, value = _on_main(ctx, fn)
    if status != "ok":
        raise RuntimeError(f"rollout servers: {value}")
    return value


def _sync_members(ctx: LoopContext) -> Optional[dict]:
    """Collective: rank 0's pool check (None without a pool): ``{"members", "renewed",
    "events"}``; every rank's pusher then pushes to those members."""
    has_pool = _broadcast(ctx.servers is not None if dist.get_rank() == 0 else None,
                          ctx.control_group)
    if not has_pool:
        return None

    def check() -> dict:
        members = ctx.servers.check()
        ctx.server_urls = list(members)  # colocated release / resume: the live ones
        return {"members": members, "renewed": ctx.servers.take_renewed(),
                "events": ctx.servers.events}
    pool = _pool_call(ctx, check)
    ctx.weights.set_servers(pool["members"], renewed=pool["renewed"])
    return pool


def server_metrics(ctx: LoopContext) -> dict:
    """Rank 0: ``rollout/servers_alive`` and ``rollout/server_restarts`` (none without a pool)."""
    return ctx.servers.metrics() if ctx.servers is not None else {}


# ------------------------------------------------------------------------------------------------
# Rank 0's outcomes on every rank, and the failure / preemption rules


def _broadcast(obj, group=None):
    """Rank 0's ``obj`` on every rank."""
    payload = [obj]
    dist.broadcast_object_list(payload, src=0, group=group)
    return payload[0]


def _on_main(ctx: LoopContext, fn, *args):
    """Run ``fn`` on rank 0 and broadcast ("ok", result) or ("error", message) to every rank, so
    that a failure there (a rollout server gone) reaches all ranks instead of hanging them."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", fn(*args))
        except Exception as err:  # noqa: BLE001 - re-raised on every rank (or preempted)
            outcome = ("error", f"{type(err).__name__}: {err}")
    return _broadcast(outcome, ctx.control_group)


class Preempted(Exception):
    """Stop requested (SIGTERM / SIGINT / SIGUSR1) and a consistent checkpoint was written."""


class PhaseFailed(Exception):
    """A phase failed on EVERY rank alike: rank 0's broadcast outcome, or a collective that
    raises the same error everywhere (the weight sync). ``cause``: the collective's own error."""

    def __init__(self, message: str, cause: Optional[BaseException] = None):
        super().__init__(message)
        self.message, self.cause = message, cause


def on_main(ctx: LoopContext, fn, *args, what: Optional[str] = None):
    """``fn(*args)`` on rank 0, its result on every rank; :class:`PhaseFailed` on every rank if
    it raised there (the message prefixed by ``what``)."""
    status, value = _on_main(ctx, fn, *args)
    if status == "ok":
        return value
    raise PhaseFailed(f"{what}: {value}" if what else value)


def everywhere(fn, *args, what: str):
    """``fn(*args)`` on this rank, where ``fn`` is a collective that fails on all ranks alike."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the same error on every rank
        raise PhaseFailed(f"{what}: {err}", cause=err) from err


class StepGuard:
    """What a failure or a stop signal does, depending on where in the step it happens.

    Slurm's requeue and preemption send SIGTERM to every task at once, so the rollout servers may
    already be gone when the trainer notices. The rule is: on a signal, save the last CONSISTENT
    state without needing the servers, then stop (:class:`Preempted`):

    * ``begin(step)``: a signal since the last step -> the checkpoint of step - 1, stop;
    * ``with before_update():`` a :class:`PhaseFailed` before step k's optimizer update (rollout,
      releasing the servers' memory) while signalled -> the checkpoint of step k - 1, with the data
      position from before step k drew its prompts; stop;
    * ``with after_update():`` a :class:`PhaseFailed` after the update (resuming the servers'
      memory, the weight sync, the evaluation) while signalled -> the rest of the block is
      skipped, and ``end`` saves step k (logged, without the sync: a resumed run syncs the
      servers first anyway) and stops;
    * ``end(save_due=...)``: saves when due, at the last step, or when signalled; then stops if
      signalled (at the last step the run simply finishes).

    A failure without a signal is an error on every rank: ``RuntimeError("step k: ...")``, or the
    collective's own exception. A step is never saved twice, nor is the step the run started
    from (its checkpoint exists; for step 0 a fresh start is the same). Anything but
    :class:`PhaseFailed` passes through untouched (it need not have happened on every rank, so
    no collective may run on its behalf). Collective: every rank makes the same calls.
    """

    def __init__(self, stop: StopFlag, *, save: Callable[[int, Optional[dict]], None],
                 data_position: Callable[[], Optional[dict]], start_step: int):
        self.stop = stop
        self._save = save
        self._data_position = data_position
        self.saved_step = start_step
        """The newest step whose state a checkpoint holds (or the run's start)."""
        self.step = start_step + 1
        """The step in progress (before ``begin`` of the first step: the initial sync)."""
        self.interrupted: Optional[str] = None
        self._position_before: Optional[dict] = None

    def begin(self, step: int) -> None:
        self.step, self.interrupted = step, None
        self._position_before = self._data_position()  # what a checkpoint of step - 1 holds
        if self.stop.any_rank():
            self._stop("signal between steps", self.step - 1, self._position_before)

    @contextmanager
    def before_update(self) -> Iterator[None]:
        try:
            yield
        except PhaseFailed as failed:
            if not self.stop.any_rank():
                raise self._error(failed) from None
            self._stop(failed.message, self.step - 1, self._position_before)

    @contextmanager
    def after_update(self) -> Iterator[None]:
        try:
            yield
        except PhaseFailed as failed:
            if not self.stop.any_rank():
                raise self._error(failed) from None
            self.interrupted = failed.message

    def end(self, *, save_due: bool, last: bool) -> None:
        stop_now = self.interrupted is not None or self.stop.any_rank()
        if save_due or last or stop_now:
            self._checkpoint(self.step, self._data_position())
        if stop_now and not last:
            raise Preempted(self.interrupted or "signal")

    def _error(self, failed: PhaseFailed) -> BaseException:
        return failed.cause if failed.cause is not None else RuntimeError(
            f"step {self.step}: {failed.message}")

    def _checkpoint(self, step: int, data_position: Optional[dict]) -> None:
        self._save(step, data_position)
        self.saved_step = step

    def _stop(self, reason: str, done_step: int, data_position: Optional[dict]) -> None:
        if done_step > self.saved_step:
            self._checkpoint(done_step, data_position)
        raise Preempted(reason)


# ------------------------------------------------------------------------------------------------
# The loop


def run(ctx: LoopContext, trainer: Trainer, *, start_step: int) -> dict:
    """Run steps start_step+1 .. run.num_steps; returns {"status", "history"}.

    Status "finished", or "preempted" after a stop signal (a consistent checkpoint is saved:
    :class:`StepGuard`). A failure without a signal is an error on every rank."""
    cfg = ctx.cfg
    is_main = dist.get_rank() == 0
    colocated = cfg.rollout.colocated
    history: dict[str, list] = {"eval/reward_mean": []}

    # rollout.async one_step: rank 0 makes step n+1's batch on a thread while step n trains
    producer = None
    if cfg.rollout.async_ == "one_step" and is_main:
        producer = RolloutProducer(lambda n: rollout_phase(ctx, n), ctx.sampler.state_dict,
                                   timeout_s=60.0 * cfg.parallel.control_timeout_minutes)
        if ctx.rollout_buffer is not None:
            producer.restore(ctx.rollout_buffer)

    def rank0_state() -> dict:
        """What a checkpoint of the last finished step holds of rank 0's data: the sampler's
        position (and, one_step, the next step's finished batch)."""
        now = ctx.sampler.state_dict()
        return producer.state(now) if producer is not None else {"sampler": now}

    def save(step: int, state: Optional[dict]) -> None:
        # rank 0 writes run_state.json; the others' copy is unused
        run_state = dict(state or {})
        if BUFFER_KEY in run_state:
            buffer = run_state[BUFFER_KEY]
            run_state[BUFFER_KEY] = {**buffer, "batch": encode_batch(buffer["batch"])}
        trainer.save(ctx.run_dir, step, run_state if is_main else {})

    made_now = {"rollout_s": 0.0}  # rank 0: rollout time spent inside this step's window

    def next_batch(step: int) -> tuple[dict, dict]:
        """Rank 0: this step's batch (one_step: made during the previous step, or now if none
        is pending: the first step of a run, or a resume without a finished buffer)."""
        if producer is None:
            buffer, ctx.rollout_buffer = ctx.rollout_buffer, None
            if buffer is not None and int(buffer["step"]) == step:
                # saved by a one_step run resumed with async off: its prompts are drawn already
                made_now["rollout_s"] = 0.0
                return decode_batch(buffer["batch"]), dict(buffer["metrics"])
            batch, metrics = rollout_phase(ctx, step)
            made_now["rollout_s"] = metrics["rollout_s"]
            return batch, metrics
        made_now["rollout_s"] = 0.0
        if producer.pending_step != step:
            producer.start(step)
            producer.wait()
            made_now["rollout_s"] = producer.busy_s
        return producer.take(step)

    def start_next(step: int) -> None:
        """Rank 0, one_step: begin the next step's rollout (with the weights of the last sync)."""
        if producer is not None and step < cfg.run.num_steps:
            producer.start(step + 1)

    def finish_next() -> dict:
        """Rank 0, one_step: wait for the next step's rollout (before the weights change)."""
        if producer is None:
            return {}
        t0 = time.monotonic()
        producer.wait()
        return {"trainer_wait_s": time.monotonic() - t0, "rollout_busy_s": producer.busy_s}

    one_step = cfg.rollout.async_ == "one_step"  # the same on every rank: same collectives

    guard = StepGuard(ctx.stop, save=save, start_step=start_step,
                      data_position=lambda: rank0_state() if is_main else None)
    ctx.logger.resume_at(start_step)  # each step once: drops what a crashed run logged later
    try:
        with guard.before_update():  # the servers serve exactly the policy we start from
            everywhere(sync_weights, ctx, trainer, str(start_step), what="weight sync")
            parity = everywhere(check_parity, ctx, trainer, str(start_step), what="parity check")
            if parity and is_main:
                print(f"parity at step {start_step}: mean log-prob gap "
                      f"{parity['parity/logprob_gap_mean']:.3g}", flush=True)
            if cfg.run.eval_interval and start_step == 0:
                evaluation = on_main(ctx, evaluate, ctx, 0, what="evaluation")
                if is_main:
                    history["eval/reward_mean"].append((0, evaluation["eval/reward_mean"]))
                    ctx.logger.log(0, {**evaluation, **parity}, progress=f"step 0/"
                                   f"{cfg.run.num_steps}  {_eval_progress(evaluation)}")
            elif parity and start_step == 0 and is_main:  # a resumed run logged its start before
                ctx.logger.log(0, parity)
        for step in range(start_step + 1, cfg.run.num_steps + 1):
            t0 = time.monotonic()
            guard.begin(step)
            with guard.before_update():
                batch, rollout_metrics = on_main(ctx, next_batch, step)
                t_batch = time.monotonic()
                if colocated:  # the servers give the memory back to training
                    on_main(ctx, _release_servers, ctx, what="release server memory")
                if one_step:
                    on_main(ctx, start_next, step, what="rollout of the next step")

            t_train = time.monotonic()
            train_metrics = trainer.train_rollout(batch, step)
            train_s = time.monotonic() - t_train

            metrics = {f"train/{k}": v for k, v in {**rollout_metrics, **train_metrics}.items()}
            # the variant's own clip fraction: sequences (GSPO) or tokens (token-clip variants)
            clip = ("clip" if "clip_frac" in train_metrics else
                    "token clip" if "token_clip_frac" in train_metrics else None)
            clip_value = train_metrics.get("clip_frac", train_metrics.get("token_clip_frac"))
            progress = (f"step {step}/{cfg.run.num_steps}  reward "
                        f"{rollout_metrics['reward_mean']:.3f}"
                        + (f"  {clip} {clip_value:.3f}" if clip else "")
                        + f"  len {rollout_metrics['response_length_mean']:.1f}")
            overlap: dict = {}
            with guard.after_update():
                if colocated:  # weights first, then the sync fills them, then the KV cache
                    on_main(ctx, _resume_servers, ctx, ["weights"], what="resume server memory")
                if one_step:  # the next rollout uses the servers' weights: it ends before they change
                    overlap = on_main(ctx, finish_next, what="rollout of the next step")
                sync = everywhere(sync_weights, ctx, trainer, str(step), what="weight sync")
                metrics.update({f"sync/{k}": v for k, v in (sync or {}).items()})
                if is_main:
                    metrics.update(server_metrics(ctx))
                if colocated:
                    on_main(ctx, _resume_servers, ctx, ["kv_cache", "cuda_graph"],
                            what="resume server memory")
                # after the KV cache is back: the probes are a prefill on every server
                metrics.update(everywhere(check_parity, ctx, trainer, str(step),
                                          what="parity check"))
                if cfg.run.eval_interval and (step % cfg.run.eval_interval == 0
                                              or step == cfg.run.num_steps):
                    evaluation = on_main(ctx, evaluate, ctx, step, what="evaluation")
                    metrics.update(evaluation)
                    history["eval/reward_mean"].append((step, evaluation["eval/reward_mean"]))
                    progress += f"  {_eval_progress(evaluation, pass_at_1=False)}"

            metrics["train/step_s"] = step_s = time.monotonic() - t0
            # measured, not derived: the trainer idles whenever it is not in train_rollout; the
            # servers generate for rollout_s (off: in this step; one_step: the next step's)
            metrics["train/train_s"] = train_s
            metrics["train/trainer_idle_frac"] = max(0.0, 1.0 - train_s / step_s)
            busy = made_now["rollout_s"] + overlap.get("rollout_busy_s", 0.0)
            metrics["train/rollout_idle_frac"] = max(0.0, 1.0 - busy / step_s)
            if overlap:
                metrics["train/trainer_wait_rollout_s"] = overlap["trainer_wait_s"]
            metrics["train/batch_wait_s"] = t_batch - t0
            progress += f"  {metrics['train/step_s']:.1f}s/step"
            if is_main:
                shown = step % cfg.run.log_interval == 0 or step == cfg.run.num_steps
                ctx.logger.log(step, metrics, progress=progress if shown else None)

            guard.end(save_due=bool(cfg.run.save_interval) and step % cfg.run.save_interval == 0,
                      last=step == cfg.run.num_steps)
    except Preempted as why:
        # a stop before any step of this run finished saves nothing (the start needs no
        # checkpoint: a fresh run has none to write, a resumed one still has its own)
        saved = guard.saved_step > start_step
        if is_main:
            print(f"stopping on signal ({why}); " + (
                f"checkpoint saved (step {guard.saved_step})" if saved else
                f"no checkpoint saved (no step finished after step {start_step})"), flush=True)
        return {"status": "preempted", "history": history, "saved": saved,
                "start_step": start_step}
    return {"status": "finished", "history": history}


def _eval_progress(evaluation: dict, *, pass_at_1: bool = True) -> str:
    text = f"held-out reward {evaluation['eval/reward_mean']:.3f}"
    return (text + f"  pass@1 {evaluation['eval/pass_at_1']:.3f}") if pass_at_1 else text
