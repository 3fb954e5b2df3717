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
import torch.distributed as dist

from pipeline import relayed_errors
def broadcast(obj, group=None):
    """Rank 0's ``obj`` on every rank."""
    payload = [obj]
    dist.broadcast_object_list(payload, src=0, group=group)
    return payload[0]


def run_on_rank0(ctx: Any, fn, *args):
    """Run ``fn`` on rank 0 and broadcast ("ok", result) or ("error", its description:
    :func:`pipeline.relayed_errors.describe`) to every rank, so that a failure there (a rollout
    server gone) reaches all ranks instead of hanging them.

    Meanwhile rank 0 may broadcast ``(RESYNC, version)`` (a rollout server died and came back:
    ``ServerPool.wait_for_live``): every rank then runs ``ctx.resync(version)`` with it and waits
    for the outcome again."""
    outcome = None
    if dist.get_rank() == 0:
        with _resync_channel(ctx):
            try:
                outcome = ("ok", fn(*args))
            except Exception as err:  # noqa: BLE001 - re-raised on every rank (or preempted)
                outcome = ("error", relayed_errors.describe(err))
    outcome = broadcast(outcome, ctx.control_group)
    while outcome[0] == RESYNC:  # ranks other than 0
        try:
            ctx.resync(outcome[1])
        except Exception:  # noqa: BLE001 - it fails on rank 0 alike, whose outcome says why
            pass
        outcome = broadcast(None, ctx.control_group)
    return outcome


RESYNC = "resync"


def _resync_channel(ctx: Any):
    """Rank 0 in :func:`_on_main`: the pool's :class:`~pipeline.servers.pool.SyncChannel` open
    (the other ranks wait for the outcome, so they can take part in a weight sync)."""
    channel = getattr(ctx.servers, "channel", None)
    if channel is None or ctx.resync is None:
        return nullcontext()
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def request() -> None:  # on the rollout's thread
        if device is not None:
            torch.cuda.set_device(device)
        version = ctx.weights_version
        broadcast((RESYNC, version), ctx.control_group)
        ctx.resync(version)
    return channel.opened(request)


class PhaseFailed(Exception):
    """A phase failed on EVERY rank alike: rank 0's broadcast outcome (``error``: its
    description, ``phase``: what was running), or a collective that raises the same error
    everywhere (the weight sync; ``cause``: the collective's own error)."""

    def __init__(self, message: str, cause: Optional[BaseException] = None, *,
                 error: Optional[dict] = None, phase: Optional[str] = None):
        super().__init__(message)
        self.message, self.cause, self.error, self.phase = message, cause, error, phase


def on_main(ctx: Any, fn, *args, what: Optional[str] = None):
    """``fn(*args)`` on rank 0, its result on every rank; :class:`PhaseFailed` on every rank if
    it raised there (the message prefixed by ``what``)."""
    status, value = run_on_rank0(ctx, fn, *args)
    if status == "ok":
        return value
    text = f"{value['type']}: {value['message']}"
    raise PhaseFailed(f"{what}: {text}" if what else text, error=value, phase=what)


def everywhere(fn, *args, what: str):
    """``fn(*args)`` on this rank, where ``fn`` is a collective that fails on all ranks alike."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the same error on every rank
        raise PhaseFailed(f"{what}: {err}", cause=err) from err
