"""The on-disk cache of `check`: same reports, re-analysis whenever an input changed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, gaaudit

from gaaudit import cache
from gaaudit.checks import engine
from gaaudit.commands.check import CheckOptions, check
from gaaudit.config import Settings
from gaaudit.findings import Confidence

BUGGY = FIXTURES / "ga001_hf_clm_sft_no_trainer.py"
CLEAN = FIXTURES / "ok_eval_only_mean.py"
DEEPSPEED = FIXTURES / "ga003_deepspeed_json_config.py"
DEEPSPEED_CONFIG = FIXTURES / "ds_config_zero2.json"
NOTEBOOK = next(FIXTURES.glob("*.ipynb"), None)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project of buggy, clean and broken scripts, a notebook and a DeepSpeed config,
    checked from its root; files count as settled at once (no racy-timestamp window)."""
    monkeypatch.setattr(cache, "RACY_NS", 0)
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    shutil.copy(BUGGY, root / "src" / "train.py")
    shutil.copy(CLEAN, root / "src" / "evaluate.py")
    shutil.copy(DEEPSPEED, root / "deepspeed_train.py")
    shutil.copy(DEEPSPEED_CONFIG, root / DEEPSPEED_CONFIG.name)
    (root / "broken.py").write_text("def f(:\n    loss.backward()\n")
    if NOTEBOOK is not None:
        shutil.copy(NOTEBOOK, root / "src" / "notebook.ipynb")
    monkeypatch.chdir(root)
    return root


def run(capsys, *paths: str, **options) -> tuple[int, dict]:
    """`gaaudit check --format json` in this process: exit status and report."""
    options.setdefault("min_confidence", "low")
    code = check(CheckOptions(paths=tuple(map(Path, paths or ["."])), format="json", **options))
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def analyses(monkeypatch):
    """The paths analysed (parsed and audited) in this process, in order."""
    seen: list[str] = []
    audit = engine.audit

    def counting(module, text, shown, *args, **options):
        seen.append(shown)
        return audit(module, text, shown, *args, **options)

    monkeypatch.setattr(engine, "audit", counting)
    return seen


def test_hit_gives_the_same_report_and_reads_no_file(project, capsys, monkeypatch, analyses):
    first = run(capsys)
    assert first[0] == 2  # broken.py is an E999; the findings are reported too
    codes = {f["code"] for f in first[1]["findings"]}
    assert {"GA001", "GA003"} <= codes and first[1]["errors"][0]["path"] == "broken.py"
    assert analyses
    gitignore = project / cache.DIRECTORY / ".gitignore"
    assert gitignore.read_text().splitlines()[-1] == "*"

    def no_reading(path):
        raise AssertionError(f"{path} was read")

    analyses.clear()
    monkeypatch.setattr(engine, "read", no_reading)
    assert run(capsys) == first
    assert analyses == []


def test_the_fixable_count_is_planned_once_and_kept_with_the_report(project, capsys, monkeypatch):
    """The text summary's `[*] N fixable` is planned where a file is checked (JSON runs plan
    nothing) and cached with its report: a later run over unchanged files plans no fix."""
    from gaaudit.fixes import fixer

    planned: list[str] = []
    plan = fixer.fix_file

    def counting(path, *args, **options):
        planned.append(Path(path).as_posix())
        return plan(path, *args, **options)

    monkeypatch.setattr(fixer, "fix_file", counting)
    run(capsys)  # JSON: the cache holds the reports, not yet the count
    assert planned == []

    def text() -> str:
        check(CheckOptions(paths=(Path("."),), min_confidence="low"))
        return capsys.readouterr().out.splitlines()[-1]

    first = text()
    assert first.startswith("[*] ") and first.endswith(" fixable with `gaaudit fix`."), first
    assert "src/train.py" in {p.removeprefix(f"{project.as_posix()}/") for p in planned}
    planned.clear()
    assert text() == first
    assert planned == []


def test_the_fixable_count_plans_on_the_checks_own_analysis(project, capsys, monkeypatch, analyses):
    """A whole file that `check` analysed is not parsed and audited again to count its
    fixable findings; the count is the one a fix planned from nothing gives."""
    from gaaudit.fixes import fixer

    monkeypatch.setattr(fixer, "audit", engine.audit)  # the fixer's audits are counted too
    check(CheckOptions(paths=(Path("."),), min_confidence="low", no_cache=True))
    summary = capsys.readouterr().out.splitlines()[-1]
    assert analyses.count("src/train.py") == 1, analyses
    settings = Settings(min_confidence=Confidence.LOW)
    scripts = [*Path(".").rglob("*.py"), *Path(".").rglob("*.ipynb")]
    planned = sum(fixer.count_fixable(path, settings) for path in scripts)
    assert analyses.count("src/train.py") == 2  # planned from nothing: audited again
    assert summary == f"[*] {planned} fixable with `gaaudit fix`.", summary


def test_changed_file_is_analysed_again(project, capsys, analyses):
    train = project / "src" / "train.py"
    before = run(capsys)
    assert any(f["path"] == "src/train.py" for f in before[1]["findings"])
    stat = train.stat()
    text = train.read_text()
    fixed = text.replace("/ args.gradient_accumulation_steps", "* args.gradient_accumulation_steps")
    assert len(fixed) == len(text) and fixed != text
    train.write_text(fixed)
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime
    analyses.clear()
    after = run(capsys)
    assert analyses == ["src/train.py"]
    assert not any(f["path"] == "src/train.py" for f in after[1]["findings"])


def test_touched_but_unchanged_file_is_hashed_not_analysed(project, capsys, analyses):
    first = run(capsys)
    os.utime(project / "src" / "train.py")
    analyses.clear()
    assert run(capsys) == first
    assert analyses == []


def test_changed_dependency_is_analysed_again(project, capsys, analyses):
    assert any(f["code"] == "GA003" for f in run(capsys)[1]["findings"])
    config = project / DEEPSPEED_CONFIG.name
    config.write_text(config.read_text().replace('"gradient_accumulation_steps": 16', '"x": 16'))
    analyses.clear()
    report = run(capsys)[1]
    assert analyses == ["deepspeed_train.py"]
    assert not any(f["code"] == "GA003" for f in report["findings"])


def test_changed_helper_module_is_a_dependency(tmp_path, monkeypatch, capsys, analyses):
    """A loss helper imported from another module of the repository (cross-module provenance)."""
    monkeypatch.setattr(cache, "RACY_NS", 0)
    shutil.copytree(FIXTURES / "ga001_xmod_relative_helper", tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    before = run(capsys)
    assert [f["path"] for f in before[1]["findings"]] == ["sft/train.py"]
    losses = tmp_path / "repo" / "sft" / "losses.py"
    losses.write_text(losses.read_text().replace("ignore_index=IGNORE_INDEX,", 'reduction="sum",'))
    analyses.clear()
    after = run(capsys)
    assert "sft/train.py" in analyses
    assert after == run(capsys, no_cache=True) != before


def test_changed_settings_or_version_analyse_again(project, capsys, analyses, monkeypatch):
    run(capsys, min_confidence="high")
    analyses.clear()
    low = run(capsys, min_confidence="low")
    assert analyses  # another key: nothing reused
    analyses.clear()
    assert run(capsys, min_confidence="low") == low and analyses == []
    monkeypatch.setattr(cache, "__version__", "99.0.0")
    assert run(capsys, min_confidence="low") == low and analyses
    settings = Settings(root=project)
    assert cache.run_key(settings) != cache.run_key(Settings(root=project, ignore=("GA003",)))
    assert cache.run_key(settings) == cache.run_key(Settings(root=project))


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{not json",
        b'{"key": 1, "entries": []}',
        b"[1, 2, 3]",
        "corrupt entries",
        "foreign key",
    ],
)
def test_corrupt_cache_is_ignored(project, capsys, analyses, damage):
    first = run(capsys)
    analysed = sorted(analyses)
    shards = sorted((project / cache.DIRECTORY).rglob("*.json"))
    assert shards
    for shard in shards:
        if damage == "corrupt entries":
            data = json.loads(shard.read_text())
            for entry in data["entries"].values():
                entry[3] = [["GA001", "forged", 1, 1, 1, 2, 7, [], "", False, None]]
                entry[4] = "not an error"
            shard.write_text(json.dumps(data))
        elif damage == "foreign key":
            data = json.loads(shard.read_text())
            data["key"] = "another run"
            shard.write_text(json.dumps(data))
        else:
            shard.write_bytes(damage)
    analyses.clear()
    assert run(capsys) == first
    assert sorted(analyses) == analysed
    analyses.clear()
    assert run(capsys) == first and analyses == []  # rewritten whole


def test_no_cache_writes_nothing(project, capsys, analyses):
    before = sorted(project.rglob("*"))
    run(capsys, no_cache=True)
    run(capsys, no_cache=True)
    assert sorted(project.rglob("*")) == before
    assert len(analyses) == 2 * len(set(analyses))


def test_cache_dir_option_and_configuration_key(project, capsys, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    run(capsys, cache_dir=elsewhere)
    assert (elsewhere / ".gitignore").is_file() and list(elsewhere.rglob("*.json"))
    assert not (project / cache.DIRECTORY).exists()
    (project / "pyproject.toml").write_text('[tool.gaaudit]\ncache-dir = "build/lint-cache"\n')
    run(capsys)
    assert list((project / "build" / "lint-cache").rglob("*.json"))
    assert not (project / cache.DIRECTORY).exists()


def test_unwritable_cache_is_a_warning(project, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = check(CheckOptions(paths=(Path("."),), format="json", cache_dir=blocker / "cache"))
    captured = capsys.readouterr()
    assert code == 2 and json.loads(captured.out)["findings"]
    assert "gaaudit: warning: cannot write the cache in" in captured.err
    assert "--no-cache" in captured.err


def test_concurrent_runs_agree_and_leave_a_valid_cache(tmp_path):
    (tmp_path / "src").mkdir()
    for number in range(80):  # enough files for the worker pool
        shutil.copy(BUGGY if number % 4 == 0 else CLEAN, tmp_path / "src" / f"s{number}.py")
    command = [sys.executable, "-m", "gaaudit", "check", "src", "-f", "json", "--jobs", "2"]
    runs = [subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE) for _ in range(3)]
    outputs = [json.loads(process.communicate(timeout=300)[0]) for process in runs]
    assert all(output == outputs[0] for output in outputs)
    assert outputs[0]["summary"]["findings"] == 20
    again = gaaudit("check", "src", "-f", "json", "--jobs", "2", cwd=tmp_path)
    assert json.loads(again.stdout) == outputs[0]
    assert not list((tmp_path / cache.DIRECTORY).rglob("*.tmp"))
