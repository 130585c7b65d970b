"""One `gaaudit fix` run, without the CLI library: files, cache, rewrites, messages, exit status.

Messages go to standard error when the fixed text or the diff is what standard output
carries (`--diff`, or `gaaudit fix -`), to standard output otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from gaaudit.commands.check import (
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_FINDINGS,
    STDIN,
    CheckOptions,
    cache_for,
    dependency_files,
    pin_reports,
    settings_for,
    stdin_target,
    use_color,
    warn_nothing_found,
)
from gaaudit.output import plural


@dataclass(frozen=True)
class FixOptions(CheckOptions):
    """The options of `gaaudit fix`: those of `check` that select files and rules, and these."""

    diff: bool = False
    verify: bool = False


@dataclass
class Tally:
    """What a run did, for its summary and exit status."""

    applied: int = 0
    skipped: int = 0
    hidden: int = 0  # of those skipped, the unsafe fixes `--unsafe-fixes` would apply
    errors: int = 0
    changed: list[str] = field(default_factory=list)  # files rewritten (or, with --diff, to be)


def fix(options: FixOptions) -> int:
    """Run `gaaudit fix` and return the exit status; raise `commands.check.UsageError`."""
    from gaaudit.checks.engine import check_files
    from gaaudit.discover.files import discover

    settings = settings_for(options)
    tally = Tally()
    stdin = stdin_target(options, settings)
    if stdin is not None:
        path, data, skipped = stdin
        if skipped:  # an excluded file: its text goes back as it came
            sys.stdout.buffer.write(data)
        else:
            _fix_one(path, settings, options, tally, data)
    else:
        paths = list(options.paths) or [Path(".")]
        files = list(discover(paths, settings, options.force_exclude))
        if not files:
            warn_nothing_found(paths)
        store = None if options.no_cache else cache_for(options, settings)
        pins = dependency_files(files)  # read by GA006, not as Python
        # pins first: a Trainer override's rewrite for transformers>=4.46 waits for its pin
        _fix_pins(pin_reports(files, paths, pins, settings), options, tally)
        sources = [f for f in files if f not in pins]
        # checked first, on --jobs workers, answered by the cache where it holds (which fix
        # reads and leaves as it is): only the files with a finding or an error are
        # rewritten (or told why not)
        flagged = {
            path
            for path, report in check_files(sources, settings, options.jobs, store)
            if report.findings or report.error
        }
        for path in (f for f in sources if f in flagged):
            _fix_one(path, settings, options, tally)
    if not options.quiet:
        verb = "Would fix" if options.diff else "Fixed"
        files = plural(len(tally.changed), "file")
        named = f" ({', '.join(tally.changed)})" if tally.changed else ""
        _say(
            f"{verb} {plural(tally.applied, 'finding')} in {files}{named}; "
            f"{tally.skipped} not fixed.",
            _to_stderr(options),
        )
        if tally.hidden:
            hidden = plural(tally.hidden, "hidden fix", "hidden fixes")
            _say(f"{hidden} can be enabled with --unsafe-fixes.", _to_stderr(options))
    if options.exit_zero:
        return EXIT_CLEAN
    if tally.errors:
        return EXIT_ERROR
    remaining = tally.skipped or (options.diff and tally.changed)
    return EXIT_FINDINGS if remaining else EXIT_CLEAN


def _fix_one(path: Path, settings, options: FixOptions, tally: Tally, data: bytes | None = None):
    """Fix one file (or standard input's `data`), write or show the result, count it."""
    from gaaudit.discover.source import SourceError
    from gaaudit.fixes.codemod import WriteError, write_atomic
    from gaaudit.fixes.fixer import fix_file

    stderr = _to_stderr(options)
    try:
        result = fix_file(path, settings, options.unsafe_fixes, data)
        held = options.verify and result.changed and _held_back(path, result)
        if held:
            _say(f"{result.path}: fixes held back: {held}", stderr)
            tally.skipped += sum(o.applied for o in result.outcomes)
            result = None
        elif data is not None:
            out = result.diff().encode() if options.diff else result.after
            sys.stdout.buffer.write(out)
            sys.stdout.flush()
        elif result.changed and not options.diff:
            for companion in result.companions:  # the functions the file's loop now asks
                write_atomic(Path(companion.path), companion.after, companion.before)
            write_atomic(path, result.after, result.before)
    except (SourceError, WriteError) as exc:
        tally.errors += 1
        where = f":{exc.line}:{exc.column}" if isinstance(exc, SourceError) else ""
        message = exc.message if isinstance(exc, SourceError) else exc
        _say(f"{path.as_posix()}{where}: E999 {message}", stderr)
        if data is not None:  # an editor replaces the buffer with what it gets: give it back
            sys.stdout.buffer.write(data)
        return
    except Exception as exc:  # noqa: BLE001 - a gaaudit bug: leave this file, go on with the rest
        tally.errors += 1
        _say(
            f"{path.as_posix()}: E999 internal error ({type(exc).__name__}); "
            "file left unchanged, please report this",
            stderr,
        )
        if data is not None:
            sys.stdout.buffer.write(data)
        return
    if result is not None:
        _tell(result, options, tally, data is None)


def _tell(result, options: FixOptions, tally: Tally, show_diff: bool = True) -> None:
    """Count a file's outcomes, say why each finding was not fixed, and show the diff (with
    --diff, unless the text came on standard input and the diff went to standard output)."""
    stderr = _to_stderr(options)
    if result.changed:
        tally.changed += [result.path, *(c.path for c in result.companions)]
    for outcome in result.outcomes:
        where = f"{result.path}:{outcome.location}: {outcome.site.code}"
        if outcome.applied:
            tally.applied += 1
            if outcome.reason and not options.quiet:  # which rewrite a framework finding got
                _say(f"{where} fixed: {outcome.reason}", stderr)
        else:
            tally.skipped += 1
            tally.hidden += outcome.reason.startswith("unsafe fix")
            _say(f"{where} not fixed: {outcome.reason}", stderr)
    if options.diff and result.changed and show_diff:
        diff = "".join(f.diff() for f in (result, *result.companions))
        sys.stdout.write(_colour_diff(diff) if use_color() else diff)


def _fix_pins(reports, options: FixOptions, tally: Tally) -> None:
    """GA006's findings on dependency files (requirements, pyproject.toml, ...): each pin
    raised to a release with the Trainer's fix (`fixes.pins`; unsafe but for an exact pin's
    patch release)."""
    from gaaudit.fixes.codemod import WriteError, write_atomic
    from gaaudit.fixes.pins import fix_pins

    stderr = _to_stderr(options)
    for report in reports:
        path = Path(report.path)
        try:
            result = fix_pins(path, report.path, report.findings, options.unsafe_fixes)
            held = options.verify and result.changed and _held_back(path, result)
            if held:
                _say(f"{result.path}: fixes held back: {held}", stderr)
                tally.skipped += sum(o.applied for o in result.outcomes)
                continue
            if result.changed and not options.diff:
                write_atomic(path, result.after, result.before)
        except (OSError, WriteError) as exc:
            tally.errors += 1
            _say(f"{report.path}: E999 {exc}", stderr)
            continue
        _tell(result, options, tally)


def _held_back(path: Path, result) -> str:
    """Why a file's fixes may not be applied under --verify ("" when every loop verified).
    K = 4; the rest of [tool.gaaudit.verify] applies (model factory, processes, ...)."""
    from gaaudit.commands.verify import VERIFIED, VerifyError, options_for, verify_pair
    from gaaudit.config import ConfigError

    if path.suffix != ".py":
        return "--verify replays Python files only"
    if result.companions:
        changed = ", ".join(c.path for c in result.companions)
        return f"the fix also changes {changed}, which the replay imports as it is on disk"
    try:
        outcomes = verify_pair(path, result.before, result.after, None, options_for(path, ks=(4,)))
    except (ConfigError, VerifyError) as exc:
        return str(exc)
    outcomes = [o for o in outcomes if o.flagged]  # the loops the fixes touch
    failed = [o for o in outcomes if o.verdict != VERIFIED]
    if not outcomes:
        return "no loop could be replayed"
    return "; ".join(f"line {o.line}: {o.verdict}" for o in failed)


DIFF_COLOURS = (("+++", "1"), ("---", "1"), ("@@", "36"), ("+", "32"), ("-", "31"))


def _colour_diff(text: str) -> str:
    """ANSI-coloured unified diff lines (headers bold, hunks cyan, additions green)."""
    lines = []
    for line in text.splitlines(keepends=True):
        colour = next((c for prefix, c in DIFF_COLOURS if line.startswith(prefix)), None)
        lines.append(f"\x1b[{colour}m{line.rstrip(chr(10))}\x1b[0m\n" if colour else line)
    return "".join(lines)


def _to_stderr(options: FixOptions) -> bool:
    return options.diff or options.paths == (STDIN,)


def _say(text: str, stderr: bool) -> None:
    print(text, file=sys.stderr if stderr else sys.stdout, flush=True)
