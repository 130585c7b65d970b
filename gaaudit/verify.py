"""`gaaudit verify`: replay each accumulation loop of a file, original and patched, against
one full-batch step on a tiny real model (GA-GUIDE section 6).

The static half (which loops, which divisors, the patched source) runs here without torch.
The replay runs in a child process (`python -m gaaudit.verify`), so that a hanging or
crashing user loop is stopped by a timeout and cannot take gaaudit down.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import libcst as cst

from gaaudit.config import Settings
from gaaudit.findings import Confidence
from gaaudit.source import parse, read

VERIFIED, REPRODUCED = "verified", "bug reproduced"


@dataclass(frozen=True)
class Target:
    """One statement to replay: where it starts in the original and in the patched source."""

    line: int
    patched_line: int | None
    header: str
    divisors: tuple[str, ...]


@dataclass
class Outcome:
    """The replay verdicts of one loop, one row per window size K."""

    line: int
    header: str
    rows: list[dict] = field(default_factory=list)  # k, original_error, patched_error, verdict

    @property
    def verdict(self) -> str:
        verdicts = [row["verdict"] for row in self.rows]
        if verdicts and all(v == VERIFIED for v in verdicts):
            return VERIFIED
        return next((v for v in verdicts if v != VERIFIED), "not replayable: nothing ran")


@dataclass(frozen=True)
class Options:
    """How to replay: window sizes, device, dtype, seed, per-file timeout."""

    ks: tuple[int, ...] = (2, 4, 8)
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    timeout: float = 120.0


def targets(original: bytes, patched: bytes, line: int | None = None) -> list[Target]:
    """The statements holding the file's accumulation windows (all confidences)."""
    from gaaudit.checks.accumulation import Auditor
    from gaaudit.tree import Tree, code

    tree = Tree(parse(original))
    patched_lines = patched.decode("utf-8", "replace").splitlines()
    found: dict[int, Target] = {}
    for site in Auditor(tree).sites():
        statement = _replayed_statement(tree, site)
        if statement is None:
            continue
        start = tree.line(statement)
        if line is not None and not (start <= line <= tree.positions[statement].end.line):
            continue
        header = tree.module.code_for_node(statement).strip().splitlines()[0]
        divisors = {code(d.divisor) for d in site.origin.divisions}
        if site.window.size is not None:
            divisors.add(code(site.window.size))
        previous = found.get(start)
        merged = tuple(sorted(divisors | set(previous.divisors if previous else ())))
        occurrence = _occurrence(tree.module.code.splitlines(), header, start)
        found[start] = Target(start, _find(patched_lines, header, occurrence), header, merged)
    return sorted(found.values(), key=lambda t: t.line)


def _replayed_statement(tree, site) -> cst.CSTNode | None:
    """The loop that holds both the backward calls and the optimizer step, else the function."""
    window = site.window
    anchor = site.backward.call if site.backward.call is not None else site.node
    loops = [a for a in tree.ancestors(anchor) if isinstance(a, (cst.For, cst.While))]
    if window.kind == "micro-loop" and window.loop in loops:
        outer = loops[loops.index(window.loop) + 1 :]  # the loop whose body also steps
        scope = tree.scope_of(window.loop)
        return outer[0] if outer else scope if isinstance(scope, cst.FunctionDef) else window.loop
    if window.kind in ("modulo", "accumulate") and loops:
        return window.loop or loops[-1]
    scope = tree.scope_of(anchor)
    return scope if isinstance(scope, cst.FunctionDef) else None


def _occurrence(lines: list[str], header: str, line: int) -> int:
    return sum(1 for text in lines[: line - 1] if text.strip() == header)


def _find(lines: list[str], header: str, occurrence: int) -> int | None:
    matches = [i for i, text in enumerate(lines, 1) if text.strip() == header]
    return matches[occurrence] if occurrence < len(matches) else None


def verify_file(path: Path, line: int | None, options: Options) -> list[Outcome]:
    """Every loop of a file against what `gaaudit fix` (all confidences, unsafe fixes too)
    would make of it."""
    from gaaudit.fixer import fix_source

    original = read(path).data
    patched = fix_source(original, path, Settings(min_confidence=Confidence.LOW), unsafe=True).after
    return verify_pair(path, original, patched, line, options)


def verify_pair(path: Path, original: bytes, patched: bytes, line: int | None, options: Options) -> list[Outcome]:
    """Plan statically, then replay in a child process bounded by `options.timeout`."""
    planned = targets(original, patched, line)
    if not planned:
        return []
    job = {"original": original.decode("utf-8", "replace"), "patched": patched.decode("utf-8", "replace"),
           "targets": [asdict(t) for t in planned], "options": asdict(options), "filename": str(path)}
    try:
        child = subprocess.run(
            [sys.executable, "-m", "gaaudit.verify"], input=json.dumps(job), capture_output=True,
            text=True, timeout=options.timeout,
        )
    except subprocess.TimeoutExpired:
        return [_failed(t, f"not replayable: timed out after {options.timeout:g} s") for t in planned]
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        return [_failed(t, f"not replayable: the replay process failed ({last})") for t in planned]
    return [Outcome(**row) for row in json.loads(child.stdout)]


def _failed(target: Target, verdict: str) -> Outcome:
    return Outcome(target.line, target.header, [{"k": None, "original_error": None,
                                                  "patched_error": None, "verdict": verdict}])


def _replay(job: dict) -> list[dict]:
    """The child's side: replay every target for every K with the harness."""
    from gaaudit.harness.replay import compare

    options = Options(**{k: tuple(v) if k == "ks" else v for k, v in job["options"].items()})
    outcomes = []
    for raw in job["targets"]:
        target = Target(**{**raw, "divisors": tuple(raw["divisors"])})
        outcome = Outcome(target.line, target.header)
        for k in options.ks:
            if target.patched_line is None:
                outcome.rows.append({"k": k, "original_error": None, "patched_error": None,
                                     "verdict": "not replayable: the patched loop was not found"})
                continue
            result = compare(job["original"], job["patched"], target.line, target.patched_line, k,
                             target.divisors, device=options.device, dtype=options.dtype,
                             seed=options.seed, timeout=options.timeout)
            outcome.rows.append({"k": k, "original_error": result.original.error,
                                 "patched_error": result.patched.error, "verdict": result.verdict,
                                 "original_verdict": result.original.verdict, "dtype": result.dtype})
        outcomes.append(asdict(outcome))
    return outcomes


if __name__ == "__main__":
    print(json.dumps(_replay(json.loads(sys.stdin.read()))))


def report(outcomes: list[Outcome], fmt: str, path: Path) -> int:
    """Print the outcomes; the exit code: 0 all verified, 1 one is not, 2 nothing replayed."""
    if fmt == "json":
        print(json.dumps({"path": path.as_posix(), "loops": [{**asdict(o), "verdict": o.verdict} for o in outcomes]}, indent=2))
    else:
        print(f"{'line':>5}  {'K':>3}  {'original error':>14}  {'patched error':>13}  verdict")
        for outcome in outcomes:
            print(f"{outcome.line:>5}  {outcome.header}")
            for row in outcome.rows:
                print(f"{'':>5}  {row['k'] or '-':>3}  {_number(row['original_error']):>14}  "
                      f"{_number(row['patched_error']):>13}  {row['verdict']}")
        if not outcomes:
            print(f"{path}: no accumulation loop to replay")
    replayed = [o for o in outcomes if not o.verdict.startswith("not replayable")]
    if not replayed:
        return 2
    return 0 if all(o.verdict == VERIFIED for o in outcomes) else 1


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def run_demo(fmt: str, plot: Path | None) -> int:
    """The reference experiment: full batch vs mean/K vs sum-and-count for K = 1..32."""
    from gaaudit.harness.demo import plot as draw
    from gaaudit.harness.demo import run_demo as experiment

    rows = experiment()
    if fmt == "json":
        print(json.dumps([asdict(row) for row in rows], indent=2))
    else:
        print(f"{'K':>3}  {'mean / K':>10}  {'sum and count':>13}")
        for row in rows:
            print(f"{row.k:>3}  {row.mean_over_k:>10.1e}  {row.sum_and_count:>13.1e}")
    if plot is not None:
        draw(rows, str(plot))
    return 0
