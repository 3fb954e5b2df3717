"""ModelConfig from a Hugging Face Qwen3MoeConfig (object, dict, or a directory's config.json)."""

from __future__ import annotations

import json

from megatron_gspo.hf.hf_config import model_config_from_hf


def test_from_transformers_config_object_and_files(tmp_path):
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeConfig(vocab_size=300, hidden_size=48, moe_intermediate_size=24,
                        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                        head_dim=20, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                        tie_word_embeddings=True, rope_theta=5e5)
    expected = dict(num_layers=3, hidden_size=48, num_attention_heads=6, num_query_groups=2,
                    head_dim=20, num_experts=6, moe_router_topk=3, moe_ffn_hidden_size=24,
                    norm_topk_prob=True, vocab_size=300, rope_theta=5e5, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path)  # transformers 5 writes rope_parameters and num_local_experts
    for source in (hf, str(tmp_path), json.loads((tmp_path / "config.json").read_text())):
        cfg = model_config_from_hf(source)
        assert {k: getattr(cfg, k) for k in expected} == expected


def test_transformers4_style_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "vocab_size": 151936,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "tie_word_embeddings": False}))
    cfg = model_config_from_hf(str(tmp_path))
    assert (cfg.num_experts, cfg.head_dim, cfg.rope_theta, cfg.vocab_size) == (128, 128, 1e6, 151936)
