"""The package layering, frozen: imports go one way (launch -> pipeline -> megatron_gspo's pure base).

``megatron_gspo`` is the training library and never imports ``pipeline`` or ``launch``; ``pipeline`` is
the RL dataflow and imports only the torch-free / Megatron-free base it needs from the library;
``megatron_gspo.loss`` is pure torch math (no Megatron, no model or training code); ``config/`` is
plain Python. Every import statement of every module is read (module level and inside functions),
so a lazy import inside a function cannot hide a back edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What pipeline/ may import from the training library: the typed config, the pure group-advantage
# math, the variant registry, the trainer's input format, the child-process lifetime helper, the
# error kinds and the cross-rank outcome protocol.
PIPELINE_MAY_IMPORT = (
    "megatron_gspo.collectives",
    "megatron_gspo.config",
    "megatron_gspo.errors",
    "megatron_gspo.loss.advantages",
    "megatron_gspo.loss.variants",
    "megatron_gspo.train.batching",
    "megatron_gspo.lifetime",
)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in ``path``, ``from a import b`` as ``a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path(path.name)
    package = ".".join(rel.with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _modules(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    return files


def _violations(files: list[Path], allowed) -> list[str]:
    bad = []
    for path in files:
        for line, module in _imports(path):
            if not allowed(module):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                bad.append(f"{where}:{line} imports {module}")
    return sorted(set(bad))


def _top(module: str) -> str:
    return module.split(".")[0]


def test_training_library_never_imports_pipeline_or_launch():
    assert _violations(_modules("megatron_gspo"),
                       lambda m: _top(m) not in ("pipeline", "launch")) == []


def test_pipeline_imports_only_the_pure_base_of_the_library():
    def allowed(module: str) -> bool:
        if _top(module) == "launch":
            return False
        if _top(module) != "megatron_gspo" or module == "megatron_gspo":
            return True
        return any(module == a or module.startswith(a + ".") for a in PIPELINE_MAY_IMPORT)

    assert _violations(_modules("pipeline"), allowed) == []


def test_loss_math_is_pure_torch():
    def allowed(module: str) -> bool:
        if _top(module) in ("megatron", "transformer_engine", "apex", "pipeline", "launch"):
            return False
        if _top(module) == "megatron_gspo":
            return module.startswith("megatron_gspo.loss")
        return True

    assert _violations(_modules("megatron_gspo/loss"), allowed) == []


def test_hf_interop_never_imports_the_model():
    """One direction between the library's subpackages: ``model`` uses the HF mapping to load and
    initialise weights; ``hf`` works on a live policy through ``hf.rank_pieces``, not ``model``."""
    assert _violations(_modules("megatron_gspo/hf"),
                       lambda m: not m.startswith("megatron_gspo.model")) == []


def test_bench_never_imports_tests():
    """The benchmarks' helpers (``bench.spawn``, ``bench.hf_tiny``) live in bench/; tests import them."""
    assert _violations(_modules("bench"), lambda m: _top(m) != "tests") == []


def test_config_is_plain_python():
    def allowed(module: str) -> bool:
        if _top(module) in ("torch", "megatron", "pipeline", "launch"):
            return False
        return _top(module) != "megatron_gspo" or module.startswith(
            ("megatron_gspo.errors", "megatron_gspo.loss.variants", "megatron_gspo.config."))

    assert _violations(_modules("megatron_gspo/config"), allowed) == []
    # its YAML loader too: PyYAML and the standard library only
    assert _violations([ROOT / "megatron_gspo" / "config" / "yaml_load.py"],
                       lambda m: _top(m) not in ("torch", "megatron", "megatron_gspo", "pipeline",
                                                 "launch")) == []


def test_errors_and_collectives_are_light():
    """What pipeline/ and the config import of the library's error kinds and collectives: the
    errors are plain Python; the collectives torch.distributed and the errors, no Megatron."""
    assert _violations([ROOT / "megatron_gspo" / "errors.py"],
                       lambda m: _top(m) not in ("torch", "megatron", "megatron_gspo", "pipeline",
                                                 "launch")) == []
    assert _violations([ROOT / "megatron_gspo" / "collectives.py"],
                       lambda m: _top(m) not in ("megatron", "transformer_engine", "pipeline",
                                                 "launch")
                       and (_top(m) != "megatron_gspo" or m.startswith("megatron_gspo.errors"))
                       ) == []


@pytest.mark.parametrize("module,is_allowed", [("pipeline.generation.client", False), ("launch.cli", False),
                                               ("megatron_gspo.config", True)])
def test_checker_reports_a_lazy_back_edge(tmp_path, module, is_allowed):
    """The checker itself: an import inside a function is seen, so the rules cannot pass vacuously."""
    path = tmp_path / "probe.py"
    path.write_text(f"def f():\n    import {module}\n")
    bad = _violations([path], lambda m: _top(m) not in ("pipeline", "launch"))
    assert (bad == []) is is_allowed


def test_public_gspo_import_path_is_kept():
    from megatron_gspo.gspo import group_advantages, gspo_loss, sequence_log_ratio  # noqa: F401
