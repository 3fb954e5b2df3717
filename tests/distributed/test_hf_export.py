"""A policy trained/initialised under EP2 is exported as a Hugging Face directory that transformers
loads, and transformers' own Qwen3-MoE gives the same per-token log-probs as the Megatron policy."""

from __future__ import annotations

import json
import re

import torch

from megatron_gspo.model import gpt as policy
from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.export import export_hf_dir
from tests.distributed.layouts import tiny_config
from bench.spawn import run_on_ranks


def _export_worker(rank, world, cfg_dict, out_dir, tokens):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=3)
    with torch.no_grad():  # make the norms non-trivial so that they are checked too
        for name, p in gpt.named_parameters():
            if "norm" in name:
                p.mul_(1.0 + 0.1 * torch.sin(torch.arange(p.numel(), dtype=p.dtype)).view_as(p))
    export_hf_dir(gpt, cfg.model, pg, out_dir)
    gpt.eval()
    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).expand_as(tokens).contiguous()
        logits = gpt(tokens[:, :-1].contiguous(), pos[:, :-1].contiguous(), None)
        log_probs, _ = policy.token_log_probs(logits, tokens[:, 1:].contiguous(), cfg.model, pg)
    parallel.destroy_model_parallel()
    return log_probs


def test_exported_policy_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config({"expert": 2}, {"norm_topk_prob": True, "vocab_size": 250})
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (3, 12), generator=gen)
    results = run_on_ranks(2, _export_worker, (cfg, str(tmp_path / "hf"), tokens), timeout_s=300)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 250 and config["head_dim"] == 32
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits.double()
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    for log_probs in results:  # both EP ranks ran the same batch
        assert (log_probs.double() - expected).abs().max() < 1e-5
    # nothing funnels through rank 0: under EP2 rank 1 is the source of its experts and writes
    # their shards itself (each shard's metadata names its writer); the index names every shard
    from safetensors import safe_open

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    writers = {}
    for shard in shards:
        with safe_open(str(tmp_path / "hf" / shard), framework="pt") as f:
            for name in f.keys():
                writers[name] = int(f.metadata()["rank"])
    assert set(writers) == set(index["weight_map"])
    expert = {n: int(re.search(r"\.mlp\.experts\.(\d+)\.", n).group(1)) for n in writers
              if ".mlp.experts." in n}
    assert expert and all(writers[n] == e // 2 for n, e in expert.items())  # 4 experts, EP2
    assert {writers[n] for n in writers if n not in expert} == {0}  # DP-replicated: lowest rank
