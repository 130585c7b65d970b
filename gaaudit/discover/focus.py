"""Which parts of a file can matter: blank the rest before libcst sees it.

libcst parses about ten times slower than CPython's own parser. A file that passed the
byte prefilter is first read with `ast`; functions, classes and methods (of classes at any
depth) that hold nothing that matters (`screen.py` decides; a trigger's bytes, for the loss
helpers of other modules), and that nothing kept refers to, become blank lines. Line and
column numbers are unchanged, so findings on the focused source point at the real file.
"""

from __future__ import annotations

import ast
from functools import cache

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
ALWAYS_KEPT = {"__init__", "__post_init__", "setup", "setUp"}  # where `self.loss_fn = ...` lives


def focus(data: bytes, triggers: tuple[bytes, ...]) -> bytes:
    """`data` with the definitions holding none of `triggers` blanked; `data` itself if
    `ast` fails."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return data  # libcst reports the problem with its position
    lines = data.splitlines(keepends=True)
    return blank(data, lines, tree, units(tree), lambda unit: has_trigger(lines, unit, triggers))


def blank(data: bytes, lines: list[bytes], tree: ast.Module, found: dict, matters) -> bytes:
    """`data` (split into `lines`, ends kept) with the `found` units (see `units`) for which
    `matters` is false blanked, unless something kept refers to them by name."""
    kept = {unit for unit in found if matters(unit)}
    top_level = _names(n for n in tree.body if not isinstance(n, DEFINITIONS))
    names_of = cache(_own_names)  # each unit walked once
    while True:
        kept = _with_owners(kept, found)  # a kept method keeps its classes
        kept |= {u for u, owner in found.items() if owner in kept and u.name in ALWAYS_KEPT}
        kept |= with_members({u for u in kept if _hollow(u, kept)}, found)
        wanted = top_level.union(*map(names_of, kept))
        revived = {u for u in found if u not in kept and u.name in wanted}
        revived = with_members(revived, found)  # a named class, whole
        if not revived:
            break
        kept |= revived
    blanked: set[int] = set()
    for unit in found:
        if unit not in kept:
            start, end = _span(unit)
            blanked.update(range(max(start, 3), end + 1))  # lines 1-2 may hold an encoding cookie
    if not blanked:
        return data
    return b"".join(
        _blank(line) if number in blanked else line for number, line in enumerate(lines, 1)
    )


def units(tree: ast.Module) -> dict[Definition, ast.ClassDef | None]:
    """Top-level functions and classes, and the methods and classes of classes at any depth,
    with the class holding them."""
    found: dict[Definition, ast.ClassDef | None] = {}
    pending: list[tuple[ast.AST, ast.ClassDef | None]] = [(tree, None)]
    while pending:
        holder, owner = pending.pop()
        for node in holder.body:
            if isinstance(node, DEFINITIONS):
                found[node] = owner
            if isinstance(node, ast.ClassDef):
                pending.append((node, node))
    return found


def _with_owners(kept: set, found: dict) -> set:
    """`kept` and every class holding one of them."""
    closed, pending = set(kept), list(kept)
    while pending:
        owner = found[pending.pop()]
        if owner is not None and owner not in closed:
            closed.add(owner)
            pending.append(owner)
    return closed


def with_members(revived: set, found: dict) -> set:
    """`revived` and every definition inside one of them."""
    closed = set(revived)
    changed = True
    while changed:
        members = {u for u, owner in found.items() if owner in closed} - closed
        closed |= members
        changed = bool(members)
    return closed


def _hollow(unit: Definition, kept: set) -> bool:
    """A kept class whose body would be blank (all its members blanked): not Python, so it is
    kept whole."""
    return isinstance(unit, ast.ClassDef) and not any(
        n in kept or not isinstance(n, DEFINITIONS) for n in unit.body
    )


def _span(node: Definition) -> tuple[int, int]:
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return start, node.end_lineno or node.lineno


def has_trigger(lines: list[bytes], node: Definition, triggers: tuple[bytes, ...]) -> bool:
    start, end = _span(node)
    text = b"".join(lines[start - 1 : end])
    return any(trigger in text for trigger in triggers)


def _own_names(unit: Definition) -> set[str]:
    """Names a function mentions; for a class, those outside its methods (judged on their own)."""
    if isinstance(unit, ast.ClassDef):
        return _names(
            [*unit.bases, *unit.keywords, *(n for n in unit.body if not isinstance(n, DEFINITIONS))]
        )
    return _names([unit])


def _names(nodes) -> set[str]:
    """The names some nodes mention, and the attributes they call (`self.helper()`): the
    only references by which the analysis finds a definition of the file. An attribute
    only read (`self.args`) names no definition it follows."""
    found: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found.add(sub.id)
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute):
                found.add(sub.func.attr)
    return found


def _blank(line: bytes) -> bytes:
    """An empty line with the original line ending."""
    return line[len(line.rstrip(b"\r\n")) :]
