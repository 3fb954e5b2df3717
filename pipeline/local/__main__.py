"""The local rollout server's own entry point: SGLang's HTTP API on the CPU (no GPU needed)::

    python -m pipeline.local --model-path DIR [--host 127.0.0.1] [--port 30000] [--random-seed 0]

The flags are those of ``megatron-gspo serve`` (:mod:`pipeline.local.args`; ``megatron-gspo serve
--help`` describes them), and so are the rules: a bad argument is one line naming the flag, exit
status 2, before the model is loaded; so is a model directory that cannot be served as it is (a
truncated safetensors file, weights that do not match config.json:
:mod:`pipeline.local.model_files`), naming the file, the tensor and the shapes; SIGINT or SIGTERM
stop it. ``pipeline/servers/cluster.py``
starts its servers this way.

The third-party warnings that are benign here are silenced first, before the server's modules
import torch, transformers and uvicorn, as ``launch.cli`` does for every command
(:mod:`pipeline.observe.benign_warnings`, THE registry of them; ``MEGATRON_GSPO_SHOW_WARNINGS=1``
shows all).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from megatron_gspo.errors import is_input_error
from pipeline.local.args import ServeArgError, add_arguments, validate
from pipeline.observe import benign_warnings

PROG = "python -m pipeline.local"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)

    def one_line_error(message: str):  # argparse's own errors (a missing flag, not a number)
        print(f"{PROG}: {message} (see {PROG} --help)", file=sys.stderr)
        sys.exit(2)
    parser.error = one_line_error
    return parser.parse_args(argv)


def run(args: argparse.Namespace, prog: str) -> int:
    """Serve with parsed ``args`` until stopped; a bad value is one line naming the flag, prefixed
    by ``prog``, and exit status 2 (``megatron-gspo serve`` runs the server this way too)."""
    try:
        validate(args)
    except ServeArgError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    # imported after the warning filters are in place (and after a bad argument was refused
    # without loading torch): the server's modules import torch, transformers and fastapi
    from pipeline.local.server import serve

    try:
        return serve(args)
    except Exception as err:
        if not is_input_error(err):  # a crash: its traceback
            raise
        print(f"{prog}: {err}", file=sys.stderr)  # bad input (the model files): one line
        return 2


def main(argv: Optional[list[str]] = None) -> int:
    benign_warnings.apply()
    return run(parse_args(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())
