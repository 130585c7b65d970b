"""Which files to check: walk the given paths, honouring excludes and .gitignore files."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from gaaudit.config import Settings

if TYPE_CHECKING:  # imported when a folder is walked: files named alone need no patterns
    import pathspec

SUFFIXES = (".py", ".ipynb")


def _spec(patterns) -> pathspec.GitIgnoreSpec:
    import pathspec

    return pathspec.GitIgnoreSpec.from_lines(patterns)


def discover(paths: list[Path], settings: Settings) -> Iterator[Path]:
    """Files to check, each once. A file named explicitly is always checked."""
    excluded = None
    seen: set[Path] = set()
    for path in paths:
        if not path.is_dir():
            if path not in seen:
                seen.add(path)
                yield path
            continue
        excluded = excluded or _spec([*settings.exclude, *settings.extend_exclude])
        for found in _walk(path, excluded, settings.root):
            if found not in seen:
                seen.add(found)
                yield found


def _walk(top: Path, excluded: pathspec.GitIgnoreSpec, root: Path) -> Iterator[Path]:
    """Python files under `top`, in a stable order; symbolic links are not followed, and
    only regular files are listed. A directory that cannot be listed is yielded itself, so
    that reading it reports the error instead of its files being skipped in silence."""
    resolved = top.resolve()
    ignores = _parent_gitignores(resolved)
    unlisted: list[OSError] = []
    for directory, dirnames, filenames in os.walk(top, onerror=unlisted.append):
        here = Path(directory)
        gitignore = here / ".gitignore"
        if gitignore.is_file():
            ignores.append((resolved / here.relative_to(top), _read_gitignore(gitignore)))
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not (here / d).is_symlink() and not _ignored(here / d, True, excluded, ignores, top)
        )
        for name in sorted(filenames):
            file = here / name
            if (
                name.endswith(SUFFIXES)
                and _is_regular(file)
                and not _ignored(file, False, excluded, ignores, top)
            ):
                yield file
    for error in unlisted:
        yield Path(error.filename)


def _is_regular(path: Path) -> bool:
    """A plain file, not a link, pipe, socket or device (reading a pipe would block)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _ignored(path: Path, is_dir: bool, excluded, ignores, top: Path) -> bool:
    suffix = "/" if is_dir else ""
    relative = path.relative_to(top)
    if excluded.match_file(relative.as_posix() + suffix) or excluded.match_file(path.name + suffix):
        return True
    if not ignores:  # no .gitignore: spare resolving `top` for every file
        return False
    absolute = top.resolve() / relative
    for base, spec in ignores:
        try:
            if spec.match_file(absolute.relative_to(base).as_posix() + suffix):
                return True
        except ValueError:
            continue
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
