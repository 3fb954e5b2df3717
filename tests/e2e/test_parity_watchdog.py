"""The parity watchdog in a real GSPO session: it passes a faithful server and stops a faulty one.

One process drives two real sessions (``launch.rl_session.RLSession``: one training rank, real
Megatron-Core, embedded mode, one local rollout server behind the real sglang-router, the disk
weight sync without checksums, as against SGLang), 2 steps each, ``parity.enabled``:

* the faithful server: the run finishes; every sync's check (steps 0, 1, 2; the updates change
  the weights) is in metrics.jsonl with a mean gap at fp32 noise (Megatron vs transformers'
  Qwen3-MoE on the CPU), no re-sync;
* a server started with the fault-injection option ``--fault-perturb-weights`` (noise added to
  its weights after every update): the check after the initial sync notices, syncs once more,
  checks again and stops the run with ``ParityError`` naming the gap, the server's URL and the
  threshold; nothing is trained.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import ROOT

CONFIG = "launch/configs/tiny_cpu.yaml"
THRESHOLD = 1e-3

DRIVER = r'''
import json, os, sys

from launch.rl_session import RLSession
from pipeline.servers.cluster import free_port
from megatron_gspo.config import load_config


class FaultyServers(RLSession):
    def _start_local_servers(self, model_path):
        import pipeline.engines.sglang as session_module  # where the SGLang engine starts them

        real = session_module.LocalRolloutCluster

        def faulty(*args, server_args=(), **kwargs):
            return real(*args, server_args=[*server_args, "--fault-perturb-weights", "0.05"],
                        **kwargs)

        session_module.LocalRolloutCluster = faulty
        try:
            return super()._start_local_servers(model_path)
        finally:
            session_module.LocalRolloutCluster = real


for name, overrides in json.loads(sys.argv[2]):
    cfg = load_config(sys.argv[1], overrides)
    os.environ["MASTER_PORT"] = str(free_port())  # each session its own store
    session_type = FaultyServers if name == "faulty" else RLSession
    try:
        with session_type(cfg, resume=False) as session:
            code, error = session.run(), None
    except Exception as err:
        code, error = None, f"{type(err).__name__}: {err}"
    print("RESULT " + json.dumps({"name": name, "code": code, "error": error}), flush=True)
'''


def test_watchdog_passes_a_faithful_server_and_stops_a_perturbed_one(tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    common = ["parallel.expert=1", "rollout.num_servers=1", "rollout.weight_sync.verify=false",
              "run.global_batch_size=16", "run.micro_batch_size=8", "run.num_steps=2",
              "run.eval_interval=0", "run.save_interval=0", "parity.enabled=true",
              "parity.num_probes=4", f"parity.max_gap_mean={THRESHOLD}",
              # the random policy earns no reward (zero advantages): the entropy bonus makes
              # the updates change the weights, so each check sees a new policy
              "gspo.entropy_coef=0.05"]
    runs = [[name, [f"run.output_dir={tmp_path / name}", *common]] for name in ("good", "faulty")]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run([sys.executable, str(driver), CONFIG, json.dumps(runs)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    results = {r["name"]: r for r in (json.loads(line[len("RESULT "):])
                                      for line in proc.stdout.splitlines()
                                      if line.startswith("RESULT "))}
    assert proc.returncode == 0 and len(results) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]

    good = results["good"]
    assert good["code"] == 0 and good["error"] is None, good
    records = [json.loads(line) for line in (tmp_path / "good" / "metrics.jsonl").open()]
    checks = {r["step"]: r for r in records if "parity/logprob_gap_mean" in r}
    assert sorted(checks) == [0, 1, 2]
    for r in checks.values():
        assert r["parity/logprob_gap_mean"] < 1e-4, r  # fp32 on the CPU: ~1e-6
        assert r["parity/logprob_gap_max"] >= r["parity/logprob_gap_mean"] > 0
        assert r["parity/num_tokens"] > 0 and "parity/resyncs" not in r
    trained = [r for r in records if "train/grad_norm" in r]
    assert len(trained) == 2 and all(r["train/grad_norm"] > 0 for r in trained)
    probes = json.loads((tmp_path / "good" / "parity_probes.json").read_text())
    assert len(probes) == 4 and all(p["response_ids"] for p in probes)

    faulty = results["faulty"]
    assert faulty["code"] is None and faulty["error"].startswith("ParityError: rollout server "
                                                                 "http://127.0.0.1:"), faulty
    error = faulty["error"]
    assert f"exceeds parity.max_gap_mean {THRESHOLD:g}" in error
    assert "also after syncing the weights again" in error
    assert not (tmp_path / "faulty" / "metrics.jsonl").exists() or not any(
        "train/loss" in line for line in (tmp_path / "faulty" / "metrics.jsonl").open())
    assert "syncing the weights again" in proc.stdout
