"""Source ranges of libcst nodes, computed for the statements asked, not the whole module.

libcst's `PositionProvider` generates the code of the whole module to learn where each
node lies; a run needs the positions of a handful of nodes. Here the innermost statement
line (a `SimpleStatementLine`) or compound statement holding a node is generated alone:
it starts at column 0 of its line, so the columns of the code generated are the file's,
and CPython's `ast` says which line that is. Only the header of a compound statement is
generated when the node lies there (`def f(...)`, `for x in y`). The ranges are those
`PositionProvider` gives (tests/test_positions.py compares every node); where the bytes
are missing or `ast` cannot read them, `PositionProvider` runs over the module.
"""

from __future__ import annotations

import ast
import re
import warnings
from functools import cache

import libcst as cst
from libcst._nodes.internal import CodegenState

# A node's range: 1-based line, 0-based column (in characters), end line, end column.
Range = tuple[int, int, int, int]

NEWLINE = re.compile(r"\r\n?|\n")
UNITS = (cst.SimpleStatementLine, cst.BaseCompoundStatement)
# Compound statements whose header can be generated without its body (the body emptied).
HEADED = (cst.FunctionDef, cst.ClassDef, cst.If, cst.For, cst.While, cst.With)
# The fields that hold statements (or the suites and clauses holding them), in both trees.
HOLDING = ("body", "handlers", "orelse", "finalbody", "cases")
EMPTY_BODY = cst.IndentedBlock(body=[])


class _Tracker(CodegenState):
    """A code generation state that keeps no code, only each node's range.

    The ranges follow `PositionProvider`: the syntactic range a node's code generation
    records (leading comments and trailing whitespace excluded), else the range of all the
    code the node generated. Lines count from `line`; columns from 0 at the start.
    """

    def __init__(self, module: cst.Module, indents: list[str], line: int) -> None:
        super().__init__(
            default_indent=module.default_indent,
            default_newline=module.default_newline,
            indent_tokens=indents,
        )
        self.line, self.column = line, 0
        self.ranges: dict[cst.CSTNode, Range] = {}
        self.starts: list[tuple[int, int]] = []

    def add_token(self, value: str) -> None:
        if "\n" in value or "\r" in value:
            pieces = NEWLINE.split(value)
            self.line += len(pieces) - 1
            self.column = len(pieces[-1])
        else:
            self.column += len(value)

    def add_indent_tokens(self) -> None:
        for indent in self.indent_tokens:  # whitespace, never a line break
            self.column += len(indent)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self.starts.append((self.line, self.column))

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self.starts.pop()
        if node not in self.ranges:
            self.ranges[node] = (*start, self.line, self.column)

    def record_syntactic_position(self, node, *, start_node=None, end_node=None) -> _Syntactic:
        return _Syntactic(self, node, start_node, end_node)


class _Syntactic:
    """Records the range of the code generated inside it (or of `start_node`/`end_node`)."""

    __slots__ = ("end_node", "node", "start", "start_node", "state")

    def __init__(self, state: _Tracker, node, start_node, end_node) -> None:
        self.state, self.node = state, node
        self.start_node, self.end_node = start_node, end_node

    def __enter__(self) -> None:
        self.start = (self.state.line, self.state.column)

    def __exit__(self, *_) -> None:
        state = self.state
        start = self.start if self.start_node is None else state.ranges[self.start_node][:2]
        end = (
            (state.line, state.column) if self.end_node is None else state.ranges[self.end_node][2:]
        )
        state.ranges[self.node] = (*start, *end)


class Positions:
    """Node -> `Range` for one module, each statement's nodes computed when first asked."""

    def __init__(self, module: cst.Module, parents: dict, source: bytes | None) -> None:
        """`parents`: each node of `module` -> its parent; `source`: the exact bytes libcst
        parsed into `module`, if known."""
        self.module, self.source, self._parents = module, source, parents
        self._ranges: dict[cst.CSTNode, Range] = {}
        self._lines: dict[cst.CSTNode, int] | None = None  # statement -> its first line
        self._whole = None  # PositionProvider's answer, once needed

    def __getitem__(self, node: cst.CSTNode) -> Range:
        found = self._ranges.get(node)
        if found is None:
            unit, header = self._unit(node)
            if unit is not None and self._generate(unit, header):
                found = self._ranges.get(node)
            if found is None:
                found = self._from_whole_module(node)
        return found

    def _unit(self, node: cst.CSTNode) -> tuple[cst.CSTNode | None, bool]:
        """The innermost statement line or compound statement holding `node`, and whether
        `node` lies in its header (before its body)."""
        below = None
        current = node
        while not isinstance(current, UNITS):
            below = current
            current = self._parents.get(current)
            if current is None:  # the module, its leading or trailing comments
                return None, False
        if not isinstance(current, HEADED) or below is None:
            return current, False
        return current, below is not current.body and below is not getattr(current, "orelse", None)

    def _generate(self, unit: cst.CSTNode, header: bool) -> bool:
        """Record the ranges of `unit`'s nodes (its header's only, if `header`); False when
        the line it starts on is unknown."""
        lines = self._statement_lines()
        first = unit.body[0] if isinstance(unit, cst.SimpleStatementLine) else unit
        line = lines.get(first) if lines is not None else None
        if line is None:
            return False
        generated = unit
        if header:  # the same header over an empty body: its nodes are the unit's own
            emptied = {"body": EMPTY_BODY}
            if getattr(unit, "orelse", None) is not None:
                emptied["orelse"] = None
            generated = unit.with_changes(**emptied)
        state = _Tracker(self.module, self._indents(unit), 0)
        generated._codegen(state)
        shift = line - state.ranges[generated][0]
        known = self._parents
        for node, (start, column, end, end_column) in state.ranges.items():
            if node in known:  # not the emptied copy or its body
                self._ranges[node] = (start + shift, column, end + shift, end_column)
        return True

    def _indents(self, unit: cst.CSTNode) -> list[str]:
        """The indentation of the blocks around `unit`, outermost first."""
        indents = []
        node = self._parents.get(unit)
        while node is not None:
            if isinstance(node, cst.IndentedBlock):
                indents.append(self.module.default_indent if node.indent is None else node.indent)
            node = self._parents.get(node)
        indents.reverse()
        return indents

    def _statement_lines(self) -> dict[cst.CSTNode, int] | None:
        """Each libcst statement (small or compound) -> the line it starts on, from `ast`'s
        statements matched in document order; None when they do not match one to one."""
        if self._lines is None:
            self._lines = {}
            statements = self._ast_statements()
            ours: list[cst.CSTNode] = []
            _cst_statements(self.module, ours)
            if statements is not None and len(statements) == len(ours):
                pairs = list(zip(ours, statements))
                if all(_same_kind(node, statement) for node, statement in pairs):
                    self._lines = {node: statement.lineno for node, statement in pairs}
        return self._lines or None

    def _ast_statements(self) -> list[ast.stmt] | None:
        if self.source is None:
            return None
        try:
            with warnings.catch_warnings():  # `compile` warns of invalid escapes and the like
                warnings.simplefilter("ignore")
                tree = compile(self.source, "<file>", "exec", ast.PyCF_ONLY_AST, True)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None  # perhaps syntax newer than this Python
        found: list[ast.stmt] = []
        _ast_statements(tree, found)
        return found

    def _from_whole_module(self, node: cst.CSTNode) -> Range:
        """`PositionProvider`'s range: correct, and slow on a large module."""
        if self._whole is None:
            from libcst.metadata import MetadataWrapper, PositionProvider

            wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
            self._whole = wrapper.resolve(PositionProvider)
        found = self._whole[node]
        return found.start.line, found.start.column, found.end.line, found.end.column


def _cst_statements(node: cst.CSTNode, found: list[cst.CSTNode]) -> None:
    """libcst's small and compound statements in document order."""
    for field in HOLDING:
        held = getattr(node, field, None)
        for child in held if type(held) in (list, tuple) else () if held is None else (held,):
            kind = type(child)
            if kind is cst.SimpleStatementLine:
                found.extend(child.body)
            elif _is_small(kind):
                found.append(child)
            else:  # a compound statement, a suite, or a clause (`else:`, `except:`, `case`)
                if issubclass(kind, cst.BaseCompoundStatement):
                    found.append(child)
                _cst_statements(child, found)


@cache
def _is_small(kind: type) -> bool:
    return issubclass(kind, cst.BaseSmallStatement)


def _ast_statements(node: ast.AST, found: list[ast.stmt]) -> None:
    """`ast` statements in document order (`elif` is an `If` in `orelse`, as in libcst)."""
    for field in HOLDING:
        for child in getattr(node, field, ()):
            if isinstance(child, ast.stmt):
                found.append(child)
            _ast_statements(child, found)


def _same_kind(node: cst.CSTNode, statement: ast.stmt) -> bool:
    """Whether a libcst statement and an `ast` one are the same kind of statement."""
    ours = type(node).__name__
    theirs = type(statement).__name__.removeprefix("Async")
    return ours == theirs or (ours, theirs) == ("Del", "Delete")
