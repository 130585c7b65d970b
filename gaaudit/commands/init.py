"""`gaaudit init`: starter configuration, never overwriting what a project already has."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

PYPROJECT_BLOCK = """
[tool.gaaudit]
# Rule codes or prefixes to report (default: every rule).
# select = ["GA"]
# ignore = ["GA006"]
# Lowest confidence to report: low, medium (default) or high.
# min-confidence = "medium"
# gitignore-style patterns added to the default excludes.
# extend-exclude = ["experiments/archive"]
# Rules to skip in some files.
# per-file-ignores = { "notebooks/*.ipynb" = ["GA002"] }
# Extra names that mean "the accumulation divisor" in your code.
# accumulation-names = ["n_micro"]

# Defaults for `gaaudit verify` and `gaaudit fix --verify` (uncomment the header too).
# [tool.gaaudit.verify]
# A function returning a small instance of your own model, called with no arguments.
# model-factory = "mypackage.models:tiny_model"
# Window sizes to replay, and the number of processes for a DDP loop.
# k = [2, 4, 8]
# distributed = 2
"""

# The files the check hook runs on: Python, notebooks and the dependency files GA006 reads
# (the same pattern as the published hook's, in .pre-commit-hooks.yaml).
HOOK_FILES = (
    r"\.(py|ipynb)$|(^|/)(requirements[^/]*\.txt|constraints[^/]*\.txt|requirements/[^/]+\.txt"
    r"|pyproject\.toml|setup\.cfg|environment[^/]*\.ya?ml)$"
)
# A `repo: local` configuration runs the gaaudit installed beside the project; it needs no
# published release.
PRE_COMMIT = f"""repos:
  - repo: local
    hooks:
      - id: gaaudit
        name: gaaudit check
        entry: gaaudit check --force-exclude
        language: system
        files: '{HOOK_FILES}'
      # - id: gaaudit-fix   # rewrite findings to sum-and-count on commit
      #   name: gaaudit fix
      #   entry: gaaudit fix --force-exclude
      #   language: system
      #   types_or: [python, jupyter]
"""


def write_config(root: Path) -> Iterator[tuple[str, bool]]:
    """Create or extend the two files; yield (message, done) per file."""
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8") if pyproject.exists() else ""
    if "[tool.gaaudit]" in text:
        yield f"{pyproject}: already has [tool.gaaudit]; left unchanged", False
    else:
        gap = "" if not text else "\n" if text.endswith("\n") else "\n\n"
        pyproject.write_text(text + gap + PYPROJECT_BLOCK.lstrip("\n"), encoding="utf-8")
        yield f"{pyproject}: added a commented [tool.gaaudit] block", True
    config = root / ".pre-commit-config.yaml"
    if config.exists():
        yield (
            f"{config}: exists; left unchanged. Add this entry under `repos:` yourself:\n"
            + PRE_COMMIT.split("\n", 1)[1],
            False,
        )
    else:
        config.write_text(PRE_COMMIT, encoding="utf-8")
        yield f"{config}: created with the gaaudit hook", True
