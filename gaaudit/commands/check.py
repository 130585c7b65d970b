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
STDIN = Path("-")


class UsageError(Exception):
    """A problem with the command line or the configuration: exit 2 with this message."""


@dataclass(frozen=True)
class CheckOptions:
    """The options of `gaaudit check`, as the command line gives them (`fix` shares those
    that select files and rules)."""

    paths: tuple[Path, ...] = ()
    format: str = "text"
    output: Path | None = None
    select: tuple[str, ...] = ()
    extend_select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    extend_exclude: tuple[str, ...] = ()
    force_exclude: bool = False
    respect_gitignore: bool | None = None
    min_confidence: str | None = None
    statistics: bool = False
    exit_zero: bool = False
    quiet: bool = False
    jobs: int | None = None
    unsafe_fixes: bool = False
    no_cache: bool = False
    cache_dir: Path | None = None
    stdin_filename: Path | None = None  # with the path `-`: the file standard input holds


def settings_for(options: CheckOptions):
    """The configuration found from the first path, overridden by the command line; raise
    `UsageError` for a bad configuration, an unknown rule code or a path that does not exist.
    `--select` replaces the configuration's selection; `--extend-select` and `--ignore`
    add to it."""
    from gaaudit.config import ConfigError, load, rule_codes
    from gaaudit.findings import Confidence

    paths = options.paths
    if STDIN in paths and len(paths) > 1:
        raise UsageError("`-` reads one file from standard input; give no other path with it")
    if options.stdin_filename is not None and paths != (STDIN,):
        raise UsageError("--stdin-filename names the file that `-` reads: add `-` as the path")
    if paths == (STDIN,):
        start = options.stdin_filename or Path.cwd()
    else:
        start = paths[0] if paths else Path.cwd()
    try:
        settings = load(start)
        select, extend, ignore = (
            rule_codes(values, flag)
            for values, flag in (
                (options.select, "--select"),
                (options.extend_select, "--extend-select"),
                (options.ignore, "--ignore"),
            )
        )
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    exclude, extend_exclude = (
        _rebased(p, settings.root) for p in (options.exclude, options.extend_exclude)
    )
    settings = settings.override(
        select=(*(select or settings.select), *extend) if select or extend else None,
        ignore=(*settings.ignore, *ignore) if ignore else None,
        exclude=exclude or None,
        extend_exclude=(*settings.extend_exclude, *extend_exclude) if extend_exclude else None,
        respect_gitignore=options.respect_gitignore,
        min_confidence=Confidence.parse(options.min_confidence) if options.min_confidence else None,
    )
    missing = [p for p in paths if p != STDIN and not p.exists() and not p.is_symlink()]
    if missing:
        raise UsageError(f"{missing[0]}: no such file or directory")
    return settings


def _rebased(patterns, root: Path) -> tuple[str, ...]:
    """Exclude patterns of the command line, which are relative to the current folder, as
    patterns anchored at the project `root`. A pattern with a `/` before its end is anchored
    (gitignore's rule); a plain name matches at any depth and needs nothing."""
    if not patterns:
        return ()
    here = os.path.relpath(Path.cwd().resolve(), root.resolve()).replace(os.sep, "/")
    if here == "." or here.startswith(".."):
        return tuple(patterns)
    return tuple(
        f"{'!' * p.startswith('!')}/{here}/{p.lstrip('!').lstrip('/')}"
        if "/" in p.lstrip("!").rstrip("/")
        else p
        for p in patterns
    )


def check(options: CheckOptions) -> int:
    """Run `gaaudit check`, write its report and return the exit status; raise `UsageError`."""
    from gaaudit.checks.engine import check_files
    from gaaudit.discover.files import discover
    from gaaudit.output import CheckRun, write

    paths = list(options.paths) or [Path(".")]
    settings = settings_for(options)
    started = time.perf_counter()
    stdin = stdin_target(options, settings)
    # the text summary's count of what `gaaudit fix` would fix
    count = _count_fixable if options.format == "text" and not options.quiet else None
    if stdin is not None:
        from gaaudit.checks.engine import check_file, counted

        path, data, skipped = stdin
        files = [] if skipped else [path]
        checked = [(path, check_file(path, settings, data)) for path in files]
        if count:
            checked = [(path, counted(path, r, settings, count, data)) for path, r in checked]
        store = None
    else:
        files = list(discover(paths, settings, options.force_exclude))
        if not files:
            warn_nothing_found(paths)
        pins = dependency_files(files)  # read by GA006, not as Python
        store = None if options.no_cache else cache_for(options, settings)
        sources = [f for f in files if f not in pins] if pins else files
        checked = check_files(sources, settings, options.jobs, store, count)
    # Only reports with something to say are kept: memory stays flat as the tree grows.
    found = [
        (p, r)
        for p, r in _progress(checked, len(files), options.quiet)
        if r.findings or r.error or r.hidden or r.notes
    ]
    warning = store.save() if store is not None else None
    reports = [report for _, report in found]
    # SARIF's fixes: a fix run per file with a finding. The text summary's count was planned
    # where each file was checked, and is cached with its report.
    fixes, fixable = {}, None
    if options.format == "sarif":
        from gaaudit.output.sarif_fixes import suggest

        fixes = suggest(found, settings, options.unsafe_fixes)
    elif count:
        fixable = sum(r.fixable or 0 for r in reports)
    if stdin is None:
        reports += pin_reports(files, paths, pins, settings)
    run = CheckRun(
        reports=reports,
        files_checked=len(files),
        elapsed=time.perf_counter() - started,
        statistics=options.statistics,
        color=options.output is None and options.format == "text" and use_color(),
        quiet=options.quiet,
        fixes=fixes,
        fixable=fixable,
    )
    if options.output is None:
        write(options.format, run, sys.stdout)
    else:
        with options.output.open("w", encoding="utf-8") as stream:
            write(options.format, run, stream)
    if warning:
        print(f"gaaudit: warning: {warning}", file=sys.stderr)
    if options.exit_zero:
        return EXIT_CLEAN
    return EXIT_ERROR if run.errors else EXIT_FINDINGS if run.findings else EXIT_CLEAN


def _count_fixable(path: Path, settings, data: bytes | None, audited) -> int:
    """`fixes.fixer.count_fixable`, imported only where a file has a fixable finding."""
    from gaaudit.fixes.fixer import count_fixable

    return count_fixable(path, settings, data, audited)


def stdin_target(options: CheckOptions, settings) -> tuple[Path, bytes, bool] | None:
    """For the path `-`: the file it stands for (`--stdin-filename`, else `-`), the bytes
    standard input holds, and whether the project excludes that file; None for other paths."""
    if options.paths != (STDIN,):
        return None
    from gaaudit.discover.files import is_excluded

    path = options.stdin_filename or STDIN
    data = sys.stdin.buffer.read()
    return path, data, path != STDIN and is_excluded(path, settings)


def warn_nothing_found(paths) -> None:
    """Say that the paths given hold no file to check (all excluded, ignored or not Python)."""
    named = ", ".join(p.as_posix() for p in paths)
    print(
        f"gaaudit: warning: no Python files found under {named} (excluded, git-ignored or "
        "none there; --no-respect-gitignore and --force-exclude change what is skipped)",
        file=sys.stderr,
    )


def cache_for(options: CheckOptions, settings):
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


def dependency_files(files: list[Path]) -> list[Path]:
    """The requirements, pyproject.toml, setup.cfg or environment files named on the command
    line (a folder's walk yields only Python files and notebooks)."""
    named = [f for f in files if not f.name.endswith((".py", ".ipynb"))]
    if not named:
        return []
    from gaaudit.checks.versions import is_pin_file

    return [f for f in named if is_pin_file(f)]


def pin_reports(files, paths, pins, settings) -> list:
    """GA006 findings on dependency files, filtered like the per-file ones (none when GA006
    is off or there are no such files to read). A dependency file named on the command line
    is judged against the code of its folder, as when that folder is checked."""
    if not settings.enabled("GA006", "") or not _dependency_files_possible(paths, files):
        return []  # and the imports below are skipped too
    from gaaudit.checks.engine import display_path
    from gaaudit.checks.versions import check_repository
    from gaaudit.discover.files import discover

    folders = [p.parent for p in pins]
    code = [*files, *discover(folders, settings)] if folders else files
    reports = check_repository(code, [p for p in paths if p.is_dir()] + folders)
    for report in reports:
        relative = display_path(Path(report.path), settings.root)
        selected = [f for f in report.findings if settings.enabled(f.code, relative)]
        report.findings = [f for f in selected if f.confidence >= settings.min_confidence]
        report.hidden = len(selected) - len(report.findings)
    return [r for r in reports if r.findings or r.hidden]


def use_color() -> bool:
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ and os.environ.get("TERM") != "dumb"
