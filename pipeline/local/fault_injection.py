"""FAULT INJECTION for tests: a local server that serves wrong weights, or that updates slowly.

**Wrong weights** (tests of the parity watchdog only).

``megatron-gspo serve --fault-perturb-weights R`` makes the server, after every successful
weight update (any ``/update_weights_from_*`` call answered 200), add Gaussian noise to every
floating-point weight: ``w += R * rms(w) * N(0, 1)`` elementwise, from a generator seeded by
``--random-seed`` and a counter (reproducible). The update itself and its answer are untouched,
so the trainer's weight sync succeeds as usual (with ``rollout.weight_sync.verify: false``: the
per-bucket checksums are those of the received weights, computed before the noise, but a later
sync's checksums would show it), and only the watchdog (``pipeline/weights/parity.py``) can tell that
the server does not serve the trainer's policy. Never use it for anything else.

**Slow weight updates** (tests of a long weight-sync pause only). ``megatron-gspo serve
--fault-update-delay-s S`` makes every weight update (any ``/update_weights_from_*`` call) hold
the engine thread for S seconds before the update itself runs, as SGLang's scheduler is held by a
disk reload that reads the whole model on every TP rank (minutes at 235B): nothing comes out of
the engine meanwhile, so a health check during a paused sync answers nothing
(:mod:`pipeline.local.routes.health`). The update and its answer are otherwise untouched.

Kept apart from the server's handlers: HTTP middlewares that run on the engine thread (between
decoding steps, like every weight change): the perturbation once the handler has answered, the
delay before the handler runs.
"""

from __future__ import annotations

import asyncio
import math
import time

import torch

UPDATE_PATHS = ("/update_weights_from_disk", "/update_weights_from_tensor",
                "/update_weights_from_distributed")


@torch.no_grad()
def perturb(engine, relative_std: float, generator: torch.Generator) -> None:
    """Engine thread: ``w += relative_std * rms(w) * noise`` for every floating weight."""
    for name in engine.weights.names():
        w = engine.weights.view(name)
        if not w.is_floating_point() or w.numel() == 0:
            continue
        rms = w.double().pow(2).mean().sqrt().item()
        noise = torch.randn(w.shape, generator=generator, dtype=torch.float32)
        w.add_((relative_std * rms * noise).to(w.dtype))


def install(app, engine, relative_std: float, seed: int) -> None:
    """Perturb the weights after every successful weight update (see the module docstring)."""
    if not relative_std > 0:
        raise ValueError(f"--fault-perturb-weights: must be > 0, got {relative_std}")
    generator = torch.Generator().manual_seed(int(seed))

    @app.middleware("http")
    async def perturb_after_update(request, call_next):
        response = await call_next(request)
        if request.url.path in UPDATE_PATHS and response.status_code == 200:
            await asyncio.wrap_future(engine.call(lambda: perturb(engine, relative_std, generator)))
        return response


def install_update_delay(app, engine, seconds: float) -> None:
    """Hold the engine thread ``seconds`` before every weight update (see the module docstring)."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--fault-update-delay-s: must be > 0, got {seconds}")

    @app.middleware("http")
    async def delay_update(request, call_next):
        if request.url.path in UPDATE_PATHS:
            await asyncio.wrap_future(engine.call(lambda: time.sleep(seconds)))
        return await call_next(request)
