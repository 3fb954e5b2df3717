"""The local server's prefix cache: SGLang 0.5.23's radix cache, as seen through its protocol.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_prefix_cache.py``

* :class:`prefix_cache.PrefixCache` itself: longest prefix under a limit, node splits, what an insert
  keeps (the values already cached), least-recently-used eviction under the token bound, reset;
* against a reference server started with ``--disable-radix-cache`` (every prefill cold), on a
  Qwen3-MoE with 16 experts top-4 (routing differs between tokens): a request extending an
  earlier one's prompt + output (a multi-turn rollout's next turn) reports that prefix minus its
  last token in ``meta_info.cached_tokens`` and answers what a cold prefill answers - the same
  tokens (greedy and seeded), log-probs to 1e-4, the same routed experts (those of the cached
  positions being the ones recorded when they were computed) - also in a batch mixing hits and
  misses, with input log-probs (the cache stops at ``logprob_start_len``) and for ``n > 1``
  (SGLang's warm-up request: each sample finds ``len - 1`` tokens cached);
* the token bound (LRU), ``/flush_cache`` and weight updates (disk, tensor) emptying it,
  ``flush_cache: false`` keeping it (SGLang's rule), an abort leaving nothing, a retracted
  request keeping its count, ``--disable-radix-cache`` reporting 0 always.
"""

from __future__ import annotations

import time

import pytest
import torch

from pipeline.generation import routed_experts as rx
from pipeline.local.prefix_cache import PrefixCache
from pipeline.generation.client import http_json
from pipeline.weights.transport import encode_named_tensors
from tests.rollout.conftest import InProcessServer
from tests.rollout.test_server_conformance import Stream, post, wait_for

NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 16, 4
WEIGHT = "model.layers.1.mlp.experts.2.up_proj.weight"


# ------------------------------------------------------------------------------------------------
# The tree


def _kv(tokens: list[int]) -> list:
    """Per-layer KV whose values name their token: K = token, V = -token ([H=1, n, d=2])."""
    t = torch.tensor(tokens, dtype=torch.float32)[None, :, None].expand(1, -1, 2)
    return [(t.clone(), -t.clone()), (2 * t, -2 * t)]


def _insert(cache: PrefixCache, tokens: list[int], routes=None, tag: float = 0.0) -> int:
    full = _kv(tokens)
    return cache.insert(tokens, lambda a, b: [(k[:, a:b] + tag, v[:, a:b] + tag) for k, v in full],
                        routes)


def test_tree_matches_the_longest_prefix_under_the_limit_and_keeps_cached_values():
    cache = PrefixCache(100)
    routes = torch.arange(6 * NUM_LAYERS * TOP_K, dtype=torch.int32).view(6, NUM_LAYERS, TOP_K)
    assert _insert(cache, [1, 2, 3, 4, 5, 6], routes) == 6 and cache.num_tokens == 6
    m, kv, got = cache.match([1, 2, 3, 4, 9], limit=10)
    assert m == 4 and torch.equal(kv[0][0][0, :, 0], torch.tensor([1., 2., 3., 4.]))
    assert torch.equal(kv[1][1][0, :, 0], -2 * torch.tensor([1., 2., 3., 4.]))
    assert torch.equal(got, routes[:4])
    assert cache.match([1, 2, 3, 4, 9], limit=2)[0] == 2  # at most `limit` tokens
    assert cache.match([7, 1, 2], limit=3) == (0, None, None)
    assert cache.match([1, 2], limit=0) == (0, None, None)
    # a branch after the split at 4: the shared part keeps its values, only [7, 8] is added
    assert _insert(cache, [1, 2, 3, 4, 7, 8], routes, tag=100.0) == 2 and cache.num_tokens == 8
    m, kv, got = cache.match([1, 2, 3, 4, 7, 8, 0], limit=7)
    assert m == 6
    assert kv[0][0][0, :, 0].tolist() == [1., 2., 3., 4., 107., 108.]
    assert torch.equal(got, routes[:6])  # the branch's own routes from position 4 on
    assert _insert(cache, [1, 2, 3], routes) == 0  # cached already: nothing added
    m, _, got = cache.match([1, 2, 3, 4, 5, 6], limit=6)
    assert m == 6 and torch.equal(got, routes)
    assert cache.match([1, 2, 3], limit=5)[1][0][0].shape == (1, 3, 2)
    mixed = PrefixCache(100)  # a path with a node without routes: no routes for the match
    _insert(mixed, [1, 2], routes[:2])
    _insert(mixed, [1, 2, 3], None)
    assert mixed.match([1, 2, 3], 3)[2] is None and torch.equal(mixed.match([1, 2], 2)[2],
                                                                 routes[:2])
    cache.reset()
    assert cache.num_tokens == 0 and cache.match([1, 2, 3], 3)[0] == 0


def held(cache: PrefixCache, tokens: list[int]) -> int:
    """How much of ``tokens`` the tree holds, read without touching it (``match`` would refresh
    the access times and split nodes)."""
    node, i = cache._root, 0
    while i < len(tokens) and tokens[i] in node.children:
        node = node.children[tokens[i]]
        n = 0
        while n < len(node.tokens) and i + n < len(tokens) and node.tokens[n] == tokens[i + n]:
            n += 1
        i += n
        if n < len(node.tokens):
            break
    return i


def test_tree_evicts_least_recently_used_leaves_down_to_its_bound():
    cache = PrefixCache(12)
    _insert(cache, [1, 2, 3, 4, 5])  # A
    _insert(cache, [6, 7, 8, 9, 10])  # B
    # A's head used: the match splits A at 3 (as SGLang's does); its tail [4, 5] keeps A's
    # older access time, so it is now the least recent leaf, then B
    assert cache.match([1, 2, 3], 3)[0] == 3
    _insert(cache, [11, 12, 13, 14, 15])  # C: 15 > 12 tokens: [4, 5] goes, then B
    assert cache.num_tokens == 8
    assert [held(cache, p) for p in ([1, 2, 3, 4, 5], [6, 7, 8], [11, 12, 13, 14, 15])] == \
        [3, 0, 5]
    _insert(cache, [1, 2, 3, 20, 21, 22])  # D shares [1, 2, 3]: 11 tokens, nothing goes
    assert cache.num_tokens == 11
    _insert(cache, [30, 31, 32, 33])  # E: 15: the least recent leaf (C) goes
    assert cache.num_tokens == 10 and held(cache, [11]) == 0
    # a shared node goes only after its last child: F evicts D's tail, G then [1, 2, 3]
    _insert(cache, [40, 41, 42, 43, 44])
    assert cache.num_tokens == 12 and held(cache, [1, 2, 3, 20]) == 3
    _insert(cache, [50, 51])
    assert cache.num_tokens == 11 and held(cache, [1, 2, 3]) == 0
    assert [held(cache, p) for p in ([30, 31, 32, 33], [40, 41, 42, 43, 44], [50, 51])] == \
        [4, 5, 2]
    # longer than the bound: its first max_tokens tokens are cached
    small = PrefixCache(4)
    assert _insert(small, [1, 2, 3, 4, 5, 6]) == 4 and held(small, [1, 2, 3, 4, 5]) == 4
    with pytest.raises(ValueError, match="--radix-cache-max-tokens 0"):
        PrefixCache(0)


# ------------------------------------------------------------------------------------------------
# The server against a cold reference


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.rollout.tiny import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("prefix") / "moe16", seed=5,
                          num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS,
                          num_experts_per_tok=TOP_K)


@pytest.fixture(scope="module")
def servers(moe_dir):
    """(cached, cold reference): both with routed experts, the same seed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cached = InProcessServer(moe_dir, enable_return_routed_experts=True,
                             weight_roots=[str(moe_dir.parent)])
    cold = InProcessServer(moe_dir, enable_return_routed_experts=True, disable_radix_cache=True)
    yield cached, cold
    cached.close()
    cold.close()
    torch.set_num_threads(threads)


def tree(server) -> PrefixCache:
    return server.server.engine.prefix_cache


def flushed(server):
    status, _ = http_json("POST", server.url + "/flush_cache", {})
    assert status == 200
    assert tree(server) is None or tree(server).num_tokens == 0
    return server


def generate(server, body):
    status, answer = post(server, "/generate", body)
    assert status == 200, answer
    return answer


def routes(item, prompt_len):
    n = prompt_len + len(item["output_ids"]) - 1
    return rx.decode(item["meta_info"]["routed_experts"], n, NUM_LAYERS, TOP_K)


def assert_same(hit, ref, prompt_len, *, input_logprobs=False):
    """Same tokens, log-probs to 1e-4, identical routes."""
    assert hit["output_ids"] == ref["output_ids"]
    a, b = hit["meta_info"], ref["meta_info"]
    assert [t for _, t, _ in a["output_token_logprobs"]] == hit["output_ids"]
    assert torch.allclose(torch.tensor([lp for lp, _, _ in a["output_token_logprobs"]]),
                          torch.tensor([lp for lp, _, _ in b["output_token_logprobs"]]),
                          atol=1e-4, rtol=0)
    if input_logprobs:
        got, want = a["input_token_logprobs"], b["input_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want] and got[0][0] is None
        assert torch.allclose(torch.tensor([lp for lp, _, _ in got[1:]]),
                              torch.tensor([lp for lp, _, _ in want[1:]]), atol=1e-4, rtol=0)
    assert torch.equal(routes(hit, prompt_len), routes(ref, prompt_len))


def turn(prompt, max_new, **sampling):
    return {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, **sampling}}


def test_next_turn_reuses_the_previous_turn_and_answers_as_a_cold_prefill(servers):
    cached, cold = servers
    flushed(cached)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    first = generate(cached, turn(prompt, 7, temperature=0.0))
    assert first["meta_info"]["cached_tokens"] == 0  # a cold request
    assert first["meta_info"]["cached_tokens_details"] is None
    # the KV of prompt + output minus the last token (never computed) stays
    assert tree(cached).num_tokens == len(prompt) + 7 - 1
    second_prompt = prompt + first["output_ids"] + [40, 41, 42, 43]  # + the tool's tokens
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7},
                     {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "sampling_seed": 3}):
        hit = generate(cached, turn(second_prompt, 9, **sampling))
        ref = generate(cold, turn(second_prompt, 9, **sampling))
        reused = len(prompt) + len(first["output_ids"]) - 1
        if sampling["temperature"] == 0.0:
            assert hit["meta_info"]["cached_tokens"] == reused
        else:  # the previous sampling left second_prompt minus its last token in the tree
            assert hit["meta_info"]["cached_tokens"] == len(second_prompt) - 1
        details = hit["meta_info"]["cached_tokens_details"]
        assert details == {"device": hit["meta_info"]["cached_tokens"], "host": 0}
        assert ref["meta_info"]["cached_tokens"] == 0
        assert "cached_tokens_details" in ref["meta_info"]
        assert ref["meta_info"]["cached_tokens_details"] is None
        assert_same(hit, ref, len(second_prompt))
    # the cached positions' routes are the ones recorded when they were computed: the first
    # turn's (its own answer), for prompt + output minus the last token
    assert torch.equal(routes(hit, len(second_prompt))[:reused], routes(first, len(prompt)))
    # the same prompt again: all but its last token come from the cache
    again = generate(cached, turn(prompt, 7, temperature=0.0))
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert_same(again, first, len(prompt))


def test_a_batch_mixing_hits_and_misses_answers_as_cold_prefills(servers):
    cached, cold = servers
    flushed(cached)
    seeds = {"temperature": 1.0, "sampling_seed": 11}
    long_prompt = list(range(20, 44))
    short_prompt = [50, 51, 52]
    base = [generate(cached, turn(p, 5, temperature=0.0)) for p in (long_prompt, short_prompt)]
    prompts = [long_prompt + base[0]["output_ids"] + [7, 8],  # a long hit
               [60, 61, 62, 63, 64, 65, 66],  # a miss
               short_prompt + base[1]["output_ids"] + [9, 10, 11, 12, 13, 14, 15],  # a short hit
               long_prompt[:10] + [3]]  # a partial hit (a branch inside the first prompt)
    body = {**turn(prompts, 6, **seeds)}
    hits, refs = generate(cached, body), generate(cold, body)
    assert [h["meta_info"]["cached_tokens"] for h in hits] == [
        len(long_prompt) + 4, 0, len(short_prompt) + 4, 10]
    for prompt, hit, ref in zip(prompts, hits, refs):
        assert_same(hit, ref, len(prompt))


def test_input_logprobs_are_computed_from_logprob_start_len_on(servers):
    """SGLang's ``_compute_max_prefix_len``: with ``logprob_start_len >= 0`` the cache serves
    at most ``logprob_start_len`` tokens, so every position whose log-prob is asked for is
    computed."""
    cached, cold = servers
    flushed(cached)
    prompt = list(range(70, 85))
    generate(cached, turn(prompt, 4, temperature=0.0))
    for start, reused in ((0, 0), (3, 3), (10, 10), (len(prompt) - 1, len(prompt) - 1)):
        body = {**turn(prompt, 4, temperature=0.0), "logprob_start_len": start}
        hit, ref = generate(cached, body), generate(cold, body)
        assert hit["meta_info"]["cached_tokens"] == reused
        assert len(hit["meta_info"]["input_token_logprobs"]) == len(prompt) - start
        assert_same(hit, ref, len(prompt), input_logprobs=start < len(prompt) - 1)


def test_parallel_samples_find_their_prompt_cached_as_in_sglang(moe_dir):
    """n > 1: SGLang's TokenizerManager sends the prompt alone first (max_new_tokens 0), so
    each sample reports len(prompt) - 1 cached tokens; the samples are those of cold prefills
    (the warm-up draws nothing from the server's seed stream: fresh servers, the same seed,
    no sampling_seed)."""
    cached = InProcessServer(moe_dir, enable_return_routed_experts=True)
    cold = InProcessServer(moe_dir, enable_return_routed_experts=True, disable_radix_cache=True)
    prompts = [[90, 91, 92, 93, 94, 95], [96, 97, 98]]
    body = turn(prompts, 5, temperature=1.0, n=3)
    try:
        hits, refs = generate(cached, body), generate(cold, body)
    finally:
        cached.close()
        cold.close()
    assert [h["meta_info"]["cached_tokens"] for h in hits] == [5, 5, 5, 2, 2, 2]
    assert [r["meta_info"]["cached_tokens"] for r in refs] == [0] * 6
    for j, (hit, ref) in enumerate(zip(hits, refs)):
        assert_same(hit, ref, len(prompts[j // 3]))
    assert len({tuple(h["output_ids"]) for h in hits[:3]}) > 1  # three different samples


def test_the_token_bound_evicts_the_least_recently_used(moe_dir):
    server = InProcessServer(moe_dir, radix_cache_max_tokens=30)
    try:
        info = http_json("GET", server.url + "/server_info")[1]
        assert info["disable_radix_cache"] is False and info["radix_cache_max_tokens"] == 30
        greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
        a, b, c = [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27], \
            [30, 31, 32, 33, 34, 35, 36, 37]
        for p in (a, b):  # 12 tokens each
            generate(server, {"input_ids": p, "sampling_params": greedy})
        assert tree(server).num_tokens == 24
        # A used again (a hit: A is now more recent than B), then C: 36 > 30, B is evicted
        assert generate(server, {"input_ids": a + [1], "sampling_params": greedy}
                        )["meta_info"]["cached_tokens"] == 8
        generate(server, {"input_ids": c, "sampling_params": greedy})
        assert tree(server).num_tokens <= 30
        hits = [generate(server, {"input_ids": p + [2], "sampling_params": greedy}
                         )["meta_info"]["cached_tokens"] for p in (b, c)]
        assert hits == [0, 8]
        assert tree(server).num_tokens <= 30
    finally:
        server.close()


def test_flush_and_weight_updates_empty_it_an_abort_leaves_nothing(servers, moe_dir):
    cached, _ = servers
    flushed(cached)
    prompt = [100, 101, 102, 103, 104, 105]
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": prompt + [106], "sampling_params": greedy}

    def populate():
        generate(cached, {"input_ids": prompt, "sampling_params": greedy})
        assert tree(cached).num_tokens > 0

    def cached_tokens():
        return generate(cached, body)["meta_info"]["cached_tokens"]

    populate()
    assert flushed(cached) and cached_tokens() == 0
    # a disk update flushes (flush_cache defaults to true) ...
    populate()
    status, answer = post(cached, "/update_weights_from_disk", {"model_path": str(moe_dir)})
    assert status == 200 and answer["success"], answer
    assert tree(cached).num_tokens == 0 and cached_tokens() == 0
    # ... and with flush_cache false SGLang keeps the KV the old weights computed
    populate()
    status, answer = post(cached, "/update_weights_from_disk",
                          {"model_path": str(moe_dir), "flush_cache": False})
    assert status == 200 and answer["success"], answer
    assert tree(cached).num_tokens > 0
    # a tensor update in its session flushes too
    flushed(cached)
    populate()
    assert post(cached, "/begin_weight_update", {})[0] == 200
    value = torch.tensor(post(cached, "/get_weights_by_name",
                              {"name": WEIGHT, "truncate_size": 10 ** 6})[1])
    status, answer = post(cached, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [encode_named_tensors([(WEIGHT, value)])]})
    assert status == 200 and answer["success"], answer
    assert post(cached, "/end_weight_update", {})[0] == 200
    assert tree(cached).num_tokens == 0 and cached_tokens() == 0
    # releasing the KV cache's memory flushes it, as in SGLang
    populate()
    assert post(cached, "/release_memory_occupation", {"tags": None})[0] == 200
    assert post(cached, "/resume_memory_occupation", {})[0] == 200
    assert tree(cached).num_tokens == 0
    # an aborted request (running, then aborted) leaves nothing in the tree
    stream = Stream(cached, {"input_ids": prompt, "rid": "to-abort",
                             "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 2)
    assert post(cached, "/abort_request", {"rid": "to-abort"})[0] == 200
    final = stream.join()
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert tree(cached).num_tokens == 0 and cached_tokens() == 0


def test_a_retracted_request_keeps_its_count_and_is_recomputed(servers):
    cached, cold = servers
    flushed(cached)
    prompt = list(range(110, 122))
    first = generate(cached, turn(prompt, 3, temperature=0.0))
    nxt = prompt + first["output_ids"] + [5, 6]
    body = turn(nxt, 40, temperature=0.0)
    stream = Stream(cached, body)
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 3)
    assert post(cached, "/pause_generation", {"mode": "retract"})[0] == 200
    time.sleep(0.1)
    assert post(cached, "/continue_generation", {})[0] == 200
    final = stream.join()
    assert final["meta_info"]["num_retractions"] == 1
    assert final["meta_info"]["cached_tokens"] == len(prompt) + 2  # counted once, at admission
    ref = generate(cold, body)
    assert final["output_ids"] == ref["output_ids"]
    assert torch.equal(routes(final, len(nxt)), routes(ref, len(nxt)))


def test_disable_radix_cache_reports_zero_always(servers):
    _, cold = servers
    info = http_json("GET", cold.url + "/server_info")[1]
    assert info["disable_radix_cache"] is True and info["radix_cache_max_tokens"] is None
    assert tree(cold) is None
    prompt = [130, 131, 132, 133]
    first = generate(cold, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}})
    again = generate(cold, {"input_ids": prompt + first["output_ids"],
                            "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert [a["meta_info"]["cached_tokens"] for a in [first, *again]] == [0, 0, 0]
    # a streamed chunk carries the count too (0 here)
    stream = Stream(cold, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}})
    assert stream.join()["meta_info"]["cached_tokens"] == 0


def test_serve_flags_are_parsed_and_checked():
    import argparse

    from pipeline.local.args import ServeArgError, add_arguments, validate

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-path", "/nowhere"])
    assert args.disable_radix_cache is False and args.radix_cache_max_tokens is None
    args = parser.parse_args(["--model-path", "/nowhere", "--disable-radix-cache",
                              "--radix-cache-max-tokens", "0"])
    assert args.disable_radix_cache is True
    with pytest.raises(ServeArgError, match="--radix-cache-max-tokens 0: must be >= 1"):
        validate(args)
