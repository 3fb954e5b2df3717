"""Routed experts (routing replay ``rollout``): the local server answers as SGLang 0.5.23 does.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_routed_experts.py``

* SGLang's own code from its wheel, cut out with ``ast`` and run here: the encoder
  (``DetokenizerManager._b64_encode_per_request``), the decoder it ships for users
  (``extract_routed_experts_from_meta_info``) and the position selection
  (``BaseTopkCapturer.get_topk``: rows ``[start, seqlen - 1)``);
* the experts the local server returns equal the top-k of transformers' Qwen3-MoE computed in
  float64 from its router logits on the whole sequence (a model with 16 experts, top-4, 3 layers,
  so that routing differs between tokens), for a batch with ``n > 1`` and uneven lengths;
* the client asks for them, decodes them, and the loop puts them in the layout of ``tokens``
  (padded rows and a packed micro-batch), -1 where unknown;
* SGLang's errors and its silence: a bad ``routed_experts_start_len``, a server started without
  ``--enable-return-routed-experts`` (no key; the client names the flag).
"""

from __future__ import annotations

import ast
import base64
import textwrap
import time
import zipfile
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import pytest
import torch

from pipeline.generation import routed_experts as rx
from pipeline.generation.client import (RolloutClient, RolloutError, RolloutResult, SamplingParams,
                              flush_cache, generate_payload, http_json)
from tests.rollout.conftest import InProcessServer, _wheel

NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 16, 4


# ------------------------------------------------------------------------------------------------
# SGLang's own functions, from the wheel


def _sglang_function(member: str, name: str, namespace: dict, cls: Optional[str] = None):
    """The function ``name`` (a method of class ``cls``) of wheel file ``member``, its source
    unchanged (dedented), defined in ``namespace`` (the module globals it reads)."""
    with zipfile.ZipFile(_wheel()) as wheel:
        source = wheel.read(member).decode()
    tree = ast.parse(source)
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines(keepends=True)[node.lineno - 1:node.end_lineno]
    exec(textwrap.dedent("".join(lines)), namespace)  # noqa: S102 - SGLang's code, pinned wheel
    return namespace[name]


@pytest.fixture(scope="module")
def sglang_code():
    encode = _sglang_function("sglang/srt/managers/detokenizer_manager.py",
                              "_b64_encode_per_request",
                              {"pybase64": base64, "torch": torch, "Optional": Optional,
                               "List": List}, cls="DetokenizerManager")
    extract = _sglang_function("sglang/srt/state_capturer/routed_experts.py",
                               "extract_routed_experts_from_meta_info",
                               {"pybase64": base64, "np": np})
    get_topk = _sglang_function("sglang/srt/state_capturer/base.py", "get_topk",
                                {"torch": torch, "ReqToTokenPool": object}, cls="BaseTopkCapturer")
    return SimpleNamespace(encode=encode, extract=extract, get_topk=get_topk)


def sglang_rows(get_topk, full: torch.Tensor, seqlen: int, start_len: int) -> torch.Tensor:
    """SGLang's ``get_topk`` over a host cache holding ``full`` (one row per position; the
    request's KV slots are its positions)."""
    capturer = SimpleNamespace(host_cache=SimpleNamespace(buffer=full))
    pool = SimpleNamespace(req_to_token=torch.arange(seqlen + 1)[None])
    return get_topk(capturer, req_pool_idx=0, seqlen=seqlen, req_to_token_pool=pool,
                    start_len=start_len)


def test_wire_format_is_sglangs_encoder_and_decoder(sglang_code):
    experts = torch.randint(0, NUM_EXPERTS, (7, NUM_LAYERS, TOP_K), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(0))
    [theirs] = sglang_code.encode([experts])
    assert rx.encode(experts) == theirs
    assert torch.equal(rx.decode(theirs, 7, NUM_LAYERS, TOP_K), experts)
    flat = sglang_code.extract({"meta_info": {"routed_experts": rx.encode(experts.long())}})
    assert flat.dtype == np.int32 and np.array_equal(flat, experts.reshape(-1).numpy())
    assert rx.encode(torch.zeros(0, NUM_LAYERS, TOP_K)) == sglang_code.encode(
        [torch.zeros(0, NUM_LAYERS, TOP_K, dtype=torch.int32)])[0] == ""
    with pytest.raises(ValueError, match=r"holds 336 bytes; expected 6 positions x 3 layers x "
                                         r"top-4 int32 = 288 bytes"):
        rx.decode(theirs, 6, NUM_LAYERS, TOP_K)
    with pytest.raises(ValueError, match="not base64"):
        rx.decode("not base64!", 1, 1, 1)
    # positions [start, seqlen - 1): SGLang's own selection, and its expected row count
    for seqlen, start in ((8, 0), (8, 3), (8, 7), (1, 0)):
        rows = sglang_rows(sglang_code.get_topk, experts, seqlen, start)
        assert rows.shape[0] == rx.expected_rows(seqlen, 0, start) == seqlen - 1 - min(
            start, seqlen - 1)
        assert torch.equal(rows, experts[start:seqlen - 1])


# ------------------------------------------------------------------------------------------------
# The local server against transformers' router, in float64


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.rollout.tiny import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("routed") / "moe16", seed=3,
                          num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS,
                          num_experts_per_tok=TOP_K)


@pytest.fixture(scope="module")
def routed_server(moe_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server = InProcessServer(moe_dir, enable_return_routed_experts=True)
    yield server
    server.close()
    torch.set_num_threads(threads)


def _router_oracle(model_dir):
    """sequence -> int64 [len - 1, layers, top_k]: transformers' Qwen3-MoE in float64 on
    ``ids[:-1]`` (its router logits), top-k of their softmax in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                 attn_implementation="eager",
                                                 experts_implementation="eager").eval()

    @torch.no_grad()
    def route(ids: list[int]) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids[:-1]]), output_router_logits=True)
        assert len(out.router_logits) == NUM_LAYERS
        return torch.stack([torch.topk(torch.softmax(logits.double(), dim=-1), TOP_K, dim=-1)
                            .indices for logits in out.router_logits], dim=1)
    return route


@pytest.fixture(scope="module")
def oracle(moe_dir):
    return _router_oracle(moe_dir)


def generate(server, body, api_types):
    api_types.GenerateRequest.from_json_value(body)
    status, answer = http_json("POST", server.url + "/generate", body, timeout_s=60)
    assert status == 200, answer
    for item in answer if isinstance(answer, list) else [answer]:
        api_types.GenerateResponse.from_json_value(item)
    return answer


def test_server_returns_the_experts_its_moe_routed_each_token_to(routed_server, oracle,
                                                                 api_types):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23]]
    answer = generate(routed_server, {
        "input_ids": prompts, "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 10, "n": 2, "temperature": 1.0,
                            "sampling_seed": 11}}, api_types)
    assert len(answer) == 6  # n = 2 per prompt, grouped by prompt, each with its own routing
    varied = set()
    for j, item in enumerate(answer):
        prompt, output = prompts[j // 2], item["output_ids"]
        ids = prompt + output
        got = rx.decode(item["meta_info"]["routed_experts"], len(ids) - 1, NUM_LAYERS, TOP_K)
        expected = oracle(ids)
        assert torch.equal(got.long(), expected), f"sample {j}: {ids}"
        varied |= {tuple(row) for row in got.reshape(-1, TOP_K).tolist()}
    assert len(varied) > 10  # routing is token-dependent: the comparison discriminates


def test_a_retracted_request_returns_the_new_weights_routes_for_its_whole_sequence(
        moe_dir, oracle, tmp_path):
    """Issue 23 item 5, what routing replay trains on after a partial rollout: a request paused
    with ``retract`` after k tokens, the weights updated (another model), generation continued.
    SGLang returns the routes of the request's last prefill and the decode steps after it, so the
    routes of the whole sequence come back once, not appended to the old ones, and every row -
    the prompt's and the first k tokens' too - is the top-k of the NEW weights (transformers in
    float64); the old weights routed the prefix differently. The trainer replays exactly these
    rows (``batch_routed_experts``): for the prefix, the routes the new version would take, not
    the ones that generated it (docs/async.md)."""
    from tests.rollout.test_server_conformance import Stream, post, wait_for
    from tests.rollout.tiny import make_model_dir

    new_dir = make_model_dir(tmp_path / "new", seed=4, num_layers=NUM_LAYERS, tokenizer=False,
                             num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    server = InProcessServer(moe_dir, enable_return_routed_experts=True,
                             weight_roots=[str(tmp_path)])
    try:
        prompt = [5, 6, 7, 8, 9]
        stream = Stream(server, {"input_ids": prompt, "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 40, "ignore_eos": True,
                                                     "temperature": 0.0}})
        wait_for(lambda: stream.lengths and stream.lengths[-1] >= 3)
        assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
        time.sleep(0.3)
        k = stream.lengths[-1]
        status, answer = post(server, "/update_weights_from_disk", {"model_path": str(new_dir)})
        assert status == 200 and answer["success"], answer
        assert post(server, "/update_weight_version",
                    {"new_version": "v2", "abort_all_requests": False})[0] == 200
        flush_cache(server.url)
        assert post(server, "/continue_generation", {})[0] == 200
        final = stream.join()
    finally:
        server.close()
    meta = final["meta_info"]
    assert meta["num_retractions"] == 1 and 0 < k < 40
    assert [(s["start"], s["end"]) for s in meta["weight_versions"]] == [(0, k), (k, 40)]
    ids = prompt + final["output_ids"]
    got = rx.decode(meta["routed_experts"], len(ids) - 1, NUM_LAYERS, TOP_K).long()
    assert got.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)  # replaced, not appended
    assert torch.equal(got, _router_oracle(new_dir)(ids))
    prefix = len(prompt) + k - 1  # rows of the prompt and the first k tokens' predecessors
    assert not torch.equal(got[:prefix], oracle(ids)[:prefix])  # the old weights differ there


def test_a_sample_stopped_by_an_abort_is_continued_from_its_output_so_far(routed_server,
                                                                           moe_dir, oracle):
    """Issue 23 item 6, what a ``full`` checkpoint keeps of a request in flight: the server
    aborts it part-way (its answer carries the output, log-probs and versions so far), and
    ``continue_samples`` sends prompt + output so far as a new prompt with the tokens it had left.
    The joined sample keeps the partial's tokens and log-probs, its later log-probs are those of
    the policy (transformers, float64) given the whole prefix, its version spans merge, and its
    routed experts are the continuation's prefill + decode routes for the whole sequence
    (replaced, not appended)."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from pipeline.generation.client import parse_generate_response
    from pipeline.generation.continuation import continue_samples
    from tests.rollout.test_server_conformance import Stream, post, wait_for

    prompt, budget = [5, 6, 7, 8, 9], 40
    body = generate_payload("p0", prompt, SamplingParams(max_new_tokens=budget, sampling_seed=3),
                            return_routed_experts=True)
    body["sampling_params"]["ignore_eos"] = True
    stream = Stream(routed_server, body)
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 3)
    assert post(routed_server, "/abort_request", {"rid": "p0"})[0] == 200
    partial = parse_generate_response(stream.join(), "p0", prompt, routed_server.url,
                                      routed_experts=(NUM_LAYERS, TOP_K))
    k = len(partial.output_ids)
    assert partial.finish_reason == "abort" and 3 <= k < budget

    client = RolloutClient(server_urls=[routed_server.url])
    [joined] = asyncio.run(continue_samples(
        client, prompt, [partial], SamplingParams(max_new_tokens=budget), seed=9,
        rid_prefix="c0", routed_experts=(NUM_LAYERS, TOP_K)))
    n = len(joined.output_ids)
    assert joined.finish_reason in ("stop", "length") and k < n <= budget
    assert joined.finish_reason == "stop" or n == budget  # the budget is the sample's, not k + 40
    assert joined.output_ids[:k] == partial.output_ids
    assert joined.output_logprobs[:k] == partial.output_logprobs
    assert joined.prompt_ids == prompt and joined.completion_tokens == n
    assert joined.weight_versions == [(partial.weight_version, 0, n)]  # one version: merged
    ids = prompt + joined.output_ids
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float64,
                                                 attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
    want = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:].gather(
        1, torch.tensor(joined.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(joined.output_logprobs, dtype=torch.float64), want,
                               atol=1e-4, rtol=0)
    assert joined.routed_experts.shape == (len(ids) - 1, NUM_LAYERS, TOP_K)
    assert torch.equal(joined.routed_experts.long(), oracle(ids))


def test_start_len_selects_the_rows_sglang_selects(routed_server, sglang_code, api_types):
    prompt = [30, 31, 32, 33, 34]
    greedy = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": prompt, "return_routed_experts": True, "sampling_params": greedy}
    full_answer = generate(routed_server, body, api_types)
    seqlen = len(prompt) + len(full_answer["output_ids"])
    full = rx.decode(full_answer["meta_info"]["routed_experts"], seqlen - 1, NUM_LAYERS, TOP_K)
    for start in (1, 3, len(prompt)):
        answer = generate(routed_server, {**body, "routed_experts_start_len": start}, api_types)
        assert answer["output_ids"] == full_answer["output_ids"]
        rows = rx.expected_rows(len(prompt), len(answer["output_ids"]), start)
        got = rx.decode(answer["meta_info"]["routed_experts"], rows, NUM_LAYERS, TOP_K)
        assert torch.equal(got, sglang_rows(sglang_code.get_topk, full, seqlen, start))
    # no generation at all: the prompt's last token is not returned (it is seqlen - 1)
    none = generate(routed_server, {**body, "sampling_params": {"max_new_tokens": 0}}, api_types)
    got = rx.decode(none["meta_info"]["routed_experts"], len(prompt) - 1, NUM_LAYERS, TOP_K)
    assert torch.equal(got, full[:len(prompt) - 1])
    plain = generate(routed_server, {"input_ids": prompt, "sampling_params": greedy}, api_types)
    assert "routed_experts" not in plain["meta_info"]  # not asked for


def test_bad_start_len_is_sglangs_400_and_a_server_without_the_flag_stays_silent(
        routed_server, local_server, api_types):
    def post(server, body):
        return http_json("POST", server.url + "/generate", body, timeout_s=60)

    base = {"input_ids": [5, 6, 7], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 2}}
    status, answer = post(routed_server, {**base, "routed_experts_start_len": 4})
    assert status == 400 and answer == {"error": {"message": (
        "recv_req.routed_experts_start_len=4 is higher than the number of input tokens "
        "len(req.origin_input_ids)=3. Please use a smaller routed_experts_start_len.")}}
    status, answer = post(routed_server, {**base, "routed_experts_start_len": -1})
    assert status == 400 and answer["error"]["message"].startswith(
        "recv_req.routed_experts_start_len=-1 is lower than 0.")
    with pytest.raises(api_types.JsonContractError) as schema:
        api_types.GenerateRequest.from_json_value({**base, "routed_experts_start_len": "1"})
    status, answer = post(routed_server, {**base, "routed_experts_start_len": "1"})
    assert status == 400 and answer == {"error": str(schema.value)}

    # without --enable-return-routed-experts SGLang answers without the key; the client says why
    quiet = generate(local_server, base, api_types)
    assert quiet["output_ids"] and "routed_experts" not in quiet["meta_info"]
    client = RolloutClient(server_urls=[local_server.url], max_attempts=1)
    with pytest.raises(RolloutError, match="--enable-return-routed-experts"):
        client.generate_groups([[5, 6, 7]], 1, SamplingParams(max_new_tokens=2),
                               routed_experts=(2, 2))


# ------------------------------------------------------------------------------------------------
# The client and the training batch


def test_client_decodes_them_and_the_batch_holds_them_at_the_token_positions(
        routed_server, oracle, api_types):
    from megatron_gspo.train.batching import pack_micro_batch, rl_batch

    assert "return_routed_experts" not in generate_payload("r", [1], SamplingParams())
    body = generate_payload("r", [1, 2], SamplingParams(), return_routed_experts=True)
    assert body["return_routed_experts"] is True
    assert api_types.GenerateRequest.from_json_value(body).routed_experts_start_len == 0

    client = RolloutClient(server_urls=[routed_server.url])
    prompts = [[40, 41, 42], [43, 44, 45, 46, 47, 48]]
    groups = client.generate_groups(prompts, 2, SamplingParams(max_new_tokens=6), seed=5,
                                    routed_experts=(NUM_LAYERS, TOP_K))
    results = [r for g in groups for r in g]
    prompt_ids = [r.prompt_ids for r in results]
    outputs = [r.output_ids for r in results]
    for r in results:
        ids = r.prompt_ids + r.output_ids
        assert r.routed_experts.dtype == torch.int32
        assert torch.equal(r.routed_experts.long(), oracle(ids))
    seq_length = 16
    routed = rx.batch_routed_experts(prompt_ids, outputs, [r.routed_experts for r in results],
                                     seq_length, NUM_LAYERS, TOP_K)
    batch = rl_batch(prompt_ids, outputs, [r.output_logprobs for r in results],
                     torch.zeros(len(results)), seq_length, pad_id=0)
    assert routed.dtype == torch.int16
    assert routed.shape == (*batch["tokens"].shape, NUM_LAYERS, TOP_K)
    for i, r in enumerate(results):
        ids = r.prompt_ids + r.output_ids
        n = len(ids) - 1
        assert batch["tokens"][i, :n].tolist() == ids[:-1]  # position t: input token ids[t] ...
        assert torch.equal(routed[i, :n], oracle(ids))  # ... and the experts that routed it
        assert bool((routed[i, n:] == -1).all())  # padding: unknown
    # a packed micro-batch keeps each sequence's routing with its tokens, -1 in the padding
    batch["routed_experts"] = routed
    packed = pack_micro_batch(batch, [1, 2], tp_size=8)  # the pack padded to a multiple of 8
    n1, n2 = (int(batch["lengths"][i]) for i in (1, 2))
    assert torch.equal(packed["routed_experts"][0, :n1 + n2], torch.cat([routed[1, :n1],
                                                                         routed[2, :n2]]))
    assert packed["routed_experts"].shape[1] == -(-(n1 + n2) // 8) * 8 > n1 + n2
    assert bool((packed["routed_experts"][0, n1 + n2:] == -1).all())


def test_batch_layout_unknown_samples_and_shape_errors():
    experts = torch.arange(4 * 2 * 3, dtype=torch.int32).reshape(4, 2, 3)  # prompt 2 + output 3
    out = rx.batch_routed_experts([[7, 8], [9]], [[1, 2, 3], [4]], [experts, None], 6, 2, 3)
    assert out.shape == (2, 6, 2, 3) and out.dtype == torch.int16
    assert torch.equal(out[0, :4], experts.long()) and bool((out[0, 4:] == -1).all())
    assert bool((out[1] == -1).all())  # no routing data: unknown everywhere
    with pytest.raises(ValueError, match=r"sample 0: routed_experts of shape \[4, 2, 3\]; "
                                         r"expected \[3, 2, 3\]"):
        rx.batch_routed_experts([[7]], [[1, 2, 3]], [experts], 6, 2, 3)
    with pytest.raises(ValueError, match="sample 0: 4 routed positions exceed run.seq_length 3"):
        rx.batch_routed_experts([[7, 8]], [[1, 2, 3]], [experts], 3, 2, 3)


def test_rollout_phase_asks_for_them_only_with_rollout_replay_and_batches_them(tmp_path):
    from megatron_gspo.config import config_from_dict
    from pipeline.context import LoopContext
    from pipeline.signals import StopFlag
    from pipeline.sources.batch import rollout_phase
    from pipeline.scoring.data import PromptSampler, TaskPromptDataset
    from pipeline.observe.metrics import MetricsLogger
    from pipeline.scoring.rewards import build_reward
    from pipeline.scoring.tasks import AdditionTask, decode

    class Client:
        def __init__(self):
            self.asked = []

        def generate_groups(self, prompts, group_size, sampling, *, seed=None, **kw):
            self.asked.append(kw.get("routed_experts"))
            shape = kw.get("routed_experts")
            groups = []
            for p, ids in enumerate(prompts):
                group = []
                for s in range(group_size):
                    out = [ord("1"), 10][: 1 + s % 2]
                    rows = len(ids) + len(out) - 1
                    routed = (None if shape is None else
                              torch.full((rows, *shape), p * 10 + s, dtype=torch.int32))
                    group.append(RolloutResult(
                        rid=f"p{p}s{s}", prompt_ids=list(ids), output_ids=out,
                        output_logprobs=[-0.5] * len(out), finish_reason="stop", matched_stop=10,
                        prompt_tokens=len(ids), completion_tokens=len(out), weight_version="0",
                        server_url="fake", routed_experts=routed))
                groups.append(group)
            return groups

    def ctx_for(replay):
        cfg = config_from_dict({
            "gspo": {"group_size": 2, "routing_replay": replay},
            "model": {"num_layers": 3, "moe_router_topk": 2},
            "run": {"num_steps": 1, "global_batch_size": 4, "micro_batch_size": 2,
                    "seq_length": 16, "eval_interval": 0, "save_interval": 0}})
        dataset = TaskPromptDataset(AdditionTask(digits=2, seed=0))
        return LoopContext(
            cfg=cfg, run_dir=str(tmp_path), sampler=PromptSampler(dataset, seed=0),
            reward_fn=build_reward(cfg.reward, cfg.data), client=Client(), decode=decode,
            stop_token_ids=[10], logger=MetricsLogger(tmp_path, enabled=False),
            stop=StopFlag())

    ctx = ctx_for("rollout")
    batch, _ = rollout_phase(ctx, 1)
    assert ctx.client.asked == [(3, 2)]
    routed = batch["routed_experts"]
    assert routed.shape == (4, 16, 3, 2) and routed.dtype == torch.int16
    lengths = batch["lengths"].tolist()  # len(prompt) + len(output) - 1: the routed positions
    for i, n in enumerate(lengths):
        assert bool((routed[i, :n] == (i // 2) * 10 + i % 2).all())
        assert bool((routed[i, n:] == -1).all())

    for replay in ("none", "old"):
        ctx = ctx_for(replay)
        batch, _ = rollout_phase(ctx, 1)
        assert ctx.client.asked == [None] and "routed_experts" not in batch


def test_launchers_start_servers_that_return_them():
    from launch.slurm import server_command

    for server in ("sglang", "local"):
        layout = SimpleNamespace(nodes_per_server=1, server=server, server_tp=1)
        assert "--enable-return-routed-experts" in server_command(layout, 0, False,
                                                                  routed_experts=True)
        assert "--enable-return-routed-experts" not in server_command(layout, 0, False)
