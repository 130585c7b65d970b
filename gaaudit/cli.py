"""The `gaaudit` command line: check, fix, rules, explain, verify."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from gaaudit import __version__
from gaaudit.checking import (
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_FINDINGS,
    EXIT_INTERRUPTED,
    CheckOptions,
    UsageError,
    settings_for,
)
from gaaudit.checking import use_color as _use_color

app = typer.Typer(
    name="gaaudit",
    help="Find, fix and prove the gradient-accumulation loss bug in training code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class Format(str, Enum):
    text = "text"
    json = "json"
    sarif = "sarif"
    github = "github"


class Level(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


def _fail(message: str) -> None:
    typer.echo(f"gaaudit: error: {message}", err=True)
    raise typer.Exit(EXIT_ERROR)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gaaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Find, fix and prove the gradient-accumulation loss bug in training code."""


Paths = Annotated[list[Path] | None, typer.Argument(help="Files or directories [default: .]")]
Codes = Annotated[list[str] | None, typer.Option(help="Rule codes or prefixes (repeatable).")]
Globs = Annotated[list[str] | None, typer.Option(help="gitignore-style patterns (repeatable).")]


def _settings(paths, select, ignore, exclude, extend_exclude, min_confidence):
    try:
        level = min_confidence.value if min_confidence else None
        return settings_for(paths, select, ignore, exclude, extend_exclude, level)
    except UsageError as exc:
        _fail(str(exc))


@app.command()
def check(
    paths: Paths = None,
    format: Annotated[Format, typer.Option("--format", "-f", help="Output format.")] = Format.text,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the report to FILE.")
    ] = None,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    min_confidence: Annotated[
        Level | None, typer.Option(help="Lowest confidence to report [default: medium].")
    ] = None,
    statistics: Annotated[bool, typer.Option(help="Count findings per rule.")] = False,
    exit_zero: Annotated[bool, typer.Option(help="Exit 0 even when there are findings.")] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Findings only, no summary.")
    ] = False,
    jobs: Annotated[
        int | None, typer.Option("--jobs", "-j", min=1, help="Worker processes.")
    ] = None,
    unsafe_fixes: Annotated[
        bool, typer.Option(help="With --format sarif: also suggest fixes marked unsafe.")
    ] = False,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Neither read nor write the cache.")
    ] = False,
    cache_dir: Annotated[
        Path | None,
        typer.Option(help="Cache directory [default: .gaaudit_cache at the project root]."),
    ] = None,
) -> None:
    """Report gradient-accumulation loss bugs. Exit 0: none, 1: findings, 2: errors."""
    from gaaudit.checking import check as run_check

    options = CheckOptions(
        paths=tuple(paths or ()),
        format=format.value,
        output=output,
        select=tuple(select or ()),
        ignore=tuple(ignore or ()),
        exclude=tuple(exclude or ()),
        extend_exclude=tuple(extend_exclude or ()),
        min_confidence=min_confidence.value if min_confidence else None,
        statistics=statistics,
        exit_zero=exit_zero,
        quiet=quiet,
        jobs=jobs,
        unsafe_fixes=unsafe_fixes,
        no_cache=no_cache,
        cache_dir=cache_dir,
    )
    try:
        raise typer.Exit(run_check(options))
    except UsageError as exc:
        _fail(str(exc))


@app.command()
def fix(
    paths: Paths = None,
    diff: Annotated[
        bool, typer.Option("--diff", help="Print a unified diff; write nothing.")
    ] = False,
    unsafe_fixes: Annotated[bool, typer.Option(help="Also apply fixes marked unsafe.")] = False,
    select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    min_confidence: Annotated[
        Level | None, typer.Option(help="Lowest confidence to fix [default: medium].")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
    verify: Annotated[
        bool,
        typer.Option("--verify", help="Apply a file's fixes only when their replay is verified."),
    ] = False,
) -> None:
    """Rewrite findings to sum-and-count. Exit 0: nothing left, 1: findings remain (or, with
    --diff, something would change), 2: errors."""
    from gaaudit.codemod import WriteError, write_atomic
    from gaaudit.discovery import discover
    from gaaudit.fixer import fix_file
    from gaaudit.source import SourceError

    paths = paths or [Path(".")]
    settings = _settings(paths, select, ignore, exclude, extend_exclude, min_confidence)
    applied = skipped = changed = errors = 0
    for path in discover(paths, settings):
        try:
            result = fix_file(path, settings, unsafe_fixes)
            held = verify and result.changed and _held_back(path, result)
            if held:
                typer.echo(f"{result.path}: fixes held back: {held}")
                skipped += sum(o.applied for o in result.outcomes)
                continue
            if result.changed and not diff:
                write_atomic(path, result.after, result.before)
        except (SourceError, WriteError) as exc:
            errors += 1
            line = f":{exc.line}:{exc.column}" if isinstance(exc, SourceError) else ""
            typer.echo(
                f"{path.as_posix()}{line}: E999 {exc.message if isinstance(exc, SourceError) else exc}"
            )
            continue
        except Exception as exc:  # noqa: BLE001 - a gaaudit bug: leave this file, go on with the rest
            errors += 1
            typer.echo(
                f"{path.as_posix()}: E999 internal error ({type(exc).__name__}); file left unchanged, please report this"
            )
            continue
        changed += result.changed
        for outcome in result.outcomes:
            if outcome.applied:
                applied += 1
                if outcome.reason and not quiet:  # which rewrite a framework finding got
                    typer.echo(
                        f"{result.path}:{outcome.location}: {outcome.site.code} "
                        f"fixed: {outcome.reason}",
                        err=diff,
                    )
            else:
                skipped += 1
                typer.echo(
                    f"{result.path}:{outcome.location}: {outcome.site.code} "
                    f"not fixed: {outcome.reason}",
                    err=diff,
                )
        if diff and result.changed:
            coloured = _use_color()
            typer.echo(
                _colour_diff(result.diff()) if coloured else result.diff(), nl=False, color=coloured
            )
    if not quiet:
        verb = "Would fix" if diff else "Fixed"
        typer.echo(
            f"{verb} {applied} finding{'s' * (applied != 1)} in {changed} file{'s' * (changed != 1)}"
            f"; {skipped} not fixed.",
            err=diff,
        )
    if errors:
        raise typer.Exit(EXIT_ERROR)
    raise typer.Exit(EXIT_FINDINGS if (changed if diff else skipped) else EXIT_CLEAN)


def _held_back(path: Path, result) -> str:
    """Why a file's fixes may not be applied under --verify ("" when every loop verified).
    K = 4; the rest of [tool.gaaudit.verify] applies (model factory, processes, ...)."""
    from gaaudit.config import ConfigError
    from gaaudit.verify import VERIFIED, VerifyError, options_for, verify_pair

    if path.suffix != ".py":
        return "--verify replays Python files only"
    try:
        outcomes = verify_pair(path, result.before, result.after, None, options_for(path, ks=(4,)))
    except (ConfigError, VerifyError) as exc:
        return str(exc)
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


@app.command()
def rules() -> None:
    """List the rules of the catalogue."""
    from gaaudit.catalogue import load

    catalogue = load()
    width = max(len(rule.name) for rule in catalogue.values())
    for rule in catalogue.values():
        typer.echo(f"{rule.code}  {rule.name:<{width}}  {rule.severity:<7}  {rule.summary}")


@app.command()
def explain(code: Annotated[str, typer.Argument(help="A rule code, e.g. GA001.")]) -> None:
    """Show a rule's rationale with a bad and a good example."""
    from gaaudit.catalogue import load

    rule = load().get(code.upper())
    if rule is None:
        _fail(f"unknown rule {code!r}; `gaaudit rules` lists them")
    typer.echo(
        f"{rule.code} ({rule.name}): {rule.summary}\n\n"
        f"## What it does\n{rule.what.strip()}\n\n## Why is this bad?\n{rule.why.strip()}\n\n"
        f"## Example\n{rule.bad.strip()}\n\n## Use instead\n{rule.good.strip()}\n\n"
        f"Hint: {rule.hint}"
    )


@app.command()
def verify(
    target: Annotated[
        list[str] | None,
        typer.Argument(help="PATH or PATH:LINE of one or more training scripts."),
    ] = None,
    k: Annotated[
        str | None, typer.Option("-k", help="Window sizes, comma-separated [default: 2,4,8].")
    ] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda [default: auto].")] = None,
    dtype: Annotated[
        str | None, typer.Option(help="float32, bfloat16 or float16 [default: float32].")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed for the model and the data.")] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Seconds before a replay is stopped [default: 120].")
    ] = None,
    model_factory: Annotated[
        str | None,
        typer.Option(
            help="module:function returning your small torch.nn.Module, used instead "
            "of the tiny harness model."
        ),
    ] = None,
    distributed: Annotated[
        int | None,
        typer.Option(min=1, help="Replay on N DDP processes (gloo on CPU, NCCL on CUDA)."),
    ] = None,
    format: Annotated[Format, typer.Option("--format", "-f", help="text or json.")] = Format.text,
    demo: Annotated[bool, typer.Option(help="Run the reference experiment, no user code.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="With --demo: draw error against K (PNG).")
    ] = None,
) -> None:
    """Replay each accumulation loop, original and patched, against one full-batch step on a
    tiny real model. Exit 0: every patched loop verified, 1: one is not, 2: nothing replayed.
    Defaults come from [tool.gaaudit.verify] in pyproject.toml."""
    from importlib.util import find_spec

    from gaaudit import verify as verifying
    from gaaudit.config import DEVICES, VERIFY_DTYPES, ConfigError

    missing = [name for name in ("torch", "transformers", "accelerate") if find_spec(name) is None]
    if missing:
        _fail(f"verify needs {', '.join(missing)}: pip install 'gaaudit[verify]'")
    if demo:
        raise typer.Exit(verifying.run_demo(format.value, plot))
    if not target:
        _fail("give a training script: gaaudit verify PATH[:LINE] (or --demo)")
    requests = []
    for text in target:
        path_text, _, line_text = text.rpartition(":")
        if not line_text.isdigit():
            path_text, line_text = text, ""
        if not Path(path_text).is_file():
            _fail(f"{path_text}: no such file")
        requests.append((Path(path_text), int(line_text) if line_text else None))
    ks = None
    if k is not None:
        try:
            ks = tuple(int(v) for v in k.split(","))
        except ValueError:
            ks = ()
        if not ks or min(ks) < 1:
            _fail(f"-k {k!r}: expected comma-separated window sizes >= 1 such as 2,4,8")
    for option, value, allowed in (
        ("--device", device, DEVICES),
        ("--dtype", dtype, VERIFY_DTYPES),
    ):
        if value is not None and value not in allowed:
            _fail(f"{option} {value!r}: expected one of {', '.join(allowed)}")
    groups: list[tuple[verifying.Options, list]] = []  # consecutive files with equal options
    for path, line in requests:
        try:
            options = verifying.options_for(
                path,
                ks=ks,
                device=device,
                dtype=dtype,
                seed=seed,
                timeout=timeout,
                model_factory=model_factory,
                distributed=distributed,
            )
        except ConfigError as exc:
            _fail(str(exc))
        if not groups or groups[-1][0] != options:
            groups.append((options, []))
        groups[-1][1].append((path, line))
    results = []
    for options, group in groups:
        model = options.model_factory or "a tiny model"
        ranks = f" on {options.distributed} DDP processes" if options.distributed else ""
        for path, _ in group:
            typer.echo(
                f"gaaudit: executing loops of {path} (and their patched versions) with "
                f"{model}{ranks}",
                err=True,
            )
        try:
            outcomes = verifying.verify_files(group, options)
        except verifying.VerifyError as exc:
            _fail(str(exc))
        results += [(path, found) for (path, _), found in zip(group, outcomes)]
    raise typer.Exit(verifying.report(results, format.value))


@app.command()
def init(
    directory: Annotated[Path, typer.Argument(help="The project root [default: .]")] = Path("."),
) -> None:
    """Write a commented [tool.gaaudit] block and a .pre-commit-config.yaml entry.
    Exit 1 when either already existed and was left unchanged."""
    from gaaudit.setup import write_config

    refused = False
    for line, done in write_config(directory):
        typer.echo(line, err=not done)
        refused |= not done
    raise typer.Exit(EXIT_FINDINGS if refused else EXIT_CLEAN)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("gaaudit: interrupted", err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
