"""The two environment variables SGLang 0.5.23's health check reads, read as SGLang reads them
(the local server's ``/health``: :mod:`pipeline.local.routes.health`; the launchers set
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` for the servers they start:
``pipeline.servers.cluster``, ``slurm/*.sbatch``)."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("megatron_gspo.serve")

TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
"""SGLang's bound of a generating health check, seconds (``int(os.getenv(..., 20))`` at the
import of its http_server.py)."""
DEFAULT_TIMEOUT_S = 20
GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
"""SGLang's switch (``environ.py``, ``EnvBool(True)``): false makes ``/health`` answer 200 without
a generation; ``/health_generate`` always generates."""
RID_PREFIX = "HEALTH_CHECK"  # SGLang's HEALTH_CHECK_RID_PREFIX (srt/constants.py)
LAUNCHER_ENV = {GENERATION_ENV: "false"}
"""What the launchers set for every rollout server they start, unless the environment already
sets it (``pipeline.servers.cluster.LocalRolloutCluster``, ``launch slurm``'s job script):
``/health`` answers 200 without a generation, so a router's health checks keep passing while a
weight sync pauses the servers, however long (a generation waits while paused; sglang-router
would mark every server unhealthy and answer ``503 No available workers`` until its checks
re-admit them). The router's checks then test that a server's HTTP process is up;
``/health_generate`` (the client's start-up wait) still generates."""

_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def timeout_from_env(environ=os.environ) -> int:
    """``SGLANG_HEALTH_CHECK_TIMEOUT`` as SGLang reads it (``int()``, default 20); ValueError
    naming the variable for what ``int()`` refuses (SGLang fails to import then)."""
    raw = environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: not an integer (SGLang reads it with int(); "
                         "seconds a generating health check may take)") from None


def generation_from_env(environ=os.environ) -> bool:
    """``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` as SGLang's ``EnvBool`` parses it; an
    unknown value is a warning and the default (true), as there."""
    raw = environ.get(GENERATION_ENV)
    if raw is None:
        return True
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    log.warning('Invalid value for %s: "%s" is not a valid boolean value, using default "True"',
                GENERATION_ENV, raw.lower())
    return True
