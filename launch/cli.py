"""``megatron-gspo``: the single command-line entry point.

    megatron-gspo demo                                            SFT then GSPO of a tiny MoE, plots
    megatron-gspo train   --config FILE.yaml [--set a.b=v ...] [--resume]
                                                                  GSPO on Megatron + rollout servers
    megatron-gspo sft     --config FILE.yaml [--set a.b=v ...]   cold-start SFT on Megatron
    megatron-gspo config  --config FILE.yaml [--set ...] [--world-size N]
                                                                  validate and print a configuration
    megatron-gspo plot    RUN_DIR [--out DIR]                     PNG charts of RUN_DIR/metrics.jsonl
    megatron-gspo serve   --model-path DIR [--host H] [--port P]  CPU rollout server, SGLang's API
    megatron-gspo launch slurm --config FILE.yaml --nodes N --rollout-nodes M [--gpus-per-node G ...]
                                                                  one Slurm job: servers + training
    megatron-gspo <command> --help                                what each command does
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatron_gspo.config import ConfigError

# Sub-command modules; each has add_parser(subparsers) and sets ``func(args, argv) -> int``.
COMMANDS = ["launch.demo", "launch.train", "launch.sft", "launch.show_config", "launch.plot", "launch.serve", "launch.slurm"]
OPTIONAL_COMMANDS = ["launch.convert"]


# Errors about the user's input (files, rows, rewards, checkpoints): reported in one line.
_INPUT_ERRORS = {"DataError", "RewardError", "CheckpointError", "HFConfigError", "WeightSyncError"}


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="megatron-gspo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    for name in OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, argv) or 0)
    except ConfigError as err:
        print(f"megatron-gspo {args.command}: configuration error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__name__ in _INPUT_ERRORS:  # bad input: the message names the file / field
            print(f"megatron-gspo {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
