"""Shared helpers: the fixture catalogue, the CLI runner, the SARIF schema of tests/data."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gaaudit.cli import app

# One OpenMP thread per torch process: the suite runs a worker per core, and each starts
# replay and training processes of its own; more threads would contend for the same cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
DATA = Path(__file__).resolve().parent / "data"


@cache
def cuda_devices() -> int:
    """The CUDA devices of this machine (0 without torch or a GPU)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def on_cuda(value: str, needed: int = 1):
    """A parameter that runs where `needed` CUDA devices are present, else is skipped,
    saying so."""
    reason = f"needs {needed} CUDA device(s); this machine has {cuda_devices()}"
    return pytest.param(value, marks=pytest.mark.skipif(cuda_devices() < needed, reason=reason))


def devices(needed: int = 1) -> list:
    """`cpu`, and `cuda` where `needed` CUDA devices are present: the harness's GPU paths
    run wherever a GPU is lent."""
    return ["cpu", on_cuda("cuda", needed)]


def clipping_unfixed() -> str:
    """ga001_clip_every_micro_batch with its step counted in the body after its test: a window
    `fix` cannot read ahead (the reader follows a counter raised before the test only), so it
    is left as it is."""
    source = (FIXTURES / "ga001_clip_every_micro_batch.py").read_text()
    counted = source.replace(
        "    model.train()\n", "    model.train()\n    updates = 0\n", 1
    ).replace(
        "        if (batch_idx + 1) % args.gradient_accumulation_steps == 0:\n",
        "        if (updates + 1) % args.gradient_accumulation_steps == 0:\n",
        1,
    )
    counted += "        updates += 1\n"
    assert counted.count("updates") == 3
    return counted


def fixture_scripts() -> list[Path]:
    """Every fixture script that has an `.expected` file."""
    return sorted(p for p in FIXTURES.glob("*.py") if p.with_suffix(".expected").exists())


def expected_findings() -> int:
    """How many findings `gaaudit check fixtures` reports at the default confidence: those
    each script's `.expected` file lists, the pins of the GA006 projects and those of the
    cross-module projects (their `expected.txt`)."""
    scripts = sum(level != "low" for s in fixture_scripts() for _, _, level in expected(s))
    pins = sum(len(f.read_text().split()) // 3 for f in FIXTURES.glob("ga006_*/expected.txt"))
    packages = sum(
        line.split()[-1] != "low"
        for f in FIXTURES.glob("*_xmod_*/expected.txt")
        for line in f.read_text().splitlines()
        if line.strip()
    )
    return scripts + pins + packages


def flat(code: str) -> str:
    """`code` without whitespace: a fix's text, however its long lines were wrapped."""
    return "".join(code.split())


def expected(path: Path) -> list[tuple[int, str, str]]:
    rows = []
    for line in path.with_suffix(".expected").read_text().splitlines():
        if line.strip():
            number, code, confidence = line.split()
            rows.append((int(number), code, confidence))
    return rows


def unscreened(path: Path, settings) -> list:
    """The findings of a file's whole module analysed by libcst, without the `ast` screen and
    the focused copy that `check` analyses."""
    from gaaudit.checks.engine import audit
    from gaaudit.discover.source import parse

    data = path.read_bytes()
    module = parse(data)
    text = data.decode(module.encoding)
    return audit(module, text, str(path), path.name, settings, path.parent)[1]


def finding_key(finding) -> tuple:
    """What the screen must leave as it is: a finding's code, span and message."""
    return finding.code, finding.span, finding.message


def gaaudit(
    *args: str, cwd: Path | None = None, env=None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess (with `stdin` as its input)."""
    return subprocess.run(
        [sys.executable, "-m", "gaaudit", *args],
        check=False,
        cwd=cwd,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def entry(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    """The console entry point (`gaaudit.__main__.main`, the fast path and typer's) run in this
    process as `gaaudit` runs it in a new one, without starting an interpreter and importing
    gaaudit again: its exit status and what it wrote to stdout and stderr."""
    from gaaudit.__main__ import main

    given = io.TextIOWrapper(io.BytesIO((stdin or "").encode()), encoding="utf-8")
    out, err = (io.TextIOWrapper(io.BytesIO(), "utf-8", write_through=True) for _ in range(2))
    saved, here = (sys.argv, sys.stdin, sys.stdout, sys.stderr), os.getcwd()
    sys.argv, sys.stdin, sys.stdout, sys.stderr = ["gaaudit", *args], given, out, err
    code = 0
    try:
        os.chdir(cwd or here)
        main()
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else int(ended.code is not None)
        if isinstance(ended.code, str):
            err.write(ended.code + "\n")
    finally:
        os.chdir(here)
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
    written = (stream.buffer.getvalue().decode("utf-8") for stream in (out, err))
    return subprocess.CompletedProcess(["gaaudit", *args], code, *written)


def verify_projects(
    root: Path, projects: dict[str, tuple[str, dict[str, str]]], *options: str
) -> tuple[subprocess.CompletedProcess, dict[str, list[dict]]]:
    """One `gaaudit verify --format json` run over the scripts of several projects (name: its
    script, then its files), so that their replays share one process (torch, transformers
    imported once); each project has a pyproject.toml of its own and the run starts outside
    them all, so each is read as a project alone. The run and each project's loops."""
    scripts = []
    for name, (script, files) in projects.items():
        for relative, text in {"pyproject.toml": f"[project]\nname = '{name}'\n", **files}.items():
            (root / name / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / name / relative).write_text(text)
        scripts.append(root / name / script)
    (root / "elsewhere").mkdir()
    result = gaaudit(
        "verify", *options, "--format", "json", *map(str, scripts), cwd=root / "elsewhere"
    )
    assert "Traceback" not in result.stderr, result.stderr
    files = json.loads(result.stdout)
    assert [Path(f["path"]) for f in files] == scripts, result.stdout
    return result, {name: found["loops"] for name, found in zip(projects, files)}


def two_processes(target, args: tuple):
    """`target(rank, *args)` on two processes started as `gaaudit verify` starts its ranks
    (forked from a server that has imported torch and the harness once: `processes`); torch's
    process context, not joined."""
    import torch

    from gaaudit.harness.replay import processes

    method = processes().get_start_method()
    return torch.multiprocessing.start_processes(
        target, args=args, nprocs=2, join=False, start_method=method
    )


@pytest.fixture
def cli(monkeypatch):
    """Invoke the Typer app in-process from a chosen working directory."""
    runner = CliRunner()

    def invoke(*args: str, cwd: Path | None = None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        return runner.invoke(app, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def sarif_schema() -> dict:
    return json.loads((DATA / "sarif-schema-2.1.0.json").read_text(encoding="utf-8"))


# The modules that take longest, longest first (measured with `--durations=0` in a fresh clone).
# pytest-xdist hands a worker its next module when it is two tests from the end of its own; one
# of these handed out last would leave the other worker idle until it ends.
LONGEST_FIRST = (
    "test_verify_fixtures.py",
    "test_proof.py",
    "test_deepspeed.py",
    "test_verify_options.py",
    "test_fix.py",
    "test_check.py",
    "test_robustness.py",
    "test_verify_lightning.py",
    "test_integrations.py",
    "test_verify_trainer.py",
    "test_output.py",
    "test_harness_ddp.py",
    "test_positions.py",
    "test_harness.py",
    "test_lightning_fix_runtime.py",
    "test_cross_module.py",
    "test_fixed_loops_runtime.py",
    "test_trainer_fix_runtime.py",
    "test_docs.py",
    "test_packaging.py",
)


def pytest_collection_modifyitems(items):
    """The longest modules first, then those with the most tests (pytest-xdist's own order,
    which `--no-loadscope-reorder` replaces by this one); JAX's last: once JAX has started
    its threads in a worker, a worker pool forked there could deadlock."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    tests = Counter(item.path for item in items)
    items.sort(
        key=lambda item: (
            item.path.name == "test_optax_fix_runtime.py",
            rank.get(item.path.name, len(rank)),
            -tests[item.path],
        )
    )


@cache
def realworld():
    """benchmarks/realworld.py as a module: its manifest reader and its test of a rewrite."""
    spec = importlib.util.spec_from_file_location("realworld", ROOT / "benchmarks" / "realworld.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module
