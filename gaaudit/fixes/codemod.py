"""Apply planned edits in one pass, and write files safely (atomic, mode kept, no lost updates)."""

from __future__ import annotations

import contextlib
import difflib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from gaaudit.analysis.tree import Tree
from gaaudit.discover.notebook import MARKER as CELL_MARKER
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.edits import DEFAULT_WIDTH, Edits, wrapped


class _Apply(cst.CSTTransformer):
    """Replaces nodes and splices statements, keyed by the original nodes' identity; the
    statements it inserts or rewrites are wrapped at `width` (`edits.wrapped`).

    A statement mapped to `REMOVE` is dropped from its block. Only the nodes that hold an
    edit are entered: the rest of the module is passed over whole.
    """

    def __init__(self, edits: Edits, width: int, tree: Tree) -> None:
        self.edits, self.width = edits, width
        self.indent = "    "  # the module's
        self.blocks: list[str] = []  # the indentation of each block being visited
        self.path: list[cst.CSTNode] = []  # the nodes being visited, outermost first
        self.originals = tree.order  # every node of the original module
        self.rewritten: set[cst.CSTNode] = set()  # statements holding a replaced node
        anchors = [*edits.replace, *edits.before, *edits.after, *edits.spaced]
        self.holding = {held for node in anchors for held in (node, *tree.ancestors(node))}

    def on_visit(self, node) -> bool:
        if node not in self.holding:
            return False
        self.path.append(node)
        if isinstance(node, cst.Module):
            self.indent = node.default_indent
        elif isinstance(node, cst.IndentedBlock):
            self.blocks.append(self.indent if node.indent is None else node.indent)
        return super().on_visit(node)

    def on_leave(self, original_node, updated_node):
        if original_node not in self.holding:
            return updated_node
        self.path.pop()
        updated_node = super().on_leave(original_node, updated_node)
        if isinstance(original_node, cst.IndentedBlock):
            self.blocks.pop()
        replacement = self.edits.replace.get(original_node, updated_node)
        if replacement is cst.RemovalSentinel.REMOVE:
            return updated_node
        if _is_statement(original_node) and original_node in self.edits.replace:
            return wrapped(replacement, self._column, self.width, self.indent, self.originals)
        if original_node in self.edits.replace:  # the statement holding it is rewritten
            holder = next((n for n in reversed(self.path) if _is_statement(n)), None)
            self.rewritten.add(holder)
        if original_node in self.rewritten:  # its line, or a block statement's header
            return wrapped(replacement, self._column, self.width, self.indent, rewritten=True)
        return replacement

    @property
    def _column(self) -> int:
        return sum(len(indent) for indent in self.blocks)

    def _splice(self, original_body, updated_body) -> list:
        body = []
        for original, updated in zip(original_body, updated_body):
            inserted = list(self.edits.before.get(original, ()))
            removed = self.edits.replace.get(original) is cst.RemovalSentinel.REMOVE
            if inserted:  # blank lines and a notebook cell marker stay above what is inserted
                lines = updated.leading_lines
                moved = len(lines) if removed or _opens_cell(updated) else _blank_prefix(lines)
                inserted[0] = inserted[0].with_changes(
                    leading_lines=[*lines[:moved], *inserted[0].leading_lines]
                )
                updated = updated.with_changes(leading_lines=lines[moved:])
            body.extend(wrapped(s, self._column, self.width, self.indent) for s in inserted)
            if original in self.edits.spaced:
                blank = _blank_prefix(updated.leading_lines)
                lines = [cst.EmptyLine()] * max(0, 2 - blank) + list(updated.leading_lines)
                updated = updated.with_changes(leading_lines=lines)
            if not removed:
                body.append(updated)
            body.extend(
                wrapped(s, self._column, self.width, self.indent)
                for s in self.edits.after.get(original, ())
            )
        return body

    def leave_IndentedBlock(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._splice(original_node.body, updated_node.body))


def _is_statement(node) -> bool:
    return isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement))


def _blank_prefix(lines) -> int:
    """How many of a statement's leading lines are blank before its first comment."""
    return next((i for i, line in enumerate(lines) if line.comment is not None), len(lines))


def _opens_cell(statement) -> bool:
    return any(
        line.comment is not None and line.comment.value.startswith(CELL_MARKER)
        for line in getattr(statement, "leading_lines", ())
    )


def apply(tree: Tree, edits: Edits, source: bytes, width: int = DEFAULT_WIDTH) -> bytes:
    """The bytes of `tree`'s module (parsed from `source`) with every edit applied in one
    traversal, the lines it writes wrapped at `width`.
    A last line that is a comment ending in a backslash keeps the newline after it, which
    libcst's code drops."""
    module = tree.module
    fixed = module.visit(_Apply(edits, width, tree)).bytes
    newline = module.default_newline.encode(module.encoding)
    if source.endswith(newline) and not fixed.endswith(newline):
        fixed += newline
    return fixed


@dataclass
class FileFix:
    """The outcome of fixing one file."""

    path: str
    before: bytes
    after: bytes
    outcomes: list[Outcome] = field(default_factory=list)
    companions: list[FileFix] = field(default_factory=list)  # other files the fixes change

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        """A unified diff `git apply` accepts."""
        old = self.before.decode("utf-8", "surrogateescape").splitlines(keepends=True)
        new = self.after.decode("utf-8", "surrogateescape").splitlines(keepends=True)
        lines = []
        for line in difflib.unified_diff(old, new, f"a/{self.path}", f"b/{self.path}"):
            if not line.endswith(("\n", "\r")):
                line += "\n\\ No newline at end of file\n"
            lines.append(line)
        return "".join(lines)


class WriteError(Exception):
    """A fixed file that could not be written; the original is untouched."""


def write_atomic(path: Path, data: bytes, expected: bytes) -> None:
    """Replace `path` with `data` via a temporary file in the same directory.

    Refuses when the file no longer holds `expected` (it changed since it was read), or
    when its permission bits make it read-only (checked on the bits, so root is refused
    too); keeps the file's permission bits and, where allowed, its owner. A symbolic link
    is written through: its target is replaced, the link stays.
    """
    path = Path(os.path.realpath(path))
    try:
        info = path.stat()
        if path.read_bytes() != expected:
            raise WriteError("file changed while gaaudit was fixing it; run again")
        if not info.st_mode & 0o222 or not os.access(path, os.W_OK):
            raise WriteError("file is not writable")
        handle, temporary = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".gaaudit", dir=path.parent
        )
    except OSError as exc:
        raise WriteError(f"cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        _keep_owner(temporary, info)
        os.chmod(temporary, info.st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException as exc:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteError(f"cannot write: {exc.strerror or exc}") from None
        raise


def _keep_owner(temporary: str, info: os.stat_result) -> None:
    """Give the new file the old one's owner and group, where the user may (root may)."""
    if hasattr(os, "chown") and (info.st_uid, info.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):
            os.chown(temporary, info.st_uid, info.st_gid)
