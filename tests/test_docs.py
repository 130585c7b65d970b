"""The README and docs/ say what runs: shell examples run as shown, options and links exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import FIXTURES, ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SHELL_BLOCK = re.compile(r"```bash\n(.*?)```", re.DOTALL)
# the `gaaudit` console script of the interpreter running the tests, first on PATH
ENV = {**os.environ, "PATH": os.pathsep.join((os.path.dirname(sys.executable), os.environ["PATH"]))}


def readme_commands() -> list[str]:
    """The command lines of the README's bash blocks, but the set-up ones (`pip install`),
    which `.ci/run` runs verbatim on a fresh machine."""
    blocks = SHELL_BLOCK.findall(README.read_text())
    return [
        line
        for block in blocks
        if "pip install" not in block
        for line in block.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def test_the_readme_shell_examples_run_as_shown(tmp_path):
    commands = readme_commands()
    assert {"check", "fix", "verify"} <= {c.split()[1] for c in commands if c.startswith("gaaudit")}
    shutil.copytree(FIXTURES, tmp_path / "fixtures")
    for command in commands:
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp_path,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        # 0: nothing found (or verified); 1: findings. 2 would be a usage error or a crash.
        assert result.returncode in (0, 1), (command, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr, (command, result.stderr)


def test_the_quick_start_ends_with_a_fixed_and_verified_file(tmp_path):
    """The quick start's story holds: the fixture has a finding, `fix` leaves none."""
    commands = [c.split("#")[0].strip() for c in readme_commands()]
    copied = next(c for c in commands if c.startswith("cp fixtures/"))
    shutil.copy(ROOT / copied.split()[1], tmp_path / copied.split()[2])

    def status(*args: str) -> int:
        return subprocess.run(
            ["gaaudit", *args], cwd=tmp_path, env=ENV, capture_output=True, check=False
        ).returncode

    assert status("check", "train.py") == 1
    assert status("fix", "train.py") == 0
    assert status("check", "train.py") == 0
    assert status("verify", "train.py", "-k", "2") == 0  # the fixed loop matches the full batch


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), (page.name, target)


def test_the_readme_stays_a_front_door():
    words = len(README.read_text().split())
    assert words < 1500, f"README.md has {words} words: move details to docs/"
