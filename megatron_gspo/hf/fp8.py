"""FP8 rollout weights: block-wise e4m3 quantization of the HF tensors the rollout servers run in
FP8 (``rollout.quantization: fp8``), in the layout of Qwen's own FP8 checkpoints (e.g.
Qwen3-30B-A3B-FP8) and of SGLang 0.5.23's block-FP8 loader:

* ``quantization_config``: ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128]}`` (:data:`QUANTIZATION_CONFIG`): SGLang's ``Fp8Config`` with
  ``is_checkpoint_fp8_serialized`` and block quantization (``layers/quantization/fp8.py``), which
  keeps its parameter objects on reload, so later weight updates load in place;
* every 2-D projection of attention and of the MLP experts (``q/k/v/o_proj``,
  ``gate/up/down_proj``; :func:`is_quantized`) is stored as ``float8_e4m3fn`` with one float32
  scale per 128 x 128 block, ``<name>_scale_inv`` (the dequantized weight is ``w_fp8 x scale`` per
  block: SGLang's name for the multiplier); the embedding, the output layer, the norms and the
  router (``mlp.gate``) stay in bf16 (Qwen's FP8 checkpoints keep them too);
* the scale of a block is ``amax / 448`` (448: e4m3's largest finite value), so every block uses
  the whole e4m3 range and none saturates (slime's and AReaL's trainer-side quantizer do the same).

Pure size arithmetic here is what ``megatron-gspo plan`` uses; :func:`quantize` / :func:`dequantize`
are what the weight sync sends and the project's local server reads (torch, any device).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch

BLOCK = 128
"""Rows and columns of one scale block (``weight_block_size: [128, 128]``)."""
FP8_MAX = 448.0
"""e4m3fn's largest finite magnitude (``torch.finfo(torch.float8_e4m3fn).max``)."""
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
"""The served checkpoint's ``quantization_config`` (config.json) that these weights fit."""
SCALE_SUFFIX = "_scale_inv"
"""``<name>_scale_inv``: the per-block float32 multiplier of the FP8 tensor ``<name>``."""
QUANTIZED_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                      "gate_proj.weight", "up_proj.weight", "down_proj.weight")
"""The HF tensors stored in FP8: the linear projections of attention and of every expert."""


def is_quantized(name: str, shape) -> bool:
    """Whether the HF tensor ``name`` is stored in FP8 (a 2-D attention or expert projection)."""
    return len(shape) == 2 and name.endswith(QUANTIZED_SUFFIXES)


def scale_shape(shape) -> tuple[int, int]:
    """The per-block scale tensor of an FP8 weight of ``shape``: [ceil(rows/128), ceil(cols/128)]."""
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def served_bytes(name: str, shape, dense_bytes: int = 2) -> int:
    """Bytes of one HF tensor as the FP8 servers hold it: 1 per element plus 4 per scale block
    when quantized, else ``dense_bytes`` per element (bf16)."""
    n = math.prod(shape)
    if not is_quantized(name, shape):
        return n * dense_bytes
    return n + 4 * math.prod(scale_shape(shape))


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``float8_e4m3fn`` weight, float32 per-block scale) of a 2-D weight: each 128 x 128 block
    (the last ones may be smaller) divided by its amax / 448 (an all-zero block: scale 1)."""
    if weight.dim() != 2:
        raise ValueError(f"FP8 block quantization takes a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = scale_shape((rows, cols))
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """The weight an FP8 server computes with: each block of ``q`` times its ``scale``."""
    rows, cols = q.shape
    expected = scale_shape((rows, cols))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit an FP8 weight of shape "
                         f"{(rows, cols)} in {BLOCK} x {BLOCK} blocks (expected {expected})")
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return (q.float() * full).to(dtype)


def checkpoint_problem(directory: str | Path) -> Optional[str]:
    """Why the Hugging Face directory an FP8 server starts from does not hold these weights'
    layout (its config.json's ``quantization_config`` against :data:`QUANTIZATION_CONFIG`);
    None when it does, or when there is no config.json here to read."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(quant, dict):
        return f"{path} has no quantization_config: a bf16 checkpoint"
    wrong = {k: quant.get(k) for k, v in QUANTIZATION_CONFIG.items() if quant.get(k) != v}
    if wrong:
        return (f"{path}'s quantization_config has {wrong}, not the block FP8 layout the weight "
                f"sync sends ({QUANTIZATION_CONFIG})")
    return None
