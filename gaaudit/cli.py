"""The `gaaudit` command line: check, fix, rules, explain, verify."""

from __future__ import annotations

import os
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from gaaudit import __version__

app = typer.Typer(
    name="gaaudit",
    help="Find, fix and prove the gradient-accumulation loss bug in training code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
PROGRESS_THRESHOLD = 200  # files


class Format(str, Enum):
    text = "text"
    json = "json"
    sarif = "sarif"
    github = "github"


class Level(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


def _fail(message: str) -> None:
    typer.echo(f"gaaudit: error: {message}", err=True)
    raise typer.Exit(EXIT_ERROR)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gaaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Find, fix and prove the gradient-accumulation loss bug in training code."""


Paths = Annotated[Optional[list[Path]], typer.Argument(help="Files or directories [default: .]")]
Codes = Annotated[Optional[list[str]], typer.Option(help="Rule codes or prefixes (repeatable).")]
Globs = Annotated[Optional[list[str]], typer.Option(help="gitignore-style patterns (repeatable).")]


def _settings(paths, select, ignore, exclude, extend_exclude, min_confidence):
    from gaaudit.config import ConfigError, load
    from gaaudit.findings import Confidence

    try:
        settings = load(paths[0] if paths else Path.cwd())
    except ConfigError as exc:
        _fail(str(exc))
    settings = settings.override(
        select=tuple(select) if select else None,
        ignore=tuple(ignore) if ignore else None,
        exclude=tuple(exclude) if exclude else None,
        extend_exclude=(*settings.extend_exclude, *extend_exclude) if extend_exclude else None,
        min_confidence=Confidence.parse(min_confidence.value) if min_confidence else None,
    )
    missing = [p for p in paths if not p.exists() and not p.is_symlink()]
    if missing:
        _fail(f"{missing[0]}: no such file or directory")
    return settings


@app.command()
def check(
    paths: Paths = None,
    format: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.text,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the report to FILE.")] = None,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    min_confidence: Annotated[
        Optional[Level], typer.Option(help="Lowest confidence to report [default: medium].")
    ] = None,
    statistics: Annotated[bool, typer.Option(help="Count findings per rule.")] = False,
    exit_zero: Annotated[bool, typer.Option(help="Exit 0 even when there are findings.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Findings only, no summary.")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, help="Worker processes.")] = None,
) -> None:
    """Report gradient-accumulation loss bugs. Exit 0: none, 1: findings, 2: errors."""
    from gaaudit.discovery import discover
    from gaaudit.engine import check_files
    from gaaudit.output import CheckRun, write

    paths = paths or [Path(".")]
    settings = _settings(paths, select, ignore, exclude, extend_exclude, min_confidence)
    started = time.perf_counter()
    files = list(discover(paths, settings))
    reports = list(_progress(check_files(files, settings, jobs), len(files), quiet))
    if settings.enabled("GA006", ""):
        reports += _repository_reports(files, paths, settings)
    run = CheckRun(
        reports=reports,
        files_checked=len(files),
        elapsed=time.perf_counter() - started,
        statistics=statistics,
        color=output is None and format is Format.text and _use_color(),
        quiet=quiet,
    )
    if output is None:
        write(format.value, run, sys.stdout)
    else:
        with output.open("w", encoding="utf-8") as stream:
            write(format.value, run, stream)
    if run.errors:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_FINDINGS if run.findings and not exit_zero else EXIT_CLEAN)


@app.command()
def fix(
    paths: Paths = None,
    diff: Annotated[bool, typer.Option("--diff", help="Print a unified diff; write nothing.")] = False,
    unsafe_fixes: Annotated[bool, typer.Option(help="Also apply fixes marked unsafe.")] = False,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    min_confidence: Annotated[
        Optional[Level], typer.Option(help="Lowest confidence to fix [default: medium].")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
    verify: Annotated[
        bool, typer.Option("--verify", help="Apply a file's fixes only when their replay is verified.")
    ] = False,
) -> None:
    """Rewrite findings to sum-and-count. Exit 0: nothing left, 1: findings remain (or, with
    --diff, something would change), 2: errors."""
    from gaaudit.codemod import WriteError, write_atomic
    from gaaudit.discovery import discover
    from gaaudit.fixer import fix_file
    from gaaudit.source import SourceError

    paths = paths or [Path(".")]
    settings = _settings(paths, select, ignore, exclude, extend_exclude, min_confidence)
    applied = skipped = changed = errors = 0
    for path in discover(paths, settings):
        try:
            result = fix_file(path, settings, unsafe_fixes)
            held = verify and result.changed and _held_back(path, result)
            if held:
                typer.echo(f"{result.path}: fixes held back: {held}")
                skipped += sum(o.applied for o in result.outcomes)
                continue
            if result.changed and not diff:
                write_atomic(path, result.after, result.before)
        except (SourceError, WriteError) as exc:
            errors += 1
            line = f":{exc.line}:{exc.column}" if isinstance(exc, SourceError) else ""
            typer.echo(f"{path.as_posix()}{line}: E999 {exc.message if isinstance(exc, SourceError) else exc}")
            continue
        except Exception as exc:  # a gaaudit bug: leave this file untouched, go on with the rest
            errors += 1
            typer.echo(f"{path.as_posix()}: E999 internal error ({type(exc).__name__}); file left unchanged, please report this")
            continue
        changed += result.changed
        for outcome in result.outcomes:
            if outcome.applied:
                applied += 1
            else:
                skipped += 1
                typer.echo(
                    f"{result.path}:{outcome.location}: {outcome.site.code} "
                    f"not fixed: {outcome.reason}",
                    err=diff,
                )
        if diff and result.changed:
            coloured = _use_color()
            typer.echo(_colour_diff(result.diff()) if coloured else result.diff(), nl=False, color=coloured)
    if not quiet:
        verb = "Would fix" if diff else "Fixed"
        typer.echo(
            f"{verb} {applied} finding{'s' * (applied != 1)} in {changed} file{'s' * (changed != 1)}"
            f"; {skipped} not fixed.",
            err=diff,
        )
    if errors:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_FINDINGS if (changed if diff else skipped) else EXIT_CLEAN)


def _held_back(path: Path, result) -> str:
    """Why a file's fixes may not be applied under --verify ("" when every loop verified)."""
    from gaaudit.verify import VERIFIED, Options, verify_pair

    if path.suffix != ".py":
        return "--verify replays Python files only"
    outcomes = verify_pair(path, result.before, result.after, None, Options(ks=(4,)))
    failed = [o for o in outcomes if o.verdict != VERIFIED]
    if not outcomes:
        return "no loop could be replayed"
    return "; ".join(f"line {o.line}: {o.verdict}" for o in failed)


def _progress(reports, total: int, quiet: bool):
    """A progress bar on stderr for long runs in a terminal; never in CI logs or pipes."""
    if quiet or total < PROGRESS_THRESHOLD or not sys.stderr.isatty() or os.environ.get("CI"):
        return reports
    from rich.console import Console
    from rich.progress import track

    return track(reports, total=total, description="checking", console=Console(stderr=True), transient=True)


def _repository_reports(files, paths, settings):
    """GA006 findings on dependency files, filtered like the per-file ones."""
    from gaaudit.checks.versions import check_repository
    from gaaudit.engine import display_path

    reports = check_repository(files, [p for p in paths if p.is_dir()])
    for report in reports:
        relative = display_path(Path(report.path), settings.root)
        report.findings = [
            f for f in report.findings
            if f.confidence >= settings.min_confidence and settings.enabled(f.code, relative)
        ]
    return [r for r in reports if r.findings]


DIFF_COLOURS = (("+++", "1"), ("---", "1"), ("@@", "36"), ("+", "32"), ("-", "31"))


def _colour_diff(text: str) -> str:
    """ANSI-coloured unified diff lines (headers bold, hunks cyan, additions green)."""
    lines = []
    for line in text.splitlines(keepends=True):
        colour = next((c for prefix, c in DIFF_COLOURS if line.startswith(prefix)), None)
        lines.append(f"\x1b[{colour}m{line.rstrip(chr(10))}\x1b[0m\n" if colour else line)
    return "".join(lines)


def _use_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"


@app.command()
def rules() -> None:
    """List the rules of the catalogue."""
    from gaaudit.catalogue import load

    catalogue = load()
    width = max(len(rule.name) for rule in catalogue.values())
    for rule in catalogue.values():
        typer.echo(f"{rule.code}  {rule.name:<{width}}  {rule.severity:<7}  {rule.summary}")


@app.command()
def explain(code: Annotated[str, typer.Argument(help="A rule code, e.g. GA001.")]) -> None:
    """Show a rule's rationale with a bad and a good example."""
    from gaaudit.catalogue import load

    rule = load().get(code.upper())
    if rule is None:
        _fail(f"unknown rule {code!r}; `gaaudit rules` lists them")
    typer.echo(
        f"{rule.code} ({rule.name}): {rule.summary}\n\n"
        f"## What it does\n{rule.what.strip()}\n\n## Why is this bad?\n{rule.why.strip()}\n\n"
        f"## Example\n{rule.bad.strip()}\n\n## Use instead\n{rule.good.strip()}\n\n"
        f"Hint: {rule.hint}"
    )


@app.command()
def verify(
    target: Annotated[Optional[str], typer.Argument(help="PATH or PATH:LINE of a training script.")] = None,
    k: Annotated[str, typer.Option("-k", help="Window sizes, comma-separated.")] = "2,4,8",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16.")] = "float32",
    seed: Annotated[int, typer.Option(help="Seed for the model and the data.")] = 0,
    timeout: Annotated[float, typer.Option(help="Seconds before a replay is stopped.")] = 120.0,
    format: Annotated[Format, typer.Option("--format", "-f", help="text or json.")] = Format.text,
    demo: Annotated[bool, typer.Option(help="Run the reference experiment, no user code.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="With --demo: draw error against K (PNG).")] = None,
) -> None:
    """Replay each accumulation loop, original and patched, against one full-batch step on a
    tiny real model. Exit 0: every patched loop verified, 1: one is not, 2: nothing replayed."""
    from gaaudit import verify as verifying

    from importlib.util import find_spec

    missing = [name for name in ("torch", "transformers", "accelerate") if find_spec(name) is None]
    if missing:
        _fail(f"verify needs {', '.join(missing)}: pip install 'gaaudit[verify]'")
    if demo:
        raise typer.Exit(verifying.run_demo(format.value, plot))
    if target is None:
        _fail("give a training script: gaaudit verify PATH[:LINE] (or --demo)")
    path_text, _, line_text = target.rpartition(":") if target.rpartition(":")[2].isdigit() else (target, "", "")
    path = Path(path_text)
    if not path.is_file():
        _fail(f"{path}: no such file")
    try:
        ks = tuple(int(v) for v in k.split(","))
    except ValueError:
        _fail(f"-k {k!r}: expected comma-separated integers such as 2,4,8")
    options = verifying.Options(ks, device, dtype, seed, timeout)
    typer.echo(f"gaaudit: executing loops of {path} (and their patched versions) on a tiny model", err=True)
    outcomes = verifying.verify_file(path, int(line_text) if line_text else None, options)
    raise typer.Exit(verifying.report(outcomes, format.value, path))


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="The project root [default: .]")] = Path("."),
) -> None:
    """Write a commented [tool.gaaudit] block and a .pre-commit-config.yaml entry.
    Exit 1 when either already existed and was left unchanged."""
    from gaaudit.setup import write_config

    refused = False
    for line, done in write_config(directory):
        typer.echo(line, err=not done)
        refused |= not done
    raise typer.Exit(EXIT_FINDINGS if refused else EXIT_CLEAN)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("gaaudit: interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
