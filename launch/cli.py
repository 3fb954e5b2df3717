"""``megatron-gspo``: the single command-line entry point.

    megatron-gspo demo                                            SFT then GSPO of a tiny MoE, plots
    megatron-gspo train   --config FILE.yaml [--set a.b=v ...] [--resume]
                                                                  GSPO on Megatron + rollout servers
    megatron-gspo sft     --config FILE.yaml [--set a.b=v ...]   cold-start SFT on Megatron
    megatron-gspo config  --config FILE.yaml [--set ...] [--world-size N]
                                                                  validate and print a configuration
    megatron-gspo plan    --config FILE.yaml --world-size N --gpu-memory-gib M
                                                                  predicted peak GPU memory per stage
    megatron-gspo calibrate-eps --config FILE.yaml [--target-clip-frac 0.1]
                                                                  the GSPO clip range for a target clip fraction
    megatron-gspo plot    RUN_DIR [--out DIR]                     PNG charts of RUN_DIR/metrics.jsonl
    megatron-gspo serve   --model-path DIR [--host H] [--port P]  CPU rollout server, SGLang's API
    megatron-gspo launch slurm --config FILE.yaml --nodes N --rollout-nodes M [--gpus-per-node G ...]
                                                                  one Slurm job: servers + training
    megatron-gspo <command> --help                                what each command does

Exit status: 0 done; 2 an input error (configuration, data, reward, checkpoint, a run directory in
use), printed as one line; 75 stopped by SIGTERM / SIGINT / SIGUSR1 after saving a checkpoint
(``--resume`` continues); 1 anything else: a failure the run explains (a non-finite loss or
gradient) as one line, a crash with its traceback. With local ranks the launcher prints the one
message (``launch/supervise.py``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Optional

from launch import local, rank_status
from megatron_gspo.config import ConfigError
from megatron_gspo.errors import is_explained, is_input_error, one_line
from megatron_gspo.lifetime import die_with_parent
from pipeline.observe import benign_warnings

# Sub-command modules; each has add_parser(subparsers) and sets ``func(args, argv) -> int``.
COMMANDS = ["launch.demo", "launch.train", "launch.sft", "launch.show_config", "launch.plot", "launch.serve", "launch.slurm",
            "launch.plan", "launch.calibrate_eps"]
OPTIONAL_COMMANDS = ["launch.convert"]
COMMAND_MODULES = {"demo": "launch.demo", "train": "launch.train", "sft": "launch.sft",
                   "config": "launch.show_config", "plot": "launch.plot", "serve": "launch.serve",
                   "launch": "launch.slurm", "plan": "launch.plan",
                   "calibrate-eps": "launch.calibrate_eps", "convert": "launch.convert"}
"""The module of each sub-command name (``tests/unit`` checks it against the full parser)."""


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser with every sub-command, or with ``command``'s alone when it names one (a
    sub-command module imports what it runs at its top: Megatron for ``train``, nothing heavy for
    ``config``; so a command imports only its own)."""
    parser = argparse.ArgumentParser(
        prog="megatron-gspo", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = COMMAND_MODULES.get(command)
    for name in [chosen] if chosen else COMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    for name in [] if chosen else OPTIONAL_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    # Before anything else: in ranks 1.. of a local run the output goes to RUN_DIR/logs/rank<N>.log
    # (launch/local.py), and the benign third-party warnings are silenced before any sub-command
    # module imports Megatron (pipeline/observe/benign_warnings.py; MEGATRON_GSPO_SHOW_WARNINGS=1 shows all).
    console = local.redirect_rank_output()
    benign_warnings.apply()
    supervised = rank_status.supervised()  # a rank whose launcher reports its outcome
    if supervised:
        die_with_parent(signal.SIGTERM)  # torchrun gone: checkpoint and stop, as on a signal
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # a rank started by launch.local.ensure_ranks (torchrun -m launch.cli -- ...)
        argv = argv[1:]
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    command = " ".join(filter(None, (args.command, getattr(args, "launcher", None))))
    try:
        code = int(args.func(args, argv) or 0)
        if code != 0 and console is not None and not supervised:
            console.error(f"megatron-gspo {command} exited with status {code}")
        rank_status.report(code)
        return code
    except ConfigError as err:
        _report(console, command, f"configuration error: {err}")
        return 2
    except Exception as err:
        if is_input_error(err):  # bad input, by its type: the message names the file / field
            _report(console, command, one_line(err))  # "step N: <phase>: <Type>: <message>"
            return 2
        if is_explained(err):  # e.g. a non-finite loss: the one line says it all, no traceback
            _report(console, command, one_line(err), code=1, log_traceback=err)
            return 1
        if supervised:  # the traceback to the rank's log; the launcher shows the first one
            return _failed_under_launcher(console, err)
        if console is not None:
            console.failure(err)
        raise
    except SystemExit as err:
        if console is not None and err.code not in (None, 0):
            console.error(f"megatron-gspo {command} exited: {err.code}")
        raise


def _report(console: Optional[local.RankConsole], command: str, error: str, *, code: int = 2,
            log_traceback: Optional[BaseException] = None) -> None:
    """An input error's (or an explained failure's, ``code`` 1) one line: on stderr (and on the
    console for ranks 1..), or, in a rank under ``launch.supervise``, in its log and to the
    launcher, which prints it once. ``log_traceback``: its traceback goes to the rank's log only
    (ranks 1..: stderr is the log; rank 0 and unsupervised ranks: not shown)."""
    line = f"megatron-gspo {command}: {error}"
    if console is not None and log_traceback is not None:  # ranks 1..: stderr is the rank's log
        print("".join(traceback.format_exception(log_traceback)), file=sys.stderr, end="")
    if rank_status.supervised():
        if console is not None:
            print(line, file=sys.stderr)
        rank_status.report(code, error=error, log=str(console.log_path) if console else None)
        return
    print(line, file=sys.stderr)
    if console is not None:
        console.error(line)


def _failed_under_launcher(console: Optional[local.RankConsole], err: BaseException) -> int:
    """A crash in a rank under ``launch.supervise``: the traceback to the rank's log (rank 0's
    console belongs to the run's progress: ``rank0.log`` beside the others), the first line and
    the traceback to the launcher; exit status 1."""
    text = "".join(traceback.format_exception(err))
    if console is not None:
        print(text, file=sys.stderr, end="")
        log = console.log_path
    else:
        log = Path(os.environ.get(local.RANK_LOG_DIR_ENV, ".")) / "rank0.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "a") as f:
                f.write(text)
        except OSError:
            print(text, file=sys.stderr, end="")
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    rank_status.report(1, error=f"{type(err).__name__}: {first}", traceback=text, log=str(log))
    return 1


if __name__ == "__main__":
    sys.exit(main())
