"""Rollouts through SGLang's native HTTP API: the client the RL loop uses.

Talks to the real ``sglang-router`` (``router_url``) or to a list of servers directly
(``server_urls``): SGLang servers on GPUs, or ``megatron-gspo serve`` on CPUs - the same protocol
(``docs/sglang_protocol.md``), the same code.

    client = RolloutClient(router_url="http://127.0.0.1:30000")
    groups = client.generate_groups(prompts, group_size=8, sampling=SamplingParams(max_new_tokens=64),
                                    seed=step)                      # list (per prompt) of G results

Each sample is ONE ``/generate`` request with ``input_ids``, ``return_logprob`` and its own
``sampling_seed`` (what slime does; SGLang's ``n`` would give fresh rids and no per-sample seed).

Failures. A server that refuses the connection, times out or dies mid-request: the request is sent
again - to another server in direct mode, through the router again in router mode - after a best
effort abort of the first attempt, under a new rid ``<rid>:retry<k>`` (so a server that still holds
the first attempt never sees a duplicate rid). Every result slot is filled exactly once: nothing is
lost or duplicated. 4xx answers are not retried (they would fail anywhere); 408/429/5xx are. Every
wait is bounded (``health_timeout_s``, ``request_timeout_s`` per attempt, ``max_attempts``), and
errors are :class:`RolloutError` naming the URL, the HTTP status and what the server last said,
whichever of SGLang's three error-body shapes it used.

Connections: every call of a client (and of the direct clients it makes) shares ONE connection
pool (:mod:`pipeline.generation.connections`): at most ``max_connections`` ``/generate`` requests
on the wire at once, whatever the number of calls running (an asynchronous rollout runs one per
group), by default a quarter of the process's ``RLIMIT_NOFILE`` and at most 512. A process that
runs out of file descriptors anyway (EMFILE) gets :class:`~pipeline.generation.connections.
TooManyOpenFiles` at once, naming it: it is not retried, and not taken for a dead server.

No server left (``servers``: the run's ``pipeline.servers.pool.ServerPool``): a request that fails
without an answer or with a 5xx (the router's ``500 call_upstream_request_error`` when its worker
died, then ``503 No available workers``) asks the pool (``wait_for_live``, on a thread, once for
every request that failed meanwhile). While a server serves, it is an ordinary retry; otherwise
the batch waits, bounded, until the pool has a server serving again (restarted and synced to the
current weights), and the failed requests are sent again with a fresh attempt budget (at most
``max_attempts`` such waits per request). The results already in are kept. A request sent again
is generated again from its prompt, with its own ``sampling_seed``: a non-streaming ``/generate``
whose server died returns no partial output to continue from. Every re-send is counted
(``requests_retried``, also in the pool's metrics).

The router's ``503 No available workers`` while the pool says a server serves (a live server the
router's health checks marked unhealthy, typically during a weight sync's pause: SGLang's
``/health`` waits while paused): the request waits until the router lists a healthy worker
again (``servers.wait_for_router``, on a thread, one per event loop at a time; bounded by
``rollout.router.readmit_timeout_s``: ``pipeline.servers.readmission``) and is sent again, not
counted as a failed attempt.

Log-probs: ``output_logprobs`` are SGLang's ``output_token_logprobs``, i.e. log-probs of the
temperature-scaled distribution ``log_softmax(logits / T)`` before top-k / top-p truncation
(greedy: ``T = 1``). Compare them with the trainer's log-probs computed at the same temperature.

Routed experts (routing replay ``rollout``): ``routed_experts=(num_layers, top_k)`` on a generate
call asks every request for SGLang's ``return_routed_experts`` and decodes the answer
(``pipeline.generation.routed_experts``) into ``RolloutResult.routed_experts``, int32
``[len(prompt) + len(output) - 1, num_layers, top_k]``: row t = the experts that routed token t of
``prompt + output``. In router mode those requests go to the router's workers directly:
sglang-router 0.3.2 drops ``return_routed_experts`` from the bodies it forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Optional

import aiohttp

from pipeline.generation import routed_experts as re_wire
from pipeline.generation.answers import Answer, Malformed, check_body, read_answer, version_spans
from pipeline.generation.connections import (ConnectionPool, Pooled, TooManyOpenFiles,
                                             out_of_files)
from pipeline.generation.parse_pool import MIN_BYTES, ParsePool, shared_pool
from pipeline.generation.trajectory import RolloutResult, Span

if TYPE_CHECKING:
    from megatron_gspo.config import RolloutConfig

RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}
NO_WORKERS_CODE = "no_available_workers"  # sglang-router's error code of that 503
NO_WORKERS_TEXT = "No available workers"


# ------------------------------------------------------------------------------------------------
# Bodies


@dataclass(kw_only=True)
class SamplingParams:
    """The ``sampling_params`` object of a /generate request (SGLang's key names and meaning)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: the whole vocabulary."""
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens; the model's EOS (config / generation_config) always stops."""
    n: int = 1
    no_stop_trim: bool = True
    skip_special_tokens: bool = True
    sampling_seed: Optional[int] = None

    def to_json(self) -> dict:
        """Exactly SGLang's keys; ``sampling_seed`` only when set."""
        body = asdict(self)
        body["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is None:
            del body["sampling_seed"]
        return body


class RolloutError(RuntimeError):
    """A rollout server (or the router) failed: which URL, which HTTP status, what it said."""

    def __init__(self, url: str, status: Optional[int], message: str):
        self.url, self.status, self.message = url, status, message
        shown = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"{url}: {shown}: {message}")

    def __reduce__(self):  # it crosses ranks as itself (megatron_gspo.collectives.Failure)
        return type(self), (self.url, self.status, self.message), self.__dict__


def error_message(text: str) -> str:
    """The message of an SGLang error body, whichever of its shapes (protocol doc §1.3)."""
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return (text or "").strip()[:1000] or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):  # contract gate: {"error": "<message>"}
            return err
        if isinstance(err, dict) and "message" in err:  # ValueError / router: {"error": {...}}
            return str(err["message"])
        if "message" in body:  # pydantic {"object": "error", ...} and {"success": false, ...}
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return text.strip()[:1000]


def no_available_workers(status: Optional[int], text: str) -> bool:
    """Whether an answer is the router's ``503 No available workers``: sglang-router 0.3.2's
    ``{"error": {"code": "no_available_workers", "message": "No available workers (all circuits
    open or unhealthy)"}}``, or the plain text of older routers. It has no worker it considers
    healthy: dead servers, or live ones its health checks have not re-admitted yet
    (``pipeline.servers.readmission``)."""
    if status != 503:
        return False
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return (text or "").lstrip().startswith(NO_WORKERS_TEXT)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and (error.get("code") == NO_WORKERS_CODE or str(
        error.get("message", "")).startswith(NO_WORKERS_TEXT))


def generate_payload(rid: str, input_ids: Sequence[int], sampling: SamplingParams, *,
                     return_routed_experts: bool = False) -> dict:
    """The /generate body of one sample (``return_routed_experts``: SGLang's top-level field,
    routed experts of every position from 0, ``routed_experts_start_len`` left at its 0)."""
    body = {"rid": rid, "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling.to_json(), "return_logprob": True,
            "logprob_start_len": -1, "stream": False}
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def parse_generate_text(text: bytes | str, rid: str, prompt_ids: Sequence[int], url: str, *,
                        routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
    """A 200 answer's text (or the bytes read off the socket) -> :class:`RolloutResult`, read in
    this thread (``pipeline.generation.answers.read_answer``); RolloutError if it is not JSON or
    malformed."""
    try:
        answer = read_answer(text, rid, len(prompt_ids), routed_experts)
    except Malformed as err:
        raise RolloutError(url, 200, str(err)) from None
    return answer_result(answer, rid, prompt_ids, url, routed_experts)


def parse_generate_response(body: Any, rid: str, prompt_ids: Sequence[int], url: str, *,
                            routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
    """One /generate response object -> :class:`RolloutResult` (RolloutError if malformed).

    ``routed_experts=(num_layers, top_k)``: the request asked for them; they are decoded, and
    their absence from a sample that ran is an error (SGLang omits them silently when the
    server was started without ``--enable-return-routed-experts``)."""
    try:
        answer = check_body(body, rid, len(prompt_ids), routed_experts)
    except Malformed as err:
        raise RolloutError(url, 200, str(err)) from None
    return answer_result(answer, rid, prompt_ids, url, routed_experts)


def answer_result(answer: Answer, rid: str, prompt_ids: Sequence[int], url: str,
                  routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
    """The sample of a checked answer (read here or in the parse process)."""
    n = len(answer.output_ids)
    routed = None
    if answer.routed is not None and routed_experts is not None:
        routed = re_wire.from_bytes(answer.routed, re_wire.expected_rows(len(prompt_ids), n),
                                    *routed_experts)
    return RolloutResult(
        rid=rid, prompt_ids=list(prompt_ids), output_ids=answer.output_ids.tolist(),
        output_logprobs=answer.logprobs.tolist(), finish_reason=answer.kind,
        matched_stop=answer.matched,
        prompt_tokens=len(prompt_ids) if answer.prompt_tokens is None else answer.prompt_tokens,
        completion_tokens=n if answer.completion_tokens is None else answer.completion_tokens,
        weight_version=answer.weight_version, server_url=url, routed_experts=routed,
        weight_versions=[Span(*s) for s in answer.spans], cached_tokens=answer.cached_tokens)


async def read_generate_answer(raw: bytes, rid: str, prompt_ids: Sequence[int], url: str, *,
                               routed_experts: Optional[tuple[int, int]] = None,
                               pool: Optional[ParsePool] = None) -> RolloutResult:
    """A 200 answer as read off the socket -> :class:`RolloutResult`: at least
    ``parse_pool.MIN_BYTES`` of it in the parse process (``pool``, default this process's:
    out of the training process's interpreter lock), a smaller one in this thread."""
    if len(raw) < MIN_BYTES:
        return parse_generate_text(raw, rid, prompt_ids, url, routed_experts=routed_experts)
    future = (pool or shared_pool()).submit(raw, rid, len(prompt_ids), routed_experts)
    try:
        answer = await asyncio.wrap_future(future)
    except Malformed as err:
        raise RolloutError(url, 200, str(err)) from None
    return answer_result(answer, rid, prompt_ids, url, routed_experts)


class SGLangWire:
    """SGLang 0.5.23's requests (``pipeline.engines.base.GenerationWire``): one ``/generate``
    per sample, read by :func:`read_generate_answer`, aborted by ``/abort_request``."""

    name, generate_path, health_path = "sglang", "/generate", "/health_generate"

    def payload(self, rid: str, input_ids: Sequence[int], sampling: SamplingParams, *,
                return_routed_experts: bool = False) -> dict:
        return generate_payload(rid, input_ids, sampling,
                                return_routed_experts=return_routed_experts)

    async def read(self, raw: bytes, rid: str, prompt_ids: Sequence[int], url: str, *,
                   routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
        return await read_generate_answer(raw, rid, prompt_ids, url, routed_experts=routed_experts)

    def abort_call(self, rid: Optional[str]) -> tuple[str, dict]:
        return "/abort_request", ({"rid": rid} if rid else {"abort_all": True})


SGLANG_WIRE = SGLangWire()

def weight_version_spans(meta: dict, num_output: int) -> list[Span]:
    """``meta_info.weight_versions`` checked: spans in order that tile ``[0, num_output)``
    (ValueError otherwise), their labels read as versions (``pipeline.generation.version``).
    Absent (a server before 0.5.23): one span of ``meta_info.weight_version`` over every output
    token."""
    return [Span(*s) for s in version_spans(meta, num_output)]


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A deterministic, well-mixed 63-bit sampling_seed for (seed, prompt, sample)."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


# The base seeds of the RL loop's requests (``generate_groups(..., seed=...)``; each sample's
# sampling_seed is then ``sample_seed(base, prompt, sample)``). A base seed names one stream of
# samples by what it is for: hashing the tuple gives distinct tuples unrelated seeds with no
# arithmetic ranges to respect (an affine formula such as (run_seed * P + step) * R + round reuses
# a seed as soon as round reaches R or step reaches P). Nothing depends on wall time or on which
# rank asks, so a resumed run draws exactly the samples of an uninterrupted one.


def rollout_seed(run_seed: int, step: int, round_: int = 0) -> int:
    """Base seed of step ``step``'s rollouts: round 0 samples the step's prompts, rounds 1, 2, ...
    the extra prompts of dynamic sampling (each round new prompts, so a new stream)."""
    return stream_seed("rollout", run_seed, step, round_)


def eval_seed(run_seed: int) -> int:
    """Base seed of every evaluation of a run: the same at every step (common random numbers), so
    a change of the held-out reward between steps measures the policy, not the sampling noise."""
    return stream_seed("eval", run_seed)


def stream_seed(*parts) -> int:
    """A 62-bit base seed named by ``parts`` (what the stream of samples is for; see above)."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 2  # 62 bits, as a random base is


def sampling_params(rollout: RolloutConfig, stop_token_ids: Sequence[int]) -> SamplingParams:
    """The sampling parameters of the RL loop's requests (training rollouts and evaluation alike:
    the held-out reward is measured under the distribution that is trained) from ``rollout``."""
    return SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                          top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens,
                          stop_token_ids=list(stop_token_ids))


# ------------------------------------------------------------------------------------------------
# Synchronous control calls (weight sync, health) - plain urllib, no event loop


def http_json(method: str, url: str, body: Any = None, *, timeout_s: float = 30.0,
              headers: Optional[dict] = None) -> tuple[int, Any]:
    """One HTTP call; returns (status, parsed JSON or text). Raises RolloutError without answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        if out_of_files(err):  # this process, not the server (a "dead" server would be restarted)
            raise TooManyOpenFiles.calling(url, err, None) from None
        reason = getattr(err, "reason", err)
        raise RolloutError(url, None, f"{type(reason).__name__}: {reason}") from None
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return status, text


def control(url: str, path: str, body: Any = None, *, method: str = "POST",
            timeout_s: float = 60.0, headers: Optional[dict] = None) -> Any:
    """A control call that must answer 200 (and ``success`` true when it says so)."""
    status, answer = http_json(method, url.rstrip("/") + path, body, timeout_s=timeout_s,
                               headers=headers)
    failed = isinstance(answer, dict) and answer.get("success") is False
    if status != 200 or failed:
        text = answer if isinstance(answer, str) else json.dumps(answer)
        raise RolloutError(url.rstrip("/") + path, status, error_message(text))
    return answer


def flush_cache(url: str, *, timeout_s: float = 60.0, interval_s: float = 0.2) -> None:
    """``/flush_cache`` answers 400 while requests run; poll until 200 (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, answer = http_json("POST", url.rstrip("/") + "/flush_cache", timeout_s=timeout_s)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise RolloutError(url + "/flush_cache", status,
                               f"still busy after {timeout_s:.0f} s: {error_message(str(answer))}")
        time.sleep(interval_s)


async def _probe(session, url: str, timeout_s: float, path: str = "/health_generate"
                 ) -> tuple[Optional[int], str]:
    try:
        async with session.get(url.rstrip("/") + path,
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, (await resp.text())[:500]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
        if out_of_files(err):
            raise TooManyOpenFiles.calling(url, err, None) from None
        return None, f"{type(err).__name__}: {err}"


async def wait_healthy_async(urls: Sequence[str], timeout_s: float, *, interval_s: float = 0.5,
                             session=None, path: str = "/health_generate") -> None:
    """Poll ``path`` (``GenerationWire.health_path``) of every URL until each answers 200."""
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        deadline = time.monotonic() + timeout_s
        last: dict[str, tuple[Optional[int], str]] = {}
        pending = list(urls)
        while pending:
            left = deadline - time.monotonic()
            answers = await asyncio.gather(*(_probe(session, u, max(1.0, min(25.0, left)), path)
                                             for u in pending))
            for u, answer in zip(pending, answers):
                last[u] = answer
            pending = [u for u, (status, _) in zip(pending, answers) if status != 200]
            if not pending:
                return
            if time.monotonic() + interval_s > deadline:
                u = pending[0]
                status, said = last[u]
                raise RolloutError(u, status, f"not healthy after {timeout_s:.0f} s; last answer: "
                                              f"{said or '(empty body)'}"
                                   + (f" (also unhealthy: {', '.join(pending[1:])})"
                                      if len(pending) > 1 else ""))
            await asyncio.sleep(interval_s)
    finally:
        if own:
            await session.close()


def wait_healthy(urls: Sequence[str], timeout_s: float, *, interval_s: float = 0.5,
                 path: str = "/health_generate") -> None:
    asyncio.run(wait_healthy_async(urls, timeout_s, interval_s=interval_s, path=path))


def router_workers(router_url: str, *, timeout_s: float = 10.0) -> list[dict]:
    """The router's workers (``GET /workers``, sglang-router >= 0.3)."""
    status, answer = http_json("GET", router_url.rstrip("/") + "/workers", timeout_s=timeout_s)
    if status != 200 or not isinstance(answer, dict):
        raise RolloutError(router_url + "/workers", status, error_message(json.dumps(answer)))
    return list(answer.get("workers", []))


# ------------------------------------------------------------------------------------------------
# The client


class _Batch:
    """State shared by the requests of one generate call."""

    def __init__(self) -> None:
        self.stopping = False  # over-sampling: enough groups, do not send more
        self.recoveries = 0  # waits for a live server that ended with one serving
        self.outage_lock: Optional[asyncio.Lock] = None  # one wait for a live server at a time
        self.outage_error: Optional[BaseException] = None  # the wait failed: every request fails
        self.alive_at = float("-inf")  # when the pool last said a server serves


class RolloutClient:
    """Asynchronous /generate client with bounded concurrency, retries and over-sampling."""

    def __init__(self, router_url: Optional[str] = None, server_urls: Optional[Sequence[str]] = None,
                 *, max_concurrency: int = 64, request_timeout_s: float = 600.0,
                 health_timeout_s: float = 300.0, max_attempts: int = 5,
                 retry_backoff_s: float = 0.5, connect_timeout_s: float = 10.0,
                 server_cooldown_s: float = 5.0, servers: Any = None,
                 max_connections: Optional[int] = None, pool: Optional[ConnectionPool] = None,
                 wire: Any = SGLANG_WIRE):
        """``wire``: the engine's requests (``pipeline.engines.base.GenerationWire``).
        ``servers``: the run's ``ServerPool`` (``wait_for_live``, ``requests_retried``), or
        None: failures are retried ``max_attempts`` times, then raised. ``max_connections``:
        ``/generate`` requests of this client on the wire at once, all its calls together
        (:mod:`pipeline.generation.connections`; default: a quarter of the process's
        ``RLIMIT_NOFILE``, at most 512); ``pool``: share another client's pool instead."""
        if not router_url and not server_urls:
            raise ValueError("RolloutClient: give router_url or server_urls")
        self.router_url = router_url.rstrip("/") if router_url else None
        self.server_urls = [u.rstrip("/") for u in (server_urls or [])]
        self.wire = wire
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.health_timeout_s = health_timeout_s
        self.max_attempts = max_attempts
        self.retry_backoff_s = retry_backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.server_cooldown_s = server_cooldown_s
        self.pool = pool if pool is not None else ConnectionPool(max_connections)
        """The connections of every call of this client (and of its direct clients)."""
        self._inflight: dict[str, int] = {u: 0 for u in self.server_urls}
        self._down_until: dict[str, float] = {}
        self._rr = 0
        self.servers = servers
        self.requests_retried = 0
        """``/generate`` requests sent again after a failure (so far)."""
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """event loop -> the semaphore of ``max_concurrency`` that every call on it shares
        (:meth:`_limit`); shared with the direct clients made from this one."""
        self._limits_lock = threading.Lock()
        self._router_waits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """event loop -> the lock that lets one request of it at a time wait on a thread for
        the router (:meth:`_wait_for_router`; the others find it routing when they get it)."""

    def _limit(self) -> asyncio.Semaphore:
        """``max_concurrency`` as ONE bound over every call of this client (and of the direct
        clients made from it) on the running event loop: a ``rollout.async: full`` stream runs
        one generate call per group on its loop, and a bound per call let (eta + 1) x P groups
        keep G requests each in flight (file descriptors ran out). Calls on another loop (another
        thread's ``asyncio.run``) have their own."""
        loop = asyncio.get_running_loop()
        with self._limits_lock:
            sem = self._limits.get(loop)
            if sem is None:
                sem = self._limits[loop] = asyncio.Semaphore(self.max_concurrency)
        return sem

    # --- targets
    def _pick(self, avoid: str | None, pin: str | None = None) -> str:
        if self.router_url:
            return self.router_url
        now = time.monotonic()
        if pin is not None and pin != avoid and self._down_until.get(pin, 0.0) <= now:
            return pin  # a sticky trajectory's server, while it answers
        up = [u for u in self.server_urls if self._down_until.get(u, 0.0) <= now]
        if len(up) > 1 and avoid in up:
            up.remove(avoid)
        if not up:  # everything failed recently: try again the one that comes back first
            up = [min(self.server_urls, key=lambda u: self._down_until.get(u, 0.0))]
        self._rr += 1
        return min(up, key=lambda u: (self._inflight.get(u, 0), (self.server_urls.index(u) - self._rr)
                                      % len(self.server_urls)))

    def worker_urls(self) -> list[str]:
        """The servers behind this client (the router's workers in router mode)."""
        if self.server_urls:
            return list(self.server_urls)
        return [w["url"].rstrip("/") for w in router_workers(self.router_url)]

    async def direct_client(self) -> "RolloutClient":
        """This client in direct mode; in router mode a direct client of the router's workers
        (same settings): requests that must reach a chosen server (routed experts, a sticky
        multi-turn trajectory) go there without the router."""
        return await self._routed_experts_client()

    def pick_server(self) -> str:
        """Direct mode: the server a new sticky trajectory starts on (the least loaded, in
        turn): its turns are sent there (``pin``) while it answers."""
        if self.router_url:
            raise RuntimeError("pick_server: a direct client only (use direct_client())")
        return self._pick(avoid=None)

    @contextlib.asynccontextmanager
    async def session(self):
        """Requests that share one HTTP session, concurrency bound and outage handling, as the
        requests of one ``generate_groups`` call do: ``async with client.session() as send:
        await send(rid, prompt, sampling, routed_experts=None, pin=None)``."""
        sem, batch = self._limit(), _Batch()
        async with self.pool.use() as pooled:
            async def send(rid: str, prompt: Sequence[int], sampling: SamplingParams, *,
                           routed_experts: Optional[tuple[int, int]] = None,
                           pin: Optional[str] = None) -> RolloutResult:
                return await self._one(pooled, sem, batch, rid, prompt, sampling,
                                       routed_experts, pin)
            try:
                yield send
            except BaseException:
                batch.stopping = True
                await self._abort_on(pooled.session, self.server_urls or [self.router_url])
                raise

    async def _routed_experts_client(self) -> "RolloutClient":
        """The client for requests that ask for routed experts: this one in direct mode; in
        router mode a direct client of the router's workers (same settings). sglang-router 0.3.2
        re-serialises a /generate body with its own request type, which has no
        ``return_routed_experts``: through the router the field never reaches a server."""
        if not self.router_url:
            return self
        urls = await asyncio.to_thread(self.worker_urls)
        if not urls:
            raise RolloutError(self.router_url + "/workers", 200,
                               "no workers registered (requests for routed experts go to the "
                               "router's workers directly)")
        direct = RolloutClient(server_urls=urls, max_concurrency=self.max_concurrency,
                               request_timeout_s=self.request_timeout_s,
                               health_timeout_s=self.health_timeout_s,
                               max_attempts=self.max_attempts,
                               retry_backoff_s=self.retry_backoff_s,
                               connect_timeout_s=self.connect_timeout_s,
                               server_cooldown_s=self.server_cooldown_s, servers=self.servers,
                               pool=self.pool, wire=self.wire)
        direct._limits, direct._limits_lock = self._limits, self._limits_lock  # one bound
        return direct

    # --- one sample
    async def _one(self, pooled: Pooled, sem: asyncio.Semaphore, batch: _Batch, rid: str,
                   prompt: Sequence[int], sampling: SamplingParams,
                   routed_experts: Optional[tuple[int, int]] = None,
                   pin: Optional[str] = None) -> RolloutResult:
        """One request; ``pin``: the server to send it to while that server answers (a sticky
        multi-turn trajectory; a retry after a failure there goes elsewhere). Out of file
        descriptors: :class:`TooManyOpenFiles` at once (no retry, no wait for a server)."""
        async with sem:
            last: Optional[RolloutError] = None
            url: Optional[str] = None
            failures = 0  # attempts failed since the request was sent first (or servers came back)
            sends = 0
            waits = 0
            no_workers_since: Optional[float] = None  # its first "No available workers" answer
            while True:
                if batch.stopping:
                    return _not_sent(rid, prompt, url or self.router_url or "")
                if failures:
                    await asyncio.sleep(min(8.0, self.retry_backoff_s * 2 ** (failures - 1))
                                        * (0.5 + random.random()))
                url = self._pick(avoid=url, pin=pin)
                send_rid = rid if sends == 0 else f"{rid}:retry{sends}"
                if sends:
                    self._count_retry()
                sends += 1
                sent_at = batch.recoveries
                payload = self.wire.payload(send_rid, prompt, sampling,
                                            return_routed_experts=routed_experts is not None)
                self._inflight[url] = self._inflight.get(url, 0) + 1
                timeout = aiohttp.ClientTimeout(total=self.request_timeout_s,
                                                sock_connect=self.connect_timeout_s)
                timed_out = False
                try:
                    async with pooled.slots:  # the pool's limit (before the timeout starts)
                        async with pooled.session.post(url + self.wire.generate_path, json=payload,
                                                       timeout=timeout) as resp:
                            status, raw = resp.status, await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                    if out_of_files(err):  # this process, not the server: no retry, no wait
                        raise TooManyOpenFiles.calling(url, err, self.pool.limit) from err
                    timed_out = isinstance(err, asyncio.TimeoutError)
                    status, raw = None, b""
                    last = RolloutError(url, None, (f"no answer within {self.request_timeout_s:g} s"
                                                    if timed_out else f"{type(err).__name__}: {err}"))
                    if not self.router_url:
                        self._down_until[url] = time.monotonic() + self.server_cooldown_s
                    if timed_out:  # it may still be running there: free it (best effort)
                        await self._abort_on(pooled.session, [url], rid=send_rid)
                finally:
                    self._inflight[url] -= 1
                if status == 200:
                    result = await self.wire.read(raw, rid, prompt, url,
                                                  routed_experts=routed_experts)
                    self._down_until.pop(url, None)
                    return result
                text = raw.decode("utf-8", "replace")
                if status is not None:
                    last = RolloutError(url, status, error_message(text))
                    if status not in RETRYABLE_STATUS:
                        raise last
                    if not self.router_url and status >= 500:
                        self._down_until[url] = time.monotonic() + self.server_cooldown_s
                # no server to answer (a refused or dropped connection, a 5xx): the pool says
                # whether one serves; if none did, it waited for one and the budget starts again
                no_server = (status is None and not timed_out) or (status or 0) >= 500
                if no_server and self.servers is not None and waits < self.max_attempts:
                    if await self._wait_for_servers(batch, sent_at, last):
                        waits += 1
                        failures = 0  # sent again at once, with the whole budget
                        continue
                    if self.router_url and no_available_workers(status, text):
                        # a server serves, the router has not re-admitted it yet: wait for it
                        answered = time.monotonic()
                        no_workers_since = no_workers_since or answered
                        await self._wait_for_router(answered, no_workers_since)
                        continue  # not a failed attempt
                failures += 1
                if failures >= self.max_attempts:
                    assert last is not None
                    raise RolloutError(last.url, last.status, f"gave up after {self.max_attempts} "
                                       f"attempts; last: {last.message}")

    def _count_retry(self) -> None:
        self.requests_retried += 1
        if self.servers is not None:
            self.servers.requests_retried += 1

    async def _wait_for_servers(self, batch: _Batch, sent_at: int, error: RolloutError) -> bool:
        """``servers.wait_for_live(error)`` on a thread, once for every request that failed
        meanwhile; True when servers came back since this request was sent (send it again at
        once), False when one was serving anyway (an ordinary retry). The pool's error (no
        server within its bound) ends every request of the batch."""
        if batch.outage_lock is None:
            batch.outage_lock = asyncio.Lock()
        async with batch.outage_lock:
            if batch.outage_error is not None:
                raise batch.outage_error
            if batch.recoveries != sent_at:  # servers came back after this request went out
                return True
            if time.monotonic() - batch.alive_at < 1.0:  # asked a moment ago: one serves
                return False
            work = asyncio.get_running_loop().run_in_executor(None, self.servers.wait_for_live,
                                                              error)
            try:
                recovered = await asyncio.shield(work)
            except asyncio.CancelledError:
                # the batch is being cancelled: the pool's wait (a restart, a collective weight
                # sync) is not abandoned half-way, it ends before the batch does
                await asyncio.wait([work])
                raise
            except Exception as err:  # noqa: BLE001 - every request of the batch fails alike
                batch.outage_error = err
                raise
            if recovered:
                batch.recoveries += 1
            else:
                batch.alive_at = time.monotonic()
            return recovered

    async def _wait_for_router(self, answered_at: float, first_at: float) -> None:
        """``servers.wait_for_router`` on a thread, one request of this event loop at a time
        (the others then find the router routing at once); its error (the bound passed) is this
        request's."""
        loop = asyncio.get_running_loop()
        with self._limits_lock:
            lock = self._router_waits.get(loop)
            if lock is None:
                lock = self._router_waits[loop] = asyncio.Lock()
        async with lock:
            await asyncio.to_thread(self.servers.wait_for_router, answered_at, first_at)

    async def _abort_on(self, session, urls: Sequence[str], *, rid: Optional[str] = None) -> None:
        path, body = self.wire.abort_call(rid)
        timeout = aiohttp.ClientTimeout(total=10.0)

        async def one(url: str) -> None:
            try:
                async with session.post(url + path, json=body, timeout=timeout) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass  # a dead server has nothing left to abort

        if self.router_url and urls == [self.router_url]:
            try:
                urls = await asyncio.to_thread(self.worker_urls)
            except RolloutError:
                return
        await asyncio.gather(*(one(u) for u in urls))

    async def abort_all(self, session=None) -> None:
        """Abort everything on every server (the router does not proxy SGLang's abort)."""
        urls = await asyncio.to_thread(self.worker_urls)
        if session is None:
            async with self.pool.use() as pooled:
                await self._abort_on(pooled.session, urls)
        else:
            await self._abort_on(session, urls)

    # --- batches
    async def generate(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]], *,
                       routed_experts: Optional[tuple[int, int]] = None) -> list[RolloutResult]:
        """One result per (rid, input_ids, sampling), in input order (``routed_experts``: see
        :meth:`generate_groups_async`)."""
        if routed_experts is not None and self.router_url:
            direct = await self._routed_experts_client()
            return await direct.generate(requests, routed_experts=routed_experts)
        rids = [r[0] for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError("generate: rids must be unique within a batch")
        for _, _, s in requests:
            if s.n != 1:
                raise ValueError("generate: sampling.n must be 1 (use generate_groups for G samples)")
        sem, batch = self._limit(), _Batch()
        async with self.pool.use() as pooled:
            return list(await asyncio.gather(*(self._one(pooled, sem, batch, rid, p, s,
                                                         routed_experts)
                                               for rid, p, s in requests)))

    def generate_sync(self, requests, *, routed_experts: Optional[tuple[int, int]] = None
                      ) -> list[RolloutResult]:
        return asyncio.run(self.generate(requests, routed_experts=routed_experts))

    async def generate_groups_async(self, prompts: Sequence[Sequence[int]], group_size: int,
                                    sampling: SamplingParams, *, seed: Optional[int] = None,
                                    min_complete_groups: Optional[int] = None,
                                    rid_prefix: Optional[str] = None,
                                    routed_experts: Optional[tuple[int, int]] = None
                                    ) -> list[list[RolloutResult]]:
        """G single requests per prompt with distinct sampling seeds; whole groups only.

        ``seed`` (pass a different one per step) makes every sample's ``sampling_seed``
        ``sample_seed(seed, prompt_index, sample_index)``; without it the seeds are random. With
        ``min_complete_groups`` the call stops as soon as that many groups are complete: it aborts
        what is still running (``abort_request`` with ``abort_all`` on every server - everything
        those servers run, so the caller must own them), and returns only the complete groups
        (possibly more than asked for), in prompt order. Without it, every group is returned.
        ``routed_experts=(num_layers, top_k)`` asks every request for the experts the server
        routed each token to (``RolloutResult.routed_experts``); None: not asked for. In router
        mode such requests go to the router's workers directly (:meth:`_routed_experts_client`).
        """
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if min_complete_groups is not None and not 1 <= min_complete_groups <= len(prompts):
            raise ValueError(f"min_complete_groups must be in [1, {len(prompts)}], got "
                             f"{min_complete_groups}")
        if routed_experts is not None and self.router_url:
            direct = await self._routed_experts_client()
            return await direct.generate_groups_async(
                prompts, group_size, sampling, seed=seed, min_complete_groups=min_complete_groups,
                rid_prefix=rid_prefix, routed_experts=routed_experts)
        base = seed if seed is not None else random.getrandbits(62)
        prefix = rid_prefix or f"g{uuid.uuid4().hex[:12]}"
        sem, batch = self._limit(), _Batch()
        async with self.pool.use() as pooled:
            tasks: dict[asyncio.Task, tuple[int, int]] = {}
            for p, prompt in enumerate(prompts):
                for s in range(group_size):
                    sp = replace(sampling, n=1, sampling_seed=sample_seed(base, p, s))
                    task = asyncio.create_task(
                        self._one(pooled, sem, batch, f"{prefix}-p{p}-s{s}", prompt, sp,
                                  routed_experts))
                    tasks[task] = (p, s)
            groups: list[list[Optional[RolloutResult]]] = [[None] * group_size for _ in prompts]
            complete: set[int] = set()
            pending = set(tasks)
            last_abort = float("-inf")
            try:
                while pending:
                    done, pending = await asyncio.wait(pending, timeout=1.0,
                                                       return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        p, s = tasks[task]
                        groups[p][s] = task.result()  # raises the request's RolloutError
                        if all(r is not None and r.finish_reason != "abort" for r in groups[p]):
                            complete.add(p)
                    if (min_complete_groups is not None and pending
                            and len(complete) >= min_complete_groups
                            and time.monotonic() - last_abort >= 1.0):
                        # Abort until everything has come back (a request in flight may reach its
                        # server after an abort; the next abort, a second later, catches it).
                        batch.stopping = True
                        last_abort = time.monotonic()
                        await self._abort_on(pooled.session,
                                             self.server_urls or [self.router_url])
            except BaseException:
                batch.stopping = True
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                for task in tasks:  # the others that failed alike (no live server) are seen
                    if task.done() and not task.cancelled():
                        task.exception()
                await self._abort_on(pooled.session, self.server_urls or [self.router_url])
                raise
        if min_complete_groups is None:
            return [list(g) for g in groups]
        return [list(groups[p]) for p in sorted(complete)]

    def generate_groups(self, prompts, group_size: int, sampling: SamplingParams, *,
                        seed: Optional[int] = None, min_complete_groups: Optional[int] = None,
                        rid_prefix: Optional[str] = None,
                        routed_experts: Optional[tuple[int, int]] = None
                        ) -> list[list[RolloutResult]]:
        return asyncio.run(self.generate_groups_async(
            prompts, group_size, sampling, seed=seed, min_complete_groups=min_complete_groups,
            rid_prefix=rid_prefix, routed_experts=routed_experts))

    def wait_healthy(self, timeout_s: Optional[float] = None) -> None:
        wait_healthy(self.worker_urls() if self.router_url is None else [self.router_url],
                     self.health_timeout_s if timeout_s is None else timeout_s,
                     path=self.wire.health_path)


def _not_sent(rid: str, prompt: Sequence[int], url: str) -> RolloutResult:
    return RolloutResult(rid=rid, prompt_ids=list(prompt), output_ids=[], output_logprobs=[],
                         finish_reason="abort", matched_stop=None, prompt_tokens=len(prompt),
                         completion_tokens=0, weight_version=None, server_url=url)
