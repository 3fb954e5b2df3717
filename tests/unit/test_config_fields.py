"""No validated field is unread: every field of every ``Config`` section is read by the program.

A field that is validated but never read silently does nothing (``optim.warmup_steps`` once was
such a field: a cosine schedule trained at a constant rate). The check is syntactic and
deliberately simple: a field counts as read when its name appears as an attribute READ
(``x.field``, or ``getattr(x, "field")``) in a module of ``megatron_gspo/``, ``pipeline/`` or
``launch/`` outside the config package; inside ``megatron_gspo/config/`` only reads in the
derived-value helpers
count (``clip_range``, ``padded_vocab_size``, ...: not the validation, not the loader), and only
when the program itself calls that helper. A helper that reads a field by a computed name
(``getattr(self, low)``: ``clip_range`` takes each variant's range fields from the variant
registry) reads the field names the registry declares: the string constants of its
``eps_fields=`` entries and of its module-level ``*_RANGE`` tuples (that ``clip_range`` returns
exactly those fields' values, per variant, is tested in test_config.py).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron_gspo.config import Config

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_gspo", "pipeline", "launch")
CONFIG = ROOT / "megatron_gspo" / "config"
REGISTRY = ROOT / "megatron_gspo" / "loss" / "variants.py"
# config-package functions that only check, load or print values: reads there do not count
NOT_A_USE = {"__post_init__", "require", "_to_plain", "_type_name", "_coerce", "_build",
             "apply_override", "config_from_dict", "load_config", "dump_config", "to_dict"}


def config_fields() -> list[tuple[str, str]]:
    """(section, field) of every field, nested sections' too (``rollout.weight_sync``, ``dir``)."""
    out = []

    def walk(path: str, section) -> None:
        for f in dataclasses.fields(section):
            out.append((path, f.name))
            value = getattr(section, f.name)
            if dataclasses.is_dataclass(value):
                walk(f"{path}.{f.name}", value)

    for section in dataclasses.fields(Config):
        walk(section.name, section.default_factory())
    return out


def attribute_reads(tree: ast.AST) -> set[str]:
    """Names read as attributes in ``tree``: ``x.name`` (load) and ``getattr(x, "name"[, d])``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "getattr" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def registry_field_names(tree: ast.AST) -> set[str]:
    """String constants the variant registry declares as field names: ``eps_fields=(...)``
    keywords (dotted ``section.field``: every part) and module-level ``NAME_RANGE = (...)``
    tuples, and the first argument (the variant's name) of a call with a ``params=`` keyword."""
    names = set()
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.keyword) and node.arg == "eps_fields":
            value = node.value
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and node.targets[0].id.endswith("_RANGE")):
            value = node.value
        elif (isinstance(node, ast.Call) and any(k.arg == "params" for k in node.keywords)
              and node.args and isinstance(node.args[0], ast.Constant)):
            value = ast.Tuple(elts=[node.args[0]])
        if isinstance(value, ast.Tuple):
            names.update(part for e in value.elts
                         if isinstance(e, ast.Constant) and isinstance(e.value, str)
                         for part in e.value.split("."))
    return names


def reads_by_computed_name(tree: ast.AST) -> bool:
    """Whether ``tree`` calls ``getattr(x, <not a constant>)``."""
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
               and node.func.id == "getattr" and len(node.args) >= 2
               and not isinstance(node.args[1], ast.Constant) for node in ast.walk(tree))


def called_names(tree: ast.AST) -> set[str]:
    """Names of what is called or imported in ``tree`` (``f(...)``, ``x.f(...)``, ``from m import f``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute):
                names.add(func.attr)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


def unread_fields(program: list[ast.AST], config_tree: ast.AST,
                  fields: list[tuple[str, str]], registry: set[str] = frozenset()) -> list[str]:
    read, called = set(), set()
    for tree in program:
        read |= attribute_reads(tree)
        called |= called_names(tree)
    for node in ast.walk(config_tree):
        if (isinstance(node, ast.FunctionDef) and node.name not in NOT_A_USE
                and not node.name.startswith("validate_") and node.name in called):
            read |= attribute_reads(node)
            if reads_by_computed_name(node):
                read |= registry
    return [f"{section}.{name}" for section, name in fields if name not in read]


def program_trees() -> list[ast.AST]:
    trees = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if CONFIG not in path.parents:
                trees.append(ast.parse(path.read_text(), filename=str(path)))
    assert len(trees) > 20, "the program's modules were not found"
    return trees


def config_tree() -> ast.Module:
    """Every module of the config package as one tree."""
    modules = sorted(CONFIG.glob("*.py"))
    assert len(modules) > 5, "the config package's modules were not found"
    return ast.Module(body=[node for path in modules
                            for node in ast.parse(path.read_text(), filename=str(path)).body],
                      type_ignores=[])


def test_every_config_field_is_read_outside_the_config_package():
    registry = registry_field_names(ast.parse(REGISTRY.read_text()))
    assert {"eps_low", "token_eps_low", "cispo", "gmpo", "sapo"} <= registry
    missing = unread_fields(program_trees(), config_tree(), config_fields(), registry)
    assert missing == [], (f"validated but never read (they would do nothing): {missing}; use "
                           "them, or delete them")


def test_the_checker_sees_an_unread_field_and_the_ways_of_reading_one():
    """The checker itself: it must be able to fail, and to see reads through helpers."""
    fields = [("optim", "warmup_steps"), ("optim", "lr"), ("gspo", "token_eps_low"),
              ("run", "seed"), ("run", "num_steps")]
    config_tree = ast.parse(
        "class G:\n"
        "    def __post_init__(self):\n        assert self.num_steps > 0\n"
        "    def clip_range(self):\n        return self.token_eps_low\n"
        "def validate_x(o):\n    return o.warmup_steps\n")
    program = [ast.parse("def f(cfg):\n    cfg.run.seed = 3\n    return cfg.optim.lr\n"),
               ast.parse("def g(cfg):\n    return cfg.gspo.clip_range()\n")]
    # warmup_steps: only validated; seed: only assigned; num_steps: only in __post_init__
    assert unread_fields(program, config_tree, fields) == ["optim.warmup_steps", "run.seed",
                                                           "run.num_steps"]
    program.append(ast.parse("def h(o):\n    return getattr(o, 'seed') + o.num_steps + o.warmup_steps\n"))
    assert unread_fields(program, config_tree, fields) == []
    # a helper nobody calls does not make its fields read
    assert "gspo.token_eps_low" in unread_fields(program[:1], config_tree, fields)


def test_a_registry_named_field_counts_only_through_a_called_helper_reading_by_name():
    fields = [("gspo", "cispo_eps_low"), ("gspo", "eps_low")]
    registry = registry_field_names(ast.parse(
        "SEQUENCE_RANGE = ('eps_low', 'eps_high')\n"
        "SPECS = [Spec('cispo', eps_fields=('cispo_eps_low', 'cispo_eps_high'))]\n"))
    assert registry == {"eps_low", "eps_high", "cispo_eps_low", "cispo_eps_high"}
    by_name = ast.parse("class G:\n    def clip_range(self):\n        low = pick()\n"
                        "        return getattr(self, low)\n")
    by_constant = ast.parse("class G:\n    def clip_range(self):\n"
                            "        return getattr(self, 'eps_low')\n")
    caller = [ast.parse("def g(cfg):\n    return cfg.gspo.clip_range()\n")]
    assert unread_fields(caller, by_name, fields, registry) == []
    assert unread_fields(caller, by_constant, fields, registry) == ["gspo.cispo_eps_low"]
    assert unread_fields([ast.parse("x = 1\n")], by_name, fields, registry) == [
        "gspo.cispo_eps_low", "gspo.eps_low"]
