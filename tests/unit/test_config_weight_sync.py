"""The section ``rollout.weight_sync`` (``megatron_gspo.config.WeightSyncConfig``): its fields'
checks name the nested key, and the flat keys it replaced are refused naming the new key.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_config_weight_sync.py``
"""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, RolloutConfig, config_from_dict

FLAT = ["senders", "dir", "bucket_mb", "dtype", "master_address", "verify", "delta", "full_every"]


def test_the_section_reads_every_field_and_resolves_senders():
    sync = config_from_dict({"rollout": {"weight_sync": {
        "transport": "distributed", "dir": "/shm/w", "bucket_mb": 64, "dtype": "bfloat16",
        "master_address": "10.0.0.1", "verify": True, "delta": True, "full_every": 3}}}
    ).rollout.weight_sync
    assert (sync.transport, sync.dir, sync.bucket_mb, sync.dtype, sync.master_address,
            sync.verify, sync.delta, sync.full_every) == (
        "distributed", "/shm/w", 64, "bfloat16", "10.0.0.1", True, True, 3)
    assert sync.resolved_senders() == "node"  # auto: one per node for broadcast groups
    assert config_from_dict({}).rollout.weight_sync.resolved_senders() == "rank"  # disk
    stage = config_from_dict({"rollout": {"weight_sync": {"senders": "stage"}}})
    assert stage.rollout.weight_sync.resolved_senders() == "stage"


@pytest.mark.parametrize("name", FLAT)
def test_a_flat_key_is_refused_naming_its_new_key(name):
    with pytest.raises(ConfigError, match=rf"^rollout\.weight_sync_{name}: moved; write "
                                          rf"rollout\.weight_sync\.{name}$"):
        config_from_dict({"rollout": {f"weight_sync_{name}": None}})
    with pytest.raises(ConfigError, match=rf"rollout\.weight_sync\.{name}"):
        config_from_dict({}, [f"rollout.weight_sync_{name}=1"])
    assert set(RolloutConfig.MOVED_KEYS) == {f"weight_sync_{n}" for n in FLAT}


@pytest.mark.parametrize("how", ["yaml", "override"])
def test_the_transport_as_a_plain_value_is_refused_naming_the_transport_key(how):
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync: 'tensor' is a plain value, "
                                          r"but rollout\.weight_sync is a section now; write "
                                          r"rollout\.weight_sync\.transport: 'tensor'"):
        if how == "yaml":
            config_from_dict({"rollout": {"weight_sync": "tensor"}})
        else:
            config_from_dict({}, ["rollout.weight_sync=tensor"])
    cfg = config_from_dict({}, ["rollout.weight_sync.transport=tensor"])
    assert cfg.rollout.weight_sync.transport == "tensor"


@pytest.mark.parametrize("section, message", [
    ({"bucket_mb": 0}, r"^rollout\.weight_sync\.bucket_mb: must be >= 1, got 0$"),
    ({"full_every": 0}, r"^rollout\.weight_sync\.full_every: must be >= 1, got 0$"),
    ({"delta": True}, r"^rollout\.weight_sync\.delta: needs rollout\.weight_sync\.transport "
                      r"tensor or distributed \(got disk"),
    ({"transport": "tcp"}, r"^rollout\.weight_sync\.transport: 'tcp' is not one of"),
    ({"buckets_mb": 1}, r"^rollout\.weight_sync\.buckets_mb: unknown key \(valid keys: bucket_mb,"),
    ({"transport": "tensor", "delta": True, "dtype": "float32"},
     r"^rollout\.weight_sync\.delta: needs bf16 weights on the wire \(rollout\.weight_sync\.dtype "
     r"resolves to float32\)"),
])
def test_checks_name_the_nested_field(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"rollout": {"weight_sync": section}})
