"""SGLang 0.5.23's HTTP contract, read from its wheel's source with ``ast`` (nothing imported):

* ``routes()``: every path ``srt/entrypoints/http_server.py`` serves -> its HTTP methods;
* ``body_classes()``: path -> the ``io_struct`` request class its handler takes as the body
  (``Annotated[X, Body()]``, or ``Optional[X]``);
* ``fields(cls)``: a request class's fields -> their default as source text (``None`` for a
  required field), inherited ``BaseReq`` fields included.

The conformance tests check every call the client makes against these, so a path, a field name
or a default that differs from the wheel's fails there, not on a GPU cluster.
"""

from __future__ import annotations

import ast
import functools

from tests.sglang_wheel import read_member

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"


@functools.lru_cache(maxsize=None)
def _tree(member: str) -> ast.Module:
    return ast.parse(read_member(member).decode())


def _route_of(decorator: ast.expr) -> tuple[str, set[str]] | None:
    """(path, methods) of an ``@app.get/post/api_route(...)`` decorator, else None."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"
            and decorator.args and isinstance(decorator.args[0], ast.Constant)):
        return None
    kind, path = decorator.func.attr, decorator.args[0].value
    if kind in ("get", "post", "put", "delete"):
        return path, {kind.upper()}
    if kind == "api_route":
        for kw in decorator.keywords:
            if kw.arg == "methods":
                return path, {ast.literal_eval(e) for e in kw.value.elts}
        return path, {"GET"}
    return None


def _handlers():
    for node in _tree(HTTP_SERVER).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                route = _route_of(dec)
                if route is not None:
                    yield route[0], route[1], node


@functools.lru_cache(maxsize=None)
def routes() -> dict[str, frozenset[str]]:
    out: dict[str, set[str]] = {}
    for path, methods, _ in _handlers():
        out.setdefault(path, set()).update(methods)
    return {p: frozenset(m) for p, m in out.items()}


def _body_class(annotation: ast.expr) -> str | None:
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        if annotation.value.id in ("Annotated", "Optional"):
            inner = annotation.slice.elts[0] if isinstance(annotation.slice, ast.Tuple) \
                else annotation.slice
            return _body_class(inner)
    if isinstance(annotation, ast.Name) and annotation.id.endswith(("ReqInput", "Req")):
        return annotation.id
    return None


@functools.lru_cache(maxsize=None)
def body_classes() -> dict[str, str]:
    out = {}
    for path, _, fn in _handlers():
        for arg in fn.args.args:
            cls = _body_class(arg.annotation) if arg.annotation is not None else None
            if cls is not None:
                out[path] = cls
    return out


@functools.lru_cache(maxsize=None)
def fields(cls: str) -> dict[str, str | None]:
    """Field -> default (source text), base classes first; ``None``: no default (required)."""
    classes = {n.name: n for n in _tree(IO_STRUCT).body if isinstance(n, ast.ClassDef)}
    node = classes[cls]
    out: dict[str, str | None] = {}
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(fields(base.id))
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out[stmt.target.id] = None if stmt.value is None else ast.unparse(stmt.value)
    return out
