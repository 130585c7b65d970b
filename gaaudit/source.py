"""Reading and parsing one file: bytes in, a libcst module or a clear error out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Byte patterns without which no rule can fire: files lacking all of them are never parsed.
TRIGGERS = (
    b".backward(", b"accumulate_grad_batches", b"compute_loss", b"training_step", b"Trainer(",
    b"Trainer)", b"MultiSteps", b"jax.tree", b"tree_util", b"/// script",
)
# Inside a file that passed, the definitions holding any of these are kept for libcst (focus.py).
FOCUS = (*TRIGGERS, b"tree_map", b"tree.map", b"value_and_grad", b"jax.grad")


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
        return any(trigger in self.data for trigger in TRIGGERS)


def read(path: Path) -> Source:
    """Read a file's bytes, turning OS errors into a `SourceError`."""
    if path.is_dir():
        raise SourceError("is a directory, not a Python file; exclude it or rename it")
    try:
        return Source(path, path.read_bytes())
    except OSError as exc:
        raise SourceError(f"cannot read file: {exc.strerror or exc}") from None


def parse(data: bytes):
    """Parse bytes with libcst (encoding cookie and BOM honoured); raise `SourceError`."""
    import libcst as cst

    if b"\0" in data:
        raise SourceError("file contains null bytes; it is binary or corrupt, not Python source")
    try:
        return cst.parse_module(data)
    except cst.ParserSyntaxError as exc:
        return _raise_syntax(data, exc)
    except UnicodeDecodeError as exc:
        raise SourceError(
            f"cannot decode as UTF-8 ({exc.reason} at byte {exc.start}); "
            "add an encoding cookie such as `# -*- coding: latin-1 -*-`"
        ) from None
    except (LookupError, SyntaxError) as exc:
        raise SourceError(f"cannot decode: {exc}") from None
    except RecursionError:
        raise SourceError("expression nested too deeply to analyse") from None


def _raise_syntax(data: bytes, exc) -> None:
    """Prefer CPython's own wording and position; libcst's when CPython accepts the file."""
    try:
        compile(data, "<file>", "exec", dont_inherit=True, flags=0x400)  # ast.PyCF_ONLY_AST
    except SyntaxError as python:
        raise SourceError(
            f"syntax error, not valid Python 3: {python.msg}", python.lineno or 1, python.offset or 1
        ) from None
    except (ValueError, RecursionError, MemoryError):
        pass
    message = exc.message.splitlines()[0] if exc.message else "invalid syntax"
    raise SourceError(
        f"syntax gaaudit's parser does not support: {message}", exc.raw_line, exc.raw_column + 1
    ) from None
