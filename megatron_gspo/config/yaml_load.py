"""Reading a YAML configuration: PyYAML's safe loader, with the checks a configuration needs.

``load(text, source)`` parses one YAML document like ``yaml.safe_load`` (the same tags, anchors,
aliases and merge keys) and refuses, with :class:`YAMLLoadError` naming ``source`` (the file, or
the ``--set`` item) and the line:

* a key given twice in one mapping, at any depth (PyYAML keeps the last silently): the message
  names the key's path (``run.num_steps``) and both lines. Keys brought in by a merge (``<<:``)
  may still be overridden, as YAML intends;
* a document that expands beyond :data:`MAX_NODES` nodes, every use of an alias counted as the
  whole subtree it stands for: an "alias bomb" (a few KB of nested aliases standing for billions
  of nodes) is refused while it is read, before anything walks, copies or prints its data;
* an alias inside its own anchor (a recursive structure), and nesting deeper than
  :data:`MAX_DEPTH` (PyYAML recurses once per level).

``shown(value)`` is a bounded ``repr`` for error messages: a message never formats more than
:data:`MAX_SHOWN` characters of the input.

The counting happens while the document is composed (``compose_node``): each new node counts 1,
each alias the expanded size of its anchor's node, known by then. So the work is linear in the
file's length whatever the aliases stand for.
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml

MAX_NODES = 100_000
"""Nodes one document may stand for, aliases expanded (a large recipe has a few hundred)."""
MAX_DEPTH = 64
"""Nesting levels of one document (a configuration has 3: section, key, list)."""
MAX_SHOWN = 200
"""Characters of an input value an error message shows at most."""

_MERGE_TAG = "tag:yaml.org,2002:merge"

_repr = reprlib.Repr()
_repr.maxlevel = 3
_repr.maxdict = _repr.maxlist = _repr.maxtuple = _repr.maxset = 8
_repr.maxstring = _repr.maxother = MAX_SHOWN


def shown(value: Any) -> str:
    """``repr(value)`` bounded to :data:`MAX_SHOWN` characters (nested containers elided), in
    time and memory independent of the value's size."""
    text = _repr.repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


class YAMLLoadError(yaml.YAMLError):
    """A YAML document refused by :func:`load`; the message names the source and the line."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` plus the duplicate-key, size and depth checks (module docstring)."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self._expanded = 0  # nodes composed so far, aliases expanded
        self._sizes: dict[int, int] = {}  # id(node) -> its expanded size, once complete
        self._keys: list[str] = []  # the key path of the node being composed

    def _where(self, mark) -> str:
        return f"{self.source}: line {mark.line + 1}" if mark is not None else self.source

    def _count(self, n: int, mark) -> None:
        self._expanded += n
        if self._expanded > MAX_NODES:
            raise YAMLLoadError(
                f"{self._where(mark)}: the document expands to more than {MAX_NODES} nodes "
                "(aliases counted at every use); refusing it (an alias bomb?)")

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:
                size = self._sizes.get(id(node))
                if size is None:
                    raise YAMLLoadError(f"{self._where(event.start_mark)}: alias *{event.anchor} "
                                        "refers to its own anchor (a recursive structure)")
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)  # unknown anchors: PyYAML's error
        mark = self.peek_event().start_mark
        if len(self._keys) >= MAX_DEPTH:
            raise YAMLLoadError(f"{self._where(mark)}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(index, yaml.ScalarNode):
            self._keys.append(str(index.value))
        elif index is not None and isinstance(parent, yaml.SequenceNode):
            self._keys.append(f"[{index}]")
        else:
            self._keys.append("?")  # the root, or a mapping key
        start = self._expanded
        self._count(1, mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._keys.pop()
        self._sizes[id(node)] = self._expanded - start
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        first: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # merged keys may be overridden; complex keys: not in a configuration
            key = self.construct_object(key_node)
            try:
                earlier = first.setdefault(key, key_node)
            except TypeError:  # unhashable: PyYAML's own error when constructed
                continue
            if earlier is not key_node:
                path = _dotted([*self._keys[1:], str(key_node.value)])
                line, first_line = key_node.start_mark.line + 1, earlier.start_mark.line + 1
                raise YAMLLoadError(
                    f"{self.source}: duplicate key {shown(path)} at line {line} (first at line "
                    f"{first_line}); YAML would keep only the last, so remove one")
        return node


def _dotted(keys: list[str]) -> str:
    """``run.num_steps``, ``data.files[2].path``: a key path as the configuration names it."""
    out = ""
    for key in keys:
        if key == "?":
            continue
        out += key if key.startswith("[") or not out else f".{key}"
    return out


def load(text: str, source: str) -> Any:
    """The data of the single YAML document ``text`` (as ``yaml.safe_load``), checked as the
    module docstring says; ``source`` names it in errors (a path, or ``--set a.b=v``)."""
    loader = _Loader(text, source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
