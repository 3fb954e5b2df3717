"""SGLang 0.5.23's and sglang-router's own command-line parsers, for checking the command lines
``launch slurm`` renders (tests/slurm/test_sglang_cli.py).

Run as a script in a process of its own: ``python tests/slurm/sglang_cli.py WHEEL``. It reads one
JSON request a line on stdin, ``{"program": "sglang.launch_server" | "sglang_router.launch_router",
"argv": [...]}``, and answers one JSON line: ``{"error": null, "values": {dest: value}}`` (the
parsed values of the flags given) when the program's parser takes the command line, else
``{"error": "<what is wrong>"}``.

``sglang.launch_server``'s parser is SGLang's: ``ServerArgs.add_cli_args`` (the one
``prepare_server_args`` builds), imported from the wheel itself (zipimport; the wheel is read,
never installed or unpacked) without running ``sglang/__init__.py`` (the public API: it pulls in
the model runtime). Its CUDA code is never imported: argument registration needs only
``sglang.srt.server_args``, ``sglang.srt.arg_groups`` and what those import at module level. The
third-party modules of that import chain that are not installed here are stubs
(``STUBBED_MODULES``: every attribute is a placeholder class; no argument definition reads them).
A command line is refused when argparse refuses it (unknown flag, ambiguous abbreviation, bad
value), and also when a flag is not spelled exactly as SGLang registers it (an unambiguous
abbreviation, or an alias) or is one of its deprecated spellings.

``sglang_router.launch_router``'s parser is the installed sglang-router's
(``RouterArgs.add_cli_args(parser, use_router_prefix=False)``, what its ``parse_router_args``
does), checked the same way; without sglang-router the answer is ``{"skip": "..."}``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types

STUBBED_MODULES = ("pybase64", "requests", "triton", "zmq")
"""Imported at module level by ``sglang.srt.server_args``'s import chain, not installed here
(a fast base64, HTTP client, GPU kernel compiler, ZeroMQ)."""


class CommandLineError(Exception):
    pass


class StrictParser(argparse.ArgumentParser):
    """argparse as the programs use it (abbreviations allowed: that is how a stale flag becomes
    "ambiguous"), with errors raised instead of exiting."""

    def error(self, message):
        raise CommandLineError(message)

    def exit(self, status=0, message=None):
        raise CommandLineError(message or f"exited with status {status}")


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _Stub(Exception, metaclass=_StubMeta):
    """A placeholder: callable, subclassable, usable in ``except`` clauses."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: only what no real finder has, and only ``STUBBED_MODULES``."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def server_parser(wheel: str) -> argparse.ArgumentParser:
    sys.meta_path.append(_StubFinder())
    package = types.ModuleType("sglang")  # the package without its __init__ (the public API)
    package.__path__ = [f"{wheel}/sglang"]
    sys.modules["sglang"] = package
    from sglang.srt.server_args import ServerArgs

    parser = StrictParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    parser.from_cli_args = ServerArgs.from_cli_args
    return parser


def router_parser() -> argparse.ArgumentParser:
    from sglang_router.router_args import RouterArgs

    parser = StrictParser(prog="sglang_router.launch_router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    parser.from_cli_args = lambda ns: RouterArgs.from_cli_args(ns, use_router_prefix=False)
    return parser


def check(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """Raise CommandLineError unless ``parser`` takes ``argv`` with every flag spelled as
    registered and none deprecated; the parsed values of the flags given, by destination."""
    namespace = parser.parse_args(argv)
    registered = parser._option_string_actions
    for word in argv:
        if not word.startswith("--"):
            continue
        flag = word.split("=", 1)[0]
        action = registered.get(flag)
        if action is None:
            candidates = sorted(o for o in registered if o.startswith(flag))
            raise CommandLineError(f"{flag}: not one of the program's flags (argparse took it as "
                                   f"an abbreviation of {candidates})")
        if action.option_strings[0] != flag:
            raise CommandLineError(f"{flag}: an alias; the program's name is "
                                   f"{action.option_strings[0]}")
        deprecated = (type(action).__name__.startswith("Deprecated")
                      or (action.help or "").lstrip("(").lower().startswith("deprecated"))
        if deprecated:
            raise CommandLineError(f"{flag}: deprecated: {action.help}")
    parser.from_cli_args(namespace)  # the program's own record of the parsed arguments
    given = {registered[w.split("=", 1)[0]].dest for w in argv if w.startswith("--")}
    return {dest: getattr(namespace, dest) for dest in sorted(given)}


def main() -> int:
    wheel = sys.argv[1]
    parsers: dict[str, object] = {}
    for line in sys.stdin:
        request = json.loads(line)
        program = request["program"]
        try:
            if program not in parsers:
                try:
                    parsers[program] = (server_parser(wheel) if program == "sglang.launch_server"
                                        else router_parser())
                except ImportError as exc:
                    if program == "sglang.launch_server":
                        raise
                    parsers[program] = f"sglang-router is not importable: {exc}"
            parser = parsers[program]
            if isinstance(parser, str):
                answer = {"skip": parser}
            else:
                answer = {"error": None, "values": check(parser, request["argv"])}
        except CommandLineError as exc:
            answer = {"error": str(exc)}
        print(json.dumps(answer, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
