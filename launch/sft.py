"""``megatron-gspo sft``: cold-start supervised fine-tuning of the policy on Megatron.

Run on one machine (the ranks are started for you)::

    megatron-gspo sft --config launch/configs/tiny_cpu.yaml
    megatron-gspo sft --config launch/configs/tiny_cpu.yaml --set run.num_steps=10 --nproc 2

or under torchrun / srun, one process per rank. Writes ``<run.output_dir>/metrics.jsonl`` and
TensorBoard logs, prints one line per step, writes the trained policy as a Hugging Face directory
``<run.output_dir>/hf`` (the ``run.init_from`` of a GSPO run), and ends with
``held-out loss: <first> -> <last>``.

``run.init_from`` starts from a Hugging Face directory or a Megatron checkpoint instead of the
``run.seed`` initialisation. With ``run.save_interval`` > 0 checkpoints go to
``<run.output_dir>/checkpoints`` every save_interval steps and at the last; ``--resume`` continues
from the newest one (model, optimizer, LR schedule, RNG, data position, step), or says that there
is none and starts at step 0. Input errors are found before the ranks start (``launch.preflight``:
exit 2, one message); one run per ``run.output_dir`` (``launch.run_lock``).

SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 - to this command, to torchrun, to a rank, or to all of them
at once - finish the current step, save its checkpoint (also with ``run.save_interval`` 0) and
exit with status 75 at every level, without writing ``hf``; ``--resume`` continues right after
it, drawing the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch import local, preflight
from launch.common import add_config_args, load_from_args
from launch.session import Session
from megatron_gspo import parallel
from megatron_gspo.hf.export import export_hf_dir
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.tasks import PAD_ID, write_byte_tokenizer
from pipeline.signals import PREEMPTED_EXIT_CODE
from pipeline.step.sft_loop import run_sft


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "sft", help="supervised fine-tuning (cold start) of the policy on Megatron",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in run.output_dir (if there is one)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks to start when not launched by torchrun/srun "
                        "(default: the smallest world the parallel layout needs)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_from_args(args)

    world = args.nproc or parallel.minimal_world_size(cfg.parallel)

    preflight.before_ranks(cfg, program="sft", world_size=world,
                           resume=args.resume)  # input errors: exit 2 here
    code = local.ensure_ranks(argv, world, log_dir=Path(cfg.run.output_dir) / "logs")
    if code is not None:
        return code

    with SFTSession(cfg, resume=args.resume) as session:
        return session.run()


class SFTSession(Session):
    """One SFT session on one training rank (the start, run lock, signals and resources of
    :class:`launch.session.Session`, as ``train``'s ``RLSession``)."""

    def run(self) -> int:
        """Build the trainer (resumed with ``--resume``), run the SFT loop, export the policy;
        returns the exit status (0, or 75 after a stop signal)."""
        from megatron_gspo.train.sft import SFTTrainer  # imports Megatron: not for --help

        cfg, is_main = self.cfg, self.is_main
        latest = self.checkpoint_to_resume()
        logger = MetricsLogger.from_config(cfg, cfg.run.output_dir, enabled=is_main)
        self.resources.callback(logger.close)
        trainer = SFTTrainer(cfg, self.pg, pad_id=PAD_ID)
        start_step, run_state = 0, None
        if latest is not None:
            run_state = trainer.load(latest)
            start_step = int(run_state["step"])
            self.say_resumed(latest, start_step)
        result = run_sft(trainer, cfg, logger=logger, start_step=start_step,
                         run_state=run_state, stop=self.stop)
        logger.close()
        if result.preempted:
            if is_main:
                print(f"preempted: checkpoint saved; exit {PREEMPTED_EXIT_CODE}", flush=True)
            return PREEMPTED_EXIT_CODE

        hf_dir = Path(cfg.run.output_dir) / "hf"
        export_hf_dir(trainer.current_policy(), cfg.model, self.pg, hf_dir,
                      tokenizer_dir=cfg.data.tokenizer_dir)
        if is_main and cfg.data.tokenizer_dir is None:
            write_byte_tokenizer(hf_dir)
            print(f"policy written to {hf_dir}")
        if is_main and result.losses:
            print(f"train loss: {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
            if result.eval_losses:
                print(f"held-out loss: {result.eval_losses[0]:.4f} -> "
                      f"{result.eval_losses[-1]:.4f}", flush=True)
        return 0
