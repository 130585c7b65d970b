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

# The fast path's flags: each is a typer flag of `check` with this parameter name.
FLAGS = {
    "-q": "quiet",
    "--quiet": "quiet",
    "--exit-zero": "exit_zero",
    "--statistics": "statistics",
    "--no-cache": "no_cache",
    "--force-exclude": "force_exclude",
}


def plain_check(arguments: list[str]):
    """The options of a plain `check` command line, or None when it is not one."""
    if not arguments or arguments[0] != "check":
        return None
    flags, paths = set(), []
    for argument in arguments[1:]:
        if argument in FLAGS:
            flags.add(FLAGS[argument])
        elif argument.startswith("-") or not argument:
            return None
        else:
            paths.append(argument)
    from pathlib import Path

    from gaaudit.checking import CheckOptions

    return CheckOptions(paths=tuple(map(Path, paths)), **dict.fromkeys(flags, True))


def main() -> None:
    options = plain_check(sys.argv[1:])
    if options is None:
        from gaaudit.cli import main as command_line

        command_line()
        return
    from gaaudit.checking import EXIT_ERROR, EXIT_FINDINGS, EXIT_INTERRUPTED, UsageError, check

    try:
        code = check(options)
    except UsageError as exc:
        print(f"gaaudit: error: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        print("gaaudit: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader left (`| head`): say nothing more, as click does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_FINDINGS
    sys.exit(code)


if __name__ == "__main__":
    main()
