"""The served model directory, checked before transformers loads it (``--model-path DIR``).

transformers reports a damaged directory with a raw error deep in its loader (a truncated
safetensors file: ``SafetensorError``; weights whose shapes do not match config.json: its
``ignore_mismatched_sizes`` advice) or not at all (a weight no file holds is initialised at random
and served). :func:`check_model_dir` refuses such a directory first, in one line naming the file,
the tensor and the shapes (:class:`ModelFilesError`, an input error: ``megatron-gspo serve`` /
``python -m pipeline.local`` exit with status 2):

* every safetensors header against its file, and the index against its shards: the check this
  server makes of an ``update_weights_from_disk`` directory (:func:`~pipeline.local.weight_table.
  shard_headers`; the trainer makes the same of a Hugging Face ``run.init_from`` with
  ``megatron_gspo.hf.safetensors_io.HFCheckpoint``, which the layering keeps out of
  ``pipeline/``);
* every weight's shape against the model config.json describes: that model built on the meta
  device (no memory), its parameters by their on-disk names, checked as a disk update's are
  (:meth:`~pipeline.local.weight_table.WeightTable.header_problems`); a weight the model needs
  that no file holds is refused too, and so is one the files hold that the model has no place
  for (unless the model class ignores it when loading).

A directory without safetensors files (``pytorch_model.bin``) is left to transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_gspo.errors import InputError
from pipeline.local.weight_table import WeightFileError, WeightTable, shard_headers

SHOWN = 4
"""Problems named in the message (the rest are counted)."""


class ModelFilesError(ValueError, InputError):
    """The served model directory cannot be loaded as it is; the message names the file, the
    tensor and the shapes."""


def load_config(model_path: Path):
    """transformers' config of ``model_path`` (a :class:`ModelFilesError` naming config.json
    when it does not parse)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelFilesError(f"--model-path {model_path}: {model_path / 'config.json'}: "
                              f"{type(err).__name__}: {' '.join(str(err).split())}") from None


def meta_model(config):
    """The model of ``config`` on the meta device (shapes only, no memory), and its class's
    patterns of names to ignore when missing / unexpected."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return (model, list(getattr(model, "_keys_to_ignore_on_load_missing", None) or []),
            list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []))


def _ignored(name: str, patterns: list[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def check_model_dir(model_path: str | Path, config) -> None:
    """Refuse (:class:`ModelFilesError`) a model directory whose safetensors files are damaged
    or do not hold the weights ``config`` (its config.json) describes."""
    model_path = Path(model_path)
    if not any(model_path.glob("*.safetensors")):
        return
    try:
        headers = shard_headers(model_path)
    except (WeightFileError, OSError) as err:
        raise ModelFilesError(f"--model-path {model_path}: {' '.join(str(err).split())}"
                              ) from None
    fp8 = sorted(e[0] for layout, _ in headers.values() for e in layout
                 if e[1] == torch.float8_e4m3fn or e[0].endswith("_scale_inv"))
    if fp8:
        raise ModelFilesError(
            f"--model-path {model_path}: an FP8 checkpoint ({fp8[0]}, ...: float8_e4m3fn "
            "weights with their _scale_inv): this server loads bf16 / fp32 checkpoints and, "
            "with --quantization fp8, rounds their projections to FP8 blocks itself; serve the "
            "checkpoint it was quantized from")
    model, missing_ok, unexpected_ok = meta_model(config)
    table = WeightTable(model)
    kept = {f: ([e for e in layout if not _ignored(e[0], unexpected_ok)], start)
            for f, (layout, start) in headers.items()}
    problems = table.header_problems(kept, whose="config.json's")
    on_disk = {e[0] for layout, _ in headers.values() for e in layout}
    problems += [f"{name}: in no file (shape {list(table.shape(name))}; transformers would "
                 "serve it at random)" for name in table.names()
                 if name not in on_disk and not _ignored(name, missing_ok)]
    if problems:
        more = f"; ... ({len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise ModelFilesError(f"--model-path {model_path}: the weights do not match its "
                              f"config.json: " + "; ".join(problems[:SHOWN]) + more)
