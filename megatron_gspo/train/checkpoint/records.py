"""The parallel layout and the model a checkpoint was written under (recorded in its manifest),
and whether a run of another model may resume from it (:func:`resume_refusal`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from megatron_gspo.collectives import rank_world
from megatron_gspo.config import padded_vocab_size
from megatron_gspo.train.checkpoint.manifest import (CheckpointError, checkpoint_root, read_manifest,
                                                     step_dirs)
from megatron_gspo.train.checkpoint.state import (DISTRIBUTED_OPTIMIZER_SHARDING,
                                                  is_distributed_optimizer, module_of)


def layout_of(model_chunks: list) -> dict[str, Any]:
    """This run's parallel layout as a manifest records it: the degrees of the model's Megatron
    config, the data parallelism they leave over, the world size and uneven pipeline stages.
    Sequence parallelism is no part of it (it shards activations, not parameters or state)."""
    tcfg = module_of(model_chunks[0]).config
    world = rank_world()[1]
    tp, pp, cp = (tcfg.tensor_model_parallel_size, tcfg.pipeline_model_parallel_size,
                  tcfg.context_parallel_size)
    return {"world_size": world, "tensor": tp, "pipeline": pp, "context": cp,
            "expert": tcfg.expert_model_parallel_size,
            "expert_tensor": tcfg.expert_tensor_parallel_size or tp,
            "data": world // (tp * pp * cp),
            "num_layers_in_first_pipeline_stage": tcfg.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": tcfg.num_layers_in_last_pipeline_stage}


def describe_layout(layout: Optional[dict], world_size: Any = "?") -> str:
    """``tensor 1, pipeline 1, expert 2, expert_tensor 1, context 1, data 2 (2 ranks)``."""
    if not isinstance(layout, dict):
        return f"an unrecorded layout of {world_size} ranks"
    text = ", ".join(f"{k} {layout.get(k, '?')}" for k in
                     ("tensor", "pipeline", "expert", "expert_tensor", "context", "data"))
    for stage in ("first", "last"):
        layers = layout.get(f"num_layers_in_{stage}_pipeline_stage")
        if layers is not None:
            text += f", {layers} layers in the {stage} stage"
    ranks = layout.get("world_size", world_size)
    return f"{text} ({ranks} rank{'' if ranks == 1 else 's'})"


RESUMABLE_MODEL_FIELDS = frozenset({
    # how the same function is computed: kernels, dispatch, recompute, router precision
    "moe_token_dispatcher", "moe_router_dtype", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "moe_permute_fusion",
    "gradient_accumulation_fusion", "apply_rope_fusion",
    # read only at initialisation (a resumed run loads its weights), or a training coefficient
    "init_method_std", "moe_aux_loss_coeff",
    # a limit on positions (RoPE: no parameter depends on it)
    "max_position_embeddings",
    # compared through what it decides, the padded vocabulary (the embedding's rows)
    "make_vocab_size_divisible_by",
})
"""ModelConfig fields a resumed run may change. Every other field (sizes, heads, head_dim,
experts, top-k, vocabulary, tied embeddings, RoPE theta, norm epsilon, parameter dtype, and any
field added later) is the model itself: a checkpoint written with another value cannot resume."""


def model_record(model, tensor_parallel: int) -> dict[str, Any]:
    """The manifest's record of ``model`` (a ModelConfig): every field, and the vocabulary padded
    for ``tensor_parallel`` (the embedding's and output layer's rows)."""
    record = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    record = json.loads(json.dumps(record))  # as the manifest stores it (lists, floats)
    record["padded_vocab_size"] = padded_vocab_size(model, tensor_parallel)
    return record


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def model_changes(record: dict, model) -> list[tuple[str, Any, Any]]:
    """``(field, written, now)`` for every field of ``model`` that differs from a checkpoint's
    :func:`model_record` and is not in :data:`RESUMABLE_MODEL_FIELDS` (fields the record lacks,
    e.g. added after it was written, are not compared)."""
    now = model_record(model, 1)
    return [(name, record[name], now[name]) for name in now
            if name != "padded_vocab_size" and name not in RESUMABLE_MODEL_FIELDS
            and name in record and record[name] != now[name]]


def resume_refusal(path: str | Path, manifest: dict, model, tensor_parallel: int) -> Optional[str]:
    """Why the checkpoint ``path`` (its ``manifest``) cannot resume a run of ``model`` under
    ``tensor_parallel``, in one message, or None. A checkpoint without a model record (written
    before checkpoints had one) is not judged here."""
    record = manifest.get("model")
    if not isinstance(record, dict):
        return None
    changes = model_changes(record, model)
    if changes:
        if len(changes) == 1:
            name, written, now = changes[0]
            what = f"model.{name}={_show(written)}; this config has {_show(now)}"
        else:
            what = (" and ".join(f"model.{n}={_show(w)}" for n, w, _ in changes)
                    + "; this config has " + " and ".join(f"model.{n}={_show(v)}"
                                                          for n, _, v in changes))
        return (f"--resume: checkpoint {path} was written with {what}: a changed model cannot "
                "resume (start a new run, or init from the exported hf/ policy: run.init_from)")
    rows, now_rows = record.get("padded_vocab_size"), padded_vocab_size(model, tensor_parallel)
    if rows is None or rows == now_rows:
        return None
    written_tp = (manifest.get("layout") or {}).get("tensor", "?")
    hint = ""
    written_divisor = record.get("make_vocab_size_divisible_by")
    for divisor in ((written_divisor * written_tp if isinstance(written_tp, int)
                     and isinstance(written_divisor, int) else 0), rows):
        if divisor and divisor % tensor_parallel == 0:
            candidate = dataclasses.replace(model, make_vocab_size_divisible_by=divisor
                                            // tensor_parallel)
            if padded_vocab_size(candidate, tensor_parallel) == rows:
                hint = (f"; set model.make_vocab_size_divisible_by: "
                        f"{divisor // tensor_parallel} to keep {rows} rows")
                break
    return (f"--resume: checkpoint {path} holds a vocabulary padded to {rows} rows "
            f"(model.make_vocab_size_divisible_by {written_divisor} x "
            f"parallel.tensor {written_tp}); this config pads it to {now_rows} "
            f"(model.make_vocab_size_divisible_by {model.make_vocab_size_divisible_by} x "
            f"parallel.tensor {tensor_parallel}): the embedding and output layer would not fit"
            + hint)


def optimizer_record(optimizer) -> dict[str, Any]:
    """What a manifest records of the optimizer state: the distributed optimizer's follows its
    buffers (Megatron's ``dp_reshardable``, ``state.DISTRIBUTED_OPTIMIZER_SHARDING``)."""
    if is_distributed_optimizer(optimizer):
        return {"distributed": True, "sharding": DISTRIBUTED_OPTIMIZER_SHARDING}
    return {"distributed": False}


def optimizer_refusal(path: str | Path, manifest: dict, distributed: bool,
                      layout: Optional[dict] = None) -> Optional[str]:
    """Why this run (``distributed``: ``optim.use_distributed_optimizer``; ``layout``: its
    parallel layout, None when not known yet) cannot load the optimizer state of checkpoint
    ``path``, in one message, or None. A manifest without an optimizer record was written by the
    plain optimizer (the distributed optimizer's state could not be saved before the record)."""
    record = manifest.get("optimizer") or {"distributed": False}
    written = bool(record.get("distributed"))
    if written != distributed:
        return (f"--resume: checkpoint {path} holds the {'distributed' if written else 'plain'} "
                f"optimizer's state (optim.use_distributed_optimizer: {str(written).lower()}); "
                f"this config has {str(distributed).lower()}: the two optimizers' checkpoints do "
                f"not convert; set optim.use_distributed_optimizer: {str(written).lower()}")
    written_layout = manifest.get("layout")
    if written and layout is not None and written_layout != layout:
        return (f"--resume: checkpoint {path} holds the distributed optimizer's state "
                f"(Megatron's {record.get('sharding', '?')} format, which follows its buffers) "
                f"written under layout {describe_layout(written_layout)}; this run has "
                f"{describe_layout(layout)}: resume it under the layout that wrote it")
    return None


def resume_candidate(run_dir: str | Path) -> Optional[tuple[Path, dict]]:
    """(checkpoint, manifest) that ``--resume`` would start from, judged cheaply (no checksums:
    the ranks verify): the newest checkpoint whose manifest reads; None when there is none."""
    for path in step_dirs(checkpoint_root(run_dir)):
        try:
            return path, read_manifest(path)
        except CheckpointError:
            continue
    return None
