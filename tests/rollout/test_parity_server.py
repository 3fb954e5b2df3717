"""The servers' side of the parity watchdog (``pipeline/weights/parity.py``, SGLang's scorer:
``pipeline.engines.sglang.SGLangScorer``) against the local server (vLLM's: tests/engines).

* the probe request is valid under SGLang 0.5.23's own schema, and so is the answer;
* SGLang's ``logprob_start_len`` semantics: the entry AT that position has no value (``None``),
  then one raw (T = 1) log-prob per later input token; the values equal an independent float64
  ``log_softmax`` of transformers' Qwen3-MoE (the oracle) on the same ids;
* the fault-injection option (``--fault-perturb-weights``) really makes a server serve other
  weights after an update (gap far above fp32 noise), and without it an update with the same
  weights leaves the gap at fp32 noise.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from pipeline.engines.sglang import SGLangScorer
from pipeline.generation.client import http_json
from pipeline.weights.parity import Probe, gap_stats, score_on_server
from pipeline.weights.transport import encode_named_tensors
from tests.rollout.conftest import InProcessServer

SCORER = SGLangScorer()
PROBES = [Probe([40, 41, 42, 43], [7, 9, 11, 2, 1]), Probe([5], [6, 6, 30]),
          Probe([12, 13], [14])]


def oracle(model_dir) -> list[list[float]]:
    """float64 log_softmax of the HF model's logits at each probe's response tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for p in PROBES:
            ids = p.prompt_ids + p.response_ids
            logits = model(torch.tensor([ids])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            start = len(p.prompt_ids)
            out.append([lp[start + j - 1, t].item() for j, t in enumerate(p.response_ids)])
    return out


def test_probe_scores_follow_sglang_semantics_and_match_the_oracle(local_server, model_dir,
                                                                   api_types):
    reference = oracle(model_dir)
    for p, ref in zip(PROBES, reference):
        path, body = SCORER.score_call("parity-test", p.prompt_ids, p.response_ids)
        assert path == "/generate"
        api_types.GenerateRequest.from_json_value(body)
        status, answer = http_json("POST", local_server.url + "/generate", body, timeout_s=60)
        assert status == 200, answer
        api_types.GenerateResponse.from_json_value(answer)
        entries = answer["meta_info"]["input_token_logprobs"]
        # from logprob_start_len = len(prompt) - 1: [None, last prompt token], then the response
        assert entries[0][0] is None and entries[0][1] == p.prompt_ids[-1]
        assert [e[1] for e in entries[1:]] == p.response_ids
        assert answer["output_ids"] == [] and answer["meta_info"]["completion_tokens"] == 0
        got, routed = SCORER.read_scores(answer, p.prompt_ids, p.response_ids, local_server.url)
        assert routed is None
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-5
    scores, routed = score_on_server(local_server.url, PROBES, SCORER, timeout_s=60)
    assert gap_stats(scores, reference)["mean"] < 1e-5 and routed == [None] * len(PROBES)


def test_fault_injection_perturbs_the_weights_after_each_update(model_dir):
    reference = oracle(model_dir)
    weights = load_file(str(model_dir / "model.safetensors"))
    update = {"serialized_named_tensors": [encode_named_tensors(weights.items())],
              "weight_version": "1"}
    for fault, expect_large in ((0.0, False), (0.05, True)):
        server = InProcessServer(model_dir, fault_perturb_weights=fault)
        try:
            before = gap_stats(score_on_server(server.url, PROBES, SCORER, timeout_s=60)[0], reference)
            # SGLang 0.5.23: tensor updates only inside a weight-update session
            assert http_json("POST", server.url + "/begin_weight_update", {})[0] == 200
            status, answer = http_json("POST", server.url + "/update_weights_from_tensor",
                                       update, timeout_s=60)
            assert status == 200 and answer["success"] is True, answer
            assert http_json("POST", server.url + "/end_weight_update", {})[0] == 200
            after = gap_stats(score_on_server(server.url, PROBES, SCORER, timeout_s=60)[0], reference)
        finally:
            server.close()
        assert before["mean"] < 1e-5  # the fault acts only after an update
        if expect_large:
            assert after["mean"] > 1e-2, after
        else:
            assert after["mean"] < 1e-5, after
