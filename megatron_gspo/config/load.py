"""Loading a configuration: YAML (:mod:`megatron_gspo.config.yaml_load`), ``--set a.b=value``
overrides, and the typed build of :class:`~megatron_gspo.config.root.Config` from the mapping.

:func:`_build` makes one section from its mapping: unknown keys are refused with the valid ones,
a section's ``MOVED_KEYS`` (old key -> its key now) and ``FORMER_SCALAR`` (the field a plain value
used to set) name the new spelling, and :func:`_coerce` checks each value against its field's
annotation. Every error is a :class:`~megatron_gspo.config.checks.ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from megatron_gspo.config.checks import ConfigError, require
from megatron_gspo.config.root import Config, yaml_key
from megatron_gspo.config.yaml_load import MAX_SHOWN, YAMLLoadError, shown
from megatron_gspo.config.yaml_load import load as load_yaml


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:
            value = "off"  # YAML 1.1 reads a bare off as false
        require(isinstance(value, str) == all(isinstance(a, str) for a in allowed)
                and value in allowed, f"{path}: {shown(value)} is not one of {list(allowed)}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            require(type(None) in options, f"{path}: must not be null")
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {shown(value)} does not match {tp}")
    if origin in (list, tuple):
        require(isinstance(value, (list, tuple)), f"{path}: expected a list, got {shown(value)}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        require(isinstance(value, bool), f"{path}: expected true or false, got {shown(value)}")
        return value
    if tp is int:
        require(isinstance(value, int) and not isinstance(value, bool),
                f"{path}: expected an integer, got {shown(value)}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:  # YAML 1.1 reads "3e-4" as a string
                value = float(value)
            except ValueError:
                pass
        require(isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{path}: expected a number, got {shown(value)}")
        # no field means anything by inf or nan (YAML's .inf / .nan); they would pass the range
        # checks below or turn every loss into nan much later
        require(math.isfinite(value), f"{path}: must be a finite number, got {shown(value)}")
        return float(value)
    if tp is str:
        require(isinstance(value, str), f"{path}: expected a string, got {shown(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _key(key: Any) -> str:
    """A key of the input as an error message shows it (bounded, as every input value)."""
    return key if isinstance(key, str) and len(key) <= MAX_SHOWN else shown(key)


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    prefix = f"{path}." if path else ""
    former = getattr(cls, "FORMER_SCALAR", None)
    require(isinstance(data, dict) or former is None or isinstance(data, (list, tuple)),
            f"{path}: {shown(data)} is a plain value, but {path} is a section now; write "
            f"{path}.{former}: {shown(data)}")
    require(isinstance(data, dict), f"{path or 'config'}: expected a mapping, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    names = {yaml_key(cls, f.name): f.name for f in dataclasses.fields(cls)}
    moved = [k for k in data if k in getattr(cls, "MOVED_KEYS", {})]
    if moved:  # ``MOVED_KEYS``: old key -> its new place, dotted, within the same section
        raise ConfigError("; ".join(f"{prefix}{k}: moved; write {prefix}{cls.MOVED_KEYS[k]}"
                                    for k in moved))
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError("; ".join(
            f"{prefix}{_key(k)}: unknown key (valid keys: {', '.join(sorted(names))})"
            for k in unknown))
    kwargs = {names[k]: _coerce(v, hints[names[k]], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as err:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"{path}: {err}") from err


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b=value`` override to the raw mapping (value parsed as YAML)."""
    if "=" not in override:
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"--set {override!r}: expected section.key=value")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {override!r}: {key} is not a section")
    try:
        node[keys[-1]] = load_yaml(raw, f"--set {override!r}") if raw.strip() else ""
    except YAMLLoadError as err:
        raise ConfigError(str(err)) from None
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--set {override!r}: the value is not valid YAML ({problem}); quote it "
                          "to pass a string") from None


def config_from_dict(data: dict, overrides: Optional[list[str]] = None) -> Config:
    data = dict(data or {})
    for override in overrides or []:
        apply_override(data, override)
    return _build(Config, data, "")


def load_config(path: str | Path | None, overrides: Optional[list[str]] = None) -> Config:
    """Load a YAML file (or only defaults when ``path`` is None) and apply ``a.b=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = raw[:err.start].count(b"\n") + 1
            raise ConfigError(f"config file {path}: not UTF-8 text (byte 0x{raw[err.start]:02x} at "
                              f"offset {err.start}, line {line}); save it as UTF-8") from None
        try:
            data = load_yaml(text, f"config file {path}")
        except YAMLLoadError as err:
            raise ConfigError(str(err)) from None
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path}: not valid YAML: {err}") from None
        if data is None:
            raise ConfigError(f"config file {path}: empty (no sections); write the sections to "
                              "set, or {} for every default")
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping of sections")
    try:
        return config_from_dict(data, overrides)
    except ConfigError as err:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}{err}") from None


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
