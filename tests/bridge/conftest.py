"""The ``bridge`` tier runs in the Megatron-Bridge environment only (launch/envs/bridge.sh):
elsewhere its tests are skipped with that reason (the README suite and the fast tier deselect
them by marker anyway)."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    if importlib.util.find_spec("megatron.bridge") is not None:
        return
    skip = pytest.mark.skip(reason="needs Megatron-Bridge 0.6.2: run the bridge tier with the "
                                   "environment launch/envs/bridge.sh builds (.venv-bridge/bin/python "
                                   "-m pytest -m bridge tests/bridge)")
    for item in items:
        if "tests/bridge/" in item.nodeid:
            item.add_marker(skip)
