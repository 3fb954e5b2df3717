"""Megatron-Bridge 0.6.2 on a CPU-only machine, for the ``bridge`` test tier: test-only, it touches
no conversion or checkpoint code of Bridge, Megatron-Core or this project.

Four accommodations (the review behind issue 35 found five; the fifth, ``if __name__ ==
"__main__"`` around scripts, is met by the tests running in pytest and forked ranks):

1. :func:`import_bridge`: a placeholder ``transformer_engine`` package while ``megatron.bridge`` is
   imported, then removed. Bridge's ``peft/lora_layers.py`` does an unconditional ``import
   transformer_engine.pytorch as te`` and uses ``te.ops.Sequential`` in annotations at class
   definition (GPU paths only). Megatron-Core's modules that test for Transformer Engine
   (``HAVE_TE``) are imported first, without the placeholder, so they record its absence.
2. :func:`local_provider`: Bridge's provider builds Bridge's own ``local_layer_spec``
   (``models/gpt_provider.py``) in fp32 with TE/CUDA fusions off (its default is the TE spec);
   :func:`local_spec_everywhere` applies it where Bridge's own entry points make their provider
   (``AutoBridge.to_megatron_provider`` for ``import_ckpt``; ``load_model_config``, the provider
   it instantiates from ``run_config.yaml``, for ``load_megatron_model`` and ``export_ckpt``).
3. The ranks are gloo ranks made before Bridge sees a process group (``bench.spawn``), with the
   project's CPU accommodations (``megatron_gspo.cpu_compat``: CUDA device calls, the RNG
   tracker); otherwise ``provide_distributed_model`` calls ``init_process_group("nccl")``.
4. :func:`prepare_rank`: ``torch.cuda.get_rng_state`` returns an empty tensor: Bridge's
   ``get_rng_state`` calls it even with ``save_rng=False`` (``training/checkpointing.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import sys
import types

import torch

from megatron_gspo import cpu_compat

_PLACEHOLDERS = ("transformer_engine", "transformer_engine.pytorch")


def _placeholder(name: str, package: bool) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    return module


def import_bridge() -> types.ModuleType:
    """``megatron.bridge``, imported with accommodation 1 (the placeholder is gone afterwards)."""
    if "megatron.bridge" in sys.modules:
        return sys.modules["megatron.bridge"]
    # Megatron-Core's modules that record HAVE_TE, imported before the placeholder exists
    # (megatron-core 0.19: this tier's environment)
    importlib.import_module("megatron.core.models.gpt.gpt_layer_specs")
    importlib.import_module("megatron.core.models.hybrid.hybrid_layer_specs")
    te, te_pytorch = _placeholder(_PLACEHOLDERS[0], True), _placeholder(_PLACEHOLDERS[1], False)
    te.pytorch = te_pytorch
    te_pytorch.ops = types.SimpleNamespace(Sequential=type("Sequential", (), {}))
    sys.modules.update(dict(zip(_PLACEHOLDERS, (te, te_pytorch))))
    try:
        import megatron.bridge
        import megatron.bridge.models.conversion.auto_bridge  # noqa: F401
        import megatron.bridge.training.checkpointing  # noqa: F401
        import megatron.bridge.training.model_load_save  # noqa: F401
    finally:
        for name in _PLACEHOLDERS:
            sys.modules.pop(name, None)
    return megatron.bridge


def prepare_rank() -> None:
    """Accommodations 3 and 4 on a gloo rank (call before Bridge builds a model)."""
    cpu_compat.apply()
    cpu_compat.seed_rng_tracker()
    torch.cuda.get_rng_state = lambda device=None: torch.empty(0, dtype=torch.uint8)


def local_provider(provider):
    """Accommodation 2 on a Bridge model provider: the local spec, fp32, no TE/CUDA fusions."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider.transformer_layer_spec = local_layer_spec
    provider.bf16, provider.fp16, provider.params_dtype = False, False, torch.float32
    for flag in ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                 "persist_layer_norm", "apply_rope_fusion", "bias_dropout_fusion",
                 "moe_permute_fusion", "cross_entropy_loss_fusion"):
        if hasattr(provider, flag):
            setattr(provider, flag, False)
    provider.perform_initialization = False
    return provider


@contextlib.contextmanager
def local_spec_everywhere():
    """Accommodation 2 at Bridge's own entry points, while the context lasts."""
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.training import model_load_save

    to_provider, load_config = AutoBridge.to_megatron_provider, model_load_save.load_model_config

    def to_megatron_provider(self, *args, **kwargs):
        return local_provider(to_provider(self, *args, **kwargs))

    def load_model_config(checkpoint_path):
        model_cfg, mlm_args = load_config(checkpoint_path)
        return local_provider(model_cfg), mlm_args

    AutoBridge.to_megatron_provider = to_megatron_provider
    model_load_save.load_model_config = load_model_config
    try:
        yield
    finally:
        AutoBridge.to_megatron_provider = to_provider
        model_load_save.load_model_config = load_config
