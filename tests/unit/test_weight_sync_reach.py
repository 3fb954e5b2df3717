"""Issue 37, item 3: ``rollout.weight_sync.transport: tensor`` (CUDA-IPC / shared-memory handles,
which open only on the node that made them) is refused before anything starts wherever the
servers or the ranks are on another node (``launch.weight_sync_reach``): ``train`` with ranks on
several nodes or with an external router whose workers are elsewhere, and every layout ``launch
slurm`` renders (tests/slurm/test_render.py's bad-layout cases). One line naming the field, exit 2.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from launch import cli, local, weight_sync_reach
from megatron_gspo.config import ConfigError, load_config

CONFIG = "launch/configs/tiny_cpu.yaml"
FAR = "http://192.0.2.7:30000"  # TEST-NET-1 (RFC 5737): never an address of this machine


def test_only_this_nodes_addresses_count_as_this_node():
    assert weight_sync_reach.nonlocal_servers(
        ["http://127.0.0.1:31000", "http://localhost:31002", "http://0.0.0.0:31004", FAR,
         "http://no-such-host.invalid:31006"]) == [FAR, "http://no-such-host.invalid:31006"]


@pytest.mark.parametrize("env, nodes", [
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_NODES": "2"}, 2),   # srun
    ({"GROUP_WORLD_SIZE": "4", "RANK": "0"}, 4),               # torchrun, 4 agents
])
def test_a_world_on_several_nodes_is_refused_for_tensor_only(env, nodes):
    tensor = load_config(CONFIG, ["rollout.weight_sync.transport=tensor"])
    with pytest.raises(ConfigError, match=rf"^rollout\.weight_sync\.transport: tensor with "
                                          rf"training ranks on {nodes} nodes"):
        weight_sync_reach.check_world(tensor, env)
    weight_sync_reach.check_world(tensor, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_NODES": "1"})
    weight_sync_reach.check_world(load_config(CONFIG, ["rollout.weight_sync.transport=distributed"]),
                                  env)


class _Router(http.server.BaseHTTPRequestHandler):
    workers: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"workers": [{"url": u} for u in self.workers]} if self.path == "/workers"
                          else {}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def router():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Router
    server.shutdown()
    server.server_close()


def test_train_refuses_an_external_router_whose_workers_are_on_another_node(
        router, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(local, "ensure_ranks", lambda *a, **k: pytest.fail("ranks were started"))
    url, handler = router
    handler.workers = ["http://127.0.0.1:31000", FAR]
    argv = ["train", "--config", CONFIG, "--set", f"run.output_dir={tmp_path / 'run'}",
            "--set", "rollout.mode=external", "--set", f"rollout.router_url={url}",
            "--set", "rollout.weight_sync.transport=tensor"]
    assert cli.main(argv) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("megatron-gspo train: "), err
    assert (f"rollout.weight_sync.transport: tensor with rollout server(s) {FAR} on another node"
            in err[0]), err
    # config validates the file, often on another machine than the job's: a note, exit 0
    assert cli.main(["config", *argv[1:]]) == 0
    out = capfd.readouterr().out
    assert "# note: rollout.weight_sync.transport: tensor works only with every training rank " \
           "and every rollout server on one node" in out
