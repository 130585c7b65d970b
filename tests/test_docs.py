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
    """Each command runs in a copy of the fixtures, and the quick start's story holds: the
    copied loop has a finding, its patched loop is verified, and once fixed nothing is left."""
    commands = readme_commands()
    assert {"check", "fix", "verify"} <= {c.split()[1] for c in commands if c.startswith("gaaudit")}
    shutil.copytree(FIXTURES, tmp_path / "fixtures")
    status = {}
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
        status.setdefault(command.split("#")[0].split()[1], []).append(result.returncode)
    assert status["check"] == [1, 0] and status["verify"] == [0], status


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
        assert (page.parent / target).exists(), (page.name, target)


def test_the_readme_stays_a_front_door():
    words = len(README.read_text().split())
    assert words < 1500, f"README.md has {words} words: move details to docs/"
