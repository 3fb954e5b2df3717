"""FP8 on the wire (``rollout.quantization: fp8``): a bucket's attention and expert projections
as block-wise e4m3 weights and their per-block float32 scales, the rest as it is.

The trainer trains in ``model.params_dtype``; the servers run FP8 weights that SGLang 0.5.23's
block-FP8 loader reloads in place (``megatron_gspo.hf.fp8``: the format, Qwen's FP8 checkpoints'
layout). Every push quantizes the bucket's projections (:func:`fp8_entries`) on the sending rank,
on its device, and sends ``<name>`` (``float8_e4m3fn``) with ``<name>_scale_inv`` (float32
``[ceil(rows/128), ceil(cols/128)]``) in the same bucket, whichever transport carries it. The
entries are ordered by item size, largest first, so that every tensor of the flattened bucket
(SGLang's ``FlattenedTensorBucket``) starts at a multiple of its item size.
"""

from __future__ import annotations

import torch

from megatron_gspo.hf.fp8 import SCALE_SUFFIX, is_quantized, quantize

FP8_DTYPE = torch.float8_e4m3fn


def fp8_entries(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``named`` as FP8 servers load it: each projection as its FP8 weight and its scale."""
    out = []
    for name, tensor in named:
        if is_quantized(name, tensor.shape):
            q, scale = quantize(tensor)
            out += [(name, q), (name + SCALE_SUFFIX, scale)]
        else:
            out.append((name, tensor))
    return sorted(out, key=lambda entry: -entry[1].element_size())  # stable: keeps the order


def server_quantization(info: dict) -> str | None:
    """What a server's ``/server_info`` says it runs: SGLang reports its resolved
    ``quantization`` server argument (None for the checkpoint's own dtype), as the local
    server does."""
    value = info.get("quantization")
    return str(value) if value else None
