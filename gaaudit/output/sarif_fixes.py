"""The fixes `check --format sarif` suggests: what `gaaudit fix` would change, as replacements.

The fixer rewrites a file in one pass (one normalisation per accumulation window) and cannot
be restricted to one finding, so a file gets one fix, its whole change, attached to every
finding that change resolves; the description names the others. With `--unsafe-fixes`, a
finding the safe fixes resolve keeps the safe change; one only an unsafe fix resolves gets
the change with the unsafe fixes. Notebooks get none: their code lives inside JSON strings,
which line and column replacements of the code do not address.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from difflib import SequenceMatcher
from itertools import accumulate
from pathlib import Path

from gaaudit import catalogue
from gaaudit.config import Settings
from gaaudit.discover.source import decode
from gaaudit.findings import FileReport, Finding
from gaaudit.fixes.accumulation import Outcome
from gaaudit.fixes.codemod import FileFix
from gaaudit.fixes.fixer import fix_file

# A line with its terminator; SARIF, like Python's tokenizer, ends lines at CR, LF or CRLF.
LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


@dataclass(frozen=True)
class Replacement:
    """Characters `offset` to `offset + length` of the original text (also given as 1-based
    `(line, column)` positions, end exclusive), replaced by `text`."""

    offset: int
    length: int
    start: tuple[int, int]
    end: tuple[int, int]
    text: str


@dataclass(frozen=True)
class SuggestedFix:
    """A file's whole change, offered as the fix of one of the findings it resolves."""

    description: str
    unsafe: bool
    replacements: tuple[Replacement, ...]


def suggest(
    files: Iterable[tuple[Path, FileReport]], settings: Settings, unsafe: bool
) -> dict[Finding, SuggestedFix]:
    """The fix of every finding that `gaaudit fix` (with `--unsafe-fixes` when `unsafe`)
    would apply; only files with a fixable finding are rewritten."""
    fixes: dict[Finding, SuggestedFix] = {}
    for path, report in files:
        if path.suffix != ".ipynb" and any(f.fixable for f in report.findings):
            fixes.update(_file_fixes(path, report.findings, settings, unsafe))
    return fixes


def _file_fixes(
    path: Path, findings: list[Finding], settings: Settings, unsafe: bool
) -> dict[Finding, SuggestedFix]:
    """A finding the safe fixes resolve gets their change; one only an unsafe fix resolves
    gets the change with the unsafe fixes too."""
    try:
        safe = fix_file(path, settings)
        if unsafe and not all(o.applied for o in safe.outcomes):
            held = {_key(o): o.reason for o in safe.outcomes if not o.applied}
            return {
                **_attach(fix_file(path, settings, unsafe=True), findings, held),
                **_attach(safe, findings, {}),
            }
        return _attach(safe, findings, {})
    except Exception as exc:  # noqa: BLE001 - unreadable since checked, or a fixer bug: the report stands
        print(f"gaaudit: warning: {path}: no SARIF fix offered ({exc})", file=sys.stderr)
        return {}


def _key(outcome: Outcome) -> tuple[str, int, int]:
    return outcome.site.code, outcome.line, outcome.column


def _attach(
    result: FileFix, findings: list[Finding], held: dict[tuple[str, int, int], str]
) -> dict[Finding, SuggestedFix]:
    """`result`'s change as the fix of each finding it resolves; `held`: why the safe run
    left some findings alone (those it resolves make the change unsafe)."""
    applied = {_key(o) for o in result.outcomes if o.applied}
    resolved = [f for f in findings if (f.code, f.span.line, f.span.column) in applied]
    if not resolved or not result.changed:
        return {}
    edits = replacements(decode(result.before), decode(result.after))
    unsafe = {key: reason for key, reason in held.items() if key in applied}
    return {f: SuggestedFix(_describe(f, resolved, unsafe), bool(unsafe), edits) for f in resolved}


def _describe(
    finding: Finding, resolved: list[Finding], unsafe: dict[tuple[str, int, int], str]
) -> str:
    """What the change does, which other findings it fixes, and why it is unsafe if it is."""
    parts = [catalogue.load()[finding.code].hint]
    others = [f"{f.code} at line {f.span.line}" for f in resolved if f != finding]
    if others:
        parts.append(f"gaaudit fixes a file in one change, so this also fixes {', '.join(others)}.")
    parts += [f"Unsafe ({code} at line {line}): {why}." for (code, line, _), why in unsafe.items()]
    return " ".join(parts)


def replacements(before: str, after: str) -> tuple[Replacement, ...]:
    """The line hunks that turn `before` into `after`, positioned in `before`."""
    old, new = LINE.findall(before), LINE.findall(after)
    starts = list(accumulate(map(len, old), initial=0))
    hunks = SequenceMatcher(None, old, new).get_opcodes()
    return tuple(
        Replacement(
            offset=starts[i1],
            length=starts[i2] - starts[i1],
            start=_position(old, i1),
            end=_position(old, i2),
            text="".join(new[j1:j2]),
        )
        for tag, i1, i2, j1, j2 in hunks
        if tag != "equal"
    )


def _position(lines: list[str], index: int) -> tuple[int, int]:
    """Where line `index` starts, as an editor counts: after a final line break comes an empty
    last line; `index == len(lines)` without that break is the end of the last line."""
    if index == len(lines) and lines and not lines[-1].endswith(("\n", "\r")):
        return index, len(lines[-1]) + 1
    return index + 1, 1
