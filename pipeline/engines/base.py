"""The seam between the pipeline and a rollout engine (``rollout.engine``: SGLang or vLLM).

The pipeline needs four things of an engine, and nothing else asks which engine runs:

* :class:`GenerationWire`: how one sample is asked for and read back (token ids in and out,
  log-probs, the sampling seed, per-token weight-version spans), how requests are aborted, which
  path says a server can generate. :class:`pipeline.generation.client.RolloutClient` sends it;
  its retries, sticky servers, over-sampling, connection bounds and dead-server waits are the
  same for every engine.
* :class:`ServerControl`: what the weight sync and the server pool do to one server: pause
  (:data:`PAUSE_MODES`), resume, the weight-version label, the cache flush, its description,
  liveness (while paused, too).
* a weight transport per ``rollout.weight_sync.transport`` (:meth:`Engine.make_transport`,
  :class:`pipeline.weights.interface.Transport`): :class:`pipeline.weights.push.WeightPusher`
  keeps the pause, the bucket order, the checks, the versions and the recovery for all of them.
* the servers of an embedded run (:meth:`Engine.cluster`) and their flags;
* :class:`ProbeScorer`: how the parity watchdog (``pipeline.weights.parity``) has one server
  score fixed token sequences (prefill only, the log-probs of given tokens at T = 1).

:func:`pipeline.engines.choice.engine` returns the one :class:`Engine` of a run; it is chosen
once, where the session is built (``launch.rl_session``).

Pause modes, in the pipeline's words (:data:`PAUSE_MODES`): ``abort`` (requests in flight come
back aborted with their output so far) and ``retract`` (they stay on the server and are
recomputed under the new weights after the update: ``rollout.async: full``). Each engine maps
them onto its own API (SGLang: ``/pause_generation {"mode": "abort"|"retract"}``; vLLM:
``/pause?mode=abort``, or ``keep`` then ``/reset_prefix_cache?reset_running_requests=true``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Protocol

from pipeline.generation.trajectory import RolloutResult

PAUSE_MODES = ("abort", "retract")
"""The pipeline's pause modes (module docstring)."""


class GenerationWire(Protocol):
    """One engine's generation requests (used by ``RolloutClient`` for every sample)."""

    name: str
    generate_path: str
    """The path one sample is POSTed to."""
    health_path: str
    """A GET that answers 200 once the server can generate (``wait_healthy``)."""

    def payload(self, rid: str, input_ids: Sequence[int], sampling, *,
                return_routed_experts: bool = False) -> dict:
        """The body of one sample's request (``sampling``: ``client.SamplingParams``)."""

    async def read(self, raw: bytes, rid: str, prompt_ids: Sequence[int], url: str, *,
                   routed_experts: Optional[tuple[int, int]] = None) -> RolloutResult:
        """A 200 answer -> the sample (``RolloutError`` naming ``url`` if it is malformed)."""

    def abort_call(self, rid: Optional[str]) -> tuple[str, dict]:
        """(path, body) that aborts the request ``rid`` on a server (None: every request)."""


class ProbeScorer(Protocol):
    """One engine's scoring of a parity probe: the raw (T = 1) log-probs a server gives the
    probe's response tokens after its prompt, prefill only (``pipeline.weights.parity``)."""

    def score_call(self, rid: str, prompt_ids: Sequence[int], response_ids: Sequence[int], *,
                   routed_experts: bool = False) -> tuple[str, dict]:
        """(path, body) of the request (``routed_experts``: also the routed experts, where the
        engine gives them for a prefill)."""

    def read_scores(self, body: Any, prompt_ids: Sequence[int], response_ids: Sequence[int],
                    url: str) -> tuple[list[float], Any]:
        """A 200 answer -> (one log-prob per response token, the routed experts or None);
        ``RolloutError`` naming ``url`` when it is malformed or scores other tokens."""


class ServerControl(Protocol):
    """What the weight sync and the server pool do to one server (``url``); every call is
    bounded by ``timeout_s`` and raises ``RolloutError`` naming the server and the call."""

    pause_modes: tuple[str, ...]
    """The modes :meth:`pause` takes (:data:`PAUSE_MODES` at least)."""

    def extensions(self, info: dict) -> set[str]:
        """What the server (its :meth:`server_info`) offers beyond the engine's own API
        (``checksums``, ``delta``, ``timings``: negotiated by ``WeightPusher``)."""

    def pause(self, url: str, mode: str, *, timeout_s: float) -> None:
        """Stop generating (:data:`PAUSE_MODES`, or one of the engine's own modes)."""

    def resume(self, url: str, *, timeout_s: float) -> None:
        """Generate again (after :meth:`pause`)."""

    def after_update(self, url: str, mode: str, *, timeout_s: float) -> None:
        """The weights changed while paused in ``mode``: drop the KV the old weights computed
        (the prefix cache; with ``retract``, also the paused requests', which are recomputed)."""

    def set_version(self, url: str, version: str, *, timeout_s: float) -> None:
        """Label the weights the server holds now (per-token version spans carry it)."""

    def weight_version(self, url: str, *, timeout_s: float) -> Optional[str]:
        """The label of the weights the server holds."""

    def server_info(self, url: str, *, timeout_s: float) -> dict:
        """``tp_size``, ``dp_size``, ``pp_size`` and what else the engine reports."""

    def liveness_path(self, paused: bool) -> str:
        """A GET whose 200 says the server's process serves HTTP (``paused``: while the weight
        sync has it paused, when some engines' ``/health`` waits)."""


class Engine(Protocol):
    """One rollout engine: the wire, the control calls, the transports, the embedded servers."""

    name: str
    wire: GenerationWire
    control: ServerControl
    scorer: ProbeScorer

    def check(self, cfg, *, on_gpu: bool) -> None:
        """Refuse (``ConfigError``, one line naming the field) what the engine cannot serve of
        ``cfg`` on this machine, before any process starts."""

    def make_transport(self, pusher, transport: str, **options: Any):
        """The ``pipeline.weights.interface.Transport`` named ``transport`` for ``pusher``
        (``ValueError`` naming ``rollout.weight_sync.transport`` where the engine has none)."""

    def cluster(self, cfg, model_path: str, *, log_dir, weights_dir):
        """The embedded servers of a run (``cfg``'s rollout section; a not yet started
        ``pipeline.servers.cluster.LocalRolloutCluster``); ``weights_dir``: the disk sync's."""
