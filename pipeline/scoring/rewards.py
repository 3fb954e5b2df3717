"""Rewards: score each response of a rollout, and never let a failure pass as a number.

    reward_fn = build_reward(cfg.reward, cfg.data)
    result = compute_rewards(reward_fn, samples, on_error=cfg.reward.on_error)
    result.rewards            # list[float], one per sample, all finite
    result.failures           # list[RewardFailure]: the samples counted as 0 (on_error="zero")

A reward function follows ``RewardFn``: ``fn(prompt, response_ids, response_text) -> float``.
One that can score many samples at once (the HTTP service) also has
``score_batch(samples) -> list[float | Exception]`` (an exception in place of each reward it
could not get); ``compute_rewards`` uses it when present.

Built-ins (``reward.kind``):
- ``exact_match``: ``response_text.strip() == label.strip()``.
- ``math``: the answer in the response is mathematically equal to the label, through the
  math-verify package (``math_verify.parse`` / ``verify``): "0.5", "\\frac{1}{2}" and
  "\\boxed{1/2}" all match the label "1/2".
- ``addition``: the synthetic task's exact match of the answer up to the end token
  (``AdditionTask.reward``).
- ``carry_addition``: the long-response task's exact match of the final segment, the answer
  after the carry trace (``CarryAdditionTask.reward``).
- ``function``: a user function, "package.module:function" or "path/to/file.py:function",
  called in a worker process with a deadline of ``reward.timeout_s`` per sample
  (``FunctionReward``): a call that hangs fails that sample (then ``reward.on_error``), and a stop
  signal abandons the call at once.
- ``http``: a reward service (``HTTPReward``).

An exception or a non-finite reward is an error naming the sample (prompt index, the prompt's
origin, sample index); with ``on_error="zero"`` it is counted as 0 and returned in
``failures`` so the loop can log it - unless EVERY sample of the call failed, which is an error
naming the reward function and the first sample's error (a run that learns nothing must not
report success).
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import math
import numbers
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import lru_cache
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Protocol, Sequence

from megatron_gspo.errors import InputError

from pipeline.scoring.data import Prompt
from pipeline.scoring.tasks import AdditionTask, CarryAdditionTask, Problem, ToolAdditionTask

if TYPE_CHECKING:
    from megatron_gspo.config import DataConfig, RewardConfig


class RewardError(RuntimeError, InputError):
    """A reward that could not be computed; the message names the sample or the service."""


class RewardInterrupted(RuntimeError):
    """A stop signal came while a reward was being computed: the reward was abandoned (its worker
    killed) so that the rank can save its checkpoint and stop (``pipeline.step.step_guard.StepGuard``). Not
    a ``RewardError``: ``reward.on_error`` does not apply."""


class RewardFn(Protocol):
    def __call__(self, prompt: Prompt, response_ids: list[int], response_text: str) -> float: ...


@dataclass(frozen=True, slots=True)
class RewardSample:
    """One response to score."""

    prompt: Prompt
    sample_index: int
    """Which of the prompt's G responses (0..G-1)."""
    response_ids: list[int]
    response_text: str


@dataclass(frozen=True, slots=True)
class RewardFailure:
    prompt_index: int
    sample_index: int
    error: str


@dataclass(slots=True)
class RewardResult:
    rewards: list[float]
    failures: list[RewardFailure] = field(default_factory=list)

    @property
    def num_failures(self) -> int:
        return len(self.failures)


def _describe(sample: RewardSample) -> str:
    return (f"prompt {sample.prompt.index} ({sample.prompt.origin}), "
            f"sample {sample.sample_index}")


def _as_float(value: Any) -> float:
    """The reward as a float (possibly non-finite); ValueError for a non-number."""
    if isinstance(value, (bool, numbers.Real)):
        return float(value)
    if hasattr(value, "item") and math.prod(getattr(value, "shape", ())) == 1:
        return float(value.item())  # a one-element numpy array or torch tensor
    raise ValueError(f"returned {type(value).__name__} {str(value)[:60]!r}, expected a number")


def _as_finite(value: Any) -> float:
    """The reward as a float; ValueError for a non-number or a non-finite one."""
    reward = _as_float(value)
    if not math.isfinite(reward):
        raise ValueError(f"returned the non-finite reward {reward}")
    return reward


def compute_rewards(fn: RewardFn, samples: Sequence[RewardSample], *,
                    on_error: Literal["raise", "zero"] = "raise") -> RewardResult:
    """Score every sample. Failures raise ``RewardError`` or, with "zero", become 0 and are listed."""
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error: expected 'raise' or 'zero', got {on_error!r}")
    rewards: list[float] = [0.0] * len(samples)
    failures: list[RewardFailure] = []

    def fail(i: int, error: str, cause: Optional[BaseException] = None) -> None:
        if on_error == "raise":
            raise RewardError(f"reward of {_describe(samples[i])}: {error}") from cause
        failures.append(RewardFailure(samples[i].prompt.index, samples[i].sample_index, error))

    raw: list[Any] = [None] * len(samples)
    score_batch = getattr(fn, "score_batch", None)
    if score_batch is not None:
        try:
            raw = list(score_batch(samples))
        except RewardInterrupted:
            raise  # a stop signal: no reward.on_error policy applies
        except Exception as err:
            raw = [err] * len(samples)
        if len(raw) != len(samples):
            raise RewardError(f"{type(fn).__name__}.score_batch returned {len(raw)} rewards for "
                              f"{len(samples)} samples")
    else:
        for i, s in enumerate(samples):
            try:
                raw[i] = fn(s.prompt, s.response_ids, s.response_text)
            except Exception as err:
                raw[i] = err
    for i, value in enumerate(raw):
        if isinstance(value, Exception):
            fail(i, str(value) if isinstance(value, RewardError)
                 else f"{type(value).__name__}: {value}", value)
            continue
        try:
            rewards[i] = _as_finite(value)
        except ValueError as err:
            fail(i, str(err))
    if samples and len(failures) == len(samples):
        # "zero" is for a reward that fails now and then: with none computed, every advantage
        # is 0 and the run would learn nothing while reporting success
        first = failures[0]
        raise RewardError(
            f"every one of the {len(samples)} rewards failed ({_reward_name(fn)}; "
            f"reward.on_error: zero counts a failure as 0, but none succeeded); first: "
            f"{_describe(samples[0])}: {first.error}")
    return RewardResult(rewards=rewards, failures=failures)


def _reward_name(fn: Any) -> str:
    """The reward function as a user wrote it: module:function, or the service's URL."""
    url = getattr(fn, "url", None)
    if url:
        return f"reward service {url}"
    if isinstance(fn, FunctionReward):
        fn = fn.function
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"reward function {module}:{name}" if module else f"reward function {name}"


# ------------------------------------------------------------------------------------------------
# Built-ins


def _label(prompt: Prompt, kind: str) -> str:
    if prompt.label is None:
        raise RewardError(f"the {kind} reward needs a label, and prompt {prompt.index} "
                          f"({prompt.origin}) has none (data.label_key)")
    return prompt.label


def exact_match(prompt: Prompt, response_ids: list[int], response_text: str) -> float:
    """1.0 if the stripped response equals the stripped label."""
    return 1.0 if response_text.strip() == _label(prompt, "exact_match").strip() else 0.0


def addition(prompt: Prompt, response_ids: list[int], response_text: str) -> float:
    """The synthetic task's reward: exact answer up to the end-of-answer token (byte-level ids)."""
    problem = Problem(prompt=prompt.text, answer=_label(prompt, "addition"))
    return AdditionTask.reward(problem, list(response_ids))


def carry_addition(prompt: Prompt, response_ids: list[int], response_text: str) -> float:
    """The long-response task's reward: exact match of the final segment (the answer after the
    carry trace, up to the end token) with the label's."""
    problem = Problem(prompt=prompt.text, answer=_label(prompt, "carry_addition"))
    return CarryAdditionTask.reward(problem, list(response_ids))


def tool_addition(prompt: Prompt, response_ids: list[int], response_text: str) -> float:
    """The tool task's reward: the response (a trajectory's last model turn, up to the end token)
    is the sum, the label's final answer."""
    problem = Problem(prompt=prompt.text, answer=_label(prompt, "tool_addition"))
    return ToolAdditionTask.reward(problem, list(response_ids))


@lru_cache(maxsize=65536)
def _parse_gold(label: str, timeout: Optional[int]):
    from math_verify import parse

    gold = parse(label, parsing_timeout=timeout)
    if not gold:  # a bare LaTeX expression without delimiters
        gold = parse(f"${label}$", parsing_timeout=timeout)
    return gold


def math_equal(prompt: Prompt, response_ids: list[int], response_text: str) -> float:
    """1.0 if math-verify finds the response's answer equal to the label.

    math-verify bounds its work with ``signal.alarm``, which exists only in the main thread; in
    another thread the bounds are off (``timeout None``).
    """
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise RewardError("reward.kind 'math' needs the math-verify package "
                          "(pip install math-verify)") from err
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    label = _label(prompt, "math")
    gold = _parse_gold(label, timeout)
    if not gold:
        raise RewardError(f"math-verify cannot parse the label {label!r}")
    answer = parse(response_text, parsing_timeout=timeout)
    if not answer:
        return 0.0
    return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_equal,
    "addition": addition,
    "carry_addition": carry_addition,
    "tool_addition": tool_addition,
}


def load_function(spec: str) -> RewardFn:
    """The callable named by "package.module:function" or "path/to/file.py:function"."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward.function {spec!r}: expected \"module:function\"")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise RewardError(f"reward.function {spec!r}: file {path} not found")
        module_spec = importlib.util.spec_from_file_location(f"_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise RewardError(f"reward.function {spec!r}: importing {path} failed: "
                              f"{type(err).__name__}: {err}") from err
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                raise RewardError(f"reward.function {spec!r}: no module named {err.name!r} "
                                  f"(is it on PYTHONPATH? sys.path[0] = {sys.path[0]!r})") from err
            raise RewardError(f"reward.function {spec!r}: importing {module_name} failed: "
                              f"{err}") from err
        except Exception as err:
            raise RewardError(f"reward.function {spec!r}: importing {module_name} failed: "
                              f"{type(err).__name__}: {err}") from err
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise RewardError(f"reward.function {spec!r}: module {module_name} has no attribute "
                          f"{attr!r} (it has: {', '.join(public[:20])})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward.function {spec!r}: {attr} is a {type(fn).__name__}, "
                          "not callable")
    return fn


WORKER_START_TIMEOUT_S = 120.0
"""How long a reward worker may take to start (Python, then the import of the function's module)
before the sample it was started for counts as failed."""

POLL_S = 0.1
"""How often a wait for the worker checks for a stop signal."""


_spawn_requests: "queue.SimpleQueue" = queue.SimpleQueue()
_spawner: Optional[threading.Thread] = None
_spawner_lock = threading.Lock()


def _popen(args: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` from a thread that lives as long as this process.

    PR_SET_PDEATHSIG (the worker dies with its owner) fires when the THREAD that started the
    child ends, not the process: a worker started by a rollout on a thread of its own
    (``rollout.async``, ``pipeline.sources.one_step``) would be killed when that rollout ends. The main
    thread starts it directly; any other thread through one daemon thread kept for the purpose."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(args, **kwargs)
    with _spawner_lock:
        if _spawner is None:
            def serve() -> None:
                while True:
                    call_args, call_kwargs, answer = _spawn_requests.get()
                    try:
                        answer.put((True, subprocess.Popen(call_args, **call_kwargs)))
                    except BaseException as err:  # noqa: BLE001 - raised in the caller
                        answer.put((False, err))
            _spawner = threading.Thread(target=serve, name="reward-worker-spawner", daemon=True)
            _spawner.start()
    answer: "queue.SimpleQueue" = queue.SimpleQueue()
    _spawn_requests.put((args, kwargs, answer))
    ok, value = answer.get()
    if not ok:
        raise value
    return value


def start_piped_worker(module: str, argv: Callable[[int, int], list[str]], *,
                       base_env: Optional[dict] = None, **popen_kwargs
                       ) -> tuple[subprocess.Popen, Connection, Connection]:
    """``python -m module *argv(fd_in, fd_out)``, talking over two pipes: returns (process,
    inbox, outbox). The worker gets the pipes' child ends as file descriptors ``fd_in`` /
    ``fd_out``, this process's import path first (a module next to the config, a package
    installed at run time), its own session (killed with what it starts), and is started by
    :func:`_popen` (it dies with this process). Its environment: ``base_env`` (None: this
    process's) with ``PYTHONPATH`` set to that import path."""
    child_in, parent_out = os.pipe()
    parent_in, child_out = os.pipe()
    path = [p for p in sys.path if p] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ if base_env is None else base_env,
               PYTHONPATH=os.pathsep.join(filter(None, path)))
    try:
        proc = _popen([sys.executable, "-m", module, *argv(child_in, child_out)],
                      pass_fds=(child_in, child_out), stdin=subprocess.DEVNULL, env=env,
                      start_new_session=True, **popen_kwargs)
    except BaseException:
        for fd in (parent_in, parent_out):
            os.close(fd)
        raise
    finally:
        os.close(child_in)
        os.close(child_out)
    return proc, Connection(parent_in, writable=False), Connection(parent_out, readable=False)


class FunctionReward:
    """A user reward function (``reward.kind: function``), called in a worker process with a
    deadline: ``reward.timeout_s`` seconds per sample.

    The function is imported here once (so that a wrong spec fails at start-up, naming it), and
    called only in the worker (``pipeline.scoring.reward_worker``), started at the first call and kept
    for the whole run: module-level state (a cache, a loaded verifier) lives there, not in the
    trainer. A batch goes to the worker at once; its answers come back one per sample.

    * A sample that takes longer than ``timeout_s`` (a hang, an endless loop, a regular
      expression backtracking for ever, a C extension holding the GIL) fails with a
      ``RewardError`` naming the function, the sample and the deadline; the worker is killed with
      its process group (what the function started) and a fresh one scores the rest. The failure
      then follows ``reward.on_error``: "raise" stops the run (exit 2), "zero" counts the sample
      as 0 in the step's ``train/reward_failures``.
    * A worker that dies (a segfault, ``os._exit``, the OOM killer) fails its sample the same way.
    * ``interrupted()`` (the rank's stop flag) is checked every ``POLL_S`` s while waiting: after a
      stop signal the call is abandoned at once (:class:`RewardInterrupted`, the worker killed),
      whatever the function does, so that the rank can save its checkpoint and stop.
    * The worker dies with this process, even by SIGKILL (PR_SET_PDEATHSIG; started from a
      thread that lives as long as the process, :func:`_popen`), and ignores the stop signals
      (this process decides when it ends).
    """

    def __init__(self, spec: str, *, timeout_s: float, step_timeout_s: Optional[float] = None,
                 fail_fast: bool = False, interrupted: Optional[Callable[[], bool]] = None,
                 say: Callable[[str], None] = print):
        self.spec = spec
        self.function = load_function(spec)
        self.timeout_s = float(timeout_s)
        self.step_timeout_s = None if step_timeout_s is None else float(step_timeout_s)
        self.fail_fast = fail_fast
        self.interrupted = interrupted
        self.say = say
        self.name = _reward_name(self.function)
        self.timeouts = 0
        """Samples that passed the deadline (each one killed a worker)."""
        self.worker_starts = 0
        self._proc: Optional[subprocess.Popen] = None
        self._inbox: Optional[Connection] = None
        self._outbox: Optional[Connection] = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def __call__(self, prompt: Prompt, response_ids: list[int], response_text: str) -> float:
        value = self.score_batch([RewardSample(prompt, 0, list(response_ids), response_text)])[0]
        if isinstance(value, Exception):
            raise value
        return value

    def score_batch(self, samples: Sequence[RewardSample]) -> list[Any]:
        """One float or exception per sample, in order (see the class docstring). Thread-safe:
        concurrent calls take turns (one worker)."""
        with self._lock:
            return self._score_batch(samples)

    def _score_batch(self, samples: Sequence[RewardSample]) -> list[Any]:
        """One batch (a step's samples): each sample within ``timeout_s``, the whole batch within
        ``step_timeout_s``; with ``fail_fast`` (``reward.on_error: raise``) nothing more is
        scored after a failure. Each deadline passed is said on the console at once."""
        results: list[Any] = []
        t0 = time.monotonic()
        batch_deadline = None if self.step_timeout_s is None else t0 + self.step_timeout_s
        while len(results) < len(samples):
            if self.fail_fast and any(isinstance(r, Exception) for r in results):
                skipped = RewardError(f"not scored: an earlier sample's reward failed "
                                      f"(reward.on_error: raise)")
                return results + [skipped] * (len(samples) - len(results))
            start_error = self._start(samples[len(results)])
            if start_error is not None:
                results.append(start_error)
                continue
            rest = samples[len(results):]
            try:
                self._outbox.send(("score", [(s.prompt, list(s.response_ids), s.response_text)
                                             for s in rest]))
            except OSError:
                pass  # the worker died: its end is read below
            for sample in rest:
                left = None if batch_deadline is None else batch_deadline - time.monotonic()
                if left is not None and left < self.timeout_s:
                    answer = self._answer(sample, max(left, 0.0))
                    if answer is None:  # the step's bound: the rest fail without a call
                        return results + self._past_step_bound(len(results), len(samples), t0)
                else:
                    answer = self._answer(sample, self.timeout_s)
                if answer is None:  # past the deadline: a fresh worker scores the rest
                    error = RewardError(
                        f"{self.name} did not return within reward.timeout_s = "
                        f"{self.timeout_s:g} s ({_describe(sample)}); its worker process was "
                        "killed")
                    self.say(f"reward: {error} ({len(results)} of {len(samples)} samples of "
                             f"this step scored, {time.monotonic() - t0:.0f} s)")
                    results.append(error)
                    self.timeouts += 1
                    break
                results.append(answer)
                if isinstance(answer, _WorkerGone):
                    break
        return results

    def _past_step_bound(self, scored: int, total: int, t0: float) -> list[RewardError]:
        """The batch passed ``reward.step_timeout_s``: the worker is killed (by ``_answer``) and
        every sample not scored fails with this error."""
        self.timeouts += 1
        error = RewardError(
            f"{self.name}: the step's rewards took longer than reward.step_timeout_s = "
            f"{self.step_timeout_s:g} s ({scored} of {total} samples scored in "
            f"{time.monotonic() - t0:.0f} s); its worker process was killed")
        self.say(f"reward: {error}")
        return [error] * (total - scored)

    def _start(self, sample: RewardSample) -> Optional[RewardError]:
        """A worker ready to score (started if there is none); the error of ``sample`` if it
        could not start."""
        if self._proc is not None and self._proc.poll() is None:
            return None
        self.close()
        self._proc, self._inbox, self._outbox = start_piped_worker(
            "pipeline.scoring.reward_worker",
            lambda fd_in, fd_out: [self.spec, str(fd_in), str(fd_out), str(os.getpid())])
        self.worker_starts += 1
        ready = self._receive(max(WORKER_START_TIMEOUT_S, self.timeout_s), sample)
        if ready is None:
            self.close()
            return RewardError(f"the worker process of {self.name} did not start within "
                               f"{max(WORKER_START_TIMEOUT_S, self.timeout_s):g} s "
                               f"({_describe(sample)})")
        kind, value = ready
        if kind == "ready":
            return None
        self.close()
        return value if isinstance(value, RewardError) else RewardError(
            f"{self.name}: its worker process: {value}")

    def _answer(self, sample: RewardSample, timeout_s: float) -> Any:
        """The worker's reward for ``sample`` (a float, or the exception in its place); None
        past ``timeout_s`` (the worker killed)."""
        got = self._receive(timeout_s, sample)
        if got is None:
            self.close()
            return None
        kind, value = got
        if kind == "ok":
            return value
        if kind == "gone":
            return value
        return RewardError(value) if kind in ("error", "invalid") else RewardError(
            f"{self.name}: unexpected answer {kind!r} from its worker")

    def _receive(self, timeout_s: float, sample: RewardSample) -> Optional[tuple[str, Any]]:
        """The worker's next message; None after ``timeout_s``; ("gone", error) if it died.
        Raises :class:`RewardInterrupted` as soon as ``interrupted()`` is true."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.interrupted is not None and self.interrupted():
                self.close()
                raise RewardInterrupted(f"a stop signal came while {self.name} scored "
                                        f"{_describe(sample)}: the reward was abandoned")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                if self._inbox.poll(min(POLL_S, remaining)):
                    return self._inbox.recv()
            except (EOFError, OSError):
                return "gone", self._gone(sample)

    def _gone(self, sample: RewardSample) -> "_WorkerGone":
        code = self._proc.wait() if self._proc is not None else None
        self.close()
        how = f"exit status {code}"
        if code is not None and code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        return _WorkerGone(f"{self.name} ended its worker process ({how}) while scoring "
                           f"{_describe(sample)}")

    def close(self) -> None:
        """Kill the worker (with its process group) and close the pipes; the next call starts a
        fresh one."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for conn in (self._inbox, self._outbox):
            if conn is not None:
                conn.close()
        self._inbox = self._outbox = None


class _WorkerGone(RewardError):
    """A sample whose worker process died while scoring it."""


# ------------------------------------------------------------------------------------------------
# HTTP reward service


class HTTPReward:
    """A reward service: POST a JSON list of samples, answered by ``{"rewards": [...]}``.

    Each request carries at most ``batch_size`` samples, as
    ``[{"prompt", "response", "label", "prompt_index", "sample_index"}, ...]``; the answer must
    hold exactly one reward per sample, in order. Connection errors, timeouts, 429 and 5xx
    answers are retried ``max_retries`` times with exponential backoff; any other failure raises
    ``RewardError`` naming the URL and what it answered.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 2,
                 batch_size: int = 64, backoff_s: float = 0.5):
        self.url, self.timeout_s, self.max_retries = url, timeout_s, max_retries
        self.batch_size, self.backoff_s = batch_size, backoff_s

    def __call__(self, prompt: Prompt, response_ids: list[int], response_text: str) -> float:
        return self.score_batch([RewardSample(prompt, 0, list(response_ids), response_text)])[0]

    def score_batch(self, samples: Sequence[RewardSample]) -> list[Any]:
        """One reward per sample; the samples of a failed request get its ``RewardError``."""
        rewards: list[Any] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start:start + self.batch_size]
            try:
                rewards.extend(self._post(chunk))
            except RewardError as err:
                rewards.extend([err] * len(chunk))
        return rewards

    def _post(self, samples: Sequence[RewardSample]) -> list[Any]:
        body = json.dumps([{"prompt": s.prompt.text, "response": s.response_text,
                            "label": s.prompt.label, "prompt_index": s.prompt.index,
                            "sample_index": s.sample_index} for s in samples]).encode()
        what = f"{self.url} (request of {len(samples)} samples)"
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(
                self.url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    status, text = response.status, response.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as err:
                text = err.read().decode("utf-8", "replace") if err.fp else ""
                last_error = f"HTTP {err.code}: {text[:200]!r}"
                if err.code == 429 or err.code >= 500:
                    continue
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
                reason = getattr(err, "reason", err)
                last_error = f"no answer ({type(reason).__name__}: {reason})"
                continue
            if status != 200:
                last_error = f"HTTP {status}: {text[:200]!r}"
                break
            return self._parse(text, len(samples), what)
        tries = f", after {attempt + 1} attempts" if attempt else ""
        raise RewardError(f"reward service {what}{tries}: {last_error}")

    def _parse(self, text: str, count: int, what: str) -> list[Any]:
        try:
            answer = json.loads(text)
        except json.JSONDecodeError:
            raise RewardError(f"reward service {what}: answered non-JSON "
                              f"{text[:200]!r}") from None
        rewards = answer.get("rewards") if isinstance(answer, dict) else None
        if not isinstance(rewards, list):
            raise RewardError(f"reward service {what}: expected "
                              f"{{\"rewards\": [...]}}, got {text[:200]!r}")
        if len(rewards) != count:
            raise RewardError(f"reward service {what}: sent {count} samples, "
                              f"got {len(rewards)} rewards")
        return rewards


# ------------------------------------------------------------------------------------------------


def reward_kind(reward: "RewardConfig", data: "DataConfig") -> str:
    """The configured kind, or the synthetic task's own reward when ``reward.kind`` is null."""
    if reward.kind is not None:
        return reward.kind
    if data.task is None:
        raise RewardError("reward.kind: required with data.train_path")
    return data.task  # every synthetic task names its own built-in reward


def build_reward(reward: "RewardConfig", data: "DataConfig", *,
                 interrupted: Optional[Callable[[], bool]] = None) -> RewardFn:
    """The reward function of a config's ``reward:`` (and ``data:``) sections.

    ``interrupted``: the rank's "a stop signal came" (``pipeline.signals.StopFlag``); a user
    function's call (:class:`FunctionReward`) is abandoned as soon as it is true."""
    kind = reward_kind(reward, data)
    if kind == "function":
        return FunctionReward(reward.function, timeout_s=reward.timeout_s,
                              step_timeout_s=reward.step_timeout_s,
                              fail_fast=reward.on_error == "raise", interrupted=interrupted,
                              say=lambda line: print(line, flush=True))
    if kind == "http":
        return HTTPReward(reward.url, timeout_s=reward.timeout_s, max_retries=reward.max_retries,
                          batch_size=reward.batch_size)
    if kind == "math":
        try:
            import math_verify  # noqa: F401  (fail at start-up, not at the first reward)
        except ImportError as err:
            raise RewardError("reward.kind 'math' needs the math-verify package "
                              "(pip install math-verify)") from err
    return BUILTIN_REWARDS[kind]
