"""Issue 22, items 2 and 3 (and the file-level lesser findings): reading a configuration file.

* A key given twice (at any depth) used to keep the last silently (``run:`` twice lost the first
  section's ``num_steps``, exit 0): it is an error naming the key, the file and both lines.
* A 2 KB alias bomb used to hang ``config`` / ``train`` (6.4 GB after 90 s: ``_build`` formatted
  the whole expansion with repr): it is refused while it is read, fast and in bounded memory, and
  no error message formats more than a bounded length of any input value.
* An empty file used to be all defaults, a non-UTF-8 one a traceback: both name the file.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import ConfigError, config_from_dict, load_config, yaml_load

ROOT = Path(__file__).resolve().parents[2]


def bomb(levels: int = 9) -> str:
    """The "billion laughs": 9 ** levels strings in ~2 KB (350 bytes for 9 levels)."""
    text = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    names = "abcdefghijklmnop"[:levels]
    for prev, name in zip(names, names[1:]):
        text += f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]\n"
    return text


def test_a_duplicated_section_names_the_key_the_file_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("run:\n  num_steps: 3\nmodel:\n  num_layers: 2\nrun:\n  seed: 7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert str(path) in message and "duplicate key 'run'" in message
    assert "line 5" in message and "first at line 1" in message


def test_a_duplicated_nested_key_names_its_path_and_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model:\n  num_layers: 2\nrun:\n  num_steps: 3\n  seed: 7\n  num_steps: 4\n")
    with pytest.raises(ConfigError, match=rf"{path}: duplicate key 'run.num_steps' at line 6 "
                                          r"\(first at line 4\)"):
        load_config(path)
    # in a flow mapping, in a list, and spelled differently (1 and 0x1 are the same int key)
    for text, key in [("{a: 1, a: 2}", "a"), ("l:\n  - {x: 1, y: 2, x: 3}\n", "l[0].x"),
                      ("1: a\n0x1: b\n", "0x1")]:
        with pytest.raises(yaml_load.YAMLLoadError,
                           match=rf"f.yaml: duplicate key '{re.escape(key)}'"):
            yaml_load.load(text, "f.yaml")


def test_merge_keys_may_still_be_overridden_and_plain_files_load_as_before():
    text = "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\nl: [1, *b]\n"
    assert yaml_load.load(text, "f") == yaml.safe_load(text)
    assert yaml_load.load(text, "f")["c"] == {"x": 3, "y": 2}
    shipped = (ROOT / "launch" / "configs" / "tiny_cpu.yaml").read_text()
    assert yaml_load.load(shipped, "tiny") == yaml.safe_load(shipped)


def test_an_override_value_is_read_by_the_same_loader():
    with pytest.raises(ConfigError, match=r"--set 'run.seed=\{a: 1, a: 2\}': duplicate key 'a'"):
        config_from_dict({}, ["run.seed={a: 1, a: 2}"])
    with pytest.raises(ConfigError, match=r"--set 'run.seed=.*more than 100000 nodes"):
        config_from_dict({}, ["run.seed=" + bomb().replace("\n", ", ").join("{}")])


BOMB_PROBE = textwrap.dedent("""
    import sys, time, tracemalloc
    from megatron_gspo.config import ConfigError, load_config
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        load_config(sys.argv[1])
        outcome = "accepted"
    except ConfigError as err:
        outcome = str(err)
    elapsed = time.monotonic() - t0
    print(repr((outcome, elapsed, tracemalloc.get_traced_memory()[1])))
""")


def test_an_alias_bomb_is_refused_fast_and_in_bounded_memory(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb() + "run: *i\n")  # 9 ** 9 strings where run's mapping should be
    assert path.stat().st_size < 2048
    # a subprocess: the unfixed loader never returns (and takes gigabytes) - the timeout fails it
    proc = subprocess.run([sys.executable, "-c", BOMB_PROBE, str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome, elapsed, peak = eval(proc.stdout.strip().splitlines()[-1])
    assert elapsed < 1.0, elapsed
    assert peak < 20 << 20, peak  # bytes allocated at the peak, while reading and refusing it
    assert str(path) in outcome and "more than" in outcome and "alias" in outcome, outcome
    assert len(outcome) < 500, outcome[:1000]


def test_recursive_aliases_and_deep_nesting_are_refused_naming_the_file():
    with pytest.raises(yaml_load.YAMLLoadError,
                       match=r"f.yaml: line 1: alias \*x refers to its own"):
        yaml_load.load("a: &x [1, *x]\n", "f.yaml")
    with pytest.raises(yaml_load.YAMLLoadError, match=r"f.yaml: line 1: nested deeper than"):
        yaml_load.load("[" * 3000 + "]" * 3000, "f.yaml")  # PyYAML itself: RecursionError
    # just under the limit is still read
    assert yaml_load.load("a: " + "[" * 60 + "]" * 60, "f")["a"] is not None


def test_no_error_message_formats_an_unbounded_value():
    """A huge value reached through Python (shared sub-lists: 9 ** 7 strings) or a long string is
    shown cut short; the unfixed ``_build`` formatted all of it (tens of MB)."""
    huge = ["lol"] * 9
    for _ in range(6):
        huge = [huge] * 9
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"^run: expected a mapping, got \[\[\[") as err:
        config_from_dict({"run": huge})
    assert len(str(err.value)) <= 300 and time.monotonic() - t0 < 1.0
    long = "x" * 1_000_000
    cases = [({"run": {"seed": long}}, "run.seed: expected an integer"),
             ({"gspo": {"variant": long}}, "gspo.variant: "),
             ({"run": {long: 1}}, "run.'xxx"),
             ({"optim": {"lr": [long] * 1000}}, "optim.lr: expected a number")]
    for data, start in cases:
        with pytest.raises(ConfigError) as err:
            config_from_dict(data)
        assert str(err.value).startswith(start) and len(str(err.value)) < 1000, str(err.value)[:300]
    assert len(yaml_load.shown(list(range(10 ** 6)))) <= yaml_load.MAX_SHOWN
    assert len(yaml_load.shown({i: "y" * 10 ** 5 for i in range(100)})) <= yaml_load.MAX_SHOWN


@pytest.mark.parametrize("text", ["", "\n\n", "# every line a comment\n"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config file {path}: empty"):
        load_config(path)


def test_an_explicitly_empty_mapping_is_every_default(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text("{}\n")
    assert load_config(path) == load_config(None)


def test_a_non_utf8_file_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  seed: 1\n  output_dir: runs/caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"config file {path}: not UTF-8 text \(byte 0xe9 at "
                                          r"offset 37, line 3\)"):
        load_config(path)
    bom = tmp_path / "bom.yaml"  # a UTF-8 byte-order mark is fine
    bom.write_bytes(b"\xef\xbb\xbfrun:\n  seed: 5\n")
    assert load_config(bom).run.seed == 5


def test_json_config_still_loads(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"run": {"seed": 9}}))
    assert load_config(path).run.seed == 9
