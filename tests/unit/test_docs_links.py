"""Every document the repository mentions is in the repository; nothing points outside it.

Scans the sources, scripts, configs and docs of the checkout (not .git, virtual environments or
run outputs) for

* ``docs/<path>.md`` (and ``docs/<path>.png``) references: each must be a file under ``docs/``;
* Markdown links ``[text](target)`` in ``.md`` files: a relative target must exist relative to
  the file (anchors and URLs aside);
* any other ``<name>.md`` mention (not a quoted string literal, which names a file a program
  writes): some file of that name must exist in the repository;
* the development machines' reference folder beside the checkout (``../shared``, ``shared/docs``,
  ``shared/scripts``): never, since a fresh clone does not have it.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED_SUFFIXES = {".py", ".md", ".sh", ".toml", ".sbatch", ".yaml", ".yml", ".cfg", ".txt", ".ini"}
SCANNED_NAMES = {"Dockerfile", "run"}  # slurm/Dockerfile, .ci/run
SKIPPED_DIRS = {".git", ".venv", ".venv312", "venv", "node_modules", "__pycache__", "runs", "build", "dist",
                ".pytest_cache", ".mypy_cache"}

_SHARED = "shared"  # spelled apart so that this file does not match its own patterns
OUTSIDE = re.compile(rf"\.\./{_SHARED}\b|\b{_SHARED}/(docs|scripts|seeds|hooks)/")
DOC_PATH = re.compile(r"(?<![\w./-])docs/([\w./-]+?\.(?:md|png))\b")
MD_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
MD_NAME = re.compile(r"(?<![\w./'\"-])([\w-]+\.md)\b(?!['\"])")


@functools.cache
def repository_files() -> tuple[Path, ...]:
    files = []
    for directory, subdirs, names in os.walk(ROOT):
        # any virtual environment (.venv-vllm, .venv-bridge, ...) is someone else's files
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                            and not (Path(directory) / d / "pyvenv.cfg").exists())
        for name in sorted(names):
            path = Path(directory) / name
            if path.suffix in SCANNED_SUFFIXES or name in SCANNED_NAMES:
                files.append(path)
    return tuple(files)


@functools.cache
def file_names() -> frozenset[str]:
    return frozenset(path.name for path in repository_files())


def references(path: Path) -> list[tuple[int, str, str]]:
    """``(line, kind, text)`` of every document reference in ``path`` that does not resolve."""
    text = path.read_text(errors="replace")
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in OUTSIDE.finditer(line):
            problems.append((number, "points outside the repository", match.group(0)))
        for match in DOC_PATH.finditer(line):
            if not (ROOT / "docs" / match.group(1)).is_file():
                problems.append((number, "no such file", f"docs/{match.group(1)}"))
        if path.suffix == ".md":
            for match in MD_LINK.finditer(line):
                target = match.group(1).split("#")[0]
                if not target or re.match(r"^[a-z]+:", target):
                    continue
                if not (path.parent / target).exists():
                    problems.append((number, "broken link", match.group(1)))
        for match in MD_NAME.finditer(line):
            if match.group(1) not in file_names():
                problems.append((number, "no file of that name", match.group(1)))
    return problems


def test_every_document_reference_resolves_inside_the_repository():
    files = repository_files()
    assert ROOT / "README.md" in files and (ROOT / "docs" / "gspo_math.md") in files
    problems = [f"{path.relative_to(ROOT)}:{line}: {kind}: {text}"
                for path in files if path != Path(__file__).resolve()
                for line, kind, text in references(path)]
    assert problems == [], "document references that do not resolve:\n" + "\n".join(problems)


def test_the_checker_finds_what_it_must(tmp_path):
    """The patterns above catch each kind of bad reference (so the scan cannot pass vacuously)."""
    bad = tmp_path / "bad.md"
    bad.write_text(f"see ../{_SHARED}/docs/x.md and docs/no_such_doc.md, [a](missing.md), "
                   f"megatron_nowhere.md; fine: docs/gspo_math.md, README.md, [b](#anchor), "
                   f"[c](https://example.org/x.md), 'written_by_a_bench.md'\n")
    found = {(kind, text) for _, kind, text in references(bad)}
    assert ("points outside the repository", f"../{_SHARED}") in found
    assert ("no such file", "docs/no_such_doc.md") in found
    assert ("broken link", "missing.md") in found
    assert ("no file of that name", "megatron_nowhere.md") in found
    assert not any("gspo_math" in text or text == "README.md" or "anchor" in text or "example" in text
                   or "bench" in text for _, text in found), found
