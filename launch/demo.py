"""``megatron-gspo demo``: the whole pipeline in miniature on one CPU machine.

1. cold-start SFT of a tiny Qwen3-style MoE on generated additions (2 Megatron ranks, EP2);
2. GSPO from the SFT policy: 2 training ranks (EP2), 2 local rollout servers behind the real
   sglang-router, weights synced to the servers after every step, held-out evaluation;
3. plots of the run (reward, clip fractions, log s_i, length, entropy, mismatch).

It ends with ``held-out reward: SFT <x> -> GSPO <y>``: the mean held-out reward of the SFT policy
(GSPO step 0) and of the final policy. Outputs go to ``--out`` (default runs/demo).

``--engine vllm`` generates the rollouts with real vLLM 0.32 servers instead of the project's own
(``rollout.engine: vllm``, docs/vllm.md): one vLLM server started from the vLLM environment
(``launch/envs/vllm_cpu.sh`` builds it into ``.venv-vllm``; ``$MGSPO_VLLM_PYTHON`` names another),
the weights pushed into it after every step through the project's worker extension; the same
model (its head_dim 32 is a head size vLLM's CPU attention runs), the same SFT stage and the
same final line. Out: runs/demo_vllm.

``--task tools`` runs the multi-turn demo instead (docs/tools.md): sums of two 5-digit numbers,
which the tiny model cannot add token by token, with a calculator tool (``pipeline.scoring.tasks:add``)
run in the sandbox; SFT on reference trajectories that call it (the call format), then GSPO on
multi-turn trajectories (launch/configs/tiny_cpu_tools*.yaml, out: runs/demo_tools). It ends with
the same line and then ``tool calls per trajectory: <z>`` (held-out, final policy).

Each stage is a ``megatron-gspo`` command of its own (in a session of its own; it gets SIGTERM if
this process dies). SIGTERM, SIGINT (Ctrl-C), SIGUSR1 and SIGHUP (as SIGTERM) are passed on to the
stage that runs, which checkpoints and exits 75; the demo then stops with that stage's status
(75, or whatever it exited with) and starts no further stage. A signal between two stages stops
the demo with 75 before the next one starts.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from megatron_gspo.lifetime import die_with_parent
from pipeline.observe.metrics import read_metrics

CONFIGS = Path(__file__).resolve().parent / "configs"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="SFT then GSPO on a tiny MoE on this machine, with plots",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=sorted(TASK_CONFIGS), default="addition",
                   help="addition: one prompt, one response (default); tools: multi-turn "
                        "trajectories with a calculator tool (docs/tools.md)")
    p.add_argument("--engine", choices=sorted(ENGINE_SETTINGS), default="sglang",
                   help="the rollout engine: sglang (the project's own servers speaking SGLang's "
                        "protocol, default) or vllm (real vLLM servers from the environment "
                        "launch/envs/vllm_cpu.sh builds; docs/vllm.md)")
    p.add_argument("--config", default=None,
                   help="GSPO run configuration (default: launch/configs/tiny_cpu.yaml, "
                        "--task tools: tiny_cpu_tools.yaml)")
    p.add_argument("--sft-config", default=None,
                   help="SFT configuration (default: launch/configs/tiny_cpu_sft.yaml, "
                        "--task tools: tiny_cpu_tools_sft.yaml)")
    p.add_argument("--out", default=None,
                   help="output directory (default: runs/demo, --task tools: runs/demo_tools)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override a GSPO setting (repeatable)")
    p.set_defaults(func=main)


TASK_CONFIGS = {"addition": ("tiny_cpu.yaml", "tiny_cpu_sft.yaml", "runs/demo"),
                "tools": ("tiny_cpu_tools.yaml", "tiny_cpu_tools_sft.yaml", "runs/demo_tools")}
"""``--task`` -> (GSPO config, SFT config, output directory) by default."""

ENGINE_SETTINGS = {
    "sglang": (),
    # one vLLM server: each is ~3 GB and pins its threads to the first core (vLLM's CPU default)
    "vllm": ("rollout.engine=vllm", "rollout.num_servers=1"),
}
"""``--engine`` -> the GSPO settings it adds (before ``--set``, which can override them)."""
OUT_SUFFIX = {"sglang": "", "vllm": "_vllm"}
"""``--engine`` -> the default output directory's suffix (runs/demo_vllm)."""

FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
             signal.SIGUSR1: signal.SIGUSR1, signal.SIGHUP: signal.SIGTERM}
"""Signal the demo receives -> signal it sends the running stage."""


class Stopped(SystemExit):
    """A stop signal ended the demo; ``code`` is its exit status."""


def _stage_preexec() -> None:
    die_with_parent(signal.SIGTERM)  # the demo gone: the stage stops as on a signal


class Stages:
    """Runs the demo's stages one at a time and passes the stop signals on to the one running."""

    def __init__(self):
        self.proc: Optional[subprocess.Popen] = None
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def __enter__(self) -> "Stages":
        self._previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.proc is not None and self.proc.poll() is None:  # an error here: stop the stage
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait()

    def _forward(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(FORWARDED[signum])
            except ProcessLookupError:
                pass

    def run(self, cmd: list[str]) -> None:
        if self.signum is not None:
            raise Stopped(self._stopped_message(f"before megatron-gspo {cmd[0]}", 75))
        print("+ megatron-gspo " + " ".join(cmd), flush=True)
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *cmd],
                                     start_new_session=True, preexec_fn=_stage_preexec)
        code = self.proc.wait()  # a handled signal interrupts nothing here (PEP 475)
        self.proc = None
        if self.signum is not None:
            raise Stopped(self._stopped_message(f"during megatron-gspo {cmd[0]}", code or 75))
        if code != 0:
            raise SystemExit(f"megatron-gspo {cmd[0]} failed with exit status {code}")

    def _stopped_message(self, where: str, code: int) -> int:
        what = "checkpoint saved" if code == 75 else f"exit status {code}"
        print(f"megatron-gspo demo: stopped by {signal.Signals(self.signum).name} {where} "
              f"({what}); exit {code}", file=sys.stderr, flush=True)
        return code


def main(args: argparse.Namespace, argv: list[str]) -> int:
    config, sft_config, default_out = TASK_CONFIGS[args.task]
    config = args.config or str(CONFIGS / config)
    sft_config = args.sft_config or str(CONFIGS / sft_config)
    out = Path(args.out or default_out + OUT_SUFFIX[args.engine])
    if (out / "gspo" / "checkpoints").exists() or (out / "sft").exists():
        raise SystemExit(f"{out} already holds a demo run: choose another --out or remove it")
    sft = ["sft", "--config", sft_config, "--set", f"run.output_dir={out / 'sft'}"]
    gspo = ["train", "--config", config, "--set", f"run.output_dir={out / 'gspo'}",
            "--set", f"run.init_from={out / 'sft' / 'hf'}"]
    for override in (*ENGINE_SETTINGS[args.engine], *args.overrides):
        gspo += ["--set", override]
    try:
        with Stages() as stages:
            stages.run(sft)
            stages.run(gspo)
            stages.run(["plot", str(out / "gspo")])
    except Stopped as stopped:
        return int(stopped.code)
    evals = [r for r in read_metrics(out / "gspo") if "eval/reward_mean" in r]
    if len(evals) < 2 or evals[0]["step"] != 0:
        raise SystemExit("the GSPO run logged no held-out evaluation at step 0 and at the end")
    print(f"held-out reward: SFT {evals[0]['eval/reward_mean']:.3f} -> "
          f"GSPO {evals[-1]['eval/reward_mean']:.3f}", flush=True)
    if "eval/tool_calls/mean" in evals[-1]:  # multi-turn: the final policy's held-out trajectories
        print(f"tool calls per trajectory: {evals[-1]['eval/tool_calls/mean']:.2f}", flush=True)
    return 0
