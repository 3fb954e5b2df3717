"""The local rollout server's command-line flags: SGLang's launch-flag names where one exists.

:func:`add_arguments` declares them (``python -m pipeline.local`` and ``megatron-gspo serve``,
``launch/serve.py``, share them), :func:`validate` checks every one before anything is loaded
(:class:`ServeArgError` naming the flag), :func:`resolve_dp_layout` resolves the data-parallel
layout as SGLang 0.5.23 does. The flags themselves are described in ``launch/serve.py``'s
docstring (``megatron-gspo serve --help``).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
from pathlib import Path

from pipeline.local import health_env

DEFAULT_MAX_N = 1024  # --max-n
DEFAULT_MAX_QUEUED = 4096  # --max-queued-requests (SGLang's default: unbounded)
DEFAULT_MAX_REQUEST_MB = 32  # --max-request-mb (SGLang: unbounded)
DEFAULT_MAX_WEIGHT_UPDATE_MB = 4096  # --max-weight-update-mb (SGLang: unbounded)
DEFAULT_MAX_JSON_DEPTH = 64  # --max-json-depth (SGLang: Python's recursion limit, ~1000)


class ServeArgError(ValueError):
    """A bad argument of the local rollout server; the message starts with the flag."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", "--model", dest="model_path", required=True,
                   help="Hugging Face Qwen3-MoE directory (config.json + safetensors; tokenizer "
                        "files optional)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-seed", type=int, default=None,
                   help="seed of the sampling noise of requests without sampling_seed")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="do not load a tokenizer: input_ids only, responses without 'text'")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--context-length", type=int, default=None,
                   help="default: max_position_embeddings of config.json")
    p.add_argument("--max-running-requests", type=int, default=64,
                   help="requests decoded together in one batch")
    p.add_argument("--max-prefill-tokens", type=int, default=16384,
                   help="padded prompt tokens per prefill batch")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="FP8 weights (SGLang's flag; rollout.quantization: fp8): the attention "
                        "and expert projections are rounded to e4m3 blocks of 128 x 128 with a "
                        "float32 scale each at the start, and updates send them so (with their "
                        "<name>_scale_inv); the model computes with their dequantized values. An "
                        "imitation of the weights SGLang's FP8 kernels use, not of its FP8 "
                        "activations (this server has no FP8 kernels)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda[:N]: where the model, its KV cache and its forward "
                        "passes run (SGLang's --device); sampling and answers stay on the host")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads (this server's own flag; default 1)")
    p.add_argument("--weight-update-timeout", type=float, default=300.0,
                   help="seconds init_weights_update_group / a broadcast may wait for the trainer")
    p.add_argument("--tp-size", type=int, default=1,
                   help="act as a server of this many TP ranks in weight updates: rank 0 plus "
                        "tp_size - 1 processes that join the update groups at rank_offset + "
                        "tp_rank and deserialise their own tensor entries (generation runs on "
                        "rank 0 only)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help="largest sampling_params.n of one request (more: HTTP 400)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                   help="requests (after n expansion) that may wait for a decoding slot; a "
                        "request that does not fit gets SGLang's 503 'The request queue is "
                        "full.' (default 4096)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="record the experts every MoE layer routed each token to, returned to "
                        "requests with return_routed_experts (SGLang's flag; without it such "
                        "requests get no routed_experts, as in SGLang)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="no prefix cache (SGLang's flag): every request is prefilled from scratch "
                        "and meta_info.cached_tokens is always 0. Without it the KV (and routed "
                        "experts) of finished requests stay in a radix cache that serves the "
                        "longest cached prefix of later prompts, as SGLang's does")
    p.add_argument("--radix-cache-max-tokens", type=int, default=None, metavar="N",
                   help="tokens the prefix cache holds at most, least recently used evicted "
                        "first (this server's own flag; SGLang's cache lives in its KV pool). "
                        "Default: as many as 1 GiB of KV holds, at least --context-length, at "
                        "most --context-length x --max-running-requests")
    p.add_argument("--weight-roots", nargs="+", default=[], metavar="DIR",
                   help="directories update_weights_from_disk may load from, besides the "
                        "--model-path directory (default: none)")
    p.add_argument("--allow-pickled-tensors", action="store_true",
                   help="accept SGLang's update_weights_from_tensor payloads (pickles of "
                        "shared-memory handles; deserialising them runs code, so only with "
                        "--host 127.0.0.1). Without it the server reads base64 safetensors only")
    p.add_argument("--no-extensions", action="store_true",
                   help="offer none of this server's protocol extensions (bucket checksums, "
                        "bf16 delta pushes, timings): /server_info lists "
                        "megatron_gspo_extensions: [] and every request is answered exactly as "
                        "SGLang 0.5.23 answers it. Without the flag they are still used only by "
                        "a request that asks with the X-Megatron-Gspo-Extensions header")
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1,
                   help="REPORTED ONLY (SGLang's flag): data-parallel replicas in /server_info; "
                        "as in SGLang a server with more than one refuses tensor / distributed "
                        "updates and update groups (HTTP 500), disk updates work. This server "
                        "always computes as one replica")
    p.add_argument("--attn-dp-size", "--attention-data-parallel-size", dest="attn_dp_size",
                   type=int, default=1,
                   help="REPORTED ONLY (SGLang's flag): attention data-parallel groups (must "
                        "divide --tp-size)")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="SGLang's deprecated spelling: with --dp-size N it means --attn-dp-size "
                        "N --dp-size 1, as 0.5.23 resolves it")
    p.add_argument("--enable-metrics", action="store_true",
                   help="serve /metrics (SGLang's flag; without it /metrics is a 404, as there)")
    p.add_argument("--max-request-mb", type=float, default=DEFAULT_MAX_REQUEST_MB, metavar="MB",
                   help="largest request body in MiB (more: HTTP 413, refused from its "
                        "Content-Length before it is read, or as soon as a chunked body passes "
                        "it); default 32. Weight-update bodies have --max-weight-update-mb")
    p.add_argument("--max-weight-update-mb", type=float, default=DEFAULT_MAX_WEIGHT_UPDATE_MB,
                   metavar="MB",
                   help="largest body of update_weights_from_tensor / _distributed in MiB (a "
                        "base64 bucket is 4/3 of rollout.weight_sync.bucket_mb); default 4096")
    p.add_argument("--max-json-depth", type=int, default=DEFAULT_MAX_JSON_DEPTH, metavar="N",
                   help="deepest nesting of arrays / objects in a JSON body (deeper: HTTP 400, "
                        "checked before parsing); default 64")
    p.add_argument("--fault-perturb-weights", type=float, default=0.0, metavar="R",
                   help="FAULT INJECTION, for tests of the parity watchdog only: after every "
                        "weight update add noise of R x each weight's RMS to every weight, so the "
                        "server no longer serves the synced policy (pipeline/local/"
                        "fault_injection.py; default 0: off)")
    p.add_argument("--fault-update-delay-s", type=float, default=0.0, metavar="S",
                   help="FAULT INJECTION, for tests of a long weight-sync pause only: every "
                        "weight update holds the engine thread S seconds before it runs, as a "
                        "long disk reload holds SGLang's scheduler (pipeline/local/"
                        "fault_injection.py; default 0: off)")


def _at_least(args, flag: str, low, *, allow_none: bool = False) -> None:
    value = getattr(args, flag[2:].replace("-", "_"))
    if value is None and allow_none:
        return
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
        raise ServeArgError(f"{flag} {value}: must be >= {low}")


def validate(args: argparse.Namespace) -> None:
    """Every argument checked before anything is loaded; :class:`ServeArgError` naming the
    flag."""
    for flag in ("--tp-size", "--dp-size", "--attn-dp-size", "--max-running-requests",
                 "--max-prefill-tokens", "--cpu-threads", "--max-n", "--max-json-depth"):
        _at_least(args, flag, 1)
    _at_least(args, "--context-length", 2, allow_none=True)
    _at_least(args, "--max-queued-requests", 1, allow_none=True)
    _at_least(args, "--radix-cache-max-tokens", 1, allow_none=True)
    _at_least(args, "--fault-perturb-weights", 0.0)
    _at_least(args, "--fault-update-delay-s", 0.0)
    for flag in ("--weight-update-timeout", "--max-request-mb", "--max-weight-update-mb"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if not (math.isfinite(value) and value > 0):
            raise ServeArgError(f"{flag} {value}: must be a positive number")
    if not 1 <= args.port <= 65535:
        raise ServeArgError(f"--port {args.port}: must be in 1 .. 65535")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ServeArgError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        raise ServeArgError(f"--model-path {args.model_path}: "
                            + ("no config.json in it (a Hugging Face model directory?)"
                               if model.is_dir() else "not a directory"))
    for root in args.weight_roots:  # may not exist yet: the disk sync makes it at its first push
        if Path(root).exists() and not Path(root).is_dir():
            raise ServeArgError(f"--weight-roots {root}: not a directory")
    if args.allow_pickled_tensors and not is_loopback(args.host):
        raise ServeArgError(f"--allow-pickled-tensors: only with --host 127.0.0.1 (got "
                            f"{args.host}): deserialising a pickle runs code, so such payloads "
                            "must never come from the network")
    try:
        resolve_dp_layout(args.dp_size, args.attn_dp_size, args.enable_dp_attention,
                          args.tp_size)
        health_env.timeout_from_env()  # SGLang fails to start on what int() refuses
    except ValueError as err:
        raise ServeArgError(str(err)) from None


def resolve_dp_layout(dp_size: int, attn_dp_size: int, enable_dp_attention: bool,
                      tp_size: int) -> tuple[int, int]:
    """(dp_size, attn_dp_size) as SGLang 0.5.23 resolves its flags: ``handle_deprecated_dp_attention``
    (srt/arg_groups/parallel_hook.py) turns ``--enable-dp-attention --dp-size N`` into
    ``attn_dp_size = N, dp_size = 1``; then its checks (``_handle_data_parallelism``)."""
    if enable_dp_attention and attn_dp_size == 1:
        attn_dp_size, dp_size = dp_size, 1
    if dp_size < 1:
        raise ValueError(f"--dp-size must be positive (got {dp_size}).")
    if attn_dp_size < 1:
        raise ValueError(f"--attn-dp-size must be positive (got {attn_dp_size}).")
    if attn_dp_size > 1 and dp_size > 1:
        raise ValueError(f"--dp-size {dp_size} with --attn-dp-size {attn_dp_size}: "
                         "data-parallel replicas combined with attention data parallelism "
                         "are not supported.")
    if tp_size % attn_dp_size:
        raise ValueError(f"--attn-dp-size {attn_dp_size}: tp_size {tp_size} must be divisible "
                         "by it")
    return dp_size, attn_dp_size


def arg_or(args, name: str, default):
    """``args.name``, ``default`` when absent or None (never for 0: ``--tp-size 0`` is an error,
    not 1)."""
    value = getattr(args, name, None)
    return default if value is None else value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
