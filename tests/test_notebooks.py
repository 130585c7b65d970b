"""Jupyter notebooks: checked and fixed cell by cell, outputs and metadata untouched."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES, gaaudit

from gaaudit.discover.notebook import load, rebuild

SCRIPT = (FIXTURES / "ga002_hf_clm_no_division.py").read_text()


def notebook(cells: list[dict]) -> dict:
    return {
        "cells": cells,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def code(source, outputs=()) -> dict:
    return {
        "cell_type": "code",
        "execution_count": 3,
        "metadata": {"tags": ["train"]},
        "outputs": list(outputs),
        "source": source,
    }


def split_script() -> list[dict]:
    """The fixture script as cells: imports and helpers first, the training function last."""
    head, _, tail = SCRIPT.partition("\ndef main")
    return [
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": ["# Fine-tuning\n", "with accumulation"],
        },
        code(
            ["!pip install -q transformers\n", "%load_ext autoreload\n", "%autoreload 2"],
            outputs=[{"output_type": "stream", "name": "stdout", "text": ["done\n"]}],
        ),
        code(head.splitlines(keepends=True)),
        code(("def main" + tail).splitlines(keepends=True)),
    ]


@pytest.fixture
def train_ipynb(tmp_path):
    path = tmp_path / "train.ipynb"
    path.write_text(json.dumps(notebook(split_script()), indent=1) + "\n")
    return path


def backward_line() -> tuple[int, int]:
    """(cell, line) of the fixture's backward call in the notebook above."""
    lines = ("def main" + SCRIPT.partition("\ndef main")[2]).splitlines()
    return 4, next(i for i, line in enumerate(lines, 1) if "loss.backward()" in line)


def test_findings_point_at_cell_and_line(train_ipynb, cli):
    result = cli("check", "train.ipynb", cwd=train_ipynb.parent)
    cell, line = backward_line()
    assert result.exit_code == 1
    assert f"train.ipynb:cell {cell}:line {line}:col 13: GA002 [high]" in result.output
    assert "(cell 4, line" in result.output and "(line " not in result.output  # evidence too


def test_json_and_sarif_carry_the_cell(train_ipynb, cli, sarif_schema):
    import jsonschema

    data = json.loads(
        cli("check", "train.ipynb", "--format", "json", cwd=train_ipynb.parent).output
    )
    (finding,) = data["findings"]
    assert (finding["cell"], finding["line"]) == backward_line()
    sarif = json.loads(cli("check", "train.ipynb", "--format", "sarif").output)
    jsonschema.validate(sarif, sarif_schema)
    assert sarif["runs"][0]["results"][0]["properties"]["cell"] == backward_line()[0]


def test_fix_rewrites_only_code_cell_sources(train_ipynb, cli):
    before = json.loads(train_ipynb.read_text())
    result = cli("fix", "train.ipynb", cwd=train_ipynb.parent)
    assert result.exit_code == 0, result.output
    after = json.loads(train_ipynb.read_text())
    assert after["metadata"] == before["metadata"] and after["nbformat"] == before["nbformat"]
    for old, new in zip(before["cells"], after["cells"]):
        assert {k: v for k, v in old.items() if k != "source"} == {
            k: v for k, v in new.items() if k != "source"
        }
    assert after["cells"][:3] == before["cells"][:3]  # markdown, magics and untouched code
    fixed_cell = "".join(after["cells"][3]["source"])
    assert "micro_tokens" in fixed_cell and "window_tokens = 0" in fixed_cell
    compile(fixed_cell, "cell", "exec")
    once = train_ipynb.read_bytes()
    assert cli("fix", "train.ipynb").exit_code == 0 and train_ipynb.read_bytes() == once
    assert cli("check", "train.ipynb").exit_code == 0


def test_clean_notebook_is_byte_identical(tmp_path, cli):
    path = tmp_path / "clean.ipynb"
    raw = json.dumps(notebook([code("x = 1\n%time x + 1\n!ls"), code(["print(x)"])]), indent=2)
    path.write_text(raw)  # no trailing newline, indent 2: any rewrite would show
    assert cli("fix", "clean.ipynb", cwd=tmp_path).exit_code == 0
    assert cli("check", "clean.ipynb").exit_code == 0
    assert path.read_text() == raw


def test_magics_inside_blocks_do_not_break_parsing(tmp_path, cli):
    cell = (
        "for step in range(3):\n    !echo $step\n    loss = model(x).mean()\n    loss.backward()\n"
    )
    path = tmp_path / "magic.ipynb"
    path.write_text(
        json.dumps(notebook([code("%%time\nprint(1)"), code(cell + "optimizer.step()\n")]))
    )
    result = cli("check", "magic.ipynb", cwd=tmp_path)
    assert "E999" not in result.output
    assert "magic.ipynb:cell 2:line 4:col 5: GA002" in result.output


@pytest.mark.parametrize(
    "raw, reason",
    [
        ("{not json", "invalid JSON"),
        ('{"cells": 3}', "no `cells` list"),
        ("[1, 2]", "no `cells` list"),
    ],
)
def test_invalid_notebook_is_e999(tmp_path, cli, raw, reason):
    path = tmp_path / "broken.ipynb"
    path.write_text(raw)
    result = cli("check", ".", cwd=tmp_path)
    assert result.exit_code == 2
    assert (
        "broken.ipynb:1:1: E999 not a valid notebook" in result.output and reason in result.output
    )
    assert cli("fix", "broken.ipynb").exit_code == 2 and path.read_text() == raw


def test_syntax_error_in_a_cell_names_the_cell(tmp_path, cli):
    path = tmp_path / "bad.ipynb"
    path.write_text(json.dumps(notebook([code("x = 1"), code("loss.backward(\n")])))
    result = cli("check", "bad.ipynb", cwd=tmp_path)
    assert result.exit_code == 2 and "E999 cell 2, line" in result.output


def magic_cells(first_line: str) -> list[dict]:
    """The fixture notebook with its training cell run under the cell magic `first_line`."""
    cells = split_script()
    cells[3]["source"] = [first_line + "\n", *cells[3]["source"]]
    return cells


@pytest.mark.parametrize("first_line", ["%%time", "%%timeit -n 1 -r 1", "%%capture out"])
def test_a_python_cell_magic_is_checked_and_fixed(tmp_path, cli, first_line):
    path = tmp_path / "timed.ipynb"
    path.write_text(json.dumps(notebook(magic_cells(first_line)), indent=1) + "\n")
    cell, line = backward_line()
    result = cli("check", "timed.ipynb", cwd=tmp_path)
    assert result.exit_code == 1 and "note:" not in result.output
    assert f"timed.ipynb:cell {cell}:line {line + 1}:col 13: GA002" in result.output
    assert cli("fix", "timed.ipynb").exit_code == 0
    fixed = json.loads(path.read_text())["cells"][3]["source"]
    assert fixed[0] == first_line + "\n" and "micro_tokens" in "".join(fixed)
    compile("".join(fixed[1:]), "cell", "exec")
    assert cli("check", "timed.ipynb").exit_code == 0


def test_another_cell_magic_is_skipped_and_said_so(tmp_path, cli):
    path = tmp_path / "shell.ipynb"
    path.write_text(json.dumps(notebook(magic_cells("%%bash")), indent=1) + "\n")
    result = cli("check", "shell.ipynb", cwd=tmp_path)
    assert result.exit_code == 0 and "GA002" not in result.output
    note = "cell 4: cell magic `%%bash` runs no Python; not checked"
    assert f"shell.ipynb: note: {note}" in result.output
    document = json.loads(cli("check", "shell.ipynb", "-f", "json").output)
    assert document["notes"] == [{"path": "shell.ipynb", "message": note}]
    assert cli("fix", "shell.ipynb").exit_code == 0
    assert json.loads(path.read_text()) == notebook(magic_cells("%%bash"))
    assert load(path.read_bytes()).skipped == ((4, note.removeprefix("cell 4: ")),)


def test_shell_lines_continued_with_backslashes_parse(tmp_path, cli):
    cells = split_script()
    cells[1]["source"] = ["!pip install -q peft \\\n", "    transformers \\\n", "  accelerate\n"]
    cells[3]["source"][1:1] = ["    !nvidia-smi --query-gpu=name \\\n", "        --format=csv\n"]
    path = tmp_path / "continued.ipynb"
    path.write_text(json.dumps(notebook(cells), indent=1) + "\n")
    result = cli("check", "continued.ipynb", cwd=tmp_path)
    assert "E999" not in result.output and result.exit_code == 1
    assert gaaudit("check", ".", "--no-cache", cwd=tmp_path).returncode == 1  # not 2
    cell, line = backward_line()
    assert f"continued.ipynb:cell {cell}:line {line + 2}:col 13: GA002" in result.output
    assert cli("fix", "continued.ipynb").exit_code == 0
    fixed = json.loads(path.read_text())["cells"]
    assert fixed[1] == cells[1] and fixed[3]["source"][1:3] == cells[3]["source"][1:3]


def test_ipython_lines_are_kept_aside_and_python_is_not(tmp_path, cli):
    ipython = [
        "%pip install -q a \\\n",
        "    b\n",
        "files = !ls\n",
        "?torch.nn\n",
        "model?\n",
        "optimizer.step??\n",
    ]
    python = ["mask = (labels\n", "        != -100)\n", 'msg = ("step %d"\n', "       % step)"]
    cells = split_script()
    cells[1]["source"] = ipython + python
    raw = (json.dumps(notebook(cells), indent=1) + "\n").encode()
    loaded = load(raw)
    assert loaded.magics == tuple(line.removesuffix("\n") for line in ipython)
    assert "        != -100)\n" in loaded.text and "       % step)\n" in loaded.text
    assert rebuild(loaded, loaded.text, raw) == raw
    path = tmp_path / "ipython.ipynb"
    path.write_bytes(raw)
    result = cli("check", "ipython.ipynb", cwd=tmp_path)
    assert "E999" not in result.output and result.exit_code == 1
    assert cli("fix", "ipython.ipynb").exit_code == 0
    assert json.loads(path.read_text())["cells"][1] == cells[1]


def test_automagic_lines_that_break_the_parse_are_kept_aside(tmp_path, cli):
    """A line magic written without its `%` (IPython's automagic: `pip install x`, `ls data/`)
    is kept aside where it breaks the parse; one that parses as Python (`ls -la`, a
    subtraction) stays code, and a real syntax error is still reported."""
    cells = split_script()
    cells[1]["source"] = ["pip install -q transformers peft\n", "ls ./data/\n", "ls -la\n"]
    cells[3]["source"][1:1] = ["    cd checkpoints\n"]
    raw = (json.dumps(notebook(cells), indent=1) + "\n").encode()
    loaded = load(raw)
    assert loaded.magics == ("pip install -q transformers peft", "ls ./data/", "    cd checkpoints")
    assert "\nls -la\n" in loaded.text
    path = tmp_path / "automagic.ipynb"
    path.write_bytes(raw)
    result = cli("check", "automagic.ipynb", cwd=tmp_path)
    assert "E999" not in result.output and result.exit_code == 1
    cell, line = backward_line()
    assert f"automagic.ipynb:cell {cell}:line {line + 1}:col 13: GA002" in result.output
    assert cli("fix", "automagic.ipynb").exit_code == 0
    fixed = json.loads(path.read_text())["cells"]
    assert fixed[1] == cells[1] and fixed[3]["source"][1] == "    cd checkpoints\n"
    broken = tmp_path / "broken.ipynb"
    broken.write_text(json.dumps(notebook([code("pip install x\nloss.backward()\nprint(m)s\n")])))
    assert "E999 cell 1, line 3" in cli("check", "broken.ipynb", cwd=tmp_path).output
