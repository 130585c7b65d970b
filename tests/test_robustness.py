"""Hostile input, atomic writes, inert analysis and bounded resources: gaaudit never
corrupts, crashes on or runs the code it is given."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT

from gaaudit.config import Settings
from gaaudit.discover.source import MAX_BYTES, SourceError, read
from gaaudit.fixes import codemod, fixer
from gaaudit.fixes.codemod import WriteError, write_atomic
from gaaudit.fixes.fixer import fix_source

BUGGY = textwrap.dedent(
    """\
    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForSeq2Seq

    model = AutoModelForCausalLM.from_pretrained("gpt2")
    for step, batch in enumerate(loader):
        outputs = model(**batch)  # forward
        loss = outputs.loss / accum_steps
        loss.backward()
        if (step + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    """
)
# An accumulation window: the screen keeps the file for libcst, which meets the hostile line.
TRIGGER = "\nfor i, x in enumerate(xs):\n    f(x).backward()\n    if i % 2:\n        opt.step()\n"
CONSOLE = Path(sys.executable).with_name("gaaudit")
# The installed console script keeps the working directory off `sys.path`, unlike `python -m`.
COMMAND = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-I", "-m", "gaaudit"]
# Runs the command line after it with Ctrl-C's default action (exec keeps it).
DEFAULT_SIGINT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]
LINUX = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="counts processes in /proc")


def gaaudit(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real command line in a subprocess."""
    return subprocess.run(
        [*COMMAND, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        check=False,
    )


def fixed_text(text: str) -> str:
    return fix_source(text.encode(), Path("x.py"), Settings(), True).after.decode()


NESTED = "E999 code nested too deeply to analyse"
# name -> (bytes, how its E999 line starts after `name:`, what it says); positions that
# depend on the Python version are left out.
HOSTILE = {
    "syntax.py": (
        b"def f(:\n    loss.backward()\n",
        "1:7:",
        "E999 syntax error, not valid Python 3",
    ),
    "python2.py": (
        b'print "x"\nloss.backward()\n',
        "1:1:",
        "E999 syntax error, not valid Python 3: Missing parentheses in call to 'print'",
    ),
    "nulls.py": (b"x = 1\0\nloss.backward()\n", "1:6:", "E999 file contains null bytes"),
    "binary.py": (bytes(range(256)) * 64, "1:1:", "E999 file contains null bytes"),
    "image.py": (
        b"\x89PNG\r\n\x1a\n" + bytes(range(1, 256)) * 8,
        "1:1:",
        "E999 cannot decode as utf-8",
    ),
    "latin1_no_cookie.py": (
        b'x = "caf\xe9"\nloss.backward()\n',
        "1:9:",
        "E999 cannot decode as utf-8 (invalid continuation byte); add an encoding cookie",
    ),
    "late_bad_byte.py": (b"loss.backward()\n# \xff\n", "2:3:", "E999 cannot decode as utf-8"),
    "unknown_cookie.py": (
        b"# -*- coding: klingon -*-\nloss.backward()\n",
        "1:1:",
        "E999 cannot decode: unknown encoding",
    ),
    "bom_and_cookie.py": (
        b"\xef\xbb\xbf# coding: latin-1\nloss.backward()\n",
        "1:1:",
        "E999 cannot decode: encoding problem",
    ),
    "parens_5000.py": (
        ("x = " + "(" * 5000 + "1" + ")" * 5000 + TRIGGER).encode(),
        "1:",
        "E999 syntax error, not valid Python 3: too many nested parentheses",
    ),
    "unary_5000.py": (("x = " + "-" * 5000 + "1" + TRIGGER).encode(), "1:", NESTED),
    "attributes_5000.py": (("x = a" + ".b" * 5000 + TRIGGER).encode(), "1:", NESTED),
    "calls_5000.py": (("x = f" + "()" * 5000 + TRIGGER).encode(), "1:", NESTED),
    # CPython accepts the next four, which libcst cannot walk within the recursion limit
    # (and the first overflowed the C stack of libcst's parser).
    "and_20000.py": (("x = a" + " and a" * 20000 + TRIGGER).encode(), "1:", NESTED),
    "strings_3000.py": (("x = (" + "'a' " * 3000 + ")" + TRIGGER).encode(), "1:", NESTED),
    "lists_190.py": (("x = " + "[" * 190 + "]" * 190 + TRIGGER).encode(), "1:", NESTED),
    "for_clauses_500.py": (
        ("x = [a " + "for a in b " * 500 + "]" + TRIGGER).encode(),
        "1:",
        NESTED,
    ),
    "too_large.py": (
        b"loss.backward()\n" + b"x = 1\n" * (20 * 2**20 // 6),
        "1:1:",
        "E999 file too large to analyse",
    ),
}


def error_line(output: str, name: str) -> str:
    """The one E999 line reported for `name`."""
    (line,) = [
        line for line in output.splitlines() if line.startswith(f"{name}:") and "E999" in line
    ]
    return line


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_file_is_one_clear_error_and_fix_writes_nothing(name, tmp_path, cli):
    data, start, message = HOSTILE[name]
    (tmp_path / name).write_bytes(data)
    started = time.perf_counter()
    result = cli("check", name, cwd=tmp_path)
    assert result.exit_code == 2, result.output
    line = error_line(result.output, name)
    assert line.startswith(f"{name}:{start}") and message in line, line
    assert "1 file could not be checked" in result.output
    result = cli("fix", name, cwd=tmp_path)
    assert result.exit_code == 2
    line = error_line(result.output, name)
    assert line.startswith(f"{name}:{start}") and message in line, line
    assert (tmp_path / name).read_bytes() == data
    assert time.perf_counter() - started < 30


def test_hostile_tree_in_a_subprocess_no_traceback_no_crash(tmp_path):
    """The real entry point, walking a tree of every hostile file next to a good one:
    one E999 per file, the good one still checked, nothing written."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name, (data, _, _) in HOSTILE.items():
        (tree / name).write_bytes(data)
    (tree / "good.py").write_text(BUGGY)
    before = {p.name: p.read_bytes() for p in tree.iterdir()}
    result = gaaudit("check", "tree", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    for name, (_, start, message) in HOSTILE.items():
        line = error_line(result.stdout, f"tree/{name}")
        assert line.startswith(f"tree/{name}:{start}") and message in line, line
    assert "tree/good.py:7:12: GA001" in result.stdout
    assert f"{len(HOSTILE)} files could not be checked" in result.stdout
    result = gaaudit("fix", "tree", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stdout + result.stderr
    assert result.stdout.count("E999") == len(HOSTILE)
    after = {p.name: p.read_bytes() for p in tree.iterdir()}
    assert after.pop("good.py") != before.pop("good.py")
    assert after == before


@pytest.mark.parametrize(
    "transform",
    [
        lambda s: s.replace("\n", "\r\n"),
        lambda s: s.replace("\n", "\r\n", 5),  # mixed: CRLF, then LF
        lambda s: s.replace("\n", "\r"),
        lambda s: "\ufeff" + s,
        lambda s: s.replace("    ", "\t").replace("\n", "\r\n"),
        lambda s: s.replace("# forward", "# f\u2028or\u2029ward \x85 \U0001f680"),
        lambda s: s.rstrip("\n"),
    ],
    ids=["crlf", "mixed", "cr", "bom", "tabs-crlf", "unicode-separators", "no-final-newline"],
)
def test_odd_but_valid_files_are_fixed_keeping_every_line_ending(transform, tmp_path, cli):
    text = transform(BUGGY)
    path = tmp_path / "train.py"
    path.write_bytes(text.encode())
    assert cli("check", "train.py", cwd=tmp_path).exit_code == 1
    assert cli("fix", "train.py", cwd=tmp_path).exit_code == 0
    after = path.read_bytes()
    compile(after, "train.py", "exec")
    assert after.startswith(text.encode()[:20])
    before_lines = text.encode().splitlines(keepends=True)
    after_lines = after.splitlines(keepends=True)
    for line in before_lines:
        if b"/ accum_steps" not in line:
            assert line in after_lines, line  # same content, same ending
    assert cli("check", "train.py", cwd=tmp_path).exit_code == 0
    assert cli("fix", "train.py", cwd=tmp_path).exit_code == 0 and path.read_bytes() == after


def test_latin1_file_with_cookie_round_trips_byte_for_byte(tmp_path, cli):
    header = "# -*- coding: latin-1 -*-\n# Trainingsschleife f\xfcr das Modell, \xa9 caf\xe9\n"
    clean = header + "print('r\xe9sum\xe9')\n"
    (tmp_path / "clean.py").write_bytes(clean.encode("latin-1"))
    (tmp_path / "train.py").write_bytes((header + BUGGY).encode("latin-1"))
    assert cli("check", ".", cwd=tmp_path).exit_code == 1
    assert cli("fix", ".", cwd=tmp_path).exit_code == 0
    assert (tmp_path / "clean.py").read_bytes() == clean.encode("latin-1")
    after = (tmp_path / "train.py").read_bytes()
    assert after == fixed_text(header.replace("latin-1", "utf-8") + BUGGY).replace(
        "utf-8", "latin-1", 1
    ).encode("latin-1")
    assert cli("check", ".", cwd=tmp_path).exit_code == 0


def test_large_file_without_triggers_is_checked_quickly(tmp_path, cli):
    data = b"x = 1  # padding\n" * (20 * 2**20 // 17)
    (tmp_path / "data.py").write_bytes(data)
    started = time.perf_counter()
    assert cli("check", "data.py", cwd=tmp_path).exit_code == 0
    assert cli("fix", "data.py", cwd=tmp_path).exit_code == 0
    assert (tmp_path / "data.py").read_bytes() == data
    assert time.perf_counter() - started < 10
    assert len(data) > MAX_BYTES


def test_undecodable_file_names_in_every_format(tmp_path):
    try:
        (tmp_path / os.fsdecode(b"caf\xe9.py")).write_text(BUGGY)
        (tmp_path / os.fsdecode(b"bro\xffken.py")).write_text("def f(:\n    loss.backward()\n")
    except (OSError, UnicodeError):
        pytest.skip("this file system only takes UTF-8 names")
    for fmt in ("text", "json", "github", "sarif"):
        result = gaaudit("check", "-f", fmt, ".", cwd=tmp_path)
        assert "Traceback" not in result.stderr, (fmt, result.stderr[-2000:])
        assert result.returncode == 2, fmt
    result = gaaudit("fix", ".", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "window_tokens" in (tmp_path / os.fsdecode(b"caf\xe9.py")).read_text()


def test_newer_syntax_than_this_python_is_analysed_or_refused_cleanly(tmp_path, cli):
    """libcst may accept syntax this interpreter rejects (`type` aliases before 3.12);
    nesting there is bounded on libcst's own tree."""
    (tmp_path / "alias.py").write_text("type Alias = list[int]\n" + BUGGY)
    (tmp_path / "deep.py").write_text("type Alias = int\nx = a" + " and a" * 20000 + TRIGGER)
    result = cli("check", ".", cwd=tmp_path)
    assert "alias.py:8:12: GA001" in result.output
    assert "deep.py:" in result.output and "E999 code nested too deeply" in result.output


def test_unreadable_file(tmp_path, cli, monkeypatch):
    locked = tmp_path / "locked.py"
    locked.write_text(BUGGY)
    locked.chmod(0)
    result = cli("check", "locked.py", cwd=tmp_path)
    if os.access(locked, os.R_OK):  # root reads it anyway: then it is simply checked
        assert result.exit_code == 1 and "locked.py:7:12: GA001" in result.output
    else:
        assert result.exit_code == 2 and "locked.py:1:1: E999 cannot read file" in result.output
    locked.chmod(0o644)

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_bytes", denied)
    result = cli("check", "locked.py", cwd=tmp_path)
    assert result.exit_code == 2
    assert "locked.py:1:1: E999 cannot read file: Permission denied" in result.output
    result = cli("fix", "locked.py", cwd=tmp_path)
    assert result.exit_code == 2 and "E999 cannot read file: Permission denied" in result.output


def test_directory_named_like_a_python_file(tmp_path, cli):
    for where in (tmp_path / "explicit.py", tmp_path / "tree" / "nested.py"):
        where.mkdir(parents=True)
        (where / "train.py").write_text(BUGGY)
    result = cli("check", "explicit.py", "tree", cwd=tmp_path)
    assert result.exit_code == 1 and "E999" not in result.output
    assert "explicit.py/train.py:7:12: GA001" in result.output
    assert "tree/nested.py/train.py:7:12: GA001" in result.output
    with pytest.raises(SourceError, match="is a directory"):
        read(tmp_path / "explicit.py")


def test_pipe_named_like_a_python_file_is_not_read(tmp_path, cli):
    """Reading a FIFO blocks until someone writes: the walk lists regular files only."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "train.py").write_text(BUGGY)
    result = gaaudit("check", ".", cwd=tmp_path, timeout=30)
    assert result.returncode == 1 and "train.py:7:12: GA001" in result.stdout
    assert "pipe.py" not in result.stdout


def test_unlistable_directory_is_an_error_not_a_silent_skip(tmp_path, cli, monkeypatch):
    """As root every directory can be listed: the denial is simulated."""
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "train.py").write_text(BUGGY)
    (tmp_path / "train.py").write_text(BUGGY)
    scandir, access = os.scandir, os.access

    def denied_scandir(path="."):
        if Path(path).name == "secret":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", denied_scandir)
    monkeypatch.setattr(
        os,
        "access",
        lambda path, mode, **kw: Path(path).name != "secret" and access(path, mode, **kw),
    )
    for command in ("check", "fix"):
        result = cli(command, ".", cwd=tmp_path)
        assert result.exit_code == 2, result.output
        assert "secret:1:1: E999 cannot list directory: permission denied" in result.output
    assert "window_tokens" in (tmp_path / "train.py").read_text()
    assert (tmp_path / "secret" / "train.py").read_text() == BUGGY


def test_dependency_files_that_are_pipes_or_loops_neither_hang_nor_crash(tmp_path):
    """GA006 reads requirement and config files of the checked tree."""
    (tmp_path / "train.py").write_text(BUGGY)
    (tmp_path / "requirements.txt").symlink_to("requirements.txt")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "setup.cfg")
        os.mkfifo(tmp_path / "config.yaml")
    result = gaaudit("check", ".", cwd=tmp_path, timeout=30)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1 and "train.py:7:12: GA001" in result.stdout


def test_symlinks_loops_and_links_out_of_the_tree_are_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "elsewhere.py").write_text(BUGGY)
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "train.py").write_text(BUGGY)
    (tree / "loop").symlink_to("loop")
    (tree / "a").symlink_to("b")
    (tree / "b").symlink_to("a")
    (tree / "up").symlink_to("..")
    (tree / "pkg" / "self").symlink_to(".")
    (tree / "out").symlink_to(outside)
    (tree / "linked.py").symlink_to(outside / "elsewhere.py")
    (tree / "dangling.py").symlink_to(tmp_path / "missing.py")
    (tree / "looped.py").symlink_to("looped.py")
    result = gaaudit("check", ".", cwd=tree, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "pkg/train.py:7:12: GA001" in result.stdout
    assert "elsewhere" not in result.stdout and "linked.py" not in result.stdout
    assert "Found 1 finding" in result.stdout and "of 1 file " in result.stdout


@pytest.mark.parametrize("first", [True, False], ids=["first-argument", "later-argument"])
def test_symlink_loop_named_explicitly_is_an_error(tmp_path, first):
    (tmp_path / "good.py").write_text(BUGGY)
    (tmp_path / "looped.py").symlink_to("looped.py")
    args = ["looped.py", "good.py"] if first else ["good.py", "looped.py"]
    result = gaaudit("check", *args, cwd=tmp_path, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2
    assert "looped.py:1:1: E999 cannot read file" in result.stdout


def test_read_only_file_is_refused_even_for_root(tmp_path, cli):
    locked = tmp_path / "locked.py"
    locked.write_text(BUGGY)
    locked.chmod(0o444)
    result = cli("fix", "locked.py", cwd=tmp_path)
    assert result.exit_code == 2
    assert "locked.py: E999 file is not writable" in result.output
    assert locked.read_text() == BUGGY and stat.S_IMODE(locked.stat().st_mode) == 0o444


def test_file_edited_during_fix_is_not_overwritten(tmp_path, cli, monkeypatch):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)
    planned = fixer.fix_file

    def edited_meanwhile(path, settings, unsafe=False, data=None):
        result = planned(path, settings, unsafe, data)
        path.write_text(BUGGY + "# saved by the editor meanwhile\n")
        return result

    monkeypatch.setattr(fixer, "fix_file", edited_meanwhile)
    result = cli("fix", "train.py", cwd=tmp_path)
    assert result.exit_code == 2
    assert "train.py: E999 file changed while gaaudit was fixing it" in result.output
    assert target.read_text() == BUGGY + "# saved by the editor meanwhile\n"
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_write_goes_through_a_temporary_file_in_the_same_directory(tmp_path, monkeypatch):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)
    target.chmod(0o640)
    inode = target.stat().st_ino
    renames = []
    replace = os.replace

    def spy(source, destination):
        source = Path(source)
        renames.append(
            (source.parent, source.name, source.read_bytes(), stat.S_IMODE(source.stat().st_mode))
        )
        assert target.read_text() == BUGGY  # untouched until the rename
        replace(source, destination)

    monkeypatch.setattr(codemod.os, "replace", spy)
    write_atomic(target, b"new\n", BUGGY.encode())
    ((directory, name, data, mode),) = renames
    assert directory == tmp_path and name.startswith(".train.py.") and name.endswith(".gaaudit")
    assert data == b"new\n" and mode == 0o640
    assert target.read_bytes() == b"new\n" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert target.stat().st_ino != inode  # replaced by rename, not rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


@pytest.mark.parametrize("failing", ["replace", "fsync"])
@pytest.mark.parametrize(
    "error",
    [OSError(28, "No space left on device"), KeyboardInterrupt()],
    ids=["oserror", "ctrl-c"],
)
def test_failed_write_leaves_the_original_and_no_temporary_file(
    tmp_path, monkeypatch, failing, error
):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)

    def fail(*args):
        raise error

    monkeypatch.setattr(codemod.os, failing, fail)
    expected = WriteError if isinstance(error, OSError) else KeyboardInterrupt
    with pytest.raises(expected):
        write_atomic(target, b"new\n", BUGGY.encode())
    assert target.read_text() == BUGGY
    assert [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_failed_rename_during_fix_is_a_clean_error(tmp_path, cli, monkeypatch):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)

    def fail(source, destination):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(codemod.os, "replace", fail)
    result = cli("fix", "train.py", cwd=tmp_path)
    assert result.exit_code == 2
    assert "train.py: E999 cannot write: Invalid cross-device link" in result.output
    assert target.read_text() == BUGGY and [p.name for p in tmp_path.iterdir()] == ["train.py"]


def test_symlinked_file_is_fixed_through_the_link(tmp_path, cli):
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "train.py"
    real.write_text(BUGGY)
    link = tmp_path / "train.py"
    link.symlink_to(real)
    assert cli("fix", "train.py", cwd=tmp_path).exit_code == 0
    assert link.is_symlink() and link.resolve() == real
    assert real.read_text() == fixed_text(BUGGY)
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["train.py"]


def test_fix_keeps_the_owner(tmp_path, cli):
    target = tmp_path / "train.py"
    target.write_text(BUGGY)
    if os.geteuid() == 0:  # only root may give a file away
        os.chown(target, 4321, 4321)
    owner = (target.stat().st_uid, target.stat().st_gid)
    assert cli("fix", "train.py", cwd=tmp_path).exit_code == 0
    assert target.read_text() == fixed_text(BUGGY)
    assert (target.stat().st_uid, target.stat().st_gid) == owner


# Importing or running any of these files creates its sentinel.
PLANTED = (
    "train.py",
    "gaaudit.py",
    "conftest.py",
    "__init__.py",
    "setup.py",
    "sitecustomize.py",
    "usercustomize.py",
    "torch.py",
    "libcst.py",
    "typer.py",
    "pkg/__init__.py",
    "pkg/__main__.py",
)


def test_check_and_fix_never_import_or_run_the_analysed_code(tmp_path):
    tree, sentinels = tmp_path / "tree", tmp_path / "sentinels"
    sentinels.mkdir()
    (tree / "pkg").mkdir(parents=True)
    for name in PLANTED:
        marker = sentinels / name.replace("/", "_")
        (tree / name).write_text(f"open({str(marker)!r}, 'w').close()\n" + BUGGY)
    for number in range(70):  # enough files for the worker pool
        (tree / f"copy_{number}.py").write_text(
            f"open({str(sentinels / 'copy')!r}, 'w').close()\n" + BUGGY
        )
    (tree / "pyproject.toml").write_text("[tool.gaaudit]\nmin-confidence = 'low'\n")
    for args in (
        ["check", "."],
        ["check", "--jobs", "2", "."],
        ["check", "-f", "json", "."],
        ["check", "-f", "sarif", "."],
        ["fix", "--diff", "."],
        ["fix", "."],
    ):
        result = gaaudit(*args, cwd=tree)
        assert result.returncode in (0, 1), (args, result.stdout[-2000:], result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        assert list(sentinels.iterdir()) == [], args
    assert "window_tokens" in (tree / "gaaudit.py").read_text()  # it was fixed, never run


def test_report_paths_are_relative_to_the_working_directory(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text(BUGGY)
    (project / "src" / "broken.py").write_text("def f(:\n    loss.backward()\n")
    for args in (
        ["src"],
        [str(project / "src")],
        [str(project / "src" / "train.py"), "src/broken.py"],
    ):
        outputs = {}
        for fmt in ("json", "sarif"):
            result = gaaudit("check", "-f", fmt, *args, cwd=project)
            assert result.returncode == 2, result.stderr
            outputs[fmt] = result.stdout
            for forbidden in {str(tmp_path), str(Path.home()), str(project)} - {"/"}:
                assert forbidden not in result.stdout, (fmt, args, forbidden)
        report = json.loads(outputs["json"])
        assert [f["path"] for f in report["findings"]] == ["src/train.py"]
        assert [e["path"] for e in report["errors"]] == ["src/broken.py"]
        (run,) = json.loads(outputs["sarif"])["runs"]
        uris = {
            r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in run["results"]
        }
        assert uris == {"src/train.py"}


def _process_group(group: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process in a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append((int(entry.name), command))
    return members


def _workers(group: int, main: int) -> list[int]:
    """Worker processes of the run: the group less the main process and multiprocessing's
    resource tracker."""
    return [
        pid
        for pid, command in _process_group(group)
        if pid != main and "resource_tracker" not in command
    ]


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    """The console script in its own process group, with Ctrl-C's default action as in a
    terminal (a runner started in the background ignores SIGINT, and its children inherit
    that); output goes to files, which, unlike pipes nobody reads while it runs, never fill
    up and block it."""
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(
            [*DEFAULT_SIGINT, *COMMAND, *args],
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    return process, stdout, stderr


def _tree(directory: Path, count: int, source: str) -> None:
    directory.mkdir()
    for number in range(count):
        (directory / f"train_{number:04}.py").write_text(source)


@LINUX
def test_jobs_bounds_the_worker_processes(tmp_path):
    _tree(tmp_path / "many", 300, BUGGY)
    process, stdout, stderr = _start(tmp_path, "check", "--jobs", "2", "-q", "many")
    most = 0
    while process.poll() is None:
        most = max(most, len(_workers(process.pid, process.pid)))
        time.sleep(0.02)
    assert process.returncode == 1, stderr.read_text()
    assert stdout.read_text().count(": GA001 [high]") == 300
    assert 1 <= most <= 2


@LINUX
@pytest.mark.parametrize("target", ["group", "main"], ids=["ctrl-c-in-terminal", "sigint-to-main"])
def test_interrupt_stops_cleanly_with_no_stray_workers(tmp_path, target):
    _tree(tmp_path / "big", 600, (FIXTURES / "ga001_hf_clm_sft_no_trainer.py").read_text())
    process, _, stderr = _start(tmp_path, "check", "--jobs", "2", "big")
    deadline = time.monotonic() + 60
    while len(_workers(process.pid, process.pid)) < 2 and time.monotonic() < deadline:
        assert process.poll() is None, stderr.read_text()
        time.sleep(0.05)
    time.sleep(0.5)  # workers busy with files
    interrupted = time.monotonic()
    if target == "group":
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    assert time.monotonic() - interrupted < 30
    errors = stderr.read_text()
    assert process.returncode in (130, 2), (process.returncode, errors[-2000:])
    assert "Traceback" not in errors, errors[-3000:]
    deadline = time.monotonic() + 10
    while _process_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _process_group(process.pid) == []


def _corpus():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import corpus
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return corpus


def test_corpus_sample_has_no_crash_and_no_broken_guarantee():
    """A deterministic CI-sized sample of `scripts/corpus.py`: every 10th file of the installed
    torch and transformers and of the standard library, and every 4th fixture (each fixture is
    fixed and fixed again by tests/test_fix.py)."""
    corpus = _corpus()
    files = corpus.python_files(corpus.default_roots())[::10]
    files += corpus.python_files([FIXTURES])[::4]
    started = time.perf_counter()
    summary = corpus.run(files, jobs=2)
    assert summary.ok, summary.crashes + summary.violations
    assert summary.files == len(files) > 100 and summary.findings > 0
    assert time.perf_counter() - started < 60
