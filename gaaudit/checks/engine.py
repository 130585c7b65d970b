"""The check pipeline for one file, and for many files through the cache and bounded workers."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from gaaudit import cache
from gaaudit.config import Settings
from gaaudit.discover.source import Source, SourceError, parse, read
from gaaudit.findings import FileError, FileReport

# Below this many files to read, a worker pool costs more than it saves.
PARALLEL_THRESHOLD = 64
TASK_FILES, TASK_BYTES = 16, 1 << 20  # a worker's task: this many files or bytes, at most
IN_FLIGHT = 4  # tasks queued per worker: enough to keep it busy, few enough to stay small
YOUNG_OBJECTS = 50_000  # allocations between collections of the youngest generation

Result = tuple[Path, FileReport, "cache.Entry | None"]


@dataclass(frozen=True)
class Audited:
    """`check`'s analysis of a whole file (not a focused copy of it), which `fix` plans on
    instead of parsing and auditing the same bytes again."""

    data: bytes
    module: object  # a libcst.Module: engine imports neither libcst nor typing for a clean file
    context: object  # its checks.context.Context
    findings: list


# how many findings of a file (or of its text) `gaaudit fix` would fix, from `check`'s
# analysis where it has one: a module-level function, which workers receive by name
FixableCount = Callable[[Path, Settings, "bytes | None", "Audited | None"], int]


def display_path(path: Path, root: Path | None = None) -> str:
    """A path relative to `root` (default: the current directory) when under it, with `/`."""
    return _relative(path, _real(os.path.abspath(root if root is not None else os.getcwd())))


def _relative(path: Path, base: str) -> str:
    """`display_path` against a base already resolved."""
    try:
        real = _real(os.fspath(path))
    except (OSError, ValueError):
        return path.as_posix()
    if real == base:
        return "."
    prefix = base if base.endswith(os.sep) else base + os.sep
    if real.startswith(prefix):
        return real[len(prefix) :].replace(os.sep, "/")
    return path.as_posix()


def _real(path: str) -> str:
    """`os.path.realpath`, resolving each folder once per process (it costs a system call
    per part of the path, on every file of a large tree)."""
    folder, name = os.path.split(os.path.abspath(path))
    if ".." in path.split(os.sep) or os.path.islink(path):
        return os.path.realpath(path)
    return os.path.join(_real_folder(folder), name)


@lru_cache(maxsize=1024)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def check_file(path: Path, settings: Settings, data: bytes | None = None) -> FileReport:
    """Read (or take `data`, its text from standard input), prefilter, parse and audit one
    file; never raises for a bad file."""
    return _read_and_analyse(path, settings, data)[0]


def _read_and_analyse(
    path: Path, settings: Settings, data: bytes | None = None
) -> tuple[FileReport, Audited | None]:
    """`check_file`'s report, and its analysis where it covers the whole file."""
    shown = display_path(path)
    try:
        source = read(path, data)
    except SourceError as exc:
        return FileReport(shown, error=FileError(shown, exc.message, exc.line, exc.column)), None
    report, _, audited = _analyse(source, settings, shown)
    return report, audited


def check_recorded(
    path: Path, settings: Settings, known: cache.Entry | None, count: FixableCount | None = None
) -> Result:
    """`check_file`, and the cache entry that records its report. `known` is the file's
    entry from an earlier run: when the file's bytes and dependencies are the same, its
    report is reused without analysis. `count`: with the findings `gaaudit fix` would fix
    (`counted`)."""
    shown = display_path(path)
    signed = cache.signature(path)  # before reading: a later change shows next time
    try:
        source = read(path)
    except SourceError as exc:  # not recorded: reading may work next time
        return (
            path,
            FileReport(shown, error=FileError(shown, exc.message, exc.line, exc.column)),
            None,
        )
    content = cache.digest(source.data)
    if known is not None and known.digest == content and cache.unchanged(known.dependencies):
        report = known.report(shown)
        if count and report.fixable is None:
            report = counted(path, report, settings, count)
        return path, report, replace(known, signature=signed, fixable=report.fixable)
    named = cache.named_files(source.data, path.parent)  # signed before the analysis reads them
    report, found, audited = _analyse(source, settings, shown)
    if count:
        report = counted(path, report, settings, count, audited=audited)
    return path, report, cache.record(signed, content, report, [*named, *cache.signed(found)])


def counted(
    path: Path,
    report: FileReport,
    settings: Settings,
    count: FixableCount,
    data: bytes | None = None,
    audited: Audited | None = None,
) -> FileReport:
    """The report with how many of its findings a safe `gaaudit fix` would fix, as `count`
    (the fixer's, handed down: checks come before fixes) plans them for the file, on
    `audited`, the check's analysis, where there is one; in the worker that checked it,
    cached with the report."""
    fixable = any(f.fixable for f in report.findings)
    report.fixable = count(path, settings, data, audited) if fixable else 0
    return report


def _analyse(source: Source, settings: Settings, shown: str):
    """The report on a file's bytes, the other files the report depends on, and the analysis
    where it covers the whole file (`Audited`; None for a focused copy or a notebook)."""
    path = source.path
    notebook, notes = None, ()
    try:
        if path.suffix == ".ipynb":
            from gaaudit.discover.notebook import load as load_notebook

            notebook = load_notebook(source.data)
            notes = tuple(f"cell {cell}: {reason}" for cell, reason in notebook.skipped)
            source = Source(path, notebook.text.encode("utf-8"))
        if not source.may_have_findings:
            return FileReport(shown, notes=notes), frozenset(), None
        from gaaudit.discover.screen import screen

        screened = screen(source.data, settings.accumulation_names, path.parent)
        if screened.data is None:
            return FileReport(shown, notes=notes), screened.dependencies, None
        module = parse(screened.data, screened.tree)
        text = source.data.decode(module.encoding)
        relative = display_path(path, settings.root)
        context, findings, hidden = audit(
            module, text, shown, relative, settings, path.parent, source=screened.data
        )
        findings = [notebook.relocate(f) for f in findings] if notebook else findings
        report = FileReport(shown, findings, hidden=hidden, notes=notes)
        whole = notebook is None and screened.data == source.data
        audited = Audited(source.data, module, context, findings) if whole else None
        return report, screened.dependencies | context.dependencies, audited
    except SourceError as exc:
        if notebook is not None:
            exc = notebook.relocate_error(exc)
        error = FileError(shown, exc.message, exc.line, exc.column)
    except RecursionError:
        error = FileError(shown, "code nested too deeply to analyse")
    except Exception as exc:  # noqa: BLE001 - a gaaudit bug must not end the run for other files
        message = f"internal error ({type(exc).__name__}); the file was skipped, please report this"
        error = FileError(shown, message)
    return FileReport(shown, error=error), frozenset(), None


def audit(
    module,
    text: str,
    shown: str,
    relative: str,
    settings: Settings,
    directory: Path,
    source: bytes | None = None,
):
    """The analysis context of a parsed module, its findings that pass selection, confidence
    and suppressions, and how many more only the confidence held back.

    `shown` is the path as reported; `relative` is relative to the settings' root,
    which is what per-file-ignores globs match. `source`: the bytes parsed into `module`
    (perhaps focused, not `text`), from which node positions are found cheaply.
    """
    from gaaudit.analysis.tree import Tree
    from gaaudit.checks.context import Context, run

    context = Context(Tree(module, source), shown, text, settings.accumulation_names, directory)
    selected = [
        finding
        for finding in run(context)
        if settings.enabled(finding.code, relative)
        and not context.evidence.suppressed(finding.span.line, finding.code)
    ]
    findings = [f for f in selected if f.confidence >= settings.min_confidence]
    return context, findings, len(selected) - len(findings)


def check_files(
    files: Iterable[Path],
    settings: Settings,
    jobs: int | None = None,
    store: cache.Cache | None = None,
    count: FixableCount | None = None,
) -> Iterator[tuple[Path, FileReport]]:
    """Each file with its report, as files finish (not in input order); with `count`, each
    report says how many of its findings `gaaudit fix` would fix.

    With a cache `store`, a file whose entry still holds is answered without being read,
    and every other report is recorded in it. More than a handful of files to read go to
    at most `jobs` worker processes with a bounded number of tasks in flight, so that
    memory stays flat however large the tree.
    """
    jobs = jobs or os.cpu_count() or 1
    here = os.path.realpath(os.getcwd())
    work: list[tuple[Path, cache.Entry | None]] = []
    for path in files:
        known = store.get(path) if store is not None else None
        if known is not None and store.fresh(path, known) and not (count and known.fixable is None):
            yield path, known.report(_relative(path, here))
        else:
            work.append((path, known))
    previous = gc.get_threshold()
    _collect_less()
    try:
        if jobs == 1 or len(work) < PARALLEL_THRESHOLD:
            results: Iterable[Result] = _check_chunk(work, settings, store is not None, count)
        else:
            results = _in_workers(work, settings, store is not None, count, jobs)
        for path, report, entry in results:
            if store is not None:
                store.put(path, entry)
            yield path, report
    finally:
        gc.set_threshold(*previous)


def _check_chunk(
    chunk: list[tuple[Path, cache.Entry | None]],
    settings: Settings,
    recording: bool,
    count: FixableCount | None,
) -> Iterator[Result]:
    for path, known in chunk:
        if recording:
            yield check_recorded(path, settings, known, count)
        else:
            report, audited = _read_and_analyse(path, settings)
            if count:
                report = counted(path, report, settings, count, audited=audited)
            yield path, report, None


def _checked(chunk, settings: Settings, recording: bool, count: FixableCount | None) -> list[tuple]:
    """A worker's task: the reports and cache entries of a chunk of files, in its order
    (not its paths, which the main process holds: rebuilding paths costs it more than
    reading the results)."""
    checked = _check_chunk(chunk, settings, recording, count)
    return [(report, entry) for _, report, entry in checked]


def _in_workers(
    work: list[tuple[Path, cache.Entry | None]],
    settings: Settings,
    recording: bool,
    count: FixableCount | None,
    jobs: int,
) -> Iterator[Result]:
    """Results from `jobs` worker processes, at most `IN_FLIGHT` tasks per worker queued."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    others = set(multiprocessing.active_children())  # processes not the pool's
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_start_worker)
    tasks: dict = {}  # future -> its chunk

    def finished() -> Iterator[Result]:
        done, _ = wait(tasks, return_when=FIRST_COMPLETED)
        for future in done:
            chunk = tasks.pop(future)
            for (path, _), (report, entry) in zip(chunk, future.result()):
                yield path, report, entry

    try:
        for task in _tasks(work):
            if len(tasks) >= jobs * IN_FLIGHT:
                yield from finished()
            tasks[pool.submit(_checked, task, settings, recording, count)] = task
        while tasks:
            yield from finished()
    except BaseException:  # Ctrl-C, or the reader left: stop the workers mid-task, at once
        for worker in set(multiprocessing.active_children()) - others:  # they only analyse
            worker.terminate()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _tasks(work: list[tuple[Path, cache.Entry | None]]) -> Iterator[list]:
    """`work` cut into tasks, largest files first: a long file started last would leave the
    other workers idle at the end of the run."""
    task, size = [], 0
    for length, item in sorted(((_size(item[0]), item) for item in work), key=lambda s: -s[0]):
        task.append(item)
        size += length
        if len(task) == TASK_FILES or size >= TASK_BYTES:
            yield task
            task, size = [], 0
    if task:
        yield task


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _start_worker() -> None:
    """Workers leave Ctrl-C to the main process, which stops them cleanly, and collect
    garbage as seldom as it does."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _collect_less()


def _collect_less() -> None:
    """Run the cyclic garbage collector less often. Parsing makes millions of objects and
    almost no cycles: at Python's default threshold the collector takes a tenth of a
    large run, tracing the trees over and over."""
    gc.set_threshold(YOUNG_OBJECTS, *gc.get_threshold()[1:])
