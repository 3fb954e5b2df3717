"""FAULT INJECTION for tests of the parity watchdog: a local server that serves wrong weights.

``megatron-gspo serve --fault-perturb-weights R`` makes the server, after every successful
weight update (any ``/update_weights_from_*`` call answered 200), add Gaussian noise to every
floating-point weight: ``w += R * rms(w) * N(0, 1)`` elementwise, from a generator seeded by
``--random-seed`` and a counter (reproducible). The update itself and its answer are untouched,
so the trainer's weight sync succeeds as usual (with ``rollout.weight_sync.verify: false``: the
per-bucket checksums are those of the received weights, computed before the noise, but a later
sync's checksums would show it), and only the watchdog (``pipeline/weights/parity.py``) can tell that
the server does not serve the trainer's policy. Never use it for anything else.

Kept apart from the server's handlers: an HTTP middleware that runs the perturbation on the
engine thread (between decoding steps, like every weight change) once the handler has answered.
"""

from __future__ import annotations

import asyncio

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
