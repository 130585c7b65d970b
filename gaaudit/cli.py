"""The `gaaudit` command line: check, fix, rules, explain, verify."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from gaaudit import __version__
from gaaudit.commands.check import (
    EXIT_CLEAN,
    EXIT_ERROR,
    EXIT_FINDINGS,
    CheckOptions,
    UsageError,
)

app = typer.Typer(
    name="gaaudit",
    help="Find, fix and prove the gradient-accumulation loss bug in training code.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)


class Format(str, Enum):
    text = "text"
    json = "json"
    sarif = "sarif"
    github = "github"


class VerifyFormat(str, Enum):
    text = "text"
    json = "json"


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
        bool,
        typer.Option("--version", "-V", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Find, fix and prove the gradient-accumulation loss bug in training code."""


# The options `check` and `fix` share: which files, which rules, which cache.
# Arguments are described in each command's docstring: typer would label them `<list[Path]>`.
Paths = Annotated[list[Path] | None, typer.Argument(metavar="PATH", hidden=True)]
Codes = Annotated[
    list[str] | None,
    typer.Option(metavar="CODES", help="Rule codes or prefixes, comma-separated or repeated."),
]
Globs = Annotated[
    list[str] | None,
    typer.Option(metavar="PATTERN", help="gitignore-style pattern (repeatable)."),
]
ForceExclude = Annotated[
    bool,
    typer.Option("--force-exclude", help="Apply excludes to paths named on the command line too."),
]
RespectGitignore = Annotated[
    bool | None,
    typer.Option(
        "--respect-gitignore/--no-respect-gitignore",
        show_default=False,
        help="Skip files that .gitignore files ignore [default: respect].",
    ),
]
StdinFilename = Annotated[
    Path | None,
    typer.Option(metavar="PATH", help="With `-`: the path of the file stdin holds."),
]
ExitZero = Annotated[
    bool, typer.Option("--exit-zero", help="Exit 0 even with findings or unreadable files.")
]
Jobs = Annotated[
    int | None, typer.Option("--jobs", "-j", min=1, metavar="N", help="Worker processes.")
]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the cache.")]
CacheDir = Annotated[
    Path | None,
    typer.Option(metavar="DIR", help="Cache folder [default: .gaaudit_cache at the project root]."),
]
UnsafeFixes = Annotated[bool, typer.Option("--unsafe-fixes", help="Include fixes marked unsafe.")]
Confidence = Annotated[
    Level | None,
    typer.Option(show_default=False, help="Lowest confidence to act on [default: medium]."),
]


def _selection(paths, select, extend_select, ignore, exclude, extend_exclude) -> dict:
    """The shared options as `CheckOptions` fields."""
    return {
        "paths": tuple(paths or ()),
        "select": tuple(select or ()),
        "extend_select": tuple(extend_select or ()),
        "ignore": tuple(ignore or ()),
        "exclude": tuple(exclude or ()),
        "extend_exclude": tuple(extend_exclude or ()),
    }


def _run(command, options) -> None:
    try:
        raise typer.Exit(command(options))
    except UsageError as exc:
        _fail(str(exc))


@app.command(short_help="Report gradient-accumulation loss bugs.")
def check(
    paths: Paths = None,
    format: Annotated[
        Format,
        typer.Option("--format", "-f", metavar="FORMAT", help="text, json, sarif or github."),
    ] = Format.text,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", help="Write the report to FILE."),
    ] = None,
    select: Codes = None,
    extend_select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    force_exclude: ForceExclude = False,
    respect_gitignore: RespectGitignore = None,
    min_confidence: Confidence = None,
    stdin_filename: StdinFilename = None,
    statistics: Annotated[
        bool, typer.Option("--statistics", help="Count findings per rule.")
    ] = False,
    exit_zero: ExitZero = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Findings only, no summary.")
    ] = False,
    jobs: Jobs = None,
    unsafe_fixes: Annotated[
        bool, typer.Option("--unsafe-fixes", help="With --format sarif: also suggest unsafe fixes.")
    ] = False,
    no_cache: NoCache = False,
    cache_dir: CacheDir = None,
) -> None:
    """Report gradient-accumulation loss bugs in the files and folders PATH (default: .;
    `-` reads one file from standard input). Exit 0: none, 1: findings, 2: errors."""
    from gaaudit.commands.check import check as run_check

    _run(
        run_check,
        CheckOptions(
            **_selection(paths, select, extend_select, ignore, exclude, extend_exclude),
            format=format.value,
            output=output,
            force_exclude=force_exclude,
            respect_gitignore=respect_gitignore,
            min_confidence=min_confidence.value if min_confidence else None,
            stdin_filename=stdin_filename,
            statistics=statistics,
            exit_zero=exit_zero,
            quiet=quiet,
            jobs=jobs,
            unsafe_fixes=unsafe_fixes,
            no_cache=no_cache,
            cache_dir=cache_dir,
        ),
    )


@app.command(short_help="Rewrite findings to sum-and-count.")
def fix(
    paths: Paths = None,
    diff: Annotated[
        bool, typer.Option("--diff", help="Print a unified diff; write nothing.")
    ] = False,
    unsafe_fixes: UnsafeFixes = False,
    select: Codes = None,
    extend_select: Codes = None,
    ignore: Codes = None,
    exclude: Globs = None,
    extend_exclude: Globs = None,
    force_exclude: ForceExclude = False,
    respect_gitignore: RespectGitignore = None,
    min_confidence: Confidence = None,
    stdin_filename: StdinFilename = None,
    exit_zero: ExitZero = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary.")] = False,
    jobs: Jobs = None,
    no_cache: NoCache = False,
    cache_dir: CacheDir = None,
    verify: Annotated[
        bool,
        typer.Option("--verify", help="Apply a file's fixes only when their replay is verified."),
    ] = False,
) -> None:
    """Rewrite findings in the files and folders PATH (default: .) to sum-and-count; `fix -`
    prints standard input, fixed. Exit 0: no finding remains, 1: findings remain (with
    --diff: or something would change), 2: errors."""
    from gaaudit.commands.fix import FixOptions
    from gaaudit.commands.fix import fix as run_fix

    _run(
        run_fix,
        FixOptions(
            **_selection(paths, select, extend_select, ignore, exclude, extend_exclude),
            force_exclude=force_exclude,
            respect_gitignore=respect_gitignore,
            min_confidence=min_confidence.value if min_confidence else None,
            stdin_filename=stdin_filename,
            exit_zero=exit_zero,
            quiet=quiet,
            jobs=jobs,
            unsafe_fixes=unsafe_fixes,
            no_cache=no_cache,
            cache_dir=cache_dir,
            diff=diff,
            verify=verify,
        ),
    )


@app.command()
def rules() -> None:
    """List the rules of the catalogue."""
    from gaaudit.catalogue import load

    catalogue = load()
    width = max(len(rule.name) for rule in catalogue.values())
    for rule in catalogue.values():
        typer.echo(f"{rule.code}  {rule.name:<{width}}  {rule.severity:<7}  {rule.summary}")


@app.command()
def explain(
    code: Annotated[str, typer.Argument(metavar="CODE", hidden=True)],
) -> None:
    """Show the rationale of the rule CODE (e.g. GA001) with a bad and a good example."""
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


@app.command(short_help="Replay loops against one full-batch step on a tiny model.")
def verify(
    target: Annotated[
        list[str] | None,
        typer.Argument(metavar="PATH[:LINE]", hidden=True),
    ] = None,
    k: Annotated[
        str | None,
        typer.Option("-k", metavar="K,K", help="Window sizes, comma-separated [default: 2,4,8]."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option("--device", metavar="DEVICE", help="auto, cpu or cuda [default: auto]."),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype", metavar="DTYPE", help="float32, bfloat16 or float16 [default: float32]."
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(metavar="N", help="Seed for the model and the data.")
    ] = None,
    timeout: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds a file's replay may run before it is stopped [default: 120].",
        ),
    ] = None,
    model_factory: Annotated[
        str | None,
        typer.Option(
            metavar="MODULE:FUNCTION",
            help="A function returning your small torch.nn.Module, used instead of the "
            "tiny harness model.",
        ),
    ] = None,
    data_factory: Annotated[
        str | None,
        typer.Option(
            metavar="MODULE:FUNCTION",
            help="A function taking K and returning K micro-batches as your loop's data "
            "loader yields them, used instead of the harness's data.",
        ),
    ] = None,
    distributed: Annotated[
        int | None,
        typer.Option(
            min=1, metavar="N", help="Replay on N DDP processes (gloo on CPU, NCCL on CUDA)."
        ),
    ] = None,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            min=1,
            metavar="N",
            show_default=False,
            help="Files replayed at once, each in a process of its own [default: 1].",
        ),
    ] = 1,
    format: Annotated[
        VerifyFormat, typer.Option("--format", "-f", metavar="FORMAT", help="text or json.")
    ] = VerifyFormat.text,
    demo: Annotated[
        bool, typer.Option("--demo", help="Run the reference experiment, no user code.")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="With --demo: draw error against K (PNG)."),
    ] = None,
) -> None:
    """Replay each accumulation loop of the training scripts PATH (or the one at LINE),
    original and patched, against one full-batch step on a tiny real model. Exit 0: every
    patched loop verified, 1: one is not, 2: nothing replayed. Defaults come from
    [tool.gaaudit.verify] in pyproject.toml."""
    from importlib.util import find_spec

    from gaaudit.commands import verify as verifying
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
                data_factory=data_factory,
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
        if options.data_factory:
            model += f" on the batches of {options.data_factory}"
        ranks = f" on {options.distributed} DDP processes" if options.distributed else ""
        for path, _ in group:
            typer.echo(
                f"gaaudit: executing loops of {path} (and their patched versions) with "
                f"{model}{ranks}",
                err=True,
            )
        try:
            outcomes = verifying.verify_files(group, options, jobs)
        except verifying.VerifyError as exc:
            _fail(str(exc))
        results += [(path, found) for (path, _), found in zip(group, outcomes)]
    raise typer.Exit(verifying.report(results, format.value))


@app.command(short_help="Write starter configuration and a pre-commit hook.")
def init(
    directory: Annotated[Path, typer.Argument(metavar="DIRECTORY", hidden=True)] = Path("."),
) -> None:
    """Write a commented [tool.gaaudit] block and a .pre-commit-config.yaml entry in
    DIRECTORY, the project root (default: .). Exit 1 when either already existed and was
    left unchanged."""
    from gaaudit.commands.init import write_config

    refused = False
    for line, done in write_config(directory):
        typer.echo(line, err=not done)
        refused |= not done
    raise typer.Exit(EXIT_FINDINGS if refused else EXIT_CLEAN)


def main() -> None:
    """The command line; on Ctrl-C typer exits with status 130 and says nothing (the
    terminal shows ^C)."""
    app()
