"""The Transformer Engine layer spec's ``_extra_state`` objects that a converted checkpoint must
hold for Megatron-LM and Megatron-Bridge, whose loaders use ``dist_ckpt_strictness=
"assume_ok_unexpected"``: a sharded object the model asks for and the checkpoint lacks is an error.

How the key set is derived from megatron-core's code, not copied by hand: megatron-core 0.19's own
``get_gpt_layer_with_transformer_engine_spec`` (the Qwen3-MoE arguments Bridge uses: experts,
grouped GEMM, QK layernorm) and ``get_gpt_decoder_block_spec(use_transformer_engine=True)`` are
built on this machine without Transformer Engine: megatron-core defines the TE wrapper classes
(``TENorm`` really, the others as placeholders) and ``TESpecProvider`` even without TE; only
``gpt_layer_specs`` hides them behind ``HAVE_TE`` and the provider asks TE's version, so those three
names are patched for the duration (as if a current TE were installed: Bridge 0.6.2 needs TE 2.x).
The spec is then walked: every submodule the spec makes a ``TENorm`` (TE's own ``RMSNorm``, which
has no ``sharded_state_dict`` of Megatron's, so ``sharded_state_dict_default`` stores its
``_extra_state``), and the block's final norm, is a norm with extra state under the TE spec. The
local spec's norms are torch modules without one, so these are exactly the objects the project
must add (``megatron_gspo.hf.mcore_checkpoint.TE_NORMS``). The TE spec's other TE modules are
checked to be the linears whose ``_extra_state`` keys the local spec shares (``linear_qkv``,
``linear_proj``, the experts' fc1 / fc2, whose TE grouped keys megatron-core makes
"interchangeable" with ``SequentialMLP``'s) or the core attention (``TEDotProductAttention
.sharded_state_dict`` stores only a learnable softmax offset, no extra state): a new kind of TE
module in a later megatron-core fails the test instead of passing unseen.

megatron-core 0.16's ``gpt_layer_specs`` has no ``TESpecProvider`` to build the spec from without
TE: the tests skip there (the 3.12 stack runs them: tests/conftest.py MCORE_SUBSET).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from bench.hf_tiny import build_hf_model, save_hf_model
from megatron_gspo import mcore_compat
from megatron_gspo.hf.convert import hf_to_mcore
from megatron_gspo.hf.hf_config import model_config_from_hf
from megatron_gspo.hf.mcore_checkpoint import TE_NORMS, te_norm_extra_state_keys

pytestmark = pytest.mark.skipif(
    mcore_compat.mcore_version()[:2] == (0, 16),
    reason="megatron-core 0.16 builds its TE spec only with Transformer Engine installed (no "
           "TESpecProvider without it); the Python 3.12 stack (megatron-core 0.19) runs this")

# TE modules the TE spec may use whose _extra_state keys the local spec has too, or which store none
SHARED_OR_NONE = {"self_attention.linear_qkv", "self_attention.linear_proj",
                  "self_attention.core_attention", "mlp.experts.linear_fc1", "mlp.experts.linear_fc2",
                  "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"}


def _te_spec():
    """megatron-core's TE layer spec and block spec for a Qwen3-MoE layer, built without TE."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as te_provider

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                               num_moe_experts=4, moe_grouped_gemm=True, qk_layernorm=True,
                               normalization="RMSNorm")
    with mock.patch.object(gpt_layer_specs, "HAVE_TE", True), \
            mock.patch.object(gpt_layer_specs, "TESpecProvider", te_provider.TESpecProvider), \
            mock.patch.object(gpt_layer_specs, "TENorm", te_ext.TENorm), \
            mock.patch.object(te_provider, "is_te_min_version", lambda *args, **kwargs: True):
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=4, moe_grouped_gemm=True, qk_layernorm=True)
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                                           pp_rank=0)
    return layer, block, te_ext, te_provider


def _is_te_norm(obj, te_ext, te_provider) -> bool:
    """``TENorm``, or the provider's ``_TENormWithResidual`` (its ``__new__`` returns a TENorm)."""
    return isinstance(obj, type) and (issubclass(obj, te_ext.TENorm) or (
        obj.__module__ == te_provider.__name__ and "TENorm" in obj.__name__))


def _te_modules(spec, te_ext, te_provider, path: str = "") -> dict[str, object]:
    """Submodule path -> the TE class (megatron.core.extensions.transformer_engine, or the spec
    provider's own TE classes) the spec puts there."""
    # without TE some names are placeholders (MagicMock) and some None: None marks no module
    te_objects = {id(getattr(module, name)) for module, prefix in ((te_ext, "TE"), (te_provider, "_TE"))
                  for name in dir(module)
                  if name.startswith(prefix) and getattr(module, name) is not None}
    found: dict[str, object] = {}

    def walk(obj, where: str) -> None:
        if isinstance(obj, functools.partial):  # MoE builders: partial(module, submodules=...)
            obj = ModuleSpec(module=obj.func, submodules=obj.keywords.get("submodules"))
        if isinstance(obj, ModuleSpec):
            walk(obj.module, where)
            walk(obj.submodules, where)
        elif _is_te_norm(obj, te_ext, te_provider) or id(obj) in te_objects:
            found[where] = obj
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name), f"{where}.{field.name}" if where else field.name)

    walk(spec, path)
    return found


def derived_te_norms() -> set[str]:
    """The modules with a TENorm under the TE spec, as checkpoint key prefixes."""
    layer, block, te_ext, te_provider = _te_spec()
    modules = _te_modules(layer, te_ext, te_provider)
    norms = {f"decoder.layers.{p}" for p, cls in modules.items() if _is_te_norm(cls, te_ext, te_provider)}
    others = set(modules) - {p.removeprefix("decoder.layers.") for p in norms}
    assert others <= SHARED_OR_NONE, f"TE modules of a kind this test does not know: {others - SHARED_OR_NONE}"
    assert block.layer_norm is te_ext.TENorm
    return norms | {"decoder.final_layernorm"}


def test_te_norms_with_extra_state_are_those_megatron_cores_te_spec_builds():
    assert derived_te_norms() == set(TE_NORMS)


@pytest.fixture
def one_rank():
    """A one-rank gloo group in this process (``dist_checkpointing.load`` plans collectively)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_converted_checkpoint_holds_every_te_norm_object_under_megatron_lms_strictness(tmp_path,
                                                                                       one_rank):
    hf_dir = save_hf_model(build_hf_model("gqa2_untied", seed=4), tmp_path / "hf")
    hf_to_mcore(hf_dir, tmp_path / "mcore", progress=False, sync_files=False)
    model = model_config_from_hf(str(hf_dir))
    L = model.num_layers
    request = {}
    for module in derived_te_norms():  # what a TE-spec model asks for: one object per layer
        key = f"{module}._extra_state"
        if module.startswith("decoder.layers."):
            for layer in range(L):
                request[f"{key}.{layer}"] = ShardedObject(key, None, (L,), (layer,), replica_id=0)
        else:
            request[key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
    assert {o.unique_key for o in request.values()} == set(te_norm_extra_state_keys(model))
    # Megatron-LM's and Bridge's default strictness: a missing object raises
    loaded = dist_checkpointing.load(request, str(tmp_path / "mcore" / "iter_0000000"),
                                     strict="assume_ok_unexpected", validate_access_integrity=False)
    assert all(loaded[name] is None for name in request)
    missing = dict(request, absent=ShardedObject("decoder.layers.absent._extra_state", None, (L,),
                                                 (0,), replica_id=0))
    with pytest.raises(CheckpointException) as err:  # the control: the strictness does bite
        dist_checkpointing.load(missing, str(tmp_path / "mcore" / "iter_0000000"),
                                strict="assume_ok_unexpected", validate_access_integrity=False)
    assert "Missing key in checkpoint state_dict: decoder.layers.absent._extra_state" in repr(
        err.value.failures)
    assert torch.load(tmp_path / "mcore" / "iter_0000000" / "common.pt", weights_only=True)[
        "checkpoint_version"] == 3.0
