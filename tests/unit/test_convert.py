"""HF <-> Megatron conversion in one process: round trips, the checkpoint's keys, clear errors.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_convert.py``

Loading into the Megatron policy under parallel layouts (and the comparison with transformers'
log-probs) is in ``tests/distributed/test_convert.py``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from launch import convert as cli
from megatron_gspo.config import ConfigError, ModelConfig
from megatron_gspo.hf.convert import hf_to_mcore, mcore_to_hf
from megatron_gspo.hf.hf_config import HFConfigError, check_model_config
from megatron_gspo.hf.mcore_checkpoint import McoreCheckpoint, extra_state_keys
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.safetensors_io import CheckpointError
from bench.hf_tiny import build_hf_model, load_safetensors_dir, random_batch, save_hf_model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """case -> (transformers model, saved directory): an fp32 untied model in one file and a bf16
    tied one in several shards."""
    root = tmp_path_factory.mktemp("hf")
    fp32 = build_hf_model("gqa2_untied")
    bf16 = build_hf_model("gqa4_tied", seed=3, dtype=torch.bfloat16)
    return {"fp32_untied": (fp32, save_hf_model(fp32, root / "fp32_untied")),
            "bf16_tied_sharded": (bf16, save_hf_model(bf16, root / "bf16_tied", max_shard_size="60KB"))}


@pytest.mark.parametrize("case", ["fp32_untied", "bf16_tied_sharded"])
def test_round_trip_is_bit_identical_and_loads_in_transformers(case, hf_models, tmp_path):
    from transformers import AutoModelForCausalLM

    _, hf_dir = hf_models[case]
    # tiny vocabulary blocks and shards exercise the row-block streaming and the shard splitting
    hf_to_mcore(hf_dir, tmp_path / "mcore", tensor=2, expert=2, progress=False,
                vocab_block_bytes=1000)
    out = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_size="100KB", progress=False,
                      vocab_block_bytes=3000)
    original, exported = load_safetensors_dir(hf_dir), load_safetensors_dir(out.out_dir)
    assert sorted(original) == sorted(exported)
    assert all(exported[n].dtype == t.dtype and torch.equal(exported[n], t) for n, t in original.items())
    assert len(list(out.out_dir.glob("model-*.safetensors"))) > 1
    config = json.loads((out.out_dir / "config.json").read_text())
    assert config["dtype"] == str(original["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    # (compared with the original directory loaded the same way: Module.to(bfloat16) would also
    # have rounded the non-persistent RoPE buffer of the in-memory model)
    reloaded = AutoModelForCausalLM.from_pretrained(out.out_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    batch = random_batch(config["vocab_size"])
    with torch.no_grad():
        assert torch.equal(reloaded(batch["tokens"]).logits, reference(batch["tokens"]).logits)


def test_dtype_cast(hf_models, tmp_path):
    _, hf_dir = hf_models["fp32_untied"]
    hf_to_mcore(hf_dir, tmp_path / "mcore", dtype="bfloat16", progress=False)
    assert McoreCheckpoint(tmp_path / "mcore").dtype("decoder.layers.mlp.router.weight") == torch.bfloat16
    out = mcore_to_hf(tmp_path / "mcore", tmp_path / "hf", dtype="float32", progress=False)
    original, exported = load_safetensors_dir(hf_dir), load_safetensors_dir(out.out_dir)
    assert all(torch.equal(exported[n], t.to(torch.bfloat16).float()) for n, t in original.items())


def test_checkpoint_layout(hf_models, tmp_path):
    """Global keys and shapes as Megatron's local spec and TE spec name them (the distributed
    tests load this under several layouts); zero vocabulary padding for TP 2."""
    model, hf_dir = hf_models["fp32_untied"]
    hf_to_mcore(hf_dir, tmp_path / "mcore", tensor=2, progress=False)
    ckpt = McoreCheckpoint(tmp_path / "mcore")
    cfg = model_config_from_hf(str(hf_dir))
    L, E, H, I, d = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.head_dim
    padded = 272  # 259 rounded up to a multiple of 8 x TP 2
    expected = {
        "embedding.word_embeddings.weight": (padded, H),
        "output_layer.weight": (padded, H),
        "decoder.final_layernorm.weight": (H,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, H),
        "decoder.layers.self_attention.linear_qkv.weight": (L, (4 + 2 * 2) * d, H),
        "decoder.layers.self_attention.linear_proj.weight": (L, H, 4 * d),
        "decoder.layers.self_attention.q_layernorm.weight": (L, d),
        "decoder.layers.self_attention.k_layernorm.weight": (L, d),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, H),
        "decoder.layers.pre_mlp_layernorm.weight": (L, H),  # the TE spec's key for the same tensor
        "decoder.layers.mlp.router.weight": (L, E, H),
        "decoder.layers.mlp.experts.experts.linear_fc1.weight": (L, E, 2 * I, H),
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (L, E, H, I),
    }
    assert {k: ckpt.shape(k) for k in ckpt.tensors} == expected
    assert set(extra_state_keys(cfg)) <= set(ckpt.metadata.state_dict_metadata)
    sd = model.state_dict()
    (embed,) = ckpt.read([("embedding.word_embeddings.weight", (0, 0), (padded, H))])
    assert torch.equal(embed[:259], sd["model.embed_tokens.weight"]) and not embed[259:].any()
    (fc1,) = ckpt.read([("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 3, 0, 0),
                         (1, 1, 2 * I, H))])
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"][3]  # transformers' in-memory [gate; up]
    assert torch.equal(fc1[0, 0], gate_up)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_config_not_matching_weights_lists_every_mismatch(hf_models, tmp_path):
    hf_dir = _copy(hf_models["fp32_untied"][1], tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(head_dim=16, num_local_experts=8, num_hidden_layers=3,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError) as err:
        hf_to_mcore(hf_dir, tmp_path / "out", progress=False)
    message = str(err.value)
    for needle in ("config.json", "rope settings: rope_type 'yarn'", "head_dim: config.json says 16, the weights have 24",
                   "num_experts: config.json says 8, the weights have 4",
                   "num_hidden_layers: config.json says 3, the weights have 2",
                   "missing tensors", "shape mismatches"):
        assert needle in message, f"{needle!r} not in:\n{message}"
    assert not (tmp_path / "out").exists()


def test_missing_shard_and_truncated_file_are_named(hf_models, tmp_path, capsys):
    hf_dir = _copy(hf_models["bf16_tied_sharded"][1], tmp_path / "hf")
    shards = sorted(hf_dir.glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) // 2])
    assert cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert f"{shards[1]}: truncated safetensors file" in capsys.readouterr().err
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"missing from .*{shards[1].name}"):
        hf_to_mcore(hf_dir, tmp_path / "o", progress=False)


def test_parallel_sizes_must_divide_heads_and_experts(hf_models, tmp_path):
    _, hf_dir = hf_models["fp32_untied"]
    with pytest.raises(ConfigError) as err:
        hf_to_mcore(hf_dir, tmp_path / "o", tensor=4, expert=3, progress=False)
    message = str(err.value)
    assert "parallel.tensor: 4 does not divide model.num_query_groups 2" in message
    assert "parallel.expert: 3 does not divide model.num_experts 4" in message
    assert "--tp" in message and "--ep" in message


def test_mcore_to_hf_errors(hf_models, tmp_path):
    _, hf_dir = hf_models["fp32_untied"]
    mcore = tmp_path / "mcore"
    hf_to_mcore(hf_dir, mcore, progress=False)
    # a config that does not describe the checkpoint: every mismatching tensor is listed
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(num_local_experts=8, moe_intermediate_size=48)
    (tmp_path / "other.json").write_text(json.dumps(config))
    with pytest.raises(HFConfigError) as err:
        mcore_to_hf(mcore, tmp_path / "x", hf_config=tmp_path / "other.json", progress=False)
    assert "router.weight: [2, 4, 64] in the checkpoint, config implies [2, 8, 64]" in str(err.value)
    assert "linear_fc2.weight: [2, 4, 64, 32] in the checkpoint, config implies [2, 8, 64, 48]" in str(err.value)
    # no config anywhere (neither hf_config/ nor a run_config.yaml naming a local one)
    bare = _copy(mcore, tmp_path / "bare")
    shutil.rmtree(bare / "iter_0000000" / "hf_config")
    (bare / "iter_0000000" / "run_config.yaml").unlink()
    with pytest.raises(CheckpointError, match="--hf-config"):
        mcore_to_hf(bare, tmp_path / "x", progress=False)
    # damaged checkpoints
    data_file = next((mcore / "iter_0000000").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=f"{data_file.name}: truncated"):
        mcore_to_hf(mcore, tmp_path / "x", progress=False)
    (mcore / "iter_0000000" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="no metadata.json"):
        mcore_to_hf(mcore, tmp_path / "x", progress=False)


def test_run_config_checked_against_config_json(hf_models):
    _, hf_dir = hf_models["fp32_untied"]
    reference = model_config_from_hf(str(hf_dir))
    check_model_config(reference, hf_dir)  # the same model: no error
    fields = {f: getattr(reference, f) for f in ModelConfig.__slots__}
    fields.update(head_dim=32, num_experts=8, rope_theta=1e6)
    with pytest.raises(HFConfigError) as err:
        check_model_config(ModelConfig(**fields), hf_dir)
    for needle in ("model.head_dim: 32 in the run config, head_dim = 24",
                   "model.num_experts: 8 in the run config, num_experts = 4",
                   "model.rope_theta: 1000000.0 in the run config, rope_theta = 10000.0"):
        assert needle in str(err.value)


def test_output_directory_is_protected(hf_models, tmp_path):
    _, hf_dir = hf_models["fp32_untied"]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        hf_to_mcore(hf_dir, tmp_path / "busy", progress=False)
    with pytest.raises(CheckpointError, match="refusing to delete"):
        hf_to_mcore(hf_dir, tmp_path / "busy", overwrite=True, progress=False)
    assert (tmp_path / "busy" / "notes.txt").exists()


def test_cli_round_trip(hf_models, tmp_path, capsys):
    _, hf_dir = hf_models["bf16_tied_sharded"]
    assert cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "m"), "--tp", "2",
                     "--ep", "2", "--no-progress", "--no-fsync"]) == 0
    assert cli.main(["mcore-to-hf", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h"),
                     "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    original, exported = load_safetensors_dir(hf_dir), load_safetensors_dir(tmp_path / "h")
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    assert (tmp_path / "h" / "generation_config.json").is_file()



def test_writer_threads_default_to_one_per_five_gib():
    from megatron_gspo.hf.convert import auto_writer_threads

    gib = 2**30
    assert auto_writer_threads(10 << 20, cpu_count=16) == 1   # a tiny model: one file
    assert auto_writer_threads(11 * gib, cpu_count=16) == 3
    assert auto_writer_threads(61 * gib, cpu_count=16) == 8   # 30B in bf16: at most 8 ...
    assert auto_writer_threads(61 * gib, cpu_count=2) == 2    # ... and at most the CPUs
    assert auto_writer_threads(470 * gib, cpu_count=64) == 8  # 235B: not one 470 GB file


def test_writer_threads_write_that_many_files_and_the_cli_takes_auto(hf_models, tmp_path,
                                                                    monkeypatch, capsys):
    from megatron_gspo.hf import convert

    _, hf_dir = hf_models["fp32_untied"]
    monkeypatch.setattr(convert, "BYTES_PER_WRITER", 20_000)  # the tiny model then wants several
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    assert cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "auto"),
                     "--no-progress", "--no-fsync"]) == 0  # the default is auto
    assert len(list((tmp_path / "auto" / "iter_0000000").glob("*.distcp"))) == 3  # min(8, CPUs, size / 20 kB)
    assert cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "two"),
                     "--threads", "2", "--no-progress", "--no-fsync"]) == 0
    assert len(list((tmp_path / "two" / "iter_0000000").glob("*.distcp"))) == 2
    original = load_safetensors_dir(hf_dir)
    for directory in ("auto", "two"):  # either converts back to the same tensors
        mcore_to_hf(tmp_path / directory, tmp_path / f"hf_{directory}", progress=False)
        exported = load_safetensors_dir(tmp_path / f"hf_{directory}")
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[n], t) for n, t in original.items())
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["hf-to-mcore", "--hf", str(hf_dir), "--out", str(tmp_path / "bad"),
                  "--threads", "0"])
    assert "--threads: 'auto' or an integer >= 1, got '0'" in capsys.readouterr().err
