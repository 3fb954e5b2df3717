"""``megatron-gspo convert hf-to-fp8``: the FP8 checkpoint SGLang servers start from with
``rollout.quantization: fp8``.

A bf16 (or fp32) Hugging Face Qwen3-MoE directory is rewritten with every attention and expert
projection as block-wise e4m3 and its ``<name>_scale_inv`` (``megatron_gspo.hf.fp8``: the layout
the weight sync then sends every step, Qwen's own -FP8 releases' layout), the other tensors as
they are, and ``quantization_config`` in config.json, so that SGLang 0.5.23 loads it with its
block-FP8 method, whose parameters later weight updates load in place. (Started from the bf16
directory instead, SGLang would quantize online per tensor, replacing its parameters, and refuse
every update after that.) One tensor in memory at a time; the tokenizer files are copied.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_gspo.hf.convert import ConversionResult, _prepare_out_dir, _ShardedOutput
from megatron_gspo.hf.fp8 import (QUANTIZATION_CONFIG, SCALE_SUFFIX, is_quantized, quantize,
                                  scale_shape)
from megatron_gspo.hf.mcore_checkpoint import HF_SIDE_FILES, copy_hf_files
from megatron_gspo.hf.safetensors_io import INDEX_FILE, CheckpointError, HFCheckpoint, parse_size


def hf_to_fp8(hf_dir: str | Path, out_dir: str | Path, *, max_shard_size: str = "5GB",
              progress: bool = True, overwrite: bool = False,
              sync_files: bool = True) -> ConversionResult:
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    try:
        config = json.loads((hf_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{hf_dir / 'config.json'}: cannot be read ({err})") from None
    if config.get("quantization_config"):
        raise CheckpointError(f"{hf_dir / 'config.json'}: already quantized "
                              f"({config['quantization_config']}); pass the bf16 checkpoint")
    source = HFCheckpoint(hf_dir)
    planned = []
    for name, info in sorted(source.tensors.items(), key=lambda kv: (kv[1].path, kv[1].offset)):
        if is_quantized(name, info.shape):
            planned += [(name, info.shape, torch.float8_e4m3fn),
                        (name + SCALE_SUFFIX, scale_shape(info.shape), torch.float32)]
        else:
            planned.append((name, info.shape, info.dtype))
    out_dir = _prepare_out_dir(Path(out_dir), overwrite, marker=INDEX_FILE)
    output = _ShardedOutput(out_dir, planned, parse_size(max_shard_size), sync_files)
    with source, tqdm(total=output.total_size, unit="B", unit_scale=True, unit_divisor=1024,
                      desc="hf-to-fp8", disable=not progress, mininterval=0.5) as bar:
        for name, _, dtype in planned:
            if name.endswith(SCALE_SUFFIX) and dtype == torch.float32:
                continue  # written right after its weight
            tensor = source.read(name)
            if dtype == torch.float8_e4m3fn:
                q, scale = quantize(tensor)
                output.write(name, q)
                output.write(name + SCALE_SUFFIX, scale)
                bar.update(q.numel() + 4 * scale.numel())
            else:
                output.write(name, tensor)
                bar.update(tensor.numel() * tensor.element_size())
    output.close()
    copy_hf_files(hf_dir, out_dir, [n for n in HF_SIDE_FILES if n != "config.json"])
    quantized = dict(config, quantization_config=dict(QUANTIZATION_CONFIG))
    (out_dir / "config.json").write_text(json.dumps(quantized, indent=2) + "\n")
    return ConversionResult(out_dir, len(planned), output.total_size, time.perf_counter() - start)
