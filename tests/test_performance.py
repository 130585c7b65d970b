"""The fast path of a plain `gaaudit check`: the same command as typer's, answered without it.

Speed itself is measured by `benchmarks/bench.py`, not by timed tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer.main
from conftest import FIXTURES

from gaaudit.__main__ import FLAGS, plain_check
from gaaudit.cli import app
from gaaudit.commands.check import CheckOptions


def check_command():
    return typer.main.get_command(app).commands["check"]


def test_fast_flags_are_flags_of_the_check_command():
    params = {
        option: (param, side)
        for param in check_command().params
        for side, options in ((True, param.opts), (False, param.secondary_opts))
        for option in options
    }
    for flag, (name, value) in FLAGS.items():
        param, side = params[flag]
        assert (param.name, param.is_flag, value) == (name, True, side), flag
        assert param.default in (False, None), flag  # the flag changes what the default is


def test_every_check_option_has_its_field():
    assert {param.name for param in check_command().params} == {
        f.name for f in fields(CheckOptions)
    }


@pytest.mark.parametrize(
    "arguments",
    [
        ["check", "--format", "json", "x.py"],
        ["check", "-f", "json"],
        ["check", "--help"],
        ["check", "--", "x.py"],
        ["check", "-qx"],
        ["check", ""],
        ["check", "--no-statistics"],
        ["fix", "x.py"],
        ["--version"],
        [],
    ],
)
def test_anything_else_goes_to_typer(arguments):
    assert plain_check(arguments) is None


def test_plain_check_options():
    options = plain_check(["check", "-q", "a.py", "--no-cache", "src", "--exit-zero"])
    expected = CheckOptions(
        paths=(Path("a.py"), Path("src")), quiet=True, no_cache=True, exit_zero=True
    )
    assert options == expected
    both = ["check", "--respect-gitignore", "--no-respect-gitignore", "a.py"]
    assert plain_check(both) == CheckOptions(paths=(Path("a.py"),), respect_gitignore=False)


def run(cwd, *arguments: str) -> tuple[int, str, str]:
    result = subprocess.run(
        [sys.executable, "-m", "gaaudit", *arguments],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = re.compile(r" in \d+\.\d\ds\.")
    return result.returncode, elapsed.sub(" in Ts.", result.stdout), result.stderr


@pytest.mark.parametrize(
    "arguments",
    [
        ["train.py", "clean.py"],
        ["-q", "train.py"],
        ["--exit-zero", "--statistics", "."],
        ["--no-cache", "clean.py"],
        ["broken.py", "clean.py"],
        ["missing.py"],
        ["."],
    ],
)
def test_fast_path_answers_like_typer(tmp_path, arguments):
    """`--min-confidence medium` (the default) sends the same command line through typer."""
    shutil.copy(FIXTURES / "ga001_hf_clm_sft_no_trainer.py", tmp_path / "train.py")
    shutil.copy(FIXTURES / "ok_eval_only_mean.py", tmp_path / "clean.py")
    (tmp_path / "broken.py").write_text("def f(:\n    loss.backward()\n")
    fast = run(tmp_path, "check", *arguments)
    typed = run(tmp_path, "check", "--min-confidence", "medium", *arguments)
    assert fast == typed
    assert fast[0] in (0, 1, 2) and (fast[1] or fast[2])
