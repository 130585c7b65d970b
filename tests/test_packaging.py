"""A non-editable wheel, installed alone in a fresh virtualenv, carries the rule catalogue."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from conftest import ROOT


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=600, check=True, **kwargs)


def test_wheel_ships_the_catalogue(tmp_path):
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        str(tmp_path / "dist"),
        str(ROOT),
    )
    (wheel,) = (tmp_path / "dist").glob("gaaudit-*.whl")
    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = Path(
        run(
            str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        ).stdout.strip()
    )
    # The wheel's runtime dependencies come from this interpreter's site-packages; gaaudit itself
    # comes only from the wheel (an editable install's .pth there is not processed via a .pth line).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "-q",
        "--no-deps",
        str(wheel),
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run(str(python), "-c", "import gaaudit; print(gaaudit.__file__)", cwd=elsewhere).stdout
    assert where.startswith(str(site))
    rules = run(str(fresh / "bin" / "gaaudit"), "rules", cwd=elsewhere).stdout
    assert "GA001" in rules and "GA002" in rules
    explained = run(str(fresh / "bin" / "gaaudit"), "explain", "GA001", cwd=elsewhere).stdout
    assert "Why is this bad?" in explained
    (elsewhere / "train.py").write_text(
        (ROOT / "fixtures" / "ga002_hf_clm_no_division.py").read_text()
    )
    check = subprocess.run(
        [str(fresh / "bin" / "gaaudit"), "check", "train.py", "--format", "json"],
        check=False,
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 1 and '"GA002"' in check.stdout
