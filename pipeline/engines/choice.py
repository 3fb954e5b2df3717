"""The one place ``rollout.engine`` picks the engine (``launch.rl_session`` calls :func:`engine`
once, where the session is built; nothing else asks which engine runs)."""

from __future__ import annotations

from pipeline.engines.base import Engine
from pipeline.engines.sglang import SGLANG
from pipeline.engines.vllm.engine import VLLM

ENGINES: dict[str, Engine] = {"sglang": SGLANG, "vllm": VLLM}
"""``rollout.engine`` -> its :class:`pipeline.engines.base.Engine`."""


def engine(name: str) -> Engine:
    """The engine ``rollout.engine`` names (the config refused any other name)."""
    return ENGINES[name]
