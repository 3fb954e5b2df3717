"""The training rank of the vLLM weight-sync test (importable for spawn): the real Megatron policy
pushes its Hugging Face buckets into a real vLLM server, and the served log-probs are compared
with the trainer's own after EVERY sync.

``run`` builds the policy from the served model's directory, then:

1. samples from the server (T = 1 and T = 0.7, seeded) and recomputes the sampled tokens'
   log-probs with Megatron (``token_log_probs`` at the same temperature): the starting gap;
2. for each transport in turn (gloo broadcast through the worker extension, disk reload, gloo
   again over the same update group): sends a greedy request with a 150-token prompt first (vLLM
   caches its first 128-token block), draws new weights, pushes them (``WeightPusher``, vLLM
   engine, ``verify=True``: every bucket's checksum checked on every worker), then samples again
   (the long prompt among the prompts, so a prefix cache left with the old weights' KV shows)
   and compares with Megatron on the new weights. The version label comes back as the samples'
   ``weight_versions`` spans.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_gspo import parallel
from megatron_gspo.config import ParallelConfig
from megatron_gspo.hf.gather import HFGather
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.model import gpt as policy
from pipeline.engines.vllm.engine import VLLM
from pipeline.generation.client import RolloutClient, SamplingParams
from pipeline.weights.push import WeightPusher
from tests.rollout.sync_worker import _control_group, _megatron_logits

LONG = [(7 * i + 3) % 250 + 2 for i in range(150)]
"""150 tokens: one full 128-token block in vLLM's prefix cache."""
PROMPTS = [[5, 6, 7, 8], [30, 31], [100, 7, 200, 9, 40, 41], LONG]


def _gap(client: RolloutClient, gpt, model_cfg, pg, tag: str) -> dict:
    """Sample every prompt at T = 1 and T = 0.7; max |served - Megatron| log-prob, the spans."""
    requests = []
    for t, temperature in enumerate((1.0, 0.7)):
        for p, prompt in enumerate(PROMPTS):
            sp = SamplingParams(temperature=temperature, max_new_tokens=12,
                                sampling_seed=1000 * t + p)
            requests.append((f"{tag}-{t}-{p}", prompt, sp))
    results = client.generate_sync(requests)
    worst, spans = 0.0, set()
    for r, (_, _, sp) in zip(results, requests):
        tokens = r.prompt_ids + r.output_ids
        logits = _megatron_logits(gpt, tokens)
        lp, _ = policy.token_log_probs(logits[:, :-1], torch.tensor([tokens[1:]]), model_cfg, pg,
                                       temperature=sp.temperature)
        ours = lp[0, len(r.prompt_ids) - 1:].double()
        served = torch.tensor(r.output_logprobs, dtype=torch.float64)
        worst = max(worst, (ours - served).abs().max().item())
        spans |= {(s.version, s.start, s.end) for s in r.weight_versions}
    return {"max_abs_diff": worst, "spans": sorted(spans, key=str), "n": len(results)}


def run(rank: int, world_size: int, hf_dir: str, url: str, shared_dir: str,
        transports: list[str]) -> dict:
    pg = parallel.initialize(ParallelConfig())
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, ParallelConfig(), pg).eval()
    hf = load_file(f"{hf_dir}/model.safetensors")
    policy.load_hf_weights(gpt, model_cfg, pg, hf.__getitem__)
    client = RolloutClient(server_urls=[url], wire=VLLM.wire, request_timeout_s=120)
    report = {"initial": _gap(client, gpt, model_cfg, pg, "init"), "syncs": []}
    pushers: dict[str, WeightPusher] = {}
    for k, transport in enumerate(transports):
        # the long prompt's first block into the prefix cache, under the old weights
        client.generate_sync([(f"warm{k}", LONG, SamplingParams(temperature=1.0,
                                                                 max_new_tokens=1,
                                                                 sampling_seed=1))])
        policy.init_weights(gpt, model_cfg, pg, seed=500 + k)
        with torch.no_grad():  # decisive logits (init_weights' N(0, 0.02) is near uniform)
            for _, p in gpt.named_parameters():
                if p.dim() > 1:
                    p.mul_(8.0)
        if transport not in pushers:
            pushers[transport] = WeightPusher([url], transport=transport, shared_dir=shared_dir,
                                              group=_control_group(), engine=VLLM, verify=True,
                                              timeout_s=120)
        t0 = time.perf_counter()
        stats = pushers[transport].push(HFGather(model_cfg, bucket_bytes=64 * 1024)
                                        .buckets(gpt, pg), str(k + 1))
        seconds = time.perf_counter() - t0
        gap = _gap(client, gpt, model_cfg, pg, f"sync{k}")
        report["syncs"].append({"transport": transport, "version": k + 1, "seconds": seconds,
                                "buckets": stats.num_buckets,
                                "verified": stats.verified_buckets, **gap})
    for pusher in pushers.values():
        pusher.close()
    parallel.destroy_model_parallel()
    dist.barrier()
    return report
