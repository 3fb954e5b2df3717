"""The one place a run's rollout engine is built: a picklable :class:`ClientSpec` and the config
-> the client and the generator of every training and evaluation sample.

Rank 0 builds its own from here (``launch.rl_session.RLSession.build_rollout``: evaluation, the
parity probes, ``rollout.async: off``), and so does the rollout producer process of the async
modes (``pipeline.producer.worker``), from the same spec sent over its pipe: a second rollout
engine is swapped in here, once, for both: the spec names ``rollout.engine``, and the client
speaks that engine's wire (:mod:`pipeline.engines.choice`).

    client = build_client(ClientSpec(router_url="http://r:30000"), servers=pool)
    generator = build_generator(cfg, client, encoder, interrupted=lambda: stop.signum is not None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from pipeline.engines.choice import engine as choose_engine
from pipeline.generation.client import RolloutClient
from pipeline.generation.generator import GroupGenerator, SingleTurnGenerator
from pipeline.generation.multiturn import ToolGenerator

if TYPE_CHECKING:
    from megatron_gspo.config import Config
    from pipeline.scoring.data import PromptEncoder


@dataclass(frozen=True)
class ClientSpec:
    """What a process needs to build the run's rollout client (plain data: it is pickled to the
    producer process)."""

    router_url: Optional[str]
    """The router every ``/generate`` goes through (None: ``server_urls`` directly)."""
    server_urls: tuple[str, ...] = ()
    max_concurrency: int = 64
    """``rollout.max_concurrency``."""
    request_timeout_s: float = 600.0
    """``rollout.request_timeout_s``."""
    engine: str = "sglang"
    """``rollout.engine``: whose wire the client speaks."""


def client_spec(cfg: Config, router_url: Optional[str],
                server_urls: Sequence[str] = ()) -> ClientSpec:
    """The run's client spec: through ``router_url`` (or to ``server_urls`` directly), with the
    config's bounds."""
    return ClientSpec(router_url=router_url, server_urls=tuple(server_urls),
                      max_concurrency=cfg.rollout.max_concurrency,
                      request_timeout_s=cfg.rollout.request_timeout_s,
                      engine=cfg.rollout.engine)


def build_client(spec: ClientSpec, *, servers: Any = None) -> RolloutClient:
    """The rollout client of ``spec``. ``servers``: the run's server pool, or what stands for it
    in another process (``wait_for_live``, ``wait_for_router``, ``requests_retried``; None:
    failures are retried, then raised)."""
    client = RolloutClient(router_url=spec.router_url, server_urls=list(spec.server_urls) or None,
                           max_concurrency=spec.max_concurrency,
                           request_timeout_s=spec.request_timeout_s,
                           wire=choose_engine(spec.engine).wire)
    client.servers = servers
    return client


def build_generator(cfg: Config, client: RolloutClient, encoder: PromptEncoder, *,
                    interrupted: Optional[Callable[[], bool]] = None) -> GroupGenerator:
    """The run's generator over ``client``: multi-turn trajectories with ``tools`` configured
    (its sandbox's workers live until ``close()``), else one request per sample.
    ``interrupted``: a stop signal came (the tool calls in flight are abandoned)."""
    if cfg.tools.enabled():
        return ToolGenerator(cfg, client, encode_text=encoder.encode_text, decode=encoder.decode,
                             interrupted=interrupted)
    return SingleTurnGenerator(client)
