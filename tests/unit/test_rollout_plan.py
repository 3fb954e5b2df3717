"""Issue 37, items 4 and 5: ``megatron-gspo plan`` models the weight-sync pause per step of both
transports from the bytes each link carries (``megatron_gspo.rollout_plan``), with its
bandwidths stated and changeable, next to NeMo-RL's published refit times, and the memory of one
SGLang GPU with bf16 and with FP8 weights. The expected values are computed here from the
model's dimensions (not from the planner's own tensor table)."""

from __future__ import annotations

import math
import re

import pytest

from launch.cli import main
from megatron_gspo.config import load_config
from megatron_gspo.plan import plan_memory
from megatron_gspo.rollout_plan import (GB, GIB, SyncAssumptions, inventory, server_memory,
                                        sync_estimate)

RECIPES = {"launch/configs/qwen3_30b_a3b.yaml": 16, "launch/configs/qwen3_235b_a22b.yaml": 64}


def _by_hand(m) -> dict:
    """Elements of Qwen3-MoE's HF tensors from config.json's numbers: the FP8-quantized
    projections (with their 128 x 128 scale blocks) and the rest."""
    H, d, E, I, L = m.hidden_size, m.head_dim, m.num_experts, m.moe_ffn_hidden_size, m.num_layers
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    projections = [(q, H), (kv, H), (kv, H), (H, q)] + [(I, H), (I, H), (H, I)] * E
    blocks = sum(math.ceil(a / 128) * math.ceil(b / 128) for a, b in projections) * L
    quantized = sum(a * b for a, b in projections) * L
    rest = L * (2 * H + 2 * d + E * H) + H + m.vocab_size * H * (1 if m.tie_word_embeddings else 2)
    tensors = L * (9 + 3 * E) + 2 + (0 if m.tie_word_embeddings else 1)
    return dict(quantized=quantized, blocks=blocks, rest=rest, tensors=tensors)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bytes_on_the_wire_bf16_and_fp8(recipe):
    cfg = load_config(recipe)
    hand = _by_hand(cfg.model)
    bf16, fp8 = inventory(cfg, fp8=False), inventory(cfg, fp8=True)
    assert bf16.tensors == fp8.tensors == hand["tensors"]
    assert bf16.total == 2 * (hand["quantized"] + hand["rest"])
    assert fp8.total == hand["quantized"] + 4 * hand["blocks"] + 2 * hand["rest"]
    # the published sizes: Qwen3-30B-A3B 61 GB, Qwen3-235B-A22B 470 GB in bf16
    assert round(bf16.total / GB) == {"launch/configs/qwen3_30b_a3b.yaml": 61,
                                      "launch/configs/qwen3_235b_a22b.yaml": 470}[recipe]


def test_the_pause_follows_the_bytes_and_the_stated_bandwidths():
    cfg = load_config("launch/configs/qwen3_30b_a3b.yaml")
    a = SyncAssumptions()
    inv = inventory(cfg, fp8=False)
    buckets = math.ceil(inv.total / (512 << 20))
    dist = sync_estimate(cfg, 16, "distributed", a, fp8=False)
    assert dist.seconds == pytest.approx(inv.total / (50e9 * 0.8) + buckets * 0.003
                                         + inv.tensors * 20e-6)
    # disk: 2 training nodes write, each rollout node reads the whole model (servers of 2 GPUs),
    # each server process copies what it keeps (half the model) meanwhile
    disk = sync_estimate(cfg, 16, "disk", a, fp8=False)
    read = max(inv.total / 10e9, inv.total / 2 / 8e9)
    assert disk.seconds == pytest.approx(inv.total / (2 * 5e9) + read + inv.tensors * 20e-6)
    # twice the InfiniBand: the egress term halves; a slower filesystem: only disk slows
    fast = sync_estimate(cfg, 16, "distributed", SyncAssumptions(ib_gbps=100), fp8=False)
    assert dist.seconds - fast.seconds == pytest.approx(inv.total / (100e9 * 0.8))
    nfs = SyncAssumptions.parse(["fs_read_gbps=2", "fs_write_gbps=1"])
    assert sync_estimate(cfg, 16, "distributed", nfs, fp8=False).seconds == dist.seconds
    assert sync_estimate(cfg, 16, "disk", nfs, fp8=False).seconds == pytest.approx(
        inv.total / 2e9 + inv.total / 2e9 + inv.tensors * 20e-6)
    # FP8 on the wire: about half the bytes
    half = sync_estimate(cfg, 16, "distributed", a, fp8=True)
    assert 0.45 < (half.seconds - inv.tensors * 20e-6) / (dist.seconds - inv.tensors * 20e-6) < 0.6


def test_server_memory_with_fp8_weights_leaves_more_kv_cache():
    cfg = load_config("launch/configs/qwen3_30b_a3b.yaml")
    bf16, fp8 = server_memory(cfg, 80, fp8=False), server_memory(cfg, 80, fp8=True)
    assert bf16.weights == inventory(cfg, fp8=False).total / 2  # TP2: half of every tensor
    assert fp8.weights == inventory(cfg, fp8=True).total / 2
    assert bf16.budget == fp8.budget == 0.85 * 80 * GIB
    per_token = 2 * 48 * (4 // 2) * 128 * 2  # K and V, 48 layers, 2 of 4 KV heads per GPU, bf16
    assert bf16.kv_tokens == int((bf16.budget - bf16.weights) // per_token)
    assert fp8.kv_tokens > 1.3 * bf16.kv_tokens


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_prints_both_transports_fp8_memory_and_the_published_reference(recipe, capsys):
    world = str(RECIPES[recipe])
    assert main(["plan", "--config", recipe, "--world-size", world]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("fits: yes")
    lines = {t: next(l for l in out if l.startswith(f"  {t}: ")) for t in ("distributed", "disk")}
    seconds = {t: float(re.match(rf"  {t}: ([\d.]+) s = ", l).group(1)) for t, l in lines.items()}
    assert lines["distributed"].endswith("[this config]")  # the recipes' transport
    assert seconds["distributed"] < seconds["disk"] / 2
    assert any("NeMo-RL, Qwen3-30B-A3B" in l and "0.74-1.00 s" in l for l in out)
    assert any(l.startswith("  assumptions (plan --sync-assume NAME=VALUE): ib_gbps 50,")
               for l in out)
    served = [l for l in out if l.startswith("  served in ")]
    assert len(served) == 2 and "served in fp8" in served[1] and "x1." in served[1]
    # the filesystem is a parameter: NFS-like reads make the disk pause longer, not the other
    assert main(["plan", "--config", recipe, "--world-size", world,
                 "--sync-assume", "fs_read_gbps=2"]) == 0
    out = capsys.readouterr().out.splitlines()
    slow = float(re.match(r"  disk: ([\d.]+) s", next(l for l in out if l.startswith("  disk:")))
                 .group(1))
    assert slow > seconds["disk"] and next(
        l for l in out if l.startswith("  distributed:")) == lines["distributed"]


@pytest.mark.parametrize("item", ["fs_read_gbps", "fs_read=3", "fs_read_gbps=-1",
                                  "ib_gbps=fast", "ib_gbps=nan"])
def test_a_bad_assumption_exits_2_naming_the_flag(item, capsys):
    argv = ["plan", "--config", "launch/configs/qwen3_30b_a3b.yaml", "--sync-assume", item]
    assert main(argv) == 2
    assert f"--sync-assume: {item!r}" in capsys.readouterr().err


@pytest.mark.parametrize("engine,flag,default", [("sglang", "mem_fraction_static", 0.85),
                                                 ("vllm", "gpu_memory_utilization", 0.92)])
def test_server_memory_is_planned_in_the_engines_own_terms(engine, flag, default):
    """``rollout.mem_fraction_static`` is SGLang's --mem-fraction-static (weights + KV cache) or
    vLLM's --gpu-memory-utilization (also activations and CUDA graphs, which vLLM profiles when
    it starts: the planned KV cache is an upper bound), with each engine's own default when
    unset (vLLM 0.32's 0.92 is checked against vLLM's code in the vllm tier:
    tests/engines/test_vllm_server_args.py); the weight-update groups every server GPU joins:
    one per sender for SGLang, vLLM's weight-transfer engine's one for vLLM."""
    base = ["rollout.weight_sync.transport=distributed", f"rollout.engine={engine}",
            "rollout.mem_fraction_static=null"]
    cfg = load_config("launch/configs/qwen3_30b_a3b.yaml", base)
    mem = server_memory(cfg, 80, fp8=False)
    assert mem.budget == default * 80 * GIB
    per_token = 2 * 48 * (4 // 2) * 128 * 2  # K and V, 48 layers, 2 of 4 KV heads per GPU, bf16
    assert mem.kv_tokens == int((default * 80 * GIB - mem.weights) // per_token)
    lines = notes_of(cfg)
    (head,) = [l for l in lines if l.startswith("server memory per ")]
    assert head.startswith(f"server memory per {'SGLang' if engine == 'sglang' else 'vLLM'} GPU ")
    assert f"{flag} {default:g} (" in head and f"= {default * 80:.1f} GiB" in head
    served = [l for l in lines if l.startswith("  served in ")]
    assert len(served) == 2
    assert all(("at most: less the activation peak" in l) == (engine == "vllm") for l in served)
    (groups,) = [l for l in lines if l.startswith("rollout-server GPU")]
    count = 1 if engine == "vllm" else 2  # 16 ranks, one stage, 8 GPUs a node: a sender each
    name = "SGLang" if engine == "sglang" else "vLLM"
    assert f": {count} update group(s) (" in groups and f"outside {name}'s {flag}" in groups
    assert f"what it leaves: {1 - default:.2f} x 80 GiB" in groups
    # set: the same share for both, in each engine's flag
    set_cfg = load_config("launch/configs/qwen3_30b_a3b.yaml",
                          [*base[:2], "rollout.mem_fraction_static=0.7"])
    assert server_memory(set_cfg, 80, fp8=False).budget == 0.7 * 80 * GIB
    assert any(l.startswith("server memory per ") and f"{flag} 0.7 (rollout.mem_fraction_static)"
               in l for l in notes_of(set_cfg))


def notes_of(cfg) -> list[str]:
    return plan_memory(cfg, 16, 80).notes
