"""Typed configuration: loading, overrides, and errors that name the field and the fix."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from launch.cli import main
from megatron_gspo.config import (REWARD_KINDS, Config, ConfigError, GSPOConfig, RewardConfig, config_from_dict,
                                  dump_config, load_config, padded_vocab_size, validate_data_parallel)
from megatron_gspo.loss import gspo, variants

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"


def test_shipped_configs_load():
    tiny = load_config(CONFIGS / "tiny_cpu.yaml")
    assert tiny.parallel.expert == 2 and tiny.model.head_dim * tiny.model.num_attention_heads != \
        tiny.model.hidden_size
    big = load_config(CONFIGS / "qwen3_30b_a3b.yaml")
    m = big.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim,
            m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.vocab_size, m.rope_theta) == \
        (48, 2048, 32, 4, 128, 128, 8, 768, 151936, 1e6)
    assert big.gspo.eps_low == 3e-4 and big.gspo.eps_high == 4e-4


def test_defaults_are_the_papers_clip_range():
    cfg = Config()
    assert (cfg.gspo.eps_low, cfg.gspo.eps_high) == (3e-4, 4e-4)
    assert cfg.gspo.clip_range() == (3e-4, 4e-4)
    assert config_from_dict({"gspo": {"variant": "grpo"}}).gspo.clip_range() == (0.2, 0.28)


def test_unknown_keys_are_rejected_with_their_full_path():
    with pytest.raises(ConfigError, match=r"gspo\.clip_eps_hi: unknown key"):
        config_from_dict({"gspo": {"clip_eps_hi": 0.1}})
    with pytest.raises(ConfigError, match=r"^modle: unknown key"):
        config_from_dict({"modle": {}})


def test_divisibility_errors_name_both_fields():
    with pytest.raises(ConfigError,
                       match=r"parallel\.tensor: 3 does not divide model\.num_query_groups 4"):
        config_from_dict({"model": {"num_attention_heads": 12, "num_query_groups": 4},
                          "parallel": {"tensor": 3, "sequence_parallel": True}})
    with pytest.raises(ConfigError, match=r"parallel\.expert: 3 does not divide model\.num_experts 4"):
        config_from_dict({"model": {"num_experts": 4}, "parallel": {"expert": 3}})
    with pytest.raises(ConfigError, match=r"parallel\.pipeline: 4 does not divide model\.num_layers 2"):
        config_from_dict({"parallel": {"pipeline": 4}})


def test_invalid_values_name_the_field_and_the_fix():
    cases = [
        ({"gspo": {"eps_low": 2.0}}, r"gspo\.eps_low: must be in \(0, 1\)"),
        ({"gspo": {"variant": "ppo"}}, r"gspo\.variant: 'ppo' is not one of"),
        ({"gspo": {"cispo": {"eps_low": 1.5}}}, r"gspo\.cispo\.eps_low: must be in \(0, 1\]"),
        ({"rollout": {"outage_timeout_s": 0}}, r"rollout\.outage_timeout_s: must be > 0"),
        ({"rollout": {"router": {"readmit_timeout_s": 0}}},
         r"rollout\.router\.readmit_timeout_s: must be > 0, got 0"),
        ({"rollout": {"router": {"readmit": 5}}},
         r"rollout\.router\.readmit: unknown key \(valid keys: readmit_timeout_s\)"),
        ({"gspo": {"sapo": {"tau_neg": 0}}}, r"gspo\.sapo\.tau_neg: must be in \[0\.01, 100\], got 0"),
        ({"gspo": {"gmpo": {"log_eps_high": -0.1}}},
         r"gspo\.gmpo\.log_eps_high: must be in \(0, 20\], got -0\.1"),
        ({"gspo": {"sapo_tau_pos": 2.0}}, r"gspo\.sapo_tau_pos: moved; write gspo\.sapo\.tau_pos"),
        ({"gspo": {"cispo": {"eps": 1.0}}}, r"gspo\.cispo\.eps: unknown key \(valid keys: eps_high, eps_low\)"),
        ({"model": {"hidden_size": "big"}}, r"model\.hidden_size: expected an integer"),
        ({"parallel": {"tensor": 2}}, r"parallel\.sequence_parallel: must be true"),
        ({"parallel": {"tensor": 2, "sequence_parallel": True, "expert_tensor": 1}},
         r"parallel\.expert_tensor: 1 must equal parallel\.tensor 2"),
        ({"run": {"global_batch_size": 10, "micro_batch_size": 4}},
         r"run\.global_batch_size: 10 is not a multiple of run\.micro_batch_size 4"),
        ({"rollout": {"mode": "external"}}, r"rollout\.router_url: external mode needs exactly "
                                            r"one of .* got neither"),
        ({"model": {"moe_router_topk": 9}}, r"model\.moe_router_topk: 9 exceeds model\.num_experts"),
        ({"optim": {"clip_grad": -1}}, r"optim\.clip_grad: must be >= 0"),
    ]
    for data, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            config_from_dict(data)


def test_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("gspo:\n  eps_high: 4.0e-4\n")
    cfg = load_config(path, ["gspo.eps_high=5e-4", "run.num_steps=3", "parallel.expert=2",
                             "rollout.router_url=http://h:1"])
    assert cfg.gspo.eps_high == 5e-4 and cfg.run.num_steps == 3 and cfg.parallel.expert == 2
    assert cfg.rollout.router_url == "http://h:1"
    with pytest.raises(ConfigError, match=r"gspo\.nope: unknown key"):
        load_config(path, ["gspo.nope=1"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["gspo"])


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match=f"{bad}: not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  num_layers: 0\n")
    with pytest.raises(ConfigError, match=rf"{wrong}: model\.num_layers: must be >= 1"):
        load_config(wrong)


def test_dump_round_trips(tmp_path):
    cfg = load_config(CONFIGS / "tiny_cpu.yaml", ["gspo.variant=gspo_token"])
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_padded_vocab_is_derived_not_stored():
    cfg = config_from_dict({"model": {"vocab_size": 250, "make_vocab_size_divisible_by": 8}})
    assert padded_vocab_size(cfg.model, 1) == 256 and padded_vocab_size(cfg.model, 4) == 256
    assert padded_vocab_size(cfg.model, 3) == 264
    assert cfg.model.vocab_size == 250


def test_data_files_and_reward_sections():
    cfg = config_from_dict({
        "data": {"task": None, "train_path": "data/train.parquet", "eval_path": "data/eval.jsonl",
                 "prompt_key": "question.text", "label_key": "meta.answer",
                 "tokenizer_dir": "tok/", "num_eval_prompts": None, "shuffle": False},
        "reward": {"kind": "math", "on_error": "zero"}})
    assert cfg.data.train_path == "data/train.parquet" and cfg.data.num_eval_prompts is None
    assert (cfg.reward.kind, cfg.reward.on_error) == ("math", "zero")
    default = Config()
    assert default.data.task == "addition" and default.reward.kind is None
    cfg = config_from_dict({"reward": {"kind": "http", "url": "http://127.0.0.1:8000/score"}})
    assert cfg.reward.url.endswith("/score")


def test_data_and_reward_errors_name_the_field():
    cases = [
        ({"data": {"train_path": "t.jsonl"}},
         r"data\.task: exactly one of data\.task and data\.train_path .* write task: null"),
        ({"data": {"task": None}}, r"data\.task: exactly one of"),
        ({"data": {"eval_path": "e.jsonl"}}, r"data\.eval_path: only used with data\.train_path"),
        ({"data": {"tokenizer_dir": "tok"}}, r"data\.tokenizer_dir: only used with"),
        ({"data": {"num_eval_prompts": None}}, r"data\.num_eval_prompts: must be set"),
        ({"data": {"format": "csv"}}, r"data\.format: 'csv' is not one of"),
        ({"data": {"task": None, "train_path": "t.jsonl"}}, r"reward\.kind: required with data\.train_path"),
        ({"data": {"task": None, "train_path": "t.jsonl", "label_key": None},
          "reward": {"kind": "exact_match"}}, r"data\.label_key: reward\.kind 'exact_match'"),
        ({"data": {"task": None, "train_path": "t.jsonl", "tokenizer_dir": "tok"},
          "reward": {"kind": "addition"}}, r"reward\.kind: 'addition' reads byte-level"),
        ({"reward": {"kind": "function"}}, r"reward\.function: required"),
        ({"reward": {"kind": "function", "function": "mod.fn"}}, r"reward\.function: expected"),
        ({"reward": {"kind": "http"}}, r"reward\.url: required"),
        ({"reward": {"kind": "http", "url": "localhost:80"}}, r"reward\.url: expected an http"),
        ({"reward": {"on_error": "skip"}}, r"reward\.on_error: 'skip' is not one of"),
        ({"reward": {"kind": "bleu"}}, r"reward\.kind: 'bleu'"),
        ({"reward": {"timeout_s": 0}}, r"reward\.timeout_s: must be > 0"),
        ({"reward": {"urls": "x"}}, r"reward\.urls: unknown key"),
    ]
    for data, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            config_from_dict(data)


def test_cross_field_checks_run_when_the_file_is_loaded():
    """Checks that used to run only in `train` (launch/rl_session.validate_rl) reject the file in
    load_config itself, so `config`, `launch slurm`, `sft` and `train` agree."""
    cases = [
        ({"run": {"global_batch_size": 12, "micro_batch_size": 4}, "gspo": {"group_size": 8}},
         r"run\.global_batch_size: 12 is not a multiple of gspo\.group_size 8"),
        ({"run": {"global_batch_size": 16, "micro_batch_size": 4},
          "gspo": {"group_size": 4, "updates_per_rollout": 3}},
         r"run\.global_batch_size: 16 does not split into gspo\.updates_per_rollout = 3"),
        ({"run": {"global_batch_size": 16, "micro_batch_size": 4},
          "gspo": {"group_size": 4, "updates_per_rollout": 8}},
         r"run\.global_batch_size: a mini-batch of 16 / gspo\.updates_per_rollout 8 = 2 "
         r"sequences is not a multiple of run\.micro_batch_size 4"),
        ({"optim": {"warmup_steps": 20}, "run": {"num_steps": 20}},
         r"optim\.warmup_steps: 20 must be < run\.num_steps 20"),
        ({"optim": {"min_lr": 1e-7}}, r"optim\.min_lr: 1e-07 is only used by a decaying schedule"),
    ]
    for data, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            config_from_dict(data)
    # the fixes the messages name are accepted
    ok = config_from_dict({"optim": {"min_lr": 1e-7, "lr_decay_style": "cosine", "warmup_steps": 19}})
    assert (ok.optim.min_lr, ok.optim.warmup_steps) == (1e-7, 19)


def test_world_dependent_check_names_the_fields():
    cfg = config_from_dict({"run": {"global_batch_size": 32, "micro_batch_size": 4},
                            "gspo": {"group_size": 8, "updates_per_rollout": 2}})
    validate_data_parallel(cfg, 4)  # 16 rows per mini-batch = 4 ranks x 4
    with pytest.raises(ConfigError, match=r"run\.global_batch_size: a mini-batch of 32 / "
                                          r"gspo\.updates_per_rollout 2 = 16 sequences does not "
                                          r"split into data-parallel size 8 x run\.micro_batch_size 4"):
        validate_data_parallel(cfg, 8)


def test_one_variant_registry_and_one_meaning_of_token_clip():
    # the config's field type IS the registry's Literal, and the table lists the same names
    hints = typing.get_type_hints(GSPOConfig)
    assert typing.get_args(hints["variant"]) == variants.VARIANTS == tuple(variants.SPECS)
    assert gspo.VARIANTS is variants.VARIANTS and gspo.TOKEN_CLIP_VARIANTS is variants.TOKEN_CLIP_VARIANTS
    reward_kind = typing.get_type_hints(RewardConfig)["kind"]
    assert tuple(a for a in typing.get_args(reward_kind) if a is not type(None)) == (
        typing.Literal[REWARD_KINDS],)
    # "token-clip" = the cut unit is the token; the clip RANGE follows the clipped ratio
    assert set(variants.TOKEN_CLIP_VARIANTS) == {"gspo_token", "grpo", "seq_ratio_token_clip",
                                                 "cispo", "sapo"}
    assert set(variants.SEQUENCE_CLIP_VARIANTS) | set(variants.TOKEN_CLIP_VARIANTS) == set(variants.VARIANTS)
    assert set(variants.TOKEN_RATIO_CLIP_VARIANTS) == {"grpo", "seq_ratio_token_clip"}
    assert set(variants.TOKEN_NORMALIZED_VARIANTS) == {"cispo", "luspo"}
    token_range, sequence_range = (0.2, 0.28), (3e-4, 4e-4)
    own = {"cispo": (1.0, 4.0), "gmpo": (0.4, 0.4)}  # the papers' defaults (gmpo: log space)
    for variant in variants.VARIANTS:
        got = config_from_dict({"gspo": {"variant": variant}}).gspo.clip_range()
        assert got == own.get(variant, token_range if variant in ("grpo", "seq_ratio_token_clip")
                              else sequence_range), variant
    gspo_cfg = config_from_dict({"gspo": {"variant": "gmpo", "gmpo": {"log_eps_low": 0.3},
                                          "cispo": {"eps_high": 2.0}}}).gspo
    assert gspo_cfg.clip_range() == (0.3, 0.4) and gspo_cfg.cispo.eps_high == 2.0
    assert (gspo_cfg.sapo.tau_pos, gspo_cfg.sapo.tau_neg) == (1.0, 1.05)
    assert gspo_cfg.variant_params() is None
    # the variant's params section is what the loss gets; the flat keys of before are refused
    sapo = config_from_dict({"gspo": {"variant": "sapo"}}, ["gspo.sapo.tau_neg=1.5"]).gspo
    assert sapo.variant_params() == variants.SapoParams(tau_pos=1.0, tau_neg=1.5)
    for old, new in GSPOConfig.MOVED_KEYS.items():
        with pytest.raises(ConfigError, match=rf"gspo\.{old}: moved; write gspo\.{new}"):
            config_from_dict({"gspo": {old: 1.0}})
    assert all(spec.meaning for spec in variants.SPECS.values())


def test_config_command_rejects_what_train_rejects(capsys):
    code = main(["config", "--config", "launch/configs/tiny_cpu.yaml",
                 "--set", "gspo.updates_per_rollout=3"])
    assert code == 2
    assert "run.global_batch_size: 256 does not split into gspo.updates_per_rollout = 3" in \
        capsys.readouterr().err
    code = main(["config", "--config", "launch/configs/tiny_cpu.yaml", "--world-size", "16"])
    assert code == 2
    assert ("a mini-batch of 256 / gspo.updates_per_rollout 2 = 128 sequences does not split into "
            "data-parallel size 16 x run.micro_batch_size 16") in capsys.readouterr().err
