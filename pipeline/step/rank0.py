"""Run on rank 0, tell every rank: rank 0's outcome (its result, or its error as a type) on every
training rank, so that a failure there (a rollout server gone, a reward that raised) reaches all
ranks instead of hanging them in their next collective.

Rank 0 alone talks to the rollout servers and the reward function; the other ranks wait in a
broadcast on the control group (gloo, ``parallel.control_timeout_minutes``). While they wait,
rank 0 may have them all take part in a weight sync (``RESYNC``: a rollout server it restarted
needs the current weights, ``pipeline.servers.pool.SyncChannel``).

``ctx`` is the loop's context (``pipeline.context.LoopContext``): ``control_group``, and for the
resync ``servers`` (its ``channel``), ``resync`` and ``weights_version``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch

from megatron_gspo.collectives import Outcome, broadcast, rank_world
from megatron_gspo.errors import kind_of

RESYNC = "resync"


def run_on_rank0(ctx: Any, fn, *args):
    """``fn(*args)`` on rank 0, its value on every rank, or the error it raised there raised on
    every rank (as :func:`megatron_gspo.collectives.on_rank0`: the same type, or a
    :class:`~megatron_gspo.errors.RemoteError`), so that a failure there (a rollout server gone)
    reaches all ranks instead of hanging them.

    Meanwhile rank 0 may broadcast ``(RESYNC, version)`` (a rollout server died and came back:
    ``ServerPool.wait_for_live``): every rank then runs ``ctx.resync(version)`` with it and waits
    for the outcome again."""
    group = ctx.control_group
    mine = None
    if rank_world(group)[0] == 0:
        with _resync_channel(ctx):
            mine = Outcome.of(fn, *args)
    shipped = broadcast(mine, group=group)
    while isinstance(shipped, tuple) and shipped[0] == RESYNC:  # ranks other than 0
        try:
            ctx.resync(shipped[1])
        except Exception:  # noqa: BLE001 - it fails on rank 0 alike, whose outcome says why
            pass
        shipped = broadcast(None, group=group)
    return (mine if mine is not None else shipped).result()


def _resync_channel(ctx: Any):
    """Rank 0 in :func:`run_on_rank0`: the pool's :class:`~pipeline.servers.pool.SyncChannel`
    open (the other ranks wait for the outcome, so they can take part in a weight sync)."""
    channel = getattr(ctx.servers, "channel", None)
    if channel is None or ctx.resync is None:
        return nullcontext()
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def request() -> None:  # on the thread waiting for a live server (a call of the producer)
        if device is not None:
            torch.cuda.set_device(device)
        version = ctx.weights_version
        broadcast((RESYNC, version), group=ctx.control_group)
        ctx.resync(version)
    return channel.opened(request)


class PhaseFailed(Exception):
    """A phase failed on EVERY rank alike with ``cause``: rank 0's error re-raised on every rank
    (:func:`on_main`; ``phase``: what was running, ``on_rank0`` True), or a collective that raises
    the same error everywhere (:func:`everywhere`, the weight sync). Without a ``cause``: the
    ``message`` says what failed."""

    def __init__(self, message: str, cause: Optional[BaseException] = None, *,
                 phase: Optional[str] = None, on_rank0: bool = False):
        super().__init__(message)
        self.message, self.cause, self.phase, self.on_rank0 = message, cause, phase, on_rank0


def on_main(ctx: Any, fn, *args, what: Optional[str] = None):
    """``fn(*args)`` on rank 0, its result on every rank; :class:`PhaseFailed` on every rank if
    it raised there (the message prefixed by ``what``; ``cause``: the error, as its type)."""
    try:
        return run_on_rank0(ctx, fn, *args)
    except Exception as err:  # noqa: BLE001 - the same error on every rank
        text = f"{kind_of(err)}: {err}"
        raise PhaseFailed(f"{what}: {text}" if what else text, err, phase=what,
                          on_rank0=True) from err


def everywhere(fn, *args, what: str):
    """``fn(*args)`` on this rank, where ``fn`` is a collective that fails on all ranks alike."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the same error on every rank
        raise PhaseFailed(f"{what}: {err}", err) from err
