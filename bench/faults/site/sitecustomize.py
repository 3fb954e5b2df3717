"""The fault harness's entry into a run's processes (``bench/faults``): this directory goes first
on ``PYTHONPATH`` of a run started by the harness. Where ``MGSPO_FAULT`` is set it installs
``bench.faults.inject`` (the repository root is on ``PYTHONPATH`` too); otherwise it does nothing.
Either way it then runs the ``sitecustomize`` it shadows, if any (the next one on ``sys.path``).
"""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("MGSPO_FAULT"):
    from bench.faults import inject

    inject.install()


def _run_shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_run_shadowed()
