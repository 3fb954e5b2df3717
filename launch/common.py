"""Arguments every sub-command that reads a run configuration shares: --config and --set."""

from __future__ import annotations

import argparse

from megatron_gspo.config import Config, load_config


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, metavar="FILE.yaml",
                        help="run configuration (sections: model, parallel, gspo, rollout, optim, "
                             "run, data, reward, parity)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="override one value, parsed as YAML (repeatable), "
                             "e.g. --set gspo.eps_high=5e-4")


def load_from_args(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)
