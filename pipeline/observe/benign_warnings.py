"""THE registry of third-party warnings that are benign here, each with the reason, and where it applies.

A user should see a warning when it tells them something. The ones listed here tell nothing on the
machine where they are silenced: Megatron-Core announcing that Transformer Engine and Apex are
absent on a machine without CUDA (where neither can exist and the torch fallbacks are the intended
path), a deprecation inside a dependency that calls another dependency, a log line caused by the
router's connection probe. Each entry names the message (a regex matched at its start, case-
insensitive, as ``warnings.filterwarnings`` does), the category (a ``Warning`` class, or ``None`` for
a log record), the module that emits it (a regex matched at the start of the warning's module name;
for a log record the exact logger name) and why it is benign. Entries with ``only_without_cuda``
stay loud on a machine where torch sees a GPU: there a missing Transformer Engine is a real problem.

Applied by

* ``launch.cli.main`` before any sub-command module is imported, so in the launcher and in every
  training rank (torchrun and srun start ranks as ``python -m launch.cli ...``);
* the local rollout server's own entry point (``pipeline/local/__main__.py``) before the server's
  modules are imported, so in every local rollout server (``pipeline/servers/cluster.py`` starts
  ``python -m pipeline.local``; ``megatron-gspo serve`` is ``launch.cli``);
* the test suite: ``pyproject.toml``'s ``filterwarnings`` holds the unconditional entries (a unit
  test keeps that list equal to :func:`pytest_filters`), ``tests/conftest.py`` adds the
  ``only_without_cuda`` ones on machines without CUDA.

``MEGATRON_GSPO_SHOW_WARNINGS=1`` in the environment turns all of it off (every process started
from that environment shows everything again). Python's own default filters still apply to what is
not listed (e.g. a DeprecationWarning raised inside a library is hidden outside tests anyway).

The entries were taken from what megatron-core 0.16.1 and 0.19.2 (the two supported stacks,
``megatron_gspo/mcore_compat.py``), torch 2.13, transformers 5 and sglang-router 0.3.2 print in ``megatron-gspo demo``, ``sft``, ``train``, ``serve`` and the test suite
on a CPU machine. A new dependency version that prints something else shows it: add it here with
its reason, or fix the cause.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["REGISTRY", "SHOW_ENV", "BenignWarning", "apply", "cuda_machine", "pytest_filters", "showing_everything"]

SHOW_ENV = "MEGATRON_GSPO_SHOW_WARNINGS"


@dataclass(frozen=True)
class BenignWarning:
    message: str
    """Regex matched (case-insensitively) at the start of the warning message / log message."""
    category: Optional[type[Warning]]
    """The warning class; ``None`` for a log record of level WARNING or below."""
    module: str
    """Regex matched at the start of the emitting module's name (``warnings`` semantics); for a
    log record, the exact name of the logger."""
    reason: str
    """Why it tells the user nothing on the machines where it is silenced."""
    only_without_cuda: bool = False
    """Silenced only where torch sees no CUDA device; shown on GPU machines."""


REGISTRY: tuple[BenignWarning, ...] = (
    # ------------------------------------------------------------------ machines without CUDA
    BenignWarning(
        message=r"Transformer Engine and Apex are not installed\. Falling back to",
        category=UserWarning,
        module=r"megatron\.core\.",
        reason="Transformer Engine and Apex are CUDA libraries: without CUDA neither can be installed, "
               "and Megatron's torch fallbacks (torch Adam/SGD, its local multi_tensor_applier) are the "
               "path this project runs on the CPU. Printed at import by megatron.core.optimizer, "
               "optimizer.optimizer, optimizer.clip_grads and megatron_fsdp.mixed_precision. On a GPU "
               "machine it means Transformer Engine is missing (pip install -e '.[gpu]'): shown there.",
        only_without_cuda=True),
    BenignWarning(
        message=r"Apex is not installed\. Falling back to Torch Norm",
        category=UserWarning,
        module=r"megatron\.core\.models\.",
        reason="Apex's fused norms need CUDA; without it the local layer spec uses a torch norm "
               "(megatron_gspo/model/norm.py), which is what runs on the CPU. Printed at import by "
               "megatron.core.models.backends and gpt.gpt_layer_specs. Shown on GPU machines.",
        only_without_cuda=True),
    # ------------------------------------------------------------------ every machine
    BenignWarning(
        message=r"MimoModelConfig is experimental",
        category=UserWarning,
        module=r"megatron\.core\.models\.mimo",
        reason="megatron-core 0.19's get_megatron_optimizer imports its multimodal MimoModel to test "
               "isinstance(model, MimoModel), and that import announces the experimental API; the "
               "policy is no MimoModel (megatron_gspo/mcore_compat.py, difference 3)."),
    BenignWarning(
        message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        category=FutureWarning,
        module=r"torch\.distributed\.c10d_logger",
        reason="torch 2.13 renamed the collective that megatron-core 0.16.1 calls (DDP's grad buffers, "
               "tensor_parallel mappings); the old name still works. This project never calls it "
               "(tests/unit/test_benign_warnings.py checks), so the warning always comes from Megatron."),
    BenignWarning(
        message=r"`torch\.jit\.script_method` is deprecated",
        category=DeprecationWarning,
        module=r"torch\.jit\._script",
        reason="Raised while torch and its dependencies import TorchScript helpers; this project "
               "uses no TorchScript. Hidden by Python's default filters outside tests anyway."),
    BenignWarning(
        message=r"The following imports from `dynamic_context\.py` will be removed",
        category=DeprecationWarning,
        module=r"megatron\.core\.inference\.contexts",
        reason="Megatron's inference package warns about its own re-exports when "
               "megatron.core imports it; this project does not use Megatron's inference engine."),
    BenignWarning(
        message=r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine' module is deprecated",
        category=DeprecationWarning,
        module=r"megatron\.core\.",
        reason="megatron-core 0.16.1 imports its own deprecated TE shim (multi_latent_attention); "
               "this project imports neither it nor MLA."),
    # ------------------------------------------------------------------ log records
    BenignWarning(
        message=r"GPTModel IS DEPRECATED",
        category=None,
        module="megatron.core.models.gpt.gpt_model",
        reason="megatron-core 0.19 logs it at every GPTModel construction (HybridModel is its "
               "successor); the policy stays on GPTModel on both supported stacks so that "
               "checkpoints, the Hugging Face mapping and routing replay keep their parameter "
               "names (megatron_gspo/mcore_compat.py, difference 2)."),
    BenignWarning(
        message=r"No CUDA runtime is found, using CUDA_HOME",
        category=None,
        module="torch.utils.cpp_extension",
        reason="A CUDA build of torch (the Python 3.12 stack's wheel from the package registry) on a "
               "machine without a GPU: torch's extension loader says it found no CUDA runtime when "
               "Megatron imports it. Nothing is compiled on the CPU path. Shown on GPU machines.",
        only_without_cuda=True),
    BenignWarning(
        message=r"Invalid HTTP request received\.",
        category=None,
        module="uvicorn.error",
        reason="sglang-router 0.3.2 probes every worker it registers for gRPC (an HTTP/2 preface) "
               "before it settles on HTTP (its detect_connection_mode step); the local rollout server "
               "speaks HTTP/1.1, so uvicorn logs the rejected preface. Twice per registered server."),
)


def showing_everything() -> bool:
    """True when ``MEGATRON_GSPO_SHOW_WARNINGS`` asks for every warning (any value but '', '0')."""
    return os.environ.get(SHOW_ENV, "") not in ("", "0")


def cuda_machine() -> bool:
    """True when torch sees a CUDA (or ROCm) device, as ``torch.cuda.is_available()`` says.

    A CPU-only build of torch can never see one; that is read from ``torch/version.py`` without
    importing torch, so that ``megatron-gspo --help`` and ``config`` stay fast. Other builds are
    asked (importing torch, which every command that emits these warnings imports anyway).
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    try:
        version = Path(spec.origin).with_name("version.py").read_text()
    except OSError:
        version = ""
    if all(re.search(rf"^{name}\s*(:[^=\n]*)?=\s*None\s*$", version, re.M) for name in ("cuda", "hip")):
        return False
    import torch

    return torch.cuda.is_available()


class _LogFilter(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.WARNING and self.pattern.match(record.getMessage()))


def _silenced(cuda: Optional[bool]) -> list[BenignWarning]:
    if any(entry.only_without_cuda for entry in REGISTRY) and cuda is None:
        cuda = cuda_machine()
    return [entry for entry in REGISTRY if not (entry.only_without_cuda and cuda)]


def apply(*, cuda: Optional[bool] = None) -> list[BenignWarning]:
    """Silence the entries that are benign on this machine; returns them (nothing with the switch).

    Idempotent (``warnings.filterwarnings`` replaces an equal filter; a logger gets each filter
    once). ``cuda`` overrides :func:`cuda_machine` (tests).
    """
    if showing_everything():
        return []
    entries = _silenced(cuda)
    for entry in entries:
        if entry.category is None:
            logger = logging.getLogger(entry.module)
            if not any(isinstance(f, _LogFilter) and f.pattern.pattern == entry.message for f in logger.filters):
                logger.addFilter(_LogFilter(re.compile(entry.message, re.I)))
        else:
            warnings.filterwarnings("ignore", message=entry.message, category=entry.category,
                                    module=entry.module)
    return entries


def pytest_filters(*, only_without_cuda: bool) -> list[str]:
    """The ``filterwarnings`` lines (pytest's ``action:message:category:module`` form) of the entries
    with that ``only_without_cuda`` value; log records are not pytest's business."""
    lines = []
    for entry in REGISTRY:
        if entry.category is None or entry.only_without_cuda != only_without_cuda:
            continue
        for text in (entry.message, entry.module):
            if ":" in text:
                raise ValueError(f"benign warning regex {text!r}: a ':' cannot be written in a pytest filter")
        lines.append(f"ignore:{entry.message}:{entry.category.__name__}:{entry.module}")
    return lines
