"""Issue 36, item 4: vLLM's routed-experts output (``routed_experts`` of a choice: base64 ``.npy``,
uint8 / uint16 ``[prompt + output - 1, layers, top_k]``) read into the project's routing-replay
format (``pipeline.engines.vllm.routed_experts``), the same rows the training batch takes from
SGLang. Constructed payloads (numpy's ``.npy``, as vLLM's ``numpy2base64`` writes it) as unit
tests; one made by vLLM 0.32's own serving types in the vLLM environment (marked ``vllm``, ~6 s:
importing vLLM)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.engines.vllm import routed_experts as vre
from pipeline.engines.vllm.client import VllmWire
from pipeline.generation import routed_experts as project
from pipeline.generation.client import RolloutError, SamplingParams
from tests.engines import vllm_env

PROMPT, OUTPUT, LAYERS, TOP_K, EXPERTS = 5, 3, 2, 2, 4


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sample(rows: int = PROMPT + OUTPUT - 1, dtype: str = "uint8", experts: int = EXPERTS,
           seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, experts, size=(rows, LAYERS, TOP_K)).astype(dtype)


def _decode(text, **changes):
    shape = dict(prompt_len=PROMPT, output_len=OUTPUT, num_layers=LAYERS, top_k=TOP_K,
                 num_experts=EXPERTS)
    return vre.decode(text, **{**shape, **changes})


def test_vllm_rows_become_the_training_batchs_rows():
    """Row t of vLLM's array = the experts token t of prompt + output was routed to; the batch
    built from it equals the one built from the same rows in SGLang's encoding."""
    experts = sample()
    got = _decode(npy_b64(experts))
    assert got.dtype == np.int32 and np.array_equal(got, experts.astype(np.int32))
    wire = vre.to_wire_bytes(got)
    as_sglang = project.decode(base64.b64encode(wire).decode(), PROMPT + OUTPUT - 1, LAYERS, TOP_K)
    assert torch.equal(as_sglang, torch.from_numpy(experts.astype(np.int32)))
    prompts, outputs = [list(range(PROMPT))], [list(range(OUTPUT))]
    batch = project.batch_routed_experts(prompts, outputs, [as_sglang], seq_length=10,
                                         num_layers=LAYERS, top_k=TOP_K)
    assert torch.equal(batch[0, :PROMPT + OUTPUT - 1], torch.from_numpy(experts).to(torch.int16))
    assert (batch[0, PROMPT + OUTPUT - 1:] == project.UNKNOWN).all()


def test_uint16_above_256_experts_and_a_skipped_prompt_prefix():
    experts = sample(rows=PROMPT + OUTPUT - 1 - 2, dtype="uint16", experts=300)
    got = _decode(npy_b64(experts), num_experts=300, prompt_start=2)
    assert got.shape == (PROMPT + OUTPUT - 3, LAYERS, TOP_K) and int(got.max()) == experts.max()


@pytest.mark.parametrize("payload, message", [
    (npy_b64(sample(rows=PROMPT + OUTPUT)), "shape [8, 2, 2]; expected [7, 2, 2]"),  # a row too many
    (npy_b64(sample(dtype="int64")), "dtype int64; vLLM sends uint8 or uint16"),
    (npy_b64(np.full((PROMPT + OUTPUT - 1, LAYERS, TOP_K), EXPERTS, np.uint8)),
     "names expert 4; the model has 4"),
    ("not base64!", "not base64"),
    (base64.b64encode(b"\x00" * 28).decode(), "not a .npy array"),  # SGLang's raw int32 bytes
    (7, "must be a base64 string"),
])
def test_malformed_payloads_are_refused_naming_the_problem(payload, message):
    with pytest.raises(ValueError) as err:
        _decode(payload)
    assert message in str(err.value), str(err.value)


def test_pickled_objects_are_never_loaded():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="not a .npy array"):
        _decode(base64.b64encode(buffer.getvalue()).decode())


def test_a_choice_without_routed_experts():
    shape = dict(prompt_len=PROMPT, output_len=OUTPUT, num_layers=LAYERS, top_k=TOP_K,
                 num_experts=EXPERTS)
    assert vre.from_choice({"finish_reason": "abort", "routed_experts": None}, **shape) is None
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        vre.from_choice({"finish_reason": "length", "routed_experts": None}, **shape)


@pytest.mark.vllm
def test_a_choice_made_by_vllms_own_serving_code():
    experts = sample(seed=3)
    request = {"experts": experts.tolist(), "dtype": "uint8", "token_ids": list(range(OUTPUT))}
    proc = subprocess.run([str(vllm_env.python()),
                           str(Path(__file__).with_name("vllm_routed_payload.py"))],
                          input=json.dumps(request) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    choice = json.loads(proc.stdout.strip().splitlines()[-1])
    got = vre.from_choice(choice, prompt_len=PROMPT, output_len=len(choice["token_ids"]),
                          num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS)
    assert np.array_equal(got, experts.astype(np.int32))


def test_the_vllm_wire_reads_routed_experts_into_the_sample():
    """``VllmWire.read(..., routed_experts=(L, K))``: the rollout's sample carries vLLM's rows
    as the project's int32 tensor (what the training batch of routing replay reads)."""
    experts = sample(seed=5)
    body = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [7, 8, 9],
                         "logprobs": {"content": [{"token_id": t, "logprob": -1.0}
                                                  for t in (7, 8, 9)]},
                         "weight_versions": [{"version": "3", "start": 0, "end": 3}],
                         "routed_experts": npy_b64(experts)}],
            "usage": {"prompt_tokens": PROMPT}}
    wire = VllmWire()
    assert wire.payload("r", list(range(PROMPT)), _sampling(),
                        return_routed_experts=True)["sampling_params"][
        "routed_experts_prompt_start"] == 0
    result = asyncio.run(wire.read(json.dumps(body).encode(), "r", list(range(PROMPT)), "u",
                                   routed_experts=(LAYERS, TOP_K)))
    assert torch.equal(result.routed_experts, torch.from_numpy(experts.astype(np.int32)))
    plain = asyncio.run(wire.read(json.dumps(body).encode(), "r", list(range(PROMPT)), "u"))
    assert plain.routed_experts is None
    body["choices"][0]["routed_experts"] = None  # a server without the flag: named
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        asyncio.run(wire.read(json.dumps(body).encode(), "r", list(range(PROMPT)), "u",
                              routed_experts=(LAYERS, TOP_K)))


def _sampling():
    return SamplingParams(max_new_tokens=OUTPUT)
