"""A fresh clone has nothing beside it: no module, test or script builds a path that climbs out
of the repository (`../sibling`, `Path(__file__).parents[3]`, `ROOT.parent`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("gaaudit", "tests", "scripts", "benchmarks")
# A literal path that starts above its base or passes through a parent (`../x`, `a/../../b`).
CLIMBING_LITERAL = re.compile(r"^\.\.[/\\]\S|[/\\]\.\.[/\\]")


def _height(node: ast.AST, heights: dict[str, int]) -> int | None:
    """How many folders above the file's own folder `node` names (-1: the file itself), or
    None when it is not a path derived from `__file__`."""
    if isinstance(node, ast.Name):
        return -1 if node.id == "__file__" else heights.get(node.id)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("Path", "PurePath") and node.args:
            return _height(node.args[0], heights)
        if isinstance(func, ast.Attribute):
            if func.attr in ("resolve", "absolute"):
                return _height(func.value, heights)
            if func.attr in ("dirname", "abspath", "realpath") and node.args:
                inner = _height(node.args[0], heights)
                return None if inner is None else inner + (func.attr == "dirname")
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _height(node.value, heights)
        return None if inner is None else inner + 1
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "parents"
        and isinstance(node.slice, ast.Constant)
    ):
        inner = _height(node.value.value, heights)
        return None if inner is None else inner + node.slice.value + 1
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        inner = _height(node.left, heights)
        if inner is not None and isinstance(node.right, ast.Constant):
            parts = [p for p in re.split(r"[/\\]", str(node.right.value)) if p not in ("", ".")]
            return inner + sum(1 if p == ".." else -1 for p in parts)
    return None


def climbing_paths(source: str, depth: int) -> list[str]:
    """Where a module `depth` folders below the repository root names a place above it."""
    tree = ast.parse(source)
    heights: dict[str, int] = {}
    found = []
    for node in ast.walk(tree):  # assignments before uses, in the order they are written
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            height = _height(node.value, heights)
            if isinstance(target, ast.Name) and height is not None:
                heights[target.id] = height
    for node in ast.walk(tree):
        height = _height(node, heights) if isinstance(node, ast.expr) else None
        if height is not None and height > depth:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        literal = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if literal and CLIMBING_LITERAL.search(node.value):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


# Public repositories `benchmarks/realworld.py restore` exports (git-ignored): not our code.
RESTORED = ROOT / "benchmarks" / "realworld" / "trees"


def python_files() -> list[Path]:
    return sorted(
        p
        for folder in SCANNED
        for p in (ROOT / folder).rglob("*.py")
        if not p.is_relative_to(RESTORED)
    )


@pytest.mark.parametrize("path", python_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_path_climbs_out_of_the_repository(path):
    depth = len(path.relative_to(ROOT).parts) - 1
    assert climbing_paths(path.read_text(encoding="utf-8"), depth) == []


@pytest.mark.parametrize(
    "source",
    [
        'SHARED = Path(__file__).resolve().parent.parent.parent / "sibling"',
        "ROOT = Path(__file__).parents[1]\nOUT = ROOT.parent",
        'DATA = "../sibling/data/schema.json"',
        'HOME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))\nUP = HOME / ".."',
    ],
)
def test_the_scan_sees_a_path_that_climbs_out(source):
    assert climbing_paths(source, depth=1)  # as written in a module of tests/


def test_the_repository_root_itself_is_inside():
    assert climbing_paths("ROOT = Path(__file__).resolve().parent.parent", depth=1) == []
