"""No optimizer update with a non-finite loss or gradient: it is stopped before it is applied.

Megatron-Core does not stop it. ``FP32Optimizer.step`` (float32 parameters, as on the CPU) and the
mixed-precision optimizers without a grad scaler (bfloat16 here: Megatron builds a grad scaler
only for fp16 or an explicit loss scale, neither of which this project sets) apply the update
whatever the gradient holds, and their grad-norm clip lets a NaN norm through (``clip_coeff <
1.0`` is False for NaN). One NaN then reaches every parameter through Adam, every rollout server
through the weight sync, and the next checkpoint. ``update_successful`` is False only when a grad
scaler found inf/NaN (fp16), which skips the update silently.

So :func:`check_update` runs in ``train_step`` after the backward (the gradients reduced over the
data-parallel ranks: ``finalize_model_grads``) and before ``optimizer.step()``. It is collective
over every training rank: each rank checks what it holds, the loss terms of its micro-batches
(the last pipeline stage has them) and its gradient buffers, and one MAX all-reduce of a few flags
makes every rank reach the same verdict and raise the same :class:`NonFiniteError` naming the term
(the policy term, the KL term, the entropy term, the loss, or the gradient) and whether it is NaN
or inf. The RL trainer adds the step and the update (``step 2: update 1/2: ...``). Nothing after
it runs: no update, no weight sync, no checkpoint, so the newest checkpoint stays the last good
state. The cost: one min/max pass over this rank's gradient buffers (no copy) and one all-reduce of
``len(LOSS_TERMS) + 1`` numbers per update.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from megatron_gspo.errors import ExplainedError
from megatron_gspo.parallel import collective_device

LOSS_TERMS: tuple[tuple[str, str], ...] = (
    ("policy_loss", "the policy term (gspo.variant)"),
    ("kl_mean", "the KL term (gspo.kl_coef)"),
    ("entropy_mean", "the entropy term (gspo.entropy_coef)"),
    ("loss_sum", "the loss"),
)
"""The micro-batch metrics checked (the loss function's, and ``forward_backward``'s ``loss_sum``)
and their names in the message: the terms first, then the loss they add up to. A key a loss
function does not report (SFT's has ``loss_sum`` only) is not checked."""

FINITE, INF, NAN = 0.0, 1.0, 2.0
"""A flag's values; the all-reduce keeps the largest (NaN over inf)."""
_WORD = {INF: "inf", NAN: "NaN"}


class NonFiniteError(FloatingPointError, ExplainedError):
    """The update's loss or gradient is not finite; it was not applied (exit status 1, one
    line: ``megatron_gspo.errors.ExplainedError``)."""


def _code(values: torch.Tensor) -> torch.Tensor:
    """NAN if any of ``values`` is NaN, INF if any is +-inf, FINITE otherwise (a 0-d tensor)."""
    values = values.detach().to(torch.float64)
    is_nan = torch.isnan(values).any()
    is_inf = torch.isinf(values).any()
    return torch.where(is_nan, NAN, torch.where(is_inf, INF, FINITE))


def _gradients(model_chunks: Iterable) -> list[torch.Tensor]:
    """The gradient tensors of this rank: Megatron DDP's contiguous buffers (dense and expert),
    else each parameter's ``main_grad`` / ``grad``."""
    grads = []
    for chunk in model_chunks:
        buffers = getattr(chunk, "buffers", None)  # DDP's list (nn.Module has a method so named)
        if isinstance(buffers, list):
            expert = list(getattr(chunk, "expert_parallel_buffers", []))
            grads += [b.grad_data for b in list(buffers) + expert]
            continue
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(g)
    return [g for g in grads if g.numel() > 0]


def local_flags(per_microbatch: Sequence[dict], model_chunks: Iterable) -> torch.Tensor:
    """This rank's flags, float64 on the collective device: one per :data:`LOSS_TERMS` entry over
    its micro-batches, then one for its gradients (each FINITE, INF or NAN)."""
    device = collective_device()
    flags = torch.zeros(len(LOSS_TERMS) + 1, dtype=torch.float64, device=device)
    for i, (key, _) in enumerate(LOSS_TERMS):
        values = [torch.as_tensor(m[key]).reshape(()).to(device, torch.float64)
                  for m in per_microbatch if key in m]
        if values:
            flags[i] = _code(torch.stack(values))
    # min and max of each buffer: NaN propagates through both, an inf shows in one; no copy
    ends = [torch.stack(torch.aminmax(g)).to(device, torch.float64)
            for g in _gradients(model_chunks)]
    if ends:
        flags[-1] = _code(torch.cat(ends))
    return flags


def describe(flags: Sequence[float]) -> str:
    """The verdict of the (reduced) flags in words; empty when everything is finite."""
    terms = [f"{name} is {_WORD[code]}" for (_, name), code in zip(LOSS_TERMS, flags[:-1])
             if code != FINITE]
    gradient = flags[-1]
    if not terms and gradient == FINITE:
        return ""
    if terms:
        what = "non-finite loss: " + ", ".join(terms)
        if gradient != FINITE:
            what += f"; the gradient is {_WORD[gradient]}"
    else:
        what = f"non-finite gradient (the loss is finite): the gradient is {_WORD[gradient]}"
    return (f"{what}. The update was not applied and the run stops before any weight sync or "
            "checkpoint: the rollout servers keep the previous weights and the newest checkpoint "
            "is intact (--resume continues from it once the cause is fixed: too large an "
            "optim.lr, gspo settings at the edge of their range, non-finite rewards)")


def check_update(per_microbatch: Sequence[dict], model_chunks: Iterable, *, group=None) -> None:
    """Collective over ``group`` (None: every rank): raise :class:`NonFiniteError` on every rank
    when any rank's loss terms or gradients are not finite (see the module docstring)."""
    flags = local_flags(per_microbatch, model_chunks)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    verdict = describe(flags.tolist())
    if verdict:
        raise NonFiniteError(verdict)
