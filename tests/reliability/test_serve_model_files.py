"""Issue 38, item 6: bad model files given to the rollout server are one line, exit status 2.

The probe's ``megatron-gspo serve --model-path DIR`` on a directory whose safetensors file is
truncated died with transformers' raw ``SafetensorError`` traceback, and on weights whose shapes
do not match config.json with its ``ignore_mismatched_sizes`` error. Both commands of the server
(``megatron-gspo serve`` and ``python -m pipeline.local``, in this process: they fail before
anything is served) now refuse such a directory in one line naming the file, the tensor and the
shapes (:mod:`pipeline.local.model_files`); a weight no file holds is refused too (transformers
would serve it at random).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import uvicorn

from launch.cli import main as cli_main
from pipeline.local.__main__ import main as module_main
from tests.rollout.tiny import make_model_dir


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve_files") / "model")


@pytest.fixture()
def model_copy(good_dir, tmp_path):
    return shutil.copytree(good_dir, tmp_path / "model")


@pytest.fixture(autouse=True)
def _no_serving(monkeypatch):
    """A directory that passes must not make the test serve forever; the server's
    ``--cpu-threads`` must not stay this process's torch threads."""
    def serve_instead(self, *args, **kwargs):
        raise AssertionError("the model directory was loaded and served")
    monkeypatch.setattr(uvicorn.Server, "run", serve_instead)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _serve(capsys, model_dir) -> tuple[list[int], list[str]]:
    """Both commands' exit statuses and stderr on ``model_dir`` (a port nobody listens on)."""
    codes, errs = [], []
    for run, prog in ((cli_main, "serve"), (module_main, None)):
        args = ["--model-path", str(model_dir), "--port", "1"]
        codes.append(run(["serve", *args] if prog else args))
        errs.append(capsys.readouterr().err)
    return codes, errs


def test_truncated_safetensors_file_is_one_line_naming_it(model_copy, capsys):
    shard = model_copy / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    codes, errs = _serve(capsys, model_copy)
    assert codes == [2, 2], (codes, errs)
    for err, prog in zip(errs, ("megatron-gspo serve: ", "python -m pipeline.local: ")):
        assert err.count("\n") == 1 and err.startswith(prog), err
        assert f"--model-path {model_copy}: {shard}" in err and "truncated" in err, err
        assert "Traceback" not in err and "SafetensorError" not in err, err


def test_weights_that_do_not_match_config_json_are_named_with_their_shapes(model_copy, capsys):
    config_file = model_copy / "config.json"
    config = json.loads(config_file.read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    config["vocab_size"] = vocab + 40
    config_file.write_text(json.dumps(config))
    codes, errs = _serve(capsys, model_copy)
    assert codes == [2, 2], (codes, errs)
    for err in errs:
        assert err.count("\n") == 1, err
        assert "the weights do not match its config.json" in err, err
        assert (f"model.safetensors: model.embed_tokens.weight: shape [{vocab}, {hidden}] does "
                f"not match config.json's [{vocab + 40}, {hidden}]") in err, err
        assert "ignore_mismatched_sizes" not in err and "Traceback" not in err, err


def test_a_weight_in_no_file_is_refused(model_copy, capsys):
    from safetensors.torch import load_file, save_file

    shard = model_copy / "model.safetensors"
    tensors = load_file(shard)
    dropped = "model.layers.1.mlp.gate.weight"
    shape = list(tensors.pop(dropped).shape)
    save_file(tensors, shard, metadata={"format": "pt"})
    codes, errs = _serve(capsys, model_copy)
    assert codes == [2, 2], (codes, errs)
    assert all(f"{dropped}: in no file (shape {shape}" in err for err in errs), errs


def test_the_good_directory_passes_the_check(good_dir):
    from pipeline.local.model_files import check_model_dir, load_config

    check_model_dir(good_dir, load_config(good_dir))
