"""A checkpoint's run state: ``run_state.json`` with placeholders, its tensors in
``run_state.safetensors`` (``megatron_gspo.train.checkpoint.run_state``), and the older forms the
sources still read (issue 37 item 7). The real save / load / manifest path:
tests/reliability/test_run_state_tensors.py."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from safetensors.torch import save

from megatron_gspo.train.checkpoint import CheckpointError
from megatron_gspo.train.checkpoint.run_state import (RUN_STATE, RUN_TENSORS, read_run_state,
                                                      tensor_bytes, write_run_state)
from pipeline.generation.trajectory import RolloutResult, Span, result_from_json, result_to_json
from pipeline.sources.saved import restored_batch


def _batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, 9, (4, 6), generator=gen),
            "rollout_log_probs": torch.randn(4, 6, generator=gen).to(torch.bfloat16),
            "response_mask": torch.rand(4, 6, generator=gen) > 0.5,
            "routed_experts": torch.randint(-1, 8, (4, 6, 2, 2), generator=gen, dtype=torch.int32)}


def _sample(routed) -> RolloutResult:
    return RolloutResult(rid="r", prompt_ids=[1, 2], output_ids=[3, 4], output_logprobs=[-0.5, -1.25],
                         finish_reason="stop", matched_stop=None, prompt_tokens=2,
                         completion_tokens=2, weight_version=3, server_url="u",
                         weight_versions=[Span(3, 0, 2)], routed_experts=routed)


def _state() -> dict:
    routed = torch.arange(3 * 2 * 2, dtype=torch.int32).reshape(3, 2, 2)
    return {"sampler": {"index": 4, "a/b~c": [1, 2]},
            "rollout_buffer": {"step": 3, "batch": _batch(), "metrics": {"reward_mean": 0.5}},
            "rollout_stream": {"complete": [{"results": [result_to_json(_sample(routed))]}]}}


def _manifest(directory) -> dict:
    return {"files": {p.name: {} for p in directory.iterdir()}}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_tensors_go_to_the_file_and_come_back_bit_for_bit(tmp_path):
    state = _state()
    write_run_state(tmp_path, 7, state)
    text = (tmp_path / RUN_STATE).read_text()
    placeholders = json.loads(text)
    assert placeholders["rollout_buffer"]["batch"]["routed_experts"] == {
        "__tensor__": "/rollout_buffer/batch/routed_experts"}
    assert placeholders["rollout_stream"]["complete"][0]["results"][0]["routed_experts"] == {
        "__tensor__": "/rollout_stream/complete/0/results/0/routed_experts"}
    assert (tmp_path / RUN_TENSORS).stat().st_size > tensor_bytes(state) > 0
    back = read_run_state(tmp_path, _manifest(tmp_path), tensors=True)
    assert back["step"] == 7 and _same({k: v for k, v in back.items() if k != "step"}, state)
    sample = result_from_json(back["rollout_stream"]["complete"][0]["results"][0])
    assert torch.equal(sample.routed_experts, state["rollout_stream"]["complete"][0]["results"][0][
        "routed_experts"])
    assert restored_batch(back["rollout_buffer"]["batch"]).keys() == _batch().keys()
    # ranks other than 0 leave the file alone: placeholders
    assert read_run_state(tmp_path, _manifest(tmp_path), tensors=False) == placeholders


def test_a_state_without_tensors_writes_no_tensor_file(tmp_path):
    write_run_state(tmp_path, 2, {"sampler": {"index": 8}})
    assert not (tmp_path / RUN_TENSORS).exists()
    assert read_run_state(tmp_path, _manifest(tmp_path), tensors=True) == {
        "step": 2, "sampler": {"index": 8}}


def test_a_tensor_file_the_manifest_lacks_or_a_missing_key_is_refused_naming_the_file(tmp_path):
    write_run_state(tmp_path, 1, _state())
    with pytest.raises(CheckpointError, match=rf"{RUN_TENSORS}: not in the checkpoint's manifest"):
        read_run_state(tmp_path, {"files": {RUN_STATE: {}}}, tensors=True)
    (tmp_path / RUN_TENSORS).write_bytes(save({"other": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=rf"{RUN_TENSORS}: has no tensor "
                                              r"'/rollout_buffer/batch/tokens'"):
        read_run_state(tmp_path, _manifest(tmp_path), tensors=True)
    (tmp_path / RUN_TENSORS).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=rf"{RUN_TENSORS}: unreadable"):
        read_run_state(tmp_path, _manifest(tmp_path), tensors=True)


def test_checkpoints_from_before_the_file_still_resume():
    """The one_step batch as base64 safetensors text, the stream's routed experts as lists."""
    batch = _batch()
    text = base64.b64encode(save({k: v.contiguous() for k, v in batch.items()})).decode("ascii")
    assert _same(restored_batch(text), batch)
    routed = torch.tensor([[[1, 2]], [[3, -1]]], dtype=torch.int32)
    old = {**result_to_json(_sample(None)), "routed_experts": routed.tolist()}
    assert torch.equal(result_from_json(json.loads(json.dumps(old))).routed_experts, routed)
    with pytest.raises(TypeError, match=r"\['note'\] are not tensors"):
        restored_batch({"note": "x"})
