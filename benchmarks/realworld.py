"""Score gaaudit on labelled files of public training repositories.

    python benchmarks/realworld.py restore MIRROR_ROOT [--trees DIR]
    python benchmarks/realworld.py score [--trees DIR] [--only REPO ...]
    python benchmarks/realworld.py fixes [--trees DIR] [--only REPO ...]
    python benchmarks/realworld.py verdicts [--trees DIR] [--only REPO ...] [--each]
    python benchmarks/realworld.py sweep [--trees DIR] [--only REPO ...]

`manifest.jsonl` (beside this script, in `realworld/`) holds one labelled file a row: repo,
commit, path, label, lines, loss_source, data_path, reason, framework. `restore` exports the
text files of each labelled commit from git snapshots under MIRROR_ROOT (`owner+name/...`, as
the library's `fetch` leaves them, or `owner/name`) into one tree per repository. `score` runs
`gaaudit check .` at each tree's root, as a user would, and prints precision and recall of the
labelled files' verdicts at the default confidence and at any confidence, per rule, label and
framework, the verdicts that changed since the last run (`realworld/last.json`, rewritten by
every full run), and the wall time. A file is flagged when a finding of gaaudit starts in it,
or when a GA006 finding (a transformers pin without the Trainer's fix) names the Trainer it builds.
The labels judge the loss: findings of the window rules (GA007) are listed apart, for reading.
`fixes` runs `gaaudit fix` (the loss rules) on each labelled file at its tree's root and prints how many buggy
files a safe fix changed, whether they are sound (compile, bind every name they read, hold no
inserted block twice), what `gaaudit verify` says of them, which correct or benign files it changed (it
should change none), and why findings were not fixed; each file is restored afterwards.
`verdicts` runs `gaaudit verify` on each labelled torch-family file and prints how many get a
verdict and how many of those agree with the label, per framework. `sweep` applies every fix
(unsafe ones too, at any confidence) to a copy of each whole tree and names any module a fix
leaves unsound.
This is a script that prints figures, not a test; no repository code is committed.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent / "realworld"
MANIFEST = HERE / "manifest.jsonl"
LAST = HERE / "last.json"
TREES = HERE / "trees"
CONSOLE = Path(sys.executable).with_name("gaaudit")
GAAUDIT = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "gaaudit"]

POSITIVE = ("ga_mean_div_steps", "ga_no_normalization", "jax_multisteps_mean")
NEGATIVE = ("correct_sum_count", "benign_fixed_length", "benign_logging_only", "no_accumulation")
LABELS = (*POSITIVE, *NEGATIVE, "other")
FIELDS = ("repo", "commit", "path", "label", "lines", "loss_source", "data_path", "reason")
FRAMEWORKS = (
    "torch",
    "accelerate",
    "deepspeed",
    "lightning",
    "fabric",
    "hf_trainer",
    "jax",
    "other",
)
# Rules of the accumulation window's shape, not of the loss: the labels do not judge them, so
# they are left out of the verdicts and listed on their own, to be read by hand.
WINDOW_RULES = ("GA007",)
# An unsafe fix, alone or as the way left after a refusal ("...; reading the window ahead:
# unsafe fix (...); apply with --unsafe-fixes"): `--unsafe-fixes` applies it.
UNSAFE = re.compile(r"(?:^|: )unsafe fix \(")
RANK = {"low": 1, "medium": 2, "high": 3}
DEFAULT = "medium"
MAX_BYTES = 2_000_000  # larger blobs are data, not code
TRAINER_SITE = re.compile(r"trainer: .* in (\S+) line \d+$")


@dataclass(frozen=True)
class Row:
    """One labelled file of the manifest."""

    repo: str
    commit: str
    path: str
    label: str
    framework: str
    lines: str = ""  # where the label's reader saw it: "940 (micro-step loop), 949 (...)"

    @property
    def positive(self) -> bool:
        return self.label in POSITIVE

    @property
    def first_line(self) -> int | None:
        found = re.search(r"\d+", self.lines)
        return int(found.group()) if found else None


def load_manifest(path: Path = MANIFEST) -> list[Row]:
    """The manifest's rows; exits naming the line of a malformed one."""
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        data = json.loads(line)
        missing = [field for field in FIELDS if not str(data.get(field, "")).strip()]
        if missing or data["label"] not in LABELS or len(data["commit"]) != 40:
            sys.exit(
                f"{path}:{number}: needs {', '.join(FIELDS)}, a label of {LABELS} and a full sha"
            )
        rows.append(
            Row(
                data["repo"],
                data["commit"],
                data["path"],
                data["label"],
                data.get("framework", "other"),
                str(data.get("lines", "")),
            )
        )
    return rows


def tree_of(trees: Path, repo: str) -> Path:
    return trees / repo.replace("/", "+")


def git_dir(mirrors: Path, repo: str) -> Path | None:
    """The git directory of `repo`'s snapshot under `mirrors`, if there is one."""
    for base in (mirrors / repo.replace("/", "+"), mirrors / repo):
        if not base.is_dir():
            continue
        if (base / "HEAD").is_file() and (base / "objects").is_dir():
            return base
        for head in sorted(base.rglob("HEAD")):
            if (head.parent / "objects").is_dir():
                return head.parent
    return None


def restore(mirrors: Path, trees: Path) -> int:
    """Export each labelled commit's text files into `trees`; returns how many repositories failed."""
    commits = {row.repo: row.commit for row in load_manifest()}
    failed = 0
    for repo, commit in sorted(commits.items()):
        target = tree_of(trees, repo)
        stamp = target / ".realworld-commit"
        if stamp.is_file() and stamp.read_text().strip() == commit:
            continue
        source = git_dir(mirrors, repo)
        if source is None:
            print(f"{repo}: no snapshot under {mirrors}; bring it with the library's `fetch`")
            failed += 1
            continue
        shutil.rmtree(target, ignore_errors=True)
        try:
            count = _export(source, commit, target)
        except subprocess.CalledProcessError as error:
            print(f"{repo}: commit {commit[:12]} not in {source}: {error.stderr.strip()}")
            failed += 1
            continue
        # A repository root of its own, as a user's checkout is: .gitignore files above it
        # (this repository's) do not apply.
        subprocess.run(["git", "init", "-q", str(target)], check=True)
        stamp.write_text(commit + "\n")
        print(f"{repo}: {count} files at {commit[:12]}")
    return failed


def _export(source: Path, commit: str, target: Path) -> int:
    """Write the text blobs of `commit` under `target`; returns their number."""
    git = ["git", f"--git-dir={source}"]
    listing = subprocess.run(
        [*git, "ls-tree", "-r", "-l", "-z", commit], capture_output=True, text=True, check=True
    ).stdout
    blobs = []
    for entry in filter(None, listing.split("\0")):
        meta, name = entry.split("\t", 1)
        mode, kind, sha, size = meta.split()
        if kind == "blob" and mode != "120000" and size.isdigit() and int(size) <= MAX_BYTES:
            blobs.append((sha, name))
    batch = subprocess.run(
        [*git, "cat-file", "--batch"],
        input="".join(f"{sha}\n" for sha, _ in blobs).encode(),
        capture_output=True,
        check=True,
    ).stdout
    offset, count = 0, 0
    for _, name in blobs:
        header_end = batch.index(b"\n", offset)
        size = int(batch[offset:header_end].split()[2])
        data = batch[header_end + 1 : header_end + 1 + size]
        offset = header_end + 1 + size + 1
        if b"\0" in data[:8192]:
            continue
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        count += 1
    return count


def run_gaaudit(tree: Path) -> tuple[dict[str, list[dict]], float, str]:
    """Findings per file (relative path) of `gaaudit check .` at `tree`, its seconds, any error."""
    started = time.perf_counter()
    command = [
        *GAAUDIT,
        "check",
        ".",
        "--format",
        "json",
        "--min-confidence",
        "low",
        "--no-cache",
        "--exit-zero",
    ]
    done = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return (
            {},
            seconds,
            (done.stderr.strip().splitlines() or ["exit " + str(done.returncode)])[-1],
        )
    found: dict[str, list[dict]] = defaultdict(list)
    for finding in json.loads(done.stdout)["findings"]:
        found[os.path.normpath(finding["path"])].append(finding)
        for site in _trainer_sites(finding):
            found[os.path.normpath(site)].append(finding)
    return found, seconds, ""


def _trainer_sites(finding: dict) -> list[str]:
    """The files whose Trainer a GA006 pin finding names (`trainer: ... in PATH line N`)."""
    if finding["code"] != "GA006":
        return []
    return [m.group(1) for e in finding["evidence"] if (m := TRAINER_SITE.match(e))]


def verdict(findings: list[dict], threshold: str) -> list[str]:
    """Sorted codes of the loss rules' findings at or above `threshold`."""
    return sorted(
        {
            f["code"]
            for f in findings
            if RANK[f["confidence"]] >= RANK[threshold] and f["code"] not in WINDOW_RULES
        }
    )


def ratio(part: int, whole: int) -> str:
    return f"{part / whole:.2f}" if whole else "  - "


def table(title: str, groups: dict[str, list[tuple[Row, list[dict]]]]) -> None:
    """Precision and recall per group, at the default confidence and at any."""
    print(f"\n{title:<22} files  pos   P@default R@default   P@any  R@any")
    for name, members in sorted(groups.items()):
        scored = [(row, found) for row, found in members if row.label != "other"]
        cells = []
        for threshold in (DEFAULT, "low"):
            flagged = [row for row, found in scored if verdict(found, threshold)]
            true = sum(row.positive for row in flagged)
            positives = sum(row.positive for row, _ in scored)
            cells += [ratio(true, len(flagged)), ratio(true, positives)]
        positives = sum(row.positive for row, _ in scored)
        print(
            f"{name:<22} {len(members):>5} {positives:>4}   {cells[0]:>9} {cells[1]:>9}   {cells[2]:>5}  {cells[3]:>5}"
        )


def score(trees: Path, only: list[str]) -> int:
    """Run gaaudit on every restored tree and print the figures; returns an exit status."""
    rows = [row for row in load_manifest() if not only or row.repo in only]
    started = time.perf_counter()
    results: dict[str, dict[str, list[dict]]] = {}
    timings: list[tuple[float, str]] = []
    for repo in sorted({row.repo for row in rows}):
        tree = tree_of(trees, repo)
        if not tree.is_dir():
            print(f"{repo}: not restored; run `restore MIRROR_ROOT` first", file=sys.stderr)
            return 2
        results[repo], seconds, error = run_gaaudit(tree)
        timings.append((seconds, repo))
        if error:
            print(f"{repo}: gaaudit failed: {error}", file=sys.stderr)
    wall = time.perf_counter() - started
    scored = [(row, results[row.repo].get(os.path.normpath(row.path), [])) for row in rows]

    labels = defaultdict(list)
    frameworks = defaultdict(list)
    for row, found in scored:
        labels[row.label].append((row, found))
        frameworks[row.framework].append((row, found))
    table("all", {"all": scored})
    print(f"\n{'rule':<22} flagged (positive/negative) at the default   at any   P@default  P@any")
    for code in sorted({code for _, found in scored for code in verdict(found, "low")}):
        cells = []
        for threshold in (DEFAULT, "low"):
            flagged = [
                row
                for row, found in scored
                if code in verdict(found, threshold) and row.label != "other"
            ]
            true = sum(row.positive for row in flagged)
            cells.append((true, len(flagged) - true, ratio(true, len(flagged))))
        (tp, fp, p), (tp_any, fp_any, p_any) = cells
        print(f"{code:<22} {tp:>3}/{fp:<3}{'':>30} {tp_any:>3}/{fp_any:<3}  {p:>9}  {p_any:>5}")
    table("label", labels)
    table("framework", frameworks)

    print("\nwrong verdicts at the default confidence:")
    for row, found in scored:
        flagged = bool(verdict(found, DEFAULT))
        if row.label != "other" and flagged != row.positive:
            kind = "FP" if flagged else "FN"
            shown = (
                ", ".join(f"{f['code']}:{f['confidence']}@{f['line']}" for f in found) or "nothing"
            )
            print(f"  {kind} {row.label:<20} {row.repo}/{row.path}: {shown}")

    now = {
        f"{row.repo}/{row.path}": [f"{f['code']}:{f['confidence']}" for f in found]
        for row, found in scored
    }
    before = json.loads(LAST.read_text()) if LAST.is_file() else {}
    changed = [
        key for key in sorted(now) if key in before and sorted(before[key]) != sorted(now[key])
    ]
    windows = [
        f"{repo}/{path}:{f['line']} {f['code']} {f['confidence']}"
        for repo, files in sorted(results.items())
        for path, found in sorted(files.items())
        for f in found
        if f["code"] in WINDOW_RULES and os.path.normpath(f["path"]) == path
    ]
    print(f"\nwindow findings in the trees ({', '.join(WINDOW_RULES)}), not judged by the labels:")
    for line in windows:
        print(f"  {line}")
    print(f"\nverdicts changed since the last run: {len(changed)}")
    for key in changed:
        print(f"  {key}: {before[key] or 'nothing'} -> {now[key] or 'nothing'}")
    if not only:
        LAST.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")

    slowest = ", ".join(
        f"{repo} {seconds:.1f}s" for seconds, repo in sorted(timings, reverse=True)[:3]
    )
    print(
        f"\n{len(rows)} files of {len(results)} repositories; wall time {wall:.1f}s (slowest: {slowest})"
    )
    return 0


def fixes(trees: Path, only: list[str], each: bool = False) -> int:
    """`gaaudit fix` (its safe fixes, at the default confidence) on each labelled file, run at
    its tree's root as a user would: which files it changed, whether they still compile and
    bind every name they read, and why the findings of buggy files were not fixed; with
    `each`, what happened to each buggy file. Each file, and any module a fix changed with it,
    is put back afterwards."""
    rows = [row for row in load_manifest() if not only or row.repo in only]
    changed: dict[Row, bool] = {}  # -> every module the fix rewrote is sound (`sound`)
    reasons: Counter[str] = Counter()
    outcome: dict[Row, str] = {}  # buggy file -> what fix did
    said: dict[Row, list[str]] = {}  # buggy file -> why its findings were not fixed
    pin_fixes: dict[str, dict[str, list[str]]] = {}  # repository -> `_pin_fixes`
    pin_fixed: dict[Row, list[str]] = {}  # buggy file -> the dependency files a safe fix raised
    started = time.perf_counter()
    for row in rows:
        target = tree_of(trees, row.repo) / row.path
        if not target.is_file():
            print(f"missing: {row.repo}/{row.path} (run `restore`)", file=sys.stderr)
            continue
        root = tree_of(trees, row.repo)
        kept = {path: path.read_bytes() for path in root.rglob("*.py") if path.is_file()}
        before = kept[target] = target.read_bytes()  # a notebook too
        try:
            result = subprocess.run(
                [*GAAUDIT, "fix", "--ignore", ",".join(WINDOW_RULES), row.path],
                check=False,
                cwd=root,
                capture_output=True,
                text=True,
                timeout=600,
            )
            after = target.read_bytes()
        finally:  # the file, and any other module a fix changed with it
            rewritten = {}
            for path, data in kept.items():
                if (now := path.read_bytes()) != data:
                    rewritten[path] = now
                    path.write_bytes(data)
        if after != before:
            changed[row] = all(sound(kept[p], now, str(p)) for p, now in rewritten.items())
        if row.positive:
            why = [
                found.group(1)
                for line in result.stdout.splitlines()
                if (found := re.search(r": GA\d+ not fixed: (.*)$", line))
            ]
            if after == before and not why:  # a pin that names the file's Trainer, if any
                why = pin_fixes.setdefault(row.repo, _pin_fixes(root)).get(row.path, [])
                pinned = sorted({w[len(PIN_FIXED) :] for w in why if w.startswith(PIN_FIXED)})
                if pinned:
                    pin_fixed[row] = pinned
                    why = []
            reasons.update(re.sub(r"`[^`]*`", "`...`", reason)[:100] for reason in why)
            said[row] = why
            outcome[row] = (
                "fixed by a safe fix"
                if after != before
                else "fixed by a safe fix of its transformers pin"
                if row in pin_fixed
                else "only an unsafe fix (--unsafe-fixes)"
                if any(UNSAFE.search(reason) for reason in why)
                else "refused, with the reason"
                if why
                else "no finding gaaudit fixes (GA006 pins, or none at the default)"
            )
    positives = [row for row in rows if row.positive]
    negatives = [row for row in rows if row.label in NEGATIVE]
    fixed = [row for row in positives if row in changed]
    safe = len(fixed) + len(pin_fixed)
    print(f"buggy files            {len(positives):>4}: fixed by a safe fix {safe}", end="")
    print(f" ({ratio(safe, len(positives))}), {len(pin_fixed)} of them by their pin;", end="")
    print(" changed files sound (`sound`): ", end="")
    print(f"{sum(changed[r] for r in fixed)} of {len(fixed)}")
    for what, count in Counter(outcome.values()).most_common():
        print(f"  {count:>3}  {what}")
        if each:
            for row in sorted((r for r in outcome if outcome[r] == what), key=str):
                print(f"         {row.repo}/{row.path}  {'; '.join(said[row])[:150]}")
    verdicts = Counter(replayed(trees, row) for row in fixed)
    verdicts += Counter(_replayed_with_pins(trees, row, pins) for row, pins in pin_fixed.items())
    for verdict, count in verdicts.most_common():
        print(f"  {count:>3}  gaaudit verify: {verdict}")
    wrong = [row for row in negatives if row in changed]
    print(f"correct or benign files {len(negatives):>3}: changed {len(wrong)}")
    for row in wrong:
        print(f"  changed {row.label:<20} {row.repo}/{row.path}")
    print("\nwhy findings of buggy files were not fixed (at the default confidence):")
    for reason, count in reasons.most_common(12):
        print(f"  {count:>3}  {reason}")
    print(f"\n{len(rows)} files; wall time {time.perf_counter() - started:.1f}s")
    return 0


PIN_FIXED = "its transformers pin: "  # how `_pin_fixes` says a pin got a safe fix


def sound(before: bytes, after: bytes, path: str) -> bool:
    """Whether a module a fix rewrote compiles, reads no name that it binds nowhere, where
    the original bound it or never read it (pyflakes, of the test extra), and holds no
    lines twice in a row that the original did not (a block inserted twice)."""
    from pyflakes.checker import Checker
    from pyflakes.messages import UndefinedName

    def unbound(source: bytes) -> set[str]:
        found = Checker(ast.parse(source)).messages
        return {m.message_args[0] for m in found if isinstance(m, UndefinedName)}

    def repeated(source: bytes) -> set[tuple[str, ...]]:
        lines = [line.strip() for line in source.decode("utf-8", "replace").splitlines()]
        lines = [line for line in lines if re.search(r"\w", line)]  # not a lone `)`
        return {
            tuple(lines[i : i + size])
            for size in range(1, 9)
            for i in range(len(lines) - 2 * size + 1)
            if lines[i : i + size] == lines[i + size : i + 2 * size]
        }

    try:
        compile(after, path, "exec")
    except SyntaxError:
        return False
    return unbound(after) <= unbound(before) and repeated(after) <= repeated(before)


def _pin_fixes(root: Path) -> dict[str, list[str]]:
    """For each file whose Trainer a GA006 pin names (at the default confidence), what
    `gaaudit fix` says of that pin at the tree's root (`--diff`: nothing is written): the
    pin's safe fix (`PIN_FIXED`, then where), or why it was not fixed ("unsafe fix (...)"
    where `--unsafe-fixes` would raise it)."""
    options = ["--select", "GA006", "--no-cache", "."]
    checked = subprocess.run(
        [*GAAUDIT, "check", *options, "--format", "json", "--exit-zero"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    fixed = subprocess.run(
        [*GAAUDIT, "fix", *options, "--diff"], cwd=root, capture_output=True, text=True, check=False
    )
    said = {}
    for line in fixed.stderr.splitlines():
        if found := re.match(r"((.*?):\d+:\d+): GA006 (fixed|not fixed): (.*)$", line):
            applied = found.group(3) == "fixed"
            said[found.group(1)] = f"{PIN_FIXED}{found.group(2)}" if applied else found.group(4)
    named: dict[str, list[str]] = defaultdict(list)
    for finding in json.loads(checked.stdout or '{"findings": []}')["findings"]:
        where = f"{finding['path']}:{finding['line']}:{finding['column']}"
        for site in _trainer_sites(finding) if where in said else ():
            named[os.path.normpath(site)].append(said[where])
    return named


def _replayed_with_pins(trees: Path, row: Row, pins: list[str]) -> str:
    """What `gaaudit verify` says of a file's loops once the safe fixes of the dependency
    files `pins` are applied (they are put back afterwards): "verified" where its Trainer,
    replayed as the release the fixed pin admits trains, matches the full batch."""
    root = tree_of(trees, row.repo)
    kept = {root / pin: (root / pin).read_bytes() for pin in pins}
    try:
        subprocess.run(
            [*GAAUDIT, "fix", "--no-cache", *pins], cwd=root, capture_output=True, check=False
        )
        verdict, why = _original_verdict(trees, row)
        return {"matches": "verified", None: f"not replayable: {why}"}.get(verdict, "bug remains")
    finally:
        for path, data in kept.items():
            path.write_bytes(data)


def _verify(trees: Path, row: Row) -> subprocess.CompletedProcess:
    """`gaaudit verify --format json` (K = 4, CPU) on a labelled file, at its tree's root."""
    return subprocess.run(
        [*GAAUDIT, "verify", "--format", "json", "-k", "4", "--device", "cpu", row.path],
        check=False,
        cwd=tree_of(trees, row.repo),
        capture_output=True,
        text=True,
        timeout=600,
    )


def replayed(trees: Path, row: Row) -> str:
    """`gaaudit verify` (K = 4, CPU) on a file a safe fix changes, at its tree's root: whether
    the patched loop matches the full batch, and whether it is worse than the original."""
    result = _verify(trees, row)
    try:
        entry = json.loads(result.stdout)
    except ValueError:
        return f"error: {(result.stderr.strip().splitlines() or ['no output'])[-1][:80]}"
    if not any(loop.get("flagged", True) for loop in entry["loops"]):
        return "no loop replayed"
    verdicts = []
    for loop in (loop for loop in entry["loops"] if loop.get("flagged", True)):
        rows = loop.get("rows") or [{}]
        original, patched = rows[0].get("original_error"), rows[0].get("patched_error")
        worse = original is not None and patched is not None and patched > original
        verdict = loop["verdict"].splitlines()[0][:90]
        verdicts.append("patched WORSE than the original" if worse else verdict)
    return "; ".join(sorted(set(verdicts)))


REPLAYED_LABELS = ("correct_sum_count", "benign_fixed_length")  # and every positive label


def verdicts(trees: Path, only: list[str], each: bool = False) -> int:
    """`gaaudit verify` (K = 4, CPU) on each labelled torch-family file (not JAX), buggy,
    correct or benign, at its tree's root: whether it gets a verdict on its original loops
    (the bug reproduced, or the loop matches the full batch), and whether that verdict agrees
    with the label (buggy: reproduced; correct: matches; benign: matches, which needs the
    file's own fixed-length data), per framework; with `each`, where each file stopped. The
    files are replayed side by side, one per CPU core."""
    rows = [
        row
        for row in load_manifest()
        if (not only or row.repo in only)
        and row.framework != "jax"
        and (row.positive or row.label in REPLAYED_LABELS)
    ]
    started = time.perf_counter()
    tally: dict[str, Counter] = defaultdict(Counter)
    stops: Counter[str] = Counter()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        outcomes = list(pool.map(lambda row: _original_verdict(trees, row), rows))
    for row, (verdict, why) in zip(rows, outcomes):
        if each and verdict is None:
            print(f"  stops: {row.repo}/{row.path}: {why}")
        agrees = verdict == ("bug reproduced" if row.positive else "matches")
        for group in (row.framework, "all"):
            tally[group].update(files=1, verdict=verdict is not None, agrees=agrees)
        if verdict is None:
            stops[why[:90]] += 1
        elif not agrees:
            print(f"  disagrees: {row.label:<20} {verdict:<15} {row.repo}/{row.path}")
    print(
        f"\n{'framework':<12} {'files':>5} {'verdict':>8} {'share':>6} {'agrees':>7} {'of those':>9}"
    )
    for group, count in sorted(tally.items(), key=lambda item: item[0] == "all"):
        files, given, agreed = count["files"], count["verdict"], count["agrees"]
        print(
            f"{group:<12} {files:>5} {given:>8} {ratio(given, files):>6} {agreed:>7} "
            f"{ratio(agreed, given):>9}"
        )
    print("\nwhere the replays without a verdict stopped:")
    for why, count in stops.most_common(12):
        print(f"  {count:>3}  {why}")
    print(f"\n{len(rows)} files; wall time {time.perf_counter() - started:.1f}s")
    return 0


def _original_verdict(trees: Path, row: Row) -> tuple[str | None, str]:
    """("bug reproduced" or "matches", "") for a file whose original loops replayed, else
    (None, why not). Of several loops, the one the label names: the last one that opens at or
    before the label's first line (all of them where none does)."""
    try:
        result = _verify(trees, row)
        loops = json.loads(result.stdout)["loops"]
    except subprocess.TimeoutExpired:
        return None, "timed out after 600 s"
    except (ValueError, KeyError):
        return None, f"error: {(result.stderr.strip().splitlines() or ['no output'])[-1]}"
    verdicts = {  # after a short first window (GA007, not the labels' question), the next one's
        loop["line"]: [
            r.get("window_verdict") or r.get("original_verdict", r["verdict"]) for r in loop["rows"]
        ]
        for loop in loops
    }
    found = [v for each in verdicts.values() for v in each]
    labelled = max((line for line in verdicts if line <= (row.first_line or 0)), default=None)
    if len(verdicts) > 1 and labelled is not None:
        found = verdicts[labelled]
    if "bug reproduced" in found:
        return "bug reproduced", ""
    if "verified" in found:
        return "matches", ""
    return None, next(iter(found), "no accumulation loop to replay")


def sweep(trees: Path, only: list[str]) -> int:
    """`gaaudit fix --unsafe-fixes` at any confidence over the whole of each tree, on a copy:
    every fix it has, on every file it reaches, labelled or not. Prints each rewritten module
    that is not `sound`, and each run that failed other than on files it cannot parse;
    returns how many there were."""
    problems = rewritten = 0
    started = time.perf_counter()
    for repo in sorted({row.repo for row in load_manifest() if not only or row.repo in only}):
        root = tree_of(trees, repo)
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(shutil.copytree(root, Path(scratch) / root.name, symlinks=True))
            result = subprocess.run(
                [*GAAUDIT, "fix", "--unsafe-fixes", "--min-confidence", "low", "."],
                check=False,
                cwd=copy,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if result.returncode not in (0, 1) and "E999" not in result.stdout:
                problems += 1
                print(f"{repo}: exit {result.returncode}: {result.stderr.strip()[-300:]}")
            for path in copy.rglob("*.py"):
                original = root / path.relative_to(copy)
                before = original.read_bytes() if original.is_file() else None
                if before is None or path.read_bytes() == before:
                    continue
                rewritten += 1
                if not sound(before, path.read_bytes(), str(path)):
                    problems += 1
                    print(f"{repo}/{path.relative_to(copy)}: broken by the fix")
    print(f"{rewritten} modules rewritten, {problems} problems; wall time", end="")
    print(f" {time.perf_counter() - started:.1f}s")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", type=Path, default=TREES, help="where restored trees live")
    commands = parser.add_subparsers(dest="command", required=True)
    restoring = commands.add_parser("restore", help="export labelled commits from git snapshots")
    restoring.add_argument("mirrors", type=Path, metavar="MIRROR_ROOT")
    scoring = commands.add_parser("score", help="run gaaudit on the trees and print figures")
    scoring.add_argument(
        "--only", nargs="+", default=[], metavar="REPO", help="score these repositories only"
    )
    fixing = commands.add_parser("fixes", help="run `gaaudit fix` on each labelled file")
    fixing.add_argument(
        "--only", nargs="+", default=[], metavar="REPO", help="these repositories only"
    )
    fixing.add_argument("--each", action="store_true", help="list each buggy file's outcome")
    replaying = commands.add_parser("verdicts", help="run `gaaudit verify` on each torch file")
    replaying.add_argument(
        "--only", nargs="+", default=[], metavar="REPO", help="these repositories only"
    )
    replaying.add_argument("--each", action="store_true", help="say where each file stopped")
    sweeping = commands.add_parser("sweep", help="every fix over every tree, on copies")
    sweeping.add_argument(
        "--only", nargs="+", default=[], metavar="REPO", help="these repositories only"
    )
    args = parser.parse_args()
    if args.command == "sweep":
        return 1 if sweep(args.trees, args.only) else 0
    if args.command == "verdicts":
        return verdicts(args.trees, args.only, args.each)
    if args.command == "restore":
        return 1 if restore(args.mirrors, args.trees) else 0
    if args.command == "fixes":
        return fixes(args.trees, args.only, args.each)
    return score(args.trees, args.only)


if __name__ == "__main__":
    sys.exit(main())
