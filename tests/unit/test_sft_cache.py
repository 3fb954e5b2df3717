"""The session SFT policy's cache (tests/conftest.py, ``MGSPO_TEST_SFT_CACHE``): keyed by every
source file, stored whole or not at all."""

from __future__ import annotations

from pathlib import Path

from tests import conftest


def fake_tree(root: Path) -> None:
    for d in ("megatron_gspo", "pipeline", "launch/configs"):
        (root / d).mkdir(parents=True)
    (root / "megatron_gspo" / "model.py").write_text("A = 1\n")
    (root / "pipeline" / "loop.py").write_text("B = 2\n")
    (root / "launch" / "configs" / "sft.yaml").write_text("run: {}\n")


def test_the_key_changes_with_any_source_or_config_file(tmp_path, monkeypatch):
    fake_tree(tmp_path)
    monkeypatch.setattr(conftest, "ROOT", tmp_path)
    first = conftest.sft_policy_key()
    assert conftest.sft_policy_key() == first
    for path in ("megatron_gspo/model.py", "pipeline/loop.py", "launch/configs/sft.yaml"):
        before = (tmp_path / path).read_text()
        (tmp_path / path).write_text(before + "# changed\n")
        assert conftest.sft_policy_key() != first, path
        (tmp_path / path).write_text(before)
    assert conftest.sft_policy_key() == first
    (tmp_path / "pipeline" / "notes.txt").write_text("not a source")
    assert conftest.sft_policy_key() == first


def test_a_stored_policy_is_whole_and_replaces_a_partial_one(tmp_path):
    hf = tmp_path / "run" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\x01" * 10)
    entry = tmp_path / "cache" / "key"
    (entry / "hf").mkdir(parents=True)  # an earlier session died while storing: no mark
    (entry / "hf" / "stale").write_text("x")
    got = conftest.store_sft_policy(hf, entry)
    assert got == entry / "hf" and (entry / "complete").is_file()
    assert sorted(p.name for p in got.iterdir()) == ["config.json", "model.safetensors"]
    assert (got / "model.safetensors").read_bytes() == b"\x01" * 10
    assert list((tmp_path / "cache").iterdir()) == [entry]
