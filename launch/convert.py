"""``megatron-gspo convert``: Hugging Face <-> Megatron checkpoints for Qwen3-MoE.

    megatron-gspo convert hf-to-mcore --hf Qwen3-30B-A3B/ --out ckpt/qwen3-30b-mcore --tp 4 --ep 8
    megatron-gspo convert mcore-to-hf --mcore ckpt/qwen3-30b-mcore --out export/qwen3-30b
    megatron-gspo convert hf-to-fp8 --hf Qwen3-30B-A3B/ --out Qwen3-30B-A3B-fp8   # FP8 rollouts

(or ``python -m launch.convert hf-to-mcore ...``). One process, no GPU, memory bounded by one
layer-sized chunk (not by the model); a progress bar on stderr.

hf-to-mcore writes a Megatron torch_dist checkpoint that the trainer loads under ANY later
TP / PP / EP layout (``megatron_gspo.hf.mcore_checkpoint.load_model``); --tp/--pp/--ep/--etp are
checked against the model (they must divide heads, KV groups, layers, experts) and --tp sets the
vocabulary padding. OUT is laid out as Megatron-LM and Megatron-Bridge keep checkpoints
(``megatron_gspo.hf.megatron_layout``): ``OUT/latest_checkpointed_iteration.txt`` and
``OUT/iter_0000000/`` with the common state Megatron-LM reads, Bridge's ``run_config.yaml`` and
config.json and the tokenizer files in ``hf_config/``; Megatron-LM loads it with
``--pretrained-checkpoint OUT`` (or ``--load OUT --finetune``), Bridge with
``AutoBridge.load_megatron_model(OUT)`` / ``export_ckpt``.

mcore-to-hf reads such a checkpoint, one the trainer saved (any layout), or a Megatron-LM /
Bridge checkpoint (the root or an ``iter_*`` directory; --hf-config where it records no local
Hugging Face config), and writes
safetensors shards, model.safetensors.index.json, config.json and the tokenizer files, which
``transformers.AutoModelForCausalLM.from_pretrained`` loads. The vocabulary padding is removed.

hf-to-fp8 writes the FP8 checkpoint SGLang servers start from with ``rollout.quantization: fp8``
(``megatron_gspo.hf.convert_fp8``).

Exit status: 0 on success, 2 with a message naming the file or field on bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatron_gspo.config import ConfigError

DTYPE_HELP = ("auto keeps each tensor's dtype (bit-identical round trip); bfloat16 | float32 | "
              "float16 cast (default: auto)")


def _add_direction_parsers(subparsers) -> None:
    h = subparsers.add_parser(
        "hf-to-mcore", help="Hugging Face safetensors -> Megatron torch_dist checkpoint",
        description="Convert a Hugging Face Qwen3-MoE directory (config.json + safetensors) to a "
                    "Megatron torch_dist checkpoint that loads under any parallel layout.")
    h.add_argument("--hf", required=True, metavar="DIR",
                   help="Hugging Face model directory (config.json, model.safetensors or shards "
                        "with model.safetensors.index.json, tokenizer files)")
    h.add_argument("--out", required=True, metavar="DIR", help="output checkpoint directory")
    h.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel size the checkpoint is meant for: checked against heads "
                        "and KV groups, sets the vocabulary padding (default 1)")
    h.add_argument("--pp", type=int, default=1, metavar="N",
                   help="pipeline parallel size: checked against the layers (default 1)")
    h.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert parallel size: checked against the experts (default 1)")
    h.add_argument("--etp", type=int, default=None, metavar="N",
                   help="expert tensor parallel size: checked against moe_intermediate_size "
                        "(default: --tp, as in Megatron)")
    h.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    h.add_argument("--threads", type=_threads, default=None, metavar="N|auto",
                   help="writer threads (N data files; N chunks in memory at once; default auto: "
                        "one per 5 GiB of checkpoint, at most 8 or the CPU count)")
    _add_common(h)
    h.set_defaults(convert_func=_hf_to_mcore)

    m = subparsers.add_parser(
        "mcore-to-hf", help="Megatron torch_dist checkpoint -> Hugging Face safetensors",
        description="Convert a Megatron torch_dist checkpoint (from hf-to-mcore, or saved by the "
                    "trainer under any layout) to a Hugging Face directory that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads.")
    m.add_argument("--mcore", required=True, metavar="DIR",
                   help="Megatron checkpoint: a Megatron-LM / Bridge root (its "
                        "latest_checkpointed_iteration.txt names the iteration), an iter_* "
                        "directory, or a flat torch_dist directory (metadata.json, .metadata)")
    m.add_argument("--out", required=True, metavar="DIR", help="output Hugging Face directory")
    m.add_argument("--hf-config", default=None, metavar="PATH",
                   help="config.json or the directory holding it (default: the checkpoint's hf_config/ or the "
                        "local hf_model_id of Bridge's run_config.yaml, "
                        "written by hf-to-mcore)")
    m.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="directory with the tokenizer files to copy (default: the config's "
                        "directory)")
    m.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    m.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors shard, e.g. 5GB or 2GiB (default 5GB)")
    _add_common(m)
    m.set_defaults(convert_func=_mcore_to_hf)

    f = subparsers.add_parser(
        "hf-to-fp8", help="Hugging Face bf16 -> FP8 checkpoint for rollout.quantization: fp8",
        description="Rewrite a Hugging Face Qwen3-MoE directory with its attention and expert "
                    "projections as block-wise FP8 (e4m3, one float32 scale per 128 x 128 block, "
                    "<name>_scale_inv) and quantization_config in config.json: what SGLang "
                    "servers start from with rollout.quantization: fp8 (launch slurm "
                    "--model-path), the layout the weight sync sends.")
    f.add_argument("--hf", required=True, metavar="DIR", help="the bf16 Hugging Face directory")
    f.add_argument("--out", required=True, metavar="DIR", help="output FP8 directory")
    f.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest safetensors shard, e.g. 5GB or 2GiB (default 5GB)")
    _add_common(f)
    f.set_defaults(convert_func=_hf_to_fp8)


def _threads(text: str):
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--threads: 'auto' or an integer >= 1, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace the output directory if it holds a previous conversion")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-fsync", action="store_true",
                   help="do not fsync the written files (faster; not crash-safe)")


def _hf_to_mcore(args: argparse.Namespace):
    from megatron_gspo.hf.convert import hf_to_mcore

    return hf_to_mcore(args.hf, args.out, tensor=args.tp, pipeline=args.pp, expert=args.ep,
                       expert_tensor=args.etp, dtype=args.dtype, progress=not args.no_progress,
                       overwrite=args.overwrite, thread_count=args.threads,
                       sync_files=not args.no_fsync)


def _mcore_to_hf(args: argparse.Namespace):
    from megatron_gspo.hf.convert import mcore_to_hf

    return mcore_to_hf(args.mcore, args.out, hf_config=args.hf_config, tokenizer=args.tokenizer,
                       dtype=args.dtype, max_shard_size=args.max_shard_size,
                       progress=not args.no_progress, overwrite=args.overwrite,
                       sync_files=not args.no_fsync)


def _hf_to_fp8(args: argparse.Namespace):
    from megatron_gspo.hf.convert_fp8 import hf_to_fp8

    return hf_to_fp8(args.hf, args.out, max_shard_size=args.max_shard_size,
                     progress=not args.no_progress, overwrite=args.overwrite,
                     sync_files=not args.no_fsync)


def add_parser(subparsers) -> None:
    """Register ``convert hf-to-mcore``, ``mcore-to-hf`` and ``hf-to-fp8`` on the main CLI."""
    p = subparsers.add_parser(
        "convert", help="Hugging Face <-> Megatron checkpoint conversion (Qwen3-MoE)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    directions = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    _add_direction_parsers(directions)
    p.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Optional[list[str]] = None) -> int:
    """Run the parsed conversion; bad input prints one message and returns 2."""
    from megatron_gspo.hf.safetensors_io import CheckpointError

    try:
        result = args.convert_func(args)
    except (ConfigError, CheckpointError) as err:
        print(f"megatron-gspo convert {args.direction}: error: {err}", file=sys.stderr)
        return 2
    what = "chunks" if args.direction == "hf-to-mcore" else "tensors"
    print(f"wrote {result.out_dir} ({result.num_tensors} {what}, "
          f"{result.bytes_written / 2**30:.2f} GiB) in {result.seconds:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launch.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    _add_direction_parsers(directions)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
