"""The weight version: which weights generated a token.

The loop labels the weights after training step k with the version ``k`` (the initial weights:
the step the run starts from). It is an ``int`` everywhere in the pipeline - the step, the
stream's admission rule, a sample's version spans (``pipeline.generation.trajectory.Span``) and
the staleness metrics - and a string only on the wire: SGLang carries it as the ``weight_version``
label of ``/update_weight_version`` and the weight-update routes, and sends it back in
``meta_info.weight_version(s)``. :func:`to_wire` and :func:`from_wire` are the two conversions.

A server's label that is not a step number (SGLang's initial ``"default"``, before the run's
first sync) has no version: :func:`from_wire` gives None, and nothing that compares versions
counts it.
"""

from __future__ import annotations

import re
from typing import Optional

WeightVersion = int
"""The step whose update produced the weights (see the module docstring)."""

_STEP_LABEL = re.compile(r"-?[0-9]+")


def to_wire(version: WeightVersion) -> str:
    """The label SGLang carries for ``version`` (``/update_weight_version``'s ``new_version``,
    the weight-update routes' ``weight_version``, the disk sync's ``weights_v{label}``)."""
    return str(int(version))


def from_wire(label: Optional[str]) -> Optional[WeightVersion]:
    """The version a server's label names; None for a label that is not a step number (a
    server's initial label) or no label."""
    if label is None or not _STEP_LABEL.fullmatch(str(label)):
        return None
    return int(label)
