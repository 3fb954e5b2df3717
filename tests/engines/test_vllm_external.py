"""Issue 36, item 4: ``rollout.mode: external`` with vLLM servers. The run takes a list of servers
(``rollout.server_urls``) or a router that names them (``GET /workers``), and refuses, before a
rank starts (exit 2, one line naming the field), servers it cannot use: not vLLM, another vLLM
release, no development endpoints (``VLLM_SERVER_DEV_MODE``), no scale-out generate, another
worker extension, no routed experts for routing replay (``pipeline.engines.vllm.probe``). An
embedded vLLM run on the CPU refuses routing replay ``rollout`` and head sizes vLLM's CPU attention
lacks before it starts a server (``train``'s check, ``VllmEngine.check``); an external run
leaves that to the probe of its servers, which may be GPUs.

The servers here replay the answers a real vLLM 0.32 server gave (tests/engines/recorded/,
recorded from servers started by ``pipeline.engines.vllm.server_args``); the router is a stub
that lists them. Unit tier (each test < 1 s)."""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import cli, local, preflight
from launch.rl_session import external_endpoints
from megatron_gspo.config import ConfigError, load_config
from pipeline.engines.vllm import probe
from pipeline.servers.cluster import free_port

RECORDED = json.loads((Path(__file__).with_name("recorded") / "vllm_0.32_probe.json").read_text())
CONFIG = "launch/configs/tiny_cpu.yaml"


class Replay(ThreadingHTTPServer):
    """A vLLM 0.32 server as far as the probe sees it: ``answers`` maps (method, path) to
    (status, body); what is not there answers 404 as vLLM does."""

    def __init__(self, answers: dict):
        self.answers = answers
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()


class _Handler(BaseHTTPRequestHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        status, body = self.server.answers.get((self.command, self.path),
                                               (404, {"detail": "Not Found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def vllm_answers(changes: dict = None) -> dict:
    answers = {
        ("GET", "/health"): (200, None),
        ("GET", "/version"): (200, RECORDED["version"]),
        ("GET", "/server_info?config_format=json"): (200, copy.deepcopy(RECORDED["server_info"])),
        ("POST", "/inference/v1/generate"): (400, RECORDED["generate_empty_body"]),
    }
    answers.update(changes or {})
    return answers


@pytest.fixture()
def servers():
    started = []

    def start(answers):
        server = Replay(answers)
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def _cfg(*sets):
    return load_config(CONFIG, ["rollout.engine=vllm", *sets])


def test_a_server_started_by_server_args_is_usable(servers):
    good = servers(vllm_answers())
    assert probe.server_problems(good.url, _cfg()) == []


def test_each_missing_piece_is_named_with_its_fix(servers):
    info = copy.deepcopy(RECORDED["server_info"])
    info["vllm_config"]["parallel_config"]["worker_extension_cls"] = ""
    cases = [
        (vllm_answers({("GET", "/server_info?config_format=json"):
                         (404, RECORDED["server_info_without_dev_mode"])}),
         "start it with VLLM_SERVER_DEV_MODE=1"),
        (vllm_answers({("POST", "/inference/v1/generate"):
                         (403, RECORDED["generate_without_scale_out"])}),
         "(HTTP 403); start it with --enable-scale-out"),
        (vllm_answers({("GET", "/server_info?config_format=json"): (200, info)}),
         "runs the worker extension none; start it with --worker-extension-cls "
         "pipeline.engines.vllm.worker_extension.WeightSyncExtension"),
        (vllm_answers({("GET", "/version"): (200, {"version": "0.31.2"})}),
         "runs vLLM 0.31.2; the project speaks vLLM 0.32's API"),
        ({("GET", "/health"): (200, None)}, "does not answer vLLM's /version (HTTP 404): not a "
                                            "vLLM server"),  # an SGLang server
    ]
    for answers, message in cases:
        server = servers(answers)
        problems = probe.server_problems(server.url, _cfg())
        assert len(problems) == 1 and message in problems[0], problems


def test_routing_replay_needs_a_server_that_records_routed_experts(servers):
    cfg = _cfg("gspo.routing_replay=rollout", "rollout.local_server_device=cuda")
    plain = servers(vllm_answers())
    (problem,) = probe.server_problems(plain.url, cfg)
    assert "--enable-return-routed-experts" in problem
    info = copy.deepcopy(RECORDED["server_info"])
    info["vllm_config"]["aux_output_config"]["enable_return_routed_experts"] = True
    recording = servers(vllm_answers({("GET", "/server_info?config_format=json"): (200, info)}))
    assert probe.server_problems(recording.url, cfg) == []


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    (problem,) = probe.server_problems(url, _cfg(), timeout_s=2)
    assert problem.startswith(f"{url} is not reachable within 2 s")


def _external(*sets):
    return _cfg("rollout.mode=external", *sets)


def test_preflight_checks_the_listed_servers_and_the_routers_workers(servers):
    good = servers(vllm_answers())
    bad = servers(vllm_answers({("POST", "/inference/v1/generate"):
                                  (403, RECORDED["generate_without_scale_out"])}))
    preflight.check_external(_external(f"rollout.server_urls=[{good.url}]"))
    with pytest.raises(ConfigError, match=r"^rollout\.server_urls: 1 problem\(s\) with the vLLM "
                                          r"servers .*--enable-scale-out"):
        preflight.check_external(_external(f"rollout.server_urls=[{good.url}, {bad.url}]"))
    workers = {"workers": [{"url": good.url}, {"url": bad.url}]}
    router = servers({("GET", "/health"): (200, None), ("GET", "/workers"): (200, workers)})
    with pytest.raises(ConfigError, match=r"^rollout\.router_url: 1 problem\(s\) .*" + bad.url):
        preflight.check_external(_external(f"rollout.router_url={router.url}"))
    empty = servers({("GET", "/health"): (200, None), ("GET", "/workers"): (200, {"workers": []})})
    with pytest.raises(ConfigError, match=r"^rollout\.router_url: .* lists no workers"):
        preflight.check_external(_external(f"rollout.router_url={empty.url}"))


def test_sglang_server_lists_are_checked_for_reachability_only(servers):
    sglang = servers({("GET", "/health"): (200, None)})
    cfg = load_config(CONFIG, ["rollout.mode=external", f"rollout.server_urls=[{sglang.url}]"])
    preflight.check_external(cfg)
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = load_config(CONFIG, ["rollout.mode=external", f"rollout.server_urls=[{dead}]"])
    with pytest.raises(ConfigError, match=rf"^rollout\.server_urls: {dead} is not reachable"):
        preflight.check_external(cfg)


def test_train_refuses_unusable_vllm_servers_before_the_ranks(servers, capfd, monkeypatch,
                                                              tmp_path):
    def started(*args, **kwargs):
        raise AssertionError("ranks were started: the input error was not found before")

    monkeypatch.setattr(local, "ensure_ranks", started)
    bad = servers(vllm_answers({("GET", "/server_info?config_format=json"):
                                  (404, RECORDED["server_info_without_dev_mode"])}))
    code = cli.main(["train", "--config", CONFIG, "--set", f"run.output_dir={tmp_path / 'run'}",
                     "--set", "rollout.engine=vllm", "--set", "rollout.mode=external",
                     "--set", f"rollout.server_urls=[{bad.url}]"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "rollout.server_urls" in lines[0] and "VLLM_SERVER_DEV_MODE=1" in lines[0]


@pytest.mark.parametrize("sets, message", [
    (["gspo.routing_replay=rollout"], r"gspo\.routing_replay: 'rollout' needs .* only on GPUs"),
    (["model.head_dim=24"], r"model\.head_dim: 24 is not a head size vLLM 0\.32\.0's CPU "),
])
def test_an_embedded_cpu_vllm_run_refuses_what_vllm_cannot_serve_before_starting(
        sets, message, capfd, monkeypatch, tmp_path):
    monkeypatch.setattr(local, "ensure_ranks", lambda *a, **k: pytest.fail("ranks started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU, on any machine
    argv = ["train", "--config", CONFIG, "--set", "rollout.engine=vllm"]
    for item in [f"run.output_dir={tmp_path / 'run'}", *sets]:
        argv += ["--set", item]
    assert cli.main(argv) == 2
    assert re.search(message, capfd.readouterr().err)


def test_config_fields_of_external_mode():
    with pytest.raises(ConfigError, match=r"exactly one of .* got both"):
        load_config(CONFIG, ["rollout.mode=external", "rollout.router_url=http://r:1",
                             "rollout.server_urls=[http://a:1]"])
    with pytest.raises(ConfigError, match=r": rollout\.server_urls: only with rollout\.mode "
                                          r"external"):
        load_config(CONFIG, ["rollout.server_urls=[http://a:1]"])
    with pytest.raises(ConfigError, match=r": rollout\.server_urls: 'a:1' is not a server's base "
                                          r"URL"):
        load_config(CONFIG, ["rollout.mode=external", "rollout.server_urls=[a:1]"])
    with pytest.raises(ConfigError, match=r": rollout\.server_urls: a server is listed twice"):
        load_config(CONFIG, ["rollout.mode=external",
                             "rollout.server_urls=[http://a:1, http://a:1]"])


def test_the_client_routes_over_vllm_servers_itself(servers):
    workers = {"workers": [{"url": "http://a:1"}, {"url": "http://b:2"}]}
    router = servers({("GET", "/workers"): (200, workers)})
    listed = SimpleNamespace(server_urls=["http://a:1"], router_url=None, engine="vllm")
    assert external_endpoints(listed) == (None, ["http://a:1"])
    via_router = SimpleNamespace(server_urls=None, router_url=router.url, engine="vllm")
    assert external_endpoints(via_router) == (None, ["http://a:1", "http://b:2"])
    sglang = SimpleNamespace(server_urls=None, router_url=router.url, engine="sglang")
    assert external_endpoints(sglang) == (router.url, None)
