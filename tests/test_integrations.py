"""The real flake8 and pre-commit, driving gaaudit as a user's setup would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, gaaudit

BUGGY = FIXTURES / "ga002_hf_clm_no_division.py"
CLEAN = FIXTURES / "ok_single_step_no_accumulation.py"
PRE_COMMIT_FATAL = 3  # pre-commit's exit status for an error of its own (e.g. a failed install)


def flake8(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flake8", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def flake8_rows(stdout: str) -> list[tuple[str, int, int, str]]:
    """`(path, line, column, code)` of each `path:line:col: CODE message` line."""
    rows = []
    for line in stdout.splitlines():
        path, number, column, message = line.split(":", 3)
        rows.append((path, int(number), int(column), message.split()[0]))
    return rows


def test_flake8_reports_what_check_reports():
    target = "fixtures/ga001_hf_clm_sft_no_trainer.py"
    result = flake8("--select", "GA", target)
    report = json.loads(gaaudit("check", target, "--format", "json", cwd=ROOT).stdout)
    expected = [(f["path"], f["line"], f["column"], f["code"]) for f in report["findings"]]
    assert expected and result.returncode == 1
    assert flake8_rows(result.stdout) == expected
    assert report["findings"][0]["message"] in result.stdout


def test_flake8_matches_check_on_the_python_fixtures():
    """Every Python fixture but the fixed twins (the fixer's output, which tests/test_fix.py
    checks clean)."""
    twins = "*.fixed.py"
    args = ("check", "fixtures", "--extend-exclude", twins, "--format", "json")
    report = json.loads(gaaudit(*args, cwd=ROOT).stdout)
    expected = sorted(
        (f["path"], f["line"], f["column"], f["code"])
        for f in report["findings"]
        # GA006 is on dependency files and notebooks are not flake8's: only Python files
        if f["path"].endswith(".py") and f["code"] != "GA006"
    )
    assert len(expected) > 200
    shown = flake8("--select", "GA", "--extend-exclude", twins, "fixtures").stdout
    assert sorted(flake8_rows(shown)) == expected


def test_flake8_clean_file_and_ignore():
    clean = flake8("--select", "GA", str(CLEAN.relative_to(ROOT)))
    assert (clean.returncode, clean.stdout) == (0, "")
    target = "fixtures/ga001_hf_clm_sft_no_trainer.py"
    ignored = flake8("--select", "GA", "--extend-ignore", "GA001", target)
    assert (ignored.returncode, ignored.stdout) == (0, "")


def test_flake8_reads_stdin_and_tool_gaaudit(tmp_path):
    shutil.copy(BUGGY, tmp_path / "train.py")
    piped = subprocess.run(
        [sys.executable, "-m", "flake8", "--select", "GA", "--stdin-display-name", "train.py", "-"],
        cwd=tmp_path,
        input=BUGGY.read_text(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert [row[3] for row in flake8_rows(piped.stdout)] == ["GA002"]
    (tmp_path / "pyproject.toml").write_text('[tool.gaaudit]\nignore = ["GA002"]\n')
    configured = flake8("--select", "GA", "train.py", cwd=tmp_path)
    assert (configured.returncode, configured.stdout) == (0, "")


def git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=120)


def git_repository(path: Path, files: dict[str, Path | str]) -> Path:
    """A fresh git repository at `path` holding `files` (name -> source path or text), staged."""
    path.mkdir()
    git("init", "-q", cwd=path)
    git("config", "user.email", "ci@example.com", cwd=path)
    git("config", "user.name", "CI", cwd=path)
    for name, source in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            shutil.copy(source, path / name)
        else:
            (path / name).write_text(source)
    git("add", ".", cwd=path)
    return path


@pytest.fixture(scope="session")
def pre_commit_run(tmp_path_factory):
    """Run the real pre-commit with hook HOOK of this checkout on a target repository.

    The checkout's working tree (tracked and untracked, not ignored) is committed to a copy,
    which a configuration outside the target names at that commit, as a user's
    `.pre-commit-config.yaml` would. Every call shares one PRE_COMMIT_HOME, so the hook's
    virtualenv (gaaudit and its dependencies from PyPI) is built once (`pre-commit try-repo`
    builds it anew on every call).
    """
    base = tmp_path_factory.mktemp("pre-commit")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    copy = base / "gaaudit"
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    git("init", "-q", cwd=copy)
    git("add", ".", cwd=copy)
    identity = ("-c", "user.email=ci@example.com", "-c", "user.name=CI")
    git(*identity, "commit", "-q", "-m", "snapshot", cwd=copy)
    rev = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=copy, check=True, capture_output=True, text=True
    ).stdout.strip()
    env = {**os.environ, "PRE_COMMIT_HOME": str(base / "home"), "PRE_COMMIT_COLOR": "never"}

    def run(hook: str, target: Path, *files: str) -> subprocess.CompletedProcess:
        """The hook on these `files`, or on every file of the repository."""
        config = base / f"{hook}.yaml"
        config.write_text(
            f"repos:\n- repo: {copy.as_posix()}\n  rev: {rev}\n  hooks:\n  - id: {hook}\n"
        )
        chosen = ["--files", *files] if files else ["--all-files"]
        result = subprocess.run(
            [sys.executable, "-m", "pre_commit", "run", "-c", str(config), *chosen],
            cwd=target,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if result.returncode == PRE_COMMIT_FATAL:
            log = Path(env["PRE_COMMIT_HOME"]) / "pre-commit.log"
            detail = log.read_text()[-3000:] if log.exists() else result.stdout + result.stderr
            pytest.fail(
                "pre-commit could not install gaaudit's hook environment; it pip-installs "
                f"gaaudit and its dependencies, which needs network access to PyPI.\n{detail}"
            )
        return result

    return run


def test_pre_commit_check_hook(pre_commit_run, tmp_path):
    both = git_repository(tmp_path / "both", {"train.py": BUGGY, "eval.py": CLEAN})
    failed = pre_commit_run("gaaudit", both)
    assert failed.returncode == 1, failed.stdout
    assert "GA002" in failed.stdout and "train.py" in failed.stdout
    clean = git_repository(tmp_path / "clean", {"eval.py": CLEAN})
    passed = pre_commit_run("gaaudit", clean)
    assert passed.returncode == 0, passed.stdout


def test_pre_commit_fix_hook(pre_commit_run, tmp_path):
    repository = git_repository(tmp_path / "repo", {"train.py": BUGGY, "eval.py": CLEAN})
    result = pre_commit_run("gaaudit-fix", repository)
    assert result.returncode == 1, result.stdout
    assert "files were modified by this hook" in result.stdout
    assert (repository / "train.py").read_text() == BUGGY.with_suffix(".fixed.py").read_text()
    assert (repository / "eval.py").read_text() == CLEAN.read_text()


def test_pre_commit_hooks_honour_the_configured_excludes(pre_commit_run, tmp_path):
    repository = git_repository(
        tmp_path / "repo",
        {
            "pyproject.toml": '[tool.gaaudit]\nextend-exclude = ["legacy"]\n',
            "legacy/train.py": BUGGY,
            "train.py": BUGGY,
        },
    )
    result = pre_commit_run("gaaudit-fix", repository)
    assert result.returncode == 1, result.stdout
    assert (repository / "legacy" / "train.py").read_text() == BUGGY.read_text()
    assert (repository / "train.py").read_text() == BUGGY.with_suffix(".fixed.py").read_text()
    git("add", ".", cwd=repository)
    assert pre_commit_run("gaaudit", repository).returncode == 0  # what is left is excluded


PIN = "transformers==4.40.0\n"  # before the Trainer's accumulation fix (GA006)
ACCUMULATES = FIXTURES / "ga001_hf_clm_sft_no_trainer.py"  # --gradient_accumulation_steps 8


def test_pre_commit_check_hook_runs_when_a_requirements_file_changes(pre_commit_run, tmp_path):
    repository = git_repository(
        tmp_path / "repo", {"requirements.txt": PIN, "train.py": ACCUMULATES}
    )
    result = pre_commit_run("gaaudit", repository, "requirements.txt")
    assert result.returncode == 1, result.stdout
    assert "requirements.txt:1:1: GA006" in result.stdout


def test_init_writes_a_local_hook_that_pre_commit_runs(tmp_path):
    """`gaaudit init`'s configuration works before any release: it runs the gaaudit
    installed beside the project (this test's interpreter's)."""
    from gaaudit.commands.init import HOOK_FILES

    repository = git_repository(tmp_path / "repo", {"train.py": BUGGY, "eval.py": CLEAN})
    assert gaaudit("init", ".", cwd=repository).returncode == 0
    git("add", ".", cwd=repository)
    scripts = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": scripts + os.pathsep + os.environ.get("PATH", ""),
        "PRE_COMMIT_HOME": str(tmp_path / "home"),
        "PRE_COMMIT_COLOR": "never",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pre_commit", "run", "--all-files"],
        cwd=repository,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1 and "train.py" in result.stdout and "GA002" in result.stdout
    for shown in (ROOT / ".pre-commit-hooks.yaml", ROOT / "README.md"):
        assert f"files: '{HOOK_FILES}'" in shown.read_text()  # the same files everywhere
