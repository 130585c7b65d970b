"""CLI extras: init, version, the help path, and what a plain check imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import FIXTURES, gaaudit

from gaaudit.config import load


def test_init_writes_both_files_then_refuses(tmp_path, cli):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "demo"')
    result = cli("init", str(tmp_path))
    assert result.exit_code == 0
    text = (tmp_path / "pyproject.toml").read_text()
    assert text.startswith('[project]\nname = "demo"\n\n[tool.gaaudit]\n# ')
    assert load(tmp_path).source == tmp_path / "pyproject.toml"  # a valid, empty table
    hooks = (tmp_path / ".pre-commit-config.yaml").read_text()
    assert "id: gaaudit" in hooks and "repos:" in hooks
    again = cli("init", str(tmp_path))
    assert again.exit_code == 1 and "left unchanged" in again.output
    assert (tmp_path / "pyproject.toml").read_text() == text
    assert (tmp_path / ".pre-commit-config.yaml").read_text() == hooks


@pytest.mark.parametrize(
    "args",
    [
        ["check", "clean.py"],  # the pre-commit call: no CLI library either
        ["check", "train.py"],  # a training script with backward but no accumulation window
        ["check", "--format", "text", "clean.py"],
        ["--help"],
        ["check", "--help"],
    ],
)
def test_clean_file_check_and_help_load_no_parser_or_frameworks(tmp_path, args):
    (tmp_path / "clean.py").write_text("import torch\nprint(torch.ones(2).sum())\n")
    (tmp_path / "train.py").write_bytes(
        (FIXTURES / "ok_single_step_no_accumulation.py").read_bytes()
    )
    heavy = {"libcst", "torch", "transformers", "accelerate", "rich"}
    if args in (["check", "clean.py"], ["check", "train.py"]):
        heavy |= {"typer", "click", "pydantic", "pathspec", "packaging", "typing"}
    probe = (
        f"import sys\nfrom gaaudit.__main__ import main\nsys.argv = ['gaaudit', *{args!r}]\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\n"
        f"heavy = {sorted(heavy)!r}\n"
        "print('CODE', code, 'HEAVY', sorted(set(heavy) & set(sys.modules)))\n"
    )
    command = [sys.executable, "-c", probe]
    result = subprocess.run(
        command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert "CODE 0 HEAVY []" in result.stdout, result.stdout + result.stderr


def test_help_lists_every_command():
    result = gaaudit("--help")
    assert result.returncode == 0
    for command in ("check", "fix", "rules", "explain", "init"):
        assert command in result.stdout


def test_diff_is_coloured_only_for_a_terminal(tmp_path, monkeypatch, cli):
    from conftest import FIXTURES

    from gaaudit.commands import fix as module

    (tmp_path / "train.py").write_bytes((FIXTURES / "ga002_hf_clm_no_division.py").read_bytes())
    plain = cli("fix", ".", "--diff", cwd=tmp_path).stdout
    assert "\x1b[" not in plain and plain.startswith("--- a/train.py")
    monkeypatch.setattr(module, "use_color", lambda: True)
    coloured = cli("fix", ".", "--diff").stdout
    assert "\x1b[32m+" in coloured and "\x1b[31m-" in coloured


def test_verify_without_the_harness_says_how_to_install_it(tmp_path):
    probe = (
        "import importlib.util, sys\nreal = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'torch' else real(name, *a)\n"
        "from gaaudit.cli import main\nsys.argv = ['gaaudit', 'verify', 'x.py']\nmain()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "pip install 'gaaudit[verify]'" in result.stderr
