"""Reading and parsing one file: bytes in, a libcst module or a clear error out."""

from __future__ import annotations

import ast
import codecs
import io
import os
import tokenize
from dataclasses import dataclass
from pathlib import Path

from gaaudit.discover.focus import DEFINITIONS
from gaaudit.vocabulary import WINDOW_GUARD

# Byte patterns without which no rule can fire (besides a window's guard, `% accum_iter`:
# `vocabulary.window_guards`): files lacking all of them are never parsed.
TRIGGERS = (
    b".backward(",
    b"accumulate_grad_batches",
    b"compute_loss",
    b"training_step",
    b"Trainer(",
    b"Trainer)",
    b"Trainer as",  # `from transformers import Trainer as T`, then `T(model=...)`
    b"MultiSteps",
    b"microbatching",  # optax.microbatching.microbatch
    b"jax.tree",
    b"tree_util",
    b"value_and_grad",  # handed to a micro-batching function of another module
    b"/// script",
    b"pipelining",
    b"PipelineModule",
    b"pretrain(",  # Megatron's loop, around a forward step of the file
    b"training_main(",  # SwissArmyTransformer's
    b"accumulative_counts",  # mmengine's optimizer wrapper
)
# Substrings several triggers share: a file without one lacks them all, found in one scan.
SHARED = (b"Trainer", b"ipelin", b"tree")
PROBES = (
    *((key, tuple(t for t in TRIGGERS if key in t)) for key in SHARED),
    *((t, (t,)) for t in TRIGGERS if not any(key in t for key in SHARED)),
)
# libcst parses dense code at about 100 kB/s and holds some 500 bytes per byte parsed:
# larger files that could have findings are refused, so that a run stays bounded.
MAX_BYTES = 2 * 2**20
# libcst's visitors recurse about three Python frames per level of its tree: deeper trees
# overflow the default recursion limit of 1000 during analysis.
MAX_DEPTH = 250
# libcst's native parser recurses on the C stack; deep input overflows a thread's default 8 MiB.
PARSER_STACK = 256 * 1024 * 1024
STRING_TOKENS = ("STRING", "FSTRING_START", "TSTRING_START")


class SourceError(Exception):
    """A file that cannot be read or parsed; carries the position to report."""

    def __init__(self, message: str, line: int = 1, column: int = 1) -> None:
        super().__init__(message)
        self.message, self.line, self.column = message, line, column


@dataclass(frozen=True)
class Source:
    """A file's raw bytes and where it came from."""

    path: Path
    data: bytes

    @property
    def may_have_findings(self) -> bool:
        data = self.data
        return any(key in data and any(t in data for t in group) for key, group in PROBES) or (
            b"%" in data and WINDOW_GUARD.search(data) is not None
        )


def read(path: Path, data: bytes | None = None) -> Source:
    """Read a file's bytes (or take `data`, the file's text from standard input); OS errors,
    bytes that are not text and files too large to analyse become a `SourceError`."""
    if data is None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            if not path.is_dir():
                raise SourceError(f"cannot read file: {exc.strerror or exc}") from None
            if not os.access(path, os.R_OK | os.X_OK):
                raise SourceError(
                    "cannot list directory: permission denied; its files are not checked"
                )
            raise SourceError("is a directory, not a Python file; exclude it or rename it")
    source = Source(path, data)
    if len(data) > MAX_BYTES and source.may_have_findings:
        raise _too_large(data)
    decode(data)
    return source


def decode(data: bytes) -> str:
    """The text of Python source bytes (encoding cookie and BOM honoured); raise `SourceError`."""
    if b"\0" in data:
        line, column = _position(data, data.index(b"\0"))
        message = "file contains null bytes; it is binary or corrupt, not Python source"
        raise SourceError(message, line, column)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        if "missing encoding declaration" not in exc.msg:  # an unknown or conflicting cookie
            raise SourceError(f"cannot decode: {exc.msg}") from None
        encoding = "utf-8"  # undecodable first lines and no cookie: decoding says where
    hint = ""
    if encoding == "utf-8":
        hint = "; add an encoding cookie such as `# -*- coding: latin-1 -*-`"
    if encoding == "utf-8-sig":  # error offsets count from after the BOM
        data, encoding = data[len(codecs.BOM_UTF8) :], "utf-8"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        line, column = _position(data, exc.start)
        message = f"cannot decode as {encoding} ({exc.reason}){hint}"
        raise SourceError(message, line, column) from None


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """1-based line and column of a byte offset."""
    return data.count(b"\n", 0, offset) + 1, offset - data.rfind(b"\n", 0, offset)


def parse(data: bytes, tree: ast.Module | None = None):
    """Parse bytes with libcst into a module its visitors can walk; raise `SourceError`.

    CPython parses first: its errors are the clearest, and it bounds the nesting that
    libcst, much slower and recursive, is given. `tree`, CPython's tree of these bytes or of
    the file they were focused from, spares that parse unless it nests too deeply (the deep
    part may have been blanked).
    """
    import libcst as cst

    if len(data) > MAX_BYTES:
        raise _too_large(data)
    text = decode(data)
    lines = text.encode("utf-8").splitlines(keepends=True)
    python = None
    if tree is None or _depth(tree, lines)[0] > MAX_DEPTH:
        try:
            tree = compile(data, "<file>", "exec", dont_inherit=True, flags=ast.PyCF_ONLY_AST)
        except SyntaxError as exc:
            if exc.msg.startswith("too many"):  # nested parentheses, levels of indentation
                raise _syntax(exc) from None
            tree, python = None, exc  # perhaps syntax newer than this Python: libcst decides
        except (RecursionError, MemoryError):
            raise SourceError("code nested too deeply to analyse") from None
        if tree is not None:
            depth, node = _depth(tree, lines)
            if depth > MAX_DEPTH:
                raise SourceError(
                    f"code nested too deeply to analyse (about {depth} levels; at most {MAX_DEPTH})",
                    getattr(node, "lineno", 1),
                    getattr(node, "col_offset", 0) + 1,
                )
    try:
        module = _on_large_stack(cst.parse_module, data)
    except cst.ParserSyntaxError as exc:
        if python is not None:
            raise _syntax(python) from None
        message = exc.message.splitlines()[0] if exc.message else "invalid syntax"
        raise SourceError(
            f"syntax gaaudit's parser does not support: {message}", exc.raw_line, exc.raw_column + 1
        ) from None
    if python is not None and _cst_depth(module) > MAX_DEPTH:
        raise SourceError(f"code nested too deeply to analyse (more than {MAX_DEPTH} levels)")
    if data.endswith(b"\r") and not module.has_trailing_newline:  # libcst drops a final lone CR
        module = module.with_changes(has_trailing_newline=True)
    return module


def _too_large(data: bytes) -> SourceError:
    size, limit = len(data) / 2**20, MAX_BYTES / 2**20
    return SourceError(f"file too large to analyse ({size:.1f} MiB; at most {limit:.0f} MiB)")


def _syntax(exc: SyntaxError) -> SourceError:
    message = f"syntax error, not valid Python 3: {exc.msg}"
    return SourceError(message, exc.lineno or 1, exc.offset or 1)


def _on_large_stack(function, *args):
    """`function(*args)` on a thread with a `PARSER_STACK` stack; its exception re-raised here."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, function(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            outcome.append((False, exc))

    import threading  # only when a file is parsed: a clean file's check spares the import

    previous = threading.stack_size(PARSER_STACK)
    try:
        thread = threading.Thread(target=run, name="gaaudit-parse", daemon=True)
        thread.start()
    finally:
        threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _depth(tree: ast.AST, lines: list[bytes]) -> tuple[int, ast.AST]:
    """An upper estimate of the depth of libcst's tree for `tree`, and the deepest node.

    libcst puts a wrapper node (an element, an argument, a block) between a node and the
    members of its lists; nests `a and b and c`, `for` clauses of a comprehension and
    implicitly concatenated strings one inside the next; and puts a subscript's slice two
    levels down. A definition whose first line is blank in `lines` was blanked by `focus`
    and is not walked.
    """
    deepest, where = 0, tree
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, DEFINITIONS) and not lines[node.lineno - 1].strip():
            continue
        if isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes))
        ):
            depth += _strings(node, lines, MAX_DEPTH - depth)
        if depth > deepest:
            deepest, where = depth, node
        for name, value in ast.iter_fields(node):
            if isinstance(value, list):
                chained = isinstance(node, ast.BoolOp) or name == "generators"
                step = len(value) + 1 if chained else 2
                stack.extend((child, depth + step) for child in value if isinstance(child, ast.AST))
            elif isinstance(value, ast.AST):
                stack.append((value, depth + (3 if name == "slice" else 1)))
    return deepest, where


def _strings(node: ast.expr, lines: list[bytes], budget: int) -> int:
    """How many literals a string expression is implicitly concatenated from, when that
    could exceed `budget` (each literal takes two characters or more); else 0."""
    first, last = node.lineno, node.end_lineno or node.lineno
    if first == last and (node.end_col_offset or 0) - node.col_offset <= 2 * budget:
        return 0
    block = b"".join(lines[first - 1 : last])
    end = len(block) - len(lines[last - 1]) + (node.end_col_offset or 0)
    segment = block[node.col_offset : end]
    text = "(" + segment.decode("utf-8", "replace") + ")"
    try:
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        return sum(tokenize.tok_name[token.type] in STRING_TOKENS for token in tokens)
    except (tokenize.TokenError, SyntaxError):
        return 0


def _cst_depth(module) -> int:
    """The depth of a libcst tree (slow: only for files CPython could not parse)."""
    deepest, stack = 0, [(module, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node.children)
    return deepest
