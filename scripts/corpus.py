"""Run `check` and `fix` (in memory, never writing) over every `.py` file of large code bases.

    python scripts/corpus.py [--paths DIR ...] [--jobs 2] [--every N]

By default: the installed torch and transformers (found without importing them) and the
Python standard library. Any exception other than `SourceError` is a crash; an unparsable
file is a per-file error and the run goes on. Violations: `fix` changing a file without
findings, a changed file that does not compile, a second `fix` that changes something.
Exits 1 on any crash or violation.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import sysconfig
import time
import traceback
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

from gaaudit.checks.engine import check_file
from gaaudit.config import Settings
from gaaudit.discover.source import SourceError
from gaaudit.findings import Confidence
from gaaudit.fixes.fixer import fix_source

SETTINGS = Settings(min_confidence=Confidence.LOW)
INTERNAL = "internal error"  # how gaaudit words a bug it caught


@dataclass
class Result:
    """What checking and fixing one file showed."""

    path: str
    lines: int = 0
    findings: int = 0
    error: str | None = None
    crashes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Summary:
    """The totals of a run, and every crash and violation by file."""

    files: int = 0
    lines: int = 0
    findings: int = 0
    errors: Counter = field(default_factory=Counter)  # by reason
    crashes: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.crashes and not self.violations


def default_roots() -> list[Path]:
    """torch, transformers (where installed) and the standard library."""
    roots = []
    for name in ("torch", "transformers"):
        spec = importlib.util.find_spec(name)  # a top-level spec: nothing is imported
        if spec is not None and spec.submodule_search_locations:
            roots.extend(Path(location) for location in spec.submodule_search_locations)
    roots.append(Path(sysconfig.get_paths()["stdlib"]))
    return roots


def python_files(roots: list[Path]) -> list[Path]:
    """Regular `.py` files under `roots` (files named are taken as they are), sorted;
    installed packages below the standard library are left out."""
    found = [root for root in roots if root.is_file()]
    for root in (root for root in roots if root.is_dir()):
        for directory, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
            here = Path(directory)
            files = (here / name for name in sorted(filenames) if name.endswith(".py"))
            found.extend(file for file in files if file.is_file() and not file.is_symlink())
    return found


def examine(path: Path) -> Result:
    """Check and fix one file in memory, recording crashes and broken guarantees."""
    started = time.perf_counter()
    result = Result(str(path))
    try:
        data = path.read_bytes()
    except OSError as exc:
        result.error = f"cannot read: {exc}"
        return result
    result.lines = data.count(b"\n")
    try:
        report = check_file(path, SETTINGS)
    except Exception:  # noqa: BLE001 - check_file must never raise: that is the crash reported
        result.crashes.append(f"check raised: {_last_line()}")
        report = None
    if report is not None:
        result.findings = len(report.findings)
        if report.error is not None:
            result.error = report.error.message
            if report.error.message.startswith(INTERNAL):
                result.crashes.append(f"check: {report.error.message}")
    _fix(path, data, result, report is not None and not report.findings)
    result.seconds = time.perf_counter() - started
    return result


def _fix(path: Path, data: bytes, result: Result, clean: bool) -> None:
    """Fix `data` twice in memory; record what breaks a guarantee."""
    try:
        once = fix_source(data, path, SETTINGS, unsafe=True).after
        if once == data:
            return
        if clean:
            result.violations.append("fix changed a file without findings")
        try:
            compile(once, str(path), "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            result.violations.append(f"the fixed file does not compile: {exc}")
            return
        if fix_source(once, path, SETTINGS, unsafe=True).after != once:
            result.violations.append("a second fix changed the file again")
    except SourceError as exc:
        if exc.message.startswith(INTERNAL):
            result.crashes.append(f"fix: {exc.message}")
        else:
            result.error = result.error or exc.message
    except Exception:  # noqa: BLE001 - any other exception is the crash reported
        result.crashes.append(f"fix raised: {_last_line()}")


def _last_line() -> str:
    """The exception being handled and where it was raised."""
    frames = traceback.extract_tb(sys.exc_info()[2])
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    kind, value = sys.exc_info()[:2]
    return f"{kind.__name__}: {value}{where}"[:500]


def run(files: list[Path], jobs: int = 2) -> Summary:
    """Examine `files` in `jobs` worker processes and total the results."""
    summary = Summary(files=len(files))
    started = time.perf_counter()
    done: set[str] = set()
    try:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for result in pool.map(examine, files, chunksize=8):
                done.add(result.path)
                _add(summary, result)
    except BrokenProcessPool:
        left = [str(p) for p in files if str(p) not in done]
        summary.crashes.append(
            f"a worker process died (a segfault?) on one of {len(left)} files, from {left[0]}"
        )
    summary.slowest = sorted(summary.slowest, reverse=True)[:5]
    summary.seconds = time.perf_counter() - started
    return summary


def _add(summary: Summary, result: Result) -> None:
    summary.lines += result.lines
    summary.findings += result.findings
    if result.error is not None:
        summary.errors[result.error.split(":")[0].split(" (")[0]] += 1
    summary.crashes += [f"{result.path}: {crash}" for crash in result.crashes]
    summary.violations += [f"{result.path}: {violation}" for violation in result.violations]
    summary.slowest.append((result.seconds, result.path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--paths",
        nargs="+",
        type=Path,
        help="directories or files [default: torch, transformers and the standard library]",
    )
    parser.add_argument("--jobs", type=int, default=2, help="worker processes [default: 2]")
    parser.add_argument("--every", type=int, default=1, help="examine every N-th file only")
    args = parser.parse_args(argv)
    roots = args.paths or default_roots()
    files = python_files(roots)[:: args.every]
    print("roots:", *roots, sep="\n  ")
    summary = run(files, args.jobs)
    print(
        f"files {summary.files}  lines {summary.lines}  findings {summary.findings}  "
        f"errors {summary.errors.total()}  crashes {len(summary.crashes)}  "
        f"violations {len(summary.violations)}  time {summary.seconds:.1f}s"
    )
    reasons = (f"{count:5}  {reason}" for reason, count in summary.errors.most_common())
    print("errors:", *reasons, sep="\n  ")
    print("slowest:", *(f"{seconds:.2f}s {path}" for seconds, path in summary.slowest), sep="\n  ")
    for title, items in (("crashes", summary.crashes), ("violations", summary.violations)):
        if items:
            print(f"{title}:", *items, sep="\n  ")
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
