"""Jupyter notebooks: code cells joined into one Python source, and split back after a fix.

Cells are joined in order, each preceded by a marker comment, so the analysis sees the
whole notebook (the model built in one cell, the loop in another). IPython magics and
shell lines (with their backslash continuations), and the line magics written without their
`%` that break the parse, become `pass` placeholders that keep line numbers and indentation,
and are restored verbatim when the source is split back into cells. A cell magic that runs
its cell as Python (`%%time`, ...) is kept aside alone; a cell under any other cell magic
(`%%bash`, `%%writefile`, ...) is kept aside whole, and said so.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, replace

from gaaudit.discover.source import SourceError
from gaaudit.findings import Finding, Span

MARKER = "# gaaudit: cell "
PLACEHOLDER = "pass  # gaaudit: magic "
LINE = re.compile(r"\(line (\d+)\)")
# An IPython line: `%magic`, `!shell` (not a continued `!=`), `?help`, `name?`, `x = !cmd`.
MAGIC = re.compile(r"^(\s*)(?:%(?=[%\w])|!(?!=)|\?|[\w.*]+\?\??\s*$|[\w.]+\s*=\s*[%!])")
# A line magic written without its `%`, as IPython's automagic runs it (`pip install x`,
# `ls data/`): taken for one only where the line breaks the parse.
# fmt: off
AUTOMAGIC = re.compile(
    r"^(\s*)(?:pip|conda|mamba|uv|cd|ls|ll|pwd|mkdir|rmdir|rm|cp|mv|cat|less|more|env|set_env"
    r"|load_ext|reload_ext|matplotlib|time|timeit|run|who|whos|reset|history|bookmark|pushd|popd"
    r"|alias|store|system|sx|sc|xmode|config|pylab|autoreload|aimport)(?:\s|$)"
)
# fmt: on
CELL_MAGIC = re.compile(r"^%%(\w+)")
# Cell magics whose body is Python: run in the notebook (`%%time`, ...) or as a script (`%%python`).
PYTHON_CELL_MAGICS = frozenset(
    {"time", "timeit", "capture", "prun", "debug", "memit", "python", "python3"}
)


@dataclass(frozen=True)
class Notebook:
    """A notebook's JSON and its code cells as one Python text.

    `skipped` lists the code cells left out of the analysis (those under a cell magic such
    as `%%bash`) as (1-based cell, reason), the reason a sentence for the report's note.
    """

    data: dict
    text: str
    origins: tuple[tuple[int, int], ...]  # per line of `text`: (1-based cell, 1-based line)
    magics: tuple[str, ...]  # original magic lines, by placeholder number
    skipped: tuple[tuple[int, str], ...] = ()  # (1-based cell, why) of cells not checked

    def locate(self, line: int) -> tuple[int, int]:
        """(cell, line in cell) for a 1-based line of `text`."""
        return self.origins[max(1, min(line, len(self.origins))) - 1]

    def relocate(self, finding: Finding) -> Finding:
        """A finding on `text`, re-pointed at its cell."""
        span = finding.span
        cell, line = self.locate(span.line)
        end_cell, end_line = self.locate(span.end_line)
        end_line = end_line if end_cell == cell else line
        evidence = tuple(LINE.sub(self._cell_line, text) for text in finding.evidence)
        return replace(
            finding,
            cell=cell,
            span=Span(line, span.column, end_line, span.end_column),
            evidence=evidence,
        )

    def _cell_line(self, match: re.Match) -> str:
        cell, line = self.locate(int(match.group(1)))
        return f"(cell {cell}, line {line})"

    def relocate_outcome(self, outcome):
        """A fix outcome on `text`, re-pointed at `cell N, line L` for the user."""
        cell, line = self.locate(outcome.line)
        return replace(outcome, line=line, cell=cell)

    def relocate_error(self, error: SourceError) -> SourceError:
        cell, line = self.locate(error.line)
        return SourceError(f"cell {cell}, line {line}: {error.message}", 1, 1)


def load(raw: bytes) -> Notebook:
    """Parse notebook JSON; raise `SourceError` with a clear reason when it is not one."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SourceError(f"not a valid notebook: invalid JSON ({exc})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise SourceError("not a valid notebook: no `cells` list (nbformat 4 expected)")
    lines: list[str] = []
    origins: list[tuple[int, int]] = []
    magics: list[str] = []
    skipped: list[tuple[int, str]] = []
    for number, cell in enumerate(cells, 1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = _source(cell)
        lines.append(f"{MARKER}{number}")
        origins.append((number, 1))
        magic = CELL_MAGIC.match(source)
        whole = magic is not None and magic.group(1) not in PYTHON_CELL_MAGICS
        if whole:
            skipped.append((number, f"cell magic `%%{magic.group(1)}` runs no Python; not checked"))
        continued, indent = False, ""
        for index, line in enumerate(source.split("\n"), 1):
            match = MAGIC.match(line)
            if whole or continued or match:
                if match and not (continued or whole):
                    indent = match.group(1)
                magics.append(line)
                continued = line.endswith("\\")  # a shell or magic line goes on below
                line = f"{indent}{PLACEHOLDER}{len(magics) - 1}"
            lines.append(line)
            origins.append((number, index))
    _automagics_aside(lines, magics)
    text = "\n".join(lines) + "\n"
    return Notebook(data, text, tuple(origins), tuple(magics), tuple(skipped))


def _automagics_aside(lines: list[str], magics: list[str]) -> None:
    """Each line that breaks the parse and reads as an automagic becomes a placeholder too;
    the first other error is left for the parse to report."""
    while True:
        try:
            ast.parse("\n".join(lines))
            return
        except SyntaxError as exc:
            index = (exc.lineno or 0) - 1
            match = AUTOMAGIC.match(lines[index]) if 0 <= index < len(lines) else None
            if match is None:
                return
            magics.append(lines[index])
            lines[index] = f"{match.group(1)}{PLACEHOLDER}{len(magics) - 1}"


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def rebuild(notebook: Notebook, fixed: str, raw: bytes) -> bytes:
    """The notebook JSON with each changed code cell's source taken from the fixed text;
    outputs, metadata and untouched cells stay as they were."""
    sources: dict[int, list[str]] = {}
    current = None
    for line in fixed.removesuffix("\n").split("\n"):
        stripped = line.strip()
        if stripped.startswith(MARKER):
            current = int(stripped[len(MARKER) :])
            sources[current] = []
        elif current is not None:
            if stripped.startswith(PLACEHOLDER):
                line = notebook.magics[int(stripped[len(PLACEHOLDER) :])]
            sources[current].append(line)
    data = json.loads(raw)
    for number, cell in enumerate(data["cells"], 1):
        text = "\n".join(sources.get(number, ()))
        if number in sources and text != _source(cell):
            cell["source"] = (
                text.splitlines(keepends=True) if isinstance(cell.get("source"), list) else text
            )
    return (json.dumps(data, indent=_indent(raw), ensure_ascii=False) + "\n").encode("utf-8")


def _indent(raw: bytes) -> int:
    """The JSON indentation the notebook was written with (nbformat uses 1)."""
    match = re.search(rb"\n( +)\"", raw)
    return len(match.group(1)) if match else 1
