"""GitHub Actions workflow commands: one annotation per finding and per error."""

from __future__ import annotations

from typing import TextIO

from gaaudit.findings import Confidence
from gaaudit.output import CheckRun

COMMAND = {Confidence.HIGH: "error", Confidence.MEDIUM: "warning", Confidence.LOW: "notice"}


def write(run: CheckRun, out: TextIO) -> None:
    """Write `::error`/`::warning`/`::notice` lines that GitHub shows on the diff."""
    for f in run.findings:
        s = f.span
        message = f"{f.message}\nhint: {f.hint}" if f.hint else f.message
        out.write(
            f"::{COMMAND[f.confidence]} file={_property(f.path)},line={s.line},col={s.column},"
            f"endLine={s.end_line},endColumn={s.end_column},"
            f"title={_property(f'{f.code} [{f.confidence}]' + (f' (cell {f.cell})' if f.cell else ''))}"
            f"::{_data(message)}\n"
        )
    out.writelines(
        f"::error file={_property(e.path)},line={e.line},col={e.column},"
        f"title={_property(e.code)}::{_data(e.message)}\n"
        for e in run.errors
    )


def _data(text: str) -> str:
    """Escape a command's message, as @actions/core does."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    """Escape a command property value, as @actions/core does."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")
