"""The check pipeline for one file, and for many files in bounded worker processes."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gaaudit.config import Settings
from gaaudit.findings import FileError, FileReport
from gaaudit.focus import focus
from gaaudit.notebook import load as load_notebook
from gaaudit.source import FOCUS, Source, SourceError, parse, read

# Below this many files, a worker pool costs more than it saves.
PARALLEL_THRESHOLD = 64


def display_path(path: Path, root: Path | None = None) -> str:
    """A path relative to `root` (default: the current directory) when under it, with `/`."""
    base = (root or Path.cwd()).resolve()
    try:
        return path.resolve().relative_to(base).as_posix()
    except (ValueError, OSError, RuntimeError):  # RuntimeError: a symbolic link loop
        return path.as_posix()


def check_file(path: Path, settings: Settings) -> FileReport:
    """Read, prefilter, parse and audit one file; never raises for a bad file."""
    shown = display_path(path)
    notebook = None
    try:
        source = read(path)
        if path.suffix == ".ipynb":
            notebook = load_notebook(source.data)
            source = Source(path, notebook.text.encode("utf-8"))
        if not source.may_have_findings:
            return FileReport(shown)
        module = parse(focus(source.data, FOCUS))
        text = source.data.decode(module.encoding)
        relative = display_path(path, settings.root)
        findings = audit(module, text, shown, relative, settings, path.parent)[1]
        return FileReport(shown, [notebook.relocate(f) for f in findings] if notebook else findings)
    except SourceError as exc:
        if notebook is not None:
            exc = notebook.relocate_error(exc)
        return FileReport(shown, error=FileError(shown, exc.message, exc.line, exc.column))
    except RecursionError:
        return FileReport(shown, error=FileError(shown, "code nested too deeply to analyse"))
    except Exception as exc:  # a bug in gaaudit must not end the run for every other file
        message = f"internal error ({type(exc).__name__}); the file was skipped, please report this"
        return FileReport(shown, error=FileError(shown, message))


def audit(module, text: str, shown: str, relative: str, settings: Settings, directory: Path):
    """The analysis context of a parsed module, and its findings that pass selection,
    confidence and suppressions.

    `shown` is the path as reported; `relative` is relative to the settings' root,
    which is what per-file-ignores globs match.
    """
    from gaaudit.checks import Context, run
    from gaaudit.tree import Tree

    context = Context(Tree(module), shown, text, settings.accumulation_names, directory)
    findings = [
        finding
        for finding in run(context)
        if finding.confidence >= settings.min_confidence
        and settings.enabled(finding.code, relative)
        and not context.evidence.suppressed(finding.span.line, finding.code)
    ]
    return context, findings


def check_files(files: Iterable[Path], settings: Settings, jobs: int | None = None) -> Iterator[FileReport]:
    """Reports in input order; large inputs go to at most `jobs` worker processes."""
    files = list(files)
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1 or len(files) < PARALLEL_THRESHOLD:
        for path in files:
            yield check_file(path, settings)
        return
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_ignore_interrupts)
    try:
        yield from pool.map(check_file, files, [settings] * len(files), chunksize=16)
    finally:  # on Ctrl-C too: drop queued work, let the workers finish their file and exit
        pool.shutdown(wait=True, cancel_futures=True)


def _ignore_interrupts() -> None:
    """Workers leave Ctrl-C to the main process, which stops them cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
