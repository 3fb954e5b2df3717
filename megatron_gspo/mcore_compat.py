"""Every difference between the two Megatron-Core versions this project supports, with its reason.

The two tested stacks (``pyproject.toml`` selects megatron-core by the Python version):

* Python 3.11 + megatron-core 0.16.1 (the development machines' default);
* Python 3.12 + megatron-core 0.19.2 (current NGC containers; 0.17 and later need Python >= 3.12).

The rest of the project calls Megatron the same way on both; what differs is met here, and this
docstring lists what was read in 0.19.2's source and found to need nothing:

1. **CUDA-graph field** (:func:`no_cuda_graph_kwargs`). 0.16 names it ``cuda_graph_scope``, 0.19
   ``cuda_graph_modules`` (``cuda_graph_scope`` still exists there, deprecated: a
   ``DeprecationWarning`` whenever it is set). Both default to ``"full"``, a value both deprecate
   with a ``UserWarning`` in ``TransformerConfig.__post_init__`` before normalising it to ``[]``.
   The policy passes ``[]`` (no CUDA graphs; what ``"full"`` becomes) under the running version's
   name: the same configuration, and no notice on either stack.
2. **GPTModel is deprecated in 0.19** in favour of ``HybridModel``; every ``GPTModel`` construction
   logs a WARNING ("GPTModel IS DEPRECATED ... only accepting critical bug fixes"). The policy keeps
   ``GPTModel`` on both stacks: ``HybridModel`` builds attention and MoE as separate layers from a
   layer pattern, which renames every parameter (checkpoint keys, the Hugging Face mapping of
   ``megatron_gspo/hf/mapping.py``, routing replay's per-layer routers) and would make a checkpoint
   of one stack unreadable on the other. ``pipeline/observe/benign_warnings.py`` silences that one log record
   (its entry points here); ``MEGATRON_GSPO_SHOW_WARNINGS=1`` shows it.
3. **An experimental import in 0.19's optimizer**: ``get_megatron_optimizer`` imports
   ``megatron.core.models.mimo`` to test ``isinstance(model, MimoModel)``, and that import warns
   "MimoModelConfig is experimental". The policy is no MimoModel; the benign-warning registry has
   the entry.
4. ``get_gpt_layer_local_spec``: 0.16 spells out its keywords (with the legacy
   ``moe_use_legacy_grouped_gemm``, removed in 0.19 together with ``moe/grouped_gemm_util.py``);
   0.19 forwards ``*args, **kwargs`` to ``get_gpt_layer_local_submodules``. The four keywords the
   policy passes (``num_experts``, ``moe_grouped_gemm``, ``qk_layernorm``, ``normalization``) have
   the same names and meaning in both; ``get_gpt_decoder_block_spec`` (the Transformer Engine
   spec) has the same signature in both.
5. ``RouterReplay``: 0.19 adds static buffers for CUDA-graph capture
   (``set_global_static_buffers`` slices one buffer over ``global_router_replay_instances``;
   ``record_indices`` copies into the buffer when one is set). Routing replay's
   ``CapturingRouterReplay`` leaves that global list and never sets a buffer, so recording and
   replay behave as in 0.16 (tests/distributed/test_routing_replay.py runs on both stacks).
6. ``PackedSeqParams``: 0.19 adds ``total_tokens``, ``seq_idx``, ``tokens_per_sample`` and
   ``pad_between_seqs`` (Mamba's CUDA-graph path), all defaulting to ``None``; the THD packing the
   policy builds (``qkv_format="thd"`` with ``cu_seqlens``) and its own packed core attention are
   unchanged.
7. ``dist_checkpointing``: ``strategies/base.py`` is gone in 0.19 (the project never imported it);
   the ``torch_dist`` format, ``ShardedTensor`` / ``ShardedObject`` / ``ShardedTensorFactory`` and
   ``filesystem_async._results_queue`` (which ``train/checkpoint/save.py`` sets to a queue that dies
   with the rank) are the same, but 0.19 stores the common (non-sharded) state as a
   ``ShardedObject`` named ``common_state`` inside the torch_dist files, where 0.16 wrote it to
   ``common.pt`` and reads only that (0.19 still reads ``common.pt``). Under 0.16,
   :func:`dist_load_kwargs` gives ``dist_checkpointing.load`` a common-state reader that does what
   0.19's ``load_common_state_dict`` does (torch DCP reads the object, ``torch.load(...,
   weights_only=True)`` unpickles it). Checkpoints record the stack that wrote them (:func:`stack`);
   one written by either stack resumes on the other exactly, and starts a run there as
   ``run.init_from`` (``hf.mcore_checkpoint.load_model`` uses the same reader; so do Megatron-Bridge's
   and Megatron-LM's checkpoints, written by 0.19) (tests/distributed/test_cross_stack_checkpoint.py).
8. The CPU accommodations (``megatron_gspo/cpu_compat.py``) patch names that exist in both
   versions; ``tests/unit/test_cpu_compat.py`` runs on both stacks and fails if one stops working
   or stops being needed. One is no longer needed in 0.19: ``moe_utils.te_general_gemm`` is
   defined as ``None`` there without Transformer Engine (0.16 left it undefined), so accommodation
   3 finds the name and leaves it.

Nothing here imports Megatron at module level: the version is read from the installed
distribution's metadata.
"""

from __future__ import annotations

import io
import platform
from functools import lru_cache
from importlib import metadata
from pathlib import Path

__all__ = ["SUPPORTED", "dist_load_kwargs", "mcore_version", "no_cuda_graph_kwargs", "stack",
           "transformer_engine_available"]

SUPPORTED = {(0, 16): "3.11", (0, 19): "3.12"}
"""The supported megatron-core minor versions and the Python each is tested with."""


@lru_cache(maxsize=None)
def mcore_version() -> tuple[int, int, int]:
    """The installed megatron-core's ``(major, minor, patch)``; a clear error for an unsupported
    one (pyproject.toml pins each Python to its version: a container's own Megatron may differ)."""
    text = metadata.version("megatron-core")
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 3:
        parts.append(0)
    version = (parts[0], parts[1], parts[2])
    if version[:2] not in SUPPORTED:
        known = ", ".join(f"{a}.{b} (Python {py})" for (a, b), py in SUPPORTED.items())
        raise RuntimeError(f"megatron-core {text} is installed; megatron-gspo supports {known}: "
                           "pip install -e . in a fresh virtual environment selects the right one")
    return version


def no_cuda_graph_kwargs() -> dict:
    """``TransformerConfig`` keywords for "no CUDA graphs" (difference 1 of the module docstring)."""
    field = "cuda_graph_scope" if mcore_version()[:2] == (0, 16) else "cuda_graph_modules"
    return {field: []}


def transformer_engine_available() -> bool:
    """Whether this machine runs the Transformer Engine layer spec: a GPU and ``transformer_engine``
    importable (``model.gpt`` builds the local spec otherwise; ``launch.plan`` plans for it)."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def stack() -> dict[str, str]:
    """The software stack a checkpoint is written with (recorded in its manifest)."""
    import torch

    return {"megatron_core": metadata.version("megatron-core"), "torch": torch.__version__,
            "python": platform.python_version()}


def dist_load_kwargs(checkpoint_dir: str | Path) -> dict:
    """Extra keywords for ``dist_checkpointing.load`` of ``checkpoint_dir`` (difference 7): under
    0.16, a checkpoint without ``common.pt`` (one written by 0.19) gets 0.19's common-state reader."""
    if mcore_version()[:2] != (0, 16) or (Path(checkpoint_dir) / "common.pt").exists():
        return {}
    return {"common_strategy": _common_state_object_reader()}


def _common_state_object_reader():
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class CommonStateObjectReader(TorchCommonLoadStrategy):
        """0.16's torch common-state strategy, reading 0.19's ``common_state`` object."""

        def load_common(self, checkpoint_dir):
            key = ShardedObject("common_state", None, (1,), (0,)).unique_key
            state = {key: io.BytesIO()}
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(checkpoint_dir)), no_dist=True)
            loaded = state[key]
            if isinstance(loaded, io.BytesIO):
                loaded.seek(0)
                loaded = torch.load(loaded, weights_only=True)
            return loaded[0]

    return CommonStateObjectReader()
