"""``megatron-gspo config``: validate a run configuration and print it with its derived layout.

    megatron-gspo config --config launch/configs/qwen3_30b_a3b.yaml --world-size 64

Exits with status 2 and a message naming the field when the configuration is invalid: the same
checks, with the same messages, as ``sft``, ``train`` and ``launch slurm`` (they all load the file
through ``megatron_gspo.config.load_config``), and then what needs the world (``--world-size``, or
the smallest one ``sft`` / ``train`` would start): the parallel factors and the data-parallel
split of a mini-batch; and what ``launch.preflight`` checks for a GSPO run (the data files and
their lengths, the reward function, ``run.init_from``). An external router that does not answer,
and input paths that do not exist on this machine (a recipe's placeholders), are ``# note:``
lines, not errors (``train`` and ``launch slurm`` refuse them; a ``launch slurm`` job starts its
own router).
"""

from __future__ import annotations

import argparse

from launch.common import add_config_args, load_from_args
from megatron_gspo.config import ConfigError, dump_config, padded_vocab_size, validate_data_parallel


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "config", help="validate a configuration and print it resolved",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--world-size", type=int, default=None,
                   help="also derive the data-parallel sizes for this many training ranks")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from launch import preflight
    from megatron_gspo.parallel import derive_layout, minimal_world_size

    cfg = load_from_args(args)
    world = args.world_size or minimal_world_size(cfg.parallel)
    # without --world-size: the world sft / train start; nothing printed before the verdict
    notes: list[str] = []
    preflight.check(cfg, program="config", world_size=world, notes=notes)
    layout = derive_layout(cfg.parallel, world)
    validate_data_parallel(cfg, layout.data)
    print(dump_config(cfg), end="")
    for note in notes:
        print(f"# note: {note}")
    if cfg.rollout.mode == "external":  # train refuses an unreachable router; here a note
        try:
            preflight.check_router(cfg.rollout.router_url)
        except ConfigError as err:
            print(f"# note: {err} (train needs it; launch slurm starts its own)")
    print(f"# layout: {layout.describe()}")
    print(f"# padded vocabulary: {padded_vocab_size(cfg.model, cfg.parallel.tensor)}")
    return 0
