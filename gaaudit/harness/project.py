"""Modules of the user's project that cannot be imported here (a relative import, a package
under `src/`, one that needs libraries or releases this environment lacks), defined from
their source as far as it is safe: their imports that work, module-level classes, functions
and values that call nothing (nothing else of a module runs: no model or data is loaded).
Their classes, and a name whose import fails and is no module of the project, are what
`stand_in` gives for them: a class may need what the harness cannot give (arguments, process
groups, files) or check what it is handed (a logger that takes floats, not stand-ins)."""

from __future__ import annotations

import ast
import contextlib
import types
from collections.abc import Callable
from pathlib import Path

from gaaudit.discover.modules import locate

StandIn = Callable[[str], object]  # a failing import's bound name -> its stand-in, or None


def defined(
    source: str, filename: str, stand_in: StandIn, modules: dict | None, classes: bool = True
) -> dict:
    """The namespace of `source`'s imports that this environment has (of the project's
    modules, `project_import`, unless `modules` is None; else `stand_in`'s, where it gives
    one) and its module-level functions, values that call nothing (`_plain`) and, with
    `classes`, classes. `modules`: the project's modules defined so far, by path."""
    namespace: dict = {"__name__": "__gaaudit_project__"}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), filename, "exec"), namespace)  # noqa: S102
            except Exception:  # noqa: BLE001 - a missing library: its names stand in
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    found = None
                    if modules is not None:
                        found = project_import(node, alias, filename, stand_in, modules)
                    found = stand_in(bound) if found is None else found
                    if found is not None:
                        namespace[bound] = found
        elif isinstance(node, ast.ClassDef) and not classes:
            if (found := stand_in(node.name)) is not None:
                namespace[node.name] = found
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef)) or _plain(node):
            with contextlib.suppress(Exception):
                exec(compile(ast.Module([node], []), filename, "exec"), namespace)  # noqa: S102
    return namespace


def project_import(
    node: ast.stmt, alias: ast.alias, filename: str, stand_in: StandIn, modules: dict
):
    """What `alias` of the import `node` binds when it names a module of the project, or a
    name of one (`from .helpers import unpack`), with that module `defined`; None when it
    names none."""
    directory = Path(filename).resolve().parent
    level = getattr(node, "level", 0)
    if isinstance(node, ast.Import):
        dotted = alias.name if alias.asname or "." not in alias.name else ""
        path = dotted and locate(directory, 0, dotted, set())
        return _module(path, stand_in, modules) if path else None
    submodule = locate(directory, level, f"{node.module or ''}.{alias.name}", set())
    if submodule:
        return _module(submodule, stand_in, modules)
    path = locate(directory, level, node.module or "", set())
    return getattr(_module(path, stand_in, modules), alias.name, None) if path else None


def _module(path: Path, stand_in: StandIn, modules: dict) -> types.ModuleType:
    """The project's module at `path`, `defined` (once: an import cycle finds it as far as it
    is defined); empty where it is no Python 3."""
    if path not in modules:
        modules[path] = module = types.ModuleType(path.stem)
        text = path.read_text("utf-8", "replace")
        with contextlib.suppress(SyntaxError, ValueError):
            module.__dict__.update(defined(text, str(path), stand_in, modules, classes=False))
    return modules[path]


# what a module-level value may call to be set up here: empty containers (`_counters = dict()`)
CONTAINERS = frozenset({"dict", "list", "set", "tuple", "frozenset"})


def _plain(node: ast.stmt) -> bool:
    """A module-level value that its functions may read and that runs nothing: a literal, an
    empty container, names and their attributes (`_dtype = torch.float32`)."""
    return (
        isinstance(node, ast.Assign)
        and all(
            not isinstance(n, ast.Call)
            or (isinstance(n.func, ast.Name) and n.func.id in CONTAINERS and not n.args)
            for n in ast.walk(node.value)
        )
        and not any(
            isinstance(n, (ast.Lambda, ast.NamedExpr, ast.Await)) for n in ast.walk(node.value)
        )
    )


def constant(node: ast.stmt) -> bool:
    """`IGNORE_INDEX = -100`: a module-level literal a function may read."""
    if not isinstance(node, ast.Assign):
        return False
    try:
        ast.literal_eval(node.value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True
