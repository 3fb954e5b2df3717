"""Check a Hugging Face Qwen3-MoE ``config.json`` against its weights and against the run's model.

Three checks, each collecting EVERY problem before raising one :class:`HFConfigError`:

* :func:`unsupported_features` - config.json settings this project's Megatron model does not
  implement (RoPE scaling, sliding window, dense MLP layers, attention bias, ...);
* :func:`check_weights` - the shapes the config implies against the tensors on disk, plus the
  values the weights imply (head_dim from ``q_norm``, the number of experts from the expert
  indices, ...) so the error says which config field is wrong, not only which tensor;
* :func:`check_model_config` - the run's :class:`~megatron_gspo.config.ModelConfig` (YAML) against
  config.json, field by field (the trainer calls this before loading a converted checkpoint).

``model_config_from_checkpoint(hf_dir)`` runs the first two and returns the ModelConfig.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from megatron_gspo.config import ConfigError, ModelConfig
from megatron_gspo.hf.mapping import hf_param_shapes

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
             "moe_intermediate_size", "vocab_size")


class HFConfigError(ConfigError):
    """config.json does not describe the weights or the run's model; lists every mismatch."""


def load_hf_config(path: str | Path) -> dict:
    """config.json as a dict (``path`` is the file or its directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise HFConfigError(f"{path}: not found")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise HFConfigError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return config


def rope_settings(config: Mapping[str, Any]) -> tuple[float, str, Any]:
    """(rope_theta, rope_type, scaling) from either config.json generation.

    transformers 5 writes ``rope_parameters: {"rope_theta": ..., "rope_type": "default"}``;
    transformers 4 and the published Qwen3 checkpoints write top-level ``rope_theta`` and an optional
    ``rope_scaling``. The default theta is transformers' (10000).
    """
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or (scaling or {}).get("rope_type") or (
        (scaling or {}).get("type")) or "default"
    return float(theta), rope_type, scaling


def unsupported_features(config: Mapping[str, Any]) -> list[str]:
    """Every config.json setting the Megatron Qwen3-MoE policy cannot reproduce (empty if none)."""
    problems = []
    missing = [k for k in _REQUIRED if config.get(k) is None]
    if config.get("num_experts") is None and config.get("num_local_experts") is None:
        missing.append("num_experts (or num_local_experts)")
    if missing:
        problems.append(f"missing required field(s): {', '.join(missing)}")
    model_type = config.get("model_type")
    if model_type is not None and model_type != "qwen3_moe":
        problems.append(f"model_type: {model_type!r}, expected 'qwen3_moe'")
    _, rope_type, scaling = rope_settings(config)
    if rope_type != "default":
        problems.append(f"rope settings: rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    elif scaling:
        problems.append(f"rope settings: rope_scaling {scaling!r} is not supported")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step: {config['decoder_sparse_step']}, only 1 (every layer "
                        "MoE) is supported")
    if config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers: {config['mlp_only_layers']}, dense layers are not supported")
    if config.get("use_sliding_window"):
        problems.append("use_sliding_window: true is not supported")
    if config.get("attention_bias"):
        problems.append("attention_bias: true is not supported (Qwen3 has no QKV bias)")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act: {config['hidden_act']!r}, only 'silu' (SwiGLU) is supported")
    return problems


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.0\.mlp\.experts\.(\d+)\.")


def _implied_by_weights(model: ModelConfig, shapes: Mapping[str, tuple]) -> list[str]:
    """Config fields that disagree with what the tensors on disk imply."""
    problems = []

    def field(name: str, config_value, weight_value, evidence: str) -> None:
        if weight_value is not None and weight_value != config_value:
            problems.append(f"{name}: config.json says {config_value}, the weights have "
                            f"{weight_value} ({evidence})")

    layers = {int(m.group(1)) for n in shapes if (m := _LAYER.match(n))}
    if layers:
        field("num_hidden_layers", model.num_layers, max(layers) + 1, "largest layer index + 1")
    experts = {int(m.group(1)) for n in shapes if (m := _EXPERT.match(n))}
    if experts:
        field("num_experts", model.num_experts, max(experts) + 1, "experts of layer 0")
    embed = shapes.get("model.embed_tokens.weight")
    if embed is not None and len(embed) == 2:
        field("vocab_size", model.vocab_size, embed[0], "model.embed_tokens.weight rows")
        field("hidden_size", model.hidden_size, embed[1], "model.embed_tokens.weight columns")
    q_norm = shapes.get("model.layers.0.self_attn.q_norm.weight")
    if q_norm is not None and len(q_norm) == 1:
        field("head_dim", model.head_dim, q_norm[0], "model.layers.0.self_attn.q_norm.weight")
        head_dim = q_norm[0]
        q = shapes.get("model.layers.0.self_attn.q_proj.weight")
        k = shapes.get("model.layers.0.self_attn.k_proj.weight")
        if q is not None and q[0] % head_dim == 0:
            field("num_attention_heads", model.num_attention_heads, q[0] // head_dim,
                  "q_proj rows / head_dim")
        if k is not None and k[0] % head_dim == 0:
            field("num_key_value_heads", model.num_query_groups, k[0] // head_dim,
                  "k_proj rows / head_dim")
    gate = shapes.get("model.layers.0.mlp.experts.0.gate_proj.weight")
    if gate is not None:
        field("moe_intermediate_size", model.moe_ffn_hidden_size, gate[0], "experts.0.gate_proj rows")
    router = shapes.get("model.layers.0.mlp.gate.weight")
    if router is not None and not experts:
        field("num_experts", model.num_experts, router[0], "model.layers.0.mlp.gate.weight rows")
    return problems


def weight_problems(model: ModelConfig, shapes: Mapping[str, tuple]) -> list[str]:
    """Every disagreement between ``model`` (from config.json) and the tensors on disk."""
    expected = hf_param_shapes(model)
    problems = _implied_by_weights(model, shapes)
    missing = [n for n in expected if n not in shapes]
    wrong = [f"{n}: {list(shapes[n])} on disk, config implies {list(s)}"
             for n, s in expected.items() if n in shapes and tuple(shapes[n]) != tuple(s)]
    # transformers ties lm_head to embed_tokens and ignores a stored lm_head when tied.
    ignorable = {"lm_head.weight"} if model.tie_word_embeddings else set()
    unexpected = [n for n in shapes if n not in expected and n not in ignorable]
    for label, names in (("missing tensors", missing), ("shape mismatches", wrong),
                         ("unexpected tensors", unexpected)):
        if names:
            shown = "; ".join(names[:8]) + (f"; ... ({len(names) - 8} more)" if len(names) > 8 else "")
            problems.append(f"{label} ({len(names)}): {shown}")
    return problems


def check_weights(model: ModelConfig, shapes: Mapping[str, tuple], source: str) -> None:
    """Raise one HFConfigError listing every disagreement between ``model`` and the tensors."""
    problems = weight_problems(model, shapes)
    if problems:
        raise HFConfigError(f"{source}: config.json does not match the weights:\n  - "
                            + "\n  - ".join(problems))


def model_config_from_checkpoint(hf_dir: str | Path, shapes: Mapping[str, tuple]) -> ModelConfig:
    """Validate config.json (supported features, agreement with the weights) and return the
    ModelConfig; one HFConfigError lists every problem found."""
    config_file = Path(hf_dir) / "config.json"
    config = load_hf_config(config_file)
    problems = unsupported_features(config)
    model = None
    if not any(p.startswith("missing required") for p in problems):
        try:
            model = model_config_from_hf(config)
        except ConfigError as err:
            problems.append(str(err))
    if model is not None:
        problems += weight_problems(model, shapes)
    if problems:
        raise HFConfigError(f"{config_file}: does not describe a supported Qwen3-MoE model with "
                            "these weights:\n  - " + "\n  - ".join(problems))
    return model


_COMPARED = {
    # ModelConfig field -> how config.json names it (for the message)
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "head_dim": "head_dim",
    "num_experts": "num_experts",
    "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "vocab_size": "vocab_size",
    "rope_theta": "rope_theta",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}


def check_model_config(model: ModelConfig, hf_config: Mapping[str, Any] | str | Path,
                       source: str = "config.json") -> None:
    """The run's ModelConfig must describe the same network as config.json; one error lists all
    differing fields (``model.<field>`` = run value vs config.json value) and unsupported settings."""
    if not isinstance(hf_config, Mapping):
        source = str(hf_config)
        hf_config = load_hf_config(hf_config)
    problems = unsupported_features(hf_config)
    if not problems:
        reference = model_config_from_hf(dict(hf_config))
        for ours, theirs in _COMPARED.items():
            a, b = getattr(model, ours), getattr(reference, ours)
            if a != b:
                problems.append(f"model.{ours}: {a} in the run config, {theirs} = {b} in config.json")
    if problems:
        raise HFConfigError(f"the model definition does not match {source}:\n  - "
                            + "\n  - ".join(problems))


def model_config_from_hf(hf_config, **overrides) -> ModelConfig:
    """ModelConfig from a Hugging Face ``Qwen3MoeConfig`` (object, dict or config.json path)."""
    if isinstance(hf_config, str):
        path = Path(hf_config)
        if path.is_dir():
            path = path / "config.json"
        hf_config = json.loads(path.read_text())
    get = (hf_config.get if isinstance(hf_config, dict)
           else lambda key, default=None: getattr(hf_config, key, default))
    rope_theta = get("rope_theta", None)
    if rope_theta is None:  # transformers 5 writes rope_parameters
        rope_theta = (get("rope_parameters", None) or {}).get("rope_theta", 10000.0)
    num_heads = get("num_attention_heads")
    values = dict(
        num_layers=get("num_hidden_layers"),
        hidden_size=get("hidden_size"),
        num_attention_heads=num_heads,
        num_query_groups=get("num_key_value_heads", num_heads),
        head_dim=get("head_dim", None) or get("hidden_size") // num_heads,
        num_experts=get("num_experts", None) or get("num_local_experts"),
        moe_router_topk=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("moe_intermediate_size"),
        # transformers' Qwen3MoeConfig defaults norm_topk_prob to False (the published Qwen3-MoE
        # configs set it to true explicitly); an absent key must mean what it means to transformers.
        norm_topk_prob=bool(get("norm_topk_prob", False)),
        vocab_size=get("vocab_size"),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
    )
    values.update(overrides)
    return ModelConfig(**values)
