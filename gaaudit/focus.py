"""Which parts of a file can matter: blank the rest before libcst sees it.

libcst parses about ten times slower than CPython's own parser. A file that passed the
byte prefilter is first read with `ast`; functions, classes and methods that hold no
trigger, and that nothing kept refers to, become blank lines. Line and column numbers
are unchanged, so findings on the focused source point at the real file.
"""

from __future__ import annotations

import ast

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
ALWAYS_KEPT = {"__init__", "__post_init__", "setup", "setUp"}  # where `self.loss_fn = ...` lives


def focus(data: bytes, triggers: tuple[bytes, ...]) -> bytes:
    """`data` with irrelevant definitions blanked; `data` itself if `ast` fails."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return data  # libcst reports the problem with its position
    lines = data.splitlines(keepends=True)
    units = _units(tree)
    kept = {unit for unit in units if _has_trigger(lines, unit, triggers)}
    top_level = _names(n for n in tree.body if not isinstance(n, DEFINITIONS))
    while True:
        kept |= {units[u] for u in kept if units[u] is not None}  # a kept method keeps its class
        kept |= {u for u, owner in units.items() if owner in kept and u.name in ALWAYS_KEPT}
        wanted = top_level.union(*(_own_names(unit) for unit in kept))
        revived = {u for u in units if u not in kept and u.name in wanted}
        revived |= {u for u, owner in units.items() if owner in revived}  # a named class, whole
        if not revived:
            break
        kept |= revived
    blank: set[int] = set()
    for unit in units:
        if unit not in kept:
            start, end = _span(unit)
            blank.update(range(max(start, 3), end + 1))  # lines 1-2 may hold an encoding cookie
    if not blank:
        return data
    return b"".join(
        _blank(line) if number in blank else line for number, line in enumerate(lines, 1)
    )


def _units(tree: ast.Module) -> dict[Definition, ast.ClassDef | None]:
    """Top-level functions and classes, and the methods of top-level classes, with their class."""
    units: dict[Definition, ast.ClassDef | None] = {}
    for node in tree.body:
        if isinstance(node, DEFINITIONS):
            units[node] = None
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, DEFINITIONS):
                    units[member] = node
    return units


def _span(node: Definition) -> tuple[int, int]:
    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return start, node.end_lineno or node.lineno


def _has_trigger(lines: list[bytes], node: Definition, triggers: tuple[bytes, ...]) -> bool:
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
    """Every name and attribute some nodes mention."""
    found: set[str] = set()
    for node in nodes:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                found.add(sub.attr)
    return found


def _blank(line: bytes) -> bytes:
    """An empty line with the original line ending."""
    return line[len(line.rstrip(b"\r\n")) :]
