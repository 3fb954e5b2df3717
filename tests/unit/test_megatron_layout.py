"""The Megatron-LM / Megatron-Bridge checkpoint layout (megatron_gspo/hf/megatron_layout.py): what
``convert hf-to-mcore`` writes, and the readers' resolution of a root, an iteration directory and the
earlier flat layout (Megatron-LM's own readers check the written layout in the bridge tier)."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from bench.hf_tiny import build_hf_model, load_safetensors_dir, save_hf_model
from megatron_gspo.hf import megatron_layout
from megatron_gspo.hf.convert import hf_to_mcore, mcore_to_hf
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mcore_checkpoint import McoreCheckpoint, extra_state_keys
from megatron_gspo.hf.safetensors_io import CheckpointError
from megatron_gspo.train.initial_weights import is_mcore_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    hf_dir = save_hf_model(build_hf_model("gqa4_tied", seed=2), root / "hf")
    hf_to_mcore(hf_dir, root / "mcore", progress=False, sync_files=False)
    return root, hf_dir


def test_hf_to_mcore_writes_the_megatron_lm_and_bridge_layout(converted):
    root, hf_dir = converted
    out = root / "mcore"
    # Megatron-LM's get_checkpoint_tracker_filename / read_metadata / get_checkpoint_name
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"
    ckpt = out / "iter_0000000"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert (ckpt / "metadata.json").is_file() and (ckpt / ".metadata").is_file()
    # the common state Megatron-LM reads (checkpoint_version >= 2.0: no QKV reordering; iteration)
    assert torch.load(ckpt / "common.pt", weights_only=True) == {
        "checkpoint_version": 3.0, "iteration": 0, "content_metadata": {"singleton_local_shards": False}}
    # Bridge's run_config.yaml: the provider load_model_config instantiates, no optimizer / RNG
    config = yaml.safe_load((ckpt / "run_config.yaml").read_text())
    model = model_config_from_hf(str(hf_dir))
    provider = config["model"]
    assert provider["_target_"] == "megatron.bridge.models.gpt_provider.GPTModelProvider"
    assert (provider["num_layers"], provider["num_moe_experts"], provider["kv_channels"],
            provider["num_query_groups"], provider["vocab_size"]) == (
        model.num_layers, model.num_experts, model.head_dim, model.num_query_groups, model.vocab_size)
    assert provider["share_embeddings_and_output_weights"] is True  # gqa4_tied
    assert provider["moe_router_pre_softmax"] is True  # norm_topk_prob false
    assert provider["rotary_base"] == 1e6
    assert config["checkpoint"]["save_optim"] is False and config["checkpoint"]["save_rng"] is False
    assert megatron_layout.find_hf_config(ckpt) == ckpt / "hf_config"
    # every _extra_state object either spec asks for, the TE spec's norms among them
    stored = set(McoreCheckpoint(out).metadata.state_dict_metadata)
    assert set(extra_state_keys(model)) <= stored
    assert "decoder.final_layernorm._extra_state/shard_0_1" in stored
    assert "decoder.layers.pre_mlp_layernorm._extra_state/shard_1_2" in stored


def test_every_layout_resolves_to_the_torch_dist_directory(converted, tmp_path):
    root, hf_dir = converted
    out = root / "mcore"
    ckpt = out / "iter_0000000"
    assert megatron_layout.resolve(out) == ckpt  # the root: its tracker names the iteration
    assert megatron_layout.resolve(ckpt) == ckpt  # an iteration directory
    flat = shutil.copytree(ckpt, tmp_path / "flat")  # the project's earlier flat layout
    assert megatron_layout.resolve(flat) == flat
    assert all(is_mcore_checkpoint(p) for p in (out, ckpt, flat)) and not is_mcore_checkpoint(hf_dir)
    # a 'release' tracker (Megatron-LM) names release/
    release = tmp_path / "release_root"
    shutil.copytree(ckpt, release / "release")
    (release / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert megatron_layout.resolve(release) == release / "release"
    # the way back from each: the same tensors
    original = load_safetensors_dir(hf_dir)
    for i, source in enumerate((out, flat, release)):
        exported = load_safetensors_dir(mcore_to_hf(source, tmp_path / f"hf{i}", progress=False,
                                                    sync_files=False).out_dir)
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[n], t) for n, t in original.items())


def test_a_root_that_names_nothing_loadable_is_a_clear_error(converted, tmp_path):
    root, _ = converted
    bad = tmp_path / "bad"
    shutil.copytree(root / "mcore" / "iter_0000000", bad / "iter_0000007")
    with pytest.raises(CheckpointError, match="no latest_checkpointed_iteration.txt to say which "
                                              "checkpoint is current; name one of iter_0000007"):
        megatron_layout.resolve(bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("seven")
    with pytest.raises(CheckpointError, match="'seven' is neither an iteration number nor 'release'"):
        megatron_layout.resolve(bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointError, match="names iter_0000003, which is not a Megatron distributed"):
        megatron_layout.resolve(bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("7")
    assert megatron_layout.resolve(bad) == bad / "iter_0000007"
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        megatron_layout.resolve(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a Megatron distributed checkpoint"):
        megatron_layout.resolve(tmp_path / "empty")


def test_the_hf_config_is_taken_from_where_the_checkpoint_records_it(converted, tmp_path):
    root, hf_dir = converted
    # Bridge records the HF model's directory as run_config.yaml's model.hf_model_id
    bridge_like = shutil.copytree(root / "mcore" / "iter_0000000", tmp_path / "iter_0000000")
    shutil.rmtree(bridge_like / "hf_config")
    (bridge_like / "run_config.yaml").write_text(yaml.safe_dump(
        {"model": {"_target_": "x", "hf_model_id": str(hf_dir)}}))
    assert megatron_layout.find_hf_config(bridge_like) == hf_dir
    # a hub id (not a local directory) records nothing usable here: mcore-to-hf asks for --hf-config
    (bridge_like / "run_config.yaml").write_text(yaml.safe_dump(
        {"model": {"hf_model_id": "Qwen/Qwen3-30B-A3B"}}))
    assert megatron_layout.find_hf_config(bridge_like) is None
    with pytest.raises(CheckpointError, match="pass --hf-config"):
        mcore_to_hf(bridge_like, tmp_path / "x", progress=False)
