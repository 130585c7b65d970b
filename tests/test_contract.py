"""The contract a ruff user relies on, through the real console entry point (run in the test's
process: `entry`): rule selection, excludes anchored at the configuration, exit codes, stdin,
what was not shown, help."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import tomllib
from conftest import FIXTURES, ROOT, entry

GA001 = FIXTURES / "ga001_hf_clm_sft_no_trainer.py"  # GA001 high, safely fixable
GA002 = FIXTURES / "ga002_hf_clm_no_division.py"  # GA002, safely fixable
LOW = FIXTURES / "ga001_exact_image_cls_drop_last.py"  # one GA001 at low confidence only
UNFIXABLE = FIXTURES / "ga003_deepspeed_dict_config_sft.py"  # GA003: its count is in a helper
CLEAN = FIXTURES / "ok_single_step_no_accumulation.py"
BROKEN = "def f(:\n    loss.backward()\n"  # a trigger in code that does not parse
GA006_BAD = tomllib.loads((ROOT / "rules" / "GA006.toml").read_text())["bad"]


def project(root: Path, files: dict[str, Path | str], config: str = "") -> Path:
    """A folder with these files (fixture paths or text) and, if given, a [tool.gaaudit]."""
    for name, content in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            shutil.copy(content, target)
        else:
            target.write_text(content)
    if config:
        (root / "pyproject.toml").write_text(f"[tool.gaaudit]\n{config}\n")
    return root


def codes(output: str) -> list[tuple[str, str]]:
    """(path, code) of each finding line of text output."""
    return re.findall(r"^(\S+?):\d+:\d+: (GA\d{3}) ", output, re.MULTILINE)


# 1. Rule selection -------------------------------------------------------------------------


@pytest.fixture
def two_rules(tmp_path):
    return project(tmp_path, {"one.py": GA001, "two.py": GA002})


@pytest.mark.parametrize(
    "select, wanted",
    [
        (["--select", "GA001,GA003"], [("one.py", "GA001")]),
        (["--select", "ga001"], [("one.py", "GA001")]),
        (["--select", "GA001", "--select", "ga002"], [("one.py", "GA001"), ("two.py", "GA002")]),
        (["--select", "GA00"], [("one.py", "GA001"), ("two.py", "GA002")]),
        (["--select", "all", "--ignore", "ga001"], [("two.py", "GA002")]),
        (["--ignore", "GA001, GA002"], []),
    ],
)
def test_select_and_ignore_take_lists_any_case_and_prefixes(two_rules, select, wanted):
    result = entry("check", ".", "--no-cache", *select, cwd=two_rules)
    assert sorted(codes(result.stdout)) == wanted
    assert result.returncode == (1 if wanted else 0)


@pytest.mark.parametrize("flag", ["--select", "--ignore", "--extend-select"])
def test_an_unknown_code_is_a_usage_error_that_lists_the_known_ones(two_rules, flag):
    result = entry("check", ".", flag, "GA001,GA999", cwd=two_rules)
    assert result.returncode == 2
    assert f"{flag}: unknown rule code or prefix 'GA999'" in result.stderr
    assert "GA001, GA002, GA003, GA004, GA005, GA006, GA007" in result.stderr
    assert entry("fix", ".", flag, "XY", cwd=two_rules).returncode == 2


def test_extend_select_adds_to_the_configured_selection(two_rules):
    (two_rules / "pyproject.toml").write_text('[tool.gaaudit]\nselect = ["ga002"]\n')
    only = entry("check", ".", "--no-cache", cwd=two_rules)
    assert codes(only.stdout) == [("two.py", "GA002")]
    both = entry("check", ".", "--no-cache", "--extend-select", "GA001", cwd=two_rules)
    assert sorted(codes(both.stdout)) == [("one.py", "GA001"), ("two.py", "GA002")]
    (two_rules / "pyproject.toml").write_text(
        '[tool.gaaudit]\nselect = ["GA002"]\nextend-select = ["ga001"]\n'
    )
    configured = entry("check", ".", "--no-cache", cwd=two_rules)
    assert sorted(codes(configured.stdout)) == sorted(codes(both.stdout))


def test_configured_codes_take_comma_lists_and_any_case(two_rules):
    (two_rules / "pyproject.toml").write_text(
        '[tool.gaaudit]\nselect = ["ga001, GA002"]\nper-file-ignores = { "two.py" = ["ga"] }\n'
    )
    result = entry("check", ".", "--no-cache", cwd=two_rules)
    assert codes(result.stdout) == [("one.py", "GA001")]


# 2. Excludes anchored at the configuration, --force-exclude -----------------------------


@pytest.fixture
def nested(tmp_path):
    files = {"src/train.py": GA001, "src/exp/train.py": GA001, "exp/train.py": GA001}
    return project(tmp_path, files, 'extend-exclude = ["src/exp"]')


@pytest.mark.parametrize(
    "args, cwd, wanted",
    [
        (["src"], ".", ["src/train.py"]),
        (["."], ".", ["exp/train.py", "src/train.py"]),
        (["."], "src", ["train.py"]),
        (["train.py", "exp"], "src", ["train.py"]),
        ([os.path.join(os.pardir, "src")], "exp", [f"{os.pardir}/src/train.py"]),
    ],
)
def test_excludes_are_anchored_at_the_configuration(nested, args, cwd, wanted):
    result = entry("check", *args, "--no-cache", cwd=nested / cwd)
    assert sorted(path for path, _ in codes(result.stdout)) == sorted(wanted)


def test_a_named_file_is_checked_unless_force_exclude(nested):
    named = entry("check", "exp/train.py", "--no-cache", cwd=nested / "src")
    assert codes(named.stdout) == [("exp/train.py", "GA001")]
    forced = entry("check", "exp/train.py", "--force-exclude", cwd=nested / "src")
    assert forced.returncode == 0 and codes(forced.stdout) == []
    assert "no Python files found under exp/train.py" in forced.stderr
    fixed = entry("fix", "src/exp/train.py", "--force-exclude", cwd=nested)
    assert (nested / "src/exp/train.py").read_bytes() == GA001.read_bytes()
    assert fixed.returncode == 0


def test_command_line_patterns_are_relative_to_the_current_folder(nested):
    result = entry("check", ".", "--extend-exclude", "train.py", "--no-cache", cwd=nested / "src")
    assert codes(result.stdout) == []  # a plain name excludes at any depth
    anchored = entry("check", "..", "--extend-exclude", "/train.py", cwd=nested / "src")
    assert sorted(p for p, _ in codes(anchored.stdout)) == [f"{os.pardir}/exp/train.py"]


def test_per_file_ignores_are_anchored_at_the_configuration(tmp_path):
    root = project(
        tmp_path,
        {"src/exp/train.py": GA001, "src/train.py": GA001},
        'per-file-ignores = { "src/exp/*.py" = ["GA001"] }',
    )
    result = entry("check", ".", "--no-cache", cwd=root / "src")
    assert codes(result.stdout) == [("train.py", "GA001")]


def test_gitignored_files_are_skipped_unless_asked(tmp_path):
    root = project(tmp_path, {"train.py": GA001, ".gitignore": "train.py\n"})
    skipped = entry("check", ".", "--no-cache", cwd=root)
    assert skipped.returncode == 0 and "no Python files found under ." in skipped.stderr
    kept = entry("check", ".", "--no-cache", "--no-respect-gitignore", cwd=root)
    assert codes(kept.stdout) == [("train.py", "GA001")]
    (root / "pyproject.toml").write_text("[tool.gaaudit]\nrespect-gitignore = false\n")
    assert codes(entry("check", ".", "--no-cache", cwd=root).stdout) == [("train.py", "GA001")]


# 3. --exit-zero --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "json", "sarif", "github"])
def test_exit_zero_covers_unparsable_files_and_still_reports_them(tmp_path, fmt):
    root = project(tmp_path, {"legacy.py": BROKEN, "train.py": GA001})
    plain = entry("check", ".", "-f", fmt, "--no-cache", cwd=root)
    assert plain.returncode == 2
    zero = entry("check", ".", "-f", fmt, "--no-cache", "--exit-zero", cwd=root)
    assert zero.returncode == 0 and "legacy.py" in zero.stdout
    usage = entry("check", ".", "--exit-zero", "--select", "GA999", cwd=root)
    assert usage.returncode == 2


# 4. fix: exit codes, options, summary --------------------------------------------------


def test_fix_exits_0_when_nothing_remains_and_names_the_files_it_changed(tmp_path):
    root = project(tmp_path, {"train.py": GA001, "eval.py": CLEAN})
    diff = entry("fix", ".", "--diff", "--no-cache", cwd=root)
    assert diff.returncode == 1 and diff.stdout.startswith("--- a/train.py")
    assert "Would fix 1 finding in 1 file (train.py)" in diff.stderr
    done = entry("fix", ".", "--no-cache", "--cache-dir", str(tmp_path / "c"), cwd=root)
    assert done.returncode == 0, done.stdout
    assert "Fixed 1 finding in 1 file (train.py); 0 not fixed." in done.stdout
    again = entry("fix", ".", "--diff", cwd=root)
    assert again.returncode == 0 and again.stdout == ""


def test_fix_exits_1_while_findings_remain(tmp_path):
    root = project(tmp_path, {"train.py": UNFIXABLE})
    before = entry("check", ".", "--no-cache", cwd=root)
    assert before.returncode == 1
    result = entry("fix", ".", "--no-cache", cwd=root)
    assert result.returncode == 1 and "GA003 not fixed" in result.stdout
    assert "Fixed 0 findings in 0 files; 1 not fixed." in result.stdout
    assert entry("fix", ".", "--exit-zero", cwd=root).returncode == 0
    assert entry("fix", ".", "--diff", cwd=root).returncode == 1


def test_fix_raises_a_pin_in_a_requirements_file_only_as_an_unsafe_fix(tmp_path):
    """GA006 on a dependency file: raising the pin is an unsafe fix, so `fix` names it as
    such and exits 1, leaving every file as it was; `--unsafe-fixes` rewrites the pin alone."""
    script = "\n".join(
        line for line in GA006_BAD.splitlines() if not line.startswith("#")
    )  # the script without its inline metadata: the pin is in requirements.txt
    root = project(tmp_path, {"train.py": script, "requirements.txt": "transformers==4.45.2\n"})
    assert codes(entry("check", ".", "--no-cache", cwd=root).stdout) == [
        ("requirements.txt", "GA006")
    ]
    result = entry("fix", ".", "--no-cache", cwd=root)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "requirements.txt:1:1: GA006 not fixed: unsafe fix (`transformers>=4.46.2`" in result.stdout
    )
    assert "Fixed 0 findings in 0 files; 1 not fixed." in result.stdout
    assert "1 hidden fix can be enabled with --unsafe-fixes." in result.stdout
    assert (root / "train.py").read_text() == script
    assert (root / "requirements.txt").read_text() == "transformers==4.45.2\n"
    assert entry("fix", "requirements.txt", "--no-cache", cwd=root).returncode == 1
    assert entry("fix", ".", "--exit-zero", cwd=root).returncode == 0
    unsafe = entry("fix", ".", "--no-cache", "--unsafe-fixes", cwd=root)
    assert unsafe.returncode == 0, unsafe.stdout + unsafe.stderr
    assert "Fixed 1 finding in 1 file (requirements.txt); 0 not fixed." in unsafe.stdout
    assert "hidden fix" not in unsafe.stdout
    assert (root / "requirements.txt").read_text() == "transformers>=4.46.2\n"
    assert (root / "train.py").read_text() == script


def test_fix_skips_files_the_cache_knows_are_clean(tmp_path):
    root = project(tmp_path, {"train.py": GA001, "eval.py": CLEAN})
    entry("check", ".", cwd=root)  # fills the cache
    (root / "eval.py").chmod(0o444)  # a fix that opened it to rewrite would be refused
    result = entry("fix", ".", cwd=root)
    assert result.returncode == 0 and "Fixed 1 finding in 1 file (train.py)" in result.stdout


# 5. stdin --------------------------------------------------------------------------------


def test_check_reads_stdin_as_the_named_file(tmp_path):
    root = project(tmp_path, {"src/placeholder.txt": ""}, 'extend-exclude = ["src/old"]')
    text = GA001.read_text()
    found = entry("check", "-", "--stdin-filename", "src/train.py", cwd=root, stdin=text)
    assert found.returncode == 1
    assert codes(found.stdout) == [("src/train.py", "GA001")]
    excluded = entry("check", "-", "--stdin-filename", "src/old/a.py", cwd=root, stdin=text)
    assert excluded.returncode == 0 and codes(excluded.stdout) == []
    anonymous = entry("check", "-", cwd=root, stdin=text)
    assert codes(anonymous.stdout) == [("-", "GA001")]


def test_fix_reads_stdin_and_prints_the_fixed_source(tmp_path):
    args = ["fix", "-", "--stdin-filename", "train.py"]
    fixed = entry(*args, cwd=tmp_path, stdin=GA002.read_text())
    assert fixed.returncode == 0
    assert fixed.stdout == GA002.with_suffix(".fixed.py").read_text()
    assert "Fixed 1 finding" in fixed.stderr
    clean = entry(*args, cwd=tmp_path, stdin=CLEAN.read_text())
    assert clean.returncode == 0 and clean.stdout == CLEAN.read_text()
    broken = entry(*args, cwd=tmp_path, stdin=BROKEN)
    assert broken.returncode == 2 and broken.stdout == BROKEN
    assert "train.py:1:" in broken.stderr


def test_stdin_takes_no_other_path(tmp_path):
    result = entry("check", "-", "train.py", cwd=tmp_path)
    assert result.returncode == 2 and "`-` reads one file" in result.stderr
    assert entry("check", ".", "--stdin-filename", "a.py", cwd=tmp_path).returncode == 2


# 7. What was not shown -------------------------------------------------------------------


def test_the_summary_counts_hidden_and_fixable_findings(tmp_path):
    root = project(tmp_path, {"exact.py": LOW, "train.py": GA001})
    text = entry("check", ".", "--no-cache", cwd=root).stdout
    assert "1 more finding at low confidence (`--min-confidence low`)." in text
    assert "[*] 1 fixable with `gaaudit fix`." in text
    shown = entry("check", ".", "--no-cache", "--min-confidence", "low", cwd=root).stdout
    assert "more finding" not in shown and len(codes(shown)) == 2
    document = json.loads(entry("check", ".", "-f", "json", cwd=root).stdout)
    assert document["summary"]["hidden"] == 1 and document["summary"]["findings"] == 1
    (root / "train.py").unlink()
    only_low = entry("check", ".", cwd=root)  # answered from the cache: the count is kept
    assert only_low.returncode == 0 and "1 more finding at low confidence" in only_low.stdout
    assert "[*]" not in only_low.stdout


# 8. Help ---------------------------------------------------------------------------------

COMMANDS = ["check", "fix", "verify", "rules", "explain", "init"]


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_is_readable(command):
    short = entry(*command, "-h")
    assert short.returncode == 0 and short.stdout == entry(*command, "--help").stdout
    assert not re.search(
        r"<list\[|<int range>|<float>|<str>|<path>|[a-z,]\.\.\.$", short.stdout, re.MULTILINE
    )


def test_version_flags():
    assert entry("-V").stdout == entry("--version").stdout
    assert re.fullmatch(r"gaaudit \d+\.\d+\.\d+\S*\n", entry("-V").stdout)


def test_verify_offers_only_the_formats_it_writes(tmp_path):
    help_text = entry("verify", "-h").stdout
    assert "sarif" not in help_text and "github" not in help_text
    result = entry("verify", "x.py", "--format", "sarif", cwd=tmp_path)
    assert result.returncode == 2 and "sarif" in result.stderr


# Options README names but gaaudit does not own: flake8's, pre-commit's and Megatron's.
FOREIGN_FLAGS = {"--extend-ignore", "--all-files", "--calculate-per-token-loss", "--eod-mask-loss"}


def test_every_option_the_readme_and_docs_name_exists():
    readme = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    # (a flag with an underscore, Lightning's `--accumulate_grad_batches`, is another program's)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)(?!\w)", readme)) - FOREIGN_FLAGS
    helps = "\n".join(entry(*c, "-h").stdout for c in [[], *([c] for c in COMMANDS)])
    offered = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", helps))
    assert named <= offered, sorted(named - offered)


# The stages of docs/architecture.md, in the order a file flows through them.
STAGES = ("discover", "analysis", "checks", "fixes", "output", "harness", "commands")
SHARED = {"findings", "config", "catalogue", "cache", "vocabulary"}


def test_the_package_is_laid_out_by_stage_and_imports_run_one_way():
    package = ROOT / "gaaudit"
    top = {p.stem for p in package.glob("*.py")} - {"__init__", "__main__", "cli"}
    assert top <= SHARED, sorted(top - SHARED)
    assert {p.name for p in package.iterdir() if (p / "__init__.py").exists()} == set(STAGES)
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).parts
        stage = parts[0] if len(parts) > 1 else path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gaaudit")):
                continue
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            imported = {m.split(".")[1] for m in modules if m.count(".") >= 1} & set(STAGES)
            if stage in SHARED:  # values every stage reads: they import no stage
                assert not imported, f"{path.relative_to(ROOT)}:{node.lineno} imports {imported}"
            elif stage in STAGES:
                later = {s for s in imported if STAGES.index(s) > STAGES.index(stage)}
                assert not later, f"{path.relative_to(ROOT)}:{node.lineno} imports {later}"
