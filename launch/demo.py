"""``megatron-gspo demo``: the whole pipeline in miniature on one CPU machine.

1. cold-start SFT of a tiny Qwen3-style MoE on generated additions (2 Megatron ranks, EP2);
2. GSPO from the SFT policy: 2 training ranks (EP2), 2 local rollout servers behind the real
   sglang-router, weights synced to the servers after every step, held-out evaluation;
3. plots of the run (reward, clip fractions, log s_i, length, entropy, mismatch).

It ends with ``held-out reward: SFT <x> -> GSPO <y>``: the mean held-out reward of the SFT policy
(GSPO step 0) and of the final policy. Outputs go to ``--out`` (default runs/demo).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="SFT then GSPO on a tiny MoE on this machine, with plots",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIGS / "tiny_cpu.yaml"),
                   help="GSPO run configuration (default: launch/configs/tiny_cpu.yaml)")
    p.add_argument("--sft-config", default=str(CONFIGS / "tiny_cpu_sft.yaml"),
                   help="SFT configuration (default: launch/configs/tiny_cpu_sft.yaml)")
    p.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a GSPO setting (repeatable)")
    p.set_defaults(func=main)


def _run(cmd: list[str]) -> None:
    print("+ megatron-gspo " + " ".join(cmd), flush=True)
    code = subprocess.call([sys.executable, "-m", "launch.cli", *cmd])
    if code != 0:
        raise SystemExit(f"megatron-gspo {cmd[0]} failed with exit status {code}")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    from pipeline.metrics import read_metrics

    out = Path(args.out)
    if (out / "gspo" / "checkpoints").exists() or (out / "sft").exists():
        raise SystemExit(f"{out} already holds a demo run: choose another --out or remove it")
    _run(["sft", "--config", args.sft_config, "--set", f"run.output_dir={out / 'sft'}"])
    gspo = ["train", "--config", args.config, "--set", f"run.output_dir={out / 'gspo'}",
            "--set", f"run.init_from={out / 'sft' / 'hf'}"]
    for override in args.overrides:
        gspo += ["--set", override]
    _run(gspo)
    _run(["plot", str(out / "gspo")])
    evals = [(r["step"], r["eval/reward_mean"]) for r in read_metrics(out / "gspo")
             if "eval/reward_mean" in r]
    if len(evals) < 2 or evals[0][0] != 0:
        raise SystemExit("the GSPO run logged no held-out evaluation at step 0 and at the end")
    print(f"held-out reward: SFT {evals[0][1]:.3f} -> GSPO {evals[-1][1]:.3f}", flush=True)
    return 0
