"""A real Slurm for the launcher's tests: one controller and three virtual nodes on this machine.

The session fixture ``local_slurm`` runs ``tests/slurm/local_slurm_up.sh`` (it installs the
Debian packages when they are missing; the script's header lists its settings) with a private
directory, port block and node names, and always runs ``local_slurm_down.sh`` at the end. Three
nodes, because every component of a heterogeneous job needs a node of its own: the rollout
component gets one, the training component two (one gloo rank each).

If Slurm cannot start (not root, apt unreachable) every test that needs it
*fails* with the reason; nothing is skipped silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.slurm.local_slurm import LocalSlurm, free_port_block

SCRIPTS = Path(__file__).resolve().parent  # local_slurm_up.sh / local_slurm_down.sh
NUM_NODES = 3


@pytest.fixture(scope="session")
def local_slurm():
    up, down = SCRIPTS / "local_slurm_up.sh", SCRIPTS / "local_slurm_down.sh"
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests need root: local_slurm_up.sh installs and starts slurmctld, "
                    "slurmd and munged")
    # munged needs o+x on every directory above its socket, so not under pytest's 0700 tmp dirs
    directory = Path(tempfile.mkdtemp(prefix="megatron-gspo-slurm-", dir="/tmp"))
    directory.chmod(0o755)
    # 8 CPUs per virtual node: test_slurm_jobs.py runs three het jobs side by side (each takes 2
    # CPUs of the rollout node and 1 of each training node); cred_expire 5 s (the minimum) makes
    # a requeued job start again sooner
    env = dict(os.environ, LOCAL_SLURM_DIR=str(directory), LOCAL_SLURM_NODES=str(NUM_NODES),
               LOCAL_SLURM_CPUS="8", LOCAL_SLURM_CRED_EXPIRE="5",
               LOCAL_SLURM_PORT=str(free_port_block(NUM_NODES + 1)),
               LOCAL_SLURM_PREFIX=f"gs{os.getpid()}n",  # names of our own in /etc/hosts
               LOCAL_SLURM_PURGE="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    try:
        t0 = time.monotonic()
        proc = subprocess.run(["bash", str(up)], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"local_slurm_up.sh failed with status {proc.returncode} (Slurm could "
                        f"not start):\n{proc.stderr[-6000:]}")
        env["SLURM_CONF"] = str(directory / "etc" / "slurm.conf")
        # KillWait: Slurm's default 30 s instead of the script's 5 s. On SIGTERM (scontrol
        # requeue, preemption) the trainer finishes its step and checkpoints before SIGKILL.
        conf = Path(env["SLURM_CONF"])
        conf.write_text(re.sub(r"(?m)^KillWait=\d+$", "KillWait=30", conf.read_text()))
        subprocess.run(["scontrol", "reconfigure"], env=env, check=True, timeout=60)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], env=env, capture_output=True,
                               text=True, check=True, timeout=30).stdout.split()
        print(f"local Slurm up in {time.monotonic() - t0:.1f} s: {directory}, nodes {nodes}")
        yield LocalSlurm(directory=directory, env=env, nodes=sorted(set(nodes)))
    finally:
        subprocess.run(["bash", str(down)], env=env, capture_output=True, timeout=300)
        shutil.rmtree(directory, ignore_errors=True)
