"""`[tool.gaaudit]` in pyproject.toml: found by walking up, validated key by key."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from gaaudit import catalogue
from gaaudit.catalogue import toml
from gaaudit.findings import Confidence

DEFAULT_EXCLUDE = (
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    ".env",
    "env",
    "build",
    "dist",
    "site-packages",
    "node_modules",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".tox",
    ".nox",
    ".eggs",
    "*.egg-info",
    ".ipynb_checkpoints",
    ".gaaudit_cache",
)


# Where a pyproject.toml may define [tool.gaaudit]: files without it are not parsed.
MENTIONS_TABLE = re.compile(
    r"""(?:tool\s*\.\s*|^\s*|[{,]\s*)["']?gaaudit["']?\s*[.=\]]""", re.MULTILINE
)


class ConfigError(Exception):
    """A configuration problem, worded for the user (file, key, what to do)."""


# `package.module:function` or `package.module:Class.method`.
FACTORY_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
DEVICES = ("auto", "cpu", "cuda")
VERIFY_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class VerifySettings:
    """`[tool.gaaudit.verify]`: defaults for `gaaudit verify` (None where the table is silent;
    the command line wins over both)."""

    model_factory: str | None = None
    data_factory: str | None = None
    k: tuple[int, ...] | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None
    timeout: float | None = None
    distributed: int | None = None


def rule_codes(values, where: str) -> tuple[str, ...]:
    """Rule codes or prefixes from `values`, whose items may be comma-separated lists, in
    any letter case (`ALL` selects every rule); a ConfigError names one no rule starts with."""
    found = []
    for value in values:
        for part in value.split(","):
            code = part.strip().upper()
            if not code:
                continue
            code = "GA" if code == "ALL" else code
            known = catalogue.codes()
            if not any(rule.startswith(code) for rule in known):
                raise ConfigError(
                    f"{where}: unknown rule code or prefix {part.strip()!r}; "
                    f"known codes: {', '.join(known)} (or a prefix such as GA00, or ALL)"
                )
            found.append(code)
    return tuple(dict.fromkeys(found))


def unimportable(where: str, module: str, root, error: str) -> str:
    """What to do about a factory whose module cannot be imported from the project `root`."""
    return (
        f"{where}: cannot import {module!r} from {root} ({error}); name a module importable "
        "from the project root (the directory of pyproject.toml)"
    )


def check_factory(value, where: str, data: bool = False) -> str:
    """`value` if it reads `module:function`, else a ConfigError that says what is expected
    (of a model factory, or with `data` of a data factory)."""
    if not isinstance(value, str) or not FACTORY_RE.fullmatch(value):
        wanted = (
            "a function that takes k and returns k micro-batches), e.g. 'mypkg.data:window'"
            if data
            else "a function that takes no arguments and returns a small torch.nn.Module), "
            "e.g. 'mypkg.models:tiny_model'"
        )
        raise ConfigError(f"{where}: expected module:function ({wanted}; got {value!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """Everything the run needs from the configuration file and the command line."""

    root: Path = field(default_factory=Path.cwd)
    select: tuple[str, ...] = ("GA",)
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    extend_exclude: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    accumulation_names: frozenset[str] = frozenset()
    min_confidence: Confidence = Confidence.MEDIUM
    respect_gitignore: bool = True
    verify: VerifySettings = field(default_factory=VerifySettings)
    cache_dir: Path | None = None  # where `check` keeps its cache (default: see gaaudit.cache)
    source: Path | None = None  # the pyproject.toml read, if any

    def enabled(self, code: str, path: str) -> bool:
        """Whether `code` is selected and not ignored for `path` (relative, forward slashes)."""
        if not any(code.startswith(s) for s in self.select):
            return False
        if any(code.startswith(i) for i in self.ignore):
            return False
        pure = PurePosixPath(path)
        return not any(
            any(code.startswith(c) for c in codes)
            and (pure.match(glob) or fnmatch.fnmatch(path, glob))
            for glob, codes in self.per_file_ignores
        )

    def override(self, **changes) -> Settings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml with a [tool.gaaudit] table, walking up from `start`."""
    try:
        start = start.resolve()
    except (OSError, RuntimeError):  # a symbolic link loop: look from where it sits
        start = start.absolute().parent
    for directory in (start, *start.parents) if start.is_dir() else start.parents:
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            tomllib = toml()
            try:
                text = candidate.read_text(encoding="utf-8")
                data = tomllib.loads(text) if MENTIONS_TABLE.search(text) else {}
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"{candidate}: cannot read TOML: {exc}") from None
            if "gaaudit" in data.get("tool", {}):
                return candidate
    return None


def load(start: Path) -> Settings:
    """Settings from the nearest `[tool.gaaudit]`, or the defaults rooted at the current directory."""
    path = find_pyproject(start)
    if path is None:
        return Settings()
    table = toml().loads(path.read_text(encoding="utf-8"))["tool"]["gaaudit"]
    return parse(table, path)


def parse(table: dict, path: Path) -> Settings:
    """Validate a `[tool.gaaudit]` table; every error names the file and the key."""
    settings = Settings(root=path.parent, source=path)
    changes: dict = {}
    for key, value in table.items():
        where = f"{path}: [tool.gaaudit] {key}"
        if key in ("select", "ignore", "extend-select"):
            changes[key.replace("-", "_")] = rule_codes(_strings(value, where), where)
        elif key in ("exclude", "extend-exclude"):
            changes[key.replace("-", "_")] = tuple(_strings(value, where))
        elif key == "accumulation-names":
            changes["accumulation_names"] = frozenset(_strings(value, where))
        elif key == "per-file-ignores":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: expected a table of glob = [codes], got {value!r}")
            changes["per_file_ignores"] = tuple(
                (glob, rule_codes(_strings(codes, f"{where}.{glob}"), f"{where}.{glob}"))
                for glob, codes in value.items()
            )
        elif key == "respect-gitignore":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: expected true or false, got {value!r}")
            changes["respect_gitignore"] = value
        elif key == "min-confidence":
            try:
                changes["min_confidence"] = Confidence.parse(str(value))
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None
        elif key == "verify":
            changes["verify"] = parse_verify(value, path)
        elif key == "cache-dir":
            if not isinstance(value, str) or not value:
                raise ConfigError(
                    f"{where}: expected a folder, relative to {path.name}, got {value!r}"
                )
            changes["cache_dir"] = path.parent / value
        else:
            known = (
                "select, extend-select, ignore, exclude, extend-exclude, per-file-ignores, "
                "accumulation-names, min-confidence, respect-gitignore, verify, cache-dir"
            )
            raise ConfigError(f"{where}: unknown key; known keys are {known}")
    extend = changes.pop("extend_select", ())
    settings = replace(settings, **changes)
    return replace(settings, select=(*settings.select, *extend)) if extend else settings


def parse_verify(table, path: Path) -> VerifySettings:
    """Validate `[tool.gaaudit.verify]`; every error names the file and the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [tool.gaaudit] verify: expected a table, got {table!r}")
    changes: dict = {}
    for key, value in table.items():
        where = f"{path}: [tool.gaaudit.verify] {key}"
        if key in ("model-factory", "data-factory"):
            changes[key.replace("-", "_")] = check_factory(value, where, key == "data-factory")
        elif key == "k":
            if not isinstance(value, list) or not value or not all(_count(v) for v in value):
                raise ConfigError(f"{where}: expected a list of window sizes >= 1, got {value!r}")
            changes["k"] = tuple(value)
        elif key in ("device", "dtype"):
            allowed = DEVICES if key == "device" else VERIFY_DTYPES
            if value not in allowed:
                raise ConfigError(f"{where}: expected one of {', '.join(allowed)}, got {value!r}")
            changes[key] = value
        elif key == "seed":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{where}: expected an integer, got {value!r}")
            changes["seed"] = value
        elif key == "timeout":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: expected a number of seconds > 0, got {value!r}")
            changes["timeout"] = float(value)
        elif key == "distributed":
            if not _count(value):
                raise ConfigError(f"{where}: expected a number of processes >= 1, got {value!r}")
            changes["distributed"] = value
        else:
            known = "model-factory, data-factory, k, device, dtype, seed, timeout, distributed"
            raise ConfigError(f"{where}: unknown key; known keys are {known}")
    return VerifySettings(**changes)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _strings(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    return value
