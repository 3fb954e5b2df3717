"""Spawned training ranks of the weight-sync and log-prob tests (importable for spawn).

``run`` builds the real Megatron policy (EP2 on two gloo ranks), then

1. loads the Hugging Face weights the local servers started from (``load_hf_weights``), asks a
   server for samples with log-probs (T = 1 and T = 0.7 with top-p 0.9) and recomputes the
   log-probs of the sampled tokens with Megatron (``token_log_probs`` at the same temperature);
2. for each transport: draws new weights (``init_weights`` with a new seed), calls
   ``WeightPusher.push`` of the trainer's buckets on both ranks, and checks on the servers: every local HF piece is bit-equal to
   what ``/get_weights_by_name`` returns, ``weight_version`` advanced, and the servers' greedy
   outputs are Megatron's greedy outputs under the new weights.

``run_layout`` pushes by every transport from one training layout and reads back every TP rank's
whole-model checksum; ``run_delta`` runs N bf16 delta syncs. Each returns, on rank 0, a report the
test asserts on.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy

from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo import parallel
from megatron_gspo.config import ParallelConfig
from megatron_gspo.hf.gather import HFGather
from pipeline.generation.client import RolloutClient, SamplingParams, control, http_json
from pipeline.weights.push import WeightPusher
from tests.distributed.convert_worker import forward_last_stage

PROMPTS = [[5, 6, 7, 8], [30, 31], [100, 7, 200, 9, 40, 41], [3]]
GREEDY_TOKENS = 8


def _megatron_logits(gpt, tokens: list[int]) -> torch.Tensor:
    batch = {"tokens": torch.tensor([tokens]),
             "position_ids": torch.arange(len(tokens))[None]}
    return forward_last_stage(gpt, batch)  # [1, L, V_padded] (tp = pp = 1)


def _megatron_greedy(gpt, model_cfg, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        logits = _megatron_logits(gpt, tokens)[0, -1, : model_cfg.vocab_size]
        tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt):]


def _server_weights_match(url: str, pieces) -> list[str]:
    """Names of local HF pieces whose server-side values differ (bit for bit)."""
    cache: dict[str, torch.Tensor] = {}
    bad = []
    for piece, local in pieces:
        if piece.hf_name not in cache:
            status, values = http_json("POST", url + "/get_weights_by_name",
                                       {"name": piece.hf_name, "truncate_size": 1 << 30})
            assert status == 200, (url, piece.hf_name, values)
            cache[piece.hf_name] = torch.tensor(values, dtype=torch.float32)
        if not torch.equal(cache[piece.hf_name][piece.hf_index], local.float()):
            bad.append(piece.hf_name)
    return bad


def run(rank: int, world_size: int, hf_dir: str, server_urls: list[str], transports: list[str],
        shared_dir: str, bucket_bytes: int):
    from safetensors.torch import load_file

    par = ParallelConfig(expert=world_size)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg).eval()
    report: dict = {"logprobs": [], "syncs": []}

    # 1. log-probs of the server's samples, recomputed by Megatron on the same HF weights
    hf = load_file(f"{hf_dir}/model.safetensors")
    policy.load_hf_weights(gpt, model_cfg, pg, hf.__getitem__)
    samples = [None]
    if rank == 0:
        client = RolloutClient(server_urls=server_urls[:1], request_timeout_s=120)
        requests = []
        for t, (temperature, top_p) in enumerate([(1.0, 1.0), (0.7, 0.9)]):
            for p, prompt in enumerate(PROMPTS):
                sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12,
                                    sampling_seed=1000 * t + p)
                requests.append((f"lp-{t}-{p}", prompt, sp))
        samples[0] = [(r.prompt_ids, r.output_ids, r.output_logprobs, sp.temperature)
                      for r, (_, _, sp) in zip(client.generate_sync(requests), requests)]
    dist.broadcast_object_list(samples, src=0)
    for prompt, output, server_lp, temperature in samples[0]:
        tokens = prompt + output
        logits = _megatron_logits(gpt, tokens)
        target = torch.tensor([tokens[1:]])
        lp, _ = policy.token_log_probs(logits[:, :-1], target, model_cfg, pg,
                                       temperature=temperature)
        ours = lp[0, len(prompt) - 1:].double()
        report["logprobs"].append({"temperature": temperature, "n": len(output),
                                   "max_abs_diff": (ours - torch.tensor(server_lp, dtype=torch.float64)
                                                    ).abs().max().item()})

    # 2. weight sync by each transport
    for k, transport in enumerate(transports):
        version = f"step{k + 1}"
        policy.init_weights(gpt, model_cfg, pg, seed=101 + k)
        # init_weights' N(0, 0.02) weights make near-uniform logits; scale the matrices so the
        # greedy tokens are decisive (the same on every rank: init is layout-independent).
        with torch.no_grad():
            for name, p in gpt.named_parameters():
                if p.dim() > 1:
                    p.mul_(8.0)
        before = None
        if rank == 0:
            before = [control(u, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {
                "max_new_tokens": GREEDY_TOKENS, "temperature": 0}})["output_ids"] for u in server_urls]
        t0 = time.perf_counter()
        pusher = WeightPusher(server_urls, transport=transport, shared_dir=shared_dir,
                              group=_control_group())
        stats = pusher.push(HFGather(model_cfg, bucket_bytes=bucket_bytes).buckets(gpt, pg),
                            version)
        pusher.close()
        seconds = time.perf_counter() - t0
        pieces = list(rank_pieces.local_hf_pieces(gpt, model_cfg, pg))
        mismatched = {u: _server_weights_match(u, pieces) for u in server_urls}
        expected = [_megatron_greedy(gpt, model_cfg, p, GREEDY_TOKENS) for p in PROMPTS]
        if rank == 0:
            after, versions = [], []
            for u in server_urls:
                outs = control(u, "/generate", {"input_ids": PROMPTS, "sampling_params": {
                    "max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}})
                after.append([o["output_ids"] for o in outs])
                versions.append((http_json("GET", u + "/model_info")[1]["weight_version"],
                                 {o["meta_info"]["weight_version"] for o in outs}))
            report["syncs"].append({
                "transport": transport, "version": version, "stats": stats, "seconds": seconds,
                "mismatched_rank0": mismatched, "before": before, "after": after,
                "expected": expected, "versions": versions})
        else:
            report["mismatched_rank1"] = report.get("mismatched_rank1", {})
            report["mismatched_rank1"][transport] = mismatched
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mismatched)
        if rank == 0:
            report["syncs"][-1]["mismatched"] = gathered
    parallel.destroy_model_parallel()
    return report if rank == 0 else None


_CONTROL = {}


def _control_group():
    """The gloo control group the launcher passes to the pusher (here: a second gloo group)."""
    if "group" not in _CONTROL:
        _CONTROL["group"] = dist.new_group(backend="gloo")
    return _CONTROL["group"]


def _full_hf(gpt, model_cfg, pg, dtype=None) -> dict:
    """rank 0: every full HF tensor of the live policy (copies); {} elsewhere."""
    from megatron_gspo.hf.gather import iter_full_hf_tensors

    out = {}
    for bucket in iter_full_hf_tensors(gpt, model_cfg, pg, dtype=dtype):
        out.update({n: t.clone() for n, t in bucket.items()})
    return out


def _server_checksums(server_urls) -> list[list[str]]:
    """Per server, the whole-model checksum of every TP rank (``/weights_checker``)."""
    return [http_json("POST", u + "/weights_checker", {"action": "checksum"})[1]
            ["per_tp_rank_checksum"] for u in server_urls]


def _expected_checksum(full: dict, server_dtype=torch.float32) -> str:
    from pipeline.weights.transport import weights_checksum

    return weights_checksum((n, t.to(server_dtype)) for n, t in full.items())


def run_layout(rank: int, world_size: int, parallel_section: dict, hf_dir: str,
               server_urls: list[str], transports: list[str], shared_dir: str,
               bucket_bytes: int, senders: str = "rank"):
    """One training layout: random policy weights -> each transport -> every TP rank of every
    server holds exactly the trainer's full weights; the pusher verified every bucket.
    ``senders``: rollout.weight_sync.senders (``hf.gather.sender_ranks``)."""
    par = ParallelConfig(**parallel_section)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    from megatron_gspo.hf.gather import sender_ranks

    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes,
                      senders=sender_ranks(senders, pg.pp.rank()))
    report = {"sources": None, "pushes": []}
    for k, transport in enumerate(transports):
        policy.init_weights(gpt, model_cfg, pg, seed=300 + k)
        pusher = WeightPusher(server_urls, transport=transport, shared_dir=shared_dir,
                              group=_control_group())
        stream = gather.buckets(gpt, pg)
        report["sources"] = stream.sources
        stats = pusher.push(stream, f"{transport}-{k}")
        pusher.close()
        full = _full_hf(gpt, model_cfg, pg)
        if rank == 0:
            report["pushes"].append({"transport": transport, "stats": stats,
                                     "expected": _expected_checksum(full),
                                     "servers": _server_checksums(server_urls)})
    parallel.destroy_model_parallel()
    return report if rank == 0 else None


def _perturbed(base: dict, step: int, fraction: float) -> dict:
    """A sparse, layout-independent update of the full HF weights (what a small-lr step does to
    bf16 weights: a few elements change): ``fraction`` of each tensor's elements, seeded."""
    import zlib

    out = {}
    for name, t in base.items():
        gen = torch.Generator().manual_seed(step * 1_000_003 + zlib.crc32(name.encode()))
        pick = torch.rand(t.shape, generator=gen) < fraction
        out[name] = t + pick * (0.05 * torch.randn(t.shape, generator=gen))
    return out


def run_delta(rank: int, world_size: int, parallel_section: dict, hf_dir: str,
              server_urls: list[str], transport: str, num_syncs: int, full_every: int,
              bucket_bytes: int):
    """bf16 delta syncs: after every one, every TP rank of every server holds the trainer's bf16
    weights bit for bit (whole-model checksums), and every bucket was verified."""
    from safetensors.torch import load_file

    par = ParallelConfig(**parallel_section)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes, dtype=torch.bfloat16)
    pusher = WeightPusher(server_urls, transport=transport, delta=True, full_every=full_every,
                          group=_control_group())
    weights = load_file(f"{hf_dir}/model.safetensors")
    report = []
    for step in range(num_syncs):
        weights = _perturbed(weights, step, fraction=0.02 if step else 1.0)
        policy.load_hf_weights(gpt, model_cfg, pg, weights.__getitem__)
        stats = pusher.push(gather.buckets(gpt, pg), f"delta-{step}")
        full = _full_hf(gpt, model_cfg, pg, dtype=torch.bfloat16)
        if rank == 0:
            report.append({"stats": stats, "expected": _expected_checksum(full),
                           "servers": _server_checksums(server_urls)})
    pusher.close()
    parallel.destroy_model_parallel()
    return report if rank == 0 else None


def run_disk_recycled(rank: int, world_size: int, hf_dir: str, server_urls: list[str],
                      shared_dir: str, bucket_sizes: list[int]):
    """Disk pushes by one pusher, new weights and a new bucket size each time: from the third on
    the pusher overwrites the files of the version it retired (in place); every push must still
    leave exactly the trainer's weights on every TP rank, and exactly its own shards on disk."""
    import json
    from pathlib import Path

    par = ParallelConfig()
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    pusher = WeightPusher(server_urls, transport="disk", shared_dir=shared_dir,
                          group=_control_group())
    report = []
    for k, bucket_bytes in enumerate(bucket_sizes):
        policy.init_weights(gpt, model_cfg, pg, seed=700 + k)
        stats = pusher.push(HFGather(model_cfg, bucket_bytes=bucket_bytes).buckets(gpt, pg),
                            f"recycled-{k}")
        final = Path(shared_dir) / f"weights_vrecycled-{k}"
        index = json.loads((final / "model.safetensors.index.json").read_text())
        report.append({"stats": stats, "expected": _expected_checksum(_full_hf(gpt, model_cfg, pg)),
                       "servers": _server_checksums(server_urls),
                       "listing": sorted(p.name for p in Path(shared_dir).iterdir()),
                       "files": sorted(p.name for p in final.iterdir()),
                       "indexed": sorted(set(index["weight_map"].values()))})
    pusher.close()
    report.append({"after_close": sorted(p.name for p in Path(shared_dir).iterdir())})
    parallel.destroy_model_parallel()
    return report


def _fp8_expected_checksum(full: dict, server_dtype=torch.float32) -> str:
    """The whole-model checksum of a server that runs FP8 weights: every projection as the
    dequantized value of its FP8 blocks (``megatron_gspo.hf.fp8``), the rest as sent."""
    from megatron_gspo.hf.fp8 import dequantize, is_quantized, quantize
    from pipeline.weights.transport import weights_checksum

    def served(name, t):
        return dequantize(*quantize(t)) if is_quantized(name, t.shape) else t

    return weights_checksum((n, served(n, t).to(server_dtype)) for n, t in full.items())


def run_fp8(rank: int, world_size: int, parallel_section: dict, hf_dir: str,
            server_urls: list[str], transports: list[str], shared_dir: str, bucket_bytes: int):
    """``rollout.quantization: fp8``: random policy weights -> each transport, FP8 on the wire ->
    every TP rank of every server computes with the dequantized FP8 blocks of the trainer's
    projections and the trainer's other weights exactly; every bucket's checksum (of the FP8
    blocks and scales sent) verified."""
    par = ParallelConfig(**parallel_section)
    pg = parallel.initialize(par)
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes)
    report = {"pushes": []}
    for k, transport in enumerate(transports):
        policy.init_weights(gpt, model_cfg, pg, seed=500 + k)
        pusher = WeightPusher(server_urls, transport=transport, shared_dir=shared_dir,
                              group=_control_group(), quantization="fp8")
        stats = pusher.push(gather.buckets(gpt, pg), f"fp8-{transport}-{k}")
        pusher.close()
        full = _full_hf(gpt, model_cfg, pg)
        if rank == 0:
            from megatron_gspo.hf.fp8 import served_bytes

            wire = sum(served_bytes(n, t.shape, t.element_size()) for n, t in full.items())
            report["pushes"].append({"transport": transport, "stats": stats, "wire": wire,
                                     "expected": _fp8_expected_checksum(full),
                                     "unquantized": _expected_checksum(full),
                                     "servers": _server_checksums(server_urls)})
    parallel.destroy_model_parallel()
    return report if rank == 0 else None
