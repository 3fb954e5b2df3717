"""Issue 37, item 5: FP8 rollouts, bf16 training (``rollout.quantization: fp8``), without
processes: the block format (``megatron_gspo.hf.fp8``) against a block-by-block reference, the
wire the pusher sends (``pipeline.weights.fp8``), the local server's weight table that loads it
(``pipeline.local.weight_table``: FP8 blocks dequantized, checksums of what was sent, the
mismatches refused), the config (the log-prob mismatch correction on by default and stated, the
combinations that cannot work refused) and the pusher's check of the servers' quantization.
tests/rollout/test_fp8_sync.py pushes a real policy through every transport to servers running
SGLang's own weight-update code; tests/slurm/test_sglang_cli.py parses the rendered flag with
SGLang 0.5.23's parser."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.hf_tiny import build_hf_model
from launch.cli import main
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.hf import fp8
from megatron_gspo.hf.safetensors_io import HFCheckpoint
from pipeline.local.model_files import ModelFilesError, check_model_dir
from pipeline.local.model_files import load_config as hf_config
from pipeline.local.weight_table import WeightTable
from pipeline.weights import transport as wt
from pipeline.weights.fp8 import fp8_entries
from pipeline.weights.push import WeightPusher
from tests.rollout.tiny import make_model_dir

CONFIG = "launch/configs/tiny_cpu.yaml"


def test_blocks_match_a_block_by_block_reference():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.logspace(-3, 1, 200)  # columns of all scales
    w[128:256, 128:] = 0  # an all-zero block
    q, scale = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == fp8.scale_shape(w.shape) == (3, 2)
    for i in range(3):
        for j in range(2):
            block = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            amax = block.abs().max()
            want = amax / 448 if amax > 0 else torch.tensor(1.0)
            assert scale[i, j] == pytest.approx(float(want), rel=1e-6)
            ref = (block / want).to(torch.float8_e4m3fn)
            got = q[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), (i, j)
    back = fp8.dequantize(q, scale)
    # e4m3: 3 mantissa bits, so half an ulp is 1/16 of the value (normal range of each block)
    normal = w.abs() >= scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200] * 2 ** -6
    assert ((back - w).abs() <= w.abs() / 16 + 1e-12)[normal].all()
    assert torch.equal(back[128:256, 128:], torch.zeros(128, 72))
    assert fp8.served_bytes("model.layers.0.self_attn.q_proj.weight", (300, 200)) == 300 * 200 + 4 * 6
    assert not fp8.is_quantized("model.layers.0.mlp.gate.weight", (8, 64))
    assert not fp8.is_quantized("lm_head.weight", (256, 64))
    assert fp8.is_quantized("model.layers.3.mlp.experts.7.down_proj.weight", (64, 32))


@pytest.fixture()
def model():
    """A tiny Qwen3-MoE (transformers), new for each test: the tables below write into it."""
    return build_hf_model("gqa2_untied", seed=0, num_layers=2)


def _named(model, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    table = WeightTable(model)
    return [(n, table.view(n).clone() * scale) for n in table.names()]


def test_the_fp8_wire_is_aligned_and_the_server_computes_with_its_blocks(model):
    named = _named(model, 1.5)
    wire = fp8_entries(named)
    dtypes = [t.dtype for _, t in wire]
    assert dtypes == sorted(dtypes, key=lambda d: -d.itemsize)  # scales first: aligned offsets
    layout, _ = wt.flat_layout([n for n, _ in wire], dtypes, [t.shape for _, t in wire])
    names = {n for n, _ in wire}
    quantized = [n for n, t in named if fp8.is_quantized(n, t.shape)]
    assert quantized and all(n + fp8.SCALE_SUFFIX in names for n in quantized)
    table = WeightTable(model, fp8=True)
    digest = table.apply_update(dict(wire), {}, checksum=True)
    assert digest == wt.bucket_checksum(wire)  # the pusher's expected: what was sent
    for name, t in named:
        want = fp8.dequantize(*fp8.quantize(t)) if name in quantized else t
        assert torch.equal(table.view(name), want), name
        if name in quantized:
            assert not torch.equal(table.view(name), t)  # FP8 rounding is visible


def test_fp8_checkpoints_in_shards_load_like_updates(model, tmp_path):
    wire = fp8_entries(_named(model, 0.5))
    layout, _ = wt.flat_layout([n for n, _ in wire], [t.dtype for _, t in wire],
                               [t.shape for _, t in wire])
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in wire])
    wt.write_shard(tmp_path / "model-00001-of-00001.safetensors", layout, flat)
    from_disk, from_wire = WeightTable(build_hf_model("gqa2_untied", seed=1, num_layers=2),
                                       fp8=True), WeightTable(model, fp8=True)
    sums = from_disk.load_shards(tmp_path)
    assert sums == {"model-00001-of-00001.safetensors": wt.bucket_checksum(wire)}
    from_wire.apply_update(dict(wire), {})
    for name in from_wire.names():
        assert torch.equal(from_disk.view(name), from_wire.view(name)), name


def test_the_server_refuses_what_its_weights_are_not(model):
    named = dict(_named(model))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    plain, fp8_table = WeightTable(model), WeightTable(model, fp8=True)
    wire = dict(fp8_entries(list(named.items())))
    problems = plain.check(wire)
    assert any(f"{q_name}: float8_e4m3fn, but this server runs without --quantization fp8" in p
               for p in problems)
    assert any(p.startswith(f"{q_name}{fp8.SCALE_SUFFIX}: no such parameter") for p in problems)
    assert any(f"{q_name}: torch.float32 without {q_name}_scale_inv: this server runs FP8 "
               "weights" in p for p in fp8_table.check({q_name: named[q_name]}))
    assert any("a scale without its float8_e4m3fn weight" in p for p in fp8_table.check(
        {q_name + fp8.SCALE_SUFFIX: wire[q_name + fp8.SCALE_SUFFIX]}))
    with pytest.raises(ValueError, match="without --quantization fp8"):
        plain.apply_update(wire, {})


def test_the_start_rounds_the_projections_to_their_fp8_blocks(model):
    table = WeightTable(build_hf_model("gqa2_untied", seed=0, num_layers=2), fp8=True)
    before = dict(_named(model))
    table.round_to_fp8()
    for name, t in before.items():
        rounded = fp8.is_quantized(name, t.shape)
        assert torch.equal(table.view(name), fp8.dequantize(*fp8.quantize(t)) if rounded else t)


def test_config_turns_the_correction_on_and_refuses_what_cannot_work(capsys):
    cfg = load_config(CONFIG, ["rollout.quantization=fp8"])
    assert cfg.gspo.old_logprobs == "recompute" and cfg.gspo.uses_behaviour_weight()
    with pytest.raises(ConfigError, match=r"rollout\.quantization: fp8 rollouts sample from FP8 "
                                          r"weights.*gspo\.old_logprobs: recompute"):
        load_config(CONFIG, ["rollout.quantization=fp8", "gspo.old_logprobs=rollout"])
    load_config(CONFIG, ["rollout.quantization=fp8", "gspo.old_logprobs=rollout",
                         "gspo.mismatch_correction=false"])  # explicitly uncorrected: allowed
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.delta: not with "
                                          r"rollout\.quantization fp8"):
        load_config(CONFIG, ["rollout.quantization=fp8", "rollout.weight_sync.transport=tensor",
                             "rollout.weight_sync.delta=true",
                             "rollout.weight_sync.dtype=bfloat16"])
    with pytest.raises(ConfigError, match=r"rollout\.quantization"):
        load_config(CONFIG, ["rollout.quantization=int4"])
    assert main(["config", "--config", CONFIG, "--set", "rollout.quantization=fp8"]) == 0
    assert ("# note: rollout.quantization fp8: the rollout/trainer log-prob mismatch of FP8 "
            "rollouts is corrected by the behaviour weight (gspo.mismatch_correction on, "
            "truncated at gspo.mismatch_cap 2)") in capsys.readouterr().out


@pytest.mark.parametrize("pushed, served, ok", [("fp8", "fp8", True), (None, None, True),
                                                 ("fp8", None, False), (None, "fp8", False)])
def test_the_pusher_sends_only_what_the_servers_run(pushed, served, ok, tmp_path):
    pusher = WeightPusher(["http://127.0.0.1:1"], transport="disk", shared_dir=tmp_path,
                          quantization=pushed)
    try:
        if ok:
            pusher._check_quantization("http://s", {"quantization": served})
        else:
            with pytest.raises(ValueError, match=rf"http://s: rollout\.quantization is "
                                                 rf"{pushed or 'null'} but the server runs "
                                                 rf"{served or 'unquantized'} weights"):
                pusher._check_quantization("http://s", {"quantization": served})
    finally:
        pusher.close()


def test_plan_sizes_fp8_weights_from_the_same_rule():
    cfg = load_config("launch/configs/qwen3_30b_a3b.yaml")
    m = cfg.model
    blocks = math.ceil(m.moe_ffn_hidden_size / 128) * math.ceil(m.hidden_size / 128)
    assert fp8.served_bytes("model.layers.0.mlp.experts.0.up_proj.weight",
                            (m.moe_ffn_hidden_size, m.hidden_size)) == \
        m.moe_ffn_hidden_size * m.hidden_size + 4 * blocks


def test_convert_hf_to_fp8_writes_the_checkpoint_the_servers_start_from(tmp_path, capsys):
    """``megatron-gspo convert hf-to-fp8``: every projection as FP8 blocks + scale, the rest as
    it was, quantization_config in config.json (what launch slurm checks), tokenizer copied;
    the local server refuses to serve it (it loads bf16 / fp32 and rounds them itself)."""
    src = make_model_dir(tmp_path / "bf16")
    out = tmp_path / "fp8"
    assert main(["convert", "hf-to-fp8", "--hf", str(src), "--out", str(out), "--no-progress",
                 "--no-fsync"]) == 0
    assert fp8.checkpoint_problem(out) is None and "a bf16 checkpoint" in fp8.checkpoint_problem(src)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == \
        fp8.QUANTIZATION_CONFIG
    assert (out / "tokenizer.json").is_file()
    with HFCheckpoint(src) as before, HFCheckpoint(out) as after:
        quantized = [n for n, i in before.tensors.items() if fp8.is_quantized(n, i.shape)]
        assert len(quantized) == 2 * (4 + 4 * 3)  # 2 layers: q, k, v, o + 4 experts x 3
        assert set(after.tensors) == set(before.tensors) | {n + fp8.SCALE_SUFFIX for n in quantized}
        for name in before.tensors:
            if name in quantized:
                q, scale = fp8.quantize(before.read(name))
                assert torch.equal(after.read(name).view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(after.read(name + fp8.SCALE_SUFFIX), scale)
            else:
                assert torch.equal(after.read(name), before.read(name)), name
    with pytest.raises(ModelFilesError, match="an FP8 checkpoint"):
        check_model_dir(out, hf_config(out))
    assert main(["convert", "hf-to-fp8", "--hf", str(out), "--out", str(tmp_path / "again"),
                 "--no-progress"]) == 2
    assert "already quantized" in capsys.readouterr().err
