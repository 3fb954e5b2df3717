"""Every accommodation that lets real Megatron-Core run on a machine without CUDA.

Megatron-Core 0.16 assumes a GPU in a handful of places. Nothing here replaces a Megatron module:
the model, DDP, optimizer and pipeline schedules that run on the CPU are Megatron's own. Each
accommodation below names the Megatron behaviour it meets; ``tests/unit/test_cpu_compat.py`` has a
test for each one that fails if it stops working (or stops being needed in a new Megatron).

Use::

    from megatron_gspo import cpu_compat
    cpu_compat.apply()          # no-op when torch.cuda.is_available()

``apply()`` is idempotent and is called by :func:`megatron_gspo.parallel.initialize` before any
Megatron module is built. On a GPU machine it does nothing at all, so the Transformer Engine spec,
the distributed optimizer and gradient clipping run exactly as Megatron intends.

The accommodations (docs/cpu_accommodations.md tells why each is needed and what it meets):

1. ``CudaDeviceToCpu``: a ``TorchFunctionMode`` that rewrites every CUDA device argument
   (``device="cuda"``, ``device=0``, ``.to("cuda")``, ``.cuda()``) to the CPU. Megatron creates
   tensors with an explicit CUDA device in the default causal mask, the schedules' token counters,
   the optimizer's scale tensors, p2p shape buffers and RoPE (``device=torch.cuda.current_device()``).
   It also drops ``pin_memory=True`` from factory calls, which needs an accelerator: Megatron's
   context-parallel RoPE slice (``rope_utils.get_pos_emb_on_this_cp_rank``) builds its chunk
   index with it.
2. Stand-ins for ``torch.cuda.current_device/synchronize/current_stream/default_stream/Stream/
   stream/Event``: p2p communication synchronises, the token dispatchers and DDP record streams and
   events. On the CPU all work is synchronous, so each is a no-op.
3. ``moe_utils.te_general_gemm = None``: megatron-core 0.16.1 imports it from Transformer Engine
   inside a ``try`` and leaves the name undefined when TE is absent, so the router raises
   ``NameError`` (``router_gating_linear``). ``None`` selects its torch fallback. (0.19 sets
   ``None`` itself; there this does nothing.)
4. Gradient clipping: ``clip_grad_by_total_norm_fp32`` asserts
   ``param.grad.type() == 'torch.cuda.FloatTensor'``. The replacement keeps the semantics
   (same coefficient ``max_norm / (total_norm + 1e-6)``, applied only when below 1, fp32 grads)
   and asserts fp32 on any device instead.
5. The RNG tracker: ``model_parallel_cuda_manual_seed`` seeds the CUDA generator. We use
   :func:`seed_rng_tracker`, an inference tracker whose ``fork()`` leaves the default CPU
   generator in place. That is exact while dropout is 0 (the RL setting; hard-wired in
   ``model.build_transformer_config``), and model weights are initialised by
   ``model.init_weights`` from layout-independent generators, not by the tracker.
6. ``maybe_move_tensor_to_cpu`` (token dispatcher): returns numpy split sizes on the CPU too.
7. Uneven all-gather / reduce-scatter (expert-tensor parallelism): gloo accepts only equal sizes;
   the replacements pad (gather) or all-reduce and slice (reduce-scatter).
8. Activation recompute: ``tensor_parallel.checkpoint`` saves and restores the CUDA generator's
   state around the recomputed forward (``random._get_cuda_rng_state`` asserts "Torch not
   compiled with CUDA"; ``_set_cuda_rng_state`` would queue a lazy CUDA call per layer forever).
   There is no CUDA generator to keep: the stand-ins return an empty state and set nothing. The
   CPU generator and the tracker's states are still saved and restored by Megatron itself. The
   recomputed forward runs inside the backward pass, where accommodation 1's mode is not active
   (Megatron's default causal mask is built there with ``device="cuda"``): the recompute entry
   points (``CheckpointFunction.backward``, ``CheckpointWithoutOutput._recompute``) re-enter it.
   ``CheckpointWithoutOutput`` (selective layernorm recompute) sets ``self.fp8 = fp8 is not None``,
   True for its default ``fp8=False``, and then takes Transformer Engine's FP8 path, a NameError
   without TE: after Megatron's ``__init__`` the flag is set from the argument itself (there is no
   FP8 without a GPU).
9. The distributed optimizer (``use_distributed_optimizer``, with or without
   ``overlap_param_gather``): ``DistributedOptimizer._build_model_and_main_param_groups`` sorts
   the parameters by ``param.type()`` and raises ``TypeError`` for anything but
   ``torch.cuda.{Float,Half,BFloat16}Tensor``. While it runs, a CPU float32 tensor's ``type()``
   answers ``torch.cuda.FloatTensor`` (:class:`CudaFloatTypeName`), so fp32 parameters take the
   fp32 branch they take on a GPU. Everything else of the optimizer (the gradient
   reduce-scatter, the parameter all-gather, the forward pre-hooks, the sharded state dict) is
   Megatron's and runs over gloo. bf16 stays refused (``model.params_dtype``: Megatron's bf16
   path needs CUDA kernels).

Sequence parallelism without Transformer Engine needs a norm that accepts it (Megatron's
``WrappedTorchNorm`` refuses); that is not a CUDA accommodation but a module of ours, in
``megatron_gspo/model/norm.py``, used on every machine where the local spec is used.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_applied = False
_mode: "CudaDeviceToCpu | None" = None


def cuda_available() -> bool:
    """True when a real CUDA device is usable (then no accommodation is applied)."""
    return torch.cuda.is_available()


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:<int>" to torch's factories.
    return isinstance(device, int) and not isinstance(device, bool)


_SPECIAL = frozenset({torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.pin_memory,
                      torch.Tensor.record_stream})


class CudaDeviceToCpu(TorchFunctionMode):
    """Rewrite CUDA device arguments to the CPU (accommodation 1).

    Every torch call of the training step passes through here, so the common case (no
    ``device`` / ``pin_memory`` keyword, not one of the four special methods) is a lookup and
    the call: this mode's Python overhead was ~9% of a CPU training step before that fast path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            device = kwargs.get("device")
            if (device is not None and _is_cuda_device(device)) or kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                if _is_cuda_device(device):
                    kwargs["device"] = torch.device("cpu")
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False  # pinned host memory exists only for an accelerator
        else:
            kwargs = {}
        if func in _SPECIAL:
            if func is torch.Tensor.cuda:
                # ``tensor.cuda()``: the tensor already lives where the work happens.
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(torch.device("cpu") if _is_cuda_device(a) else a for a in args)
            elif func is torch.Tensor.pin_memory:
                return args[0]
            elif func is torch.Tensor.record_stream:
                return None
        return func(*args, **kwargs)


class _NoStream:
    """A CUDA stream stand-in: the CPU executes eagerly, so waiting is a no-op (accommodation 2)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event or _NoEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NoEvent:
    """A CUDA event stand-in (accommodation 2)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def wait(self, stream=None):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _patch_torch_cuda() -> None:
    """Accommodation 2: no-op stand-ins for the torch.cuda calls Megatron makes on the hot path."""
    # Megatron passes ``device=torch.cuda.current_device()`` to factories, also inside autograd
    # backward functions, where the TorchFunctionMode of accommodation 1 is not active.
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.default_stream = lambda *a, **k: _NoStream()
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None


def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Accommodation 6: Megatron's ``moe_utils.maybe_move_tensor_to_cpu`` converts the alltoall
    split sizes to numpy only for CUDA tensors; on the CPU they stayed tensors, which
    ``all_to_all_single`` rejects. Same contract, for tensors on any device."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _patch_moe_utils() -> None:
    """Accommodations 3 and 6 (MoE router and token dispatcher)."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Accommodation 4: Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assert.

    Same contract: scale every fp32 gradient in place by ``max_norm / (total_norm + 1e-6)`` when
    that coefficient is below 1.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        grad = param.decoupled_grad if use_decoupled_grad else param.grad
        if grad is None:
            continue
        if grad.dtype != torch.float32 and not (use_decoupled_grad and grad.dtype == torch.bfloat16):
            raise TypeError(f"gradient clipping expects fp32 gradients, got {grad.dtype}")
        grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clipping() -> None:
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _patch_uneven_collectives() -> None:
    """Accommodation 7: uneven all-gather / reduce-scatter along the first dimension.

    With expert-tensor parallelism the token dispatcher gathers and reduce-scatters tokens with
    per-rank sizes (``output_split_sizes`` / ``input_split_sizes`` in
    ``tensor_parallel.mappings``). NCCL accepts lists of unequal tensors; gloo raises "invalid
    tensor size". The replacements pad every piece to the largest size and use an equal all-gather,
    and compute the uneven reduce-scatter as an all-reduce followed by this rank's slice. The equal
    paths go to Megatron's own functions unchanged.
    """
    from megatron.core.tensor_parallel import mappings

    original_gather = mappings._gather_along_first_dim
    original_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None,
                                       use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start:start + sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _patch_recompute_rng() -> None:
    """Accommodation 8: no CUDA generator state to save / restore around a recomputed forward."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    tp_random._set_cuda_rng_state = lambda *a, **k: None

    def in_mode(fn):
        def wrapped(*args, **kwargs):
            with CudaDeviceToCpu():
                return fn(*args, **kwargs)
        return wrapped

    tp_random.CheckpointFunction.backward = staticmethod(
        in_mode(tp_random.CheckpointFunction.backward))
    tp_random.CheckpointWithoutOutput._recompute = in_mode(
        tp_random.CheckpointWithoutOutput._recompute)
    original_init = tp_random.CheckpointWithoutOutput.__init__

    def init(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = fp8 not in (None, False)

    tp_random.CheckpointWithoutOutput.__init__ = init


class CudaFloatTypeName(TorchFunctionMode):
    """``tensor.type()`` (no argument) of a CPU float32 tensor answers ``torch.cuda.FloatTensor``
    (accommodation 9); every other call, and ``type(dtype)`` conversions, unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.Tensor.type and len(args) == 1 and not kwargs
                and args[0].device.type == "cpu" and args[0].dtype == torch.float32):
            return "torch.cuda.FloatTensor"
        return func(*args, **kwargs)


def _patch_distributed_optimizer() -> None:
    """Accommodation 9: the distributed optimizer's parameter sort accepts CPU float32."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = DistributedOptimizer._build_model_and_main_param_groups.__func__  # a classmethod

    def build_on_cpu(cls, *args, **kwargs):
        with CudaFloatTypeName():
            return build(cls, *args, **kwargs)

    build_on_cpu.__wrapped__ = build  # Megatron's own (tests/unit/test_cpu_compat.py)
    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_on_cpu)


def seed_rng_tracker() -> None:
    """Accommodation 5: an RNG tracker that needs no CUDA generator (exact with dropout 0)."""
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def apply() -> bool:
    """Apply every accommodation when CUDA is absent. Returns True if they are (now) active."""
    global _applied, _mode
    if cuda_available():
        return False
    with _lock:
        if _applied:
            return True
        _patch_torch_cuda()
        _patch_moe_utils()
        _patch_grad_clipping()
        _patch_uneven_collectives()
        _patch_recompute_rng()
        _patch_distributed_optimizer()
        _mode = CudaDeviceToCpu()
        _mode.__enter__()  # stays active for the life of the process
        _applied = True
    return True


def is_applied() -> bool:
    return _applied
