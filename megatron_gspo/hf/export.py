"""A complete Hugging Face directory from the live, sharded policy.

The full tensors come from the weight sync's gather (``megatron_gspo.hf.gather``): each HF tensor
is assembled on its source rank (the lowest rank that holds it whole, else the first of its TP
group), and **every source rank writes its own buckets** as safetensors shards, in parallel, into
the shared output directory. Nothing funnels through rank 0 (at 235B that would be one rank
receiving and writing ~470 GB): each rank receives only its TP peers' shards and writes about its
share of the model; memory is bounded by two buckets per source. Rank 0 then gathers the small
weight maps, names the shards ``model-NNNNN-of-MMMMM.safetensors`` (a rename each; the writer's rank stays in
each shard's metadata, ``rank``) and writes the index and config.json. Used to write the SFT result, the initial policy of the rollout servers
and the final policy of a GSPO run. The output directory must be one every rank sees (a shared
file system on a cluster, as for checkpoints).

Everything is written into ``<out>.tmp`` and renamed to ``<out>`` once complete, as a checkpoint
is: a directory named ``<out>`` is always a whole export. A failed write (on any rank) is raised
on every rank alike once the gather is over, the partial ``.tmp`` removed and ``<out>`` left as
it was; a full disk (too little free space, checked first, or ENOSPC while writing, including the
safetensors library's own ``I/O error``) is an :class:`ExportDiskFull` said as a checkpoint's
(:mod:`megatron_gspo.disk_full`: the path, the space needed, the space free). It never touches the
run's checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from safetensors.torch import save_file

from megatron_gspo.collectives import all_gather, on_rank0
from megatron_gspo.config import ModelConfig
from megatron_gspo.disk_full import DiskFull, disk_full_message, is_disk_full


class ExportDiskFull(DiskFull):
    """No space left for the Hugging Face export (errno ENOSPC): the path, the space it needs
    and the space free, said as :class:`~megatron_gspo.train.checkpoint.CheckpointDiskFull`."""


class ExportError(RuntimeError):
    """Writing the Hugging Face export failed (not for want of space): which file, and why."""


def hf_config_dict(model: ModelConfig, *, dtype: str = "float32") -> dict:
    """A transformers ``Qwen3MoeConfig`` config.json for ``model`` (both rope spellings)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "intermediate_size": model.moe_ffn_hidden_size,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "num_experts": model.num_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "norm_topk_prob": model.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
        "use_sliding_window": False,
        "initializer_range": model.init_method_std,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def copy_tokenizer_files(source: str | Path, target: Path) -> None:
    """The tokenizer and generation files of a Hugging Face directory (not its config.json)."""
    from megatron_gspo.hf.mcore_checkpoint import HF_SIDE_FILES, copy_hf_files

    copy_hf_files(Path(source), target, [n for n in HF_SIDE_FILES if n != "config.json"])


def _disk_full_message(out_dir: Path, where: str | Path, needed: int, free: int) -> str:
    return disk_full_message(
        "Hugging Face export", out_dir.name, where, needed, free,
        f"free space there or point run.output_dir at a larger disk ({out_dir} is left as it was "
        "and the run's checkpoints are kept: megatron-gspo convert mcore-to-hf exports one later)")


def _free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def _prepare(out_dir: Path, tmp: Path, needed: int) -> None:
    """Rank 0: a fresh ``tmp`` (a stale one of an interrupted export gone) and enough space."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(out_dir.parent).free
        if free < needed:
            raise ExportDiskFull(_disk_full_message(out_dir, tmp, needed, free), tmp)
        tmp.mkdir()
    except ExportDiskFull:
        raise
    except OSError as err:
        if is_disk_full(err):
            raise ExportDiskFull(_disk_full_message(out_dir, tmp, needed, _free(out_dir.parent)),
                                 tmp) from None
        raise ExportError(f"Hugging Face export {out_dir.name}: cannot create {tmp}: {err}"
                          ) from None


def _write_error(err: BaseException, out_dir: Path, where: Path, needed: int) -> tuple[str, str]:
    """(kind, message) of a failed write: "disk_full" or "error"."""
    if is_disk_full(err):
        return "disk_full", _disk_full_message(out_dir, where, needed, _free(out_dir.parent))
    return "error", (f"Hugging Face export {out_dir.name}: writing {where} failed: "
                     f"{type(err).__name__}: {err}")


def _raise_on_every_rank(outcomes: list, out_dir: Path, tmp: Path) -> None:
    """Collective: every rank raises the first failure of any rank (a full disk first); the
    partial export is gone by then."""
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return
    kind, message = next((o for o in failed if o[0] == "disk_full"), failed[0])
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    if kind == "disk_full":
        raise ExportDiskFull(message, tmp)
    raise ExportError(message)


def _complete(model: ModelConfig, out_dir: Path, tmp: Path, parts: list,
              tokenizer_dir: Optional[str | Path]) -> None:
    """Rank 0: name the shards, write the index, config.json and the tokenizer files into
    ``tmp``, then put it in place of ``out_dir`` (an earlier export goes once the new one is)."""
    weight_map, total = {}, 0
    for i, (_, part, sizes) in enumerate(parts):
        shard = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (tmp / part).replace(tmp / shard)
        for name, nbytes in sizes.items():
            weight_map[name] = shard
            total += nbytes
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        indent=1))
    dtype = "bfloat16" if model.params_dtype == "bfloat16" else "float32"
    (tmp / "config.json").write_text(json.dumps(hf_config_dict(model, dtype=dtype), indent=1))
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, tmp)
    old = out_dir.with_name(out_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def export_hf_dir(gpt, model: ModelConfig, pg_collection, out_dir: str | Path, *,
                  tokenizer_dir: Optional[str | Path] = None,
                  bucket_bytes: int = 512 << 20) -> Optional[Path]:
    """Collective: write a transformers-loadable directory (safetensors shards + index +
    config.json [+ tokenizer files]); each source rank writes its own shards, into
    ``<out_dir>.tmp``, renamed to ``out_dir`` when complete. Returns the directory on rank 0
    (None elsewhere). Raises :class:`ExportDiskFull` or :class:`ExportError` on every rank
    alike; ``out_dir`` is then as it was."""
    from megatron_gspo.hf.gather import HFGather

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    rank = dist.get_rank()
    stream = HFGather(model, bucket_bytes=bucket_bytes).buckets(gpt, pg_collection)
    needed = stream.total_bytes
    on_rank0(_prepare, out_dir, tmp, needed, group=None)  # its error on every rank; a barrier
    written: list[tuple[int, str, dict[str, int]]] = []  # (bucket index, file, {name: bytes})
    error = None
    for bucket in stream:  # to the end on every rank, failed or not: it drives the collectives
        if bucket.flat is None or error is not None:  # another rank's bucket, or this rank failed
            continue
        tensors = {n: t.cpu().contiguous() for n, t in bucket.named_tensors()}
        part = f"part-{bucket.index:05d}-rank{rank:05d}.safetensors"
        try:
            save_file(tensors, str(tmp / part), metadata={"format": "pt", "rank": str(rank)})
        except Exception as err:  # noqa: BLE001 - raised on every rank below, with the path
            error = _write_error(err, out_dir, tmp / part, needed)
            continue
        written.append((bucket.index, part,
                        {n: t.numel() * t.element_size() for n, t in tensors.items()}))
    everyone = all_gather((written, error), None)
    _raise_on_every_rank([e for _, e in everyone], out_dir, tmp)
    if rank == 0:
        parts = sorted((w for ws, _ in everyone for w in ws), key=lambda w: w[0])  # bucket order
        try:
            _complete(model, out_dir, tmp, parts, tokenizer_dir)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = _write_error(err, out_dir, tmp, needed)
    _raise_on_every_rank(all_gather(error if rank == 0 else None, None), out_dir, tmp)
    return out_dir if rank == 0 else None
