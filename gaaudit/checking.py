"""One `gaaudit check` run, without the CLI library: settings, files, cache, reports, output.

`gaaudit.cli` (typer) and the fast path of `gaaudit.__main__` both call `check`, so that a
pre-commit call on a few files pays for neither typer nor click.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
PROGRESS_THRESHOLD = 200  # files


class UsageError(Exception):
    """A problem with the command line or the configuration: exit 2 with this message."""


@dataclass(frozen=True)
class CheckOptions:
    """The options of `gaaudit check`, as the command line gives them."""

    paths: tuple[Path, ...] = ()
    format: str = "text"
    output: Path | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    extend_exclude: tuple[str, ...] = ()
    min_confidence: str | None = None
    statistics: bool = False
    exit_zero: bool = False
    quiet: bool = False
    jobs: int | None = None
    unsafe_fixes: bool = False
    no_cache: bool = False
    cache_dir: Path | None = None


def settings_for(paths, select=(), ignore=(), exclude=(), extend_exclude=(), min_confidence=None):
    """The configuration found from the first path, overridden by the command line; raise
    `UsageError` for a bad configuration or a path that does not exist."""
    from gaaudit.config import ConfigError, load
    from gaaudit.findings import Confidence

    try:
        settings = load(paths[0] if paths else Path.cwd())
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    settings = settings.override(
        select=tuple(select) if select else None,
        ignore=tuple(ignore) if ignore else None,
        exclude=tuple(exclude) if exclude else None,
        extend_exclude=(*settings.extend_exclude, *extend_exclude) if extend_exclude else None,
        min_confidence=Confidence.parse(min_confidence) if min_confidence else None,
    )
    missing = [p for p in paths if not p.exists() and not p.is_symlink()]
    if missing:
        raise UsageError(f"{missing[0]}: no such file or directory")
    return settings


def check(options: CheckOptions) -> int:
    """Run `gaaudit check`, write its report and return the exit status; raise `UsageError`."""
    from gaaudit.discovery import discover
    from gaaudit.engine import check_files
    from gaaudit.output import CheckRun, write

    paths = list(options.paths) or [Path(".")]
    settings = settings_for(
        paths,
        options.select,
        options.ignore,
        options.exclude,
        options.extend_exclude,
        options.min_confidence,
    )
    started = time.perf_counter()
    files = list(discover(paths, settings))
    store = None if options.no_cache else _cache(options, settings)
    checked = check_files(files, settings, options.jobs, store)
    # Only reports with something to say are kept: memory stays flat as the tree grows.
    found = [
        (p, r) for p, r in _progress(checked, len(files), options.quiet) if r.findings or r.error
    ]
    warning = store.save() if store is not None else None
    reports = [report for _, report in found]
    fixes = {}
    if options.format == "sarif":  # a fix run per file with a fixable finding: SARIF alone pays it
        from gaaudit.output.sarif_fixes import suggest

        fixes = suggest(found, settings, options.unsafe_fixes)
    if settings.enabled("GA006", "") and _dependency_files_possible(paths, files):
        reports += _repository_reports(files, paths, settings)
    run = CheckRun(
        reports=reports,
        files_checked=len(files),
        elapsed=time.perf_counter() - started,
        statistics=options.statistics,
        color=options.output is None and options.format == "text" and use_color(),
        quiet=options.quiet,
        fixes=fixes,
    )
    if options.output is None:
        write(options.format, run, sys.stdout)
    else:
        with options.output.open("w", encoding="utf-8") as stream:
            write(options.format, run, stream)
    if warning:
        print(f"gaaudit: warning: {warning}", file=sys.stderr)
    if run.errors:
        return EXIT_ERROR
    return EXIT_FINDINGS if run.findings and not options.exit_zero else EXIT_CLEAN


def _cache(options: CheckOptions, settings):
    """The cache for this run: `--cache-dir`, else `cache-dir` of the configuration, else
    `.gaaudit_cache` at the project root."""
    from gaaudit import cache

    directory = options.cache_dir or settings.cache_dir or settings.root / cache.DIRECTORY
    return cache.Cache(directory, cache.run_key(settings))


def _progress(reports, total: int, quiet: bool):
    """A progress bar on stderr for long runs in a terminal; never in CI logs or pipes."""
    if quiet or total < PROGRESS_THRESHOLD or not sys.stderr.isatty() or os.environ.get("CI"):
        return reports
    from rich.console import Console
    from rich.progress import track

    return track(
        reports, total=total, description="checking", console=Console(stderr=True), transient=True
    )


def _dependency_files_possible(paths, files) -> bool:
    """Whether GA006 has dependency files to read: those under the folders walked, or named
    on the command line (setup.py is the one Python file among them); a pre-commit call on
    a few scripts skips it and its imports."""
    return any(p.is_dir() for p in paths) or any(
        not p.name.endswith((".py", ".ipynb")) or p.name.lower() == "setup.py" for p in files
    )


def _repository_reports(files, paths, settings):
    """GA006 findings on dependency files, filtered like the per-file ones."""
    from gaaudit.checks.versions import check_repository
    from gaaudit.engine import display_path

    reports = check_repository(files, [p for p in paths if p.is_dir()])
    for report in reports:
        relative = display_path(Path(report.path), settings.root)
        report.findings = [
            f
            for f in report.findings
            if f.confidence >= settings.min_confidence and settings.enabled(f.code, relative)
        ]
    return [r for r in reports if r.findings]


def use_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
