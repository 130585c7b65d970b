"""Output: one module per format (text, json, sarif, github), each with `write(run, out)`.

In: a `CheckRun` (the reports of one check, and how to show them). Out: text on a stream.
"""

from __future__ import annotations

import tokenize
from collections import Counter
from dataclasses import dataclass, field
from importlib import import_module

from gaaudit.findings import FileError, FileReport, Finding

TYPE_CHECKING = False  # not `typing`'s, whose import costs a one-file check 4 ms
if TYPE_CHECKING:  # computing fixes costs a fix run: only `check --format sarif` imports it
    from typing import TextIO

    from gaaudit.output.sarif_fixes import SuggestedFix

FORMATS = ("text", "json", "sarif", "github")


@dataclass
class CheckRun:
    """What one `gaaudit check` found, and how it should be shown."""

    reports: list[FileReport]
    files_checked: int
    elapsed: float
    statistics: bool = False
    color: bool = False
    quiet: bool = False
    fixes: dict[Finding, SuggestedFix] = field(default_factory=dict)  # SARIF only
    fixable: int | None = None  # findings `gaaudit fix` would fix; text only, None: not counted

    @property
    def findings(self) -> list[Finding]:
        """Every finding of every file, in `Finding.sort_key` order."""
        return sorted((f for r in self.reports for f in r.findings), key=lambda f: f.sort_key)

    @property
    def errors(self) -> list[FileError]:
        """The files that could not be checked, by path."""
        return sorted((r.error for r in self.reports if r.error), key=lambda e: e.path)

    @property
    def hidden(self) -> int:
        """Findings below the minimum confidence: counted, not shown."""
        return sum(r.hidden for r in self.reports)

    @property
    def notes(self) -> list[tuple[str, str]]:
        """(path, note) for what was left unchecked in the files checked, by path."""
        return sorted((r.path, note) for r in self.reports for note in r.notes)

    @property
    def counts(self) -> dict[str, int]:
        """Number of findings per rule code, in code order."""
        return dict(sorted(Counter(f.code for r in self.reports for f in r.findings).items()))


def write(fmt: str, run: CheckRun, out: TextIO) -> None:
    """Write `run` to `out` in the format `fmt`, one of `FORMATS`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown output format {fmt!r}; expected one of {', '.join(FORMATS)}")
    import_module(f"{__name__}.{fmt}").write(run, out)


def plural(n: int, noun: str, nouns: str = "") -> str:
    """`1 file`, `2 files`; `nouns` where the plural is not `noun` + s."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


def source_lines(path: str) -> list[str]:
    """The lines of a Python file (encoding cookie honoured); empty if it cannot be read."""
    try:
        with tokenize.open(path) as file:
            return file.read().split("\n")
    except (OSError, SyntaxError, UnicodeDecodeError):
        return []
