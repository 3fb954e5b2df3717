"""The local server's ``--device`` (``rollout.local_server_device``): where its model runs.

On this CPU machine: the option is validated (a clear error for CUDA without a GPU and for an
unknown device, naming the flag or the config field), the server reports the device it runs on
in ``/server_info``, and the embedded run passes the config field on to its servers. The CUDA
path itself runs in tests/gpu/test_gpu_smoke.py (bench/gpu_smoke.py: the rollout server on the
GPU), skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import ConfigError, config_from_dict
from pipeline.local.engine import LocalEngine


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match=r"--device cuda: torch .* sees no CUDA device"):
        LocalEngine(str(model_dir), device="cuda")


def test_an_unknown_device_is_refused(model_dir):
    with pytest.raises((ValueError, RuntimeError), match=r"tpu"):
        LocalEngine(str(model_dir), device="tpu")


def test_the_engine_runs_where_it_is_told_and_the_server_says_so(local_server):
    from pipeline.generation.client import http_json

    status, info = http_json("GET", local_server.url + "/server_info")
    assert status == 200 and info["device"] == "cpu"
    assert next(local_server.server.engine.model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("value, ok", [("cpu", True), ("cuda", True), ("cuda:1", True),
                                       ("gpu", False), ("cuda:x", False)])
def test_config_field_is_validated(value, ok):
    cfg = {"rollout": {"local_server_device": value}}
    if ok:
        assert config_from_dict(cfg).rollout.local_server_device == value
    else:
        with pytest.raises(ConfigError, match="rollout.local_server_device"):
            config_from_dict(cfg)


def test_embedded_servers_get_the_configured_device(monkeypatch, tmp_path):
    import pipeline.engines.sglang
    from launch.rl_session import RLSession
    from pipeline.engines.choice import engine

    seen = {}

    class Recorder:
        def __init__(self, model_path, num_servers, **kwargs):
            seen.update(kwargs)

        def start(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(pipeline.engines.sglang, "LocalRolloutCluster", Recorder)  # where it is used
    cfg = config_from_dict({"rollout": {"local_server_device": "cuda:0"},
                            "run": {"output_dir": str(tmp_path)}})
    session = RLSession.__new__(RLSession)
    session.cfg, session.run_dir, session.engine = cfg, tmp_path, engine("sglang")
    from contextlib import ExitStack
    session.resources = ExitStack()
    session._start_local_servers("/some/model")
    args = seen["server_args"]
    assert args[args.index("--device") + 1] == "cuda:0"
