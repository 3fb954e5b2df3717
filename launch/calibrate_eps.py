"""``megatron-gspo calibrate-eps``: the sequence clip range (eps_low, eps_high) for a target clip fraction.

    megatron-gspo calibrate-eps --config X.yaml [--target-clip-frac 0.1] [--rollouts 2]
                                [--split ratio|equal] [--out DIR] [--set a.b=v ...]

What it measures (docs/parity.md, "Clip-range calibration"): the session machinery of ``train``
(the same ranks, policy, rollout servers, weight sync) generates ``--rollouts`` rollout batches
from the initial policy (run.init_from), then makes ONE optimizer update exactly as the first
update of a training step: on one mini-batch (run.global_batch_size / gspo.updates_per_rollout
sequences, drawn with run.seed from the first batch), with log pi_old recomputed (or the
rollout's, per gspo.old_logprobs), at the full learning rate optim.lr (the warmup is skipped: it
would make the first step smaller than the ones that follow). Then it computes s_i of every
OTHER sequence of the batches - the policy after one update against pi_old: the ratios the clip
acts on at the second mini-batch of a step (the first mini-batch is never clipped when pi_old is
recomputed: its s_i = 1). From them, ``megatron_gspo.loss.clip_calibration`` picks the range
that clips the target fraction of those sequences (A > 0 above 1 + eps_high, A < 0 below
1 - eps_low; over all of them, zero advantages included, as ``train/clip_frac`` counts), split
keeping the configured eps_high / eps_low ratio (``--split ratio``) or half per side
(``--split equal``). It prints the s_i quantiles and the range, and writes both to
``DIR/calibration.json`` (default DIR: <run.output_dir>/calibrate_eps), with every measured
(s_i, A_i) under ``sequences`` (to re-calibrate for another target offline). With N sequences it
clips floor(target x N) of them unless candidates tie (identical responses of one group have the
same s_i and A_i): then the largest count at most that.

How to read it: later mini-batches of a step (k > 2) see larger ratios and clip more, while the
first clips nothing, so ``train/clip_frac`` (a mean over all k mini-batches) is not the target;
the policy drifts too. Re-run it from a later checkpoint's HF export to re-calibrate.
Only the sequence-clip variants (gspo, gspo_token, token_ratio_seq_clip, seq_ratio_unnormalized)
are calibrated; the token-clip ones clip w_it with gspo.token_eps_*.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.distributed as dist

from launch import local, preflight
from launch.common import add_config_args, load_from_args
from launch.rl_session import RLSession
from megatron_gspo.config import Config, ConfigError
from megatron_gspo.loss.clip_calibration import calibrate_clip_range, ratio_quantiles
from megatron_gspo.loss.gspo import sequence_log_ratio
from megatron_gspo.loss.variants import OWN_RANGE_VARIANTS, clips_token_ratio
from megatron_gspo.parallel import minimal_world_size
from megatron_gspo.train.batching import select_rows
from pipeline.sources.batch import rollout_phase
from pipeline.step.phases import sync_weights
from pipeline.step.rank0 import everywhere, on_main

DEFAULT_TARGET = 0.10


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate-eps", help="the GSPO clip range for a target clip fraction",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--target-clip-frac", type=float, default=DEFAULT_TARGET,
                   help="fraction of sequences to clip (default 0.1; the seed's band is 0.05-0.15)")
    p.add_argument("--rollouts", type=int, default=2,
                   help="diagnostic rollout batches from the initial policy (default 2)")
    p.add_argument("--split", choices=["ratio", "equal"], default="ratio",
                   help="ratio: keep gspo.eps_high / gspo.eps_low (default); equal: half the "
                        "target on each side")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="the calibration's run directory (default <run.output_dir>/calibrate_eps)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local training ranks (default: the smallest world the layout needs)")
    p.set_defaults(func=main)


def calibration_config(cfg: Config, out: str) -> Config:
    """The session's configuration: one update per rollout batch (the first mini-batch's is fed
    alone), no warmup, the calibration's own run directory."""
    if cfg.gspo.variant in OWN_RANGE_VARIANTS:
        raise ConfigError(f"gspo.variant: {cfg.gspo.variant} has a range of its own (gspo.cispo.*, "
                          "gspo.sapo.*, gspo.gmpo.*), not the sequence clip range; "
                          "calibrate-eps calibrates the sequence clip range of gspo, gspo_token, "
                          "token_ratio_seq_clip, seq_ratio_unnormalized and luspo")
    if clips_token_ratio(cfg.gspo.variant):
        raise ConfigError(f"gspo.variant: {cfg.gspo.variant} clips the per-token ratio w_it "
                          "(gspo.token_eps_low / token_eps_high); calibrate-eps calibrates the "
                          "sequence clip range of gspo, gspo_token, token_ratio_seq_clip, "
                          "seq_ratio_unnormalized and luspo")
    if cfg.gspo.updates_per_rollout == 1 and cfg.gspo.old_logprobs == "recompute":
        raise ConfigError("gspo.updates_per_rollout: 1 with gspo.old_logprobs recompute: every "
                          "update sees s_i = 1 and nothing is ever clipped; there is no clip "
                          "range to calibrate")
    return dataclasses.replace(
        cfg, gspo=dataclasses.replace(cfg.gspo, updates_per_rollout=1),
        optim=dataclasses.replace(cfg.optim, warmup_steps=0),
        run=dataclasses.replace(cfg.run, output_dir=out, save_interval=0, eval_interval=0))


def main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_from_args(args)
    if not 0 < args.target_clip_frac < 1:
        raise ConfigError(f"--target-clip-frac: must be in (0, 1), got {args.target_clip_frac}")
    if args.rollouts < 1:
        raise ConfigError(f"--rollouts: must be >= 1, got {args.rollouts}")
    out = args.out or str(Path(cfg.run.output_dir) / "calibrate_eps")
    session_cfg = calibration_config(cfg, out)

    world = args.nproc or minimal_world_size(session_cfg.parallel)
    preflight.before_ranks(session_cfg, program="train", world_size=world, resume=False)
    code = local.ensure_ranks(argv, world, log_dir=Path(out) / "logs")
    if code is not None:
        return code
    return run_calibration(cfg, session_cfg, target=args.target_clip_frac,
                           rollouts=args.rollouts, split=args.split)


def run_calibration(cfg: Config, session_cfg: Config, *, target: float, rollouts: int,
                    split: str) -> int:
    """Every rank: rollouts, one update, s_i of the other sequences; rank 0 reports."""
    with RLSession(session_cfg, resume=False) as session:
        trainer, _, _ = session.build_trainer()
        ctx = session.build_rollout(trainer, {})
        ctx.weights = session.build_weight_sync(ctx.server_urls)
        everywhere(sync_weights, ctx, trainer, 0, what="weight sync")
        batches = [on_main(ctx, rollout_phase, ctx, r + 1, what="rollout")[0]
                   for r in range(rollouts)]
        rows = batches[0]["tokens"].shape[0]
        size = rows // cfg.gspo.updates_per_rollout
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(cfg.run.seed))
        update_rows, first_rest = order[:size], order[size:]
        keys = batches[0].keys()
        rest = {k: torch.cat([select_rows(batches[0], first_rest)[k]]
                             + [b[k] for b in batches[1:]]) for k in keys}
        if rest["tokens"].shape[0] == 0:
            raise ConfigError("--rollouts: 1 with gspo.updates_per_rollout 1 leaves no sequence "
                              "to measure s_i on; pass --rollouts 2 or more")
        temperature = cfg.rollout.temperature
        old = (trainer.score_log_probs(rest, temperature=temperature)
               if cfg.gspo.old_logprobs == "recompute" else rest["rollout_log_probs"])
        update = trainer.train_rollout(select_rows(batches[0], update_rows), 1)
        new = trainer.score_log_probs(rest, temperature=temperature)
        mask = rest["response_mask"]
        log_s = sequence_log_ratio(new.double(), old.double(), mask)
        if cfg.gspo.variant == "seq_ratio_unnormalized":  # s_i = exp(sum_t), not the mean
            log_s = log_s * mask.sum(-1).double()
        keep = mask.any(-1)
        s, advantages = torch.exp(log_s[keep]), rest["advantages"][keep]
        if dist.get_rank() != 0:
            return 0
        result = calibrate_clip_range(s, advantages, target, split=split,
                                      eps_low_ref=cfg.gspo.eps_low, eps_high_ref=cfg.gspo.eps_high)
        report = {"target_clip_frac": target, "split": split, "num_sequences": result.num_sequences,
                  "update_sequences": int(size), "lr": update.get("lr"),
                  "s_quantiles": ratio_quantiles(s),
                  "log_s_std": float(torch.log(s).std(unbiased=False)),
                  "eps_low": result.eps_low, "eps_high": result.eps_high,
                  "clip_frac_low": result.clip_frac_low, "clip_frac_high": result.clip_frac_high,
                  "clip_frac": result.clip_frac, "max_clip_frac": result.max_clip_frac,
                  "configured": {"eps_low": cfg.gspo.eps_low, "eps_high": cfg.gspo.eps_high},
                  "sequences": {"s": s.tolist(), "advantage": advantages.double().tolist()}}
        path = Path(session_cfg.run.output_dir) / "calibration.json"
        path.write_text(json.dumps(report, indent=2))
        print(_describe(report, path), flush=True)
    return 0


def _describe(report: dict, path: Path) -> str:
    q = "  ".join(f"p{round(level * 100):g} {value:.6g}"
                  for level, value in report["s_quantiles"].items())
    lines = [
        f"s_i after one update (lr {report['lr']:.3g}, on {report['update_sequences']} "
        f"sequences), over {report['num_sequences']} other sequences:",
        f"  quantiles: {q}",
        f"  std of log s_i: {report['log_s_std']:.4g}",
        f"for a clip fraction of {report['target_clip_frac']:g} ({report['split']} split):",
        f"  gspo.eps_low: {report['eps_low']:.4g}   gspo.eps_high: {report['eps_high']:.4g}",
        f"  (clips {report['clip_frac_low']:.4f} low + {report['clip_frac_high']:.4f} high; "
        f"configured: {report['configured']['eps_low']:g} / {report['configured']['eps_high']:g})",
        f"written to {path}",
    ]
    if max(report["eps_low"], report["eps_high"]) >= 1:
        lines.append("  note: a range >= 1 is outside what gspo.eps_* accept (0, 1): the ratios "
                     "vary too much for this target")
    return "\n".join(lines)
