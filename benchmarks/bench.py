"""Time `gaaudit check` against ruff, TorchFix and Fixit on a large corpus; print a table.

    python benchmarks/bench.py [--corpus PATH ...] [--repeat N] [--skip-torchfix]

The default corpus is the installed `transformers` and `torch` packages (found without
importing them). Every tool runs N times on the same files; the table shows medians. Tools
much slower than gaaudit (TorchFix, Fixit) run on a deterministic sample (every k-th file in
path order) and their time is extrapolated to the whole corpus by lines; the table says so.
Peak RSS is that of the largest process of each run (os.wait4). TorchFix and Fixit pin
libcst and click versions of their own: install them into a separate virtualenv and put its
`bin` on PATH. This is a script that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
SAMPLE_LINES = 60_000  # lines the slow tools see per run
LATENCY_RUNS = 10
BUGGY_LINES = 500
GAAUDIT_CHECK = (sys.executable, "-m", "gaaudit", "check")


@dataclass
class Run:
    """One process: wall seconds, peak RSS of its largest process (bytes), exit status."""

    seconds: float
    peak_rss: int
    returncode: int


@dataclass
class Result:
    """A tool's median over the repetitions, scaled to the whole corpus when sampled."""

    tool: str
    seconds: float
    peak_rss: int
    scale: float = 1.0  # corpus lines / lines it ran on
    note: str = ""


def measure(command: list[str]) -> Run:
    """Run `command` with its output discarded; time it and read its rusage."""
    started = time.perf_counter()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    process = subprocess.Popen(command, **quiet)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    return Run(seconds, usage.ru_maxrss * 1024, process.returncode)


def repeated(command: list[str], repeat: int, ok: tuple[int, ...]) -> tuple[float, int, str]:
    """Median seconds, largest peak RSS, and a note if an exit status was unexpected."""
    runs = [measure(command) for _ in range(repeat)]
    codes = sorted({r.returncode for r in runs} - set(ok))
    note = f"exit status {codes}" if codes else ""
    return statistics.median(r.seconds for r in runs), max(r.peak_rss for r in runs), note


def default_corpus() -> list[Path]:
    """The installed transformers and torch package folders."""
    found = []
    for name in ("transformers", "torch"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            sys.exit(f"bench: {name} is not installed; pass --corpus PATH")
        found.append(Path(next(iter(spec.submodule_search_locations))))
    return found


def python_files(roots: list[Path]) -> list[tuple[Path, int]]:
    """Every `.py` file under `roots` with its line count, in path order."""
    files = []
    for root in roots:
        paths = [root] if root.is_file() else root.rglob("*.py")
        for path in paths:
            with path.open("rb") as handle:
                files.append((path, sum(1 for _ in handle)))
    return sorted(files)


def sample(files: list[tuple[Path, int]]) -> list[tuple[Path, int]]:
    """Every k-th file, k chosen so the sample holds about `SAMPLE_LINES` lines."""
    total = sum(lines for _, lines in files)
    step = max(1, round(total / SAMPLE_LINES))
    return files[::step]


def executable(name: str) -> str | None:
    """`name` on PATH or beside this interpreter."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def version(command: list[str]) -> str:
    """The last word of the first line a `--version` command prints."""
    output = subprocess.run(command, capture_output=True, text=True, check=False).stdout.split("\n")
    return (output[0].split() or ["?"])[-1]


def gaaudit_files_checked(corpus: list[Path]) -> int:
    """Files gaaudit checks in `corpus` (an untimed run that also warms the file cache)."""
    command = [*GAAUDIT_CHECK, *map(str, corpus), "--exit-zero", "--format", "json"]
    output = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return json.loads(output)["summary"]["files_checked"]


def buggy_script(directory: Path) -> Path:
    """A training script of about `BUGGY_LINES` lines: GA001 fixtures one after another."""
    parts, lines = [], 0
    for fixture in sorted(FIXTURES.glob("ga001_*.py")):
        if lines >= BUGGY_LINES or fixture.name.endswith(".fixed.py"):
            continue
        text = fixture.read_text()
        parts.append(text)
        lines += text.count("\n")
    path = directory / "train.py"
    path.write_text("\n".join(parts))
    return path


def latency(path: Path) -> float:
    """Median wall time of `gaaudit check FILE`, interpreter start included."""
    command = [*GAAUDIT_CHECK, str(path), "--exit-zero", "-q"]
    return statistics.median(measure(command).seconds for _ in range(LATENCY_RUNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", nargs="+", type=Path, help="files or folders [default: transformers, torch]"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool [default: 3]")
    parser.add_argument("--skip-torchfix", action="store_true", help="do not time TorchFix")
    args = parser.parse_args()

    corpus = [p.resolve() for p in args.corpus] if args.corpus else default_corpus()
    files = python_files(corpus)
    total_files, total_lines = len(files), sum(lines for _, lines in files)
    few = sample(files)
    few_lines = sum(lines for _, lines in few)
    few_paths = [str(path) for path, _ in few]
    load_before = os.getloadavg()
    checked = gaaudit_files_checked(corpus)

    results = []
    command = [*GAAUDIT_CHECK, *map(str, corpus), "--exit-zero", "-q"]
    seconds, rss, note = repeated(command, args.repeat, (0,))
    results.append(Result("gaaudit", seconds, rss, note=f"{checked} files checked {note}".strip()))
    versions = {"gaaudit": version([sys.executable, "-m", "gaaudit", "--version"])}
    ruff = executable("ruff")
    if ruff:
        versions["ruff"] = version([ruff, "--version"])
        command = [ruff, "check", "--no-cache", "--exit-zero", "-q", *map(str, corpus)]
        seconds, rss, note = repeated(command, args.repeat, (0,))
        results.append(Result("ruff (default rules)", seconds, rss, note=note))
    slow = []
    torchfix = None if args.skip_torchfix else executable("torchfix")
    if torchfix:
        slow.append(("torchfix", [torchfix, "--version"], [torchfix, *few_paths], (0, 1)))
    fixit = executable("fixit")
    if fixit:
        slow.append(("fixit", [fixit, "--version"], [fixit, "lint", *few_paths], (0, 1, 2)))
    for name, ask_version, command, ok in slow:
        versions[name] = version(ask_version)
        seconds, rss, note = repeated(command, args.repeat, ok)
        where = (
            f"sample of {len(few)} files, {few_lines} lines, extrapolated by lines"
            if len(few) < total_files
            else ""
        )
        scale = total_lines / few_lines
        results.append(Result(name, seconds, rss, scale, f"{where} {note}".strip()))

    with tempfile.TemporaryDirectory() as scratch:
        buggy = buggy_script(Path(scratch))
        clean_latency = latency(FIXTURES / "ok_single_step_no_accumulation.py")
        buggy_latency = latency(buggy)
        buggy_lines = buggy.read_text().count("\n")
    load_after = os.getloadavg()

    print(f"corpus: {', '.join(map(str, corpus))}")
    print(f"        {total_files} .py files, {total_lines} lines; medians of {args.repeat} runs")
    python = f"{platform.python_implementation()} {platform.python_version()}"
    print(f"machine: {python}, {os.cpu_count()} CPUs, "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print("versions: " + ", ".join(f"{name} {number}" for name, number in versions.items()))
    tools = (("ruff", ruff), ("torchfix", torchfix), ("fixit", fixit))
    missing = ", ".join(name for name, found in tools if not found)
    if missing:
        print(f"not timed: {missing}" + (" (--skip-torchfix)" if args.skip_torchfix else ""))
    print()
    print("| tool | wall (s) | files/s | lines/s | peak RSS (MiB) | note |")
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        wall = r.seconds * r.scale
        print(f"| {r.tool} | {wall:.2f} | {total_files / wall:.0f} | {total_lines / wall:.0f} "
              f"| {r.peak_rss / 2**20:.0f} | {r.note} |")
    base = results[0].seconds
    print()
    for r in results[1:]:
        wall = r.seconds * r.scale
        if r.tool.startswith("ruff"):
            print(f"gaaudit / {r.tool}: {base / wall:.1f}x the time")
        else:
            print(f"{r.tool} / gaaudit: {wall / base:.1f}x the time")
    print()
    print("| `python -m gaaudit check FILE`, interpreter start included | median of 10 (s) |")
    print("|---|---:|")
    print(f"| clean, fixtures/ok_single_step_no_accumulation.py | {clean_latency:.2f} |")
    print(f"| buggy, {buggy_lines} lines (the GA001 fixtures concatenated) | {buggy_latency:.2f} |")


if __name__ == "__main__":
    main()
