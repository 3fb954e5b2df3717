"""vLLM 0.32's own command-line parser, for checking the command lines the project renders for
its vLLM servers (``pipeline.engines.vllm.server_args``; tests/engines/test_vllm_server_args.py,
tests/slurm/test_vllm_cli.py).

Run as a script by the vLLM environment's interpreter (launch/envs/vllm_cpu.sh), in a process of
its own: ``.venv-vllm/bin/python tests/engines/vllm_cli.py``. It reads one JSON request a line on
stdin, ``{"argv": [...]}`` (the words after ``python -m vllm.entrypoints.launchers.api_server.entry``),
and answers one JSON line: ``{"error": null, "values": {dest: value}}`` (the parsed values of the
flags given) when vLLM takes the command line, else ``{"error": "<what is wrong>"}``. A request
``{"defaults": [dest, ...]}`` answers ``{"error": null, "values": {dest: value}}`` with the values
vLLM's engine arguments take when no flag is given (``AsyncEngineArgs`` of an empty command line).

The parser is the one that module's ``main`` builds: ``make_arg_parser(FlexibleArgumentParser())``
(``vllm.entrypoints.launchers.cli_args``), followed by its ``validate_parsed_serve_args`` and
``AsyncEngineArgs.from_cli_args`` (the engine's own record of the arguments). A command line is
refused when argparse refuses it (unknown flag, bad value, bad JSON), when vLLM's checks do, and
also when a flag is not spelled exactly as vLLM registers it first (an abbreviation or an alias
such as ``-tp``) or is one vLLM marks deprecated.
"""

from __future__ import annotations

import json
import sys

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser


class CommandLineError(Exception):
    pass


class StrictParser(FlexibleArgumentParser):
    """vLLM's parser with its errors raised instead of exiting the process."""

    def error(self, message):
        raise CommandLineError(message)

    def exit(self, status=0, message=None):
        raise CommandLineError(message or f"exited with status {status}")


def build() -> StrictParser:
    return make_arg_parser(StrictParser(prog="vllm.entrypoints.launchers.api_server.entry"))


def check(parser: StrictParser, argv: list[str]) -> dict:
    """Raise CommandLineError unless vLLM takes ``argv`` with every flag spelled as registered
    and none deprecated; the parsed values of the flags given, by destination."""
    namespace = parser.parse_args(argv)
    registered = parser._option_string_actions
    for word in argv:
        if not word.startswith("-") or word.lstrip("-")[:1].isdigit():
            continue
        flag = word.split("=", 1)[0]
        action = registered.get(flag)
        if action is None:
            raise CommandLineError(f"{flag}: not one of vLLM's flags as spelled (argparse took it "
                                   "as an abbreviation)")
        first = action.option_strings[0]
        if flag != first and not flag.startswith("--no-"):
            raise CommandLineError(f"{flag}: an alias; vLLM's name is {first}")
        if action in parser._deprecated:
            raise CommandLineError(f"{flag}: deprecated in vLLM")
    try:
        validate_parsed_serve_args(namespace)
        AsyncEngineArgs.from_cli_args(namespace)
    except (TypeError, ValueError) as exc:
        raise CommandLineError(f"vLLM refuses the arguments: {exc}") from None
    given = {registered[w.split("=", 1)[0]].dest for w in argv
             if w.startswith("--") and w.split("=", 1)[0] in registered}
    return {dest: getattr(namespace, dest) for dest in sorted(given)}


def main() -> int:
    parser = build()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if "defaults" in request:
                engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args([]))
                values = {dest: getattr(engine_args, dest) for dest in request["defaults"]}
            else:
                values = check(parser, request["argv"])
            answer = {"error": None, "values": values}
        except (CommandLineError, AttributeError) as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
