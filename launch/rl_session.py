"""Set up and tear down one GSPO training session on a training rank (used by ``train``).

Everything here is plumbing, held by one object, :class:`RLSession` (a ``launch.session.Session``,
as ``sft``'s is): the trainer, resume, datasets and rewards on rank 0, the rollout servers (started
here in embedded mode, found through the router otherwise), the weight-sync pusher, and a
guaranteed stop of every process this session started. The loop itself is ``pipeline.step.loop.run``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from launch.session import Session
from megatron_gspo.collectives import broadcast
from megatron_gspo.config import Config, ConfigError
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.export import export_hf_dir
from pipeline.context import LoopContext
from pipeline.engines.base import Engine
from pipeline.engines.choice import engine as choose_engine
from pipeline.engines.factory import build_client, build_generator, client_spec
from pipeline.generation.client import router_workers
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.data import PromptSampler, build_datasets
from pipeline.scoring.rewards import build_reward
from pipeline.scoring.tasks import write_byte_tokenizer
from pipeline.servers.pool import ServerPool
from pipeline.signals import PREEMPTED_EXIT_CODE
from pipeline.sources.base import BatchSource
from pipeline.sources.choice import make_source
from pipeline.step import loop
from pipeline.weights.parity import ParityWatchdog, draw_probe_prompts

if TYPE_CHECKING:
    from megatron_gspo.train.rl_trainer import RLTrainer
    from pipeline.weights.push import WeightPusher


def weight_pusher_options(r, run_dir: Path) -> dict:
    """``WeightPusher``'s settings from the config's rollout section: every HTTP call of a sync is
    bounded by ``rollout.request_timeout_s`` (a 235B disk reload can take many minutes). The
    engine (``rollout.engine``) is the session's (:attr:`RLSession.engine`)."""
    sync = r.weight_sync
    return dict(transport=sync.transport, shared_dir=sync.dir or str(Path(run_dir) / "weights"),
                master_address=sync.master_address, verify=sync.verify,
                delta=sync.delta, timeout_s=r.request_timeout_s, quantization=r.quantization,
                full_every=sync.full_every,
                # full: requests in flight live through the update and continue on the new weights
                pause_mode="retract" if r.async_ == "full" else "abort")


def validate_rl(cfg: Config, *, on_gpu: Optional[bool] = None) -> None:
    """What depends on this machine, not on the file (errors name the fields); ``on_gpu``
    defaults to whether this machine has CUDA. Every check the file alone decides (batch splits,
    context parallelism, ...) runs in ``megatron_gspo.config`` when the file is loaded."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    choose_engine(cfg.rollout.engine).check(cfg, on_gpu=on_gpu)
    if cfg.rollout.colocated and on_gpu:
        raise ConfigError(
            "rollout.colocated: not supported on GPUs yet: the trainer keeps its weights, "
            "gradients and optimizer state resident while the servers generate (no offload), and "
            "NCCL refuses two ranks on one GPU; give the servers their own nodes "
            "(launch slurm --rollout-nodes M > 0) and set rollout.colocated: false. Colocated "
            "runs work on CPU machines")


def _server_urls_from_router(router_url: str) -> list[str]:
    return [w["url"] for w in router_workers(router_url)]


ROUTES_THROUGH_ROUTER = {"sglang": True, "vllm": False}
"""Per ``rollout.engine``: whether an external router routes the rollouts (sglang-router does for
SGLang servers) or only names the servers the client then routes over itself (vLLM's: the
router answers 404 to ``/inference/v1/generate`` and 422 to token-id completions)."""


def external_endpoints(rollout) -> tuple[Optional[str], Optional[list[str]]]:
    """External mode: (the router the client sends every request through, or None; the servers,
    or None while the router is to be asked for them once it is healthy)."""
    if rollout.server_urls:
        return None, list(rollout.server_urls)
    if ROUTES_THROUGH_ROUTER[rollout.engine]:
        return rollout.router_url, None
    return None, _server_urls_from_router(rollout.router_url)


def run_training(cfg: Config, *, resume: bool) -> int:
    """``megatron-gspo train`` on this rank; returns the exit status (0 finished, 75 preempted)."""
    with RLSession(cfg, resume=resume) as session:
        return session.run()


class RLSession(Session):
    """One GSPO training session on one training rank.

        with RLSession(cfg, resume=False) as session:   # distributed start, signals, pid file
            code = session.run()                         # builders, then pipeline.step.loop.run

    ``run`` builds the trainer side (:meth:`build_trainer`: the policy, its optimizer, resume),
    the rollout side (:meth:`build_rollout`: rank 0's data, rewards, client, and in embedded mode
    the servers and the router) and the weight sync (:meth:`build_weight_sync`), then runs the
    loop. The start, the run lock, the signals and the one ``ExitStack`` every resource is
    registered on are :class:`launch.session.Session`'s (shared with ``sft``).
    """

    engine: Engine
    """The rollout servers' engine (``rollout.engine``), chosen once here: its client wire,
    control calls, weight transports and embedded servers (``pipeline.engines``)."""

    pool: Optional[ServerPool] = None
    """Rank 0's server pool (:meth:`build_rollout`); the weight sync gives it its record of the
    servers it paused (:meth:`build_weight_sync`)."""

    def validate(self) -> None:
        validate_rl(self.cfg)
        self.engine = choose_engine(self.cfg.rollout.engine)

    # ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Build both sides, run the loop, export the final policy; returns the exit status."""
        trainer, start_step, run_state = self.build_trainer()
        ctx = self.build_rollout(trainer, run_state)
        source = self.build_source(ctx, start_step, run_state)
        ctx.weights = self.build_weight_sync(ctx.server_urls)
        result = loop.run(ctx, trainer, start_step=start_step, source=source)
        return self._finish(trainer, result)

    def build_trainer(self) -> tuple[RLTrainer, int, dict]:
        """Every rank: the policy (``run.init_from`` or the seeded initialisation) with its
        optimizer, and with ``--resume`` the newest checkpoint loaded into both.

        Returns ``(trainer, start_step, run_state)``; ``run_state`` is what the loop saved with
        the checkpoint (the sampler's data position), ``{}`` on a fresh start."""
        from megatron_gspo.train.rl_trainer import RLTrainer

        latest = self.checkpoint_to_resume()
        trainer = RLTrainer(self.cfg, self.pg, init_hf_dir=self.cfg.run.init_from)
        if latest is None:
            return trainer, 0, {}
        run_state = trainer.load(latest)
        start_step = int(run_state["step"])
        self.say_resumed(latest, start_step)
        return trainer, start_step, run_state

    def build_rollout(self, trainer: RLTrainer, run_state: dict) -> LoopContext:
        """The loop's context. Rank 0 gets the data (the sampler at the checkpoint's position),
        the reward function, the rollout client, the metrics logger and, in embedded mode, the
        servers and the router it starts here; the other ranks get what every rank needs.

        Collective when the embedded servers need the initial policy exported first."""
        cfg, run_dir = self.cfg, self.run_dir
        server_model = self._embedded_server_model(trainer)  # collective (every rank)
        common = dict(cfg=cfg, run_dir=str(run_dir), stop=self.stop, control_group=self.control)
        if not self.is_main:
            return LoopContext(**common, logger=MetricsLogger(run_dir, enabled=False),
                                    parity=_parity_watchdog(cfg, run_dir, self.engine))

        train_set, eval_set = build_datasets(cfg.data, seed=cfg.run.seed)
        sampler = PromptSampler(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        if run_state.get("sampler"):
            sampler.load_state_dict(run_state["sampler"])
        eval_prompts = [eval_set[i] for i in range(len(eval_set))] if eval_set else []

        cluster = None
        if cfg.rollout.mode == "embedded":
            cluster = self._start_local_servers(server_model)
            router_url, server_urls = cluster.router_url, list(cluster.server_urls)
        else:
            router_url, server_urls = external_endpoints(cfg.rollout)
        # the producer process of the async modes builds its own client from the same spec
        engine = client_spec(cfg, router_url, server_urls if router_url is None else ())
        client = build_client(engine)
        if server_urls is None:  # external: wait for the router, then ask it for its workers
            client.wait_healthy()
            server_urls = _server_urls_from_router(router_url)
        # dead servers: dropped from the router and the sync, restarted when they are ours
        pool = ServerPool(server_urls, router_url=router_url, cluster=cluster,
                          min_servers=cfg.rollout.min_servers,
                          outage_timeout_s=cfg.rollout.outage_timeout_s,
                          readmit_timeout_s=cfg.rollout.router.readmit_timeout_s,
                          interrupted=lambda: self.stop.signum is not None,
                          liveness_path=self.engine.control.liveness_path)
        client.servers = pool  # a request with no live server waits for one (wait_for_live)
        self.pool = pool  # the weight sync tells it which servers it paused
        logger = MetricsLogger.from_config(cfg, run_dir)
        self.resources.callback(logger.close)
        encoder = train_set.encoder
        generator = build_generator(cfg, client, encoder,
                                    interrupted=lambda: self.stop.signum is not None)
        if hasattr(generator, "close"):  # multi-turn: the sandbox's workers live for the run
            self.resources.callback(generator.close)
        return LoopContext(
            generator=generator, engine=engine,
            **common, logger=logger, sampler=sampler,
            eval_prompts=eval_prompts if cfg.run.eval_interval else [],
            # a stop signal abandons a user reward's call at once: the rank saves and stops
            reward_fn=build_reward(cfg.reward, cfg.data,
                                   interrupted=lambda: self.stop.signum is not None),
            client=client, decode=encoder.decode,
            stop_token_ids=[encoder.eos_id], server_urls=list(server_urls), servers=pool,
            parity=_parity_watchdog(cfg, run_dir, self.engine, eval_set=eval_set,
                                    train_set=train_set))

    def build_source(self, ctx: LoopContext, start_step: int, run_state: dict) -> BatchSource:
        """The run's batch source, chosen once from ``rollout.async`` (every rank holds one, rank
        0 uses it); rank 0 restores the checkpoint's part of it, or refuses a checkpoint this mode
        cannot resume exactly (``pipeline.sources.base.resume_refusal``: a ConfigError naming both
        modes; the launcher refused it already, before the ranks started)."""
        source = make_source(ctx, start_step)
        self.resources.callback(source.close)  # a producer process stops with the session
        if self.is_main:
            source.restore(run_state)
        return source

    def _embedded_server_model(self, trainer: RLTrainer) -> Optional[str]:
        """The Hugging Face directory embedded servers load (None in external mode): run.init_from,
        or the trainer's initial weights exported first (collective)."""
        if self.cfg.rollout.mode != "embedded":
            return None
        if _init_is_hf(self.cfg):
            return self.cfg.run.init_from
        return _export_initial_weights(trainer, self.run_dir)

    def _start_local_servers(self, model_path: str):
        """Rank 0, embedded mode: the engine's local rollout servers (and, for SGLang, the
        router), stopped on exit; returns the started cluster."""
        # update_weights_from_disk reads only the disk sync's directory (and the served model);
        # made here, before the servers check their --weight-roots
        roots = Path(self.cfg.rollout.weight_sync.dir or self.run_dir / "weights")
        roots.mkdir(parents=True, exist_ok=True)
        cluster = self.engine.cluster(self.cfg, model_path, log_dir=self.run_dir / "logs",
                                      weights_dir=roots)
        self.resources.callback(cluster.stop)  # also after a start that failed half-way
        cluster.start()
        return cluster

    # --- the weight sync: the trainer's HF buckets -> every rollout server -----------------------
    def build_weight_sync(self, server_urls: list[str]) -> WeightPusher:
        """Every rank: the pusher of the trainer's HF buckets (``pipeline.step.phases.
        sync_weights``) to every rollout server (rank 0's ``server_urls``, broadcast here); its
        update groups are closed on exit."""
        from pipeline.weights.push import WeightPusher

        urls = broadcast(server_urls if self.is_main else None, group=self.control)
        pusher = WeightPusher(urls, **weight_pusher_options(self.cfg.rollout, self.run_dir),
                              group=self.control, engine=self.engine)
        self.resources.callback(pusher.close)
        if self.pool is not None:  # rank 0: a server the sync paused is not a dead one
            self.pool.paused = pusher.paused
        return pusher

    # ---------------------------------------------------------------------------------------
    def _finish(self, trainer: RLTrainer, result: dict) -> int:
        """The final policy (a finished run; collective), the summary line, the exit status."""
        if result["status"] == "finished":
            final = _export_policy(trainer, self.cfg, self.run_dir / "hf")
            if self.is_main:
                print(f"final policy written to {final}", flush=True)
        if self.is_main:
            history = result["history"]["eval/reward_mean"]
            if result["status"] == "preempted" and not result.get("saved", True):
                print(f"preempted before a step finished: no checkpoint saved (nothing done "
                      f"after step {result.get('start_step', 0)}); exit "
                      f"{PREEMPTED_EXIT_CODE}", flush=True)
            elif result["status"] == "preempted":
                print(f"preempted: checkpoint saved; exit {PREEMPTED_EXIT_CODE}", flush=True)
            elif len(history) >= 2:
                print(f"held-out reward: step {history[0][0]} {history[0][1]:.3f} -> "
                      f"step {history[-1][0]} {history[-1][1]:.3f}", flush=True)
        return PREEMPTED_EXIT_CODE if result["status"] == "preempted" else 0


def _parity_watchdog(cfg: Config, run_dir: Path, engine: Engine, *, eval_set=None,
                     train_set=None):
    """The parity watchdog of every rank (None unless parity.enabled), scoring through the
    engine's scorer; rank 0 passes the datasets its probe prompts are drawn from
    (``pipeline.weights.parity``)."""
    if not cfg.parity.enabled:
        return None
    prompts = (draw_probe_prompts(eval_set, train_set, cfg.parity.num_probes, cfg.run.seed)
               if train_set is not None else [])
    return ParityWatchdog(cfg, run_dir, engine.scorer, prompts=prompts)




def _export_policy(trainer, cfg: Config, out: Path):
    """Collective: the policy as a Hugging Face directory, with the tokenizer files."""
    tokenizer_dir = cfg.data.tokenizer_dir or (cfg.run.init_from if _init_is_hf(cfg) else None)
    if tokenizer_dir is None and cfg.run.init_from:  # a Megatron checkpoint's recorded HF config
        recorded = megatron_layout.find_hf_config(megatron_layout.resolve(cfg.run.init_from))
        tokenizer_dir = str(recorded) if recorded is not None else None
    path = export_hf_dir(trainer.current_policy(), cfg.model, trainer.pg, out,
                         tokenizer_dir=tokenizer_dir)
    if dist.get_rank() == 0 and tokenizer_dir is None and cfg.data.task is not None:
        write_byte_tokenizer(out)
    return path


def _init_is_hf(cfg: Config) -> bool:
    from megatron_gspo.train.rl_trainer import is_mcore_checkpoint

    return bool(cfg.run.init_from) and not is_mcore_checkpoint(cfg.run.init_from)


def _needs_export(cfg: Config) -> bool:
    """Embedded servers need a Hugging Face directory of the initial policy."""
    return cfg.rollout.mode == "embedded" and not _init_is_hf(cfg)


def _export_initial_weights(trainer, run_dir: Path) -> str:
    """Write the trainer's initial weights as a Hugging Face directory (collective)."""
    out = run_dir / "init_hf"
    _export_policy(trainer, trainer.cfg, out)
    return str(out)
