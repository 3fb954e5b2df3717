"""Issue 22, item 8: a single-rank run whose launcher gave no MASTER_PORT took the fixed 29500;
when another run held it: an OSError traceback, exit 1. Its store now takes a free port (no
other rank has to find it), as torchrun --standalone picks one for a local multi-rank run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    import os
    import torch.distributed as dist
    from megatron_gspo import parallel
    control = parallel.init_distributed()
    print("port", os.environ["MASTER_PORT"], dist.get_world_size(), flush=True)
    dist.destroy_process_group()
""")


def _env(**extra: str) -> dict:
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"}
    return dict({k: v for k, v in os.environ.items() if k not in drop}, CUDA_VISIBLE_DEVICES="",
                **extra)


def _hold(port: int) -> socket.socket | None:
    """Listen on 127.0.0.1:``port`` (None when someone else already does: taken either way)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
    except OSError:
        sock.close()
        return None
    return sock


def test_a_single_rank_starts_when_29500_is_taken():
    held = _hold(29500)
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(),
                              capture_output=True, text=True, timeout=180)
    finally:
        if held is not None:
            held.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    port = int(words[words.index("port") + 1])
    assert port != 29500 and words[-1] == "1", proc.stdout


def test_a_given_master_port_is_still_used():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(MASTER_PORT=str(free)),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"port {free} 1" in proc.stdout, proc.stdout
