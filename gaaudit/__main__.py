"""`python -m gaaudit` and the `gaaudit` console script.

A plain `gaaudit check [FLAGS] [PATHS]` (what a pre-commit hook runs) is answered without
importing typer and click, whose import alone takes longer than checking a clean file.
Every other command line, and anything `check` is given beyond the flags below (options
with values, `--help`, `--`, paths that start with `-`), goes to `gaaudit.cli`, the one
definition of the command line; tests hold the flags below to it.
"""

from __future__ import annotations

import os
import sys

# The fast path's flags: each is a typer flag of `check` (or the `--no-` side of one) with
# this parameter name, and the value it gives.
FLAGS = {
    "-q": ("quiet", True),
    "--quiet": ("quiet", True),
    "--exit-zero": ("exit_zero", True),
    "--statistics": ("statistics", True),
    "--no-cache": ("no_cache", True),
    "--force-exclude": ("force_exclude", True),
    "--respect-gitignore": ("respect_gitignore", True),
    "--no-respect-gitignore": ("respect_gitignore", False),
}


def plain_check(arguments: list[str]):
    """The options of a plain `check` command line, or None when it is not one."""
    if not arguments or arguments[0] != "check":
        return None
    flags, paths = {}, []
    for argument in arguments[1:]:
        if argument in FLAGS:
            name, value = FLAGS[argument]
            flags[name] = value  # the last one wins, as with click
        elif argument.startswith("-") or not argument:
            return None
        else:
            paths.append(argument)
    from pathlib import Path

    from gaaudit.commands.check import CheckOptions

    return CheckOptions(paths=tuple(map(Path, paths)), **flags)


def main() -> None:
    options = plain_check(sys.argv[1:])
    if options is None:
        from gaaudit.cli import main as command_line

        command_line()
        return
    from gaaudit.commands.check import (
        EXIT_ERROR,
        EXIT_FINDINGS,
        EXIT_INTERRUPTED,
        UsageError,
        check,
    )

    try:
        code = check(options)
    except UsageError as exc:
        print(f"gaaudit: error: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:  # as typer does for the other command lines
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`| head`): say nothing more, as click does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_FINDINGS
    sys.exit(code)


if __name__ == "__main__":
    main()
