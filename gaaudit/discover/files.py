"""Which files to check: walk the given paths, honouring excludes and .gitignore files."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from gaaudit.config import Settings

TYPE_CHECKING = False  # not `typing`'s: importing typing costs a one-file check 4 ms
if TYPE_CHECKING:  # imported when a folder is walked: files named alone need no patterns
    import pathspec

SUFFIXES = (".py", ".ipynb")
PLAIN = re.compile(r"\*?[\w.+-]+")  # matches entries of this name (or ending) at any depth


@dataclass(frozen=True)
class Excluded:
    """The exclude patterns. Plain names (`build`) and endings (`*.egg-info`) are looked
    up, the others matched with pathspec: matching every pattern on every entry costs
    more than the walk on a large tree. When a pattern negates, order matters and pathspec
    matches them all."""

    names: frozenset[str]
    endings: tuple[str, ...]
    spec: pathspec.GitIgnoreSpec | None

    @classmethod
    def of(cls, patterns: list[str]) -> Excluded:
        if any(p.startswith("!") for p in patterns):
            return cls(frozenset(), (), _spec(patterns))
        plain = [p for p in patterns if PLAIN.fullmatch(p)]
        others = [p for p in patterns if p not in plain]
        names = frozenset(p for p in plain if not p.startswith("*"))
        endings = tuple(p[1:] for p in plain if p.startswith("*"))
        return cls(names, endings, _spec(others) if others else None)

    def match(self, relative: str, name: str, suffix: str) -> bool:
        """Whether an entry (`relative` to the project root, with its `name`) is excluded;
        its folders were not. `suffix` is `/` for a folder."""
        if name in self.names or name.endswith(self.endings):
            return True
        return self.spec is not None and self.spec.match_file(relative + suffix)

    def named(self, relative: str) -> bool:
        """Whether a path named on the command line (`relative` to the project root) or one
        of its folders is excluded: what `--force-exclude` asks."""
        parts = relative.split("/")
        return any(
            self.match("/".join(parts[: i + 1]), part, "/" if i < len(parts) - 1 else "")
            for i, part in enumerate(parts)
        )


def _spec(patterns) -> pathspec.GitIgnoreSpec:
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(patterns)


def discover(paths: list[Path], settings: Settings, force_exclude: bool = False) -> Iterator[Path]:
    """Files to check, each once. Exclude patterns are anchored at the project root (the
    folder of the configuration that declares them). A path named explicitly is checked even
    when excluded, unless `force_exclude`."""
    root = os.path.realpath(settings.root)
    seen: set[Path] = set()
    for path in paths:
        if force_exclude and is_excluded(path, settings):
            continue
        if not path.is_dir():
            if path not in seen:
                seen.add(path)
                yield path
            continue
        excluded = _excluded((*settings.exclude, *settings.extend_exclude))
        for found in _walk(path, excluded, root, settings.respect_gitignore):
            if found not in seen:
                seen.add(found)
                yield found


def is_excluded(path: Path, settings: Settings) -> bool:
    """Whether the settings exclude `path` or one of its folders (what `--force-exclude`
    asks of a path named on the command line)."""
    real, root = os.path.realpath(path), os.path.realpath(settings.root)
    excluded = _excluded((*settings.exclude, *settings.extend_exclude))
    return excluded.named(_anchored(real, root, os.fspath(path)))


@lru_cache(maxsize=4)
def _excluded(patterns: tuple[str, ...]) -> Excluded:
    return Excluded.of(list(patterns))


def _anchored(real: str, root: str, otherwise: str) -> str:
    """`real` relative to `root` with `/`, or `otherwise` when it is outside the root
    ("" for the root itself)."""
    relative = os.path.relpath(real, root)
    if relative == ".." or relative.startswith(".." + os.sep):
        relative = os.path.normpath(otherwise) if otherwise else "."
    return "" if relative == "." else relative.replace(os.sep, "/")


def _walk(top: Path, excluded: Excluded, root: str, gitignored: bool = True) -> Iterator[Path]:
    """Python files under `top`, in a stable order; symbolic links are not followed, and
    only regular files are listed. A directory that cannot be listed is yielded itself, so
    that reading it reports the error instead of its files being skipped in silence.
    Paths are handled as strings: pathlib costs more than the walk on a large tree."""
    resolved = os.fspath(top.resolve())
    anchor = _anchored(resolved, root, "")
    ignores = (
        [(os.fspath(base), spec) for base, spec in _parent_gitignores(top.resolve())]
        if gitignored
        else []
    )
    unlisted: list[OSError] = []
    for directory, dirnames, filenames in os.walk(top, onerror=unlisted.append):
        walked = os.path.relpath(directory, top)
        real = resolved if walked == "." else os.path.join(resolved, walked)
        relative = anchor if walked == "." else os.path.join(anchor, walked)
        prefix = relative.replace(os.sep, "/") + "/" if relative else ""
        gitignore = os.path.join(directory, ".gitignore")
        if gitignored and ".gitignore" in filenames and os.path.isfile(gitignore):
            ignores.append((real, _read_gitignore(Path(gitignore))))
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not os.path.islink(os.path.join(directory, d))
            and not _ignored(prefix + d, os.path.join(real, d), True, excluded, ignores)
        )
        for name in sorted(filenames):
            file = os.path.join(directory, name)
            if (
                name.endswith(SUFFIXES)
                and _is_regular(file)
                and not _ignored(prefix + name, os.path.join(real, name), False, excluded, ignores)
            ):
                yield Path(file)
    for error in unlisted:
        yield Path(error.filename)


def _is_regular(path: str) -> bool:
    """A plain file, not a link, pipe, socket or device (reading a pipe would block)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _ignored(relative: str, absolute: str, is_dir: bool, excluded, ignores) -> bool:
    """Whether an entry (`relative` to the project root, with `/`; `absolute`, its real
    path) is excluded by the settings or a .gitignore (given by its folder)."""
    suffix = "/" if is_dir else ""
    if excluded.match(relative, os.path.basename(absolute), suffix):
        return True
    for base, spec in ignores:
        under = os.path.relpath(absolute, base).replace(os.sep, "/")
        if under != ".." and not under.startswith("../") and spec.match_file(under + suffix):
            return True
    return False


def _parent_gitignores(top: Path) -> list[tuple[Path, pathspec.GitIgnoreSpec]]:
    """.gitignore files above `top` (resolved), up to the repository root."""
    found = []
    if (top / ".git").exists():
        return found
    for directory in top.parents:
        gitignore = directory / ".gitignore"
        if gitignore.is_file():
            found.append((directory, _read_gitignore(gitignore)))
        if (directory / ".git").exists():
            break
    return found


def _read_gitignore(path: Path) -> pathspec.GitIgnoreSpec:
    try:
        return _spec(path.read_text(encoding="utf-8", errors="replace").splitlines())
    except OSError:
        return _spec([])
