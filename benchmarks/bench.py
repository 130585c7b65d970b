"""Time `gaaudit check` against ruff, TorchFix and Fixit on a large corpus; print tables.

    python benchmarks/bench.py [--corpus PATH ...] [--repeat N] [--slow-repeat N]
                               [--skip-torchfix] [--skip-step]

The default corpus is the installed `transformers` and `torch` packages (found without
importing them). Every tool runs N times on the same files; the tables show medians:

- cold (no cache; gaaudit and ruff `--isolated` take turns run by run, and the ratio is the
  median of their run-by-run ratios) and warm (a second run over the unchanged tree, each
  tool with its own cache) for gaaudit and ruff; TorchFix and Fixit, much slower, run on a deterministic
  sample (every k-th file in path order) and their time is extrapolated by lines;
- gaaudit's peak memory on a quarter, half and all of the corpus: the main process and the
  largest worker apart (files named on the command line, every 4th, 2nd or each file);
- one-file calls of the `gaaudit` console script, interpreter start included, as a
  pre-commit hook makes them: two clean scripts and a buggy one of about 500 lines;
- the step time of a training loop before and after `gaaudit fix` (`step_overhead.py`).

Peak RSS is that of the largest process of a run (os.wait4). Python may write bytecode
(PYTHONDONTWRITEBYTECODE is dropped), as `pip install` compiles it for an installed gaaudit;
the untimed first runs write it. TorchFix and Fixit pin libcst and click versions of their
own: install them into a separate virtualenv and put its `bin` on PATH. This is a script
that prints figures, not a test.
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
LATENCY_RUNS = 15
BUGGY_LINES = 500
CONSOLE = Path(sys.executable).with_name("gaaudit")
GAAUDIT = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "gaaudit"]
# The corpus may sit in a git-ignored virtualenv; ruff checks the folders it is handed there.
CHECK = [*GAAUDIT, "check", "--no-respect-gitignore"]
# Runs gaaudit in this interpreter and reports the peak RSS of the process and its workers.
RSS_PROBE = """
import resource, sys
from gaaudit.__main__ import main
try:
    main()
finally:
    own, workers = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    print(f"RSS {own} {workers}", file=sys.stderr)
"""


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
    return Run(seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status))


def repeated(command: list[str], repeat: int, ok: tuple[int, ...]) -> tuple[float, int, str]:
    """Median seconds, largest peak RSS, and a note if an exit status was unexpected."""
    return summary([measure(command) for _ in range(repeat)], ok)


def alternated(commands: list[list[str]], repeat: int) -> list[list[Run]]:
    """Each command `repeat` times, taking turns run by run, so that a drift of the
    machine's load touches every command alike."""
    runs: list[list[Run]] = [[] for _ in commands]
    for _ in range(repeat):
        for command, own in zip(commands, runs):
            own.append(measure(command))
    return runs


def summary(runs: list[Run], ok: tuple[int, ...]) -> tuple[float, int, str]:
    """Median seconds, largest peak RSS, and a note if an exit status was unexpected."""
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
    output = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return (output.split("\n")[0].split() or ["?"])[-1]


def gaaudit_files_checked(corpus: list[Path]) -> int:
    """Files gaaudit checks in `corpus` (an untimed run that also warms the file cache)."""
    command = [*CHECK, *map(str, corpus), "--no-cache", "--exit-zero", "-f", "json"]
    output = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    return json.loads(output)["summary"]["files_checked"]


def corpus_runs(corpus, args, scratch: Path) -> tuple[list[Result], dict[str, str], list[str]]:
    """gaaudit and ruff cold (taking turns) and warm, then the slow tools on a sample; also
    the cold ratio, the median of gaaudit's time over ruff's run by run."""
    paths = list(map(str, corpus))
    checked = gaaudit_files_checked(corpus)
    results, ratios = [], []
    versions = {"gaaudit": version([*GAAUDIT, "--version"])}
    cold = [*CHECK, *paths, "--exit-zero", "-q", "--no-cache"]
    ruff = executable("ruff")
    ruff_cold = [ruff, "check", "--isolated", "--no-cache", "--exit-zero", "-q", *paths]
    runs = alternated([cold, ruff_cold] if ruff else [cold], args.repeat)
    seconds, rss, note = summary(runs[0], (0,))
    results.append(
        Result("gaaudit, cold", seconds, rss, note=f"{checked} files checked {note}".strip())
    )
    if ruff:
        versions["ruff"] = version([ruff, "--version"])
        seconds, rss, note = summary(runs[1], (0,))
        results.append(Result("ruff (default rules), cold", seconds, rss, note=note))
        pairs = statistics.median(ours.seconds / theirs.seconds for ours, theirs in zip(*runs))
        ratios.append(f"gaaudit / ruff, cold, run by run: {pairs:.2f}x the time (median)")
    warm = [*CHECK, *paths, "--exit-zero", "-q", "--cache-dir", str(scratch / "gaaudit")]
    measure(warm)  # fills the cache
    seconds, rss, note = repeated(warm, args.repeat, (0,))
    results.append(Result("gaaudit, warm cache", seconds, rss, note=note))
    if ruff:
        cached = [ruff, "check", "--exit-zero", "-q", *paths, "--cache-dir", str(scratch / "ruff")]
        measure(cached)
        seconds, rss, note = repeated(cached, args.repeat, (0,))
        results.append(Result("ruff (default rules), warm cache", seconds, rss, note=note))
    files = python_files(corpus)
    total_lines = sum(lines for _, lines in files)
    few = sample(files)
    few_lines = sum(lines for _, lines in few)
    few_paths = [str(path) for path, _ in few]
    slow = []
    torchfix = None if args.skip_torchfix else executable("torchfix")
    if torchfix:
        slow.append(("torchfix", [torchfix, "--version"], [torchfix, *few_paths], (0, 1)))
    fixit = executable("fixit")
    if fixit:
        slow.append(("fixit", [fixit, "--version"], [fixit, "lint", *few_paths], (0, 1, 2)))
    for name, ask_version, command, ok in slow:
        versions[name] = version(ask_version)
        seconds, rss, note = repeated(command, args.slow_repeat, ok)
        where = f"sample of {len(few)} files, {few_lines} lines, extrapolated by lines"
        scale = total_lines / few_lines
        results.append(Result(name, seconds, rss, scale, f"{where} {note}".strip()))
    return results, versions, ratios


def corpus_table(results: list[Result], files: int, lines: int, ratios: list[str]) -> list[str]:
    out = [
        "| tool | wall (s) | files/s | lines/s | peak RSS (MiB) | note |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        wall = r.seconds * r.scale
        out.append(
            f"| {r.tool} | {wall:.2f} | {files / wall:.0f} | {lines / wall:.0f} "
            f"| {r.peak_rss / 2**20:.0f} | {r.note} |"
        )
    by_tool = {r.tool: r.seconds * r.scale for r in results}
    out.append("")
    out += ratios
    ours, ruff = by_tool.get("gaaudit, warm cache"), by_tool.get("ruff (default rules), warm cache")
    if ours and ruff:
        out.append(f"gaaudit / ruff, warm cache: {ours / ruff:.2f}x the time (medians)")
    for name in ("torchfix", "fixit"):
        if name in by_tool:
            out.append(
                f"{name} / gaaudit (cold): {by_tool[name] / by_tool['gaaudit, cold']:.0f}x the time"
            )
    return out


def memory_table(files: list[tuple[Path, int]]) -> list[str]:
    """Peak RSS of gaaudit's main process and of its largest worker on growing parts of the
    corpus (files named on the command line, no cache; one run each)."""
    out = [
        (
            "| part of the corpus | files | lines | wall (s) | main process peak RSS (MiB) "
            "| largest worker peak RSS (MiB) |"
        ),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, step in (("a quarter", 4), ("a half", 2), ("all", 1)):
        part = files[::step]
        command = [sys.executable, "-c", RSS_PROBE, "check", "--no-cache", "--exit-zero", "-q"]
        command += [str(path) for path, _ in part]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        own, workers = map(int, done.stderr.rsplit("RSS ", 1)[1].split())
        lines = sum(n for _, n in part)
        out.append(
            f"| {label} | {len(part)} | {lines} | {wall:.2f} | {own / 1024:.0f} | {workers / 1024:.0f} |"
        )
    return out


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


def latency(command: list[str], cwd: Path) -> float:
    """Median wall seconds of `command` run in `cwd`."""
    runs = []
    for _ in range(LATENCY_RUNS):
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, capture_output=True, check=False)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def latency_table(scratch: Path) -> list[str]:
    """One-file calls in a project folder of their own (no configuration), as a hook runs."""
    project = scratch / "project"
    project.mkdir()
    shutil.copy(FIXTURES / "ok_eval_only_mean.py", project / "evaluate.py")
    shutil.copy(FIXTURES / "ok_single_step_no_accumulation.py", project / "train_plain.py")
    buggy = buggy_script(project)
    lines = buggy.read_text().count("\n")
    start = latency([sys.executable, "-c", "pass"], project)
    out = [
        (
            f"| `{' '.join([Path(GAAUDIT[0]).name, *GAAUDIT[1:]])} check FILE`, interpreter start "
            f"included | median of {LATENCY_RUNS} (ms) |"
        ),
        "|---|---:|",
        f"| the interpreter alone (`python -c pass`) | {start * 1e3:.0f} |",
    ]
    scripts = (
        ("clean script without backward or step (evaluation)", "evaluate.py"),
        ("clean training script, one step per batch (no accumulation)", "train_plain.py"),
        (f"buggy training script, {lines} lines", buggy.name),
    )
    for label, name in scripts:
        cold = latency([*GAAUDIT, "check", "--no-cache", "--exit-zero", "-q", name], project)
        command = [*GAAUDIT, "check", "--exit-zero", "-q", name]
        subprocess.run(command, cwd=project, capture_output=True, check=False)  # fills the cache
        warm = latency(command, project)
        out.append(f"| {label}, no cache | {cold * 1e3:.0f} |")
        out.append(f"| {label}, unchanged since the last run (cache) | {warm * 1e3:.0f} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus", nargs="+", type=Path, help="files or folders [default: transformers, torch]"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per tool [default: 3]")
    parser.add_argument(
        "--slow-repeat", type=int, default=1, help="runs of TorchFix and Fixit [default: 1]"
    )
    parser.add_argument("--skip-torchfix", action="store_true", help="do not time TorchFix")
    parser.add_argument("--skip-step", action="store_true", help="do not time the training loop")
    args = parser.parse_args()
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

    corpus = [p.resolve() for p in args.corpus] if args.corpus else default_corpus()
    files = python_files(corpus)
    total_files, total_lines = len(files), sum(lines for _, lines in files)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        results, versions, ratios = corpus_runs(corpus, args, Path(scratch))
        memory = memory_table(files)
        latencies = latency_table(Path(scratch))
    step = []
    if not args.skip_step:
        sys.path.insert(0, str(Path(__file__).parent))
        from step_overhead import run as step_run

        step = step_run(None, rounds=30, windows=8, k=4)
    load_after = os.getloadavg()

    print(f"corpus: {', '.join(map(str, corpus))}")
    print(f"        {total_files} .py files, {total_lines} lines; medians of {args.repeat} runs")
    python = f"{platform.python_implementation()} {platform.python_version()}"
    print(
        f"machine: {python}, {os.cpu_count()} CPUs, "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print("versions: " + ", ".join(f"{name} {number}" for name, number in versions.items()))
    for section in (
        corpus_table(results, total_files, total_lines, ratios),
        memory,
        latencies,
        step,
    ):
        if section:
            print()
            print("\n".join(section))


if __name__ == "__main__":
    main()
