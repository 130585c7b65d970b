"""Human-readable output, like ruff's: one line per finding, then a summary."""

from __future__ import annotations

from collections.abc import Iterator

from gaaudit import catalogue
from gaaudit.findings import Confidence, Finding, Span
from gaaudit.output import CheckRun, plural, source_lines

TYPE_CHECKING = False  # not `typing`'s, whose import costs a one-file check 4 ms
if TYPE_CHECKING:
    from typing import TextIO

Line = list[tuple[str, str]]  # (text, rich style) segments

CODE_STYLE = "bold red"
PATH_STYLE = "bold"
GUTTER_STYLE = "blue"
CONFIDENCE_STYLE = {
    Confidence.HIGH: "bold red",
    Confidence.MEDIUM: "yellow",
    Confidence.LOW: "cyan",
}
MAX_FRAME_LINES = 6


def write(run: CheckRun, out: TextIO) -> None:
    """Write findings, errors and the summary; styled with rich when `run.color`."""
    lines = _lines(run)
    if not run.color:
        out.writelines("".join(text for text, _ in line) + "\n" for line in lines)
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(
        file=out,
        force_terminal=True,
        color_system="standard",
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=True,
    )
    for line in lines:
        console.print(Text.assemble(*line))


def _lines(run: CheckRun) -> Iterator[Line]:
    findings, errors = run.findings, run.errors
    if run.statistics:
        yield from _statistics(run.counts)
    else:
        sources = (
            {path: source_lines(path) for path in {f.path for f in findings}} if run.color else {}
        )
        for finding in findings:
            yield from _finding(finding, sources.get(finding.path, []))
    for error in errors:
        yield [
            (f"{error.path}:{error.line}:{error.column}:", PATH_STYLE),
            (" ", ""),
            (error.code, CODE_STYLE),
            (f" {error.message}", ""),
        ]
    if run.quiet:
        return
    for path, note in run.notes:
        yield [(f"{path}:", PATH_STYLE), (" note: ", "bold cyan"), (note, "")]
    yield [(_summary(run, findings, len(errors)), "")]
    if run.fixable:
        yield [("[*]", "bold cyan"), (f" {run.fixable} fixable with `gaaudit fix`.", "")]
    if run.hidden:
        more = plural(run.hidden, "more finding")
        yield [(f"{more} at low confidence (`--min-confidence low`).", "dim")]


def _finding(finding: Finding, source: list[str]) -> Iterator[Line]:
    span = finding.span
    yield [
        (f"{finding.path}:{finding.location}:", PATH_STYLE),
        (" ", ""),
        (finding.code, CODE_STYLE),
        (" ", ""),
        (f"[{finding.confidence}]", CONFIDENCE_STYLE[finding.confidence]),
        (f" {finding.message}", ""),
    ]
    if finding.cell is None:
        yield from _frame(span, source)
    for evidence in finding.evidence:
        yield [(f"    {evidence}", "dim")]
    if finding.hint:
        yield [("    hint: ", "bold cyan"), (finding.hint, "")]


def _frame(span: Span, source: list[str]) -> Iterator[Line]:
    """The span's source lines (at most `MAX_FRAME_LINES`), each underlined with `^`."""
    last = min(span.end_line, span.line + MAX_FRAME_LINES - 1, len(source))
    width = len(str(last))
    for number in range(span.line, last + 1):
        text = source[number - 1]
        start = span.column if number == span.line else len(text) - len(text.lstrip()) + 1
        end = span.end_column if number == span.end_line else len(text) + 1
        pad = "".join(c if c == "\t" else " " for c in text[: start - 1])
        yield [(f"  {number:>{width}} | ", GUTTER_STYLE), (text, "")]
        yield [(f"  {'':>{width}} | ", GUTTER_STYLE), (pad + "^" * max(end - start, 1), CODE_STYLE)]
    if span.line <= last < span.end_line:
        yield [(f"  {'':>{width}} | ...", GUTTER_STYLE)]


def _statistics(counts: dict[str, int]) -> Iterator[Line]:
    """`count  code  name` per rule, most frequent first, like `ruff --statistics`."""
    rules = catalogue.load()
    width = max((len(str(n)) for n in counts.values()), default=0)
    for code, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        yield [(f"{count:>{width}}  ", ""), (code, CODE_STYLE), (f"  {rules[code].name}", "")]


def _summary(run: CheckRun, findings: list[Finding], errors: int) -> str:
    checked = plural(run.files_checked, "file")
    elapsed = f"{run.elapsed:.2f}s"
    if not findings and not errors:
        return f"All checked! {checked} in {elapsed}."
    codes = ", ".join(f"{code}: {n}" for code, n in run.counts.items())
    text = f"Found {plural(len(findings), 'finding')}" + (f" ({codes})" if codes else "")
    text += f" in {len({f.path for f in findings})} of {checked} in {elapsed}."
    if errors:
        text += f" {plural(errors, 'file')} could not be checked."
    return text
