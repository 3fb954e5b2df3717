"""Set up and tear down one GSPO training session on a training rank (used by ``train``).

Everything here is plumbing: distributed start, the trainer, resume, datasets and rewards on rank
0, the rollout servers (started here in embedded mode, found through the router otherwise), the
weight-sync transport, signals, and a guaranteed stop of every process this session started.
The loop itself is ``pipeline.loop.run``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.config import Config, ConfigError


def validate_rl(cfg: Config) -> None:
    """RL-specific consistency checks (errors name the fields)."""
    g, gbs, k = cfg.gspo.group_size, cfg.run.global_batch_size, cfg.gspo.updates_per_rollout
    if gbs % g:
        raise ConfigError(f"run.global_batch_size: {gbs} is not a multiple of gspo.group_size {g}")
    if gbs % k:
        raise ConfigError(f"run.global_batch_size: {gbs} does not split into "
                          f"gspo.updates_per_rollout = {k} mini-batches")
    if cfg.parallel.context > 1:
        raise ConfigError("parallel.context: context parallelism of the policy needs Transformer "
                          "Engine attention; the RL trainer does not split rollout batches over "
                          "context-parallel ranks yet (the loss supports it: "
                          "megatron_gspo.loss.context_parallel)")


def _server_urls_from_router(router_url: str) -> list[str]:
    from pipeline.rollout import router_workers

    return [w["url"] for w in router_workers(router_url)]


def run_training(cfg: Config, *, resume: bool) -> int:
    from megatron_gspo import parallel
    from megatron_gspo.train.checkpoint import checkpoint_root, latest_checkpoint
    from megatron_gspo.train.rl_trainer import RLTrainer
    from pipeline import loop
    from pipeline.metrics import MetricsLogger

    validate_rl(cfg)
    run_dir = Path(cfg.run.output_dir)
    parallel.init_distributed()
    cluster = None
    logger = None
    syncer = None
    try:
        pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
        is_main = dist.get_rank() == 0
        latest = latest_checkpoint(run_dir) if resume else None
        if not resume and checkpoint_root(run_dir).joinpath("latest").exists():
            raise ConfigError(f"run.output_dir: {run_dir} already holds checkpoints; pass --resume "
                              "to continue that run or choose another run.output_dir")
        if is_main:
            layout = parallel.derive_layout(cfg.parallel, dist.get_world_size())
            print(f"layout: {layout.describe()}", flush=True)
        stop = loop.StopFlag().install()
        _write_pid_file(run_dir)
        trainer = RLTrainer(cfg, pg, init_hf_dir=cfg.run.init_from)
        start_step, run_state = 0, {}
        if latest is not None:
            run_state = trainer.load(latest)
            start_step = int(run_state["step"])
            if is_main:
                print(f"resumed from {latest} (step {start_step})", flush=True)

        # Rank 0: data, rewards, rollout client (and in embedded mode the servers + router).
        ctx_parts = None
        server_urls = None
        if is_main:
            from pipeline.data import PromptSampler, build_datasets
            from pipeline.rewards import build_reward
            from pipeline.rollout import RolloutClient

            train_set, eval_set = build_datasets(cfg.data, seed=cfg.run.seed)
            sampler = PromptSampler(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
            if run_state.get("sampler"):
                sampler.load_state_dict(run_state["sampler"])
            eval_prompts = [eval_set[i] for i in range(len(eval_set))] if eval_set else []
            encoder = train_set.encoder
            if cfg.rollout.mode == "embedded":
                from pipeline.servers import LocalRolloutCluster

                model_path = (cfg.run.init_from if _init_is_hf(cfg)
                              else _export_initial_weights(trainer, run_dir))
                server_args = ["--max-running-requests", "1"] if cfg.rollout.deterministic else []
                cluster = LocalRolloutCluster(model_path, cfg.rollout.num_servers,
                                              log_dir=run_dir / "logs", random_seed=cfg.run.seed,
                                              server_args=server_args)
                cluster.start()
                client = RolloutClient(router_url=cluster.router_url,
                                       max_concurrency=cfg.rollout.max_concurrency,
                                       request_timeout_s=cfg.rollout.request_timeout_s)
                server_urls = list(cluster.server_urls)
            else:
                client = RolloutClient(router_url=cfg.rollout.router_url,
                                       max_concurrency=cfg.rollout.max_concurrency,
                                       request_timeout_s=cfg.rollout.request_timeout_s)
                client.wait_healthy()
                server_urls = _server_urls_from_router(cfg.rollout.router_url)
            logger = MetricsLogger(run_dir, enabled=True)
            ctx_parts = dict(sampler=sampler, eval_prompts=eval_prompts if cfg.run.eval_interval
                             else [], client=client, decode=encoder.decode,
                             stop_token_ids=[encoder.eos_id], server_urls=list(server_urls))
        elif _needs_export(cfg):
            _export_initial_weights(trainer, run_dir)  # collective
        box = [server_urls]
        dist.broadcast_object_list(box, src=0)
        server_urls = box[0]

        from megatron_gspo.hf.weight_sync import WeightSyncer

        syncer = WeightSyncer(trainer.gpt, cfg.model, pg, server_urls,
                              transport=cfg.rollout.weight_sync,
                              bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
                              shared_dir=cfg.rollout.weight_sync_dir or str(run_dir / "weights"))

        def sync(version: str) -> dict:
            stats = syncer.sync(version)
            return {"seconds": stats.seconds_total, "gbytes_per_s": stats.gbytes_per_s,
                    "bytes": stats.bytes}

        trainer.sync_weights = sync
        ctx = loop.LoopContext(cfg=cfg, run_dir=str(run_dir), reward_fn=(
            build_reward(cfg.reward, cfg.data) if is_main else None),
            logger=logger or MetricsLogger(run_dir, enabled=False), stop=stop,
            **(ctx_parts or dict(sampler=None, eval_prompts=[], client=None, decode=None,
                                 stop_token_ids=[])))
        result = loop.run(ctx, trainer, start_step=start_step)
        if result["status"] == "finished":
            final = _export_policy(trainer, cfg, run_dir / "hf")
            if is_main:
                print(f"final policy written to {final}", flush=True)
        if is_main:
            history = result["history"]["eval/reward_mean"]
            if result["status"] == "preempted":
                print(f"preempted: checkpoint saved; exit {loop.PREEMPTED_EXIT_CODE}", flush=True)
            elif len(history) >= 2:
                print(f"held-out reward: step {history[0][0]} {history[0][1]:.3f} -> "
                      f"step {history[-1][0]} {history[-1][1]:.3f}", flush=True)
        return loop.PREEMPTED_EXIT_CODE if result["status"] == "preempted" else 0
    finally:
        if syncer is not None:
            syncer.close()
        if cluster is not None:
            cluster.stop()
        if logger is not None:
            logger.close()
        parallel.destroy()


def _write_pid_file(run_dir: Path) -> None:
    """<run_dir>/pids/rank<R>.pid: which process is which training rank (for operators, tests)."""
    pid_dir = run_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))


def _export_policy(trainer, cfg: Config, out: Path):
    """Collective: the policy as a Hugging Face directory, with the tokenizer files."""
    from megatron_gspo.hf.export import export_hf_dir

    tokenizer_dir = cfg.data.tokenizer_dir or (cfg.run.init_from if _init_is_hf(cfg) else None)
    if tokenizer_dir is None and cfg.run.init_from and (Path(cfg.run.init_from) / "hf_config").is_dir():
        tokenizer_dir = str(Path(cfg.run.init_from) / "hf_config")
    path = export_hf_dir(trainer.gpt, cfg.model, trainer.pg, out, tokenizer_dir=tokenizer_dir)
    if dist.get_rank() == 0 and tokenizer_dir is None and cfg.data.task is not None:
        from pipeline.tasks import write_byte_tokenizer

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
