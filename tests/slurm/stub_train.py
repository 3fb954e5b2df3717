"""A stand-in for ``megatron-gspo train`` that keeps the launcher's contract and nothing else.

Used by the launcher's own mechanics test (signals, requeue, ranks, router discovery) so that it
runs in seconds. Every rank: joins a gloo group through MASTER_ADDR/MASTER_PORT and
SLURM_PROCID/SLURM_NTASKS, reads the router's GET /workers; rank 0 appends one metrics record per
step to <run.output_dir>/metrics.jsonl and "checkpoints" the step to <run.output_dir>/checkpoints/
step. On SIGTERM/SIGUSR1 the ranks stop at the next step boundary and exit 75 (the contract in
slurm/lib.sh). ``--resume`` continues after the saved step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from megatron_gspo.config import load_config  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()
    cfg = load_config(args.config, args.overrides)
    stop = []
    signal.signal(signal.SIGUSR1, lambda s, f: stop.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    with urllib.request.urlopen(f"{cfg.rollout.router_url}/workers", timeout=10) as r:
        workers = json.load(r)["workers"]
    print(f"rank {rank}/{world} on {os.environ.get('SLURMD_NODENAME')} master "
          f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} workers "
          f"{sorted(w['url'] for w in workers)}", flush=True)

    out = Path(cfg.run.output_dir)
    ckpt = out / "checkpoints" / "step"
    start = int(ckpt.read_text()) + 1 if args.resume and ckpt.exists() else 1
    print(f"rank {rank}: starting at step {start}", flush=True)
    step_s = float(os.environ.get("STUB_STEP_S", "0.5"))
    for step in range(start, cfg.run.num_steps + 1):
        time.sleep(step_s)
        total = torch.tensor([float(step)])
        dist.all_reduce(total)
        if rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "reward": step / cfg.run.num_steps,
                                    "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}) + "\n")
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(str(step))
        flag = torch.tensor([float(bool(stop))])
        dist.all_reduce(flag)  # every rank stops after the same step
        if flag.item() and step < cfg.run.num_steps:
            print(f"rank {rank}: signal {stop}; checkpointed step {step}, exiting", flush=True)
            dist.destroy_process_group()
            return 75
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
