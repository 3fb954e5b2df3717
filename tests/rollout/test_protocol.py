"""The local rollout server speaks SGLang 0.5.23's protocol; the client reads it.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_protocol.py``

Against an in-process ``megatron-gspo serve`` (uvicorn thread) on a tiny random Qwen3-MoE: every
request and response body is validated with SGLang's own generated schema
(``GenerateRequest`` / ``GenerateResponse.from_json_value``), and the behaviours of the protocol
document's "minimum behaviour" list are checked one by one.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from pipeline.generation.client import (RolloutClient, RolloutError, SamplingParams, error_message,
                              generate_payload, http_json, sample_seed, wait_healthy)
from pipeline.weights.transport import encode_named_tensors, weights_checksum
from tests.rollout.conftest import InProcessServer


def post(server, path, body):
    return http_json("POST", server.url + path, body, timeout_s=60)


def generate(server, body, api_types=None):
    if api_types is not None:
        api_types.GenerateRequest.from_json_value(body)
    status, answer = post(server, "/generate", body)
    assert status == 200, answer
    if api_types is not None:
        for item in answer if isinstance(answer, list) else [answer]:
            api_types.GenerateResponse.from_json_value(item)
    return answer


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def loads(server):
    return http_json("GET", server.url + "/v1/loads")[1]["loads"][0]


def test_client_bodies_follow_sglangs_schema(api_types):
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8,
                        stop_token_ids=[1, 2], sampling_seed=3)
    request = api_types.GenerateRequest.from_json_value(generate_payload("r1", [4, 5, 6], sp))
    assert request.sampling_params.sampling_seed == 3
    assert request.sampling_params.no_stop_trim is True
    api_types.SamplingParams.from_json_value(SamplingParams().to_json())
    assert "sampling_seed" not in SamplingParams().to_json()
    assert set(sp.to_json()) == {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids",
                                 "n", "no_stop_trim", "skip_special_tokens", "sampling_seed"}
    assert set(sp.to_json()) <= set(api_types.SamplingParams.__struct_fields__)
    seeds = {sample_seed(s, p, j) for s in (0, 2 ** 40) for p in range(3) for j in range(4)}
    assert len(seeds) == 24 and all(0 <= x < 2 ** 63 for x in seeds)
    for x in seeds:  # an i64 for SGLang's contract
        api_types.GenerateRequest.from_json_value(
            generate_payload("r", [1], SamplingParams(sampling_seed=x)))


def test_single_batch_and_n_follow_the_schema_ids_and_order(local_server, api_types):
    single = generate(local_server, {"rid": "one", "input_ids": [5, 6, 7], "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 4, "sampling_seed": 1}},
                      api_types)
    meta = single["meta_info"]
    assert meta["id"] == "one" and meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == len(single["output_ids"]) == len(meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == [] and meta["weight_version"] == "default"
    assert all(isinstance(lp, float) and lp <= 0 and tok == out and text is None
               for (lp, tok, text), out in zip(meta["output_token_logprobs"], single["output_ids"]))
    assert "text" in single and meta["e2e_latency"] > 0

    batch = generate(local_server, {"rid": "b", "input_ids": [[5, 6], [7]],
                                    "sampling_params": {"max_new_tokens": 3}}, api_types)
    assert [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
    assert [b["meta_info"]["prompt_tokens"] for b in batch] == [2, 1]
    assert "output_token_logprobs" not in batch[0]["meta_info"]  # only with return_logprob

    grouped = generate(local_server, {"rid": "n", "input_ids": [[5, 6], [7]],
                                      "sampling_params": {"max_new_tokens": 3, "n": 3}}, api_types)
    assert [g["meta_info"]["prompt_tokens"] for g in grouped] == [2, 2, 2, 1, 1, 1]
    ids = [g["meta_info"]["id"] for g in grouped]
    assert len(set(ids)) == 6 and "n" not in ids  # fresh ids per sample
    one_n = generate(local_server, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert isinstance(one_n, list) and len(one_n) == 2  # n > 1 always answers an array


def test_stop_token_is_kept_in_output_ids_and_trimmed_from_text(local_server, api_types):
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    base = generate(local_server, {"input_ids": [9, 10, 11], "sampling_params": greedy}, api_types)
    assert base["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    stop = base["output_ids"][2]
    first = base["output_ids"].index(stop)
    out = generate(local_server, {"input_ids": [9, 10, 11], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop]}}, api_types)
    assert out["output_ids"] == base["output_ids"][:first + 1]  # the stop token is included
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["meta_info"]["completion_tokens"] == first + 1
    engine = local_server.server.engine
    assert out["text"] == engine.decode(out["output_ids"][:-1])  # ... but trimmed from text
    kept = generate(local_server, {"input_ids": [9, 10, 11], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop], "no_stop_trim": True}})
    assert kept["text"] == engine.decode(kept["output_ids"])


def test_sampling_seed_is_reproducible_and_independent_of_the_batch(local_server):
    body = lambda seed: {"input_ids": [20, 21, 22], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 10, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}}
    a, b, c = (generate(local_server, body(s)) for s in (7, 7, 8))
    assert a["output_ids"] == b["output_ids"] and a["output_ids"] != c["output_ids"]
    batch = generate(local_server, {"input_ids": [[1, 2, 3, 4, 5, 6, 7], [20, 21, 22]],
                                    "return_logprob": True, "sampling_params": [
                                        {"max_new_tokens": 4}, body(7)["sampling_params"]]})
    assert batch[1]["output_ids"] == a["output_ids"]
    diff = max(abs(x[0] - y[0]) for x, y in zip(batch[1]["meta_info"]["output_token_logprobs"],
                                                a["meta_info"]["output_token_logprobs"]))
    assert diff < 1e-5


@torch.no_grad()
def test_logprobs_are_of_the_temperature_scaled_distribution(local_server, model_dir):
    """SGLang returns log_softmax(logits / T) before top-k / top-p (greedy: T = 1), and raw
    (T = 1) input log-probs; the reference is transformers on the same weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    prompt = [40, 41, 42, 43]
    worst = 0.0
    for params in ({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "sampling_seed": 1},
                   {"temperature": 1.3, "sampling_seed": 2}, {"temperature": 0.0}):
        out = generate(local_server, {"input_ids": prompt, "return_logprob": True,
                                      "logprob_start_len": 0,
                                      "sampling_params": {"max_new_tokens": 8, **params}})
        ids = prompt + out["output_ids"]
        logits = model(torch.tensor([ids])).logits[0].double()
        temperature = params["temperature"] or 1.0
        ref = torch.log_softmax(logits / temperature, -1)
        got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        for j, lp in enumerate(got):
            worst = max(worst, abs(lp - ref[len(prompt) - 1 + j, ids[len(prompt) + j]].item()))
        inputs = out["meta_info"]["input_token_logprobs"]
        assert inputs[0] == [None, prompt[0], None] and len(inputs) == len(prompt)
        raw = torch.log_softmax(logits, -1)
        for j in range(1, len(prompt)):
            worst = max(worst, abs(inputs[j][0] - raw[j - 1, prompt[j]].item()))
    assert worst < 1e-5, worst


def test_top_logprobs(local_server, api_types):
    out = generate(local_server, {"input_ids": [3, 4], "return_logprob": True,
                                  "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 2}},
                   api_types)
    rows = out["meta_info"]["output_top_logprobs"]
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert all(r[0][0] >= r[1][0] >= r[2][0] for r in rows)


def test_error_bodies_have_sglangs_three_shapes(local_server, api_types):
    bad = [{"input_ids": [1], "sampling_params": {"max_tokens": 3}},
           {"input_ids": [1], "sampling_params": {"max_new_tokens": 4.0}},
           {"input_ids": [1], "stream": "no"}]
    for body in bad:  # contract gate: {"error": "<serde message>"}, SGLang's own wording
        status, answer = post(local_server, "/generate", body)
        with pytest.raises(api_types.JsonContractError) as expected:
            api_types.GenerateRequest.from_json_value(body)
        assert status == 400 and answer == {"error": str(expected.value)}
    status, answer = http_json("POST", local_server.url + "/generate", None)
    assert status == 400 and answer["object"] == "error" and answer["code"] == 400
    status, answer = post(local_server, "/generate", {"input_ids": []})
    assert status == 400 and answer == {"error": {"message": "input_ids cannot be empty."}}
    status, answer = post(local_server, "/generate", {"input_ids": [1], "model": "ignored",
                                                      "sampling_params": {"max_new_tokens": 1}})
    assert status == 200  # unknown top-level keys are ignored
    for shape in ({"error": "e1"}, {"error": {"message": "e2"}},
                  {"object": "error", "message": "e3", "code": 400}):
        assert error_message(json.dumps(shape)) in ("e1", "e2", "e3")
    client = RolloutClient(server_urls=[local_server.url], request_timeout_s=30)
    with pytest.raises(RolloutError) as err:
        client.generate_sync([("bad", [10 ** 6], SamplingParams(max_new_tokens=2))])
    assert err.value.url == local_server.url and err.value.status == 400
    assert "outside the vocabulary" in err.value.message


def test_flush_is_400_while_busy_and_pause_blocks_new_generates(local_server):
    long = {"input_ids": [50, 51], "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    results = {}
    first = threading.Thread(target=lambda: results.setdefault("first", generate(local_server, long)))
    first.start()
    wait_for(lambda: loads(local_server)["num_running_reqs"] == 1)
    assert post(local_server, "/flush_cache", {})[0] == 400
    assert post(local_server, "/pause_generation", {"mode": "in_place"})[1]["status"] == "ok"
    second = threading.Thread(target=lambda: results.setdefault("second", generate(
        local_server, {"input_ids": [5], "sampling_params": {"max_new_tokens": 2,
                                                             "ignore_eos": True}})))
    second.start()
    time.sleep(0.5)
    assert "second" not in results and "first" not in results  # blocked while paused
    assert post(local_server, "/continue_generation", {})[0] == 200
    first.join(60)
    second.join(60)
    assert results["first"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(results["second"]["output_ids"]) == 2
    assert post(local_server, "/flush_cache", {})[0] == 200
    # pause in "abort" mode returns what runs with an abort finish reason
    first = threading.Thread(target=lambda: results.__setitem__("first", generate(local_server, long)))
    first.start()
    wait_for(lambda: loads(local_server)["num_running_reqs"] == 1)
    assert post(local_server, "/pause_generation", {})[0] == 200
    first.join(30)
    assert results["first"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(local_server, "/continue_generation", {})[0] == 200


def test_abort_by_rid_prefix_running_and_queued(model_dir, api_types):
    server = InProcessServer(model_dir, max_running_requests=1)
    try:
        results = {}
        long = {"sampling_params": {"max_new_tokens": 240, "ignore_eos": True},
                "return_logprob": True}
        running = threading.Thread(target=lambda: results.setdefault("run", generate(
            server, {"rid": "job-running", "input_ids": [60, 61], **long})))
        running.start()
        wait_for(lambda: loads(server)["num_running_reqs"] == 1)
        queued = threading.Thread(target=lambda: results.setdefault("queue", generate(
            server, {"rid": "job-queued", "input_ids": [62], **long})))
        queued.start()
        wait_for(lambda: loads(server)["num_waiting_reqs"] == 1)
        assert post(server, "/abort_request", {"rid": "job-q"})[0] == 200  # prefix match
        queued.join(30)
        q = results["queue"]
        api_types.GenerateResponse.from_json_value(q)
        assert q["meta_info"]["finish_reason"] == {"type": "abort",
                                                   "message": "Abort in waiting queue"}
        assert q["output_ids"] == [] and "prompt_tokens" not in q["meta_info"]
        assert q["meta_info"]["completion_tokens"] == 0 and q["text"] == ""
        assert post(server, "/abort_request", {"abort_all": True})[0] == 200
        running.join(30)
        r = results["run"]
        api_types.GenerateResponse.from_json_value(r)
        assert r["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted",
                                                   "status_code": None, "err_type": None}
        assert 0 < len(r["output_ids"]) < 240
        assert len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"])
    finally:
        server.close()


def test_info_load_health_and_memory_endpoints(local_server, model_dir):
    for path in ("/model_info", "/get_model_info"):
        info = http_json("GET", local_server.url + path)[1]
        assert info["weight_version"] == "default" and info["is_generation"] is True
        assert info["model_path"] == str(model_dir.resolve())
    for path in ("/server_info", "/get_server_info"):
        info = http_json("GET", local_server.url + path)[1]
        assert info["tp_size"] == 1 and info["dp_size"] == 1
        assert (model_dir / "config.json").samefile(f"{info['model_path']}/config.json")
    assert http_json("GET", local_server.url + "/get_load")[0] == 404  # not in SGLang 0.5.23
    assert loads(local_server)["num_running_reqs"] == 0
    for path in ("/health", "/health_generate"):
        assert http_json("GET", local_server.url + path)[0] == 200
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert post(local_server, path, {"tags": ["weights"]}) == (200, None)


def test_streaming_chunks_are_cumulative_and_end_with_done(local_server, api_types):
    body = json.dumps({"input_ids": [[5, 6], [7]], "stream": True, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}).encode()
    req = urllib.request.Request(local_server.url + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        frames = [f for f in resp.read().decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[len("data: "):]) for f in frames[:-1]]
    for c in chunks:
        api_types.GenerateResponse.from_json_value(c)
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1] and all(len(c["output_ids"]) == 4 for c in finals.values())
    lengths = [len(c["output_ids"]) for c in chunks if c["index"] == 0]
    assert lengths == sorted(lengths)  # cumulative


def test_server_without_tokenizer_answers_without_text(tmp_path, model_dir):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    server = InProcessServer(bare)
    try:
        out = generate(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert "text" not in out and len(out["output_ids"]) == 2
        status, answer = post(server, "/generate", {"text": "abc"})
        assert status == 400 and "tokenizer" in answer["error"]["message"]
    finally:
        server.close()


def test_weight_endpoints_check_roll_back_and_tag_versions(local_server, model_dir):
    from safetensors.torch import load_file

    disk = load_file(str(model_dir / "model.safetensors"))
    checksum = lambda: post(local_server, "/weights_checker", {"action": "checksum"})[1]["checksum"]
    assert checksum() == weights_checksum(disk.items())  # fused experts map to HF names exactly
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    new = torch.randn(disk[name].shape)
    bad = {name: torch.zeros(3, 3)}
    assert post(local_server, "/begin_weight_update", {"selector": "all"})[0] == 200
    status, answer = post(local_server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_named_tensors(bad.items())]})
    assert status == 400 and answer["success"] is False and "shape" in answer["message"]
    status, answer = post(local_server, "/update_weights_from_tensor", {
        "serialized_named_tensors": ["gASVAAAAAAAAAAB9lC4="]})  # a pickle: refused
    assert status == 400 and "safetensors" in answer["message"]
    status, answer = post(local_server, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and answer["success"] is False and answer["num_paused_requests"] == 0
    assert checksum() == weights_checksum(disk.items())  # nothing changed
    status, answer = post(local_server, "/get_weights_by_name", {"name": "no.such.weight"})
    assert status == 400 and answer == {"error": {"message": "Get parameter by name failed"}}

    status, answer = post(local_server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [encode_named_tensors([(name, new)])], "weight_version": "7"})
    assert status == 200 and answer["success"] is True
    values = post(local_server, "/get_weights_by_name", {"name": name, "truncate_size": 10 ** 6})[1]
    assert torch.equal(torch.tensor(values), new)
    assert post(local_server, "/end_weight_update", {})[0] == 200
    out = generate(local_server, {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})
    assert out["meta_info"]["weight_version"] == "7"
    answer = post(local_server, "/update_weight_version", {"new_version": "8"})[1]
    assert answer["new_version"] == "8"
    assert http_json("GET", local_server.url + "/model_info")[1]["weight_version"] == "8"
    status, answer = post(local_server, "/update_weights_from_disk", {
        "model_path": str(model_dir), "weight_version": "default"})
    assert status == 200 and answer["success"] is True
    assert checksum() == weights_checksum(disk.items())


def test_wait_healthy_names_the_server_and_its_last_answer():
    from pipeline.servers.cluster import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RolloutError) as err:
        wait_healthy([url], timeout_s=1.0, interval_s=0.2)
    assert time.monotonic() - start < 10
    assert err.value.url == url and "not healthy after 1 s" in str(err.value)
    assert "Connect" in str(err.value)  # what it last said: the connection was refused
