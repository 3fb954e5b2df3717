"""What can be known about a running vLLM server before a run uses it (``launch.preflight``,
external mode with ``rollout.engine: vllm``).

    problems = server_problems("http://gpu-001:20010", cfg)   # [] when it is usable

Every answer read here is vLLM 0.32's own (recorded from a real server in
tests/engines/recorded/): a server is usable by the project when

* ``GET /version`` answers ``{"version": "0.32.x"}`` (:data:`server_args.VLLM_VERSION`'s
  release: the RL endpoints, the scale-out generate and its ``weight_versions`` spans, and the
  routed-experts encoding are 0.32's; an SGLang server answers 404 here);
* ``GET /server_info?config_format=json`` answers: it exists only with ``VLLM_SERVER_DEV_MODE=1``,
  which also mounts ``/pause``, ``/resume``, ``/abort_requests``, ``/collective_rpc``,
  ``/update_weight_version`` and ``/reset_prefix_cache``, the weight sync's endpoints. Its
  ``vllm_config`` says the rest:
  ``parallel_config.worker_extension_cls`` is the project's :data:`server_args.WORKER_EXTENSION`
  (the weight sync's methods in every worker), and with ``gspo.routing_replay: rollout``
  ``aux_output_config.enable_return_routed_experts`` is true;
* ``POST /inference/v1/generate`` with an empty body is refused as a bad request (400: the
  endpoint is mounted), not with 403 (vLLM's answer without ``--enable-scale-out``) or 404.

The empty generate body is never scheduled (vLLM refuses it before its engine sees it).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_gspo.config import Config
from pipeline.engines.vllm.server_args import VLLM_VERSION, WORKER_EXTENSION
from pipeline.generation.client import RolloutError, http_json

PROBE_TIMEOUT_S = 30.0
"""Each probe's bound: a server that does not answer within it is reported as unreachable. Not
the router's 5 s: vLLM's first ``/server_info`` collects the machine's environment (its
``collect_env``, subprocesses included): 5 s ran out on a loaded 2-core machine."""


def _get(url: str, path: str, timeout_s: float) -> tuple[int, Any]:
    return http_json("GET", url.rstrip("/") + path, timeout_s=timeout_s)


def server_problems(url: str, cfg: Config, *, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """What keeps ``url`` from serving ``cfg``'s rollouts as a vLLM server (each a sentence
    naming the flag or variable to set); [] when nothing does."""
    try:
        status, version = _get(url, "/version", timeout_s)
    except RolloutError as err:
        return [f"{url} is not reachable within {timeout_s:.0f} s ({err.message})"]
    release = version.get("version") if isinstance(version, dict) else None
    if status != 200 or not isinstance(release, str):
        return [f"{url} does not answer vLLM's /version (HTTP {status}): not a vLLM server"]
    want = ".".join(VLLM_VERSION.split(".")[:2])
    problems = []
    if ".".join(release.split(".")[:2]) != want:
        problems.append(f"{url} runs vLLM {release}; the project speaks vLLM {want}'s API")
    status, info = _get(url, "/server_info?config_format=json", timeout_s)
    config = info.get("vllm_config") if isinstance(info, dict) else None
    if status != 200 or not isinstance(config, dict):
        problems.append(f"{url} has no development endpoints (/server_info: HTTP {status}); "
                        "start it with VLLM_SERVER_DEV_MODE=1 (pause, resume, collective_rpc: "
                        "the weight sync's endpoints)")
    else:
        problems += _config_problems(url, config, cfg)
    status, answer = http_json("POST", url.rstrip("/") + "/inference/v1/generate", {},
                               timeout_s=timeout_s)
    if status != 400:
        problems.append(f"{url} does not serve /inference/v1/generate (HTTP {status}); start "
                        "it with --enable-scale-out (token ids in and out, with per-token "
                        "weight versions)")
    return problems


def _config_problems(url: str, config: dict, cfg: Config) -> list[str]:
    problems = []
    extension = _lookup(config, "parallel_config", "worker_extension_cls")
    if extension != WORKER_EXTENSION:
        problems.append(f"{url} runs the worker extension {extension or 'none'}; start it with "
                        f"--worker-extension-cls {WORKER_EXTENSION} (and the repository on "
                        "PYTHONPATH): the weight sync calls its methods")
    if cfg.gspo.routing_replay == "rollout" and not _lookup(
            config, "aux_output_config", "enable_return_routed_experts"):
        problems.append(f"{url} does not record routed experts, which gspo.routing_replay: "
                        "rollout needs; start it with --enable-return-routed-experts (GPU "
                        "servers only)")
    return problems


def _lookup(config: dict, section: str, key: str) -> Optional[Any]:
    part = config.get(section)
    return part.get(key) if isinstance(part, dict) else None


def check_servers(urls: list[str], cfg: Config, *, field: str,
                  timeout_s: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """One message naming ``field`` and every problem of every server of ``urls``; None when all
    are usable."""
    problems = [p for url in urls for p in server_problems(url, cfg, timeout_s=timeout_s)]
    if not problems:
        return None
    return (f"{field}: {len(problems)} problem(s) with the vLLM servers "
            f"(rollout.engine vllm): " + "; ".join(problems))
