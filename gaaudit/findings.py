"""The values that cross module boundaries: findings, errors, per-file results."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Confidence(IntEnum):
    """How sure a finding is that mean/K is wrong for this code (GA-GUIDE section 3)."""

    LOW = 1
    MEDIUM = 2
    HIGH = 3

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Confidence:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"expected one of low, medium, high, got {text!r}") from None


@dataclass(frozen=True, order=True)
class Span:
    """A source range: 1-based lines, 1-based columns, end exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int


@dataclass(frozen=True)
class Finding:
    """One reported problem, with the evidence that led to it."""

    path: str
    code: str
    message: str
    span: Span
    confidence: Confidence
    evidence: tuple[str, ...] = ()
    hint: str = ""
    fixable: bool = False
    cell: int | None = None  # in a notebook: the 1-based cell; `span` then counts within it

    @property
    def sort_key(self) -> tuple:
        return (self.path, self.cell or 0, self.span, self.code)

    @property
    def location(self) -> str:
        """`12:5`, or `cell 3:line 12:col 5` in a notebook."""
        if self.cell is None:
            return f"{self.span.line}:{self.span.column}"
        return f"cell {self.cell}:line {self.span.line}:col {self.span.column}"


@dataclass(frozen=True)
class FileError:
    """A file that could not be read or parsed (reported as E999)."""

    path: str
    message: str
    line: int = 1
    column: int = 1
    code: str = "E999"


@dataclass
class FileReport:
    """Everything `check` learned about one file."""

    path: str
    findings: list[Finding] = field(default_factory=list)
    error: FileError | None = None
    hidden: int = 0  # findings below the minimum confidence, counted, not shown
    notes: tuple[str, ...] = ()  # what was left unchecked, e.g. a notebook cell of another language
    fixable: int | None = None  # findings a safe `gaaudit fix` would fix; None: not counted
