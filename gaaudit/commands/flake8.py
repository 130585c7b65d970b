"""flake8 plugin: `flake8 --select GA` reports what `gaaudit check` reports for each file.

flake8 hands over the lines it read (from disk or stdin); they go through gaaudit's own
prefilter, screen, parse and rules, with `[tool.gaaudit]` from the nearest pyproject.toml.
GA006 (a transformers pin in a requirements file) is repository-wide, so only
`gaaudit check` reports it. A file that flake8's parser accepts but gaaudit cannot check
is reported as GA999 rather than skipped in silence.
"""

from __future__ import annotations

import ast
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from gaaudit import __version__
from gaaudit.checks.engine import audit, display_path
from gaaudit.config import Settings, load
from gaaudit.discover.screen import screen
from gaaudit.discover.source import Source, SourceError, parse
from gaaudit.findings import Finding

UNCHECKED = "GA999"


@cache
def _settings(directory: Path) -> Settings:
    """The settings for files in `directory`; a bad configuration raises `ConfigError`."""
    return load(directory)


def _encode(lines: list[str]) -> bytes:
    """The source as bytes in the encoding its cookie names (UTF-8 without one)."""
    head = iter(line.encode("utf-8") for line in lines[:2])
    encoding, _ = tokenize.detect_encoding(lambda: next(head, b""))
    return "".join(lines).encode(encoding.removesuffix("-sig"))


class Plugin:
    """A flake8 AST plugin; the tree is unused, gaaudit parses with libcst."""

    name = "gaaudit"
    version = __version__

    def __init__(self, tree: ast.AST, lines: list[str], filename: str) -> None:
        self.lines = lines
        self.path = Path(filename).resolve()

    def run(self) -> Iterator[tuple[int, int, str, type]]:
        """`(line, 0-based column, "CODE message", type)` per finding."""
        settings = _settings(self.path.parent)  # a ConfigError stops flake8, naming file and key
        try:
            findings = self._findings(settings)
        except SourceError as exc:
            yield self._unchecked(exc.message, exc.line, exc.column)
            return
        except RecursionError:
            yield self._unchecked("code nested too deeply to analyse")
            return
        except Exception as exc:  # noqa: BLE001 - a gaaudit bug must not end flake8's whole run
            yield self._unchecked(f"internal error ({type(exc).__name__}: {exc}), please report it")
            return
        for finding in findings:
            text = f"{finding.code} [{finding.confidence}] {finding.message}"
            yield finding.span.line, finding.span.column - 1, text, type(self)

    def _unchecked(self, reason: str, line: int = 1, column: int = 1) -> tuple[int, int, str, type]:
        message = f"{UNCHECKED} gaaudit could not check this file: {reason}"
        return line, column - 1, message, type(self)

    def _findings(self, settings: Settings) -> list[Finding]:
        data = _encode(self.lines)
        if not Source(self.path, data).may_have_findings:
            return []
        screened = screen(data, settings.accumulation_names, self.path.parent)
        if screened.data is None:
            return []
        module = parse(screened.data, screened.tree)
        text = data.decode(module.encoding)
        shown, relative = display_path(self.path), display_path(self.path, settings.root)
        directory = self.path.parent
        return audit(module, text, shown, relative, settings, directory, source=screened.data)[1]
