"""``megatron-gspo serve``: a rollout server that speaks SGLang's HTTP protocol, on the CPU.

For machines where SGLang cannot run (no GPU). It serves a Hugging Face Qwen3-MoE directory with
transformers (fp32, KV cache, batched decoding) and answers SGLang's native endpoints, so the
client, the sglang-router and the weight sync run unchanged::

    megatron-gspo serve --model-path DIR --port 30001 [--host 127.0.0.1] [--random-seed 0]
    python -m sglang_router.launch_router --host 127.0.0.1 --port 30000 \\
        --worker-urls http://127.0.0.1:30001

The flags are SGLang's launch-flag names where one exists (``--model-path``, ``--host``,
``--port``, ``--random-seed``, ``--skip-tokenizer-init``, ``--weight-version``,
``--context-length``, ``--max-running-requests``, ``--max-prefill-tokens``, ``--dtype``,
``--log-level``, ``--tp-size``, ``--max-queued-requests``, ``--enable-return-routed-experts``,
``--dp-size``, ``--attn-dp-size``, ``--enable-dp-attention``, ``--enable-metrics``,
``--disable-radix-cache``; the layout
flags are reported in ``/server_info`` and enforced as SGLang enforces them, while the server
computes as one replica); ``--no-extensions`` turns this server's protocol extensions off;
``--cpu-threads``, ``--weight-update-timeout``, ``--allow-pickled-tensors``, ``--max-n``,
``--weight-roots``, ``--max-request-mb``, ``--max-weight-update-mb``, ``--max-json-depth`` and
``--radix-cache-max-tokens`` are
this server's own, and so are ``--fault-perturb-weights`` (fault injection for the parity
watchdog's tests only: docs/parity.md) and ``--fault-update-delay-s`` (slow weight updates, for
the tests of a long weight-sync pause only).
Health checks read SGLang's environment variables as SGLang does:
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` (default true: ``/health`` generates one token,
which waits while generation is paused; false: ``/health`` answers 200 at once) and
``SGLANG_HEALTH_CHECK_TIMEOUT`` (default 20: seconds before a generating check answers 503).
A bad argument is one line naming the flag, exit status 2, before the model is loaded.
Stop it with SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import sys

# The server is pipeline.local's, a program of its own (``python -m pipeline.local``, the same
# flags); this command runs it inside the project's CLI (one-line errors, benign warnings).
from pipeline.local.__main__ import run
from pipeline.local.args import add_arguments


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="local CPU rollout server with SGLang's HTTP API (no GPU needed)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)

    def one_line_error(message: str):  # argparse's own errors (a missing flag, not a number)
        print(f"megatron-gspo serve: {message} (see megatron-gspo serve --help)", file=sys.stderr)
        sys.exit(2)
    p.error = one_line_error
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    return run(args, "megatron-gspo serve")
