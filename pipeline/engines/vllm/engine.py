"""vLLM behind the engine seam (:mod:`pipeline.engines.base`): its wire and control calls
(:mod:`pipeline.engines.vllm.client`), its weight transports (:mod:`pipeline.engines.vllm.weights`)
and the embedded servers of a run (:class:`VllmCluster`: ``rollout.num_servers`` vLLM API servers
started from the vLLM environment, no router: the client spreads the requests over them itself,
keeps multi-turn trajectories on their server and retries elsewhere when one dies; the server
pool restarts a dead one).

The vLLM environment is its own virtual environment (``launch/envs/vllm_cpu.sh`` builds it,
pinned): ``$MGSPO_VLLM_PYTHON`` names its interpreter, else ``<repository>/.venv-vllm``
(:func:`vllm_python`). Each server's command line and environment are
``pipeline.engines.vllm.server_args``' (checked against vLLM's own parser), plus
:data:`~pipeline.engines.vllm.client.SERVER_FLAGS`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_gspo.config import Config, ConfigError
from pipeline.engines.vllm import server_args as sa
from pipeline.engines.vllm import weights
from pipeline.engines.vllm.client import SERVER_FLAGS, VllmControl, VllmScorer, VllmWire
from pipeline.servers.cluster import LocalRolloutCluster

ROOT = Path(__file__).resolve().parents[3]
PYTHON_ENV = "MGSPO_VLLM_PYTHON"
START_TIMEOUT_S = 600.0
"""A vLLM server's start on a loaded 2-core machine: 30-120 s of imports, more under load."""


def vllm_python() -> Path:
    """The vLLM environment's interpreter (module docstring); ``ConfigError`` naming how to
    build it when there is none."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if not Path(named).is_file():
            raise ConfigError(f"rollout.engine: vllm: {PYTHON_ENV}={named} is no interpreter")
        return Path(named)
    venv = ROOT / ".venv-vllm"
    if not (venv / ".pins").is_file():
        raise ConfigError("rollout.engine: vllm needs the vLLM environment: build it with "
                          f"launch/envs/vllm_cpu.sh (into {venv}) or set {PYTHON_ENV} to its "
                          "interpreter")
    return venv / "bin" / "python"


class VllmCluster(LocalRolloutCluster):
    """``num_servers`` vLLM API servers on this machine (module docstring); the lifecycle,
    logs, kills and restarts are ``LocalRolloutCluster``'s."""

    health_path = "/health"

    def __init__(self, cfg: Config, model_path: str, num_servers: int, *, log_dir,
                 python: Optional[Path] = None, device: sa.Device = "cpu",
                 host: str = "127.0.0.1", kv_cache_gib: Optional[float] = None,
                 health_timeout_s: float = START_TIMEOUT_S, extra: tuple = ()):
        super().__init__(model_path, num_servers, host=host, router=False, log_dir=log_dir,
                         random_seed=cfg.run.seed, health_timeout_s=health_timeout_s)
        sa.check_supported(cfg, device)
        self.cfg, self.device, self.kv_cache_gib = cfg, device, kv_cache_gib
        self.python = python or vllm_python()
        self.extra = tuple(extra)

    def _start_server(self, i: int) -> None:
        argv = sa.server_argv(self.cfg, model_path=self.model_path, host=self.host,
                              port=self._ports[i],
                              seed=self.random_seed + 1000 * i + self._restarts[i],
                              device=self.device, extra=(*SERVER_FLAGS, *self.extra))
        env = sa.server_env(self.cfg, device=self.device, repo_root=ROOT, host_ip=self.host,
                            kv_cache_gib=self.kv_cache_gib)
        self._spawn(f"server{i}", sa.command(str(self.python), argv), forced=env)


class VllmEngine:
    """vLLM 0.32 (``rollout.engine: vllm``)."""

    name = "vllm"
    wire = VllmWire()
    control = VllmControl()
    scorer = VllmScorer()

    def check(self, cfg: Config, *, on_gpu: bool) -> None:
        """Embedded servers (on this machine's device): vLLM 0.32's refusals
        (``server_args.check_supported``: routing replay ``rollout`` on the CPU, ...) and the vLLM
        environment. External servers run elsewhere: ``launch.preflight`` probes each one
        (``pipeline.engines.vllm.probe``: routed experts recorded, ...)."""
        if cfg.rollout.mode == "embedded":
            sa.check_supported(cfg, "cuda" if on_gpu else "cpu")
            vllm_python()

    def make_transport(self, pusher, transport: str, **options: Any):
        return weights.make_transport(pusher, transport, **options)

    def cluster(self, cfg: Config, model_path: str, *, log_dir: Path,
                weights_dir: Path) -> VllmCluster:
        device: sa.Device = "cuda" if torch.cuda.is_available() else "cpu"
        return VllmCluster(cfg, model_path, cfg.rollout.num_servers, log_dir=log_dir,
                           device=device)


VLLM = VllmEngine()
