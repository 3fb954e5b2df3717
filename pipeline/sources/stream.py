"""The rollout stream of ``rollout.async: full``: generation never stops for training.

Rank 0 only (in a run: in rank 0's rollout producer process, ``pipeline.sources.remote``). A
thread runs an event loop that keeps prompt groups (G samples of one prompt) in
flight on the rollout servers, scores each group as it completes and holds it in a buffer; the
step (``pipeline.step.loop.run``, through :class:`StreamSource`) takes the batch of each step from
the buffer and pushes the new weights after every update without waiting for anything::

    version v = the weights the servers hold (the loop labels the weights after step k with k)
    admitted  = groups drawn and not yet trained (in flight, or complete in the buffer)
    admit a group while  admitted < (eta + 1 + v - taken) * P       (P prompts per step)
    take(n)   = the P oldest complete groups, once every group whose last chance is step n has
                completed (its admission version + eta + 1 == n); trained with version n - 1

**Staleness is bounded per sample** (``rollout.max_staleness`` = eta): a token generated with
version u and trained at step n (version n - 1) is n - 1 - u versions stale. The admission rule
starts at most (eta + 1) * P groups ahead of the trainer, and :meth:`take` trains the oldest
first and waits for a group on its last step, so no sample can be more than eta versions stale:
``oldest version >= n - 1 - eta`` holds for every trained sample by construction. It is also
checked at :meth:`take`; a group that fails it (possible only when more than P groups reach their
last step at once, or after a resume under a smaller eta) is never trained: its prompt is
re-queued at the front and generated again under the current weights (counted, ``requeued``).
Samples whose generation spanned weight updates (the servers were paused with ``retract`` and
continued under the new weights, or a multi-turn trajectory whose later turns ran on newer weights:
``weight_versions`` spans of several versions) are ``resumed``; a group with a
sample the server aborted (a dead server, an operator's abort) is re-queued at the front, so the
prompt is generated elsewhere. Nothing is dropped: every prompt drawn is trained once, or is in
the buffer, in flight or queued (and so in the checkpoint, :meth:`state`). Hard prompts are not
starved: re-queued prompts go first, and the counts are reported per difficulty (the prompt's
last group mean reward: ``hard`` < 1/3 <= ``medium`` <= 2/3 < ``easy``, ``new`` when unseen).

**Checkpoints.** :meth:`state` (on the loop's thread, between steps) holds the buffer of complete
groups (token ids, log-probs, weight versions, rewards: trained exactly as the uninterrupted run
would have), the groups in flight with their samples' output so far, and the prompts queued. To
read the output of requests in flight, :meth:`state` stops the stream for a moment: no group is
admitted, the servers abort what they run (``/abort_request``: an aborted request answers with
its output, log-probs and weight versions so far), every group comes back; the snapshot is
taken; then each interrupted sample is continued from its output so far (``resume``: prompt +
output as the prompt, the tokens it had left; its spans and log-probs kept), in this run and in a
resumed one alike. The sampler's position is the one after every prompt drawn. Without
``resume`` (multi-turn trajectories) nothing is stopped: groups in flight are saved as prompts and
generated again on resume.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_gspo.loss.advantages import is_zero_std_group
from pipeline.context import LoopContext
from pipeline.generation.client import sampling_params, stream_seed
from pipeline.generation.trajectory import RolloutResult, result_from_json, result_to_json
from pipeline.generation.version import WeightVersion
from pipeline.scoring.data import Prompt
from pipeline.sources.base import STREAM_KEY, check_resume
from pipeline.sources.batch import build_batch, reward_metrics, routed_experts_shape, score_groups

DIFFICULTIES = ("hard", "medium", "easy", "new")


def admission_limit(*, max_staleness: int, version: WeightVersion, taken: int,
                    prompts_per_step: int) -> int:
    """Groups that may be admitted (drawn and not yet trained) when the servers hold ``version``
    and ``taken`` batches have been trained or are training: ``(eta + 1 + version - taken) * P``
    (0 while the trainer is ahead of the servers by more than eta)."""
    return max(0, (max_staleness + 1 + version - taken) * prompts_per_step)


def difficulty(mean_reward: Optional[float]) -> str:
    """A prompt's difficulty from its last group's mean reward (None: never scored)."""
    if mean_reward is None:
        return "new"
    return "hard" if mean_reward < 1 / 3 else "easy" if mean_reward > 2 / 3 else "medium"


def oldest_version(results: Sequence[RolloutResult], default: WeightVersion) -> WeightVersion:
    """The oldest weight version any output token of ``results`` was generated with (from
    ``weight_versions``; spans whose version is not a step number are not counted)."""
    versions = [v for r in results for v, start, end in r.weight_versions
                if end > start and v is not None]
    return min(versions) if versions else default


@dataclass
class StreamGroup:
    """One prompt's G samples, from admission to training."""

    index: int
    """Admission order over the run (checkpointed): the stream's seeds and its oldest-first rule."""
    prompt: Prompt
    admitted_version: WeightVersion
    """The servers' weight version when the group was admitted (a lower bound of its tokens')."""
    attempt: int = 0
    """How often this prompt was re-queued before (its seed changes with it)."""
    results: Optional[list] = None
    rewards: Optional[list[float]] = None
    failures: int = 0
    """Rewards that failed and counted as 0 (reward.on_error: zero)."""
    partial: Optional[list] = None
    """A group a checkpoint stopped in flight: its G samples, the finished ones as they are and
    the others aborted with their output so far; continued from there (``resume``)."""
    continued: int = 0
    """How often the group was continued from a partial output."""
    stopped: set = field(default_factory=set)
    """The samples a checkpoint ever stopped in flight (continued since)."""

    @property
    def complete(self) -> bool:
        return self.rewards is not None

    def oldest(self) -> WeightVersion:
        return oldest_version(self.results or [], self.admitted_version)

    def last_step(self, max_staleness: int) -> int:
        """The last step that may train it (trained with version ``step - 1``)."""
        return self.admitted_version + max_staleness + 1


@dataclass
class StreamCounts:
    """What happened to groups and samples so far (cumulative; the loop logs per-step deltas)."""

    admitted: int = 0
    trained: int = 0
    requeued: dict = field(default_factory=lambda: dict.fromkeys(DIFFICULTIES, 0))
    """Groups not trained and generated again, by the prompt's difficulty."""
    requeued_stale: int = 0
    """... of them because they would have been more than eta versions stale."""
    requeued_aborted: int = 0
    """... of them because a server aborted one of their samples."""
    resumed: dict = field(default_factory=lambda: dict.fromkeys(DIFFICULTIES, 0))
    """Trained samples generated across weight updates (several versions), by difficulty."""
    continued: int = 0
    """Trained samples that a checkpoint stopped in flight and that were continued from their
    output so far."""
    filtered: int = 0
    """Complete groups left out by dynamic sampling (all rewards equal); not an error."""
    dropped: int = 0
    """Prompts lost: always 0 (the invariant the tests check); a counter so that it is seen."""


class RolloutStream:
    """The ``full`` mode producer; see the module docstring.

    ``generate(prompt, seed, rid_prefix)``: an awaitable of the G results of one ``Prompt`` (the
    run's ``pipeline.generation.generator.GroupGenerator``). ``score(prompt, results)`` ->
    (rewards, failures), run on a worker thread. ``draw()`` -> the next training prompt (the
    sampler; only this stream draws in ``full`` mode). ``seed_of(index, attempt)``: a group's
    sampling seed. ``keep(group)``: False leaves a complete group out (dynamic sampling).
    ``abort()``: an awaitable that aborts every request of the stream on the servers;
    ``resume(prompt, seed, rid_prefix, partial)``: an awaitable of the G results of a group whose
    aborted samples are continued from their output so far (``GroupGenerator.continue_group``,
    given when the generator ``can_continue``). With both, a checkpoint keeps the output of
    requests in flight (module docstring).
    """

    def __init__(self, *, generate: Callable[[list, int, str], Awaitable[list]],
                 score: Callable[[Prompt, list], tuple[list[float], int]],
                 draw: Callable[[], Prompt], prompts_per_step: int, max_staleness: int,
                 version: WeightVersion, taken: int, seed_of: Callable[[int, int], int],
                 keep: Optional[Callable[[StreamGroup], bool]] = None,
                 abort: Optional[Callable[[], Awaitable[None]]] = None,
                 resume: Optional[Callable[[Prompt, int, str, list], Awaitable[list]]] = None,
                 timeout_s: float = 3600.0, poll_s: float = 0.01):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._generate, self._score, self._draw = generate, score, draw
        self._seed_of, self._keep = seed_of, keep
        self._abort, self._resume = (abort, resume) if abort and resume else (None, None)
        self.prompts_per_step, self.max_staleness = prompts_per_step, max_staleness
        self.timeout_s = timeout_s
        """The longest :meth:`take` waits without any group completing (then TimeoutError)."""
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._version, self._taken = version, taken
        self._next_index = 0
        self._queue: deque[tuple[Prompt, int]] = deque()  # (prompt, attempt): re-queued first
        self._groups: dict[int, StreamGroup] = {}  # admitted, not trained: in flight or complete
        self._last_reward: dict[int, float] = {}  # prompt index -> its last group's mean reward
        self.counts = StreamCounts()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._in_flight_requests = 0
        self._tasks = 0  # groups with a task on the stream's loop (generating or scoring)
        self._suspended = False  # a checkpoint reads the groups in flight: admit nothing
        self._to_continue: deque[StreamGroup] = deque()  # partial groups, continued first
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._busy_s, self._busy_since = 0.0, None
        self.last_completed_at = time.monotonic()

    # --- the loop's side (its own thread)
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="rollout stream")
            self._thread.start()

    def set_version(self, version: WeightVersion) -> None:
        """The servers now hold ``version`` (after a weight push): more groups may be admitted."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def take(self, step: int) -> list[StreamGroup]:
        """Step ``step``'s P groups (trained with version ``step - 1``); blocks until they are
        complete (every wait is bounded: ``timeout_s`` without progress -> TimeoutError naming
        what it waited for). Raises the stream's error (a rollout or reward failure)."""
        trained = step - 1
        with self._cond:
            waiting_since = time.monotonic()
            while True:
                if self._error is not None:
                    raise self._error
                self._requeue_stale(trained)
                complete = sorted((g for g in self._groups.values() if g.complete),
                                  key=lambda g: g.index)
                due = [g for g in self._groups.values()
                       if g.last_step(self.max_staleness) <= step and not g.complete]
                if len(complete) >= self.prompts_per_step and not due:
                    break
                if time.monotonic() - max(waiting_since, self.last_completed_at) > self.timeout_s:
                    waiting = [g for g in self._groups.values() if not g.complete]
                    raise TimeoutError(
                        f"rollout stream: step {step} waited {self.timeout_s:g} s without a "
                        f"group completing ({len(complete)}/{self.prompts_per_step} complete; "
                        f"in flight: {sorted(g.prompt.origin for g in waiting)[:8]}) "
                        "(parallel.control_timeout_minutes)")
                self._cond.wait(0.05)
            chosen = complete[:self.prompts_per_step]
            for g in chosen:
                del self._groups[g.index]
                for r in g.results:
                    # several versions (a multi-turn trajectory has one span per model turn)
                    if len({v for v, _, _ in r.weight_versions}) > 1:
                        self.counts.resumed[self._difficulty(g.prompt)] += 1
                self._last_reward[g.prompt.index] = sum(g.rewards) / len(g.rewards)
                self.counts.continued += len(g.stopped)
            self.counts.trained += len(chosen)
            self._taken = max(self._taken, step)
            self._cond.notify_all()
            return chosen

    def busy_s(self) -> float:
        """Seconds so far during which at least one request of the stream was on a server."""
        with self._cond:
            extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_s + extra

    def snapshot(self) -> dict:
        """The stream now (for the step's metrics)."""
        with self._cond:
            groups = list(self._groups.values())
            return {"in_flight_groups": sum(not g.complete for g in groups),
                    "buffered_groups": sum(g.complete for g in groups),
                    "queued_groups": len(self._queue)}

    def close(self) -> None:
        """Stop admitting, cancel what is in flight (the run is over or stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    # --- checkpoints
    def state(self, sampler_state: Callable[[], Optional[dict]]) -> dict:
        """Rank 0's run state: the sampler's position (``sampler_state()``, read under the
        stream's lock: the stream draws on its thread) and the stream's: the complete groups
        (trained as they are on resume), the groups in flight with their output so far
        (continued on resume; the stream is stopped for the snapshot, see the module docstring),
        the prompts queued (generated on resume) and the admission index. JSON-able but for the
        samples' routed experts (tensors: the checkpoint writes them to
        ``run_state.safetensors``)."""
        self._suspend()
        try:
            with self._cond:
                return {"sampler": sampler_state(), STREAM_KEY: self._state()}
        finally:
            with self._cond:
                self._suspended = False
                self._cond.notify_all()

    def _suspend(self) -> None:
        """Stop admitting and bring every group in flight back (aborted on the servers: its
        samples return their output so far and become a partial group). Bounded by
        ``timeout_s``; a stream without ``abort`` / ``resume``, not started, or ended, has
        nothing to bring back."""
        if self._resume is None:
            return
        with self._cond:
            self._suspended = True
            loop = self._loop
        deadline = time.monotonic() + self.timeout_s
        failed: Optional[BaseException] = None
        while True:
            with self._cond:
                if self._tasks == 0 or loop is None or loop.is_closed():
                    return
            if time.monotonic() > deadline:
                with self._cond:
                    waiting = sorted(g.prompt.origin for g in self._groups.values()
                                     if not g.complete and g.partial is None)
                raise TimeoutError(f"rollout stream: a checkpoint waited {self.timeout_s:g} s for "
                                   f"the requests in flight to come back after an abort "
                                   f"(in flight: {waiting[:8]}; last abort error: {failed!r}) "
                                   "(parallel.control_timeout_minutes)")
            try:  # again every second: a request may reach its server after an abort
                asyncio.run_coroutine_threadsafe(self._abort(), loop).result(timeout=30.0)
            except Exception as err:  # noqa: BLE001 - the requests still end; the wait is bounded
                failed = err  # (or the stream's loop has ended: its tasks were cancelled)
            with self._cond:
                self._cond.wait_for(lambda: self._tasks == 0, timeout=1.0)

    def _state(self) -> dict:
        """(Under the lock.)"""
        by_index = sorted(self._groups.values(), key=lambda g: g.index)
        partial = [g for g in by_index if not g.complete and g.partial is not None]
        pending = [(g.prompt, g.attempt) for g in by_index
                   if not g.complete and g.partial is None]
        return {
            "next_index": self._next_index,
            "complete": [{"index": g.index, "prompt": _prompt_json(g.prompt),
                          "admitted_version": g.admitted_version, "attempt": g.attempt,
                          "results": [result_to_json(r) for r in g.results],
                          "rewards": list(g.rewards), "failures": g.failures}
                         for g in by_index if g.complete],
            "partial": [{"index": g.index, "prompt": _prompt_json(g.prompt),
                         "admitted_version": g.admitted_version, "attempt": g.attempt,
                         "continued": g.continued, "stopped": sorted(g.stopped),
                         "results": [result_to_json(r) for r in g.partial]} for g in partial],
            "pending": [{"prompt": _prompt_json(p), "attempt": a}
                        for p, a in list(self._queue) + pending],
            "last_reward": {str(k): v for k, v in self._last_reward.items()},
        }

    def restore(self, state: dict) -> None:
        """A resumed run (before :meth:`start`): the saved groups and prompts back in place."""
        with self._cond:
            self._next_index = int(state["next_index"])
            for item in state["complete"]:
                g = StreamGroup(index=int(item["index"]), prompt=_prompt_from(item["prompt"]),
                                admitted_version=int(item["admitted_version"]),
                                attempt=int(item["attempt"]),
                                results=[result_from_json(r) for r in item["results"]],
                                rewards=[float(x) for x in item["rewards"]],
                                failures=int(item["failures"]))
                self._groups[g.index] = g
            for item in state.get("partial", []):
                g = StreamGroup(index=int(item["index"]), prompt=_prompt_from(item["prompt"]),
                                admitted_version=int(item["admitted_version"]),
                                attempt=int(item["attempt"]), continued=int(item["continued"]),
                                stopped={int(i) for i in item["stopped"]},
                                partial=[result_from_json(r) for r in item["results"]])
                if self._resume is None:  # this run cannot continue them: generated again
                    self._queue.append((g.prompt, g.attempt))
                else:
                    self._groups[g.index] = g
                    self._to_continue.append(g)
            for item in state["pending"]:
                self._queue.append((_prompt_from(item["prompt"]), int(item["attempt"])))
            self._last_reward = {int(k): float(v) for k, v in state["last_reward"].items()}

    # --- the stream's thread
    def _difficulty(self, prompt: Prompt) -> str:
        return difficulty(self._last_reward.get(prompt.index))

    def _requeue_stale(self, trained: int) -> None:
        """(Under the lock.) Complete groups more than eta versions older than ``trained``."""
        for g in [g for g in self._groups.values() if g.complete]:
            if trained - g.oldest() > self.max_staleness:
                self._requeue(g, stale=True)

    def _requeue(self, g: StreamGroup, *, stale: bool) -> None:
        del self._groups[g.index]
        self.counts.requeued[self._difficulty(g.prompt)] += 1
        if stale:
            self.counts.requeued_stale += 1
        else:
            self.counts.requeued_aborted += 1
        self._queue.appendleft((g.prompt, g.attempt + 1))
        self._cond.notify_all()

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # noqa: BLE001 - take() re-raises it on the loop's thread
            with self._cond:
                self._error = err
                self._cond.notify_all()

    async def _main(self) -> None:
        tasks: set[asyncio.Task] = set()
        with self._cond:
            self._loop = asyncio.get_running_loop()

        def done(task: asyncio.Task) -> None:
            tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                with self._cond:  # take() raises it on the loop's thread
                    self._error = self._error or task.exception()
                    self._cond.notify_all()
        try:
            while True:
                with self._cond:
                    if self._closed or self._error is not None:
                        break
                    admit = [] if self._suspended else self._continue() + self._admit()
                for g in admit:
                    task = asyncio.create_task(self._one(g))
                    tasks.add(task)
                    task.add_done_callback(done)
                await asyncio.sleep(self._poll_s)
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _continue(self) -> list[StreamGroup]:
        """(Under the lock.) The partial groups a checkpoint stopped, to be continued now."""
        out = list(self._to_continue)
        self._to_continue.clear()
        for g in out:
            g.continued += 1
        self._tasks += len(out)
        return out

    def _admit(self) -> list[StreamGroup]:
        """(Under the lock.) New groups within the admission limit: re-queued prompts first."""
        limit = admission_limit(max_staleness=self.max_staleness, version=self._version,
                                taken=self._taken, prompts_per_step=self.prompts_per_step)
        out = []
        while len(self._groups) < limit:
            prompt, attempt = self._queue.popleft() if self._queue else (self._draw(), 0)
            g = StreamGroup(index=self._next_index, prompt=prompt,
                            admitted_version=self._version, attempt=attempt)
            self._next_index += 1
            self._groups[g.index] = g
            self.counts.admitted += 1
            out.append(g)
        self._tasks += len(out)
        return out

    async def _one(self, g: StreamGroup) -> None:
        try:
            await self._one_group(g)
        finally:
            with self._cond:
                self._tasks -= 1
                self._cond.notify_all()

    async def _one_group(self, g: StreamGroup) -> None:
        self._busy(+1)
        try:
            seed, rid = self._seed_of(g.index, g.attempt), f"s{g.index}a{g.attempt}"
            if g.partial is not None:  # a new sampling seed for each continuation
                results = await self._resume(g.prompt, seed + g.continued,
                                             f"{rid}c{g.continued}", g.partial)
            else:
                results = await self._generate(g.prompt, seed, rid)
        finally:
            self._busy(-1)
        if any(r.finish_reason == "abort" for r in results):
            with self._cond:
                if g.index not in self._groups:
                    return
                if self._suspended and self._resume is not None:  # a checkpoint stopped it
                    g.partial = list(results)
                    g.stopped |= {i for i, r in enumerate(results) if r.finish_reason == "abort"}
                    self._to_continue.append(g)
                else:
                    self._requeue(g, stale=False)
            return
        rewards, failures = await asyncio.to_thread(self._score, g.prompt, results)
        with self._cond:
            g.partial = None
            g.results, g.rewards, g.failures = list(results), list(rewards), failures
            self.last_completed_at = time.monotonic()
            if self._keep is not None and not self._keep(g):
                del self._groups[g.index]
                self.counts.filtered += 1
                self._last_reward[g.prompt.index] = sum(g.rewards) / len(g.rewards)
            self._cond.notify_all()

    def _busy(self, delta: int) -> None:
        with self._cond:
            now = time.monotonic()
            if self._in_flight_requests == 0 and delta > 0:
                self._busy_since = now
            self._in_flight_requests += delta
            if self._in_flight_requests == 0 and self._busy_since is not None:
                self._busy_s += now - self._busy_since
                self._busy_since = None


def _prompt_json(p: Prompt) -> dict:
    return {"index": p.index, "prompt_ids": list(p.prompt_ids), "label": p.label, "text": p.text,
            "origin": p.origin}


def _prompt_from(d: dict) -> Prompt:
    return Prompt(index=int(d["index"]), prompt_ids=[int(x) for x in d["prompt_ids"]],
                  label=d["label"], text=d["text"], origin=d["origin"])


def step_metrics(before: StreamCounts, after: StreamCounts) -> dict[str, float]:
    """This step's counts (``after`` - ``before``) and the run's totals, for ``train/``."""
    out: dict[str, float] = {}
    for name in ("requeued", "resumed"):
        for d in DIFFICULTIES:
            out[f"{name}_{d}"] = float(getattr(after, name)[d] - getattr(before, name)[d])
        out[name] = float(sum(getattr(after, name).values()) - sum(getattr(before, name).values()))
    out["requeued_stale"] = float(after.requeued_stale - before.requeued_stale)
    out["requeued_aborted"] = float(after.requeued_aborted - before.requeued_aborted)
    out["filtered_groups"] = float(after.filtered - before.filtered)
    out["continued"] = float(after.continued - before.continued)
    out["dropped"] = float(after.dropped)
    out["requeued_total"] = float(sum(after.requeued.values()))
    return out


def group_seed(run_seed: int, index: int, attempt: int) -> int:
    """The sampling seed base of the stream's group ``index`` on its ``attempt``-th try."""
    return stream_seed("full", run_seed, index, attempt)


# ------------------------------------------------------------------ the batch source


def stream_batch(ctx: LoopContext, stream: RolloutStream, step: int) -> tuple[dict, dict]:
    """Rank 0, ``rollout.async: full``: step ``step``'s batch from the stream's oldest complete
    groups (``pipeline.sources.stream``); ``rollout_s`` is how long the trainer waited for them."""
    t0 = time.monotonic()
    before = copy.deepcopy(stream.counts)
    chosen = stream.take(step)
    waited = time.monotonic() - t0
    prompts = [g.prompt for g in chosen]
    groups = [list(g.results) for g in chosen]
    rewards = [x for g in chosen for x in g.rewards]
    metrics = reward_metrics(rewards, ctx.cfg.gspo.group_size)
    batch, more = build_batch(ctx, step, prompts, groups, rewards)
    metrics.update(more)
    metrics.update(step_metrics(before, stream.counts))
    metrics.update(stream.snapshot())
    metrics.update({"reward_failures": sum(g.failures for g in chosen), "rollout_s": waited,
                    "admitted_version_min": float(min(g.admitted_version for g in chosen))})
    return batch, metrics


def make_stream(ctx: LoopContext, start_step: int) -> RolloutStream:
    """Rank 0, ``rollout.async: full``: the rollout stream of this run (not started)."""
    cfg = ctx.cfg
    G = cfg.gspo.group_size
    shape = routed_experts_shape(cfg)
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    can_continue = ctx.generator.can_continue()

    async def generate(prompt: Prompt, seed: int, rid_prefix: str) -> list:
        groups = await ctx.generator.generate_async([prompt], G, sampling, seed=seed,
                                                    rid_prefix=rid_prefix, routed_experts=shape)
        return groups[0]

    async def resume(prompt: Prompt, seed: int, rid_prefix: str, partial: list) -> list:
        return await ctx.generator.continue_group(prompt, partial, sampling, seed=seed,
                                                  rid_prefix=rid_prefix, routed_experts=shape)

    def score(prompt: Prompt, results: list) -> tuple[list[float], int]:
        return score_groups(ctx, [prompt], [results])

    def informative(group) -> bool:  # dynamic sampling: all rewards equal carry no gradient
        return not bool(is_zero_std_group(torch.tensor(group.rewards, dtype=torch.float64), G)[0])
    stream = RolloutStream(
        generate=generate, score=score, draw=lambda: ctx.sampler.next_batch(1)[0],
        prompts_per_step=cfg.run.global_batch_size // G,
        max_staleness=cfg.rollout.max_staleness, version=start_step, taken=start_step,
        seed_of=lambda index, attempt: group_seed(cfg.run.seed, index, attempt),
        keep=informative if cfg.gspo.dynamic_sampling else None,
        # samples in flight at a checkpoint are continued from their output so far when the
        # generator can (single turn); multi-turn trajectories are generated again (docs/async.md)
        abort=ctx.generator.abort_all if can_continue else None,
        resume=resume if can_continue else None,
        timeout_s=60.0 * cfg.parallel.control_timeout_minutes)
    return stream


class StreamSource:
    """:class:`pipeline.sources.base.BatchSource` of ``rollout.async: full``: the stream (made on
    rank 0 at its first use: :meth:`restore` or :meth:`start`) and its batches."""

    mode = "full"

    def __init__(self, ctx: LoopContext, start_step: int):
        self._ctx, self._start_step = ctx, start_step
        self._stream: Optional[RolloutStream] = None

    def _the_stream(self) -> RolloutStream:
        if self._stream is None:
            self._stream = make_stream(self._ctx, self._start_step)
        return self._stream

    def restore(self, saved: dict) -> None:
        check_resume(saved, self.mode)
        if saved.get(STREAM_KEY) is not None:
            self._the_stream().restore(saved[STREAM_KEY])

    def start(self) -> None:
        """The stream generates from now on (after the first weight sync)."""
        self._the_stream().start()

    def next(self, step: int) -> tuple[dict, dict]:
        return stream_batch(self._ctx, self._the_stream(), step)

    def before_weights_change(self) -> dict:
        """Requests in flight live through the update (the pusher pauses them with ``retract``)."""
        return {}

    def weights_changed(self, version: int) -> None:
        """The servers hold ``version``'s weights: admit more groups."""
        self._the_stream().set_version(version)

    def state(self) -> dict:
        return self._the_stream().state(self._ctx.sampler.state_dict)

    def busy_s(self) -> float:
        """Measured by the stream: time with a request on a server."""
        return self._stream.busy_s() if self._stream is not None else 0.0

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
