"""Where the modules a file imports live, when they belong to its repository, and what the
project's YAML configs set (no libcst here).

Every file looked at on the way is recorded as a `Dependency` of the file being checked:
its findings stay current as long as those files hold the same bytes (or stay absent).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from stat import S_ISREG

from gaaudit.vocabulary import TRAINER_MODULES

# Third-party packages, never part of the repository being checked.
# fmt: off
EXTERNAL = frozenset({
    "torch", "transformers", "accelerate", "deepspeed", "lightning", "pytorch_lightning", "jax",
    "optax", "flax", "numpy", "datasets", "peft", "trl", "megatron", "tensorflow",
})
# fmt: on
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
INSTALLED = ("site-packages", "dist-packages")
MAX_HOPS = 4  # a helper calling an imported helper calling ...: modules followed at most
CONFIG_FOLDERS = ("configs", "config", "conf")  # where Hydra and OmegaConf projects keep YAML
MAX_CONFIGS = 400  # YAML files read at most for one project
MAX_LEVELS = 6  # folders climbed at most from a file to its project's configs
MAX_IMPORTERS_READ = 5000  # Python files read at most to find a script's importers
# Lightning's accumulation factor as a YAML config sets it: a number or an interpolation.
ACCUMULATE = re.compile(rb"(?m)^[ \t]*accumulate_grad_batches[ \t]*:[ \t]*([^\s#]+)")
# ... and as a launch script hands it to `Trainer.from_argparse_args` (Lightning 1.x).
ACCUMULATE_FLAG = re.compile(rb"--accumulate_grad_batches(?:[ \t]*=[ \t]*|[ \t]+)['\"]?(\d+)")
# A Megatron or SwissArmyTransformer run that trains for no iteration: it only evaluates.
NO_TRAINING = re.compile(rb"--train[-_]iters(?:[ \t]*=[ \t]*|[ \t]+)['\"]?0(?![\w.])")


@dataclass(frozen=True, order=True)
class Dependency:
    """A file findings depend on, and the sha256 of its bytes then ("" when it was absent)."""

    path: str
    digest: str


def current(dependencies: Iterable[Dependency]) -> bool:
    """Whether every dependency still holds the bytes (or the absence) it was read with."""
    return all(file_digest(Path(d.path)) == d.digest for d in dependencies)


_DIGESTS: dict[str, tuple[tuple[int, int, int], str]] = {}


def file_digest(path: Path) -> str:
    """sha256 of a regular file's bytes, "" when there is none; a file is re-read only when
    its size, modification time or inode changed."""
    try:
        status = path.stat()
    except (OSError, ValueError):
        return ""
    if not S_ISREG(status.st_mode):
        return ""
    key = (status.st_mtime_ns, status.st_size, status.st_ino)
    known = _DIGESTS.get(str(path))
    if known is not None and known[0] == key:
        return known[1]
    import hashlib  # loads OpenSSL: only when a module of the repository is read

    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""
    _DIGESTS[str(path)] = (key, digest)
    return digest


def bases(directory: Path, level: int, parts: list[str]) -> tuple[Path, ...]:
    """The folders the module `parts` (after `level` dots) imported by a file in `directory`
    may lie under; none for a third-party package."""
    if level:
        base = directory
        for _ in range(level - 1):
            base = base.parent
        return (base,)
    return _roots(directory, parts[0]) if parts and parts[0] not in EXTERNAL else ()


def locate(directory: Path, level: int, module: str, seen: set[Dependency]) -> Path | None:
    """The file of a module a file in `directory` imports, when it is in the repository;
    each file looked for is added to `seen`."""
    parts = [p for p in module.split(".") if p]
    for base in bases(directory, level, parts):
        target = base.joinpath(*parts)
        candidates = (
            (target.with_suffix(".py"), target / "__init__.py")
            if parts
            else (target / "__init__.py",)
        )
        for candidate in candidates:
            digest = file_digest(candidate)
            seen.add(Dependency(str(candidate), digest))
            if digest:
                return candidate
    return None


def derives_from_trainer(
    directory: Path, level: int, module: str, name: str, seen: set[Dependency], hops: int = 0
) -> bool:
    """Whether the class `name` that a file in `directory` imports from the module `module`
    (after `level` dots) of its repository derives from a transformers or trl `...Trainer`
    (`class BaseTrainer(transformers.Trainer)` in `trainers/base.py`): there, through that
    module's other classes, or through the modules it imports them from, `MAX_HOPS` deep.
    Each file read or looked for is added to `seen`."""
    path = locate(directory, level, module, seen) if hops <= MAX_HOPS else None
    if path is None:
        return False
    found, read = _derives(path, file_digest(path), name, hops)
    seen |= read
    return found


@lru_cache(maxsize=256)
def _derives(path: Path, digest: str, name: str, hops: int) -> tuple[bool, frozenset[Dependency]]:
    """`derives_from_trainer` for the class `name` of the module at `path` (`digest`: its
    version), and the files read beyond it."""
    try:
        module = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False, frozenset()
    seen: set[Dependency] = set()
    classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}
    imported: dict[str, tuple[int, str, str]] = {}  # local -> (level, module, name)
    for node in module.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                imported[alias.asname or alias.name] = (node.level, node.module or "", alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                imported[local] = (0, "", alias.name if alias.asname else local)

    def derives(local: str, visited: frozenset[str]) -> bool:
        if local in classes and local not in visited:
            return any(based(b, visited | {local}) for b in classes[local].bases)
        if local not in imported:
            return False
        level, source, original = imported[local]  # re-exported: `from .base import Base`
        return derives_from_trainer(path.parent, level, source, original, seen, hops + 1)

    def based(base: ast.expr, visited: frozenset[str]) -> bool:
        parts = []
        while isinstance(base, ast.Attribute):
            parts.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name):
            return False
        level, source, original = imported.get(base.id, (0, "", base.id))
        qualified = ".".join(p for p in (source, original, *parts) if p)
        if not level and qualified.startswith(TRAINER_MODULES):
            return qualified.endswith("Trainer")
        return not parts and derives(base.id, visited)

    return derives(name, frozenset()), frozenset(seen)


@lru_cache(maxsize=256)  # asked for every import of every file of a folder
def _roots(directory: Path, top: str) -> tuple[Path, ...]:
    """Folders an absolute import may start from: the one holding the file's own top-level
    package (for that package only), then the file's folder and its parents up to the
    project root (a folder with `.git`, `pyproject.toml`, `setup.py` or `setup.cfg`), each
    also with its `src/`. Installed packages are never entered."""
    roots: list[Path] = []
    package = directory
    while (package / "__init__.py").is_file() and package.parent != package:
        package = package.parent
    if package != directory and directory.relative_to(package).parts[0] == top:
        roots.append(package)
    for folder in (directory, *directory.parents):
        if folder.name in INSTALLED:
            break
        roots += [folder, folder / "src"]
        if _is_root(folder):
            break
    return tuple(dict.fromkeys(roots))


def _is_root(folder: Path) -> bool:
    """Whether `folder` is a project's root: it holds one of `PROJECT_MARKERS`."""
    return any((folder / marker).exists() for marker in PROJECT_MARKERS)


def project_folders(directory: Path) -> Iterator[Path]:
    """`directory` and the folders above it up to the project's root, at most MAX_LEVELS;
    never an installed package's folder nor the filesystem's root."""
    for folder in (directory, *directory.parents)[:MAX_LEVELS]:
        if folder.name in INSTALLED or folder == folder.parent:
            return
        yield folder
        if _is_root(folder):
            return


def project_configs(directory: Path, seen: set[Dependency]) -> list[tuple[Path, bytes]]:
    """The YAML files of the project holding `directory` (its `configs/`, `config/` or
    `conf/` folder, as Hydra and OmegaConf projects keep them), each with its bytes; every
    file read is recorded in `seen`."""
    for folder in project_folders(Path(os.path.abspath(directory))):
        for name in CONFIG_FOLDERS:
            if (folder / name).is_dir():
                return _read_configs(folder / name, seen)
    return []


def _read_configs(configs: Path, seen: set[Dependency]) -> list[tuple[Path, bytes]]:
    paths = sorted(p for p in configs.rglob("*.y*ml") if p.suffix in (".yaml", ".yml"))
    return _read(paths[:MAX_CONFIGS], seen)


def _read(paths: list[Path], seen: set[Dependency]) -> list[tuple[Path, bytes]]:
    found = []
    for path in paths:
        digest = file_digest(path)
        seen.add(Dependency(str(path), digest))
        try:
            found.append((path, path.read_bytes() if digest else b""))
        except OSError:
            continue
    return found


def configured_accumulation(directory: Path, seen: set[Dependency]) -> tuple[Path, int, str] | None:
    """A YAML config of the project (`project_configs`) that sets Lightning's
    `accumulate_grad_batches` above 1 or from an interpolation (`${...}`), else a launch
    script of it (`project_scripts`) that passes `--accumulate_grad_batches` above 1: the
    file, the line and the value."""
    found = [(p, d, ACCUMULATE) for p, d in project_configs(directory, seen)]
    found += [(p, d, ACCUMULATE_FLAG) for p, d in project_scripts(directory, seen)]
    for path, data, pattern in found:
        for match in pattern.finditer(data):
            value = match.group(1).decode("utf-8", "replace").strip("'\"")
            if value.startswith("${") or (value.isdigit() and int(value) > 1):
                return path, data.count(b"\n", 0, match.start()) + 1, value
    return None


def evaluation_only(directory: Path, name: str, seen: set[Dependency]) -> tuple[Path, int] | None:
    """The first launch script of the project (`project_scripts`) that runs the file `name`,
    and the line where it passes `--train-iters 0`, when every script that runs the file does
    (Megatron's and SwissArmyTransformer's evaluation runs)."""
    runs = re.compile(rb"(?<![\w-])" + re.escape(name.encode()) + rb"(?![\w.])")
    found = [
        (path, data, NO_TRAINING.search(data))
        for path, data in project_scripts(directory, seen)
        if name and runs.search(data)
    ]
    if not found or not all(match for _, _, match in found):
        return None
    path, data, match = found[0]
    return path, data.count(b"\n", 0, match.start()) + 1


def project_scripts(directory: Path, seen: set[Dependency]) -> list[tuple[Path, bytes]]:
    """The shell scripts that launch the project holding `directory`: the `*.sh` files of
    `directory`, of the project's root (the first folder above with a `PROJECT_MARKERS`
    file) and of the `scripts/` folders on the way up, each with its bytes; every file read
    is recorded in `seen`."""
    directory = Path(os.path.abspath(directory))
    paths = sorted(directory.glob("*.sh"))
    for folder in project_folders(directory):
        if (folder / "scripts").is_dir():
            paths += sorted((folder / "scripts").rglob("*.sh"))
        if folder != directory and _is_root(folder):
            paths += sorted(folder.glob("*.sh"))
    return _read(paths[:MAX_CONFIGS], seen)


def configured_target(
    directory: Path, key: str, seen: set[Dependency]
) -> tuple[str, dict[str, str], Path, int] | None:
    """What the project's YAML configs build for `key` (`hydra.utils.instantiate(cfg.key)`):
    the `_target_` (or torchtune's `_component_`) of the config group `key/` or of a `key:`
    block, its scalar arguments, and where; None unless every config names the same."""
    found = configured_targets(directory, key, seen)
    if len({(target, tuple(sorted(args.items()))) for target, args, _, _ in found}) != 1:
        return None
    return found[0]


def configured_targets(
    directory: Path, key: str, seen: set[Dependency]
) -> list[tuple[str, dict[str, str], Path, int]]:
    """Every `_target_` the project's YAML configs name for `key` (see `configured_target`),
    with its scalar arguments and where."""
    found = []
    for path, data in project_configs(directory, seen):
        text = data.decode("utf-8", "replace")
        if path.parent.name == key:
            found += _targets(text, "", path, 0)
        for block in re.finditer(rf"(?m)^([ \t]*){re.escape(key)}[ \t]*:[ \t]*(?:#.*)?$", text):
            found += _targets(text, block.group(1), path, block.end())
    return found


def _targets(
    text: str, outer: str, path: Path, start: int
) -> list[tuple[str, dict[str, str], Path, int]]:
    """The `_target_` and scalar arguments of the block that begins at `start` and is
    indented deeper than `outer` (the whole file when `outer` is "" and `start` is 0)."""
    target, args, line, indent = None, {}, 0, None
    for match in re.finditer(r"(?m)^([ \t]*)([\w.-]+)[ \t]*:[ \t]*([^#\n]*)", text[start:]):
        here, name, value = match.group(1), match.group(2), match.group(3).strip()
        if start and len(here) <= len(outer):
            break  # the block ended
        indent = here if indent is None else indent
        if here != indent:
            continue  # a deeper block
        if name in ("_target_", "_component_"):
            target, line = value.strip("'\""), text.count("\n", 0, start + match.start()) + 1
        elif value and name != "defaults":
            args[name] = value
    return [(target, args, path, line)] if target else []


def shown(path: Path) -> str:
    """A path relative to the current directory when under it, with `/`."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except (ValueError, OSError, RuntimeError):
        return path.as_posix()


def project_root(path: Path) -> Path:
    """The directory of the nearest pyproject.toml above `path`, else `path`'s directory."""
    start = path.resolve().parent
    return next((d for d in (start, *start.parents) if (d / "pyproject.toml").is_file()), start)


def missing_top_module(module: str, root: Path) -> str | None:
    """The top-level package of dotted `module` when neither `root`, the current directory
    nor the installed packages hold it (found by the import system's finders: nothing of the
    project runs); None when it is there."""
    import sys
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    top = module.partition(".")[0]
    if PathFinder.find_spec(top, [str(root), os.getcwd(), *sys.path]) is not None:
        return None
    try:  # an editable install's own finder, say
        return top if find_spec(top) is None else None
    except (ImportError, ValueError):
        return None


def imported_elsewhere(path: Path) -> bool:
    """Whether another Python file of `path`'s project (`search_root`, read as `check` reads
    a folder: default exclusions and .gitignore kept) may import it: one with an import line
    naming its module (`from train_reader import train`, `import train_reader`), or a project
    too large to read (`MAX_IMPORTERS_READ` files)."""
    from gaaudit.config import Settings
    from gaaudit.discover.files import discover

    stem = re.escape(path.stem.encode())
    named = re.compile(rb"(?m)^[ \t]*(?:from|import)[ \t][^#\n]*(?<![\w])" + stem + rb"(?![\w])")
    root, here = search_root(path), path.resolve()
    others = (p for p in discover([root], Settings(root=root)) if p.suffix == ".py")
    for read, other in enumerate(others):
        if read == MAX_IMPORTERS_READ:
            return True
        try:
            if other.resolve() != here and named.search(other.read_bytes()):
                return True
        except OSError:
            continue
    return False


def search_root(path: Path) -> Path:
    """How far up the project is read for `path`: when the file is under the current
    directory, its git repository where that lies within the current directory (run from a
    home directory, the search reads one repository, not every project in it), else the
    current directory; outside it, its project root."""
    here, cwd = path.resolve(), Path.cwd().resolve()
    if not here.is_relative_to(cwd):
        return project_root(path)
    repository = next((d for d in here.parents if (d / ".git").exists()), cwd)
    return repository if repository.is_relative_to(cwd) else cwd
